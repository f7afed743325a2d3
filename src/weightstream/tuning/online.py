"""The tuner as the engine sees it: what to measure, and what a depth means for chunk size.

* *Delivered bytes.* For object stores, bytes are counted as they arrive (``received``), so a
  change of depth shows within a first-byte delay instead of a whole request. For files, a
  read counts when it completes.
* *Chunk size follows depth.* Bytes in flight (depth x chunk) are kept within half the memory
  limit: when the tuner wants more requests than fit, new blocks are cut into smaller reads
  (down to ``min_chunk``). The other half of the limit holds finished blocks the caller has not
  taken yet.
* *The last reads go out together* (file systems). The depth that gives the link's rate is not
  the one that ends a load soonest where latency has a tail: the reads issued in the last
  seconds each wait a latency drawn from it, and the load ends with the slowest, the link idle
  meanwhile (a 40.7 GB/s NFS with a p99 of 1.8 s: 1.14x the link's time, simulated). Once every
  block is admitted and the bytes still queued are no more than the measured rate times the
  slowest recent read (:meth:`Tuning.final_bytes`), the engine issues all of them at once, so
  their latencies overlap one another and the link's last transfers instead of following them.
  The bytes are admitted already (their memory is taken); only threads are added. Object
  stores hedge their stragglers instead.
* *Request size follows the interpreter* (object stores). Each request costs the process's one
  interpreter a fixed amount of Python (signing, the request machine, the engine's bookkeeping:
  about 0.4 ms of GIL here, bench/RESULTS.md), so a process can issue only so many requests a
  second, whatever its cores: at 8 MiB, 50 GB/s would be 6,000 a second. The tuner measures
  the process's user-mode CPU per second of the load (an upper bound of the time the GIL is
  held) and, once it passes ``INTERPRETER_SHARE``, lets a read join the neighbouring chunks of
  its block still waiting, so the requests a second fall back to that share
  (:meth:`Tuning.issue_size`): the cost per byte falls as the rate rises. Below it nothing
  changes: smaller requests finish sooner and hedge cheaper.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import Any

from weightstream.config import StreamConfig, settled
from weightstream.memory.align import align_down
from weightstream.tuning.controller import DepthController

__all__ = ["Tuning", "block_size", "make_tuning"]

MIN_CHUNK = 4 << 20
HARD_MAX_DEPTH = 1024
INTERPRETER_SHARE = 0.5
"""The share of one core a load's requests may keep the process busy in user mode before they
grow: half, so that the GIL is left to the application and to the request machine's peaks."""
CPU_WINDOW = 0.5
"""Seconds over which that share is measured (a few hundred requests at the rates it matters)."""
RECENT_READS = 256
"""Reads whose slowest latency stands for the tail (about its p99.6)."""
MAX_JOINED = 64 << 20
"""The largest request joined at issue (as a file system's reads)."""


def _user_cpu() -> float:
    return os.times().user


