"""The tuner as the engine sees it: what to measure, and what a depth means for chunk size.

* *Delivered bytes.* For object stores, bytes are counted as they arrive (``received``), so a
  change of depth shows within a first-byte delay instead of a whole request. For files, a
  read counts when it completes.
* *Chunk size follows depth.* Bytes in flight (depth x chunk) are kept within half the memory
  limit: when the tuner wants more requests than fit, new blocks are cut into smaller reads
  (down to ``min_chunk``). The other half of the limit holds finished blocks the caller has not
  taken yet.
"""

from __future__ import annotations

from typing import Any

from weightstream.config import StreamConfig
from weightstream.memory.align import align_down
from weightstream.tuning.controller import DepthController

__all__ = ["Tuning", "make_tuning"]

MIN_CHUNK = 4 << 20
HARD_MAX_DEPTH = 1024


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
    ) -> None:
        self.controller = controller
        self.base_chunk = chunk_size
        self.min_chunk = min(min_chunk, chunk_size)
        self.inflight = inflight
        self._net = network
        self.smallest_chunk = chunk_size
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

    def after_read(
        self, now: float, seconds: float, completed: int, *, starved: bool, nbytes: int = 0
    ) -> int:
        """One read of ``nbytes`` finished (engine lock held): feed the controller, return the
        depth."""
        c = self.controller
        c.sizes(request_bytes=self._size())
        c.latency(seconds, nbytes=nbytes)
        self._feed_first_bytes()
        return c.tick(now, self._delivered(completed), starved=starved)

    def _feed_first_bytes(self) -> None:
        """Hand the controller the first-byte delays measured since the last call."""
        net = self._net
        if net is None:
            return
        self.controller.sizes(grain=net.piece)
        delays = net.first_byte
        for seconds in delays[self._first_bytes_seen :]:
            self.controller.first_byte(seconds)
        self._first_bytes_seen = len(delays)

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

    def summary(self) -> dict[str, Any]:
        c = self.controller
        return {
            "autotune": True,
            "start_depth": self.start_depth,
            "final_depth": c.depth,
            "max_depth": c.maximum,
            "chunk_size": self._size(),
            "smallest_chunk": self.smallest_chunk,
            "settled_at_s": None if c.settled_at is None else round(c.settled_at, 3),
            "decisions": [d.as_dict() for d in c.decisions],
        }


def make_tuning(
    config: StreamConfig, *, chunk_size: int, network: Any = None, room: int = 0
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
    start = config.concurrency
    # Bytes in flight: half the memory limit, or what the configured start needs if more.
    inflight = min(config.memory_limit, max(config.memory_limit // 2, start * chunk_size))
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
    return Tuning(controller, chunk_size=chunk_size, min_chunk=MIN_CHUNK, inflight=inflight, network=network)
