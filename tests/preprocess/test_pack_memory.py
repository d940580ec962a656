"""pack-shards in bounded memory: the scan and plan as columns (a few dozen bytes a file, not a Python object per
file), the columnar plan equal to the row-by-row one it replaced, a job pickling only its own shard, the reader
thread reused between files, and a killed (SIGKILL) multi-worker pack rerun to the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path

import pytest

from preprocess.pack import validate as validate_module
from preprocess.pack.plan import SAMPLE_OVERHEAD_BYTES, SHARD_OVERHEAD_BYTES, make_plan, split_order_key, stratified_val
from preprocess.pack.sources.columns import SourceSample, sample_key
from preprocess.pack.sources.scan import SourceScan, scan_source
from preprocess.pack.validate import InvalidImage, read_ahead, read_file
from shards.transport.storage import shard_name
from tests.helpers import class_image

PACKING = {"seed": 0, "shuffle": True, "val_fraction": 0.1, "max_samples": 100, "max_bytes": 1 << 20}
# Stored per file: the 24-byte path and 30 bytes of columns (offset, label, split, size, mtime); measured ~55
# bytes a file at peak, transients included. Before the columns a file cost ~710 (a Python object per file, a
# tuple and three strings): any design holding an object per file is far above this bound.
MAX_BYTES_PER_FILE = 160


def _empty_tree(root: Path, files: int, classes: int = 10) -> Path:
    """``files`` one-byte ``.jpg`` files: the scan and plan never open them, so their content does not matter."""
    for c in range(classes):
        (root / f"class{c:03d}").mkdir(parents=True)
    for i in range(files):
        (root / f"class{i % classes:03d}" / f"img_{i:07d}.jpg").write_bytes(b"x")
    return root


def _scan_and_plan_peak(root: Path) -> int:
    tracemalloc.start()
    try:
        plan = make_plan(scan_source(root), PACKING, "tar")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(len(s.samples) for s in plan.shards) == len(plan.scan.samples)
    return peak


@pytest.mark.slow
def test_scan_and_plan_memory_grows_by_a_few_dozen_bytes_a_file(tmp_path):
    small = _scan_and_plan_peak(_empty_tree(tmp_path / "small", 2_000))
    large = _scan_and_plan_peak(_empty_tree(tmp_path / "large", 20_000))
    per_file = (large - small) / 18_000
    assert per_file < MAX_BYTES_PER_FILE, f"{per_file:.0f} bytes a file"
    assert large < 20_000 * MAX_BYTES_PER_FILE + small


def _reference_plan(scan: SourceScan, packing: dict) -> tuple[list, str]:
    """The plan computed the slow way, one ``SourceSample`` at a time, as pack-shards did before the columns."""
    seed, samples = packing["seed"], list(scan.samples)
    groups: dict[str, list[SourceSample]] = defaultdict(list)
    for s in samples:
        groups[s.split or "train"].append(s)
    if packing["val_fraction"] > 0:
        by_class: dict[str, list[SourceSample]] = defaultdict(list)
        for s in sorted(groups["train"], key=lambda s: s.rel_path):
            by_class[scan.classes[s.label]].append(s)
        val_keys = {s.key for s in stratified_val(by_class, packing["val_fraction"], seed)}
        groups["val"] = [s for s in groups["train"] if s.key in val_keys]
        groups["train"] = [s for s in groups["train"] if s.key not in val_keys]
    shards = []
    for split in sorted((g for g in groups if groups[g]), key=split_order_key):
        ordered = list(groups[split])
        if packing["shuffle"]:
            ordered.sort(key=lambda s: s.rel_path)
            random.Random(f"{seed}/shuffle/{split}").shuffle(ordered)
        current, current_bytes, count = [], 0, 0
        for s in ordered + [None]:
            cost = 0 if s is None else s.size + SAMPLE_OVERHEAD_BYTES
            if current and (s is None or len(current) >= packing["max_samples"]
                            or current_bytes + cost > packing["max_bytes"] - SHARD_OVERHEAD_BYTES):
                shards.append((shard_name(split, count, "tar"), split, current))
                current, current_bytes, count = [], 0, count + 1
            if s is not None:
                current.append(s)
                current_bytes += cost
    digest = hashlib.sha256()
    header = {"packing": packing, "classes": list(scan.classes), "kind": scan.kind}
    digest.update(json.dumps(header, sort_keys=True).encode("utf-8"))
    for name, split, members in shards:
        rows = [[s.key, s.rel_path, s.size, s.mtime_ns, s.label] for s in members]
        digest.update(json.dumps([name, split, rows], ensure_ascii=False).encode("utf-8"))
    return [(name, split, [s.rel_path for s in members]) for name, split, members in shards], digest.hexdigest()


@pytest.mark.parametrize("trial", range(12))
def test_columnar_plan_equals_the_row_by_row_reference(trial):
    rng = random.Random(trial)
    classes = tuple(sorted({f"c{rng.randrange(9)}" for _ in range(rng.randrange(1, 6))}))
    splits = rng.choice([None, ("train", "test"), ("train", "holdout", "test")])
    base = "/data/list"
    rows, seen = [], set()
    for _ in range(rng.randrange(1, 400)):
        rel = "/".join(rng.choice(["a", "b", "a-b", "é", "z.z"]) for _ in range(rng.randrange(1, 4))) \
            + f"/{rng.randrange(10**6)}.jpg"
        if rel in seen:
            continue
        seen.add(rel)
        size = rng.choice([0, 1, 5000, rng.randrange(1, 1 << 21)])
        rows.append(SourceSample(sample_key(rel), rel, f"{base}/{rel}", rng.randrange(len(classes)),
                                 None if splits is None else rng.choice(splits), size, rng.randrange(1 << 62)))
    scan = SourceScan("csv", f"{base}/list.csv", classes, tuple(rows))  # list order, not sorted
    packing = {"seed": rng.randrange(100), "shuffle": rng.random() < 0.7,
               "val_fraction": 0.0 if splits and rng.random() < 0.5 else rng.choice([0.0, 0.1, 0.5]),
               "max_samples": rng.randrange(1, 60), "max_bytes": rng.choice([1, 10_000, 1 << 20, 1 << 28])}
    plan = make_plan(scan, packing, "tar")
    expected, digest = _reference_plan(scan, packing)
    assert [(s.name, s.split, [m.rel_path for m in s.samples]) for s in plan.shards] == expected
    assert plan.sha256 == digest


def test_a_shard_job_pickles_only_its_own_samples(tmp_path):
    plan = make_plan(scan_source(_empty_tree(tmp_path / "src", 600, classes=3)), {**PACKING, "max_samples": 10},
                     "tar")
    shard = plan.shards[7]
    copy = pickle.loads(pickle.dumps(shard))
    assert list(copy.samples) == list(shard.samples) and len(copy.samples) == 10
    assert len(pickle.dumps(shard)) * 20 < len(pickle.dumps(plan.scan.samples))  # 10 of 600 files
    assert all(os.path.isfile(s.abs_path) for s in copy.samples)


def test_the_read_after_a_hung_read_gets_a_new_reader_thread(tmp_path, monkeypatch):
    good = tmp_path / "good.jpg"
    good.write_bytes(class_image(0, 0))
    real = validate_module._read_regular
    monkeypatch.setattr(validate_module, "_read_regular",
                        lambda path, *limit: time.sleep(3) or b"" if path.endswith("hung.jpg") else real(path, *limit))
    with pytest.raises(InvalidImage, match="within 0.2 s"):
        read_file(str(tmp_path / "hung.jpg"), timeout_s=0.2)
    assert read_file(str(good), timeout_s=1) == good.read_bytes()  # not queued behind the hung read
    with pytest.raises(InvalidImage, match="no such file|cannot"):
        read_file(str(tmp_path / "missing.jpg"), timeout_s=1)


def test_a_hung_file_in_a_read_ahead_is_skipped_and_the_files_after_it_are_read(tmp_path, monkeypatch):
    paths = []
    for i in range(40):
        paths.append(tmp_path / f"{i:02d}.jpg")
        paths[-1].write_bytes(bytes([i]) * (i + 1))
    real = validate_module._read_regular
    monkeypatch.setattr(validate_module, "_read_regular",
                        lambda path, *limit: time.sleep(3) or b"" if path.endswith("05.jpg") else real(path, *limit))
    got = []
    with read_ahead([str(p) for p in paths]):
        for path in paths:
            try:
                got.append(read_file(str(path), timeout_s=0.3))
            except InvalidImage as exc:
                got.append(str(exc))
        assert read_file(str(paths[0]), timeout_s=1) == b"\x00"  # a path out of order is read on its own
    assert got[5] == "could not be opened and read within 0.3 s (hung file system?)"
    assert got[:5] + got[6:] == [p.read_bytes() for i, p in enumerate(paths) if i != 5]


def _files(out: Path) -> dict[str, bytes]:
    skip = {"dataset.json"}
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in skip and ".pack" not in p.parts}


@pytest.mark.slow
def test_a_sigkilled_two_worker_pack_reruns_to_the_same_bytes(tmp_path):
    src = tmp_path / "src"
    for c in range(4):
        (src / f"k{c}").mkdir(parents=True)
        for i in range(300):
            (src / f"k{c}" / f"{i:04d}.jpg").write_bytes(class_image(c, i % 7, size=(16, 12)))
    cli = "from preprocess.pack.cli import pack_shards_command; pack_shards_command()"
    command = [sys.executable, "-c", cli, str(src), "--shard-samples", "10", "--workers", "2", "--verify", "header",
               "--quiet", "--out"]
    subprocess.run(command + [str(tmp_path / "ref")], check=True, capture_output=True)
    out = tmp_path / "out"
    job = subprocess.Popen(command + [str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(out.glob(".pack/train-*.json"))) < 5 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(job.pid, signal.SIGKILL)  # the parent and its workers, mid-shard
    job.wait()
    assert not (out / "dataset.json").exists(), "finished before the kill: make the corpus bigger"
    subprocess.run(command + [str(out)], check=True, capture_output=True)
    reference, rerun = _files(tmp_path / "ref"), _files(out)
    assert sorted(rerun) == sorted(reference) and rerun == reference
    expected = json.loads((tmp_path / "ref" / "dataset.json").read_text())
    got = json.loads((out / "dataset.json").read_text())
    assert {k: v for k, v in got.items() if k != "created"} == {k: v for k, v in expected.items() if k != "created"}


def test_rows_given_as_tuples_keep_their_absolute_paths_when_the_source_moved():
    """``--append`` rebuilds a scan from relabelled rows under the root recorded at packing time; the rows' own
    base wins, so a source moved since then is still read where it is now."""
    paths = [("a/b.jpg", "/moved/src/a/b.jpg"), ("/x/y.jpg", "/x/y.jpg"), ("c.jpg", "/moved/src/c.jpg")]
    rows = [SourceSample(sample_key(rel), rel, path, 1, None, 10, 20) for rel, path in paths]
    scan = SourceScan("imagefolder", "/where/it/was", ("k0", "k1"), tuple(rows))
    assert list(scan.samples) == rows
    with pytest.raises(ValueError, match="not 'c.jpg' under /moved/src"):
        SourceScan("imagefolder", "/src", ("k",), tuple(rows[:2] + [rows[2]._replace(abs_path="/other/c.jpg")]))
