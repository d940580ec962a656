"""The shape of every JSON field shardcache reads back: a manifest, a run folder's files, a part or plan of a pack,
an image list. JSON that parses can still hold ``"7"``, ``2.5``, ``true``, ``NaN`` or ``1e30`` where a count
belongs, or a list where an object belongs; ``int()`` and ``str()`` would accept most of them silently. Each is one
``ManifestError`` (or ``InputError``) line naming the file and the field's path, and exit code 2 from the commands.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from preprocess.pack.cli import pack_shards_command
from preprocess.pack.packer import PackConfig, pack, pack_manifest
from preprocess.pack.parts import STATE_DIR, load_part, part_path, read_plan_doc
from shards.cli.main import main as shards_cli
from shards.errors import InputError, ManifestError
from shards.manifest import load_dataset_manifest, load_feature_manifest
from tests.helpers import write_image_folder
from tests.train.conftest import write_feature_folder
from train.cli import train_command

# What a count must not be: a string, a float (even 2.0), a bool, null, NaN, infinities, beyond 2**53, containers,
# negative.
NOT_COUNTS = ["7", 2.5, 2.0, True, None, math.nan, math.inf, 1e30, 10**30, [], {}, -1]
NOT_STRINGS = [7, 2.5, True, None, math.nan, [], {}]
NOT_OBJECTS = ["x", 7, True, None, [], [{}]]
NOT_LISTS = ["x", 7, True, None, {}, {"a": 1}]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A real pack: 2 classes, a val split, several shards with class counts, a source skipped file."""
    root = tmp_path_factory.mktemp("packed")
    src = write_image_folder(root / "src", ["ant", "bee"], 6, size=(16, 16))
    (src / "ant" / "broken.jpg").write_bytes(b"not an image")
    out = root / "out"
    pack_manifest(PackConfig(str(src), str(out), max_samples=3, val_fraction=0.25, quiet=True))
    return out


@pytest.fixture
def dataset(packed: Path, tmp_path: Path) -> Path:
    """A fresh copy of the packed dataset's folder (its manifest is what the tests tamper)."""
    folder = tmp_path / "data"
    shutil.copytree(packed, folder, ignore=shutil.ignore_patterns(STATE_DIR))
    return folder


@pytest.fixture
def features(tmp_path: Path) -> Path:
    return write_feature_folder(tmp_path / "cache", shard_sizes={"train": [6, 4], "val": [4]}, classes=("a", "b"),
                                dim=4)


def tamper(path: Path, at: tuple, value: Any) -> None:
    """Set the field at ``at`` (keys and list indexes) of the JSON file ``path`` to ``value``."""
    data = json.loads(path.read_text())
    node = data
    for step in at[:-1]:
        node = node[step]
    node[at[-1]] = value
    path.write_text(json.dumps(data))


def shown(at: tuple) -> str:
    """``("splits", "train", "shards", 1, "samples")`` -> ``splits.train.shards[1].samples``."""
    text = ""
    for step in at:
        text += f"[{step}]" if isinstance(step, int) else ("." if text else "") + step
    return text


def same_dataset(one: Path, other: Path) -> bool:
    """Two dataset folders hold the same manifest (but for when it was made) and the same shard bytes."""
    first, second = (json.loads((folder / "dataset.json").read_text()) for folder in (one, other))
    first.pop("created"), second.pop("created")
    names = [s["path"] for split in first["splits"].values() for s in split["shards"]]
    return first == second and all((one / n).read_bytes() == (other / n).read_bytes() for n in names)


def one_line(error: BaseException, *fragments: str) -> str:
    text = str(error)
    assert "\n" not in text, text
    for fragment in fragments:
        assert fragment in text, text
    return text


DATASET_COUNTS = [("splits", "train", "samples"), ("splits", "train", "shards", 1, "samples"),
                  ("splits", "train", "shards", 0, "bytes"), ("splits", "val", "shards", 0, "samples"),
                  ("source", "files_seen")]


