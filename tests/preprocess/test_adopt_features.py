"""``precompute-features --source`` on an index of WebDataset tars adopted in place: one feature file per tar,
sample for sample the index's rows (its rejects left out), checked against the tars by the feature verifier."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import shards
from preprocess.adopt.index import index_tars
from preprocess.features.cli import precompute_features_command
from shards.check.features_verify import verify_feature_folder
from shards.formats.features import load_feature_shard
from shards.manifest import load_feature_manifest
from tests.helpers import class_image
from tests.preprocess.test_adopt import make_source, stream, wds

SMALL = ["--backbone", "resnet18", "--weights", "none", "--resize", "40", "--crop", "32", "--batch-size", "4",
         "--workers", "0", "-q"]


@pytest.fixture()
def adopted(tmp_path):
    src = make_source(tmp_path)
    index_tars(str(src), str(tmp_path / "index"), label_member="cls", val_shards=("c-002.tar",), quiet=True)
    return src, tmp_path / "index"


def _run(*args: str):
    return CliRunner().invoke(precompute_features_command, [*args, *SMALL])


def _assert_aligned(index: Path, src: Path, feat: Path, tars: dict[str, list[str]]) -> None:
    """Each split's feature files are its tars' in manifest order, named by place; their keys and labels, file after
    file, are what the index streams from the tars."""
    manifest = load_feature_manifest(feat)
    for split, names in tars.items():
        infos = manifest.splits[split].shards
        assert [info.source for info in infos] == names
        assert [info.path for info in infos] == [f"{split}-{i:06d}.pt" for i in range(len(names))]
        keys, labels = [], []
        for info in infos:
            shard = load_feature_shard(feat / info.path)
            assert shard.features.shape == (len(shard.keys), 512) and len(shard.keys) == info.samples
            keys += shard.keys
            labels += shard.labels.tolist()
        rows = stream(index, src, split, sampling=shards.Sampling(shuffle=False))
        assert keys == [key for key, _, _ in rows] and labels == [label for _, _, label in rows]


@pytest.mark.slow
def test_features_hold_the_index_rows_in_order_and_verify_against_the_tars(adopted, tmp_path):
    src, index = adopted
    feat = tmp_path / "feat"
    result = _run(str(index), "--source", str(src), "--out", str(feat))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["complete"] is True and summary["shards_total"] == 3 and summary["images"] == 12
    manifest = load_feature_manifest(feat)
    assert manifest.extra["provenance"]["source"] == str(src.resolve())
    _assert_aligned(index, src, feat, {"train": ["a-000.tar", "part/b-001.tar"], "val": ["c-002.tar"]})
    all_keys = {key for split in manifest.splits.values() for info in split.shards
                for key in load_feature_shard(feat / info.path).keys}
    assert len(all_keys) == 12 and not all_keys & {"g900", "g901", "c002"}  # the index's rejects
    assert verify_feature_folder(feat, full=True, source=str(src)) == []
    rerun = _run(str(index), "--source", str(src), "--out", str(feat))
    assert rerun.exit_code == 0 and json.loads(rerun.stdout.strip().splitlines()[-1])["shards_skipped"] == 3
    without = verify_feature_folder(feat, full=True)
    assert len(without) == 1 and "give --source" in without[0]
    (src / "part" / "b-001.tar").rename(src / "part" / "moved.tar")
    problems = verify_feature_folder(feat, full=True, source=str(src))
    assert len(problems) == 1 and "train-000001.pt" in problems[0] and "b-001.tar missing" in problems[0]


@pytest.mark.slow
def test_a_grown_index_featurises_only_its_new_tar_and_a_rebuilt_one_what_moved(adopted, tmp_path):
    src, index = adopted
    feat = tmp_path / "feat"
    assert _run(str(index), "--source", str(src), "--out", str(feat)).exit_code == 0
    with wds.TarWriter(str(src / "b-000.tar")) as writer:  # sorts between a-000.tar and part/b-001.tar
        for i in range(3):
            writer.write({"__key__": f"n{i:03d}", "jpg": class_image(i % 2, 300 + i, size=(12, 10)),
                          "cls": (2, 10)[i % 2]})
    for rebuilt, order, done in ((False, ["a-000.tar", "part/b-001.tar", "b-000.tar"], 1),  # appended
                                 (True, ["a-000.tar", "b-000.tar", "part/b-001.tar"], 2)):  # part/b-001.tar moved
        if rebuilt:
            shutil.rmtree(index)
        index_tars(str(src), str(index), label_member="cls", val_shards=("c-002.tar",), quiet=True)
        result = _run(str(index), "--source", str(src), "--out", str(feat))
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert (summary["shards_done"], summary["shards_skipped"]) == (done, 4 - done)
        _assert_aligned(index, src, feat, {"train": order, "val": ["c-002.tar"]})
        assert verify_feature_folder(feat, full=True, source=str(src)) == []


@pytest.mark.slow
@pytest.mark.parametrize("ranges", [True, False])
def test_tars_served_over_http_give_the_features_of_the_local_tars(adopted, tmp_path, ranges):
    import threading
    from http.server import ThreadingHTTPServer

    from tests.s3.test_parallel_ranges import _Files

    src, index = adopted
    files = {f"/{p.relative_to(src).as_posix()}": p.read_bytes() for p in src.rglob("*.tar")}
    handler = type("Handler", (_Files,), {"files": files, "ranges": ranges, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = _run(str(index), "--source", url, "--out", str(tmp_path / "http"))
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 0, result.output
    assert {path for path, _ in handler.seen} == set(files)  # every tar read from the server
    assert _run(str(index), "--source", str(src), "--out", str(tmp_path / "local")).exit_code == 0
    remote, local = load_feature_manifest(tmp_path / "http"), load_feature_manifest(tmp_path / "local")
    assert remote.splits == local.splits and remote.extra["provenance"]["source"] == url
    for split in local.splits.values():
        for info in split.shards:
            one = load_feature_shard(tmp_path / "http" / info.path)
            two = load_feature_shard(tmp_path / "local" / info.path)
            assert one.keys == two.keys and one.features.equal(two.features)


def test_an_index_without_source_or_writing_into_it_is_one_line_and_writes_nothing(adopted, tmp_path):
    src, index = adopted
    result = _run(str(index), "--out", str(tmp_path / "feat"))
    assert result.exit_code == 2 and "give --source" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "feat").exists()
    into = _run(str(index), "--source", str(src), "--out", str(src))
    assert into.exit_code == 2 and "--out must differ from the --source folder" in into.output
    assert not (src / ".precompute").exists()
