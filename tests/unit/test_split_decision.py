"""The per-load decision whether splitting the reads across ranks pays (pure; no process group).

Every rank applies :func:`split_pays` to the same status records, so the rule must be a pure
function of them; these tests check what it does with fast and slow exchanges, which rank's
figures bind, and that it never flips the wrong way as a figure improves.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import weightstream.distributed as wd
from weightstream.distributed import Measured, split_pays

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


def test_nothing_is_decided_before_two_gathers_and_enough_bytes() -> None:
    slow_exchange = 0.01 * GB
    assert split_pays(ranks([1 * GB] * 2, slow_exchange, gathers=1), 2) is None
    assert split_pays(ranks([1 * GB] * 2, slow_exchange, gathered=ENOUGH - 1), 2) is None
    assert split_pays(ranks([1 * GB] * 2, slow_exchange), 2) is False


def test_a_fast_exchange_keeps_the_split() -> None:
    # eight ranks reading 2 GB/s each from a shared link, NCCL gathering at 100 GB/s
    assert split_pays(ranks([2 * GB] * 8, 100 * GB), 8) is True


def test_an_exchange_slower_than_reading_everything_stops_it() -> None:
    # the case: two ranks, each its own 300 MB/s path, gloo on 2 busy cores
    assert split_pays(ranks([0.3 * GB] * 2, 0.25 * GB), 2) is False


def test_reads_from_memory_are_never_split() -> None:
    # the page cache holds the checkpoint: a read takes no measurable time
    free = [Measured(ENOUGH, 0.0, ENOUGH, 0.01, 3)] * 4
    assert split_pays(free, 4) is False


def test_an_exchange_that_takes_no_time_always_pays() -> None:
    assert split_pays([Measured(ENOUGH, 1.0, ENOUGH, 0.0, 3)] * 2, 2) is True


def test_the_slowest_rank_s_reads_and_the_fastest_rank_s_gathers_bind() -> None:
    # Reading everything takes as long as the slowest rank needs. With ranks at 10 and 0.5 GB/s
    # and an exchange at 1 GB/s: alone 2 s/GB, split 1 + 1 = 2 s/GB, not a tenth better: kept.
    # Had the fast rank's rate bound, alone would be 0.1 s/GB against 1.05: stopped.
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
    read_bytes=st.integers(0, 2**63),
    read_seconds=st.floats(0, 1e9),
    gathered=st.integers(0, 2**63),
    gather_seconds=st.floats(0, 1e9),
    gathers=st.integers(0, 2**31),
)
def test_a_status_record_carries_the_measurements_exactly(
    read_bytes: int, read_seconds: float, gathered: int, gather_seconds: float, gathers: int
) -> None:
    m = Measured(read_bytes, read_seconds, gathered, gather_seconds, gathers)
    raw = m.pack()
    assert len(raw) <= wd._MEASURED
    assert Measured.unpack(raw.ljust(wd._MEASURED, b"\0")) == m