@pytest.mark.parametrize("at", DATASET_COUNTS, ids=shown)
@pytest.mark.parametrize("value", NOT_COUNTS, ids=repr)
def test_a_count_in_dataset_json_is_a_json_integer(dataset: Path, at: tuple, value: Any):
    tamper(dataset / "dataset.json", at, value)
    with pytest.raises(ManifestError) as caught:
        load_dataset_manifest(dataset)
    one_line(caught.value, str(dataset / "dataset.json"), f"{shown(at)} is ")


DATASET_STRINGS = [("storage",), ("classes", 1), ("splits", "train", "shards", 0, "path"),
                   ("splits", "train", "shards", 0, "sha256"), ("splits", "train", "shards", 0, "index"),
                   ("splits", "train", "shards", 0, "index_sha256"), ("source", "kind"), ("source", "root"),
                   ("source", "skipped", 0, "path"), ("source", "skipped", 0, "reason")]
OPTIONAL = {("splits", "train", "shards", 0, "index"), ("splits", "train", "shards", 0, "index_sha256"),
            ("packing",), ("source", "skipped"), ("splits", "val", "shards", 0, "class_counts")}


@pytest.mark.parametrize("at", DATASET_STRINGS, ids=shown)
@pytest.mark.parametrize("value", NOT_STRINGS, ids=repr)
def test_a_string_in_dataset_json_is_a_string(dataset: Path, at: tuple, value: Any):
    if value is None and at in OPTIONAL:
        return  # null is how an optional field is absent
    tamper(dataset / "dataset.json", at, value)
    with pytest.raises(ManifestError) as caught:
        load_dataset_manifest(dataset)
    one_line(caught.value, str(dataset / "dataset.json"), shown(at))


@pytest.mark.parametrize("at", [("splits",), ("splits", "train"), ("splits", "train", "shards", 2), ("source",),
                                ("packing",), ("source", "skipped", 0)], ids=shown)
@pytest.mark.parametrize("value", NOT_OBJECTS, ids=repr)
def test_an_object_in_dataset_json_is_an_object(dataset: Path, at: tuple, value: Any):
    if value is None and at in OPTIONAL:
        return
    tamper(dataset / "dataset.json", at, value)
    with pytest.raises(ManifestError) as caught:
        load_dataset_manifest(dataset)
    one_line(caught.value, str(dataset / "dataset.json"), shown(at))


@pytest.mark.parametrize("at", [("classes",), ("splits", "train", "class_counts"), ("splits", "train", "shards"),
                                ("splits", "val", "shards", 0, "class_counts"), ("source", "skipped")], ids=shown)
@pytest.mark.parametrize("value", NOT_LISTS, ids=repr)
def test_a_list_in_dataset_json_is_a_list(dataset: Path, at: tuple, value: Any):
    if value is None and at in OPTIONAL:
        return
    tamper(dataset / "dataset.json", at, value)
    with pytest.raises(ManifestError) as caught:
        load_dataset_manifest(dataset)
    one_line(caught.value, str(dataset / "dataset.json"), shown(at))


@pytest.mark.parametrize("value", [["7", 1], [1.5, 1], [True, 1], [None, 1], [math.nan, 1], [1e30, 1], [-1, 1]],
                         ids=repr)
def test_class_counts_hold_counts(dataset: Path, value: list):
    tamper(dataset / "dataset.json", ("splits", "train", "class_counts"), value)
    with pytest.raises(ManifestError) as caught:
        load_dataset_manifest(dataset)
    one_line(caught.value, "splits.train.class_counts")


@pytest.mark.parametrize("value", ["1", 1.0, True, 2, None])
def test_only_version_1_is_version_1(dataset: Path, value: Any):
    """``True == 1`` and ``1.0 == 1`` in Python: the version is compared as a JSON integer."""
    tamper(dataset / "dataset.json", ("version",), value)
    with pytest.raises(ManifestError, match="version"):
        load_dataset_manifest(dataset)


def test_the_same_class_twice_is_refused(dataset: Path):
    """Labels index the class list: a repeated name would merge two labels into one class silently."""
    tamper(dataset / "dataset.json", ("classes",), ["ant", "ant"])
    with pytest.raises(ManifestError, match="classes.*'ant' twice"):
        load_dataset_manifest(dataset)


