"""Round three on the node cache, written as another user of a shared cache folder would attack it: every lock,
lease, plan, reservation and copy under ``<dir>/v1`` may have been planted by someone else.

- A plan that is a FIFO, a link out of the folder (to a valid plan, or to ``/dev/zero``), a directory, a sparse
  3 GiB file, or JSON of the wrong shape (``2.5``, ``"1"``, ``true``, ``1e30`` for a count) is ignored, with one
  warning per file for the life of the process (not one per eviction scan) naming the file and, for a shape, the
  field.
- A lock or lease file that is a link (out of the folder, or to ``/dev/zero``), a directory or a FIFO is never
  opened through and never crashes or hangs a reader: the shard is read from the source, with one warning.
- A reservation planted as a link is never written through; a forged one cannot claim more than the limit.
- A copy planted as a link or a FIFO is replaced (never served through the link, never hashed from the FIFO).
- Two users share one cache: a job of another user reads the first user's copies, adds its own, and what it may
  not remove (a sticky folder, a lease it may not read) is left with one warning, never a crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from shards.cache.node import NodeCache, ShardCache
from shards.cache.plan_view import PLAN_FORMAT, PLAN_VERSION, PLANS, live_plans
from tests.shards.test_node_cache import FORK, shard, writer_of

NOBODY = 65534


def warnings_about(caplog, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and str(path) in r.getMessage()]


def plan_text(plan_keys: list[str], **fields) -> str:
    value = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "keys": plan_keys,
             "reads": list(range(len(plan_keys))), "epoch_reads": len(plan_keys), "position": 0}
    value.update(fields)
    return json.dumps(value)


@contextlib.contextmanager
def live_lock(folder: Path, name: str):
    """Hold ``<name>.lock`` as a live reader would, so the plan beside it is read (not removed as dead)."""
    fd = os.open(folder / f"{name}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


# -- plans ------------------------------------------------------------------------------------------------------
def test_planted_plans_are_ignored_with_one_warning_each_and_never_followed(tmp_path, caplog):
    cache = NodeCache(ShardCache(tmp_path / "cache", limit=5000))
    plans = cache.root / PLANS
    _, key = shard("k")
    outside = tmp_path / "outside.plan"
    outside.write_text(plan_text([key]))  # a valid plan, but not in the cache folder
    planted: dict[str, Path] = {}

    def plant(tag: str) -> Path:
        path = planted[tag] = plans / f"host-{tag}.1.{len(planted):08x}.plan"
        return path

    os.mkfifo(plant("fifo"))
    plant("link-out").symlink_to(outside)
    plant("dev-zero").symlink_to("/dev/zero")
    plant("directory").mkdir()
    with open(plant("sparse"), "wb") as handle:
        handle.truncate(3 << 30)
    for tag, value in {"position-float": 2.5, "position-string": "1", "position-bool": True,
                       "position-huge": 1e30}.items():
        plant(tag).write_text(plan_text([key], position=value))
    plant("epoch-nan").write_text(plan_text([key], epoch_reads=float("nan")))
    plant("keys-object").write_text(plan_text([key], keys={"a": key}))
    good = plans / "host-good.1.00000099.plan"
    good.write_text(plan_text([key]))
    with contextlib.ExitStack() as stack:
        for path in [*planted.values(), good]:
            stack.enter_context(live_lock(plans, path.name[:-len(".plan")]))
        caplog.set_level(logging.WARNING, logger="shardcache")
        for _ in range(3):  # three eviction scans
            assert [plan.reads for plan in live_plans(cache.root)] == [(key,)]
    for tag, path in planted.items():
        assert len(warnings_about(caplog, path)) == 1, (tag, warnings_about(caplog, path))
    assert "position" in warnings_about(caplog, planted["position-float"])[0]
    assert not warnings_about(caplog, good)
    assert outside.read_text() == plan_text([key])


# -- locks and leases -----------------------------------------------------------------------------------------------
PLANTS = {
    "link-out": lambda path, outside: path.symlink_to(outside),
    "dev-zero": lambda path, outside: path.symlink_to("/dev/zero"),
    "directory": lambda path, outside: path.mkdir(),
    "fifo": lambda path, outside: os.mkfifo(path),
}


@pytest.mark.parametrize("folder", ["leases", "locks"])
@pytest.mark.parametrize("kind", sorted(PLANTS))
def test_a_planted_lock_or_lease_is_read_around_with_one_warning(tmp_path, caplog, folder, kind):
    cache = NodeCache(ShardCache(tmp_path / "cache", limit=5000))
    data, sha = shard("planted")
    suffix = ".lease" if folder == "leases" else ".lock"
    planted = cache.root / folder / f"{sha}{suffix}"
    outside = tmp_path / "outside-file"
    PLANTS[kind](planted, outside)
    caplog.set_level(logging.WARNING, logger="shardcache")
    for _ in range(3):
        calls: list[str] = []
        assert cache.acquire(sha, len(data), ".tar", writer_of(data, calls), "s3://b/x.tar") is None
        assert calls == []  # the caller reads the source itself
    assert len(warnings_about(caplog, planted)) == 1
    assert not outside.exists()  # nothing created or followed outside the folder
    assert cache.stats.snapshot()["bypasses"] == 3


def test_an_evict_lock_planted_after_the_cache_opened_reads_around_it(tmp_path, caplog):
    cache = NodeCache(ShardCache(tmp_path / "cache", limit=5000))
    evict_lock = cache.root / "evict.lock"
    evict_lock.unlink()
    evict_lock.mkdir()
    caplog.set_level(logging.WARNING, logger="shardcache")
    for tag in ("a", "b"):
        data, sha = shard(tag)
        assert cache.acquire(sha, len(data), ".tar", writer_of(data), "s3://b/x.tar") is None
    assert len(warnings_about(caplog, evict_lock)) == 1
    NodeCache(ShardCache(tmp_path / "cache", limit=5000))  # and a new process opens it without a traceback


# -- reservations ---------------------------------------------------------------------------------------------
def test_a_planted_reservation_link_is_never_written_through(tmp_path):
    cache = NodeCache(ShardCache(tmp_path / "cache", limit=5000))
    data, sha = shard("r")
    outside = tmp_path / "victim.txt"
    outside.write_text("precious\n")
    (cache.root / "reserve" / sha).symlink_to(outside)
    with cache.acquire(sha, len(data), ".tar", writer_of(data), "s3://b/r.tar") as lease:
        assert lease.path.read_bytes() == data
    assert outside.read_text() == "precious\n"


@pytest.mark.parametrize("size", [1e30, 10 ** 18, "7", True, -5])
def test_a_forged_reservation_cannot_claim_the_cache(tmp_path, caplog, size):
    cache = NodeCache(ShardCache(tmp_path / "cache", limit=5000))
    _, other = shard("other")
    forged = cache.root / "reserve" / other
    forged.write_text(json.dumps({"size": size, "host": "h", "pid": 1}))
    data, sha = shard("mine")
    caplog.set_level(logging.WARNING, logger="shardcache")
    with live_lock(cache.root / "locks", other):  # its fetch looks alive, so it is not removed as a leftover
        for _ in range(2):
            lease = cache.acquire(sha, len(data), ".tar", writer_of(data), "s3://b/m.tar")
            assert lease is not None and lease.path.read_bytes() == data
            lease.release()
    assert len(warnings_about(caplog, forged)) == 1


# -- copies -----------------------------------------------------------------------------------------------------
def forge_stamp(entry: Path, sha: str) -> None:
    info = os.stat(entry)  # what the entry's target says: a stamp that vouches for it
    Path(f"{entry}.ok").write_text(json.dumps({"size": info.st_size, "mtime_ns": info.st_mtime_ns,
                                               "inode": info.st_ino, "sha256": sha}))


def test_a_copy_planted_as_a_link_out_is_replaced_not_served(tmp_path):
    cache = NodeCache(ShardCache(tmp_path / "cache"))
    data, sha = shard("l")
    outside = tmp_path / "outside.tar"
    outside.write_bytes(data)
    entry = cache.entry_path(sha, ".tar")
    entry.parent.mkdir()
    entry.symlink_to(outside)
    forge_stamp(entry, sha)
    with cache.acquire(sha, len(data), ".tar", writer_of(data), "s3://b/l.tar") as lease:
        assert not lease.path.is_symlink() and stat.S_ISREG(os.lstat(lease.path).st_mode)
        assert lease.path.read_bytes() == data
    assert outside.read_bytes() == data


def test_an_entry_folder_planted_as_a_link_out_is_never_followed(tmp_path, caplog):
    cache = NodeCache(ShardCache(tmp_path / "cache"))
    data, sha = shard("d")
    outside = tmp_path / "someone-elses-folder"
    outside.mkdir()
    (outside / f"{sha}.tar").write_bytes(b"not the shard")
    (outside / f"{sha}.tar.ok").write_text("{}")
    cache.entry_path(sha, ".tar").parent.symlink_to(outside)
    caplog.set_level(logging.WARNING, logger="shardcache")
    for _ in range(2):
        assert cache.acquire(sha, len(data), ".tar", writer_of(data), "s3://b/d.tar") is None
    assert sorted(p.name for p in outside.iterdir()) == [f"{sha}.tar", f"{sha}.tar.ok"]
    assert (outside / f"{sha}.tar").read_bytes() == b"not the shard"
    assert len(warnings_about(caplog, cache.entry_path(sha, ".tar").parent)) == 1


def test_verify_all_never_hangs_on_a_copy_planted_as_a_fifo(tmp_path):
    cache = NodeCache(ShardCache(tmp_path / "cache"))
    _, sha = shard("f")
    entry = cache.entry_path(sha, ".tar")
    entry.parent.mkdir()
    os.mkfifo(entry)
    forge_stamp(entry, sha)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(cache.verify_all()), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # release the hung open() so the test process can end
        os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("verify_all hung on a FIFO in the cache folder")
    assert result == [{"checked": 1, "removed": 1, "skipped": 0}]


# -- two users --------------------------------------------------------------------------------------------------
def _as_nobody(cache_dir: str, steps: str, out: str) -> None:
    """Another user's job on the same node: run ``steps`` against the shared cache, record what happened."""
    import logging as child_logging

    records: list[str] = []

    class Keep(child_logging.Handler):
        def emit(self, record) -> None:
            records.append(record.getMessage())

    child_logging.getLogger("shardcache").addHandler(Keep(child_logging.WARNING))
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    outcome: dict = {"uid": os.getuid()}
    try:
        cache = NodeCache(ShardCache(cache_dir, limit=2500))
        for tag in steps.split(","):
            data, sha = shard(tag)
            lease = cache.acquire(sha, len(data), ".tar", writer_of(data), f"s3://b/{tag}.tar")
            outcome[tag] = None if lease is None else lease.path.read_bytes() == data
            if lease is not None:
                lease.release()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which asserts there was none
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    outcome["warnings"] = records
    Path(out).write_text(json.dumps(outcome))


