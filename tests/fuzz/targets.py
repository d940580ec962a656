"""The fuzz targets of files: manifests, run folders, pack-shards inputs (lists, Parquet, Arrow), shard formats (tar,
its byte index, HDF5), the column and source indexes, feature shards (docs/fuzzing.md lists what each calls)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from tests.fuzz import formats, readers
from tests.fuzz.mutate import Draw, mutate_bytes, mutate_json, mutate_json_lines
from tests.fuzz.registry import file_of, target
from tests.fuzz.seeds import Seeds, hf_metadata


def _policy(data: bytes) -> str:
    """The error policy of a stream, chosen by the input so a replay takes the same path: raise or skip (resync)."""
    return ("raise", "skip")[sum(data[:64]) % 2]


# -- manifests ------------------------------------------------------------------------------------------------------
@target("dataset_json", file_of("tar_dataset", "dataset.json"), mutate_json, suffix="json", examples=450)
def _dataset_json(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.check.inspect import summarize
    from shards.transport.manifest_io import load_manifest_at

    folder = seeds.copy("tar_dataset", work)
    (folder / "dataset.json").write_bytes(data)
    load_manifest_at(folder)
    summarize(folder)
    for split in ("train", "val"):
        readers.stream_split(folder, split, on_error=_policy(data))
    readers.verify(folder)
    readers.report(folder)


@target("features_json", file_of("pt_features", "features.json"), mutate_json, suffix="json", examples=450)
def _features_json(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.transport.manifest_io import load_manifest_at

    folder = seeds.copy("pt_features", work)
    (folder / "features.json").write_bytes(data)
    load_manifest_at(folder)
    readers.stream_split(folder, "train", on_error=_policy(data), images=False)
    readers.verify(folder)
    readers.report(folder)


# -- run folders (shards report, lineage) -----------------------------------------------------------------------------
def _run_folder(seeds: Seeds, work: Path, name: str, data: bytes) -> Path:
    import shutil

    folder = work / "run"
    shutil.copytree(seeds.path("run") / "run", folder)
    (folder / name).write_bytes(data)
    return folder


def _read_run(folder: Path, lineage: bool, curves: bool = True) -> None:
    """The report (``curves``: drawn by matplotlib, 0.3 s; only ``metrics.jsonl`` feeds them) and lineage."""
    from unittest import mock

    from shards.data_events import read_events
    from shards.report.run import read_run
    from shards.check.lineage import run_lineage

    if not curves:
        with mock.patch("shards.report.curves.curves_bytes", lambda *args, **kwargs: b"<svg></svg>"):
            _read_run(folder, lineage)
        return
    read_run(folder)
    read_events(folder)
    readers.report(folder)
    if lineage:
        run_lineage(folder, 1, 1)


@target("run_record", lambda seeds: (seeds.path("run") / "run" / "run.json").read_bytes(), mutate_json,
        suffix="json", examples=150)
def _run_record(data: bytes, seeds: Seeds, work: Path) -> None:
    _read_run(_run_folder(seeds, work, "run.json", data), lineage=True, curves=False)


@target("run_metrics", lambda seeds: (seeds.path("run") / "run" / "metrics.jsonl").read_bytes(), mutate_json_lines,
        examples=90)
def _run_metrics(data: bytes, seeds: Seeds, work: Path) -> None:
    # The curves cost 0.3 s of matplotlib: drawn for one input in 8 (chosen by the input, so a replay draws too).
    _read_run(_run_folder(seeds, work, "metrics.jsonl", data), lineage=False, curves=sum(data[:64]) % 8 == 0)


@target("run_events", lambda seeds: (seeds.path("run") / "run" / "data-events.jsonl").read_bytes(),
        mutate_json_lines, examples=150)
def _run_events(data: bytes, seeds: Seeds, work: Path) -> None:
    _read_run(_run_folder(seeds, work, "data-events.jsonl", data), lineage=True, curves=False)


# -- pack-shards inputs: lists, Parquet, Arrow ------------------------------------------------------------------------
def _scan_and_pack(source: Path, work: Path) -> None:
    from preprocess.pack.packer import PackConfig, pack_manifest
    from preprocess.pack.sources.scan import scan_source

    scan_source(source)
    pack_manifest(PackConfig(str(source), str(work / "out"), max_samples=2, quiet=True))


def _mutate_csv(draw: Draw, seed: bytes) -> bytes:
    return mutate_bytes(draw, seed, tokens=(b'"', b'""', b'"a\nb"', b",,,,", b"\r", b"path,label", b"\x00",
                                            b"../../../etc/passwd", b"/dev/zero", b"split"))


@target("list_csv", file_of("lists", "list.csv"), _mutate_csv, examples=450)
def _list_csv(data: bytes, seeds: Seeds, work: Path) -> None:
    from preprocess.pack.sources.scan import scan_source

    folder = seeds.copy("lists", work)
    (folder / "list.csv").write_bytes(data)
    scan_source(folder / "list.csv")


@target("list_jsonl", file_of("lists", "list.jsonl"), mutate_json_lines, examples=450)
def _list_jsonl(data: bytes, seeds: Seeds, work: Path) -> None:
    from preprocess.pack.sources.scan import scan_source

    folder = seeds.copy("lists", work)
    (folder / "list.jsonl").write_bytes(data)
    scan_source(folder / "list.jsonl")


@target("parquet", file_of("parquet", "train-00000-of-00001.parquet"), mutate_bytes, examples=90, native=True)
def _parquet(data: bytes, seeds: Seeds, work: Path) -> None:
    path = work / "src" / "train-00000-of-00001.parquet"
    path.parent.mkdir()
    path.write_bytes(data)
    _scan_and_pack(path, work)


@target("parquet_hf_metadata", lambda seeds: hf_metadata(), mutate_json, suffix="json", examples=60, native=True)
def _parquet_hf_metadata(data: bytes, seeds: Seeds, work: Path) -> None:
    from tests.fuzz.seeds import image_table, write_parquet

    path = work / "src" / "train.parquet"
    write_parquet(path, image_table(metadata=data))
    _scan_and_pack(path, work)


def _arrow_target(name: str, file: str, mutate: Callable[[Draw, bytes], bytes], suffix: str, examples: int) -> None:
    """A ``save_to_disk`` folder with ``file`` replaced, scanned and packed."""
    @target(name, file_of("arrow", file), mutate, suffix=suffix, examples=examples, native=True)
    def run(data: bytes, seeds: Seeds, work: Path) -> None:
        folder = seeds.copy("arrow", work)
        (folder / file).write_bytes(data)
        _scan_and_pack(folder, work)


_arrow_target("arrow_stream", "train/data-00000-of-00001.arrow", mutate_bytes, "bin", 90)
_arrow_target("arrow_state_json", "train/state.json", mutate_json, "json", 40)
_arrow_target("arrow_info_json", "train/dataset_info.json", mutate_json, "json", 40)
_arrow_target("arrow_dict_json", "dataset_dict.json", mutate_json, "json", 40)


# -- shard formats --------------------------------------------------------------------------------------------------
@target("tar_shard", file_of("tar_dataset", "train-000000.tar"), formats.mutate_tar, examples=300)
def _tar_shard(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.formats.tar import iter_tar_shard

    folder = seeds.copy("tar_dataset", work)
    path = readers.replace_file(folder, "train-000000.tar", data)
    readers.drain(iter_tar_shard(path))
    readers.stream_split(folder, "train", on_error=_policy(data))
    readers.verify(folder)


@target("tar_index", file_of("tar_dataset", "train-000000.tar.idx"), mutate_bytes, examples=300)
def _tar_index(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.formats.tarindex import load_local_index
    from shards.formats.tarseek import iter_tar_slice
    from shards.manifest import load_dataset_manifest

    folder = seeds.copy("tar_dataset", work)
    readers.replace_file(folder, "train-000000.tar.idx", data)
    info = load_dataset_manifest(folder).splits["train"].shards[0]
    offsets = load_local_index(folder / info.path, info)
    if offsets is not None:
        readers.drain(iter_tar_slice(folder / info.path, 1, None, offsets=offsets, resync=True))
    readers.stream_split(folder, "train", on_error=_policy(data))
    readers.verify(folder)


@target("hdf5_shard", file_of("hdf5_dataset", "train-000000.h5"), formats.mutate_h5, examples=120, native=True)
def _hdf5_shard(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.formats.hdf5 import iter_hdf5_shard, shard_length

    folder = seeds.copy("hdf5_dataset", work)
    path = readers.replace_file(folder, "train-000000.h5", data)
    shard_length(path)
    readers.drain(iter_hdf5_shard(path, resync=True))
    readers.stream_split(folder, "train", on_error=_policy(data))
    readers.verify(folder)


# -- the column index and the source index --------------------------------------------------------------------------
WIDTH_COLUMN = "columns/train/c006.npy"  # the ``width`` column (int64) of the packed seed's train split


@target("npy_column", file_of("tar_dataset", WIDTH_COLUMN), formats.mutate_npy, examples=300)
def _npy_column(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards import SourceSpec, Subset
    from shards.select.columns import open_columns, verify_columns
    from shards.manifest import load_dataset_manifest

    folder = seeds.copy("tar_dataset", work)
    readers.replace_file(folder, WIDTH_COLUMN, data)
    manifest = load_dataset_manifest(folder)
    columns = open_columns(folder, manifest, "train")
    for name in columns.fields:
        columns.column(name)[:].tolist()
        columns.present(name)
    verify_columns(folder, manifest)
    readers.stream_split(SourceSpec(str(folder), subset=Subset(where="width >= 8 and mode == 'RGB'")))


@target("source_index", file_of("tar_dataset", "source-index.jsonl"), mutate_json_lines, examples=300)
def _source_index(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards import SourceSpec, Subset

    folder = seeds.copy("tar_dataset", work)
    manifest = json.loads((folder / "dataset.json").read_text())
    del manifest["columns"]  # without a column index, a filter reads the source index
    (folder / "dataset.json").write_text(json.dumps(manifest))
    readers.replace_file(folder, "source-index.jsonl", data)
    readers.stream_split(SourceSpec(str(folder), subset=Subset(where="width >= 8 and class != 'x'")))
    readers.verify(folder)


def _keys_seed(seeds: Seeds) -> bytes:
    lines = (seeds.path("tar_dataset") / "source-index.jsonl").read_text().splitlines()
    return "".join(json.loads(line)["key"] + "\n" for line in lines[::2]).encode()


@target("keys_file", _keys_seed, mutate_bytes, examples=150)
def _keys_file(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards import SourceSpec, Subset

    keys = work / "keys.txt"
    keys.write_bytes(data)
    folder = seeds.path("tar_dataset")  # read only
    readers.stream_split(SourceSpec(str(folder), subset=Subset(keys=str(keys))))
    readers.stream_split(SourceSpec(str(folder), subset=Subset(exclude_keys=str(keys))))


# -- feature shards ---------------------------------------------------------------------------------------------------
def _feature_target(name: str, artifact: str, file: str, mutate: Callable[[Draw, bytes], bytes]) -> None:
    @target(name, file_of(artifact, file), mutate, examples=90, native=True)
    def run(data: bytes, seeds: Seeds, work: Path) -> None:
        from shards.formats.features import FeatureSpec, check_feature_shard, load_feature_shard
        from shards.manifest import load_feature_manifest

        folder = seeds.copy(artifact, work)
        path = readers.replace_file(folder, file, data, manifest="features.json")
        manifest = load_feature_manifest(folder)
        check_feature_shard(load_feature_shard(path), path, manifest.splits["train"].shards[0].samples,
                            FeatureSpec.of(manifest))
        readers.stream_split(folder, "train", images=False)
        readers.verify(folder)


_feature_target("feature_pt", "pt_features", "train-000000.pt", formats.mutate_pt)
_feature_target("feature_h5", "h5_features", "train-000000.h5", formats.mutate_h5)