def test_the_same_shard_twice_in_a_split_is_refused(dataset: Path):
    """Found by the fuzz suite: a spliced manifest listing one shard 20,000 times had every reader read it again."""
    manifest = json.loads((dataset / "dataset.json").read_text())
    shards = manifest["splits"]["train"]["shards"]
    tamper(dataset / "dataset.json", ("splits", "train", "shards"), shards + shards[:1])
    with pytest.raises(ManifestError, match=r"splits\.train\.shards lists '.*' more than once"):
        load_dataset_manifest(dataset)


@pytest.mark.parametrize("at,value", [(("created",), 7), (("tool",), []), (("source", "skipped", 0), "x")], ids=str)
def test_provenance_fields_have_their_types(dataset: Path, at: tuple, value: Any):
    tamper(dataset / "dataset.json", at, value)
    with pytest.raises(ManifestError) as caught:
        load_dataset_manifest(dataset)
    one_line(caught.value, shown(at))


@pytest.mark.parametrize("at,value,named", [
    (("source_index",), [], "source_index is"), (("source_index",), "source-index.jsonl", "source_index is"),
    (("source_index", "path"), 7, "source_index.path is"), (("source_index", "path"), None, "source_index.path is"),
    (("source_index", "path"), "../../etc/passwd", "source index path '../../etc/passwd'"),
    (("source_index", "entries"), "3", "source_index.entries is"),
    (("source_index", "entries"), -1, "source_index.entries is"),
    (("source_index", "sha256"), [], "source_index.sha256 is")], ids=str)
def test_the_source_index_entry_has_its_shape(dataset: Path, at: tuple, value: Any, named: str):
    """Read by the selection, ``shards verify`` and ``--append``: held to one shape where the manifest is read."""
    tamper(dataset / "dataset.json", at, value)
    with pytest.raises(ManifestError) as caught:
        load_dataset_manifest(dataset)
    one_line(caught.value, str(dataset / "dataset.json"), named)


def test_the_untampered_dataset_reads(dataset: Path):
    manifest = load_dataset_manifest(dataset)
    assert manifest.source.skipped and manifest.splits["train"].shards[0].class_counts is not None


# -- features.json --------------------------------------------------------------------------------------------------
FEATURE_FIELDS = [(("features_dim",), NOT_COUNTS + [0]),
                  (("views",), [v for v in NOT_COUNTS if v is not None] + [10**6]), (("dtype",), NOT_STRINGS),
                  (("config",), NOT_OBJECTS), (("config_hash",), NOT_STRINGS), (("dataset_sha256",), NOT_STRINGS),
                  (("splits", "train", "shards", 1, "source"), [7, [], {}]),
                  (("splits", "train", "shards", 0, "source_sha256"), [7, [], {}])]


@pytest.mark.parametrize("at,value", [(at, v) for at, values in FEATURE_FIELDS for v in values],
                         ids=lambda x: shown(x) if isinstance(x, tuple) else repr(x))
def test_every_field_of_features_json_has_its_type(features: Path, at: tuple, value: Any):
    manifest = features / "features.json"
    tamper(manifest, at, value)
    with pytest.raises(ManifestError) as caught:
        load_feature_manifest(features)
    one_line(caught.value, str(manifest), shown(at))


@pytest.mark.parametrize("std", [math.nan, math.inf, 0.0, -1.0, "1", None])
def test_a_regression_target_has_a_finite_positive_std(features: Path, std: Any):
    manifest = features / "features.json"
    tamper(manifest, ("config", "target"), {"task": "regression", "stored_as": "targets", "mean": 0.0, "std": std})
    with pytest.raises(ManifestError) as caught:
        load_feature_manifest(features)
    one_line(caught.value, "config.target.std")


# -- through the commands -------------------------------------------------------------------------------------------
def assert_one_line(result, exit_code: int, *fragments: str) -> None:
    assert result.exit_code == exit_code, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("at,value", [(("splits", "train", "shards", 1, "samples"), 2.5),
                                      (("splits", "train", "samples"), "7"), (("classes",), {"ant": 0}),
                                      (("splits", "train", "shards", 0), "train-000000.tar"),
                                      (("splits", "val"), [1, 2]), (("source", "files_seen"), True)], ids=str)
