"""Run a read plan: ``concurrency`` reads in flight, a byte budget, one coordinator.

Shape of a load::

    coordinator (the caller's thread)            workers (daemon threads, one read each at a time)
      admit blocks while the budget allows  ──►  tasks queue  ──►  source.read_into(chunk)
      wait for completions (io_timeout)     ◄──  results queue ◄──  (chunk, bytes, how, error)
      a block's last chunk done -> yield it
      resumed -> the caller holds it: release its bytes from the budget

* The budget counts bytes allocated for blocks not yet handed over. A block larger than the whole
  budget is admitted alone, when nothing else is held, so any checkpoint loads. A caller that
  keeps every block anyway (``load()``, ``keep_all``) gets them all at the end instead, and the
  coordinator sleeps until then.
* Python work is per chunk (a queue hop and a memoryview slice), never per byte: the reads
  themselves run in ``os.preadv`` with the GIL released.
* The first failure anywhere cancels the rest: queued chunks are dropped, buffers are released as
  their references go, and the caller gets that one error. Workers are daemon threads so a read
  stuck in the kernel (a dead NFS server) can neither hang the load (``io_timeout``) nor the exit.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from weightstream.config import StreamConfig, settled
from weightstream.engine import host
from weightstream.engine.heap import frozen_heap
from weightstream.engine.plan import Block, Chunk, ReadPlan
from weightstream.engine.sink import HostSink, Sink
from weightstream.engine.throttle import Throttle
from weightstream.errors import ReadError, StorageTimeoutError, WeightStreamError
from weightstream.sources.base import Cancellable, Source

if TYPE_CHECKING:
    from weightstream.engine.verify import InOrder, Verifier

__all__ = ["Budget", "Job", "Polled", "ReadCounters", "Tuner", "admits", "run_plan", "run_plan_polled"]

log = logging.getLogger(__name__)


class Tuner(Protocol):
    """What the engine asks of an online tuner (:class:`weightstream.tuning.online.Tuning`
    meets it): the reads in flight it wants, and the read size for blocks admitted now. The
    engine reports every finished read and, while none finishes, a tick; the engine's lock is
    held during each call."""

    @property
    def depth(self) -> int:
        """Reads in flight wanted now."""
        ...

    @property
    def maximum(self) -> int:
        """The most reads in flight it will ever want (threads are started up to this)."""
        ...

    @property
    def min_chunk(self) -> int:
        """The smallest read it will ask for."""
        ...

    def begin(self, now: float) -> None:
        """The first reads are issued now."""
        ...

    def after_read(
        self, now: float, seconds: float, completed: int, *, starved: bool, nbytes: int = 0
    ) -> int:
        """A read of ``nbytes`` took ``seconds``; ``completed`` bytes from storage so far.
        Returns the depth."""
        ...

    def skip(self, now: float, completed: int) -> int:
        """A read finished that says nothing about the storage (a copy from memory)."""
        ...

    def idle_tick(self, now: float, completed: int, *, starved: bool) -> int:
        """No read finished for a while."""
        ...

    def chunk_size(self) -> int:
        """Read size for blocks admitted now."""
        ...

    def issue_size(self) -> int:
        """The most bytes one read may cover when it is issued: a block's neighbouring chunks
        still waiting are joined into it up to this size (0: never join)."""
        ...

    def final_bytes(self) -> int:
        """Once every block is admitted, the queued bytes at or under which all of them are
        issued at once, whatever the depth (0: never)."""
        ...


@dataclass
class ReadCounters:
    """What the engine did; filled in as the load runs."""

    chunks: int = 0
    bytes_read: int = 0
    by_how: dict[str, int] = field(
        default_factory=lambda: {"direct": 0, "cached": 0, "buffered": 0, "network": 0}
    )
    peak_held: int = 0
    """Most bytes held at any moment: allocated for blocks not yet handed to the caller, plus
    copies made while handing them over (:meth:`copied`)."""
    held: int = 0
    """Bytes allocated for blocks not yet handed over, now."""

    busy_seconds: float = 0.0
    """Seconds in which at least one read was in flight, up to the last that ended (see
    :meth:`busy`): the time the storage was driven, without the time the budget or the caller
    held the reads back."""
    rate_bytes: int = 0
    """Bytes of the reads that ended after the first: over :attr:`rate_seconds`, the rate the
    storage delivered while it was driven. Counting from the first end leaves out the
    pipeline's fill: bytes over all the busy time would miss the bytes of the reads still in
    flight, which on a deep, high-latency pipeline are most of those issued; between two ends of
    a steady pipeline, each end delivers one read's bytes."""
    rate_seconds: float = 0.0
    """Busy seconds (:attr:`busy_seconds`) from the first read's end to the last's."""
    _reading: int = field(default=0, repr=False, compare=False)
    _busy_since: float = field(default=0.0, repr=False, compare=False)
    _busy_at_last_end: float | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def read_started(self, now: float) -> None:
        """A read was issued at ``now`` (per read, not per byte)."""
        with self._lock:
            if not self._reading:
                self._busy_since = now
            self._reading += 1

    def read_ended(self, now: float, nbytes: int | None) -> None:
        """A read issued with :meth:`read_started` ended at ``now`` with ``nbytes`` (``None``:
        it failed or was cancelled)."""
        with self._lock:
            self._reading -= 1
            busy = self.busy_seconds + now - self._busy_since
            if not self._reading:
                self.busy_seconds = busy
            if nbytes is None:
                return
            if self._busy_at_last_end is not None:
                self.rate_bytes += nbytes
                self.rate_seconds += busy - self._busy_at_last_end
            self._busy_at_last_end = busy

    def busy(self, now: float) -> float:
        """:attr:`busy_seconds`, with the interval still open at ``now``."""
        with self._lock:
            return self.busy_seconds + (now - self._busy_since if self._reading else 0.0)

    def copied(self, nbytes: int) -> None:
        """A copy of ``nbytes`` exists beside the blocks held (a tensor copied out of its block
        while it is handed over): it counts toward the peak."""
        self.peak_held = max(self.peak_held, self.held + nbytes)


