"""The fuzz targets of state that others write: saved loader states (``load_state_dict``, DCP's string), the node
cache's shared folder (plans, reservations, stamps, and what kind of file each is), and ``where`` filters."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from tests.fuzz import readers
from tests.fuzz.mutate import Draw, dumps, mutate_bytes, mutate_json
from tests.fuzz.registry import file_of, target
from tests.fuzz.seeds import Seeds


# -- saved loader states ----------------------------------------------------------------------------------------------
def _state_of(data: bytes) -> Any:
    """The saved state as ``torch.load`` or ``json.load`` gives it back; None when the bytes are no JSON value
    (there is nothing to hand ``load_state_dict``)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


@target("loader_state", file_of("loader_state", "state.json"), mutate_json, suffix="json", examples=300,
        needs=("tar_dataset",))
def _loader_state(data: bytes, seeds: Seeds, work: Path) -> None:
    state = _state_of(data)
    if state is None:
        return
    loader = readers.tar_loader(seeds.path("tar_dataset"))
    loader.load_state_dict(state)
    readers.drain(loader)
    loader.dataset.load_state_dict(state)
    readers.drain(loader.dataset)


def _mutate_dcp(draw: Draw, seed: bytes) -> bytes:
    """The state text DCP stores: edited as JSON or as text, or nested beyond any parser's limit."""
    if draw(st.integers(0, 9), label="dcp-deep") == 0:
        depth = draw(st.sampled_from((900, 100_000)))
        return b"[" * depth + b"]" * depth
    return mutate_json(draw, seed)


@target("dcp_state", file_of("loader_state", "state.json"), _mutate_dcp, suffix="json", examples=300,
        needs=("tar_dataset",))
