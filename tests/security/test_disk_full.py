"""A disk that fills up while ``pack-shards``, ``precompute-features`` or ``train-from-shards`` writes to it.

Each command stops with exit code 1 and one ``error:`` line naming the folder and the space left there; nothing
partial is left under a final name and no temp file is left behind; and once there is room, a rerun finishes with
what a clean run gives.

The disk is a real one where this process may mount a small ``tmpfs`` (root on Linux), else a simulated one: every
file opened for writing under the folder shares a budget of bytes, and a write past it fails with ``ENOSPC`` as the
kernel's would. Both run here when they can; neither is ever skipped.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from preprocess.pack.cli import pack_shards_command
import shards.atomic
from shards.atomic import TMP_SUFFIX, atomic_output, write_bytes_atomic
from shards.data_events import append_event
from tests.helpers import write_image_folder
from tests.train.conftest import write_feature_folder
from train.cli import train_command


def can_mount() -> bool:
    probe = Path("/proc/self/mounts")
    if not probe.exists() or shutil.which("mount") is None:
        return False
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", folder], capture_output=True)
        if done.returncode != 0:
            return False
        subprocess.run(["umount", folder], check=True)
    return True


MOUNTABLE = can_mount()


class _Simulated:
    """``size`` bytes under ``folder``: what its files hold (a file open for writing here, what was written to it,
    buffered or not), so removing a file frees its bytes as on a real disk."""

    def __init__(self, folder: Path, size: int):
        self.folder, self.size, self.writing = str(folder.resolve()), size, {}

    def covers(self, file: object, mode: str) -> bool:
        if not isinstance(file, (str, Path)) or not any(m in mode for m in "wax+"):
            return False
        return str(Path(file).resolve()).startswith(self.folder + "/")

    def free(self) -> int:
        used = 0
        for path in Path(self.folder).rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                if path.is_file():
                    used += max(path.stat().st_size, self.writing.get(str(path.resolve()), 0))
        return max(0, self.size - used)


class _LimitedFile:
    """A file on the simulated disk: a write past its free space fails with ENOSPC (after writing what still
    fitted), as the kernel's would. HDF5 writes through its own C calls, not this: the simulated disk counts its
    files' bytes and reaches it through ``shutil.disk_usage``."""

    def __init__(self, handle, path: str, disk: _Simulated):
        self._handle, self._path, self._disk = handle, path, disk
        disk.writing[path] = 0

    def write(self, data) -> int:
        size = len(data.encode("utf-8")) if isinstance(data, str) else memoryview(data).nbytes
        free = self._disk.free()
        if size > free:
            if free and not isinstance(data, str):
                self._handle.write(memoryview(data).cast("B")[:free])
                self._disk.writing[self._path] += free
            raise OSError(errno.ENOSPC, "No space left on device")
        self._disk.writing[self._path] += size
        return self._handle.write(data)

    def close(self) -> None:
        self._disk.writing.pop(self._path, None)
        self._handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


class Disk:
    """A folder of ``size`` bytes: ``grow()`` makes room, as freeing space on the disk would."""

    def __init__(self, root: Path, size: int, real: bool, monkeypatch: pytest.MonkeyPatch):
        self.root, self.size, self.real = root, size, real
        self._monkeypatch = monkeypatch
        root.mkdir(parents=True, exist_ok=True)
        if real:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)], check=True)
        else:
            simulated = _Simulated(root, size)
            real_open, real_usage = builtins.open, shutil.disk_usage

            def limited_open(file, mode="r", *args, **kwargs):
                handle = real_open(file, mode, *args, **kwargs)
                if not simulated.covers(file, mode):
                    return handle
                return _LimitedFile(handle, str(Path(file).resolve()), simulated)

            def usage(path):  # what a writer that asks first (``check_room``) sees of the simulated disk
                if not str(Path(path).resolve()).startswith(simulated.folder):
                    return real_usage(path)
                free = simulated.free()
                return real_usage(path)._replace(total=size, used=size - free, free=free)

            for module in (builtins, io):
                monkeypatch.setattr(module, "open", limited_open)
            monkeypatch.setattr(shutil, "disk_usage", usage)

    def grow(self) -> None:
        if self.real:
            subprocess.run(["mount", "-o", "remount,size=64m", str(self.root)], check=True)
        else:
            self._monkeypatch.undo()

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.root)], check=False)


