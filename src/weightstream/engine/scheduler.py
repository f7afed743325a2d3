"""Run a read plan: ``concurrency`` reads in flight, a byte budget, one coordinator.

Shape of a load::

    coordinator (the caller's thread)            workers (daemon threads, one read each at a time)
      admit blocks while the budget allows  ──►  tasks queue  ──►  source.read_into(chunk)
      wait for completions (io_timeout)     ◄──  results queue ◄──  (chunk, bytes, how, error)
      a block's last chunk done -> yield it
      resumed -> the caller holds it: release its bytes from the budget

* The budget counts bytes allocated for blocks not yet handed over. A block larger than the whole
  budget is admitted alone, when nothing else is held, so any checkpoint loads.
* Python work is per chunk (a queue hop and a memoryview slice), never per byte: the reads
  themselves run in ``os.preadv`` with the GIL released.
* The first failure anywhere cancels the rest: queued chunks are dropped, buffers are released as
  their references go, and the caller gets that one error. Workers are daemon threads so a read
  stuck in the kernel (a dead NFS server) can neither hang the load (``io_timeout``) nor the exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from weightstream.config import StreamConfig
from weightstream.engine.plan import Block, Chunk, ReadPlan
from weightstream.errors import ReadError, StorageTimeoutError, WeightStreamError
from weightstream.memory.buffers import allocate
from weightstream.sources.base import Source

__all__ = ["ReadCounters", "run_plan"]

log = logging.getLogger(__name__)


@dataclass
class ReadCounters:
    """What the engine did; filled in as the load runs."""

    chunks: int = 0
    bytes_read: int = 0
    by_how: dict[str, int] = field(default_factory=lambda: {"direct": 0, "cached": 0, "buffered": 0})
    peak_held: int = 0
    """Most bytes allocated but not yet handed to the caller at any moment."""


_Result = tuple[Chunk, int, str, BaseException | None]


class _Workers:
    def __init__(self, sources: Sequence[Source], blocks: Sequence[Block], n: int) -> None:
        self.tasks: queue.SimpleQueue[tuple[Chunk, memoryview] | None] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.inflight: dict[int, tuple[Chunk, float]] = {}
        self._sources = sources
        self._blocks = blocks
        self._threads = [
            threading.Thread(target=self._work, name=f"weightstream-io-{i}", daemon=True) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            task = self.tasks.get()
            if task is None:
                return
            chunk, view = task
            if self.cancelled.is_set():
                continue
            source = self._sources[self._blocks[chunk.block].source]
            self.inflight[me] = (chunk, time.monotonic())
            try:
                n, how = source.read_into(view, offset=chunk.offset)
                self.results.put((chunk, n, how, None))
            except BaseException as exc:
                self.results.put((chunk, 0, "", exc))
            finally:
                self.inflight.pop(me, None)
                del view, task

    def stop(self) -> None:
        self.cancelled.set()
        while True:  # drop queued work so its buffers go now
            try:
                self.tasks.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self.tasks.put(None)


def run_plan(
    plan: ReadPlan,
    sources: Sequence[Source],
    config: StreamConfig,
    *,
    counters: ReadCounters | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[tuple[Block, torch.Tensor]]:
    """Yield ``(block, buffer)`` as each block's bytes are all in, in completion order.

    ``buffer`` is a uint8 tensor holding the file bytes ``[block.start, block.end)``. The block
    counts against ``config.memory_limit`` until the generator is resumed after yielding it.
    Closing the generator early cancels the outstanding reads.
    """
    counters = counters if counters is not None else ReadCounters()
    pending = deque(plan.blocks)
    # block index -> [chunks left, buffer]
    outstanding: dict[int, list] = {}
    ready: deque[tuple[Block, torch.Tensor]] = deque()
    held = 0
    workers = _Workers(sources, plan.blocks, max(1, min(config.concurrency, plan.num_chunks)))
    try:
        while pending or outstanding or ready:
            while pending and (held == 0 or held + pending[0].nbytes <= config.memory_limit):
                block = pending.popleft()
                buf, view = allocate(block.nbytes, uri=sources[block.source].uri)
                held += block.nbytes
                counters.peak_held = max(counters.peak_held, held)
                chunks = list(block.chunks(plan.chunk_size))
                if not chunks:
                    ready.append((block, buf))
                    continue
                outstanding[block.index] = [len(chunks), buf]
                for chunk in chunks:
                    workers.tasks.put((chunk, view[chunk.pos : chunk.pos + chunk.length]))
                del view
            while ready:
                block, buf = ready.popleft()
                yield block, buf
                held -= block.nbytes
                del buf
            if not outstanding:
                continue
            chunk, n, how, error = _next_result(workers, sources, plan, config.io_timeout)
            if error is not None:
                raise _as_weightstream_error(error, sources[plan.blocks[chunk.block].source].uri, chunk)
            counters.chunks += 1
            counters.bytes_read += n
            counters.by_how[how] = counters.by_how.get(how, 0) + n
            if on_bytes is not None:
                on_bytes(n)
            state = outstanding[chunk.block]
            state[0] -= 1
            if state[0] == 0:
                del outstanding[chunk.block]
                ready.append((plan.blocks[chunk.block], state[1]))
    finally:
        workers.stop()
        outstanding.clear()
        ready.clear()


def _next_result(workers: _Workers, sources: Sequence[Source], plan: ReadPlan, timeout: float) -> _Result:
    try:
        return workers.results.get(timeout=timeout)
    except queue.Empty:
        pass
    stuck = sorted(workers.inflight.values(), key=lambda item: item[1])
    if stuck:
        chunk, since = stuck[0]
        uri = sources[plan.blocks[chunk.block].source].uri
        raise StorageTimeoutError(
            f"no read completed in {timeout:g} s; this one has been in flight for "
            f"{time.monotonic() - since:.1f} s ({len(stuck)} reads stuck; raise io_timeout if the "
            "storage is merely slow)",
            uri=uri,
            byte_range=(chunk.offset, chunk.offset + chunk.length),
        )
    raise StorageTimeoutError(f"no read completed in {timeout:g} s")


def _as_weightstream_error(error: BaseException, uri: str, chunk: Chunk) -> BaseException:
    if isinstance(error, WeightStreamError):
        return error
    if isinstance(error, OSError | MemoryError | ValueError):
        return ReadError(
            f"read failed: {error!r}", uri=uri, byte_range=(chunk.offset, chunk.offset + chunk.length)
        )
    return error  # KeyboardInterrupt, bugs: unchanged
