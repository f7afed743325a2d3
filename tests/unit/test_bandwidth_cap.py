"""A load's bandwidth cap (``max_bandwidth``, issue 25): reads issued no faster than the cap on
a simulated clock, a node's cap shared by its processes, reads cut to fit, the tuner holding at
the cap, and every byte still exact through the engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.config import CAPPED_READ_MIN, MiB, StreamConfig
from weightstream.engine.plan import make_plan
from weightstream.engine.scheduler import run_plan
from weightstream.engine.throttle import Throttle
from weightstream.errors import ConfigError
from weightstream.tuning.controller import DepthController

from .test_engine_tuning import U8, _close_stores, _entries, reads, stored  # noqa: F401


class Clock:
    """A simulated clock: a wait moves it on."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def wait(self, event: threading.Event, seconds: float) -> None:
        self.now += seconds


@given(
    st.floats(1e3, 1e10),
    st.lists(st.tuples(st.integers(1, 1 << 26), st.floats(0, 2), st.floats(0, 3)), min_size=1, max_size=60),
)
@settings(max_examples=80, deadline=None)
def test_reads_never_pass_the_cap_over_any_stretch(
    rate: float, script: list[tuple[int, float, float]]
) -> None:
    """Whatever the read sizes, the pauses between them and the time each read takes, the bytes
    issued from any read's start to any later read's start are at most ``rate`` times that
    stretch and the time reads take (a read goes that much early, to arrive on time; at most a
    second), plus the later read (it pays for its bytes after it goes)."""
    clock = Clock()
    throttle = Throttle(rate, clock=clock, wait=clock.wait)
    starts: list[tuple[float, int]] = []
    ahead = 0.0
    for nbytes, pause, took in script:
        clock.now += pause
        ahead = max(ahead, throttle.ahead)
        assert throttle.take(nbytes, threading.Event())
        starts.append((clock.now, nbytes))
        throttle.observe(took)
    assert ahead <= 1.0
    for i in range(len(starts)):
        issued = 0
        for j in range(i, len(starts)):
            span = starts[j][0] - starts[i][0]
            assert issued <= rate * (span + ahead) * (1 + 1e-9) + 1, (i, j)
            issued += starts[j][1]


def test_the_last_read_arrives_on_the_cap_s_schedule_not_a_read_later() -> None:
    """Reads that take long (a slow connection: 8 MiB at 25 MB/s, 0.36 s) are issued that much
    early, so a load at the cap ends when the cap's schedule does, not one read's time after."""
    clock = Clock()
    rate, size, took = 1e9, 8 << 20, 0.36
    throttle = Throttle(rate, clock=clock, wait=clock.wait)
    t0 = clock.now
    arrivals = []
    for _ in range(256):  # 2.1 GB: 2.1 s at the cap
        assert throttle.take(size, threading.Event())
        arrivals.append(clock.now - t0 + took)
        throttle.observe(took)  # (as the first reads end; here at once)
    schedule = 256 * size / rate
    assert max(arrivals) <= schedule + size / rate  # within one read of the schedule
    assert max(arrivals) >= schedule - size / rate  # and not ahead of it


def test_a_steady_stream_of_reads_runs_at_the_cap() -> None:
    clock = Clock()
    throttle = Throttle(100e6, clock=clock, wait=clock.wait)
    t0 = clock.now
    for _ in range(400):
        throttle.take(1 << 20, threading.Event())
    # 400 reads of 1 MiB at 100 MB/s: the last goes 399 reads' time after the first
    assert clock.now - t0 == pytest.approx(399 * (1 << 20) / 100e6)
    assert throttle.waited == pytest.approx(399 * (1 << 20) / 100e6)  # each waited for the one before


def test_a_read_waiting_for_the_cap_returns_when_the_load_is_cancelled() -> None:
    throttle = Throttle(1.0)  # one byte a second, on the real clock
    cancelled = threading.Event()
    assert throttle.take(1 << 20, cancelled)  # the first goes at once
    cancelled.set()
    assert not throttle.take(1, cancelled)  # (would wait 12 days)


def test_a_node_s_cap_is_shared_by_its_processes_within_each_one_s_own() -> None:
    node = StreamConfig(max_node_bandwidth=1_000_000_000)
    for processes in (1, 2, 3, 4, 8):
        assert node.resolved(processes=processes).max_bandwidth == 1_000_000_000 // processes
    both = StreamConfig(max_node_bandwidth=1_000_000_000, max_bandwidth=200_000_000)
    assert both.resolved(processes=2).max_bandwidth == 200_000_000  # its own is lower
    assert both.resolved(processes=8).max_bandwidth == 125_000_000  # the share is lower
    assert StreamConfig().resolved().max_bandwidth is None  # no cap unless asked
    assert both.resolved(processes=8).resolved(processes=8) == both.resolved(processes=8)
    assert StreamConfig.from_env({"WEIGHTSTREAM_MAX_BANDWIDTH": "500MB"}).max_bandwidth == 500_000_000
    with pytest.raises(ConfigError, match="max_bandwidth"):
        StreamConfig(max_bandwidth=0)


def test_reads_under_a_cap_are_a_quarter_second_at_it() -> None:
    assert StreamConfig(max_bandwidth=100_000_000).read_size == 100_000_000 // 4 // 4096 * 4096
    assert StreamConfig(max_bandwidth=5000).read_size == CAPPED_READ_MIN  # never tiny
    assert StreamConfig(max_bandwidth=1 << 40).read_size == 64 * MiB  # the chunk size rules


def test_the_tuner_stops_probing_deeper_at_the_cap() -> None:
    """Fed the cap's rate at every depth, the controller holds where it is instead of climbing
    (and reprobing) as it does without a cap."""

    def run(cap: float) -> DepthController:
        c = DepthController(initial=4, maximum=64, min_epoch=0.1)
        c.cap = cap
        now, delivered = 0.0, 0
        c.tick(now, delivered)
        for _ in range(200):
            now += 0.1
            delivered += int(1e8 * 0.1)  # 100 MB/s, whatever the depth
            c.latency(0.01)
            c.tick(now, delivered)
        return c

    capped = run(1e8)
    assert capped.depth == 4 and all(d.depth <= 4 for d in capped.decisions)
    assert max(d.depth for d in run(0.0).decisions) > 4


def test_a_capped_load_reads_every_byte_in_place() -> None:
    data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    src = stored(data)
    cfg = StreamConfig(max_bandwidth=400 << 20, autotune=False)  # reads of 100 MiB would be cut
    plan = make_plan([_entries(16, 256 << 10)], chunk_size=cfg.read_size)
    got = {block.start: buf.numpy().tobytes() for block, buf in run_plan(plan, [src], cfg, keep_all=True)}
    assert b"".join(got[k] for k in sorted(got)) == data
    assert sum(n for _, n in reads(src)) == len(data)
