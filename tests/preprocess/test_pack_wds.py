"""pack-shards from existing WebDataset tars: real ``webdataset.TarWriter`` tars and hostile hand-made ones."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from preprocess.pack.append import append_shards
from preprocess.pack.cli import pack_shards_command
from preprocess.pack.sources.members import SourceFields
from preprocess.pack.packer import PackConfig, pack_manifest
from shards.transport.listing import expand_braces
from preprocess.pack.sources.scan import scan_source
from shards.check.verify import verify_dataset
from shards.errors import InputError
from shards.formats.tar import iter_tar_shard
from tests.helpers import class_image

wds = pytest.importorskip("webdataset")
CLASSES = ["cat", "dog"]


def write_wds(folder: Path, tars: int = 3, per_tar: int = 4) -> str:
    """``tars`` tars of ``per_tar`` samples, each with jpg, cls (an int), txt and a json holding the class name."""
    folder.mkdir(parents=True, exist_ok=True)
    for t in range(tars):
        with wds.TarWriter(str(folder / f"shard-{t:03d}.tar")) as writer:
            for i in range(per_tar):
                writer.write({"__key__": f"s{t}_{i:04d}", "jpg": class_image(i % 2, t * 100 + i, size=(16, 12)),
                              "cls": i % 2, "txt": f"caption {t} {i}", "json": {"label": CLASSES[i % 2], "n": i}})
    return str(folder / f"shard-{{000..{tars - 1:03d}}}.tar")


def pack(source, out, **options):
    return pack_manifest(PackConfig(source=str(source), out=str(out), quiet=True, **options))


def members_of(shard: Path) -> dict[str, dict[str, bytes]]:
    """Every member of a tar shard by key and extension (read with tarfile: our own output, trusted here)."""
    found: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as archive:
        for info in archive.getmembers():
            key, _, ext = info.name.partition(".")
            found.setdefault(key, {})[ext] = archive.extractfile(info).read()
    return found


def all_members(out: Path) -> dict[str, dict[str, bytes]]:
    found = {}
    for split in json.loads((out / "dataset.json").read_text())["splits"].values():
        for shard in split["shards"]:
            found.update(members_of(out / shard["path"]))
    return found


def hostile_tar(path: Path, members: list[tuple[str, bytes | None, str | None]]) -> None:
    """A tar of ``(name, data, link target)`` members (a link when the target is given)."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data, target in members:
            info = tarfile.TarInfo(name)
            if target is not None:
                info.type, info.linkname = tarfile.SYMTYPE, target
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


def test_brace_expansion_is_ours_not_a_shell():
    assert expand_braces("d/s-{08..11}.tar") == ["d/s-08.tar", "d/s-09.tar", "d/s-10.tar", "d/s-11.tar"]
    assert expand_braces("{a,b}/x-{1..2}.tar") == ["a/x-1.tar", "a/x-2.tar", "b/x-1.tar", "b/x-2.tar"]
    with pytest.raises(InputError, match="neither a range"):
        expand_braces("s-{x}.tar")


def test_resharded_with_keys_labels_and_every_member_kept(tmp_path):
    pattern = write_wds(tmp_path / "in")
    manifest = pack(pattern, tmp_path / "out", max_samples=5, source_fields=SourceFields(label_member="cls"))
    assert manifest.classes == ("0", "1") and manifest.source.kind == "webdataset"
    assert manifest.splits["train"].samples == 12 and len(manifest.splits["train"].shards) == 3
    found = all_members(tmp_path / "out")
    assert sorted(found) == sorted(f"s{t}_{i:04d}" for t in range(3) for i in range(4))  # keys kept
    sample = found["s1_0003"]
    assert sample["jpg"] == class_image(1, 103, size=(16, 12))
    assert sample["txt"] == b"caption 1 3"
    assert json.loads(sample["source.json"]) == {"label": "dog", "n": 3}  # its own json, beside ours
    assert sample["source.cls"] == b"1" and sample["cls"] == b"1"
    assert json.loads(sample["json"])["path"] == "shard-001.tar#s1_0003"
    # Our reader, the stream and verify see our image, label and metadata; sidecar indexes and checksums hold.
    raws = [raw for shard in manifest.splits["train"].shards for raw in iter_tar_shard(tmp_path / "out" / shard.path)]
    assert {raw.key: raw.label for raw in raws}["s1_0003"] == 1
    assert verify_dataset(tmp_path / "out", full=True, quiet=True).problems == ()