_STOP_WAIT = 5.0
"""Seconds a cancelled load waits for reads in progress before it returns (or raises)."""

FINAL_THREADS = 1024
"""Threads a load may use at most to issue its last reads together (:meth:`Tuner.final_bytes`)."""

_TICK = 0.25
"""With a tuner, the coordinator wakes at least this often to feed it (requests on a slow link
can take many seconds each; bytes arriving meanwhile are still a measurement)."""

_Event = tuple[int, Chunk | None, BaseException | None]
"""(block index, failed chunk, error): a finished block, every block (``_ALL_DONE``), or a
failure."""

_ALL_DONE = -1


def admits(held: int, nbytes: int, memory_limit: int, *, keep_all: bool = False) -> bool:
    """The budget's rule: may a block of ``nbytes`` be admitted while ``held`` bytes are? Within
    ``memory_limit``; a block larger than the whole budget alone, when nothing is held (so any
    checkpoint loads); every block at once for a caller that keeps them all (``keep_all``). Pure:
    the simulation at full scale (bench/sim_scale.py) drives this same rule."""
    return keep_all or held == 0 or held + nbytes <= memory_limit


class Budget:
    """Bytes of blocks admitted and not yet given back, against ``limit`` (:func:`admits`), kept
    in ``counters`` (``held``, ``peak_held``)."""

    def __init__(self, limit: int, counters: ReadCounters, *, keep_all: bool = False) -> None:
        self.limit, self.counters, self.keep_all = limit, counters, keep_all
        self.held = 0
        self.closed = False
        """:meth:`close`: nothing more is admitted."""

    def admits(self, nbytes: int) -> bool:
        return not self.closed and admits(self.held, nbytes, self.limit, keep_all=self.keep_all)

    def close(self) -> None:
        """Admit nothing more: the reads in flight finish, and a polled run then yields
        ``None`` without waiting (a distributed rank that stops splitting keeps those reads)."""
        self.closed = True

    def take(self, nbytes: int) -> None:
        self.held += nbytes
        self.counters.held = self.held
        self.counters.peak_held = max(self.counters.peak_held, self.held)

    def give(self, nbytes: int) -> None:
        self.held -= nbytes
        self.counters.held = self.held


@dataclass(frozen=True)
class Job:
    """One load's reads as the pipeline hands them to its exchange, passed down whole: what is
    read (``plan``), from where (``sources``, by the plan's file index), by which settings
    (``config``), where the counts go (``counters``, ``on_bytes``), the online tuner, and whether
    the caller keeps every block until the load is over (``keep_all``: ``load()`` into memory
    the reads land in; see :func:`run_plan`), and the checks the ranks share (``checks``)."""

    plan: ReadPlan
    sources: Sequence[Source]
    config: StreamConfig
    counters: ReadCounters
    tuning: Tuner | None = None
    on_bytes: Callable[[int], None] | None = None
    keep_all: bool = False
    checks: Mapping[int, Verifier] = field(default_factory=dict)
    """The checks of the files whose reads a distributed load's ranks share (by file index;
    :attr:`~weightstream.engine.verify.Verifier.shared`)."""
    hashes: Mapping[int, InOrder] = field(default_factory=dict)
    """The hashes in file order of those files (:attr:`~weightstream.engine.verify.InOrder.shared`):
    fed with the rounds as they are gathered, one rank a file."""

    def __post_init__(self) -> None:
        # The pipeline hands settings resolved for the storage; a direct caller's automatic
        # ones are a local disk's.
        object.__setattr__(self, "config", self.config.resolved())

    @property
    def memory_limit(self) -> int:
        return settled(self.config.memory_limit)

    @property
    def concurrency(self) -> int:
        return settled(self.config.concurrency)


