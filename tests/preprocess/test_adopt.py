"""``shards index``: WebDataset tars adopted in place stream exactly what webdataset reads from them (minus the
samples the index lists as refused), resume exactly, grow incrementally, and are never written."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

import shards
from preprocess.adopt.cli import index_command
from preprocess.adopt.index import index_tars
from preprocess.pack.sources.members import SourceFields
from shards.cli.main import main as shards_main
from shards.check.verify import verify_dataset
from shards.errors import ChecksumError, InputError, MissingInputError
from shards.loader.loader import workers_mode
from tests.helpers import class_image

wds = pytest.importorskip("webdataset")


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def make_source(root: Path) -> Path:
    """Three tars: one by ``webdataset.TarWriter``; one by GNU tar with members in odd orders, extra members and
    broken samples (no image, no label, one extension twice); one truncated inside its third sample."""
    src = root / "src"
    (src / "part").mkdir(parents=True)
    with wds.TarWriter(str(src / "a-000.tar")) as writer:
        for i in range(5):
            writer.write({"__key__": f"a{i:03d}", "jpg": class_image(i % 2, i, size=(12, 10)),
                          "cls": (2, 10)[i % 2], "txt": f"caption {i}", "json": {"label": "x", "n": i}})
    staging = root / "gnu"
    staging.mkdir()
    names = []

    def put(name: str, data: bytes) -> None:
        (staging / name).write_bytes(data)
        names.append(name)

    for i in range(4):  # odd order: json, cls, image, txt; the last sample's image first
        key = f"g{i:03d}"
        if i == 3:
            put(f"{key}.png", class_image(1, 50 + i, size=(10, 12), fmt="PNG"))
        put(f"{key}.json", _json({"n": 100 + i, "w": 0.5 * i}))
        put(f"{key}.cls", b"10" if i % 2 else b"2")
        if i != 3:
            put(f"{key}.jpg", class_image(i % 2, 50 + i, size=(12, 10)))
        put(f"{key}.txt", f"gnu {i}".encode())
    put("g900.cls", b"2")  # no image
    put("g900.txt", b"orphan")
    put("g901.jpg", class_image(0, 901, size=(8, 8)))  # no label
    put("g004.jpg", class_image(0, 4, size=(12, 10)))
    put("g004.cls", b"2")
    subprocess.run(["tar", "--format=gnu", "-cf", str(src / "part" / "b-001.tar"), "-C", str(staging), *names],
                   check=True)
    with wds.TarWriter(str(root / "whole.tar")) as writer:
        for i in range(4):
            writer.write({"__key__": f"c{i:03d}", "jpg": class_image(i % 2, 200 + i, size=(12, 10)),
                          "cls": (2, 10)[i % 2]})
    data = (root / "whole.tar").read_bytes()
    third = data.index(b"c002.jpg")
    (src / "c-002.tar").write_bytes(data[:third + 700])  # cut inside c002's image
    return src


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def raw(sample, seed):
    return sample.data


def stream(index: Path, src: Path, split: str = "train", **options):
    dataset = shards.open_dataset(index, split, remote=shards.Remote(base_url=str(src)), return_keys=True,
                                  decode=shards.Decode(decoder=raw), **options)
    return [(key, bytes(data), int(label)) for data, label, key in dataset]


def webdataset_reads(src: Path) -> dict[str, bytes]:
    urls = [str(p) for p in sorted(src.rglob("*.tar"))]
    found = {}
    for sample in wds.WebDataset(urls, shardshuffle=False, handler=wds.ignore_and_continue, empty_check=False):
        image = next((sample[e] for e in ("jpg", "png") if e in sample), None)
        if image is not None:
            found[sample["__key__"]] = image
    return found


@pytest.fixture()
def adopted(tmp_path):
    src = make_source(tmp_path)
    before = snapshot(src)
    report = index_tars(str(src), str(tmp_path / "index"), label_member="cls", quiet=True)
    return src, tmp_path / "index", report, before


def test_index_streams_what_webdataset_reads_minus_the_listed_rejects(adopted):
    src, index, report, before = adopted
    manifest = json.loads((index / "dataset.json").read_text())
    assert manifest["storage"] == "wds" and manifest["classes"] == ["10", "2"]  # sorted as pack-shards sorts
    assert [s["path"] for s in manifest["splits"]["train"]["shards"]] == ["a-000.tar", "c-002.tar", "part/b-001.tar"]
    skipped = {s["path"]: s["reason"] for s in manifest["source"]["skipped"]}
    assert "no image member" in skipped["part/b-001.tar#g900"]
    assert "no .cls member" in skipped["part/b-001.tar#g901"]
    assert "damaged tar" in skipped["c-002.tar"]
    assert report.to_dict()["samples"] == {"train": 5 + 5 + 2} and report.rejected == 3
    got = stream(index, src, sampling=shards.Sampling(shuffle=False))
    theirs = webdataset_reads(src)
    ours = {key: data for key, data, _ in got}
    assert len(ours) == len(got) == 12
    assert all(theirs[key] == data for key, data in ours.items())  # the same bytes, sample by sample
    left_out = set(theirs) - set(ours)
    assert left_out <= {"g900", "g901", "c002"}  # listed by key, or in the tar listed as damaged
    assert {key: label for key, _, label in got}["a001"] == 0 and {k: l for k, _, l in got}["g000"] == 1
    assert snapshot(src) == before  # no source byte or mtime changed, no file added
    assert not any(p.name.endswith(".rows") for p in src.rglob("*"))


def test_label_field_of_the_json_member_and_seeded_val_fraction(tmp_path):
    src = make_source(tmp_path)
    report = index_tars(str(src), str(tmp_path / "i1"), label_field="n", val_fraction=0.5, seed=4, quiet=True)
    again = index_tars(str(src), str(tmp_path / "i2"), label_field="n", val_fraction=0.5, seed=4, quiet=True)
    one = json.loads((tmp_path / "i1" / "dataset.json").read_text())
    two = json.loads((tmp_path / "i2" / "dataset.json").read_text())
    assert one["splits"] == two["splits"] and report.samples == again.samples
    assert sorted(one["classes"]) == one["classes"] and "100" in one["classes"]
    assert sum(report.samples.values()) == 9  # c-002's samples have no .json member: refused


def test_resume_mid_epoch_exactly_and_on_another_worker_count(adopted):
    src, index, _, _ = adopted

    def loader(workers):
        dataset = shards.open_dataset(index, remote=shards.Remote(base_url=str(src)), return_keys=True, seed=5,
                                      decode=shards.Decode(decoder=lambda sample, seed: 0),
                                      sampling=shards.Sampling(shuffle_buffer=4))
        return shards.make_loader(dataset, batch_size=2, mode=workers_mode(workers, persistent=False, run="threads")
                                  if workers else workers_mode(0))

    whole = [k for batch in loader(2) for k in batch[2]]
    first = loader(2)
    iterator = iter(first)
    head = [k for _ in range(2) for k in next(iterator)[2]]
    state = first.state_dict()
    del iterator
    same = loader(2)
    same.load_state_dict(state)
    assert head + [k for batch in same for k in batch[2]] == whole
    other = loader(3)
    other.load_state_dict(state)
    rest = [k for batch in other for k in batch[2]]
    assert sorted(head + rest) == sorted(whole) and len(set(rest)) == len(rest)


def test_incremental_indexes_only_new_tars_and_refuses_a_changed_one(adopted, tmp_path):
    src, index, _, _ = adopted
    first = json.loads((index / "dataset.json").read_text())
    with wds.TarWriter(str(src / "d-003.tar")) as writer:
        for i in range(3):
            writer.write({"__key__": f"d{i:03d}", "jpg": class_image(i % 2, 300 + i, size=(12, 10)),
                          "cls": (2, 10)[i % 2], "json": {"n": i}})
    report = index_tars(str(src), str(index), label_member="cls", quiet=True)
    assert report.indexed == ("d-003.tar",) and report.kept == 3 and report.samples == {"train": 15}
    grown = json.loads((index / "dataset.json").read_text())
    assert grown["splits"]["train"]["shards"][:3] == first["splits"]["train"]["shards"]
    assert not (index / first["source_index"]["path"]).exists()  # superseded, removed after the commit
    assert {k for k, _, _ in stream(index, src)} >= {"d000", "d001", "d002", "a000"}
    def subset(where):
        dataset = shards.open_dataset(shards.SourceSpec(str(index), subset=shards.Subset(where=where)),
                                      remote=shards.Remote(base_url=str(src)), return_keys=True,
                                      decode=shards.Decode(decoder=raw), sampling=shards.Sampling(shuffle=False))
        return [key for _, _, key in dataset]

    assert subset("key >= 'd' and key < 'e' and n >= 1") == ["d001", "d002"]  # a .json member's field
    assert subset("class == '2'") == ["a000", "a002", "a004", "c000", "g000", "g002", "g004", "d000", "d002"]
    os.utime(src / "a-000.tar", ns=(5, 5))  # touched, same bytes: rehashed once, recorded
    touched = index_tars(str(src), str(index), label_member="cls", quiet=True)
    assert touched.indexed == () and touched.samples == {"train": 15}
    assert json.loads((index / "dataset.json").read_text())["adoption"]["tars"]["a-000.tar"]["mtime_ns"] == 5
    committed = (index / "dataset.json").read_bytes()
    nothing = index_tars(str(src), str(index), label_member="cls", quiet=True)
    assert nothing.indexed == () and nothing.samples == {"train": 15}
    assert (index / "dataset.json").read_bytes() == committed  # nothing new: nothing written
    data = bytearray((src / "a-000.tar").read_bytes())
    data[600] ^= 1
    (src / "a-000.tar").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="a-000.tar.*changed since it was indexed"):
        index_tars(str(src), str(index), label_member="cls", quiet=True)
    with pytest.raises(InputError, match="label_member"):
        index_tars(str(src), str(index), label_member="txt", quiet=True)


def test_cli_prints_one_json_line_and_refuses_a_changed_tar_in_one_line(tmp_path):
    src = make_source(tmp_path)
    runner = CliRunner()
    result = runner.invoke(shards_main, ["index", str(src), "--out", str(tmp_path / "idx"), "--label-member", "cls",
                                         "--quiet"])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip())
    assert line["tars_indexed"] == 3 and line["samples"] == {"train": 12} and line["source_base"] == str(src)
    os.utime(src / "a-000.tar", ns=(1, 1))
    (src / "a-000.tar").write_bytes((src / "a-000.tar").read_bytes()[:-1024])
    result = runner.invoke(index_command, [str(src), "--out", str(tmp_path / "idx"), "--label-member", "cls", "-q"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "a-000.tar" in result.stderr


def test_index_inside_the_source_or_over_a_packed_dataset_is_refused(tmp_path):
    src = make_source(tmp_path)
    with pytest.raises(InputError, match="inside the source folder"):
        index_tars(str(src), str(src / "index"), quiet=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "dataset.json").write_text(json.dumps({
        "format": "shardcache.dataset", "version": 1, "storage": "tar", "classes": [], "splits": {},
        "source": {"kind": "imagefolder", "root": "x", "files_seen": 0}, "packing": {}}))
    with pytest.raises(InputError, match="not an adopted index"):
        index_tars(str(src), str(other), quiet=True)


def test_verify_checks_the_tars_against_the_index_with_source(adopted):
    src, index, _, _ = adopted
    with pytest.raises(InputError, match="give --source"):
        verify_dataset(str(index), quiet=True)
    report = verify_dataset(str(index), source=str(src), full=True, quiet=True)
    assert report.ok, report.problems
    assert report.samples_read == 12 and report.samples_decoded == 12
    result = CliRunner().invoke(shards_main, ["verify", str(index), "--source", str(src), "--workers", "1", "-q"])
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True
    data = bytearray((src / "part" / "b-001.tar").read_bytes())
    data[2000] ^= 0xFF
    (src / "part" / "b-001.tar").write_bytes(bytes(data))
    (index / "a-000.tar.rows").write_bytes(b"x")
    problems = "\n".join(verify_dataset(str(index), source=str(src), quiet=True).problems)
    assert "part/b-001.tar: sha256" in problems and "a-000.tar.rows: bad row index" in problems


def test_a_tampered_row_index_or_a_missing_source_is_one_error_naming_the_file(adopted):
    src, index, _, _ = adopted
    rows = index / "part" / "b-001.tar.rows"
    data = bytearray(rows.read_bytes())
    data[-8] ^= 1  # a label changed: the recorded sha256 no longer matches
    rows.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="b-001.tar.rows"):
        stream(index, src, sampling=shards.Sampling(shuffle=False))
    with pytest.raises(MissingInputError):
        stream(index, src.parent / "elsewhere")


@pytest.mark.slow
def test_train_from_shards_reads_the_tars_from_source_and_lineage_replays_it(tmp_path):
    from train.cli import train_command

    src = make_source(tmp_path)
    index_tars(str(src), str(tmp_path / "index"), label_member="cls", val_shards=("c-002.tar",), quiet=True)
    result = CliRunner().invoke(train_command, [
        str(tmp_path / "index"), "--source", str(src), "--out", str(tmp_path / "run"), "--epochs", "1",
        "--batch-size", "2", "--workers", "0", "--image-size", "32", "--model", "mobilenet_v3_small", "--no-report",
        "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 5
    lineage = CliRunner().invoke(shards_main, ["lineage", str(tmp_path / "run"), "--epoch", "1", "--step", "2", "-q"])
    assert lineage.exit_code == 0, lineage.output
    assert {s["shard"] for s in json.loads(lineage.stdout)["ranks"]["0"]["samples"]} <= {"a-000.tar",
                                                                                        "part/b-001.tar"}
    report = CliRunner().invoke(shards_main, ["report", str(tmp_path / "run"), "--out", str(tmp_path / "r.html"),
                                              "-q"])
    assert report.exit_code == 0 and "Could not read samples" not in (tmp_path / "r.html").read_text()


def test_mutated_row_indexes_and_tars_give_typed_errors_only(adopted, tmp_path):
    """An attacker who can write the tars and the index alike (checksums re-recorded): every read ends in samples or
    typed errors naming the file, never another exception or an unbounded read."""
    from shards.errors import CorruptDataError, ShardcacheError
    from shards.formats.adopted import checked_rows, iter_adopted_slice
    from shards.formats.sample import RawSample
    from shards.manifest import load_dataset_manifest

    src, index, _, _ = adopted
    info = next(s for s in load_dataset_manifest(index).splits["train"].shards if s.path == "part/b-001.tar")
    info = dataclasses.replace(info, index_sha256=None)
    rows_data, tar_data = (index / info.index).read_bytes(), (src / info.path).read_bytes()
    rng = random.Random(7)
    target = tmp_path / "mutated.tar"
    outcomes = set()
    for _ in range(60):
        rows, tar = bytearray(rows_data), bytearray(tar_data)
        for _ in range(rng.randint(1, 4)):
            buffer = rows if rng.random() < 0.5 else tar
            buffer[rng.randrange(len(buffer))] = rng.randrange(256)
        target.write_bytes(bytes(tar))
        try:
            table = checked_rows(bytes(rows), "mutated.rows", dataclasses.replace(info, bytes=len(tar)))
            items = list(iter_adopted_slice(target, 0, None, offsets=table, resync=True))
            assert len(items) == info.samples
            assert all(isinstance(item, (RawSample, CorruptDataError)) for item in items)
            outcomes.add("read")
        except ShardcacheError as exc:
            assert "mutated" in str(exc)
            outcomes.add("refused")
    assert outcomes == {"read", "refused"}


@pytest.mark.slow
@pytest.mark.parametrize("ranges", [True, False])
def test_adopted_tars_stream_over_http_by_ranges_or_as_one_stream(adopted, ranges):
    import threading
    from http.server import ThreadingHTTPServer

    from tests.s3.test_parallel_ranges import _Files

    src, index, _, _ = adopted
    local = stream(index, src, sampling=shards.Sampling(shuffle=False))
    files = {f"/{p.relative_to(src).as_posix()}": p.read_bytes() for p in src.rglob("*.tar")}
    handler = type("Handler", (_Files,), {"files": files, "ranges": ranges, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert stream(index, url, sampling=shards.Sampling(shuffle=False)) == local
        assert sorted(stream(index, url, sampling=shards.Sampling(shuffle=True))) == sorted(local)
    finally:
        server.shutdown()
        server.server_close()
    if ranges:  # only the bytes the rows span, never a tar's end-of-archive blocks
        assert all(wanted and int(wanted.rsplit("-", 1)[1]) < len(files[path]) - 1024 for path, wanted in handler.seen)
    else:  # one stream per read, from byte 0
        assert {wanted for _, wanted in handler.seen} == {None}


def test_an_index_mixes_with_a_packed_dataset_each_source_read_from_its_own_place(adopted, tmp_path):
    from preprocess.pack.packer import PackConfig, pack_manifest

    src, index, _, _ = adopted
    other = tmp_path / "other"
    other.mkdir()
    with wds.TarWriter(str(other / "p-000.tar")) as writer:
        for i in range(4):
            writer.write({"__key__": f"p{i:03d}", "jpg": class_image(i % 2, 400 + i, size=(12, 10)),
                          "cls": (2, 10)[i % 2]})
    pack_manifest(PackConfig(source=str(other / "p-000.tar"), out=str(tmp_path / "packed"), val_fraction=0.0,
                             quiet=True, source_fields=SourceFields(label_member="cls")))
    mixed = shards.open_dataset([shards.SourceSpec(str(index), source=str(src)), str(tmp_path / "packed")],
                                return_keys=True, decode=shards.Decode(decoder=raw),
                                sampling=shards.Sampling(shuffle=False))
    got = {key: (bytes(data), int(label)) for data, label, key in mixed}
    assert set(got) == {k for k, _, _ in stream(index, src)} | {"p000", "p001", "p002", "p003"}
    assert got["p001"][1] == 0 and got["a001"][1] == 0 and got["p000"][1] == 1  # "10" and "2" in both
    assert got["a002"] == next((d, l) for k, d, l in stream(index, src) if k == "a002")


def test_report_shows_samples_read_from_source(adopted, tmp_path):
    src, index, _, _ = adopted
    runner = CliRunner()
    without = runner.invoke(shards_main, ["report", str(index), "--out", str(tmp_path / "a.html"), "-q"])
    assert without.exit_code == 0 and "Could not read samples" in (tmp_path / "a.html").read_text()
    given = runner.invoke(shards_main, ["report", str(index), "--source", str(src), "--out", str(tmp_path / "b.html"),
                                        "-q"])
    html = (tmp_path / "b.html").read_text()
    assert given.exit_code == 0 and "Could not read samples" not in html and html.count("<img") >= 4
    assert snapshot(src) == adopted[3]