class Disks:
    """Makes ``Disk`` folders: real ones (``real``) where this process can mount a tmpfs and the test asks for
    them, else simulated ones."""

    def __init__(self, root: Path, real: bool, monkeypatch: pytest.MonkeyPatch):
        self.root, self.real, self._monkeypatch, self.made = root, real, monkeypatch, []

    def __call__(self, size: int) -> Disk:
        disk = Disk(self.root / f"disk{len(self.made)}", size, self.real, self._monkeypatch)
        self.made.append(disk)
        return disk


@pytest.fixture(params=["tmpfs", "simulated"])
def small_disk(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Disks]:
    """``small_disk(size)`` -> a ``Disk`` of ``size`` bytes: a tmpfs where mounting works (else simulated), or a
    simulated one."""
    disks = Disks(tmp_path, request.param == "tmpfs" and MOUNTABLE, monkeypatch)
    yield disks
    for disk in disks.made:
        disk.close()


def assert_one_line(result, folder: Path) -> str:
    assert result.exit_code == 1, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    line = lines[0]
    assert str(folder) in line and "no space left on device" in line and " free of " in line, line
    return line


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(TMP_SUFFIX)]


# -- the door itself ---------------------------------------------------------------------------------------------
def test_atomic_output_turns_enospc_into_one_line_and_removes_its_temp(small_disk):
    disk = small_disk(16 << 10)
    target = disk.root / "out" / "big.bin"
    with pytest.raises(shards.atomic.DiskFullError) as caught:
        write_bytes_atomic(target, b"x" * (256 << 10))
    assert caught.value.errno == errno.ENOSPC
    assert str(target.parent) in str(caught.value) and " free of " in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not target.exists() and not temp_files(disk.root)


def test_a_torch_save_through_atomic_output_is_a_disk_full_error(small_disk):
    """The path every checkpoint takes (``train.run.checkpoint.save_checkpoint``): torch writes to the handle."""
    disk = small_disk(16 << 10)
    target = disk.root / "last.pt"
    with pytest.raises(shards.atomic.DiskFullError):
        with atomic_output(target) as tmp, open(tmp, "wb") as handle:
            torch.save({"weights": torch.zeros(1 << 16)}, handle)
    assert not target.exists() and not temp_files(disk.root)


def test_an_appended_event_on_a_full_disk_is_one_line(small_disk):
    disk = small_disk(4 << 10)
    with pytest.raises(shards.atomic.DiskFullError) as caught:
        for _ in range(200):
            append_event(disk.root, {"kind": "restart", "padding": "x" * 200})
    assert str(disk.root) in str(caught.value)


# -- pack-shards ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("src") / "src", ["ant", "bee"], 24)


def same_dataset(one: Path, other: Path) -> bool:
    first, second = (json.loads((folder / "dataset.json").read_text()) for folder in (one, other))
    first.pop("created"), second.pop("created")
    names = [s["path"] for split in first["splits"].values() for s in split["shards"]]
    return first == second and all((one / n).read_bytes() == (other / n).read_bytes() for n in names)


def no_partial_shards(out: Path) -> None:
    """Every shard under a final name is a finished one (its part manifest records its very bytes)."""
    for shard in [*out.glob("*.tar"), *out.glob("*.h5")]:
        part = out / ".pack" / f"{shard.name}.json"
        if part.exists():
            assert json.loads(part.read_text())["shard"]["bytes"] == shard.stat().st_size
        else:  # written, its part not yet: complete still (renamed only once whole), and packed again by a rerun
            assert shard.stat().st_size % 512 == 0 or shard.suffix == ".h5"
    assert not temp_files(out)


@pytest.mark.parametrize("size,workers,storage", [(24 << 10, 1, "tar"), (160 << 10, 1, "tar"), (160 << 10, 2, "tar"),
                                                  (24 << 10, 1, "hdf5"), (160 << 10, 1, "hdf5")], ids=str)
