"""A subset resolved over the column index selects what the row-by-row path selects: the same rows in the same
shards, the same class counts, the same errors, and never a shard opened to find them."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

import shards
from preprocess.pack.packer import PackConfig, pack_manifest
from shards.errors import CorruptDataError, InputError, ManifestError
from shards.formats.column_writer import write_split_columns
from shards.formats.columns import FORMAT
from shards.select.columns import open_columns
from shards.manifest import DatasetManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from shards.select.mixture import MixOptions, SourceSpec, Subset
from shards.select.selection import LoadedSource, combine
from tests.helpers import write_image_folder
from tests.shards.test_where_mask import FIELDS, STRINGS, random_expression

CLASSES = ("cat", "dog", "émeu")


def _meta(rng: random.Random, mixed: bool) -> dict:
    meta = {"width": rng.randint(-3, 3), "ratio": rng.choice([-1.5, 0.0, 0.5, 2.5]), "flag": rng.random() < 0.5,
            "path": rng.choice(STRINGS)}
    if rng.random() < 0.8:
        meta["height"] = rng.randint(-3, 3)
    if rng.random() < 0.9:
        meta["mode"] = rng.choice(STRINGS)
    if rng.random() < 0.1:
        meta["class"] = "not the sample's class"  # the sample's own class wins
    if mixed and rng.random() < 0.5:
        meta["mixed"] = rng.choice([1, "one"])  # a number here, a string there: not indexed
    return meta


def write_dataset(folder: Path, rng: random.Random, *, mixed: bool = False) -> DatasetManifest:
    """A dataset's manifest, source index and columns, without its shards (a subset never opens one here)."""
    folder.mkdir(parents=True)
    rows, infos, totals, n = [], [], [0] * len(CLASSES), 0
    for shard in range(rng.randint(1, 6)):
        choices = rng.choice([[0], [1, 2], [0, 1, 2]])  # some shards hold one class: skipped unread
        labels = [rng.choice(choices) for _ in range(rng.randint(1, 12))]
        name = f"train-{shard:06d}.tar"
        for position, label in enumerate(labels):
            rows.append({"key": f"k{n:04d}", "label": label, "split": "train", "shard": name, "row": position,
                         "meta": _meta(rng, mixed)})
            totals[label] += 1
            n += 1
        counts = tuple(labels.count(c) for c in range(len(CLASSES)))
        infos.append(ShardInfo(name, len(labels), 1, "0" * 64, class_counts=counts))
    index = "".join(json.dumps(row) + "\n" for row in rows).encode()
    (folder / "source-index.jsonl").write_bytes(index)
    entry = write_split_columns(folder, "train", lambda: iter(rows), n)
    manifest = DatasetManifest(
        storage="tar", classes=CLASSES, splits={"train": SplitInfo(n, tuple(totals), tuple(infos))},
        source=SourceInfo(kind="generated", root="", files_seen=n), packing={"seed": 0},
        extra={"source_index": {"path": "source-index.jsonl", "sha256": hashlib.sha256(index).hexdigest()},
               "columns": {"format": FORMAT, "splits": {"train": entry}}})
    manifest.save(folder)
    return manifest


def _source(folder: Path, manifest: DatasetManifest, subset: Subset, *, columns: bool) -> LoadedSource:
    split = manifest.split("train")

    def read_all(shard: int):
        raise AssertionError(f"shard {shard} was opened")

    return LoadedSource(SourceSpec(str(folder), subset=subset), manifest, split,
                        [str(folder / s.path) for s in split.shards], str(folder), read_all,
                        (lambda: open_columns(folder, manifest, "train")) if columns else (lambda: None))


def _selection(folder: Path, manifest: DatasetManifest, subset: Subset, *, columns: bool):
    """What a subset selects (kept shards, their rows, class counts) or the error it stops with."""
    try:
        combined = combine([_source(folder, manifest, subset, columns=columns)], "train", MixOptions(), seed=0,
                           shuffle=False)
    except (InputError, CorruptDataError) as exc:
        return type(exc).__name__, str(exc)
    return combined.locations, [r.tolist() for r in combined.mixture.runs[0]], combined.mixture.per_source_counts


