"""How much more memory this process may use: what the machine has available and what its
control groups (v2, or v1's memory controller) still allow, whichever is less.

``load()`` keeps every tensor, so a checkpoint larger than this would be killed by the kernel
part way (the OOM killer gives no error to catch); the load refuses it at once instead
(:class:`~weightstream.errors.MemoryBudgetError`, suggesting ``stream()``). Standard library
only; every read is of a small file under ``/proc`` or ``/sys/fs/cgroup``, and anything
unreadable counts as no limit.
"""

from __future__ import annotations

import contextlib
import os

from weightstream.localfs import mount_table

__all__ = ["available_bytes", "loading_share", "local_processes"]

_NO_LIMIT = 1 << 62


def available_bytes() -> tuple[int, str]:
    """``(bytes, what limits them)``: the least of the machine's available memory and the room
    left in each control group above this process (reclaimable page cache counts as room)."""
    best, why = _meminfo()
    for limit, used, where in _cgroup_levels():
        room = max(0, limit - used)
        if room < best:
            best, why = room, f"the memory limit of control group {where} ({limit} bytes, {used} in use)"
    return best, why


def loading_share(host_memory: bool) -> tuple[int, int]:
    """What a load may take more of in flight on a network file system: (available host
    memory, loading processes on this machine) for a load into host memory (``host_memory``);
    no memory (0: the defaults kept) for a load into a device, whose memory the framework
    sizes its caches by after the load. The processes are the launcher's ranks on
    this machine (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, as torchrun sets them), else one."""
    processes = local_processes()
    if not host_memory:
        return 0, processes
    room, _ = available_bytes()
    return (room if room < _NO_LIMIT else 0), processes


def local_processes() -> int:
    """The loading processes on this machine: the launcher's ranks here (``LOCAL_WORLD_SIZE``,
    else ``WORLD_SIZE``, as torchrun sets them), else one. They share its memory and its link
    (``max_node_bandwidth``)."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def _meminfo() -> tuple[int, str]:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "the memory this machine has available"
    return _NO_LIMIT, "no known limit"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    if text in ("max", ""):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _reclaimable(folder: str, keys: tuple[str, ...]) -> int:
    """Inactive file cache charged to the group: the kernel takes it back before it kills."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(folder, "memory.stat")) as fh:
            stats = dict(line.split()[:2] for line in fh if line.strip())
        for key in keys:
            if key in stats:
                return int(stats[key])
    return 0


def _mounts() -> tuple[str | None, str | None]:
    """Where cgroup v2 and v1's memory controller are mounted."""
    v2 = v1 = None
    for point, fstype, options in mount_table():
        if fstype == "cgroup2" and v2 is None:
            v2 = point
        elif fstype == "cgroup" and "memory" in options.split(",") and v1 is None:
            v1 = point
    return v2, v1


def _cgroup_levels() -> list[tuple[int, int, str]]:
    """``(limit, usage, path)`` for every control group from this process's up to the root that
    sets a memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    v2, v1 = _mounts()
    levels: list[tuple[int, int, str]] = []
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return levels
    keys: tuple[str, ...]
    for line in lines:
        num, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if num == "0" and controllers == "" and v2 is not None:
            mount, limit_file, usage_file, keys = v2, "memory.max", "memory.current", ("inactive_file",)
        elif "memory" in controllers.split(",") and v1 is not None:
            mount, limit_file = v1, "memory.limit_in_bytes"
            usage_file, keys = "memory.usage_in_bytes", ("total_inactive_file", "inactive_file")
        else:
            continue
        rel = path.strip("/")
        while True:
            folder = os.path.join(mount, rel) if rel else mount
            limit = _read_int(os.path.join(folder, limit_file))
            if limit is not None:
                used = _read_int(os.path.join(folder, usage_file)) or 0
                levels.append((limit, max(0, used - _reclaimable(folder, keys)), "/" + rel))
            if not rel:
                break
            rel = os.path.dirname(rel)
    return levels
