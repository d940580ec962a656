"""Writers lock their output folder: a second writer exits 2 with one line, task arrays still share a folder,
and temp names never collide between processes or hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from preprocess.features.featurize import FeatureConfig, merge_features, run_precompute
from preprocess.features import state as feature_state
from preprocess.pack import parts
from preprocess.pack.packer import PackConfig, pack_manifest
from shards import atomic
from shards.lock import OutputLockedError, output_lock
from shards.manifest import load_dataset_manifest, load_feature_manifest
from tests.helpers import make_shard_dataset, write_image_folder

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
PACK = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from preprocess.pack.cli import pack_shards_command as c; c()"


def pack_cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PACK, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    return process.returncode, stderr


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def listing(folder: Path) -> dict[str, int]:
    """Every file but the lock files (which any writer, refused or not, may create) with its mtime."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith("lock")}


@pytest.fixture
def src(tmp_path):
    return write_image_folder(tmp_path / "src", ["cat", "dog", "eel"], 6, size=(24, 16))


def assert_refused(returncode: int, stderr: str, out: Path) -> None:
    assert returncode == 2, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and str(out) in lines[0] and "another process is writing here" in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.slow  # over half a second in the quick loop
def test_second_pack_into_a_locked_folder_exits_2_and_writes_nothing(src, tmp_path):
    out = tmp_path / "out"
    with output_lock(out, ".pack/lock.task-0-of-1", what="pack-shards task 0 of 1"):
        before = listing(out)
        code, stderr = finish(pack_cli(src, "--out", out, "--quiet"))
        assert listing(out) == before
    assert_refused(code, stderr, out)
    assert f"pid {os.getpid()}" in stderr  # names who holds it
    assert not (out / "dataset.json").exists() and not list(out.glob("*.tar"))


@pytest.mark.parametrize("extra", [pytest.param([], marks=pytest.mark.slow), pytest.param(["--append"], marks=pytest.mark.slow),
                                   pytest.param(["--overwrite"], marks=pytest.mark.slow)])
def test_pack_append_and_overwrite_are_refused_while_an_append_holds_the_folder(src, tmp_path, extra):
    out = tmp_path / "out"
    pack_manifest(PackConfig(str(src), str(out), max_samples=5, quiet=True))
    if extra:
        write_image_folder(src, ["cat"], 8, size=(24, 16))  # something new, so append and overwrite have work
    before = listing(out)
    with output_lock(out, ".pack/lock", what="pack-shards --append"):  # what an append holds
        code, stderr = finish(pack_cli(src, "--out", out, "--quiet", "--shard-samples", "5", *extra))
    assert_refused(code, stderr, out)
    assert listing(out) == before


@pytest.mark.slow
def test_merge_and_append_refuse_while_a_task_is_packing(src, tmp_path):
    out = tmp_path / "out"
    pack_manifest(PackConfig(str(src), str(out), max_samples=5, quiet=True))
    before = listing(out)
    with output_lock(out, ".pack/lock", shared=True):  # what every running task holds
        for args in (["--merge", out], [src, "--out", out, "--append"]):
            code, stderr = finish(pack_cli(*args, "--quiet"))
            assert_refused(code, stderr, out)
    assert listing(out) == before


@pytest.mark.slow
def test_two_concurrent_packs_never_crash_and_leave_one_good_dataset(src, tmp_path):
    out = tmp_path / "out"
    runs = [pack_cli(src, "--out", out, "--quiet", "--shard-samples", "2") for _ in range(2)]
    results = [finish(run) for run in runs]
    assert {code for code, _ in results} <= {0, 2} and 0 in {code for code, _ in results}
    for code, stderr in results:
        assert "Traceback" not in stderr
        if code == 2:
            assert len(error_lines(stderr)) == 1
    pack_manifest(PackConfig(str(src), str(tmp_path / "ref"), max_samples=2, quiet=True))
    shards = lambda folder: {p.name: p.read_bytes() for p in folder.glob("*.tar")}  # noqa: E731
    assert shards(out) == shards(tmp_path / "ref")
    assert load_dataset_manifest(out).splits == load_dataset_manifest(tmp_path / "ref").splits
    assert not list(out.glob("*.tmp"))


@pytest.mark.slow
def test_task_array_processes_still_pack_one_folder_together(src, tmp_path):
    out = tmp_path / "out"
    tasks = [pack_cli(src, "--out", out, "--quiet", "--shard-samples", "2", "--task-index", i, "--num-tasks", 3)
             for i in range(3)]
    results = [finish(task) for task in tasks]
    assert [code for code, _ in results] == [0, 0, 0], [stderr for _, stderr in results]
    manifest = load_dataset_manifest(out)
    assert sum(split.samples for split in manifest.splits.values()) == 18
    assert len(manifest.splits["train"].shards) == 9