def test_shards_verify_and_training_stop_with_one_line(dataset: Path, tmp_path: Path, at: tuple, value: Any):
    tamper(dataset / "dataset.json", at, value)
    assert_one_line(CliRunner().invoke(shards_cli, ["verify", str(dataset)]), 2, "dataset.json", shown(at))
    result = CliRunner().invoke(train_command, [str(dataset), "--out", str(tmp_path / "run"), "--dry-run", "--quiet",
                                                "--device", "cpu"])
    assert_one_line(result, 2, "dataset.json", shown(at))


def test_training_on_tampered_features_stops_with_one_line(features: Path, tmp_path: Path):
    tamper(features / "features.json", ("features_dim",), 1e30)
    result = CliRunner().invoke(train_command, [str(features), "--out", str(tmp_path / "run"),
                                                "--dry-run", "--quiet", "--device", "cpu"])
    assert_one_line(result, 2, "features.json", "features_dim is 1e+30")



# -- a run folder read back: config.json, metrics.jsonl, data-events.jsonl, keys.jsonl ------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished one-epoch run on features, recording its keys: every file a run folder holds."""
    from tests.train.configs import train_config
    from train.run.loop import train

    root = tmp_path_factory.mktemp("trained")
    data = write_feature_folder(root / "cache", shard_sizes={"train": [6, 4], "val": [4]}, classes=("a", "b"), dim=4)
    train(train_config(str(data), str(root / "run"), epochs=1, batch_size=4,
                      workers=0, quiet=True, device="cpu", record_keys=True))
    return root


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run (same absolute data path; its out_dir is where the copy is)."""
    folder = tmp_path / "run"
    shutil.copytree(trained / "run", folder)
    tamper(folder / "config.json", ("run", "out_dir"), str(folder))
    return folder


@pytest.mark.parametrize("at,value", [
    (("optim", "epochs"), True), (("optim", "epochs"), "2"), (("optim", "seed"), 2.5), (("optim", "seed"), 1e30),
    (("optim", "lr"), math.nan), (("optim", "momentum"), "0.9"), (("optim", "batch_size"), [4]),
    (("run", "resume"), 1), (("model", "head"), 7), (("data", "path"), None), (("data", "sources"), {"path": "x"}),
    (("data", "sources"), [{"path": 7}]), (("data", "sources"), [{"path": "x", "weight": "2"}]),
    (("data", "sources"), [{"path": "x", "choose": 2.5}]), (("data", "sources"), [{"path": "x", "pipe": "rm"}]),
    (("data", "subset"), []), (("data", "subset"), {"max_samples": True}), (("data", "subset"), {"classes": "a"}),
    (("cache", "storage_options"), "s3"), (("loader",), [2]), (("loader", "workerz"), 2), (("optimizer",), {})],
    ids=str)
@pytest.mark.slow
def test_a_resumed_run_config_has_the_types_train_from_shards_wrote(trained: Path, run: Path, at: tuple,
                                                                     value: Any):
    tamper(run / "config.json", at, value)
    result = CliRunner().invoke(train_command, [str(trained / "cache" / "features"), "--out", str(run), "--resume",
                                                "--epochs", "2", "--quiet", "--device", "cpu"])
    assert_one_line(result, 2, str(run / "config.json"), shown(at))


def test_lineage_reads_the_run_record_through_the_same_door(run: Path):
    from shards.check.lineage import run_lineage

    tamper(run / "run.json", ("data", "make_loader", "batch_size"), 4.0)
    with pytest.raises(ManifestError) as caught:
        run_lineage(run, 1, 1)
    one_line(caught.value, str(run / "run.json"), "batch_size is 4.0: expected an integer")


def layout_line(run: Path) -> tuple[Path, int, dict]:
    path = run / "data-events.jsonl"
    lines = path.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "layout")
    return path, index, json.loads(lines[index])


@pytest.mark.parametrize("name,value", [("world_size", "1"), ("world_size", True), ("world_size", 10**9),
                                        ("num_workers", 1e30), ("batch_size", 0), ("batch_size", None),
                                        ("epoch", 1.0), ("nodes", []), ("loader_state", "x"),
                                        ("exclude_keys", "../../../etc/passwd"), ("exclude_keys", 7)], ids=str)
def test_lineage_refuses_a_layout_event_of_another_shape(run: Path, name: str, value: Any):
    from shards.check.lineage import run_lineage

    path, index, event = layout_line(run)
    lines = path.read_text().splitlines()
    lines[index] = json.dumps({**event, name: value})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ManifestError) as caught:
        run_lineage(run, 1, 1)
    one_line(caught.value, str(path), f": {name}")


def test_events_with_a_time_that_is_no_finite_number_are_left_out(run: Path):
    from shards.data_events import read_events

    path = run / "data-events.jsonl"
    path.write_text(path.read_text() + json.dumps({"kind": "restart", "time": math.nan}) + "\n"
                    + json.dumps({"kind": "restart", "time": True}) + "\n")
    assert [e["kind"] for e in read_events(run)] == ["layout"]


@pytest.mark.parametrize("line", ['{"epoch": "1"}', '{"epoch": 0}', '{"epoch": true}', '[1]', '{"epoch": 1.5}'])
def test_metrics_rows_have_a_positive_integer_epoch(run: Path, line: str):
    from shards.report.run import read_run
    from shards.runrecord import read_rows

    path = run / "metrics.jsonl"
    row = json.loads(line)
    if isinstance(row, dict):
        row["version"] = 1  # a row of this version, wrong only in its epoch
    path.write_text(path.read_text() + json.dumps(row) + "\n")
    with pytest.raises(ManifestError) as caught:
        read_rows(path)
    one_line(caught.value, str(path), "line 2")
    files = read_run(run)  # the report leaves the line out and says so
    assert len(files.rows) == 1 and files.problems and "line 2" in files.problems[0]


@pytest.mark.parametrize("line", ['{"epoch": 1, "step": "1", "rank": 0, "keys": []}',
                                  '{"epoch": 1, "step": 1, "rank": 0, "keys": "abc"}',
                                  '{"epoch": 1, "step": 1, "rank": 0, "keys": [7]}', '[1, 2]',
                                  '{"epoch": 1, "step": 1, "keys": []}'])
def test_recorded_keys_have_their_shape(run: Path, line: str):
    from train.run.lineage import read_recorded_keys

    path = run / "keys.jsonl"
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ManifestError) as caught:
        read_recorded_keys(run)
    one_line(caught.value, str(path), "line ")


# -- a mixture: the Python API converts nothing either --------------------------------------------------------------
@pytest.mark.parametrize("changes", [{"weight": "2"}, {"weight": True}, {"repeat": [1]}, {"choose": 2.5},
                                     {"choose": "3"}, {"choose": True}, {"choose": 10**30}], ids=str)
def test_a_source_spec_converts_nothing(changes: dict):
    from shards.select.mixture import SourceSpec

    with pytest.raises(InputError, match=next(iter(changes))):
        SourceSpec("x", **changes)


@pytest.mark.parametrize("value", [True, 2.5, "3", 0])
def test_a_subset_count_converts_nothing(value: Any):
    from shards.select.mixture import MixOptions, Subset

    with pytest.raises(InputError, match="max_samples"):
        Subset(max_samples=value)
    with pytest.raises(InputError, match="epoch_size"):
        MixOptions(epoch_size=value)


# -- pack-shards' own state and inputs: parts, plan, JSONL image lists -----------------------------------------------
@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_image_folder(tmp_path / "src", ["ant", "bee"], 4, size=(16, 16))


def pack_config(src: Path, out: Path) -> PackConfig:
    return PackConfig(str(src), str(out), max_samples=3, quiet=True)


@pytest.mark.parametrize("at,value", [(("shard", "samples"), "3"), (("shard", "bytes"), 1e30),
                                      (("shard", "path"), "../train-000000.tar"), (("shard", "path"), 7),
                                      (("shard",), "train-000000.tar"), (("class_counts",), [1.0, 2]),
                                      (("skipped",), {}), (("index",), "x"), (("index", 0), 7),
                                      (("plan_sha256",), 7), (("source_files",), "3")], ids=str)
def test_a_part_of_another_shape_is_packed_again(src: Path, tmp_path: Path, at: tuple, value: Any):
    """A part manifest is the resume state of its shard: one that does not read as one is not trusted, and the
    shard is packed again, giving the very dataset a clean run gives."""
    clean = pack_manifest(pack_config(src, tmp_path / "clean"))
    out = tmp_path / "out"
    pack_manifest(pack_config(src, out))
    (out / "dataset.json").unlink()
    part = part_path(out, "train-000000.tar")
    tamper(part, at, value)
    assert load_part(out, "train-000000.tar", read_plan_doc(out)["plan_sha256"], check_sha256=False) is None
    result = pack(pack_config(src, out))
    assert result.summary["shards_written"] == 1
    assert same_dataset(out, tmp_path / "clean")
    assert clean.splits == result.manifest.splits


@pytest.mark.parametrize("at,value", [(("shards", 0, "name"), "../../evil.tar"), (("shards",), {}),
                                      (("classes",), [1, 2]), (("source", "files_seen"), "8"),
                                      (("plan_sha256",), None), (("packing",), [])], ids=str)
def test_merge_refuses_a_plan_of_another_shape(src: Path, tmp_path: Path, at: tuple, value: Any):
    out = tmp_path / "out"
    pack_manifest(pack_config(src, out))
    plan = out / STATE_DIR / "plan.json"
    tamper(plan, at, value)
    result = CliRunner().invoke(pack_shards_command, ["--merge", str(out), "--quiet"])
    assert_one_line(result, 2, str(plan), shown(at))


@pytest.mark.parametrize("row,field", [({"path": 7, "label": "ant"}, "path"), ({"path": ["a"], "label": "ant"}, "path"),
                                       ({"path": "ant/img_0000.jpg", "label": ["ant"]}, "label"),
                                       ({"path": "ant/img_0000.jpg", "label": True}, "label"),
                                       ({"path": "ant/img_0000.jpg", "label": 1.5}, "label"),
                                       ({"path": "ant/img_0000.jpg", "label": {"n": 1}}, "label"),
                                       ({"path": "ant/img_0000.jpg", "label": "ant", "split": 1}, "split")], ids=str)
def test_a_jsonl_image_list_holds_strings(src: Path, tmp_path: Path, row: dict, field: str):
    """``str()`` would have made a list, an object, ``true`` or ``1.5`` a class name (or a path) silently."""
    listing = src / "list.jsonl"
    listing.write_text(json.dumps({"path": "bee/img_0000.jpg", "label": "bee"}) + "\n" + json.dumps(row) + "\n")
    result = CliRunner().invoke(pack_shards_command, [str(listing), "--out", str(tmp_path / "out"), "--quiet"])
    assert_one_line(result, 2, str(listing), f"line 2: {field} is ")
    assert not (tmp_path / "out").exists()


def test_integer_labels_in_a_jsonl_list_name_their_classes(src: Path, tmp_path: Path):
    listing = src / "list.jsonl"
    listing.write_text("".join(json.dumps({"path": f"{c}/img_000{i}.jpg", "label": n}) + "\n"
                               for n, c in enumerate(["ant", "bee"]) for i in range(2)))
    assert pack_manifest(PackConfig(str(listing), str(tmp_path / "out"), quiet=True)).classes == ("0", "1")


# -- what the commands print agrees with what they wrote -------------------------------------------------------------
def shard_files_in(out: Path) -> set[str]:
    return {p.name for p in out.iterdir() if p.suffix in (".tar", ".h5")}


def test_pack_summary_counts_the_shards_the_manifest_holds(src: Path, tmp_path: Path):
    """A planned shard whose every file is skipped writes no shard: it is neither written nor reused, on the first
    run or on a resume that redoes one shard."""
    for i in range(2):  # sorted first, unshuffled: together they are the whole first shard
        (src / "ant" / f"a_broken_{i}.jpg").write_bytes(b"not an image")
    out = tmp_path / "out"
    args = [str(src), "--out", str(out), "--shard-samples", "2", "--no-shuffle", "--quiet"]
    result = CliRunner().invoke(pack_shards_command, args)
    assert result.exit_code == 0, result.output
    first = json.loads(result.stdout)
    manifest = load_dataset_manifest(out)
    shards = [s for split in manifest.splits.values() for s in split.shards]
    assert first["shards"] == len(shards) == len(shard_files_in(out)) == first["shards_written"]
    assert first["shards_reused"] == 0 and first["skipped"] == 2
    assert first["samples"] == sum(s.samples for s in shards) == 8
    (out / "dataset.json").unlink()
    (out / shards[-1].path).unlink()
    result = CliRunner().invoke(pack_shards_command, args)
    again = json.loads(result.stdout)
    assert (again["shards_written"], again["shards_reused"], again["shards"]) == (1, len(shards) - 1, len(shards))


@pytest.mark.slow  # over half a second in the quick loop
def test_features_summary_counts_the_shards_features_json_holds(dataset: Path, tmp_path: Path):
    from preprocess.features.cli import precompute_features_command

    args = [str(dataset), "--out", str(tmp_path / "feat"), "--backbone", "resnet18", "--weights", "none",
            "--resize", "40", "--crop", "32", "--batch-size", "8", "--workers", "0", "--device", "cpu", "--quiet"]
    first = json.loads(CliRunner().invoke(precompute_features_command, args).stdout)
    total = sum(len(s.shards) for s in load_feature_manifest(tmp_path / "feat").splits.values())
    assert (first["shards_total"], first["shards_done"], first["shards_skipped"]) == (total, total, 0)
    assert first["images"] == sum(s.samples for s in load_dataset_manifest(dataset).splits.values())
    again = json.loads(CliRunner().invoke(precompute_features_command, args).stdout)
    assert (again["shards_total"], again["shards_done"], again["shards_skipped"], again["images"]) == (total, 0,
                                                                                                      total, 0)


# -- precompute-features' own state: the shard records and the run record --------------------------------------------
FEATURE_ARGS = ["--backbone", "resnet18", "--weights", "none", "--resize", "40", "--crop", "32", "--batch-size", "8",
                "--workers", "0", "--device", "cpu", "--quiet"]


@pytest.fixture
def computed(dataset: Path, tmp_path: Path) -> Path:
    from preprocess.features.cli import precompute_features_command

    out = tmp_path / "feat"
    result = CliRunner().invoke(precompute_features_command, [str(dataset), "--out", str(out), *FEATURE_ARGS])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("at,value", [(("shard", "samples"), "3"), (("shard", "path"), "../x.pt"),
                                      (("shard", "path"), "val-000000.pt"), (("shard",), []), (("shard",), None)],
                         ids=str)
@pytest.mark.slow
def test_a_shard_record_of_another_shape_is_computed_again(dataset: Path, computed: Path, at: tuple, value: Any):
    from preprocess.features.cli import precompute_features_command

    before = json.loads((computed / "features.json").read_text())
    tamper(computed / ".precompute" / "train-000000.json", at, value)
    result = CliRunner().invoke(precompute_features_command, [str(dataset), "--out", str(computed), *FEATURE_ARGS])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["shards_done"] == 1
    after = json.loads((computed / "features.json").read_text())
    assert after["splits"] == before["splits"]


@pytest.mark.parametrize("at,value", [(("features_dim",), 1e30), (("features_dim",), "512"),
                                      (("dataset_dir",), "pipe:rm -rf x"), (("splits",), "train"),
                                      (("config",), []), (("config", "storage"), "zip"), (("config", "views"), True),
                                      (("config_hash",), 7)], ids=str)
@pytest.mark.slow
def test_merge_refuses_a_run_record_of_another_shape(computed: Path, at: tuple, value: Any):
    from preprocess.features.cli import precompute_features_command

    record = computed / ".precompute" / "config.json"
    tamper(record, at, value)
    result = CliRunner().invoke(precompute_features_command, ["--merge", str(computed), "--quiet"])
    assert_one_line(result, 2, str(record), shown(at))