def _dcp_state(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.position.dcp_state import KEY, DcpLoaderState

    loader = readers.tar_loader(seeds.path("tar_dataset"))
    DcpLoaderState(loader).load_state_dict({KEY: data.decode("utf-8", "surrogateescape")})
    readers.drain(loader)


# -- the node cache's shared folder -----------------------------------------------------------------------------------
PLAN_NAME = "fuzzhost.4242.0badcafe"


def _plan_seed(seeds: Seeds) -> bytes:
    return dumps({"format": "shardcache.cache-plan", "version": 1, "keys": [readers.blob(n)[1] for n in "cab"],
                  "reads": [0, 1, 2, 1], "epoch_reads": 3, "position": 1})


def _hold(path: Path) -> int:
    """Lock ``path`` as a live process does (the lock is dropped when the child exits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@target("cache_plan", _plan_seed, mutate_json, suffix="json", examples=300, needs=("node_cache",))
def _cache_plan(data: bytes, seeds: Seeds, work: Path) -> None:
    root = seeds.copy("node_cache", work)
    plans = root / "v1" / "plans"
    _hold(plans / f"{PLAN_NAME}.lock")
    (plans / f"{PLAN_NAME}.plan").write_bytes(data)
    readers.use_cache(root)


@target("cache_reservation", lambda seeds: dumps({"size": 400, "host": "fuzzhost", "pid": 4242}), mutate_json,
        suffix="json", examples=220, needs=("node_cache",))
def _cache_reservation(data: bytes, seeds: Seeds, work: Path) -> None:
    root = seeds.copy("node_cache", work)
    sha = readers.blob("z")[1]
    _hold(root / "v1" / "locks" / f"{sha}.lock")  # a fetch in flight: its reservation counts
    (root / "v1" / "reserve" / sha).write_bytes(data)
    readers.use_cache(root)


def _stamp(seeds: Seeds) -> Path:
    sha = readers.blob("a")[1]
    return Path("v1") / sha[:2] / f"{sha}.tar.ok"


@target("cache_stamp", lambda seeds: (seeds.path("node_cache") / _stamp(seeds)).read_bytes(), mutate_json,
        suffix="json", examples=220)
def _cache_stamp(data: bytes, seeds: Seeds, work: Path) -> None:
    root = seeds.copy("node_cache", work)
    (root / _stamp(seeds)).write_bytes(data)
    readers.use_cache(root)


CACHE_ROLES = ("plan", "plan_lock", "lease", "key_lock", "reserve", "stamp", "entry", "evict_lock", "plans",
               "leases", "locks", "reserve_dir")
FILE_KINDS = ("regular", "symlink_out", "dangling", "loop", "dir", "fifo", "huge", "empty")


def _mutate_kinds(draw: Draw, seed: bytes) -> bytes:
    """Which of the cache's files (``CACHE_ROLES``) are of which kind, as JSON: ``{"plan": "fifo"}``."""
    kinds = draw(st.dictionaries(st.sampled_from(CACHE_ROLES), st.sampled_from(FILE_KINDS), min_size=1,
                                 max_size=3))
    return dumps(dict(sorted(kinds.items())))


def _role_path(root: Path, role: str) -> Path:
    v1, a, z = root / "v1", readers.blob("a")[1], readers.blob("z")[1]
    return {"plan": v1 / "plans" / f"{PLAN_NAME}.plan", "plan_lock": v1 / "plans" / f"{PLAN_NAME}.lock",
            "lease": v1 / "leases" / f"{a}.lease", "key_lock": v1 / "locks" / f"{a}.lock",
            "reserve": v1 / "reserve" / z, "stamp": v1 / a[:2] / f"{a}.tar.ok", "entry": v1 / a[:2] / f"{a}.tar",
            "evict_lock": v1 / "evict.lock", "plans": v1 / "plans", "leases": v1 / "leases", "locks": v1 / "locks",
            "reserve_dir": v1 / "reserve"}[role]


def _make_kind(path: Path, kind: str, outside: Path) -> None:
    """Put a file of ``kind`` at ``path`` (whatever was there is removed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "regular":
        path.write_bytes(b"{}")
    elif kind == "symlink_out":
        path.symlink_to(outside)
    elif kind == "dangling":
        path.symlink_to(path.parent / "no-such-file")
    elif kind == "loop":
        path.symlink_to(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        with open(path, "wb") as handle:
            handle.truncate(3 << 30)  # sparse: no disk, but 3 GiB to a reader that reads it whole
    elif kind == "empty":
        path.write_bytes(b"")


@target("cache_file_kinds", lambda seeds: dumps({"plan": "regular"}), _mutate_kinds, suffix="json", examples=300,
        needs=("node_cache",))
def _cache_file_kinds(data: bytes, seeds: Seeds, work: Path) -> None:
    kinds = json.loads(data)
    if not isinstance(kinds, dict):
        return
    root = seeds.copy("node_cache", work)
    outside = work / "someone-elses-file"
    outside.write_text('{"format": "not yours"}')
    plans = root / "v1" / "plans"
    (plans / f"{PLAN_NAME}.plan").write_bytes(_plan_seed(seeds))
    held: int | None = _hold(plans / f"{PLAN_NAME}.lock")
    try:
        if "plan_lock" in kinds:  # the lock file is replaced below: its reader is gone
            os.close(held)
            held = None
        for role, kind in sorted(kinds.items()):
            if role in CACHE_ROLES and kind in FILE_KINDS:
                _make_kind(_role_path(root, role), kind, outside)
        readers.use_cache(root)
    finally:  # the plan's reader leaves: a descriptor per example would run a long run out of them
        if held is not None:
            os.close(held)


# -- where expressions ----------------------------------------------------------------------------------------------
WHERE_FIELDS = ("width", "height", "mode", "format", "path", "class", "key", "label", "missing")
WHERE_LITERALS = ("8", "0", "-1", "2.5", "'RGB'", "'JPEG'", "''", "True", "None", "1e400", "-1e400", "9" * 30,
                  "[8, 'x']", "('a', 1)", "[]", "'é'", "'\\x00'", "b'x'", "...", "1j", "0x10", "1_000")
WHERE_OPS = ("==", "!=", "<", "<=", ">", ">=", "in", "not in", "is", "+", "*", "**", "//", "@", "and", "or")


def _where_expr(draw: Draw, depth: int = 0) -> str:
    """A random expression over the packed samples' fields, allowed or not (calls, arithmetic, ``is``)."""
    kind = draw(st.sampled_from(("compare", "compare", "bool", "not", "paren", "atom") if depth < 6
                                else ("compare", "atom")), label="where-node")
    atom = lambda: draw(st.sampled_from(WHERE_FIELDS + WHERE_LITERALS))  # noqa: E731
    if kind == "compare":
        return f"{atom()} {draw(st.sampled_from(WHERE_OPS))} {atom()}"
    if kind == "bool":
        return f"{_where_expr(draw, depth + 1)} {draw(st.sampled_from(('and', 'or')))} {_where_expr(draw, depth + 1)}"
    if kind == "not":
        return "not " + _where_expr(draw, depth + 1)
    if kind == "paren":
        return f"({_where_expr(draw, depth + 1)})"
    return atom()


def _mutate_where(draw: Draw, seed: bytes) -> bytes:
    """An expression from the grammar (fields, literals of every type, every operator), nested past the depth
    limit, thousands of clauses long, or the seed's text edited."""
    mode = draw(st.sampled_from(("grammar", "grammar", "bytes", "deep", "long")), label="where-mode")
    if mode == "grammar":
        return _where_expr(draw).encode()
    if mode == "deep":
        unit = draw(st.sampled_from(("not ", "(", "-", "[", "~", "width == ")))
        text = unit * draw(st.sampled_from((31, 33, 200, 3000))) + "1"
        return (text + (")" * text.count("(")) + ("]" * text.count("["))).encode()
    if mode == "long":
        return (" or ".join(f"key == 'k{i}'" for i in range(draw(st.sampled_from((100, 2000)))))).encode()
    return mutate_bytes(draw, seed, tokens=(b" and ", b" or ", b"not ", b"(", b")", b"'", b"\\", b"==", b" in ",
                                            b"__class__", b".", b"()", b"[0]", b"lambda: 0", b"\n"))


@target("where", lambda seeds: b"width >= 8 and mode == 'RGB' or class in ['ant', 'x']", _mutate_where,
        suffix="txt", examples=600, needs=("tar_dataset",))
def _where(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards import SourceSpec, Subset
    from shards.errors import ShardcacheError
    from shards.select.columns import open_columns
    from shards.manifest import load_dataset_manifest
    from shards.select.rows import SampleColumns, sample_fields
    from shards.select.where import Where

    expression = data.decode("utf-8", "replace")
    where = Where(expression)  # an InputError for a bad expression ends the run here, as intended
    folder = seeds.path("tar_dataset")  # read only
    manifest = load_dataset_manifest(folder)
    rows = [json.loads(line) for line in (folder / "source-index.jsonl").read_text().splitlines()]
    for row in rows + [{"key": "odd", "label": 5, "meta": {"width": [1], "mode": None, "height": 1e308}}]:
        try:
            where(sample_fields(row["key"], row["label"], manifest.classes, row.get("meta"), "row"))
        except ShardcacheError:
            pass
    where.mask(SampleColumns(open_columns(folder, manifest, "train"), manifest.classes))
    readers.stream_split(SourceSpec(str(folder), subset=Subset(where=expression)))
