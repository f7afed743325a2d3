"""A load's progress in a file that a probe or a sidecar can read: what an orchestrator can
trust while vLLM's ``/health`` cannot answer yet (it answers only once the engine is up).

The vLLM loader writes ``{"phase", "bytes_done", "bytes_total", "gb_per_s", "eta_s",
"updated", "pid", "rank"}`` as JSON (written whole to a temporary name, then renamed: a reader
never sees half a file) when the load starts, at most every second while it runs, and when it
ends (``phase``: ``loading``, ``done`` or ``failed``, with ``error``). With tensor parallelism each
rank writes its own file: ``PATH`` for rank 0, ``PATH.rank<N>`` for the others.

``weightstream load-status PATH`` reads them all (:func:`status`) and exits 0 while every load
is done or advancing, 1 when one failed or has not advanced for ``--stalled-after`` seconds:
a liveness probe made of it restarts a stuck load without waiting for the whole startup budget.
"""

from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ProgressFile", "Status", "path_for_rank", "status"]

_EVERY_S = 1.0


def path_for_rank(path: str, rank: int) -> str:
    """The file rank ``rank`` writes: ``path`` itself for rank 0."""
    return path if rank == 0 else f"{path}.rank{rank}"


class ProgressFile:
    """Writes one load's progress to ``path`` (see the module docstring)."""

    def __init__(self, path: str, total: int, *, rank: int = 0, clock: Any = time.monotonic) -> None:
        self.path, self.total, self.rank, self._clock = path, total, rank, clock
        self._start = clock()
        self._written = float("-inf")
        self.done = 0
        self._write("loading")

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self._clock() - self._written >= _EVERY_S:
            self._write("loading")

    def finish(self, error: BaseException | None = None) -> None:
        """The load ended: ``done``, or ``failed`` with ``error``."""
        if error is None:
            self._write("done")
        else:
            self._write("failed", error=f"{type(error).__name__}: {error}"[:2000])

    def _write(self, phase: str, **more: Any) -> None:
        now = self._clock()
        self._written = now
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        record = {
            "phase": phase,
            "bytes_done": self.done,
            "bytes_total": self.total,
            "gb_per_s": round(rate / 1e9, 3),
            "eta_s": round((self.total - self.done) / rate, 1) if rate > 0 and phase == "loading" else None,
            "updated": time.time(),
            "pid": os.getpid(),
            "rank": self.rank,
            **more,
        }
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(tmp, self.path)
        except OSError:  # a progress file must never fail a load
            return


@dataclass(frozen=True)
class Status:
    """One rank's load as its file says, judged at ``now``."""

    path: str
    phase: str
    """``loading``, ``done``, ``failed``, ``stalled`` (loading, but not updated for too long) or
    ``unreadable``."""
    record: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.phase in ("loading", "done")

    def describe(self) -> str:
        r = self.record
        if self.phase == "unreadable":
            return f"{self.path}: unreadable ({r.get('error')})"
        line = f"{self.path}: {self.phase}, {r.get('bytes_done', 0) / 1e9:.1f} of {r.get('bytes_total', 0) / 1e9:.1f} GB"
        if self.phase in ("loading", "stalled"):
            line += f" at {r.get('gb_per_s')} GB/s, about {r.get('eta_s')} s left"
        if self.phase == "stalled":
            line += f", no progress for {time.time() - r['updated']:.0f} s"
        if r.get("error"):
            line += f": {r['error']}"
        return line


def status(path: str, *, stalled_after: float = 120.0, now: float | None = None) -> list[Status]:
    """Every rank's file for ``path`` (``path`` and ``path.rank*``); an empty list when no load
    has started."""
    now = time.time() if now is None else now
    out = []
    for p in sorted({*glob.glob(glob.escape(path)), *glob.glob(glob.escape(path) + ".rank[0-9]*")}):
        try:
            with open(p, encoding="utf-8") as f:
                record = json.load(f)
            phase = str(record["phase"])
            updated = float(record["updated"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            out.append(Status(p, "unreadable", {"error": f"{type(exc).__name__}: {exc}"}))
            continue
        if phase == "loading" and now - updated > stalled_after:
            phase = "stalled"
        out.append(Status(p, phase, record))
    return out
