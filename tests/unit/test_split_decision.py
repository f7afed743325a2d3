"""The per-load decision whether splitting the reads across ranks pays (pure; no process group).

Every rank applies :func:`split_pays` to the same status records, so the rule must be a pure
function of them; these tests check what it does with fast and slow exchanges, which rank's
figures bind, and that it never flips the wrong way as a figure improves; and that the read rate
it is fed is the storage's: bytes between read ends over the time a read was in flight.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightstream.distributed as wd
from weightstream import open_checkpoint
from weightstream.config import StreamConfig
from weightstream.distributed import Measured, split_pays
from weightstream.engine.plan import make_plan
from weightstream.engine.scheduler import ReadCounters, run_plan
from weightstream.sources.base import ReadHow
from weightstream.sources.file import FileSource

from ..conftest import random_tensor, write_sharded

GB = 10**9
ENOUGH = wd._DECIDE_AFTER


def ranks(
    read_rates: list[float], gather_rate: float, gathered: int = ENOUGH, gathers: int = 3
) -> list[Measured]:
    """Records of ranks whose reads ran at ``read_rates`` (bytes/s) and whose gathers took
    ``gathered / gather_rate`` seconds."""
    out = []
    for rate in read_rates:
        seconds = 2.0
        out.append(Measured(int(rate * seconds), seconds, gathered, gathered / gather_rate, gathers))
    return out


def test_nothing_is_decided_before_two_gathers_enough_bytes_and_a_rate_on_every_rank() -> None:
    slow_exchange = 0.01 * GB
    assert split_pays(ranks([1 * GB] * 2, slow_exchange, gathers=1), 2) is None
    assert split_pays(ranks([1 * GB] * 2, slow_exchange, gathered=ENOUGH - 1), 2) is None
    # one rank has not had two reads end yet: its rate is unknown, not infinite
    unknown = ranks([1 * GB] * 2, slow_exchange)
    unknown[1].read_bytes, unknown[1].read_seconds = 0, 0.0
    assert split_pays(unknown, 2) is None
    assert split_pays(ranks([1 * GB] * 2, slow_exchange), 2) is False


def test_a_fast_exchange_keeps_the_split() -> None:
    # eight ranks reading 2 GB/s each from a shared link, NCCL gathering at 100 GB/s
    assert split_pays(ranks([2 * GB] * 8, 100 * GB), 8) is True


def test_an_exchange_as_fast_as_the_reads_keeps_the_split() -> None:
    # each rank its own 300 MB/s path, gloo on 2 cores at 0.33 GB/s: the split (reads and
    # exchange overlapping) was 1.18x faster than each rank reading everything (bench/RESULTS.md);
    # a model adding the two costs would have given it up
    assert split_pays(ranks([0.33 * GB] * 2, 0.33 * GB), 2) is True


def test_an_exchange_slower_than_reading_stops_it() -> None:
    # one disk shared by two ranks, gloo's copies on the reads' two cores (bench/RESULTS.md)
    assert split_pays(ranks([0.67 * GB] * 2, 0.23 * GB), 2) is False
    # within a tenth: kept (the measurements are noisy)
    assert split_pays(ranks([1 * GB] * 2, 0.95 * GB), 2) is True


def test_reads_from_memory_are_never_split() -> None:
    # the page cache holds the checkpoint: a read takes no measurable time
    free = [Measured(ENOUGH, 0.0, ENOUGH, 0.01, 3)] * 4
    assert split_pays(free, 4) is False


def test_an_exchange_that_takes_no_time_always_pays() -> None:
    assert split_pays([Measured(ENOUGH, 1.0, ENOUGH, 0.0, 3)] * 2, 2) is True


def test_the_slowest_rank_s_reads_and_the_fastest_rank_s_gathers_bind() -> None:
    # Reading everything takes as long as the slowest rank needs: ranks at 10 and 0.5 GB/s and
    # an exchange at 1 GB/s: kept. Had the fast rank's rate bound, it would have stopped.
    assert split_pays(ranks([10 * GB, 0.5 * GB], 1 * GB), 2) is True
    # A rank that arrived late at each gather waited least there: its time is the exchange's own.
    late, early = ranks([1 * GB] * 2, 4 * GB)
    early.gather_seconds = 100 * late.gather_seconds  # it waited for the late rank
    assert split_pays([late, early], 2) is True


rate = st.floats(1e6, 1e12)


@settings(max_examples=300, deadline=None)
@given(read=rate, gather=rate, world=st.integers(2, 64), faster=st.floats(1.0, 100.0))
def test_the_decision_moves_only_the_right_way(read: float, gather: float, world: int, faster: float) -> None:
    decided = split_pays(ranks([read] * world, gather), world)
    assert decided is not None
    if decided:  # splitting pays: it still does with a faster exchange, slower reads, more ranks
        assert split_pays(ranks([read] * world, gather * faster), world)
        assert split_pays(ranks([read / faster] * world, gather), world)
        assert split_pays(ranks([read] * (world + 1), gather), world + 1)
    else:  # it does not: still not with a slower exchange or faster reads
        assert not split_pays(ranks([read] * world, gather / faster), world)
        assert not split_pays(ranks([read * faster] * world, gather), world)


@settings(max_examples=100, deadline=None)
@given(reads=st.lists(rate, min_size=2, max_size=8), gather=rate, data=st.data())
def test_every_order_of_the_records_gives_the_same_answer(
    reads: list[float], gather: float, data: st.DataObject
) -> None:
    records = ranks(reads, gather)
    shuffled = data.draw(st.permutations(records))
    assert split_pays(records, len(reads)) == split_pays(shuffled, len(reads))


@given(
    st.tuples(
        st.integers(0, 2**63),
        st.floats(0, 1e9),
        st.integers(0, 2**63),
        st.floats(0, 1e9),
        st.integers(0, 2**31),
    )
)
def test_a_status_record_carries_the_measurements_exactly(fields: tuple[Any, ...]) -> None:
    m = Measured(*fields)
    raw = m.pack()
    assert len(raw) <= wd._MEASURED
    assert Measured.unpack(raw.ljust(wd._MEASURED, b"\0")) == m


# --- the read rate the decision is fed: time with a read in flight, not time waited --------


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 100), st.floats(0.001, 10), st.integers(0, 1 << 30), st.booleans()),
        min_size=1,
        max_size=30,
    )
)
def test_the_read_rate_is_the_bytes_between_ends_over_the_busy_time_between_them(
    reads: list[tuple[float, float, int, bool]],
) -> None:
    # reads: (start, duration, bytes, whether it failed)
    intervals = [(start, start + length) for start, length, _, _ in reads]
    events = sorted(
        [(lo, 1, 0, False) for lo, _ in intervals] + [(lo + d, 0, n, failed) for (lo, d, n, failed) in reads]
    )  # an end before a start at the same instant: no gap and no overlap
    counters = ReadCounters()
    for now, starts, n, failed in events:
        if starts:
            counters.read_started(now)
        else:
            counters.read_ended(now, None if failed else n)
    # busy: the union of the reads in flight, failed ones too (they occupied the storage)
    assert counters.busy_seconds == pytest.approx(_union(intervals), abs=1e-6)
    assert counters.busy(events[-1][0] + 5) == counters.busy_seconds  # nothing open: no more time
    ends = [(now, n) for now, starts, n, failed in events if not starts and not failed]
    if len(ends) < 2:
        assert counters.rate_bytes == 0 and counters.rate_seconds == 0
        return
    # the rate: the bytes of every successful read but the first to end, over the busy time
    # between the first end and the last
    first, last = ends[0][0], ends[-1][0]
    assert counters.rate_bytes == sum(n for _, n in ends[1:])
    assert counters.rate_seconds == pytest.approx(_union(_clip(intervals, first, last)), abs=1e-6)


def test_a_deep_pipeline_is_measured_at_its_rate_not_its_fill() -> None:
    # 32 reads of 8 MB in flight, 0.2 s latency, a 1 GB/s link: once the first is in, one ends
    # every 8 ms. Judged early (41 reads in), bytes over all the busy time would say 0.63 GB/s:
    # the fill is counted, and the bytes of the 32 reads in flight are not.
    depth, size, lat, per, n = 32, 8 * 10**6, 0.2, 0.008, 41
    starts: list[float] = []
    ends: list[float] = []
    for i in range(n):
        starts.append(0.0 if i < depth else ends[i - depth])
        ends.append(max(starts[i] + lat, (ends[-1] + per) if ends else lat))
    events = sorted([(t, 1) for t in starts] + [(t, 0) for t in ends])
    counters = ReadCounters()
    for t, starting in events:
        counters.read_started(t) if starting else counters.read_ended(t, size)
    assert n * size / counters.busy(ends[-1]) < 0.7e9
    assert counters.rate_bytes / counters.rate_seconds == pytest.approx(size / per, rel=1e-9)


def test_busy_time_counts_an_open_read_up_to_now() -> None:
    counters = ReadCounters()
    counters.read_started(10.0)
    counters.read_started(11.0)
    counters.read_ended(12.0, 1)
    assert counters.busy(15.0) == 5.0
    counters.read_ended(16.0, 1)
    assert counters.busy(99.0) == counters.busy_seconds == 6.0
    assert (counters.rate_bytes, counters.rate_seconds) == (1, 4.0)


class _TimedSource:
    """A real file source that records when each of its reads ran."""

    def __init__(self, inner: FileSource) -> None:
        self.inner, self.uri, self.size = inner, inner.uri, inner.size
        self.spans: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def read_prefix(self, length: int) -> bytes:
        return self.inner.read_prefix(length)

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        started = time.monotonic()
        time.sleep(0.002)  # a read that takes time, as storage does
        try:
            return self.inner.read_into(buf, offset=offset)
        finally:
            with self.lock:
                self.spans.append((started, time.monotonic()))

    def close(self) -> None:
        self.inner.close()


def test_time_the_caller_holds_the_budget_is_not_read_time(tmp_path: Path) -> None:
    # One block of budget: while the caller holds a block, nothing can be read. That time is
    # what a rank waiting for the exchange spends; it must not count as reading, or a slow
    # exchange would make the reads look slow and the split would never be given up.
    tensors = {f"t{i}": random_tensor((64 * 1024,), torch.float32, seed=i) for i in range(6)}
    write_sharded(tmp_path, [tensors])
    ck = open_checkpoint(tmp_path)
    plan = make_plan([list(ck.tensors.values())], chunk_size=64 * 1024)
    src = _TimedSource(FileSource(ck.files[0].uri, direct_io="off"))
    config = StreamConfig(concurrency=4, autotune=False, memory_limit=plan.blocks[1].nbytes)
    counters = ReadCounters()
    held = 0.0
    started = time.monotonic()
    for _block, _buf in run_plan(plan, [src], config, counters=counters):
        t = time.monotonic()
        time.sleep(0.05)
        held += time.monotonic() - t
    wall = time.monotonic() - started
    src.close()
    assert len(src.spans) == plan.num_chunks > len(plan.blocks)  # blocks of several reads
    # every read's time is in; none of the time the caller held the only block's budget is
    assert counters.busy_seconds >= _union(src.spans) > 0
    assert counters.busy_seconds <= wall - held
    assert counters.busy(time.monotonic()) == counters.busy_seconds  # no read left open