@pytest.mark.slow
def test_a_killed_holder_leaves_no_stale_lock(src, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from shards.lock import output_lock\n"
        f"with output_lock({str(out)!r}, '.pack/lock.task-0-of-1'):\n    print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert_refused(*finish(pack_cli(src, "--out", out, "--quiet")), out)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=TIMEOUT_S)
    code, stderr = finish(pack_cli(src, "--out", out, "--quiet"))
    assert code == 0, stderr
    assert (out / "dataset.json").is_file()


def test_overwrite_never_deletes_lock_files(src, tmp_path):
    out = tmp_path / "out"
    pack_manifest(PackConfig(str(src), str(out), max_samples=5, quiet=True))
    lock_files = {p.name for p in (out / ".pack").glob("lock*")}
    assert "lock" in lock_files and "lock.task-0-of-1" in lock_files
    pack_manifest(PackConfig(str(src), str(out), max_samples=3, overwrite=True, quiet=True))
    assert lock_files <= {p.name for p in (out / ".pack").glob("lock*")}


def test_temp_names_are_unique_per_host_process_and_call(tmp_path):
    final = tmp_path / "dataset.json"
    names = {atomic.unique_tmp_path(final).name for _ in range(50)}
    assert len(names) == 50
    assert all(name.startswith("dataset.json.") and name.endswith(".tmp") and f".{os.getpid()}." in name
               for name in names)
    assert all(atomic.tmp_target(name) == "dataset.json" for name in names)
    assert atomic.tmp_target("train-000001.tar.tmp") is None  # not a name our writers make: not ours to remove
    # One implementation of the shared-manifest writer, used by packing and featurising alike.
    assert parts.write_json_shared is atomic.write_json_shared is feature_state.write_json_shared


def test_leftover_temp_files_of_a_killed_run_are_cleaned_by_the_rerun(src, tmp_path):
    out = tmp_path / "out"
    pack_manifest(PackConfig(str(src), str(out), max_samples=5, quiet=True))
    (out / "dataset.json").unlink()
    (out / "train-000001.tar.node7.4242.0badc0de.tmp").write_bytes(b"half a shard")
    (out / "train-000002.tar.tmp").write_bytes(b"a user's own file")
    pack_manifest(PackConfig(str(src), str(out), max_samples=5, quiet=True))
    assert [p.name for p in out.glob("*.tmp")] == ["train-000002.tar.tmp"]
    (out / "train-000002.tar.tmp").unlink()
    (out / "dataset.json.node7.4242.0badc0de.tmp").write_text("{")
    pack_manifest(PackConfig(str(src), str(out), max_samples=3, overwrite=True, quiet=True))
    assert not list(out.glob("*.tmp"))


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_shard_dataset(root, shard_sizes={"train": [3, 2]}, storage="tar")
    return root


def feature_config(data_dir: Path, out_dir: Path, **changes) -> FeatureConfig:
    options = dict(backbone="resnet18", weights="none", resize=40, crop=32, batch_size=4, workers=0, quiet=True)
    return FeatureConfig(data_dir=data_dir, out_dir=out_dir, **{**options, **changes})


def test_second_precompute_into_a_locked_folder_is_refused(image_dataset, tmp_path):
    out = tmp_path / "feat"
    with output_lock(out, ".precompute/lock.task-0-of-1", what="precompute-features task 0 of 1"):
        before = listing(out)
        with pytest.raises(OutputLockedError, match="another process is writing here") as refused:
            run_precompute(feature_config(image_dataset, out))
        assert listing(out) == before
    assert str(out) in str(refused.value) and "\n" not in str(refused.value)
    with output_lock(out, ".precompute/lock", shared=True):  # a task is running: no --merge, no --overwrite
        with pytest.raises(OutputLockedError):
            (out / ".precompute" / "config.json").write_text("{}")
            merge_features(out)
    (out / ".precompute" / "config.json").unlink()


@pytest.mark.slow  # four featurize runs
def test_precompute_task_array_and_overwrite_still_work(image_dataset, tmp_path):
    out = tmp_path / "feat"
    assert run_precompute(feature_config(image_dataset, out, task_index=0, num_tasks=2))[0] is None
    with output_lock(out, ".precompute/lock.task-0-of-2"):  # task 0 busy again; task 1 is not held up
        manifest, _ = run_precompute(feature_config(image_dataset, out, task_index=1, num_tasks=2))
    assert manifest is not None and load_feature_manifest(out) == manifest
    (out / "train-000000.pt.node7.4242.0badc0de.tmp").write_bytes(b"partial")
    (out / "train-000000.pt").unlink()
    run_precompute(feature_config(image_dataset, out))
    assert not list(out.glob("*.tmp"))
    manifest, _ = run_precompute(feature_config(image_dataset, out, dtype="float32", overwrite=True))
    assert manifest.dtype == "float32" and (out / ".precompute" / "lock").is_file()