def run_as_nobody(cache_dir: Path, steps: str) -> dict:
    out = cache_dir.parent / f"outcome-{steps}.json"  # a folder the other user may write in
    child = FORK.Process(target=_as_nobody, args=(str(cache_dir), steps, str(out)))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    return json.loads(out.read_text())


def test_two_users_share_one_cache():
    shared = Path(tempfile.mkdtemp(prefix="shardcache-shared-", dir="/tmp"))
    try:
        os.chmod(shared, 0o1777)  # a node's shared scratch folder, like /tmp
        cache_dir = shared / "cache"
        cache_dir.mkdir()
        os.chmod(cache_dir, 0o1777)
        cache = NodeCache(ShardCache(cache_dir, limit=2500))
        root_data, root_sha = shard("root")
        cache.acquire(root_sha, len(root_data), ".tar", writer_of(root_data), "s3://b/root.tar").release()
        _, locked_sha = shard("private")
        private_lease = cache.root / "leases" / f"{locked_sha}.lease"
        private_lease.touch()
        os.chmod(private_lease, 0o600)  # a lease only its owner may read

        # The other user reads root's copy (a hit), caches its own, and reads around a lease it may not open.
        outcome = run_as_nobody(cache_dir, "root,nobody,private")
        assert outcome["uid"] == NOBODY and "error" not in outcome, outcome
        assert outcome["root"] is True and outcome["nobody"] is True and outcome["private"] is None
        assert sum("private" in w or locked_sha in w for w in outcome["warnings"]) == 1, outcome["warnings"]
        _, nobody_sha = shard("nobody")
        assert os.stat(cache.entry_path(nobody_sha, ".tar")).st_uid == NOBODY

        # Root's job reads the other user's copy.
        with cache.acquire(nobody_sha, 1000, ".tar", writer_of(b"unused"), "s3://b/nobody.tar") as lease:
            assert lease.path.read_bytes() == shard("nobody")[0]

        # A third shard needs room: the other user may not remove root's copies in a sticky folder, so it reads
        # the source, with one warning per file it could not remove, and no traceback.
        outcome = run_as_nobody(cache_dir, "third,fourth")
        assert "error" not in outcome, outcome
        assert os.path.exists(cache.entry_path(root_sha, ".tar"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
