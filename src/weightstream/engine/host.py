"""What the engine asks of the machine it runs on: the CPUs this process may use, and whether a
plan's first reads will come from the page cache (which decides how many copies run at once).
Facts of the host, kept apart from the coordinator and its workers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from weightstream.engine.plan import ReadPlan
from weightstream.sources.base import Resident, Source

__all__ = ["starts_cached", "usable_cpus"]


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a
    container limited to 4 CPUs on a 192-CPU host gets 4)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/sys/fs/cgroup/cpu.max") as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max":
            n = min(n, -(-int(quota) // int(period)))
    return max(1, n)


def starts_cached(plan: ReadPlan, sources: Sequence[Source], chunks: int) -> bool:
    """Whether the plan's first ``chunks`` reads will come from the page cache (sampled, a few
    ``cachestat`` calls): the load then starts with one copy per CPU, not the storage's depth."""
    seen = 0
    for block in plan.blocks:
        source = sources[block.source]
        if not isinstance(source, Resident):
            return False
        for chunk in block.chunks(plan.chunk_size):
            if not source.cached(chunk.offset, chunk.length):
                return False
            seen += 1
            if seen >= chunks:
                return True
    return seen > 0