@pytest.mark.slow
def test_pack_shards_on_a_full_disk_stops_in_one_line_and_a_rerun_finishes(small_disk, source: Path,
                                                                          tmp_path: Path, size: int, workers: int,
                                                                          storage: str):
    """A disk too small for the first shard, and one that fills up a few shards in (in worker processes too: on a
    real disk; the simulated one lives in this process only, so there its shards are packed here)."""
    workers = workers if small_disk.real else 1
    clean = tmp_path / "clean"
    args = ["--shard-samples", "8", "--val-fraction", "0.25", "--quiet", "--workers", str(workers), "--storage",
            storage]
    assert CliRunner().invoke(pack_shards_command, [str(source), "--out", str(clean), *args]).exit_code == 0
    disk = small_disk(size)
    out = disk.root / "out"
    result = CliRunner().invoke(pack_shards_command, [str(source), "--out", str(out), *args])
    assert_one_line(result, disk.root)
    assert not (out / "dataset.json").exists()
    no_partial_shards(out)
    disk.grow()
    result = CliRunner().invoke(pack_shards_command, [str(source), "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    assert same_dataset(out, clean) and not temp_files(out)


# -- precompute-features -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(source: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "data"
    result = CliRunner().invoke(pack_shards_command, [str(source), "--out", str(out), "--shard-samples", "12",
                                                      "--quiet"])
    assert result.exit_code == 0, result.output
    return out


FEATURES = ["--backbone", "resnet18", "--weights", "none", "--resize", "40", "--crop", "32", "--batch-size", "8",
            "--workers", "0", "--device", "cpu", "--quiet"]


@pytest.mark.parametrize("storage", ["pt", "hdf5"])
@pytest.mark.slow
def test_precompute_features_on_a_full_disk_stops_in_one_line_and_a_rerun_finishes(small_disk, dataset: Path,
                                                                                  tmp_path: Path, storage: str):
    clean = tmp_path / "clean"
    args = [*FEATURES, "--format", storage]
    result = CliRunner().invoke(precompute_features_command, [str(dataset), "--out", str(clean), *args])
    assert result.exit_code == 0, result.output
    first = min(p.stat().st_size for p in clean.iterdir() if p.suffix in (".pt", ".h5"))
    disk = small_disk((4 << 10) + first // 2)  # room for the run's record, not for its first feature shard
    out = disk.root / "features"
    result = CliRunner().invoke(precompute_features_command, [str(dataset), "--out", str(out), *args])
    assert_one_line(result, disk.root)
    assert not (out / "features.json").exists() and not temp_files(out)
    assert not [p for p in out.iterdir() if p.suffix in (".pt", ".h5")]
    disk.grow()
    result = CliRunner().invoke(precompute_features_command, [str(dataset), "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    mine, theirs = (json.loads((folder / "features.json").read_text()) for folder in (out, clean))
    for manifest in (mine, theirs):
        manifest.pop("created")
    assert mine["splits"] == theirs["splits"] and mine["config_hash"] == theirs["config_hash"]


# -- train-from-shards checkpoints ---------------------------------------------------------------------------------
TRAIN = ["--epochs", "2", "--batch-size", "4", "--device", "cpu", "--quiet", "--workers", "0", "--no-report"]


@pytest.mark.slow
def test_a_checkpoint_on_a_full_disk_stops_training_in_one_line_and_a_resume_finishes(small_disk, tmp_path: Path):
    data = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [8, 8], "val": [4]}, classes=("a", "b"),
                                dim=4)
    clean = tmp_path / "clean"
    result = CliRunner().invoke(train_command, [str(data), "--out", str(clean), *TRAIN])
    assert result.exit_code == 0, result.output
    before_checkpoint = sum((clean / name).stat().st_size for name in ("config.json", "data-events.jsonl"))
    # Room for the run's config, its layout event and its first metrics row, not for its first checkpoint (a
    # tmpfs gives each file whole 4 KiB pages).
    disk = small_disk(16 << 10 if small_disk.real else before_checkpoint + 4096)
    run = disk.root / "run"
    result = CliRunner().invoke(train_command, [str(data), "--out", str(run), *TRAIN])
    assert_one_line(result, disk.root)
    assert not (run / "last.pt").exists() and not (run / "model.pt").exists() and not temp_files(run)
    disk.grow()
    result = CliRunner().invoke(train_command, [str(data), "--out", str(run), "--resume", *TRAIN])
    assert result.exit_code == 0, result.output
    mine, theirs = (torch.load(folder / "model.pt", weights_only=True) for folder in (run, clean))
    assert mine["state_dict"].keys() == theirs["state_dict"].keys()
    assert all(torch.equal(mine["state_dict"][k], theirs["state_dict"][k]) for k in mine["state_dict"])

