"""The engine obeys the tuner: reads in flight follow its depth, read sizes follow its chunk size,
and every byte still lands where it belongs."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.config import StreamConfig
from weightstream.engine.plan import make_plan
from weightstream.engine.scheduler import ReadCounters, run_plan
from weightstream.format.dtypes import DTYPES
from weightstream.format.safetensors import TensorEntry
from weightstream.sources.memory import MemorySource, MemoryStore
from weightstream.tuning.controller import DepthController
from weightstream.tuning.online import Tuning, make_tuning

U8 = DTYPES["U8"]


_names = itertools.count()
_opened: list[MemoryStore] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def stored(
    data: bytes,
    *,
    resident_upto: int | None = None,
    kind: type[MemorySource] = MemorySource,
) -> MemorySource:
    """``data`` as the one object of a fresh in-memory store (the library's own backend), whose
    reads take 2 ms each and are logged: ``(reads running at its start, offset, length)``."""
    store = MemoryStore(f"engine-{next(_names)}", delay=0.002, resident_upto=resident_upto)
    _opened.append(store)
    store.put("m", data)
    return kind(store, "m")


def running(src: MemorySource) -> list[int]:
    """Reads running at each read's start, in order."""
    return [a for a, _, _ in src.store.reads.entries]


def reads(src: MemorySource) -> list[tuple[int, int]]:
    """Each read's ``(offset, length)``, in order."""
    return [(o, n) for _, o, n in src.store.reads.entries]


class Scripted(DepthController):
    """A controller that changes depth on a script, whatever it measures."""

    def __init__(self, depths: list[int]) -> None:
        super().__init__(initial=depths[0], maximum=max(depths))
        self.script, self.calls = depths, 0

    def tick(self, now: float, delivered: int, *, starved: bool = False) -> int:
        self.calls += 1
        self.depth = self.script[min(len(self.script) - 1, self.calls // 20)]
        return self.depth


class NoFinish(Tuning):
    """A tuning whose last reads never go out together (:meth:`Tuning.final_bytes` 0)."""

    def final_bytes(self) -> int:
        return 0


def test_reads_in_flight_follow_the_tuner_and_bytes_are_exact() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    entries = [
        TensorEntry(f"t{i}", U8, (64 << 10,), i * (64 << 10), (i + 1) * (64 << 10), "m") for i in range(128)
    ]
    plan = make_plan([entries], chunk_size=64 << 10)
    src = stored(data)
    controller = Scripted([2, 8, 3, 1])
    # The last reads of a load go out together past the depth (final_bytes: the rate times the
    # slowest recent read, so one slow read makes it several; tested below): not here, where
    # the depth itself is under test.
    tuning = NoFinish(controller, chunk_size=64 << 10, min_chunk=16 << 10, inflight=256 << 10)
    cfg = StreamConfig(memory_limit=1 << 20)
    got = {}
    for block, buf in run_plan(plan, [src], cfg, tuning=tuning):
        got[block.start] = buf.numpy().tobytes()
    assert b"".join(got[k] for k in sorted(got)) == data
    assert max(running(src)) <= 8  # never past the tuner's largest depth
    assert max(running(src)) > 2  # it did open up when told to
    # read sizes shrink as depth grows: 256 KiB in flight / depth, between 16 and 64 KiB
    sizes = {n for _, n in reads(src)}
    assert min(sizes) < 64 << 10 and min(sizes) >= 16 << 10
    last = running(src)[-20:]
    assert max(last) <= 3  # the final depths (3, then 1) held at the end


def _entries(n: int, size: int) -> list[TensorEntry]:
    return [TensorEntry(f"t{i}", U8, (size,), i * size, (i + 1) * size, "m") for i in range(n)]


def test_copies_from_the_page_cache_run_one_per_cpu_and_device_reads_at_full_depth(monkeypatch) -> None:
    from weightstream.engine import host

    monkeypatch.setattr(host, "usable_cpus", lambda: 2)
    data = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    plan = make_plan([_entries(128, 64 << 10)], chunk_size=64 << 10)
    half = 4 << 20
    for tuned in (False, True):
        src = stored(data, resident_upto=half)
        tuning = (
            Tuning(
                DepthController(initial=8, maximum=8),
                chunk_size=64 << 10,
                min_chunk=64 << 10,
                inflight=1 << 20,
            )
            if tuned
            else None
        )
        cfg = StreamConfig(memory_limit=2 << 20, concurrency=8, autotune=tuned)
        got = {block.start: buf.numpy().tobytes() for block, buf in run_plan(plan, [src], cfg, tuning=tuning)}
        assert b"".join(got[k] for k in sorted(got)) == data
        cached_starts = [a for a, offset, _ in src.store.reads.entries if offset < half]
        device_starts = [a for a, offset, _ in src.store.reads.entries if offset >= half]
        assert max(cached_starts) <= 2, tuned  # one copy per CPU, from the first read on
        assert max(device_starts) > 2, tuned  # the device's depth once its reads come in


def test_the_tuner_learns_nothing_from_page_cache_copies() -> None:
    data = bytes(range(256)) * (16 << 10)  # 4 MiB
    plan = make_plan([_entries(64, 64 << 10)], chunk_size=64 << 10)
    src = stored(data, resident_upto=len(data))
    controller = DepthController(initial=4, maximum=16, min_epoch=0.001)
    tuning = Tuning(controller, chunk_size=64 << 10, min_chunk=64 << 10, inflight=1 << 20)
    for _ in run_plan(plan, [src], StreamConfig(memory_limit=1 << 20), tuning=tuning):
        pass
    # Fed as storage reads, 64 reads of 2 ms with 1 ms epochs would have moved it.
    assert controller.rates == {} and controller.decisions == []
    assert controller.depth == 4


def test_a_load_that_starts_cold_starts_at_the_storage_depth(monkeypatch) -> None:
    from weightstream.engine import host

    monkeypatch.setattr(host, "usable_cpus", lambda: 2)
    plan = make_plan([_entries(16, 64 << 10)], chunk_size=64 << 10)
    cold = stored(bytes(1 << 20), resident_upto=0)
    hot = stored(bytes(1 << 20), resident_upto=1 << 20)
    assert not host.starts_cached(plan, [cold], 3)
    assert host.starts_cached(plan, [hot], 3)
    assert not host.starts_cached(plan, [stored(bytes(1 << 20))], 3)  # cannot tell: storage
    for _ in run_plan(plan, [cold], StreamConfig(concurrency=8, autotune=False)):
        pass
    assert max(running(cold)) > 2


def test_usable_cpus_is_within_the_machine() -> None:
    from weightstream.engine.host import usable_cpus

    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


class Broken(DepthController):
    """A controller that fails on its third tick."""

    def __init__(self) -> None:
        super().__init__(initial=4, maximum=4)
        self.calls = 0

    def tick(self, now: float, delivered: int, *, starved: bool = False) -> int:
        self.calls += 1
        if self.calls == 3:
            raise ZeroDivisionError("a bug in the tuner")
        return self.depth


def test_a_failure_after_a_read_fails_the_load_at_once() -> None:
    """Not only a failed read: any failure on a worker thread (here the tuner's) reaches the
    caller now, instead of the load waiting for a block that will never complete."""

    plan = make_plan([_entries(64, 64 << 10)], chunk_size=64 << 10)
    tuning = Tuning(Broken(), chunk_size=64 << 10, min_chunk=64 << 10, inflight=1 << 20)
    # Had the load waited for the block instead, it would end in a StorageTimeoutError.
    with pytest.raises(ZeroDivisionError, match="a bug in the tuner"):
        for _ in run_plan(plan, [stored(bytes(4 << 20))], StreamConfig(io_timeout=5), tuning=tuning):
            pass


def test_object_store_pieces_follow_the_rate_of_one_flow() -> None:
    """Bytes of a response count as pieces arrive. A piece is about 50 ms of one flow: small
    on a crowded link, so the tuner sees a change within a fraction of a second; large on a
    fast one, so the Python work per byte stays small; never beyond what the source allows."""
    from weightstream.sources.object_store import RequestStats

    stats = RequestStats()
    largest = 768 << 10
    assert stats.piece_for(largest, 100.0) == 256 << 10  # nothing measured yet
    # 128 flows sharing 1 Gbit/s: 1 MB/s each, 50 KB in 50 ms: the smallest piece.
    stats.inflight, stats.received = 128, 0
    stats.piece_for(largest, 100.0)
    stats.received = int(125e6 * 0.5)
    assert stats.piece_for(largest, 100.5) == 64 << 10
    # 16 flows at 100 MB/s each: 5 MB in 50 ms, capped at the largest piece.
    stats.inflight = 16
    stats.received += int(1.6e9 * 0.5)
    assert stats.piece_for(largest, 101.0) == largest == stats.piece
    # 128 flows at 12 MB/s each: 600 KB, in whole 64 KiB units.
    stats.inflight = 128
    stats.received += int(1.5e9 * 0.5)
    size = stats.piece_for(largest, 101.5)
    assert size % (64 << 10) == 0 and 512 << 10 <= size <= 640 << 10


def test_no_read_waits_for_the_engine_to_start_its_threads(monkeypatch) -> None:
    """Starting a thread can take milliseconds (its stack waits on the page faults of the reads
    running). The rule: a worker's read never waits for other threads to be started, nor does
    one worker's bookkeeping. Here every thread after the first two starts only once a read has
    run; an engine that starts threads while holding what a read needs never reads at all."""
    from weightstream.engine import scheduler

    read_ran = threading.Event()
    waited_for_read: list[bool] = []
    real = threading.Thread

    spawning = threading.Event()

    class SlowStart(real):  # type: ignore[misc, valid-type]
        started_count = 0

        def start(self) -> None:
            SlowStart.started_count += 1
            self.early = SlowStart.started_count <= 2
            if not self.early:
                spawning.set()
                waited_for_read.append(read_ran.wait(timeout=3))
            super().start()

        def run(self) -> None:
            if self.early:  # the first threads take their chunks while the others are started
                spawning.wait(timeout=3)
            super().run()

    class Recording(MemorySource):
        def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, str]:
            read_ran.set()
            return super().read_into(buf, offset=offset)

    monkeypatch.setattr(scheduler.threading, "Thread", SlowStart)
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    entries = [
        TensorEntry(f"t{i}", U8, (64 << 10,), i * (64 << 10), (i + 1) * (64 << 10), "m") for i in range(64)
    ]
    plan = make_plan([entries], chunk_size=64 << 10)
    got = {}
    cfg = StreamConfig(memory_limit=64 << 20, max_concurrency=16, autotune=False)
    for block, buf in run_plan(plan, [stored(data, kind=Recording)], cfg, keep_all=True):
        got[block.start] = buf.numpy().tobytes()
    assert b"".join(got[k] for k in sorted(got)) == data
    assert waited_for_read and all(waited_for_read)  # each later start saw a read already done


def test_no_more_threads_start_than_the_queued_reads_need(monkeypatch) -> None:
    """A thread with no read to take costs its start and its exit and nothing else: a
    checkpoint of 5 chunks read at a depth of 64 starts at most 5 reader threads (the code
    before started a thread per read the depth allowed, whatever was queued: 64)."""
    from weightstream.engine import scheduler

    started: list[str] = []
    real = threading.Thread

    class Counted(real):  # type: ignore[misc, valid-type]
        def start(self) -> None:
            started.append(self.name)
            super().start()

    monkeypatch.setattr(scheduler.threading, "Thread", Counted)
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, 5 << 24, dtype=np.uint8).tobytes()
    entries = [TensorEntry(f"t{i}", U8, (1 << 24,), i << 24, (i + 1) << 24, "m") for i in range(5)]
    plan = make_plan([entries], chunk_size=1 << 24)
    assert plan.num_chunks == 5
    for autotune in (False, True):
        started.clear()
        cfg = StreamConfig(memory_limit=1 << 30, concurrency=64, max_concurrency=64, autotune=autotune)
        # as load() makes it: its reads land in memory it keeps (room)
        tuning = make_tuning(cfg, chunk_size=plan.chunk_size, room=plan.read_bytes)
        got = {
            block.start: buf.numpy().tobytes()
            for block, buf in run_plan(plan, [stored(data)], cfg, tuning=tuning, keep_all=True)
        }
        assert b"".join(got[k] for k in sorted(got)) == data
        readers = [n for n in started if n.startswith("weightstream-io")]
        assert 1 <= len(readers) <= plan.num_chunks, readers


class Joining(Tuning):
    """A tuner whose issue size follows a script, whatever it measures."""

    def __init__(self, sizes: list[int], *, chunk: int) -> None:
        super().__init__(
            DepthController(initial=6, maximum=6), chunk_size=chunk, min_chunk=chunk, inflight=1 << 30
        )
        self.sizes, self.calls = sizes, 0

    def issue_size(self) -> int:
        self.calls += 1
        return self.sizes[self.calls % len(self.sizes)]


@given(
    st.lists(st.integers(1, 150).map(lambda pages: pages * 4096), min_size=1, max_size=12),
    st.lists(st.sampled_from([0, 4096, 64 << 10, 100_000, 256 << 10, 1 << 20]), min_size=1, max_size=6),
    st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_reads_joined_at_issue_stay_within_a_block_and_read_each_byte_once(sizes, script, keep_all) -> None:
    """A read joins its block's following chunks still waiting, up to the tuner's issue size at
    that moment: whatever the sizes, every byte lands in place, is read exactly once, and no read
    crosses a block's edge or grows past the size it was given."""
    chunk = 64 << 10
    entries, pos = [], 0
    for i, n in enumerate(sizes):
        entries.append(TensorEntry(f"t{i}", U8, (n,), pos, pos + n, "m"))
        pos += n
    data = np.random.default_rng(len(sizes)).integers(0, 256, pos, dtype=np.uint8).tobytes()
    plan = make_plan([entries], chunk_size=chunk, block_size=1 << 20)
    src = stored(data)
    counters = ReadCounters()
    got = {}
    for block, buf in run_plan(
        plan,
        [src],
        StreamConfig(memory_limit=64 << 20),
        tuning=Joining(script, chunk=chunk),
        counters=counters,
        keep_all=keep_all,
    ):
        got[block.index] = buf.numpy().tobytes()
    for block in plan.blocks:
        for t in block.tensors:
            assert got[block.index][t.start - block.start : t.end - block.start] == data[t.start : t.end]
    done = sorted(reads(src))
    assert sum(n for _, n in done) == plan.read_bytes  # each byte once
    for block in plan.blocks:  # (whole pages: no two blocks share one)
        mine = [(a, n) for a, n in done if block.start <= a < block.end]
        assert [a for a, _ in mine] == [block.start] + [a + n for a, n in mine[:-1]]  # no gap, no overlap
        assert mine[-1][0] + mine[-1][1] == block.end  # never across its edge
        assert all(n <= max(chunk, max(script)) for _, n in mine)
    assert counters.chunks == len(done)


def test_a_read_joins_its_neighbours_when_the_tuner_asks() -> None:
    """One 1 MiB tensor in 64 KiB chunks, issue size 256 KiB: four reads, not sixteen."""
    data = bytes(range(256)) * 4096
    plan = make_plan([[TensorEntry("t", U8, (len(data),), 0, len(data), "m")]], chunk_size=64 << 10)
    src = stored(data)
    tensors = [
        buf.numpy().tobytes()
        for _, buf in run_plan(plan, [src], StreamConfig(), tuning=Joining([256 << 10], chunk=64 << 10))
    ]
    assert tensors == [data]
    assert sorted(reads(src)) == [(i * (256 << 10), 256 << 10) for i in range(4)]


def test_object_store_requests_grow_once_their_python_would_hold_the_interpreter() -> None:
    """A process's requests cost its one interpreter a fixed amount each. Once the process
    spends more than INTERPRETER_SHARE of a core in user mode while it loads, reads may join
    their block's waiting chunks, to the size that brings the share back (at least two chunks,
    faster when the interpreter is saturated); when the share falls, reads shrink back. Files
    never join (their reads are large already), and the bytes in flight bound the size."""
    from weightstream.sources.object_store import RequestStats
    from weightstream.tuning.online import INTERPRETER_SHARE, MAX_JOINED

    mib = 1 << 20

    class Run:
        def __init__(self, *, inflight: int = 64 << 30, network: object = RequestStats()) -> None:
            self.cpu, self.now, self.done = 0.0, 0.0, 0
            controller = DepthController(initial=128, maximum=1024, streaming=True)
            self.t = Tuning(
                controller,
                chunk_size=8 * mib,
                min_chunk=4 * mib,
                inflight=inflight,
                network=network,
                cpu=lambda: self.cpu,
            )
            self.t.begin(0.0)

        def window(self, share: float) -> int:
            """Half a second of reads (one measuring window) with the process ``share`` of a
            core busy; the issue size after."""
            for _ in range(4):
                self.now += 0.125
                self.cpu += share * 0.125
                self.done += 8 * mib
                self.t.after_read(self.now, 0.05, self.done, starved=False, nbytes=8 * mib)
            return self.t.issue_size()

    run = Run()
    assert run.window(0.2) == 0  # (this machine: 2.5 GB/s uses 0.16 of a core)
    assert run.window(INTERPRETER_SHARE * 0.99) == 0
    assert run.window(0.75) == 16 * mib  # 8 MiB x 1.5 is 12: at least two chunks
    assert run.window(1.0) == 48 * mib  # saturated: it grows faster, 12 MiB x 2 x 2
    assert run.t.largest_request == 48 * mib and run.t.summary()["largest_request"] == 48 * mib
    assert run.window(1.0) == MAX_JOINED  # never past it
    assert run.window(0.05) == 0  # quiet again: 64 MiB x 0.1 is under two chunks
    bounded = Run(inflight=2 << 30)  # 2 GiB in flight over a depth of 128: 16 MiB a read
    assert bounded.window(1.0) == 16 * mib
    files = Run(network=None)
    assert files.window(1.0) == 0 and files.window(1.0) == 0


class Finishing(Tuning):
    """Depth 2 throughout; the last ``final`` bytes may go out together."""

    def __init__(self, final: int, *, chunk: int) -> None:
        super().__init__(
            DepthController(initial=2, maximum=2), chunk_size=chunk, min_chunk=chunk, inflight=1 << 30
        )
        self.final = final

    def final_bytes(self) -> int:
        return self.final


@pytest.mark.parametrize("keep_all", [True, False])
def test_the_last_reads_go_out_together_once_every_block_is_admitted(keep_all: bool) -> None:
    """Where latency has a tail, the reads issued last each wait one, and the load ends with
    the slowest: once every block is admitted and the bytes queued are within the tuner's
    final_bytes, the engine issues all of them at once, past its depth. Until then, and with
    final_bytes 0, reads in flight never pass the depth; every byte lands in place either way."""
    chunk = 64 << 10
    data = np.random.default_rng(7).integers(0, 256, 48 * chunk, dtype=np.uint8).tobytes()
    entries = [
        TensorEntry(f"t{i}", U8, (4 * chunk,), i * 4 * chunk, (i + 1) * 4 * chunk, "m") for i in range(12)
    ]
    plan = make_plan([entries], chunk_size=chunk)
    for final, most in ((0, 2), (16 * chunk, 16)):
        src = stored(data)
        got = {}
        for block, buf in run_plan(
            plan,
            [src],
            StreamConfig(memory_limit=64 << 20),
            tuning=Finishing(final, chunk=chunk),
            keep_all=keep_all,
        ):
            got[block.start] = buf.numpy().tobytes()
        assert b"".join(got[k] for k in sorted(got)) == data
        ran = running(src)
        assert max(ran) <= most, (final, max(ran))
        assert max(ran[: len(ran) - 16]) <= 2  # the depth held until the last 16 reads
    assert max(ran) > 2  # (the last run) they did go out together


def test_final_bytes_is_the_rate_times_the_slowest_recent_read_on_files_only() -> None:
    from weightstream.sources.object_store import RequestStats

    files = Tuning(
        DepthController(initial=4, maximum=8), chunk_size=1 << 20, min_chunk=1 << 20, inflight=1 << 30
    )
    files.begin(0.0)
    assert files.final_bytes() == 0  # nothing measured yet
    for i in range(1, 11):  # 1 MiB every 0.1 s: 10.5 MB/s; the slowest read took 0.5 s
        files.after_read(i * 0.1, 0.5 if i == 3 else 0.05, i << 20, starved=False, nbytes=1 << 20)
    assert files.final_bytes() == int((10 << 20) / 1.0 * 0.5)
    store = Tuning(
        DepthController(initial=4, maximum=8, streaming=True),
        chunk_size=1 << 20,
        min_chunk=1 << 20,
        inflight=1 << 30,
        network=RequestStats(),
    )
    store.begin(0.0)
    for i in range(1, 11):
        store.after_read(i * 0.1, 0.5, i << 20, starved=False, nbytes=1 << 20)
    assert store.final_bytes() == 0  # object stores hedge their stragglers instead


def test_a_storage_failure_on_a_worker_reaches_the_caller_with_its_cause() -> None:
    """A read that fails on a worker thread is raised on the caller's as a ReadError naming the
    file and range, with the original error as its cause (nothing chains it across threads)."""
    from weightstream.errors import ReadError

    class Failing(MemorySource):
        def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, str]:
            raise OSError(5, "Input/output error")

    plan = make_plan([_entries(4, 64 << 10)], chunk_size=64 << 10)
    with pytest.raises(ReadError, match="memory://engine-") as caught:
        for _ in run_plan(plan, [stored(bytes(256 << 10), kind=Failing)], StreamConfig()):
            pass
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == 5
    assert caught.value.byte_range is not None