def test_label_field_of_the_json_member_and_determinism(tmp_path):
    pattern = write_wds(tmp_path / "in")
    fields = SourceFields(label_field="label")
    one = pack(pattern, tmp_path / "one", max_samples=4, seed=3, source_fields=fields)
    two = pack(pattern, tmp_path / "two", max_samples=4, seed=3, source_fields=fields, workers=2)
    assert one.classes == ("cat", "dog")
    assert [s.sha256 for s in one.splits["train"].shards] == [s.sha256 for s in two.splits["train"].shards]
    labels = {raw.key: raw.label for s in one.splits["train"].shards
              for raw in iter_tar_shard(tmp_path / "one" / s.path)}
    assert all(labels[f"s{t}_{i:04d}"] == i % 2 for t in range(3) for i in range(4))


@pytest.mark.parametrize("past_half", [0, 100])  # cut at a header, or inside a member's data
def test_truncated_tar_keeps_the_samples_before_the_damage(tmp_path, past_half):
    pattern = write_wds(tmp_path / "in", tars=2)
    cut = tmp_path / "in" / "shard-001.tar"
    data = cut.read_bytes()
    cut.write_bytes(data[:len(data) // 2 // 512 * 512 + past_half])
    scan = scan_source(pattern)
    kept = {s.key for s in scan.samples}
    assert {f"s0_{i:04d}" for i in range(4)} <= kept and 0 < len(kept - {f"s0_{i:04d}" for i in range(4)}) < 4
    assert [s.rel_path for s in scan.skipped] == ["shard-001.tar"]
    assert scan.skipped[0].reason.startswith("damaged tar, the rest of it skipped (")
    result = CliRunner().invoke(pack_shards_command, [pattern, "-o", str(tmp_path / "strict"), "--strict"])
    assert result.exit_code == 1 and "damaged tar" in result.stderr
    assert not (tmp_path / "strict" / "dataset.json").exists()


def test_links_dot_dot_names_missing_labels_and_duplicate_keys_are_skipped(tmp_path):
    image = class_image(0, 0, size=(8, 8))
    hostile_tar(tmp_path / "a.tar", [
        ("good.jpg", image, None), ("good.cls", b"0", None),
        ("linked.jpg", None, "/etc/passwd"), ("linked.cls", b"0", None),
        ("../escape.jpg", image, None), ("../escape.cls", b"1", None),
        ("nolabel.jpg", image, None), ("nolabel.txt", b"hi", None),
        ("emptylabel.jpg", image, None), ("emptylabel.cls", b" ", None),
    ])
    hostile_tar(tmp_path / "b.tar", [("good.jpg", image, None), ("good.cls", b"1", None),
                                     ("other.png", class_image(1, 1, size=(8, 8), fmt="PNG"), None),
                                     ("other.cls", b"1", None)])
    manifest = pack(str(tmp_path / "{a,b}.tar"), tmp_path / "out")
    reasons = {s.path: s.reason for s in manifest.source.skipped}
    assert reasons == {
        "a.tar#linked": "no image member (found: cls)",  # the link was passed over, never followed
        "a.tar#../escape": "bad key '../escape' (keys are ASCII letters, digits, _ and -, parts joined by /)",
        "a.tar#nolabel": "no .cls member (its label)",
        "a.tar#emptylabel": "empty .cls member (its label)",
        "b.tar#good": "duplicate key (first in a.tar)",
    }
    assert sorted(all_members(tmp_path / "out")) == ["good", "other"]
    assert manifest.classes == ("0", "1")


def test_members_that_would_be_kept_under_one_name_skip_their_sample(tmp_path):
    """The source's own .json is kept as .source.json: beside a .source.json member the shard would hold that name
    twice, which webdataset refuses to read. Names that differ only in case count as one."""
    image = class_image(0, 0, size=(8, 8))
    hostile_tar(tmp_path / "a.tar", [
        ("two.jpg", image, None), ("two.cls", b"0", None), ("two.json", b"{}", None),
        ("two.source.json", b"{}", None),
        ("pngs.jpg", image, None), ("pngs.cls", b"0", None), ("pngs.png", image, None),
        ("pngs.source.PNG", image, None),
        ("fine.jpg", image, None), ("fine.cls", b"1", None), ("fine.json", b"{}", None), ("fine.png", image, None),
    ])
    manifest = pack(str(tmp_path / "a.tar"), tmp_path / "out")
    assert {s.path: s.reason for s in manifest.source.skipped} == {
        "a.tar#two": "members .json and .source.json would both be kept as .source.json (a tar that holds a name "
                     "twice is refused by its readers)",
        "a.tar#pngs": "members .png and .source.PNG would both be kept as .source.PNG (a tar that holds a name "
                      "twice is refused by its readers)"}
    kept = all_members(tmp_path / "out")
    assert sorted(kept) == ["fine"] and {"source.json", "source.png"} <= set(kept["fine"])
    assert len(list(wds.WebDataset(str(next((tmp_path / "out").glob("*.tar"))), shardshuffle=False))) == 1


def test_hdf5_output_keeps_image_and_label_and_says_so(tmp_path, caplog):
    pattern = write_wds(tmp_path / "in", tars=1)
    manifest = pack(pattern, tmp_path / "out", storage="hdf5")
    assert manifest.splits["train"].samples == 4
    assert any("keeps each sample's image and label only" in r.getMessage() for r in caplog.records)


def test_missing_tar_and_wrong_options_exit_2(tmp_path):
    pattern = write_wds(tmp_path / "in", tars=2)
    missing = pattern.replace("001", "002")
    result = CliRunner().invoke(pack_shards_command, [missing, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "shard-002.tar: no such tar file" in result.stderr
    result = CliRunner().invoke(pack_shards_command, [pattern, "-o", str(tmp_path / "out"), "--label-member", "cls",
                                                      "--label-field", "label"])
    assert result.exit_code == 2 and "not both" in result.stderr
    os.mkfifo(tmp_path / "in" / "shard-002.tar")  # opening it to read would block
    result = CliRunner().invoke(pack_shards_command, [missing, "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "shard-002.tar: not a regular file (FIFO)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_append_packs_the_samples_of_new_tars_and_keeps_their_members(tmp_path):
    write_wds(tmp_path / "in", tars=3)
    first = pack(str(tmp_path / "in" / "shard-{000..001}.tar"), tmp_path / "out")
    assert first.splits["train"].samples == 8
    grown = append_shards(PackConfig(source=str(tmp_path / "in" / "shard-{000..002}.tar"), out=str(tmp_path / "out"),
                                     quiet=True))
    assert grown.splits["train"].samples == 12
    new = [s for s in grown.splits["train"].shards if s not in first.splits["train"].shards]
    found = {}
    for shard in new:
        found.update(members_of(tmp_path / "out" / shard.path))
    assert sorted(found) == [f"s2_{i:04d}" for i in range(4)]
    assert found["s2_0001"]["txt"] == b"caption 2 1"


def test_append_never_packs_a_key_twice(tmp_path):
    write_wds(tmp_path / "in", tars=2)
    first = pack(str(tmp_path / "in" / "shard-000.tar"), tmp_path / "out")
    (tmp_path / "in" / "copy.tar").write_bytes((tmp_path / "in" / "shard-000.tar").read_bytes())
    # The scan refuses a key seen twice in the tars it reads; the append, one the dataset already holds.
    grown = append_shards(PackConfig(source=str(tmp_path / "in" / "{copy,shard-001}.tar"),
                                     out=str(tmp_path / "out"), quiet=True))
    assert grown.splits["train"].samples == first.splits["train"].samples + 4  # shard-001's samples only
    reasons = {s.path: s.reason for s in grown.source.skipped}
    assert reasons["copy.tar#s0_0002"] == "duplicate key (already packed from shard-000.tar#s0_0002)"