@dataclass
class _Admitted:
    """A block's chunks while some are not read yet: which are taken (by a read of their own or
    joined into a neighbour's), and the sink's handle their destinations are cut from."""

    chunks: list[Chunk]
    taken: bytearray
    handle: Any


class _Gate:
    """How many reads may be in flight at once: a worker past ``limit`` waits here. One job: the
    count of reads running and waiting."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self.waiting = 0
        """Threads holding a chunk, waiting for a slot under ``limit``."""
        self._cond = threading.Condition()

    def enter(self, cancelled: threading.Event) -> None:
        """Wait for a slot (or for the load to be cancelled), then take it."""
        with self._cond:
            while self.active >= self.limit and not cancelled.is_set():
                self.waiting += 1
                self._cond.wait()
                self.waiting -= 1
            self.active += 1

    def leave(self) -> None:
        with self._cond:
            self.active -= 1
            self._cond.notify()

    def set_limit(self, limit: int) -> None:
        if limit != self.limit:
            with self._cond:
                self.limit = limit
                self._cond.notify_all()

    def wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()


class _Pool:
    """The daemon threads that run the workers' loop and the queue they take reads from: started
    as the depth needs them, up to ``most``, and stopped together. One job: the threads."""

    def __init__(self, work: Callable[[], None], most: int, cancelled: threading.Event) -> None:
        self.tasks: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        """``(block index, chunk number)`` of each chunk admitted, in order; a chunk already
        joined into an earlier read is skipped when its turn comes."""
        self.most = most
        self._work = work
        self._cancelled = cancelled
        self._threads: list[threading.Thread] = []
        self._spawn = threading.Lock()
        """Held to start threads and to read ``_threads`` once cancelled."""

    @property
    def started(self) -> int:
        return len(self._threads)

    def grow(self, want: int, *, wait: bool = True) -> None:
        """Start threads until there are ``want`` (at most ``most``); none once cancelled.

        Not under the gate nor the bookkeeping lock: starting a thread takes up to milliseconds
        (its stack is a mapping, which waits on the page faults of the reads running), and a
        worker needs the gate to begin its read. Starting 128 under the gate held the first
        read back until the last thread had started: 10-300 ms at the start of a load.
        ``wait=False`` (a worker): leave it to whoever is starting threads now."""
        if not self._spawn.acquire(blocking=wait):
            return
        try:
            while len(self._threads) < min(want, self.most) and not self._cancelled.is_set():
                t = threading.Thread(
                    target=self._work, name=f"weightstream-io-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
        finally:
            self._spawn.release()

    def stop(self, *, wait: float) -> None:
        """Drop the queued reads and let the threads go (``cancelled`` is set): wait up to
        ``wait`` seconds for those running."""
        while True:  # drop queued work so its buffers go now
            try:
                self.tasks.get_nowait()
            except queue.Empty:
                break
        with self._spawn:  # cancelled is set: no thread starts after this snapshot
            threads = list(self._threads)
        for _ in threads:
            self.tasks.put(None)
        deadline = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _Progress:
    """What the reads have done: each admitted block's chunks (which are claimed, how many are
    left), the bytes still queued, the load's counters, the reads in flight and when the last
    one ended. One job: the bookkeeping. ``lock`` is the engine's lock (the tuner is called
    under it too)."""

    def __init__(self, counters: ReadCounters, end_after: int | None) -> None:
        self.lock = threading.Lock()
        self.counters = counters
        self.inflight: dict[int, tuple[Chunk, float]] = {}
        """By worker thread: the read it runs and when it began."""
        self.last_progress = time.monotonic()
        self.queued = 0
        """Bytes of the chunks admitted and not yet claimed by a read."""
        self.ends_at_last = end_after is not None
        """Report no finished block but the last (``end_after``)."""
        self._blocks_to_end = end_after
        self._left: dict[int, int] = {}
        self._open: dict[int, _Admitted] = {}
        """Blocks with chunks not yet read, by index: their chunks, which are taken, the sink's handle."""

    def admit(self, block: Block, handle: Any, chunks: list[Chunk]) -> None:
        with self.lock:
            if not self._left:
                # Nothing was in flight (the caller held the budget, e.g. a distributed rank
                # waiting for the others): the stall clock starts now, not at the last read.
                self.last_progress = time.monotonic()
            self._left[block.index] = len(chunks)
            self._open[block.index] = _Admitted(chunks, bytearray(len(chunks)), handle)
            self.queued += block.nbytes

    def claim(self, index: int, k: int, most: Callable[[], int]) -> tuple[Chunk, Any, int] | None:
        """Chunk ``k`` of block ``index`` as the read to issue now, joined with the block's
        following chunks still waiting up to ``most()`` bytes (asked under the lock); with the
        sink's handle and the number of chunks it covers. ``None``: an earlier read covered it."""
        with self.lock:
            admitted = self._open.get(index)
            if admitted is None or admitted.taken[k]:
                return None
            chunks, taken = admitted.chunks, admitted.taken
            first = chunks[k]
            taken[k] = 1
            length, end = first.length, k + 1
            limit = most()
            while end < len(chunks) and not taken[end] and length + chunks[end].length <= limit:
                taken[end] = 1
                length += chunks[end].length
                end += 1
            self.queued -= length
            handle = admitted.handle
        chunk = first if end == k + 1 else Chunk(index, first.offset, length, first.pos)
        return chunk, handle, end - k

    def finished(self, chunk: Chunk, covers: int, n: int, how: str, now: float) -> tuple[int, bool]:
        """A read covering ``covers`` chunks ended with ``n`` bytes (``lock`` held): the chunks
        its block still waits for, and whether that was the last block ``end_after`` waits for."""
        counters = self.counters
        self.last_progress = now
        counters.chunks += 1
        counters.bytes_read += n
        counters.by_how[how] = counters.by_how.get(how, 0) + n
        left = self._left[chunk.block] - covers
        ended = False
        if left:
            self._left[chunk.block] = left
        else:
            del self._left[chunk.block]
            del self._open[chunk.block]
            if self._blocks_to_end is not None:
                self._blocks_to_end -= 1
                ended = self._blocks_to_end == 0
        return left, ended

    def storage_bytes(self) -> int:
        """Bytes read from the storage, not copied out of the page cache (what the tuner judges)."""
        return self.counters.bytes_read - self.counters.by_how.get("cached", 0)

    def clear(self) -> None:
        with self.lock:
            self._open.clear()


