"""How much memory this job may still fill: the cgroup limit where there is one (Slurm, containers), else the RAM.

A cache that trusts the machine's RAM overruns a Slurm job's ``--mem`` (the job is killed, not the cache shrunk),
so the limit comes from the tightest memory limit on this process's cgroup and its ancestors (cgroup v2
``memory.max``, v1 ``memory.limit_in_bytes``), and the use from the same cgroup, less its inactive file pages
(page cache the kernel drops before it runs out: counting it would make a job that just read its shards look
full). Without a limit, the machine: ``MemTotal`` and ``MemAvailable`` from ``/proc/meminfo``. Paths are
arguments so tests can point them at fake files; nothing here reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages); anything this large is no limit.
UNLIMITED = 1 << 60
DEFAULT_SHARE = 0.5


@dataclass(frozen=True)
class MemoryView:
    """What the job may use (``limit``) and already uses (``used``), in bytes, and where the numbers came from."""

    limit: int
    used: int
    source: str

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, names: tuple[str, ...]) -> int:
    """The first of ``names`` in a ``memory.stat`` file (0 when absent)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(None, 1) for line in lines if " " in line)
    for name in names:
        if name in values and values[name].strip().isdigit():
            return int(values[name])
    return 0


# Per cgroup version: the mount below the root, the limit file, the usage file, and the inactive page-cache
# counters of memory.stat (v1's hierarchical total first).
_LAYOUTS = {
    "v2": ("", "memory.max", "memory.current", ("inactive_file",)),
    "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")),
}


def _own_cgroups(proc_cgroup: Path) -> list[tuple[str, str]]:
    """``(version, path)`` of this process's memory cgroups, from ``/proc/self/cgroup``: v1's ``N:memory:/p``
    lines and v2's ``0::/p``."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found.append(("v2", path))
        elif "memory" in controllers.split(","):
            found.append(("v1", path))
    return found


def cgroup_memory(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                  proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> MemoryView | None:
    """The tightest memory limit over this process's cgroup and its ancestors, with that cgroup's use; None
    when no cgroup sets one.

    The walk starts at the process's own cgroup and goes up to the mount: Slurm puts the limit on the job and runs
    each step in a child cgroup; inside a container with its own cgroup namespace the process sits at the root
    of the mount, whose files are the container's.
    """
    root = Path(cgroup_root)
    best: MemoryView | None = None
    for version, path in _own_cgroups(Path(proc_cgroup)):
        mount, limit_file, usage_file, inactive = _LAYOUTS[version]
        base = root / mount if mount else root
        folder = base / path.lstrip("/")
        for candidate in [folder, *folder.parents]:
            limit = _read_int(candidate / limit_file)
            if limit is not None and limit < UNLIMITED and (best is None or limit < best.limit):
                usage = _read_int(candidate / usage_file) or 0
                used = max(0, usage - _stat_value(candidate / "memory.stat", inactive))
                best = MemoryView(limit, used, f"the cgroup {version} limit {candidate / limit_file}")
            if candidate == base:
                break
    return best


def machine_memory(meminfo: str | os.PathLike = "/proc/meminfo") -> MemoryView:
    """The machine's RAM and what is not available of it (``MemAvailable``, else ``sysconf``'s free pages)."""
    values: dict[str, int] = {}
    try:
        for line in Path(meminfo).read_text().splitlines():
            name, _, rest = line.partition(":")
            number = rest.split()
            if number and number[0].isdigit():
                values[name] = int(number[0]) * 1024
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = values.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    available = values.get("MemAvailable", os.sysconf("SC_AVPHYS_PAGES") * page)
    return MemoryView(total, max(0, total - available), f"the machine's memory ({meminfo})")


def memory_view(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                meminfo: str | os.PathLike = "/proc/meminfo") -> MemoryView:
    """The job's limit where a cgroup sets one, else the machine's; the tighter of the two in any case (a cgroup
    limit above the RAM of the machine is no help)."""
    machine = machine_memory(meminfo)
    job = cgroup_memory(cgroup_root, proc_cgroup)
    if job is None or machine.available < job.available:
        return machine
    return job


def default_memory_limit(share: float = DEFAULT_SHARE, reserved: int = 0, view: MemoryView | None = None) -> int:
    """``share`` of what the job has left (its limit less its use, less ``reserved``: other caches of this process
    that are planned but not yet filled), in bytes."""
    view = memory_view() if view is None else view
    return max(0, int(share * max(0, view.available - reserved)))