def block_size(config: StreamConfig, *, remote: bool) -> int | None:
    """The most bytes of neighbouring small tensors one block of a load's plan joins: an object
    store's up to ``MAX_JOINED`` (an eighth of the memory limit at most), so that its reads can
    grow with the rate when they are issued (:meth:`Tuning.issue_size`); ``None`` (one read's
    worth) for a file system's, whose reads are that large already."""
    return min(MAX_JOINED, settled(config.resolved().memory_limit) // 8) if remote else None


class Tuning:
    """The engine's side of the tuner: turns finished reads (files) or arriving bytes (object
    stores) into the :class:`DepthController`'s measurements, and its depth into the size of new
    reads, so that depth x read size stays within the bytes allowed in flight."""

    def __init__(
        self,
        controller: DepthController,
        *,
        chunk_size: int,
        min_chunk: int,
        inflight: int,
        network: Any = None,
        cpu: Callable[[], float] | None = None,
    ) -> None:
        """``cpu``: the process's user-mode CPU seconds so far (default: ``os.times()``; the
        simulation gives its own)."""
        self.controller = controller
        self.base_chunk = chunk_size
        self.min_chunk = min(min_chunk, chunk_size)
        self.inflight = inflight
        self._net = network
        self.smallest_chunk = chunk_size
        self.largest_request = 0
        """The most bytes a read was allowed to join at issue (0: none was)."""
        self._cpu = (cpu or _user_cpu) if network is not None else None
        """The process's user-mode CPU seconds (object stores only: their requests are many)."""
        self._window: tuple[float, float, int, int] | None = None
        self._reads = self._bytes = 0
        self._join = 0
        self._recent: deque[float] = deque(maxlen=RECENT_READS)
        """Seconds of the last reads (files), whose slowest sizes :meth:`final_bytes`."""
        self._began = self._last = 0.0
        self._completed = 0
        self.cpu_share = 0.0
        """User-mode CPU per second of the load, over the last window."""
        self.start_depth = controller.depth
        self._first_bytes_seen = 0

    @property
    def depth(self) -> int:
        return self.controller.depth

    @property
    def maximum(self) -> int:
        return self.controller.maximum

    def begin(self, now: float) -> None:
        """The first reads are issued: the controller's clock starts here, not at the first
        measurement."""
        self.controller.tick(now, 0)
        self._began = now
        self._measure(now)

    def _measure(self, now: float, nbytes: int = 0) -> None:
        """Count a finished read of ``nbytes`` (0: none); once a ``CPU_WINDOW`` has passed, set
        the size reads may join to (:meth:`issue_size`): the window's mean read size, scaled by
        the share of a core the process spent in user mode over ``INTERPRETER_SHARE``.

        Requests a second times CPU a request is that share, so the size that brings the
        requests a second back to the target is the mean size times share / target, whatever
        the machine's speed or the heap's size (which the CPU a request includes)."""
        if self._cpu is None:
            return
        if nbytes:
            self._reads += 1
            self._bytes += nbytes
        if self._window is None:
            self._window = (now, self._cpu(), self._reads, self._bytes)
            return
        since, cpu_then, reads_then, bytes_then = self._window
        if now - since < CPU_WINDOW:
            return
        cpu = self._cpu()
        reads, nbytes = self._reads - reads_then, self._bytes - bytes_then
        self._window = (now, cpu, self._reads, self._bytes)
        if reads:
            self.cpu_share = share = (cpu - cpu_then) / (now - since)
            # The size the window's requests were issued at (its finished reads lag a request's
            # time behind), scaled; a saturated interpreter hides how far past the target the
            # load would go, so there it grows faster.
            issued = max(self._join, self._size())
            self._join = min(MAX_JOINED, int(issued * share / INTERPRETER_SHARE * (2 if share > 0.9 else 1)))

    def after_read(
        self, now: float, seconds: float, completed: int, *, starved: bool, nbytes: int = 0
    ) -> int:
        """One read of ``nbytes`` finished (engine lock held): feed the controller, return the
        depth."""
        self._measure(now, nbytes)
        if self._net is None and nbytes:
            self._recent.append(seconds)
            self._completed, self._last = completed, now
        c = self.controller
        c.sizes(request_bytes=max(self._size(), nbytes))
        c.latency(seconds, nbytes=nbytes)
        self._feed_first_bytes()
        return c.tick(now, self._delivered(completed), starved=starved)

    def _feed_first_bytes(self) -> None:
        """Hand the controller the first-byte delays measured since the last call."""
        net = self._net
        if net is None:
            return
        self.controller.sizes(grain=net.piece)
        delays, self._first_bytes_seen = net.first_bytes_since(self._first_bytes_seen)
        for seconds in delays:
            self.controller.first_byte(seconds)

    def skip(self, now: float, completed: int) -> int:
        """A read finished that says nothing about the storage (a copy out of the page cache):
        the controller's current epoch is thrown away. Returns the depth."""
        return self.controller.tick(now, self._delivered(completed), starved=True)

    def _delivered(self, completed: int) -> int:
        """Bytes that count: for object stores, received minus those of aborted attempts and
        losing hedges (read again elsewhere, so they cost the link without delivering)."""
        net = self._net
        if net is None:
            return completed
        return max(0, net.received - net.wasted)

    def idle_tick(self, now: float, completed: int, *, starved: bool) -> int:
        """No read finished for a while (long requests): let the controller see the bytes that
        arrived meanwhile. Only object stores count bytes as they arrive, so only they tick."""
        if self._net is None:
            return self.controller.depth
        self._measure(now)
        self._feed_first_bytes()
        return self.controller.tick(now, self._delivered(completed), starved=starved)

    def _size(self) -> int:
        fit = align_down(self.inflight // max(1, self.controller.depth))
        return max(self.min_chunk, min(self.base_chunk, fit))

    def chunk_size(self) -> int:
        """Read size for blocks admitted now (recorded in ``smallest_chunk``)."""
        size = self._size()
        self.smallest_chunk = min(self.smallest_chunk, size)
        return size

    def final_bytes(self) -> int:
        """Bytes of queued reads the engine may issue all at once once every block is admitted
        (engine lock held): the rate measured so far times the slowest of the recent reads'
        latencies, for file systems (0 for object stores, and before a read has finished)."""
        if self._net is None and self._recent and self._last > self._began:
            rate = self._completed / (self._last - self._began)
            return int(rate * max(self._recent))
        return 0

    def issue_size(self) -> int:
        """The most bytes a read may cover when it is issued (engine lock held): 0 (a read is
        its chunk) while an object store's requests keep the process under
        ``INTERPRETER_SHARE`` of a core; past it, the request size that brings them back to
        it, up to ``MAX_JOINED`` and within the bytes allowed in flight at the current depth
        (recorded in ``largest_request``)."""
        want = self._join
        size = self._size()
        if want <= size:
            return 0
        fit = self.inflight // max(1, self.controller.depth)
        # At least two chunks: reads join whole chunks, and a process held by its interpreter
        # measures the rate that its requests allow, so a want between one and two chunks
        # would never grow (the requests are the ceiling, their size the way past it).
        joined = int(min(max(want, 2 * size), MAX_JOINED, fit))
        if joined > self.largest_request:
            self.largest_request = joined
        return joined

    def summary(self) -> dict[str, Any]:
        c = self.controller
        return {
            "autotune": True,
            "start_depth": self.start_depth,
            "final_depth": c.depth,
            "max_depth": c.maximum,
            "chunk_size": self._size(),
            "smallest_chunk": self.smallest_chunk,
            "largest_request": self.largest_request,
            "cpu_share": round(self.cpu_share, 3),
            "settled_at_s": None if c.settled_at is None else round(c.settled_at, 3),
            "decisions": [d.as_dict() for d in c.decisions],
        }


def make_tuning(
    config: StreamConfig,
    *,
    chunk_size: int,
    network: Any = None,
    room: int = 0,
    cpu: Callable[[], float] | None = None,
) -> Tuning | None:
    """The tuner for a load with ``config`` (already the remote variant for object stores), or
    ``None`` when ``autotune`` is off.

    ``room``: the bytes the load reads into memory it has allocated anyway (``load()`` into
    host memory reads straight into the tensors it returns), so reads in flight cost nothing
    beyond it and need not fit the memory limit: reads keep their full size at any depth. On
    storage with a long latency tail, shrinking them only made more of them than the depth
    holds, and the ones left over waited a whole read behind the first (bench/RESULTS.md)."""
    if not config.autotune:
        return None
    config = config.resolved()  # (a direct caller's automatic settings: a local disk's)
    start, memory = settled(config.concurrency), settled(config.memory_limit)
    # Bytes in flight: half the memory limit, or what the configured start needs if more.
    inflight = min(memory, max(memory // 2, start * chunk_size))
    ceiling = config.max_concurrency or min(HARD_MAX_DEPTH, 4 * start)
    if room:
        if network is not None and not config.max_concurrency:
            # An object store's connections each carry a fraction of the link (S3: about
            # 90 MB/s), so the depth a link needs is its rate over that, whatever the request
            # size: 400 Gbit/s takes about 560. Reads into the returned tensors cost no memory
            # of their own, so nothing else bounds them (bench/RESULTS.md, the simulation).
            ceiling = HARD_MAX_DEPTH
        inflight = max(inflight, room, ceiling * chunk_size)
    maximum = max(min(start, ceiling), min(ceiling, inflight // min(MIN_CHUNK, chunk_size)))
    controller = DepthController(initial=start, maximum=maximum, streaming=network is not None)
    controller.cap = float(config.max_bandwidth or 0)
    return Tuning(
        controller, chunk_size=chunk_size, min_chunk=MIN_CHUNK, inflight=inflight, network=network, cpu=cpu
    )