def _random_subset(rng: random.Random, keys: list[str], names: tuple[str, ...]) -> Subset:
    while True:
        classes = rng.sample(CLASSES, rng.randint(1, 2)) if rng.random() < 0.4 else None
        wanted = rng.sample(keys + ["absent"], rng.randint(0, min(len(keys) + 1, 8))) if rng.random() < 0.3 else None
        where = random_expression(rng, names=names) if rng.random() < 0.7 else None
        most = rng.randint(1, 20) if rng.random() < 0.3 else None
        try:
            subset = Subset(classes=classes, keys=wanted, where=where, max_samples=most)
        except InputError:
            continue
        if not subset.empty:
            return subset


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.slow
def test_both_paths_agree_on_random_subsets(tmp_path, mixed):
    rng = random.Random(f"columns-{mixed}")
    names = FIELDS + (("mixed",) if mixed else ())
    selected = failed = 0
    for dataset in range(6):
        folder = tmp_path / f"d{dataset}"
        manifest = write_dataset(folder, rng, mixed=mixed)
        keys = [f"k{i:04d}" for i in range(manifest.split("train").samples)]
        for _ in range(25):
            subset = _random_subset(rng, keys, names)
            by_rows = _selection(folder, manifest, subset, columns=False)
            assert _selection(folder, manifest, subset, columns=True) == by_rows, subset
            failed += isinstance(by_rows[0], str)
            selected += not isinstance(by_rows[0], str)
    assert selected > 40 and failed > 15


def test_a_packed_dataset_subsets_from_its_columns_alone(tmp_path):
    tree = write_image_folder(tmp_path / "src", ["cat", "dog", "eel"], per_class=6, size=(20, 16))
    pack_manifest(PackConfig(str(tree), str(tmp_path / "out"), max_samples=5, seed=1, quiet=True))
    (tmp_path / "out" / "source-index.jsonl").unlink()  # the columns are enough; the shards are not opened
    cats = shards.open_dataset(SourceSpec(tmp_path / "out", subset=Subset(classes=["cat"], where="width == 20")),
                               "train", return_keys=True)
    assert len(cats) == 6 and {label for _, label, _ in cats} == {0}


def test_a_changed_column_file_is_a_one_line_error_naming_it(tmp_path):
    manifest = write_dataset(tmp_path / "d", random.Random(3))
    label_file = tmp_path / "d" / manifest.extra["columns"]["splits"]["train"]["fields"]["label"]["path"]
    data = bytearray(label_file.read_bytes())
    data[-1] ^= 1
    label_file.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="sha256") as failure:
        combine([_source(tmp_path / "d", manifest, Subset(classes=["cat"]), columns=True)], "train", MixOptions(),
                seed=0, shuffle=False)
    assert str(label_file) in str(failure.value) and "\n" not in str(failure.value)


def test_a_failing_row_after_max_samples_were_taken_is_never_looked_at(tmp_path):
    rows = [{"key": f"k{i}", "label": 0, "split": "train", "shard": f"train-{i // 2:06d}.tar", "row": i % 2,
             "meta": {"width": 5} if i < 3 else {}} for i in range(6)]
    folder = tmp_path / "d"
    folder.mkdir()
    entry = write_split_columns(folder, "train", lambda: iter(rows), 6)
    infos = tuple(ShardInfo(f"train-{s:06d}.tar", 2, 1, "0" * 64, class_counts=(2,)) for s in range(3))
    manifest = DatasetManifest(storage="tar", classes=("cat",), splits={"train": SplitInfo(6, (6,), infos)},
                               source=SourceInfo(kind="generated", root="", files_seen=6), packing={},
                               extra={"columns": {"format": FORMAT, "splits": {"train": entry}}})
    # Row 3 (shard 1) has no width: two samples are taken from shard 0 before it, three need shard 1.
    two = _selection(folder, manifest, Subset(where="width > 1", max_samples=2), columns=True)
    assert two[1] == [[0, 1]]
    three = _selection(folder, manifest, Subset(where="width > 1", max_samples=3), columns=True)
    assert three == ("InputError", "where='width > 1': sample 'k3' has no field 'width' (it has class, key, label)")


def test_a_callable_filter_sees_the_row_path_fields_on_selected_rows_only(tmp_path):
    rng = random.Random(5)
    manifest = write_dataset(tmp_path / "d", rng)
    seen: dict[bool, list] = {True: [], False: []}
    for columns in (True, False):
        def keep(fields, columns=columns):
            seen[columns].append(fields)
            return fields["width"] > 0
        subset = Subset(classes=["dog"], where=keep)
        result = _selection(tmp_path / "d", manifest, subset, columns=columns)
        assert result == _selection(tmp_path / "d", manifest, Subset(classes=["dog"], where="width > 0"),
                                    columns=columns)
    assert seen[True] == seen[False] and {f["class"] for f in seen[True]} == {"dog"}



def test_columns_of_another_length_than_the_shards_are_a_manifest_error(tmp_path):
    manifest = write_dataset(tmp_path / "d", random.Random(7))
    split = manifest.split("train")
    last = split.shards[-1]
    longer = SplitInfo(split.samples, split.class_counts, split.shards[:-1] + (
        ShardInfo(last.path, last.samples + 1, 1, "0" * 64),))
    with pytest.raises(ManifestError, match="column index holds"):
        combine([_source(tmp_path / "d", manifest.replace(splits={"train": longer}), Subset(max_samples=1),
                         columns=True)], "train", MixOptions(), seed=0, shuffle=False)