class _Workers:
    """The reads of one load on daemon threads: a :class:`_Gate`, a :class:`_Pool` and a
    :class:`_Progress`, and the rules between them and the tuner. The threads do the per-read
    bookkeeping themselves and wake the coordinator only when a block is complete or a read
    failed: on a machine with few cores a wake-up per chunk would preempt a reader every time.

    Reads in flight: the storage's depth (configured, or the tuner's) while reads go to the
    storage, and at most one per CPU while they are copies out of the page cache (``cached``).
    A copy is CPU work (the kernel zeroes each fresh destination page, then copies into it), so
    more of them than CPUs only time-slice the same cores. The mode follows the last read that
    finished, so a load that runs from cached into cold data (or back) switches with it.
    Figures: bench/RESULTS.md, "The measurements behind the code".
    """

    def __init__(
        self,
        sources: Sequence[Source],
        blocks: Sequence[Block],
        n: int,
        counters: ReadCounters,
        sink: Sink,
        tuner: Tuner | None = None,
        *,
        cpus: int = 1 << 30,
        cached: bool = False,
        end_after: int | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        """``n``: threads at most; ``end_after``: report no finished block but the last of that
        many (``_ALL_DONE``); ``throttle``: the load's bandwidth cap, taken before each read."""
        self.sink = sink
        self.throttle = throttle
        self.tuner = tuner
        self.depth = tuner.depth if tuner is not None else n
        """The storage's depth (the tuner moves it)."""
        self.cpus = cpus
        self.cached = cached
        """The last read was a copy out of the page cache: ``cpus`` reads at most."""
        self._final = False
        """The load's last reads are being issued together (:meth:`Tuner.final_bytes`)."""
        self._all_admitted = False
        self.events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self._sources = sources
        self._blocks = blocks
        self.progress = _Progress(counters, end_after)
        self.pool = _Pool(self._work, n, self.cancelled)
        self.gate = _Gate(self._limit())
        # Threads are started as the depth needs them, not all up front: starting dozens of
        # threads takes milliseconds, which a hot load would spend before its first read. The
        # first starts now; the others once the first blocks are queued (``fill_up``), so the
        # first read does not wait for the start of all of them.
        self.pool.grow(1)

    @property
    def inflight(self) -> dict[int, tuple[Chunk, float]]:
        return self.progress.inflight

    @property
    def last_progress(self) -> float:
        return self.progress.last_progress

    def submit(self, block: Block, handle: Any, chunks: list[Chunk]) -> None:
        self.progress.admit(block, handle, chunks)
        for k in range(len(chunks)):
            self.pool.tasks.put((block.index, k))

    def fill_up(self, *, wait: bool = True, all_admitted: bool = False) -> None:
        """Start the threads the current depth allows and the queued reads need: a thread with
        no read to take would only cost its start and its exit (at 128 reads in flight for a
        checkpoint of 67 chunks, 61 of them). ``wait=False`` (a worker): leave it to whoever is
        starting threads now (the coordinator calls it again on its next turn).
        ``all_admitted``: the coordinator has admitted every block of the plan."""
        if all_admitted:
            self._all_admitted = True
        self._finishing()
        gate = self.gate
        want = min(gate.limit, gate.active + gate.waiting + self.pool.tasks.qsize())
        if self.pool.started < want:
            self.pool.grow(want, wait=wait)

    def _finishing(self) -> None:
        """Once every block is admitted and the bytes still queued are within the tuner's
        :meth:`~Tuner.final_bytes`, lift the limit so that all of them are issued now."""
        if self._final or not self._all_admitted or self.tuner is None:
            return
        with self.progress.lock:
            queued = self.progress.queued
            self._final = 0 < queued <= self.tuner.final_bytes()
        if self._final:
            log.debug("the last %d bytes are issued together", queued)
            self._relimit()

    def _issue_size(self) -> int:
        return self.tuner.issue_size() if self.tuner is not None else 0

    def _work(self) -> None:
        me = threading.get_ident()
        progress, gate, cancelled = self.progress, self.gate, self.cancelled
        while True:
            task = self.pool.tasks.get()
            if task is None:
                return
            if cancelled.is_set():
                continue
            gate.enter(cancelled)
            # Claimed once a slot is free, so the read's size is decided when it is issued.
            claimed = None if cancelled.is_set() else progress.claim(*task, self._issue_size)
            del task
            if claimed is None:
                gate.leave()
                continue
            chunk, handle, covers = claimed
            target = self.sink.target(handle, chunk)
            del claimed, handle
            source = self._sources[self._blocks[chunk.block].source]
            if self.throttle is not None and not self.throttle.take(chunk.length, cancelled):
                gate.leave()  # cancelled while it waited: the load is over
                continue
            started = time.monotonic()
            progress.inflight[me] = (chunk, started)
            progress.counters.read_started(started)
            delivered: int | None = None
            try:
                if cancelled.is_set():
                    continue
                n, how = self.sink.fill(source, chunk, target)
                delivered = n
            except BaseException as exc:  # handed to the coordinator, re-raised there
                self.events.put((chunk.block, chunk, exc))
                continue
            finally:
                progress.counters.read_ended(time.monotonic(), delivered)
                progress.inflight.pop(me, None)
                del target
                gate.leave()
            try:  # a failure here must reach the coordinator too, or the load would wait for it
                left, ended = self._finished(chunk, covers, n, how, started)
                self.fill_up(wait=False)  # the tuner may have raised the depth
                if not left:
                    self.sink.block_done(self._blocks[chunk.block])
            except BaseException as exc:
                self.events.put((chunk.block, chunk, exc))
                continue
            if ended:
                self.events.put((_ALL_DONE, None, None))
            elif not left and not progress.ends_at_last:
                self.events.put((chunk.block, None, None))

    def _finished(self, chunk: Chunk, covers: int, n: int, how: str, started: float) -> tuple[int, bool]:
        """A read ended: its bookkeeping, the page-cache mode, and the tuner, under the lock."""
        now = time.monotonic()
        if self.throttle is not None:
            self.throttle.observe(now - started)
        with self.progress.lock:
            left, ended = self.progress.finished(chunk, covers, n, how, now)
            if (how == "cached") != self.cached:
                self.cached = how == "cached"
                self._relimit()
            if self.tuner is not None:
                self._retune(now, now - started, n, cached=how == "cached")
        return left, ended

    def idle_tick(self) -> None:
        """The coordinator found no event for ``_TICK`` seconds: feed the tuner anyway."""
        if self.tuner is None:
            return
        with self.progress.lock:
            self._apply(
                self.tuner.idle_tick(time.monotonic(), self.progress.storage_bytes(), starved=self._starved())
            )
        self.fill_up()

    def _retune(self, now: float, seconds: float, nbytes: int, *, cached: bool) -> None:
        """Per finished read (under the lock): feed the tuner, apply its depth. A copy out of the
        page cache says nothing about the storage: its bytes are not counted, and the tuner's
        epoch is thrown away."""
        assert self.tuner is not None
        delivered = self.progress.storage_bytes()
        if cached:
            self._apply(self.tuner.skip(now, delivered))
        else:
            self._apply(
                self.tuner.after_read(now, seconds, delivered, starved=self._starved(), nbytes=nbytes)
            )

    def _starved(self) -> bool:
        """No chunk is waiting for a slot: the plan or the memory budget, not the depth, limits
        the reads in flight right now."""
        return self.gate.waiting == 0 and self.pool.tasks.qsize() == 0

    def _apply(self, depth: int) -> None:
        if depth != self.depth:
            self.depth = depth
            self._relimit()

    def _limit(self) -> int:
        if self.cached:
            return min(self.depth, self.cpus)
        return max(self.depth, self.pool.most) if self._final else self.depth

    def _relimit(self) -> None:
        self.gate.set_limit(self._limit())
        # The threads a higher limit needs are started by ``fill_up``, outside the lock.

    def stop(self, *, wait: float) -> None:
        """Cancel queued work and let the threads go. Waits up to ``wait`` seconds for reads in
        progress to finish, so the caller can close its files without a late read landing on a
        recycled descriptor; a read stuck in the kernel is abandoned to its daemon thread."""
        self.cancelled.set()
        self.gate.wake_all()
        self.progress.clear()
        self.pool.stop(wait=wait)


Polled = Generator[tuple[Block, torch.Tensor] | None, float | None, None]
"""What :func:`run_plan_polled` returns: send it how long to wait for the next block."""


def run_plan_polled(
    plan: ReadPlan,
    sources: Sequence[Source],
    config: StreamConfig,
    *,
    counters: ReadCounters | None = None,
    tuning: Tuner | None = None,
    sink: Sink | None = None,
    budget: Budget | None = None,
) -> Polled:
    """:func:`run_plan` for a caller that must not block on a read: ``send(seconds)`` waits at most
    that long for the next finished block (``None``, or ``next()``: until one is) and yields
    ``None`` when none finished in time, or at once when nothing is in flight and the budget
    admits nothing (the caller holds it: ``budget``). Prime it with one ``next()`` (it yields
    ``None``; the reads start then). A distributed rank uses it so that a late read of its own
    never keeps it from telling the others what it has."""
    job = Job(plan, sources, config, counters if counters is not None else ReadCounters(), tuning)
    return _run_plan(job, sink=sink, budget=budget, polled=True)


def run_plan(
    plan: ReadPlan,
    sources: Sequence[Source],
    config: StreamConfig,
    *,
    counters: ReadCounters | None = None,
    on_bytes: Callable[[int], None] | None = None,
    tuning: Tuner | None = None,
    sink: Sink | None = None,
    keep_all: bool = False,
    budget: Budget | None = None,
) -> Generator[tuple[Block, torch.Tensor], None, None]:
    """Yield ``(block, buffer)`` as each block's bytes are all in, in completion order.

    ``buffer`` is a uint8 tensor holding the file bytes ``[block.start, block.end)``. The block
    counts against ``config.memory_limit`` until the generator is resumed after yielding it.
    ``on_bytes(n)`` is called as blocks complete; the calls add up to ``plan.read_bytes``.
    Closing the generator early cancels the outstanding reads. With ``tuning``, the reads in
    flight and the read size of blocks not yet started follow the online tuner. ``sink`` decides
    where the bytes go (default: host buffers the tensors keep; see :mod:`weightstream.engine.sink`).

    Destinations that cost no memory until written (host mappings) are prepared up to
    ``memory_limit`` bytes beyond the blocks admitted, so that few are made while reads are
    running (see :class:`~weightstream.engine.sink.HostSink`).

    ``keep_all``: the caller keeps every block until the load is over (``load()``), so holding
    them back costs it nothing. Every block is admitted at once, the workers wake the coordinator
    only for a failure or the end, and the blocks are yielded in plan order once all are in
    (``on_bytes`` is called then). On a machine with few cores, a wake-up per block and the
    caller's work on each block preempt the readers (figures: bench/RESULTS.md, "The measurements
    behind the code").

    ``budget``: one the caller gives back itself (``run_distributed`` holds a rank's parts until
    their round is gathered, not only until they are handed over); its ``limit`` replaces
    ``memory_limit`` for admission. Without one, a block's bytes are given back as the caller
    takes it.
    """
    counters = counters if counters is not None else ReadCounters()
    job = Job(plan, sources, config, counters, tuning, on_bytes, keep_all)
    return cast(
        "Generator[tuple[Block, torch.Tensor], None, None]",
        _run_plan(job, sink=sink, budget=budget, polled=False),
    )


def _run_plan(job: Job, *, sink: Sink | None, budget: Budget | None, polled: bool) -> Polled:
    """:func:`_run_blocks`, with the heap left out of the garbage collector's passes while the
    coordinator runs (:mod:`weightstream.engine.heap`: a full pass over a torch process's
    objects holds the GIL for tens of milliseconds, and a load's requests trigger them).

    Per resume, not for the generator's life: a ``load()`` is one resume from its first read to
    its last, while a stream suspended at a block is the caller's time, and a stream abandoned
    there (left in a reference cycle, say) must not keep the heap frozen until it is collected,
    which a frozen heap would never do."""
    blocks = _run_blocks(job, sink=sink, budget=budget, polled=polled)
    sent: float | None = None
    try:
        while True:
            with frozen_heap():
                try:
                    item = blocks.send(sent)
                except StopIteration:
                    return
            sent = yield item
    finally:
        with frozen_heap():
            blocks.close()  # (cancels and joins the workers when the caller stopped early)


def _run_blocks(job: Job, *, sink: Sink | None, budget: Budget | None, polled: bool) -> Polled:
    """:func:`run_plan`; ``polled``: as :func:`run_plan_polled` (never yields ``None`` without)."""
    plan, sources, config, counters, tuning = job.plan, job.sources, job.config, job.counters, job.tuning
    on_bytes, keep_all = job.on_bytes, job.keep_all
    pending = deque(plan.blocks)
    outstanding: dict[int, torch.Tensor] = {}  # block index -> buffer being filled
    ready: deque[tuple[Block, torch.Tensor]] = deque()
    own = budget is None
    budget = budget if budget is not None else Budget(job.memory_limit, counters, keep_all=keep_all)
    stuck = False
    sink = sink if sink is not None else HostSink()
    ahead = _Ahead(plan, sources, sink, job.memory_limit)
    wait: float | None = None  # polled: how long the caller lets the next wait for a block last
    workers = _start_workers(job, sink)
    finished = False
    try:
        if polled:  # primed by the caller's first next(): every later resume can carry a wait
            wait = yield None
        while pending or outstanding or ready:
            while pending and budget.admits(pending[0].nbytes):
                block = pending.popleft()
                ahead.admitted(block)
                buf, handle = sink.allocate(block, sources[block.source].uri)
                budget.take(block.nbytes)
                chunks = list(block.chunks(tuning.chunk_size() if tuning else plan.chunk_size))
                if chunks:
                    outstanding[block.index] = buf
                    workers.submit(block, handle, chunks)
                else:
                    ready.append((block, buf))
                del handle, buf
            ahead.fill()
            workers.fill_up(all_admitted=not pending)
            while ready:
                block, buf = ready.popleft()
                wait = yield block, sink.ready(block, buf)
                if own:
                    budget.give(block.nbytes)
                del buf
            if not outstanding:
                if polled and pending:  # the caller holds the budget: nothing can happen here
                    wait = yield None
                continue
            try:
                event = _next_event(workers, sources, plan, config.io_timeout, poll=wait if polled else None)
            except StorageTimeoutError:
                stuck = True  # waiting for those reads is what just failed
                raise
            if event is None:
                wait = yield None
                continue
            index, failed, error = event
            if error is not None:
                assert failed is not None
                raise _as_weightstream_error(error, sources[plan.blocks[failed.block].source].uri, failed)
            done = sorted(outstanding) if index == _ALL_DONE else [index]
            for i in done:
                block = plan.blocks[i]
                ready.append((block, outstanding.pop(i)))
                if on_bytes is not None:
                    on_bytes(block.nbytes)
        finished = True
    finally:
        # A stream left open when the interpreter exits is collected during finalization, when
        # the daemon threads are frozen wherever they were (a lock of a source held, a join
        # that cannot end): nothing is cancelled or waited for then, the process is ending.
        exiting = sys.is_finalizing()
        if not finished and not exiting:
            _cancel(sources)
        # Join the threads even after a finished load: one still dropping its last buffer (torch
        # code) when the interpreter exits would be killed inside C++ and abort the process.
        workers.stop(wait=0.0 if stuck or exiting else _STOP_WAIT)
        sink.drop_ahead()
        outstanding.clear()
        ready.clear()


class _Ahead:
    """Destinations prepared ahead of admission, in plan order, up to ``limit`` bytes (see
    :class:`~weightstream.engine.sink.HostSink`), until the sink says it does not map ahead."""

    def __init__(self, plan: ReadPlan, sources: Sequence[Source], sink: Sink, limit: int) -> None:
        self.plan, self.sources, self.sink, self.limit = plan, sources, sink, limit
        self.bytes = 0
        """Mapped ahead and not admitted yet."""
        self.mapped = 0
        """``plan.blocks[:mapped]`` are admitted or mapped ahead (both go in plan order)."""
        self.can_map = True

    def admitted(self, block: Block) -> None:
        if block.index < self.mapped:
            self.bytes -= block.nbytes
        else:
            self.mapped = block.index + 1

    def fill(self) -> None:
        blocks = self.plan.blocks
        while (
            self.can_map
            and self.mapped < len(blocks)
            and self.bytes + blocks[self.mapped].nbytes <= self.limit
        ):
            block = blocks[self.mapped]
            self.can_map = self.sink.map_ahead(block, self.sources[block.source].uri)
            if self.can_map:
                self.bytes += block.nbytes
                self.mapped += 1


def _start_workers(job: Job, sink: Sink) -> _Workers:
    """The load's workers, with a thread per request the tuner may allow (those beyond its depth
    wait at the gate), started as cached copies or as storage reads by what the plan begins with."""
    plan, sources, counters, tuning = job.plan, job.sources, job.counters, job.tuning
    cpus = host.usable_cpus()
    first = tuning.depth if tuning is not None else job.concurrency
    cached = host.starts_cached(plan, sources, min(first, cpus + 1))
    # With keep_all, one event when every block with bytes to read is in.
    last_event = sum(1 for b in plan.blocks if b.nbytes) if job.keep_all else None
    cap = job.config.max_bandwidth
    throttle = Throttle(cap) if cap else None
    if tuning is None:
        n = max(1, min(job.concurrency, plan.num_chunks))
        return _Workers(
            sources,
            plan.blocks,
            n,
            counters,
            sink,
            cpus=cpus,
            cached=cached,
            end_after=last_event,
            throttle=throttle,
        )
    most = plan.num_chunks + plan.read_bytes // tuning.min_chunk
    workers = _Workers(
        sources,
        plan.blocks,
        max(1, min(max(tuning.maximum, FINAL_THREADS), most)),
        counters,
        sink,
        tuning,
        cpus=cpus,
        cached=cached,
        end_after=last_event,
        throttle=throttle,
    )
    tuning.begin(time.monotonic())
    return workers


def _cancel(sources: Sequence[Source]) -> None:
    """The load ended early (closed, interrupted or failed): requests that can be abandoned are
    cancelled now, so their workers come back at once instead of when a stalled request ends."""
    for source in {id(s): s for s in sources}.values():
        if isinstance(source, Cancellable):
            source.cancel()


def _next_event(
    workers: _Workers, sources: Sequence[Source], plan: ReadPlan, timeout: float, *, poll: float | None = None
) -> _Event | None:
    """The next finished block or failure; StorageTimeoutError once no chunk at all has finished
    for ``timeout`` seconds (a large block on slow storage is progress, not a stall). With
    ``poll``: ``None`` if nothing finished within that many seconds."""
    deadline = None if poll is None else time.monotonic() + poll
    while True:
        now = time.monotonic()
        wait = timeout - (now - workers.last_progress)
        if wait > 0:
            step = min(wait, _TICK) if workers.tuner else wait
            if deadline is not None:
                step = max(0.0, min(step, deadline - now))
            try:
                return workers.events.get(timeout=step)
            except queue.Empty:
                workers.idle_tick()
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
        stuck = sorted(workers.inflight.copy().values(), key=lambda item: item[1])
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
    """A worker's failure as the caller sees it: ours as it is, a storage failure as a
    :class:`ReadError` naming the file and range with the original as its cause (it was raised
    on another thread, so nothing chains it there), anything else (a bug, an interrupt) as it is."""
    if isinstance(error, WeightStreamError):
        return error
    if isinstance(error, OSError | MemoryError | ValueError):
        wrapped = ReadError(
            f"read failed: {error!r}", uri=uri, byte_range=(chunk.offset, chunk.offset + chunk.length)
        )
        wrapped.__cause__ = error
        return wrapped
    return error  # KeyboardInterrupt, bugs: unchanged
