"""Mixing, weighing and subsetting datasets without repacking (``shards.select.mixture``, ``selection``, ``rows``)."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import shards
from preprocess.pack.packer import PackConfig, pack_manifest
from shards.errors import InputError
from shards.formats.features import FeatureShard, feature_shard_name, write_feature_shard
from shards.formats.sample import RawSample
from shards.transport.storage import get_storage, shard_name
from shards.manifest import DatasetManifest, FeatureManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from shards.stream.image_dataset import ImageShardDataset
from shards.select.mixture import MixOptions, SourceSpec, Subset, draws, epoch_rows
from shards.select.where import Where
from shards.loader.worker_processes import WorkerProcesses
from shards.loader.loader import workers_mode
from tests.helpers import class_image, write_image_folder


def zero(sample, seed):
    return 0


def write_features(out: Path, prefix: str, shard_sizes, classes=("a", "b", "c"), split="train",
                   labels_of=None) -> FeatureManifest:
    """Feature shards with keys ``<prefix>-<row>`` and per-shard class counts."""
    out.mkdir(parents=True, exist_ok=True)
    infos, counts, n = [], [0] * len(classes), 0
    for index, size in enumerate(shard_sizes):
        labels = torch.tensor([labels_of(n + i) if labels_of else (n + i) % len(classes) for i in range(size)])
        features = torch.arange(n, n + size, dtype=torch.float32)[:, None].repeat(1, 4)
        keys = [f"{prefix}-{i:05d}" for i in range(n, n + size)]
        shard_counts = torch.bincount(labels, minlength=len(classes)).tolist()
        counts = [a + b for a, b in zip(counts, shard_counts)]
        name = feature_shard_name(shard_name(split, index, "tar"), "pt")
        nbytes, digest = write_feature_shard(out / name, FeatureShard(features, labels, keys), "pt")
        infos.append(ShardInfo(name, size, nbytes, digest, class_counts=tuple(shard_counts)))
        n += size
    manifest = FeatureManifest(storage="pt", classes=tuple(classes),
                               splits={split: SplitInfo(n, tuple(counts), tuple(infos))}, features_dim=4,
                               dtype="float32", views=0, config={"backbone": "test"}, config_hash="0" * 16,
                               dataset_dir="", dataset_sha256="0" * 64)
    manifest.save(out)
    return manifest


def write_images(out: Path, prefix: str, labels_per_shard, classes=("a", "b", "c"), *, class_counts=True,
                 sizes=None) -> DatasetManifest:
    """Tar shards with the given labels, keys ``<prefix>-<row>``; ``class_counts=False`` writes an old manifest."""
    out.mkdir(parents=True, exist_ok=True)
    writer_type = get_storage("tar").writer
    infos, counts, n = [], [0] * len(classes), 0
    for index, labels in enumerate(labels_per_shard):
        name = shard_name("train", index, "tar")
        with writer_type(out / name) as writer:
            for label in labels:
                width = sizes[n] if sizes else 8
                meta = json.dumps({"class": classes[label], "width": width, "height": 8}).encode()
                writer.write(RawSample(f"{prefix}-{n:05d}", class_image(label, n, (8, 8)), "jpg", label, meta))
                counts[label] += 1
                n += 1
        shard_counts = tuple(int(np.sum(np.asarray(labels) == c)) for c in range(len(classes)))
        infos.append(ShardInfo(name, writer.samples, writer.bytes, writer.sha256, index=writer.index,
                               index_sha256=writer.index_sha256, class_counts=shard_counts if class_counts else None))
    manifest = DatasetManifest(storage="tar", classes=tuple(classes),
                               splits={"train": SplitInfo(n, tuple(counts), tuple(infos))},
                               source=SourceInfo(kind="generated", root="", files_seen=n), packing={"seed": 0})
    manifest.save(out)
    return manifest


def keys_of(dataset) -> list[str]:
    return [item[2] for item in dataset]


@pytest.fixture(scope="module")
def two_feature_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    write_features(root / "big", "big", [50] * 40)  # 2,000 samples
    write_features(root / "small", "small", [50] * 20)  # 1,000 samples
    return root / "big", root / "small"


# -- the draw --------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # over half a second in the quick loop
def test_weights_share_an_epoch_exactly_and_interleave_within_a_binomial_tolerance(two_feature_sources):
    big, small = two_feature_sources
    dataset = shards.open_dataset([SourceSpec(big, weight=1), SourceSpec(small, weight=3)], "train",
                                  return_keys=True, seed=5)
    assert len(dataset) == 3000 and dataset.mixture.draw == [750, 2250]
    drawn = keys_of(dataset)
    by_source = collections.Counter(key.split("-")[0] for key in drawn)
    assert by_source == {"big": 750, "small": 2250}
    # Repeats: the small source is read 2.25 times (every sample twice, a quarter a third time), the big one 3/8.
    small_repeats = collections.Counter(collections.Counter(k for k in drawn if k.startswith("small")).values())
    assert small_repeats == {2: 750, 3: 250}
    assert len({k for k in drawn if k.startswith("big")}) == 750
    # The epoch interleaves whole shard runs (50 samples) drawn without replacement: in its first half (30 of 60
    # runs) the small source's share is hypergeometric around its weight; 3.5 standard deviations, per seed.
    for seed in range(5):
        drawn = keys_of(shards.open_dataset([SourceSpec(big, weight=1), SourceSpec(small, weight=3)], "train",
                                            return_keys=True, seed=seed))
        share = sum(k.startswith("small") for k in drawn[:1500]) / 1500
        sigma = math.sqrt(0.75 * 0.25 / 30 * (60 - 30) / (60 - 1))
        assert abs(share - 0.75) < 3.5 * sigma, (seed, share)


def test_epoch_size_and_choose_and_repeat(two_feature_sources):
    big, small = two_feature_sources
    assert draws([SourceSpec("a", weight=2), SourceSpec("b", weight=1)], [10, 10], epoch_size=10) == [7, 3]
    assert draws([SourceSpec("a", choose=7), SourceSpec("b", repeat=1.5)], [10, 10]) == [7, 15]
    with pytest.raises(InputError, match="every source a weight, or none"):
        draws([SourceSpec("a", weight=2), SourceSpec("b")], [10, 10])
    dataset = shards.open_dataset([SourceSpec(big, choose=100), SourceSpec(small, repeat=0.5)], "train",
                                  return_keys=True)
    assert collections.Counter(k.split("-")[0] for k in keys_of(dataset)) == {"big": 100, "small": 500}
    sized = shards.open_dataset([SourceSpec(big, weight=1), SourceSpec(small, weight=1)], "train",
                                mix=MixOptions(epoch_size=600))
    assert len(sized) == 600 and sized.mixture.draw == [300, 300]


def test_the_draw_is_a_pure_function_of_seed_and_epoch():
    runs = [[np.arange(0, 5), np.arange(5, 9)], [np.arange(9, 12)]]
    a = epoch_rows(runs, [7, 6], seed=1, epoch=0)
    assert np.array_equal(a, epoch_rows(runs, [7, 6], seed=1, epoch=0))
    assert not np.array_equal(a, epoch_rows(runs, [7, 6], seed=1, epoch=1))
    assert not np.array_equal(a, epoch_rows(runs, [7, 6], seed=2, epoch=0))
    assert collections.Counter(a.tolist())[9] == 2 and len(a) == 13
    unshuffled = epoch_rows(runs, [9, 3], seed=1, epoch=0, shuffle=False)
    assert unshuffled.tolist() == list(range(12))


def test_ranks_get_equal_counts_that_together_cover_the_epoch(two_feature_sources):
    big, small = two_feature_sources
    specs = [SourceSpec(big, weight=0.3), SourceSpec(small, weight=0.7)]
    whole = collections.Counter(keys_of(shards.open_dataset(specs, "train", return_keys=True, seed=2)))
    per_rank = [keys_of(shards.open_dataset(specs, "train", return_keys=True, seed=2,
                                            distributed=shards.Distributed(rank=r, world_size=3)))
                for r in range(3)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == 1000
    assert collections.Counter(k for p in per_rank for k in p) == whole


def test_feature_batches_follow_the_mixture(two_feature_sources):
    big, small = two_feature_sources
    dataset = shards.open_dataset([SourceSpec(big, weight=1), SourceSpec(small, weight=1)], "train",
                                  return_keys=True, seed=1)
    loader = shards.make_loader(dataset, batch_size=100)
    batches = list(loader)
    keys = [k for batch in batches for k in batch[2]]
    assert len(keys) == 3000 and collections.Counter(k.split("-")[0] for k in keys) == {"big": 1500, "small": 1500}
    row = int(batches[0][0][0, 0])  # feature column 0 is the sample's row inside its own source
    assert batches[0][2][0].endswith(f"{row:05d}")


# -- class maps ------------------------------------------------------------------------------------------------------
def test_different_classes_are_refused_in_one_line_unless_union(tmp_path):
    write_features(tmp_path / "x", "x", [6], classes=("cat", "dog"))
    write_features(tmp_path / "y", "y", [6], classes=("cat", "fox"))
    with pytest.raises(InputError) as refused:
        shards.open_dataset([tmp_path / "x", tmp_path / "y"], "train")
    assert "\n" not in str(refused.value) and "union" in str(refused.value) and "fox" in str(refused.value)
    union = shards.open_dataset([tmp_path / "x", tmp_path / "y"], "train", return_keys=True,
                                mix=MixOptions(class_map="union"), sampling=shards.Sampling(shuffle=False))
    assert union.num_classes == 3  # cat, dog, fox
    labels = {key: int(label) for _, label, key in union}
    assert labels["x-00001"] == 1 and labels["y-00001"] == 2 and labels["y-00000"] == labels["x-00000"] == 0
    batch = next(iter(shards.make_loader(union, batch_size=12)))
    assert {k: int(v) for k, v in zip(batch[2], batch[1])} == labels  # the in-process batch path maps too


def test_union_maps_image_labels_by_name(tmp_path):
    write_images(tmp_path / "x", "x", [[0, 1, 0]], classes=("cat", "dog"))
    write_images(tmp_path / "y", "y", [[0, 1]], classes=("ant", "cat"))
    union = shards.open_dataset([tmp_path / "x", tmp_path / "y"], "train", return_keys=True,
                                decode=shards.Decode(decoder=zero), mix=MixOptions(class_map="union"),
                                sampling=shards.Sampling(shuffle=False))
    assert {key: label for _, label, key in union} == {"x-00000": 1, "x-00001": 2, "x-00002": 1,
                                                         "y-00000": 0, "y-00001": 1}


def test_mixing_images_with_features_is_refused(tmp_path, two_feature_sources):
    write_images(tmp_path / "img", "i", [[0, 1, 2]])
    with pytest.raises(InputError, match="one kind"):
        shards.open_dataset([two_feature_sources[0], tmp_path / "img"], "train")


# -- subsets ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def read_log(monkeypatch):
    """Every image shard the reader opens (all reads go through ``_read_source_slice``)."""
    opened: list[str] = []
    original = ImageShardDataset._read_source_slice

    def logged(self, piece, *args):
        opened.append(Path(self.locations[piece.shard]).name)
        return original(self, piece, *args)

    monkeypatch.setattr(ImageShardDataset, "_read_source_slice", logged)
    return opened


def test_a_class_subset_yields_that_class_and_never_opens_other_shards(tmp_path, read_log):
    # Shard 0 holds only class 0, shard 1 only class 2, shard 2 both.
    write_images(tmp_path / "d", "d", [[0, 0, 0], [2, 2], [0, 2, 0, 2]])
    subset = shards.open_dataset(SourceSpec(tmp_path / "d", subset=Subset(classes=["a"])), "train", return_keys=True,
                                 decode=shards.Decode(decoder=zero))
    assert len(subset) == 5
    assert read_log == ["train-000002.tar"]  # the mixed shard is read once at open to find its rows
    got = list(subset)
    assert sorted(k for _, _, k in got) == ["d-00000", "d-00001", "d-00002", "d-00005", "d-00007"]
    assert {label for _, label, _ in got} == {0}
    assert "train-000001.tar" not in read_log
    # Streaming read the mixed shard's two scattered rows in one read (plan.covering_reads), not one per row.
    assert read_log.count("train-000002.tar") == 2 and read_log.count("train-000000.tar") == 1


def test_an_old_manifest_without_class_counts_still_subsets_by_reading(tmp_path, read_log):
    write_images(tmp_path / "old", "o", [[0, 0], [1, 1, 0]], classes=("a", "b"), class_counts=False)
    subset = shards.open_dataset(SourceSpec(tmp_path / "old", subset=Subset(classes=["b"])), "train",
                                 return_keys=True, decode=shards.Decode(decoder=zero))
    assert sorted(k for _, _, k in subset) == ["o-00002", "o-00003"]
    assert sorted(set(read_log)) == ["train-000000.tar", "train-000001.tar"]


def test_keys_where_and_max_samples(tmp_path):
    write_images(tmp_path / "d", "d", [[0, 1, 2, 0], [1, 2, 0, 1]], sizes=[10, 300, 256, 40, 500, 7, 9, 260])
    (tmp_path / "keys.txt").write_text("\ufeffd-00001\nd-00004\n\nd-00006\n", encoding="utf-8")
    by_keys = shards.open_dataset(SourceSpec(tmp_path / "d", subset=Subset(keys=tmp_path / "keys.txt")), "train",
                                  return_keys=True, decode=shards.Decode(decoder=zero))
    assert sorted(k for _, _, k in by_keys) == ["d-00001", "d-00004", "d-00006"]
    once = Subset(keys=iter(["d-00002", "d-00003"]))  # an iterator from Python: read once, usable again
    for _ in range(2):  # (train and validation open the same subset)
        again = shards.open_dataset(SourceSpec(tmp_path / "d", subset=once), "train", return_keys=True,
                                    decode=shards.Decode(decoder=zero))
        assert sorted(k for _, _, k in again) == ["d-00002", "d-00003"]
    wide = shards.open_dataset(SourceSpec(tmp_path / "d", subset=Subset(where="width >= 256 and class != 'c'")),
                               "train", return_keys=True, decode=shards.Decode(decoder=zero))
    assert sorted(k for _, _, k in wide) == ["d-00001", "d-00004", "d-00007"]
    called = shards.open_dataset(SourceSpec(tmp_path / "d", subset=Subset(where=lambda f: f["width"] < 10)), "train",
                                 return_keys=True, decode=shards.Decode(decoder=zero))
    assert sorted(k for _, _, k in called) == ["d-00005", "d-00006"]
    first = shards.open_dataset(SourceSpec(tmp_path / "d", subset=Subset(max_samples=5)), "train", return_keys=True,
                                decode=shards.Decode(decoder=zero))
    assert sorted(k for _, _, k in first) == [f"d-{i:05d}" for i in range(5)]


def test_where_is_parsed_not_evaluated():
    assert Where("width >= 256 and mode in ('RGB', 'L')")({"width": 300, "mode": "L"})
    assert not Where("not (width > 1 or height > 1)")({"width": 2, "height": 0})
    for bad in ("__import__('os').system('touch /tmp/x')", "width.bit_length() > 3", "open('x')", "width + 1 > 3",
                "[x for x in y]"):
        with pytest.raises(InputError, match="not allowed|only"):
            Where(bad)
    with pytest.raises(InputError, match="has no field 'width'"):
        Where("width > 3")({"key": "k1", "height": 2})
    assert Where("width > -1 and -2.5 < height")({"width": 0, "height": 0})
    with pytest.raises(InputError, match="not allowed"):
        Where("-key == 1")  # minus applies to numbers only: refused when built, not a TypeError while filtering


def test_no_matching_sample_is_a_clear_error(tmp_path):
    write_images(tmp_path / "d", "d", [[0, 0]])
    with pytest.raises(InputError, match="no sample of this source matches"):
        shards.open_dataset(SourceSpec(tmp_path / "d", subset=Subset(where="width > 1000000")), "train")


def test_an_unknown_class_is_a_clear_error(tmp_path):
    write_images(tmp_path / "d", "d", [[0, 1]])
    with pytest.raises(InputError, match="no class 'zebra'"):
        shards.open_dataset(SourceSpec(tmp_path / "d", subset=Subset(classes=["zebra"])), "train")


def test_packed_datasets_filter_from_their_source_index_without_reading_shards(tmp_path, read_log):
    tree = write_image_folder(tmp_path / "src", ["cat", "dog", "eel"], per_class=6, size=(20, 16))
    for i in range(3):  # wider images
        (tree / "dog" / f"wide_{i}.jpg").write_bytes(class_image(1, 100 + i, (64, 16)))
    pack_manifest(PackConfig(str(tree), str(tmp_path / "out"), max_samples=5, seed=1, quiet=True))
    wide = shards.open_dataset(SourceSpec(tmp_path / "out", subset=Subset(where="width >= 64")), "train",
                               return_keys=True, decode=shards.Decode(decoder=zero))
    assert read_log == []  # rows came from source-index.jsonl
    assert len(wide) == 3
    keys = [k for _, _, k in wide]
    assert all("wide" in k for k in keys) and len(set(keys)) == 3


# -- resume ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixres")
    write_images(root / "p", "p", [[0, 1, 2] * 3, [1, 2] * 4, [0] * 6])  # 23 samples
    write_images(root / "q", "q", [[2, 0] * 3, [1] * 5])  # 11 samples
    return root / "p", root / "q"


def mixed_loader(sources, workers, *, batch=4, world=1, rank=0):
    p, q = sources
    dataset = shards.open_dataset([SourceSpec(p, weight=1), SourceSpec(q, weight=2)], "train", return_keys=True, seed=4,
                                  decode=shards.Decode(decoder=zero), sampling=shards.Sampling(shuffle_buffer=5),
                                  mix=MixOptions(epoch_size=30),
                                  distributed=shards.Distributed(rank=rank, world_size=world))
    return shards.make_loader(dataset, batch_size=batch, mode=workers_mode(workers, persistent=False), drop_last=False)


def batch_keys(batches):
    return [k for batch in batches for k in batch[2]]


@pytest.mark.parametrize("new_workers", [2, 1, 3])
@pytest.mark.slow
def test_mixing_resume_yields_exactly_the_remaining_samples(image_sources, new_workers):
    full = batch_keys(mixed_loader(image_sources, 2))
    assert len(full) == 30 and collections.Counter(k[0] for k in full) == {"p": 10, "q": 20}
    loader = mixed_loader(image_sources, 2)
    iterator = iter(loader)
    head = batch_keys(next(iterator) for _ in range(3))
    state = loader.state_dict()
    del iterator
    resumed = mixed_loader(image_sources, new_workers)
    resumed.load_state_dict(state)
    rest = batch_keys(resumed)
    assert collections.Counter(head + rest) == collections.Counter(full)  # repeats included, nothing lost or doubled
    if new_workers == 2:
        assert head + rest == full  # the same layout resumes bitwise exactly


def test_a_state_from_another_mixture_is_refused(image_sources):
    loader = mixed_loader(image_sources, 1)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    p, q = image_sources
    other = shards.make_loader(shards.open_dataset([SourceSpec(p, weight=2), SourceSpec(q, weight=1)], "train",
                                                   seed=4, decode=shards.Decode(decoder=zero),
                                                   mix=MixOptions(epoch_size=30)), batch_size=4,
                               mode=WorkerProcesses(1))
    with pytest.raises(InputError, match="another dataset"):
        other.load_state_dict(state)


def test_source_spec_parse():
    assert SourceSpec.parse("data/a:0.7") == SourceSpec("data/a", weight=0.7)
    assert SourceSpec.parse("data/a") == SourceSpec("data/a")
    assert SourceSpec.parse("s3://bucket/x:2") == SourceSpec("s3://bucket/x", weight=2.0)
    assert SourceSpec.parse("s3://bucket/x") == SourceSpec("s3://bucket/x")
    assert SourceSpec.parse("a:repeat=2").repeat == 2 and SourceSpec.parse("a:choose=5").choose == 5
    with pytest.raises(InputError, match="not a weight"):
        SourceSpec.parse("a:heavy")
    with pytest.raises(InputError, match="one of weight, repeat or choose"):
        SourceSpec("a", weight=1, repeat=2)


@pytest.mark.slow  # over half a second in the quick loop
def test_a_mixture_reads_through_the_node_cache_once_per_shard(image_sources, tmp_path):
    p, q = image_sources
    specs = [SourceSpec(p, weight=1), SourceSpec(q, weight=2, subset=Subset(classes=["b", "c"]))]

    def epochs(**cache):
        dataset = shards.open_dataset(specs, "train", return_keys=True, seed=4, decode=shards.Decode(decoder=zero),
                                      mix=MixOptions(epoch_size=30), **cache)
        loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2, persistent=False), drop_last=False)
        out = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            out.append([k for batch in loader for k in batch[2]])
        return dataset, out

    _, plain = epochs()
    cached, through_cache = epochs(remote=shards.Remote(shard_cache=shards.ShardCache(tmp_path / "cache", local=True)))
    assert through_cache == plain
    counts = cached.shard_cache.stats.snapshot()
    offsets = np.cumsum([0] + cached.split_info.shard_sizes)
    read = np.unique(np.concatenate([np.searchsorted(offsets, cached.mixture.stream(e), side="right") - 1
                                     for e in (0, 1)]))
    assert len(read) > 1 and counts["misses"] == len(read)  # each shard the two epochs read, fetched once
    assert counts["fetched_bytes"] == sum(cached.split_info.shards[int(i)].bytes for i in read)
    assert counts["hits"] > 0 and counts["refetches"] == 0


def test_a_malformed_source_index_is_a_manifest_error_naming_the_line(tmp_path):
    import hashlib

    from shards.errors import ManifestError

    tree = write_image_folder(tmp_path / "src", ["cat", "dog"], per_class=3, size=(20, 16))
    pack_manifest(PackConfig(str(tree), str(tmp_path / "out"), seed=1, quiet=True))
    index = tmp_path / "out" / "source-index.jsonl"
    lines = index.read_text(encoding="utf-8").splitlines()
    index.write_text("\n".join([lines[0], '{"shard": "train-000000.tar", "row": 1, "key": 7}', *lines[2:]]) + "\n")
    manifest = json.loads((tmp_path / "out" / "dataset.json").read_text())
    manifest["source_index"]["sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()  # as an attacker would
    del manifest["columns"]  # packed before the column index: a subset reads the source index
    (tmp_path / "out" / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="line 2 has no string key") as failure:
        shards.open_dataset(SourceSpec(tmp_path / "out", subset=Subset(where="width > 0")), "train")
    assert "source-index.jsonl" in str(failure.value) and "\n" not in str(failure.value)
