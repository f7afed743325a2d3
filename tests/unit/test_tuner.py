"""The online tuner against simulated pipes: no threads, no sleeping, simulated time."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from weightstream.config import MiB, StreamConfig
from weightstream.tuning.controller import DepthController
from weightstream.tuning.online import make_tuning

MB = 1e6


@dataclass
class Pipe:
    """Delivered rate at depth d: each request moves at most ``per_request`` B/s, the link and
    the CPU cap the sum, each request beyond the knee costs ``overhead`` of the total (flows
    fighting over a full link), and every measurement carries ``noise`` (relative, uniform)."""

    per_request: float
    cap: float
    delay: float = 0.03
    overhead: float = 0.0
    noise: float = 0.0
    latency: float = 0.2
    """Seconds per request."""
    wave: float = 0.0
    """Requests issued together finish together: the delivered rate swings by this fraction
    with the request latency as its period."""

    def rate(self, depth: int) -> float:
        knee = self.cap / self.per_request
        base = min(self.cap, depth * self.per_request)
        return base * max(0.2, 1 - self.overhead * max(0.0, depth - knee))


def drive(
    c: DepthController,
    pipe: Pipe,
    seconds: float,
    *,
    start: float = 0.0,
    delivered: float = 0.0,
    seed: int = 0,
    starved: bool = False,
    dt: float = 0.01,
) -> tuple[float, float, list[tuple[float, int, float]]]:
    """Run the controller against ``pipe`` for ``seconds`` of simulated time; returns the end
    time, bytes delivered, and the (time, depth, true rate) trace."""
    rng = random.Random(seed)
    t = start
    trace = []
    while t < start + seconds:
        true = pipe.rate(c.depth)
        swing = pipe.wave * math.sin(2 * math.pi * t / pipe.latency)
        delivered += true * (1 + swing + rng.uniform(-pipe.noise, pipe.noise)) * dt
        t += dt
        c.latency(pipe.latency, first_byte=pipe.delay)
        c.tick(t, int(delivered), starved=starved)
        trace.append((t, c.depth, true))
    return t, delivered, trace


def held_depth(trace: list[tuple[float, int, float]], since: float) -> int:
    """The depth the controller spent most of the time at (probes are short)."""
    tail = [d for t, d, _ in trace if t >= since]
    return max(set(tail), key=tail.count)


def mean_rate(trace: list[tuple[float, int, float]], since: float) -> float:
    tail = [r for t, _, r in trace if t >= since]
    return sum(tail) / len(tail)


def test_climbs_to_the_knee_of_a_per_connection_capped_pipe() -> None:
    # (d)-like: 25 MB/s per request, 1.2 GB/s of CPU: needs >= 48 requests in flight
    pipe = Pipe(per_request=25 * MB, cap=1.2e9, noise=0.03)
    c = DepthController(initial=8, maximum=256)
    _, _, trace = drive(c, pipe, 10.0)
    assert held_depth(trace, 3.0) >= 48
    assert mean_rate(trace, 3.0) >= 0.9 * pipe.cap
    assert c.decisions and c.decisions[0].reason.startswith("start")
    # converged early: the depth reached the knee within the first 3 s
    assert any(d >= 48 for t, d, _ in trace if t <= 3.0)


def test_requests_finishing_in_waves_are_not_mistaken_for_a_change() -> None:
    """64 requests issued at once finish at once: delivery swings by half with the request
    latency as period. Epochs of one latency average it out, so the climb is not misjudged."""
    pipe = Pipe(per_request=25 * MB, cap=1.6e9, latency=0.67, wave=0.5, noise=0.02)
    c = DepthController(initial=64, maximum=256)
    _, _, trace = drive(c, pipe, 15.0)
    assert held_depth(trace, 5.0) >= 64
    assert mean_rate(trace, 5.0) >= 0.9 * pipe.cap
    assert not any(d.depth < 48 for d in c.decisions)


def test_does_not_pile_on_a_saturated_link() -> None:
    # (c)-like: 1 Gbit/s link, 50 MB/s per request; each flow past the knee costs 0.1 %
    pipe = Pipe(per_request=50 * MB, cap=125 * MB, overhead=0.001, noise=0.03, delay=0.05)
    c = DepthController(initial=64, maximum=256)
    _, _, trace = drive(c, pipe, 20.0)
    assert held_depth(trace, 5.0) <= 64  # climbing bought nothing, so it did not stay up
    assert mean_rate(trace, 5.0) >= 0.95 * pipe.rate(64)
    assert max(d for _, d, _ in trace) <= 96  # probes only


def test_never_leaves_its_bounds() -> None:
    pipe = Pipe(per_request=1 * MB, cap=1e12)  # more depth always helps
    c = DepthController(initial=16, minimum=2, maximum=40)
    _, _, trace = drive(c, pipe, 30.0)
    assert max(d for _, d, _ in trace) == 40
    assert c.depth == 40
    pipe = Pipe(per_request=1e12, cap=1e9, overhead=0.05)  # one request fills it; more hurt
    c = DepthController(initial=16, minimum=2, maximum=40)
    _, _, trace = drive(c, pipe, 30.0)
    assert min(d for _, d, _ in trace) >= 2
    assert held_depth(trace, 10.0) <= 6  # from 16: each step down was clearly faster


def test_reacts_when_the_pipe_changes_mid_load() -> None:
    # per-request rate halves at t=10 (a competing transfer, or the store throttling each
    # connection): twice the depth is needed to keep the same throughput
    c = DepthController(initial=16, maximum=512)
    before = Pipe(per_request=20 * MB, cap=0.8e9, noise=0.03)
    t, got, trace1 = drive(c, before, 10.0)
    depth_before = c.depth
    assert mean_rate(trace1, 5.0) >= 0.9 * before.cap
    after = Pipe(per_request=10 * MB, cap=0.8e9, noise=0.03)
    _, _, trace2 = drive(c, after, 10.0, start=t, delivered=got)
    assert c.depth >= 72 > depth_before  # within 90 % of the new knee (80)
    assert mean_rate(trace2, t + 5.0) >= 0.9 * after.cap
    assert any("pipe changed" in d.reason for d in c.decisions)


def test_epochs_without_queued_work_are_ignored() -> None:
    pipe = Pipe(per_request=25 * MB, cap=1.2e9)
    c = DepthController(initial=8, maximum=256)
    drive(c, pipe, 5.0, starved=True)
    assert c.depth == 8 and c.decisions == []
    assert c.rates == {}


def test_a_stall_is_not_a_measurement_and_recovery_is_not_a_gain() -> None:
    """An epoch in which nothing arrived (a stalled server) teaches nothing about the depth:
    the tuner neither divides by its zero rate nor climbs on the recovery that follows."""
    pipe = Pipe(per_request=25 * MB, cap=1.2e9)
    c = DepthController(initial=8, maximum=256)
    t, delivered, _ = drive(c, pipe, 3.0)
    stalled = Pipe(per_request=25 * MB, cap=0.0)  # delivers nothing
    # The epoch running when the stall begins still saw bytes; the ones after it see none.
    t, delivered, _ = drive(c, stalled, 1.0, start=t, delivered=delivered)
    before = (c.depth, len(c.decisions))
    t, delivered, _ = drive(c, stalled, 5.0, start=t, delivered=delivered)
    assert (c.depth, len(c.decisions)) == before
    assert all(rate > 0 for rate in c.rates.values())
    drive(c, pipe, 10.0, start=t, delivered=delivered)
    assert c.depth >= 40  # 48 requests fill this pipe; it climbs on from where it was


def test_steady_under_noise_on_a_flat_pipe() -> None:
    """A pipe that is full at any depth from 4 up, measured with 5 % noise: the depth must not
    drift upward to the maximum on lucky epochs."""
    pipe = Pipe(per_request=200 * MB, cap=0.8e9, noise=0.05)
    c = DepthController(initial=16, maximum=256)
    _, _, trace = drive(c, pipe, 60.0, seed=3)
    late = [d for t, d, _ in trace if t > 30]
    assert max(late) <= 64
    assert mean_rate(trace, 5.0) >= 0.95 * pipe.cap


@pytest.mark.parametrize("seed", range(5))
def test_random_pipes_reach_ninety_percent(seed: int) -> None:
    rng = random.Random(seed)
    per = rng.uniform(5, 200) * MB
    cap = per * rng.uniform(2, 150)
    pipe = Pipe(
        per_request=per, cap=cap, delay=rng.uniform(0.001, 0.1), overhead=rng.uniform(0, 0.003), noise=0.03
    )
    c = DepthController(initial=16, maximum=512)
    _, _, trace = drive(c, pipe, 30.0, seed=seed)
    best = max(pipe.rate(d) for d in range(1, 513))
    assert mean_rate(trace, 10.0) >= 0.9 * best, (pipe, c.decisions)


def test_chunk_size_follows_depth_within_the_memory_limit() -> None:
    cfg = StreamConfig(concurrency=64, chunk_size=16 * MiB, memory_limit=2 << 30)
    tuning = make_tuning(cfg, chunk_size=16 * MiB)
    assert tuning is not None
    assert tuning.depth == 64 and tuning.chunk_size() == 16 * MiB
    assert tuning.maximum == 256
    tuning.controller.depth = 128  # as if the tuner climbed
    assert tuning.chunk_size() == 8 * MiB  # 128 x 8 MiB = half the memory limit
    tuning.controller.depth = 256
    assert tuning.chunk_size() == 4 * MiB
    assert tuning.chunk_size() * tuning.depth <= cfg.memory_limit
    assert make_tuning(cfg.replace(autotune=False), chunk_size=16 * MiB) is None


def test_the_start_depth_is_never_cut_by_the_tuner() -> None:
    # a small memory limit that the configured depth fills on its own
    cfg = StreamConfig(concurrency=4, chunk_size=256 << 10, memory_limit=1 << 20)
    tuning = make_tuning(cfg, chunk_size=256 << 10)
    assert tuning is not None and tuning.depth == 4 and tuning.chunk_size() == 256 << 10
    assert tuning.maximum * (256 << 10) <= cfg.memory_limit


def test_where_bytes_count_as_they_arrive_the_search_ends_within_a_few_first_byte_delays() -> None:
    """Profile (d) of the object-store benchmark: 30 ms to the first byte, 25 MB/s a request,
    8 MiB requests (0.36 s each), the machine's CPU capping the sum. Epochs of whole requests
    end the opening search after 1.5 s; counted as bytes arrive, in about half of that."""
    pipe = Pipe(per_request=25 * MB, cap=1.4e9, delay=0.03, latency=0.36)
    settled = {}
    for streaming in (False, True):
        c = DepthController(initial=128, maximum=512, streaming=streaming)
        drive(c, pipe, 3.0)
        assert c.settled_at is not None and c.depth == 128, streaming
        settled[streaming] = c.settled_at
    assert settled[True] <= 1.0 < settled[False]


def test_streaming_epochs_still_find_the_knee_and_survive_noise() -> None:
    pipe = Pipe(per_request=25 * MB, cap=1.2e9, delay=0.03, latency=0.36, noise=0.05)
    for seed in range(5):
        c = DepthController(initial=8, maximum=256, streaming=True)
        _, _, trace = drive(c, pipe, 20.0, seed=seed)
        assert mean_rate(trace, 10.0) >= 0.9 * pipe.cap, seed


def test_a_burst_while_searching_is_not_taken_for_the_pipe_slowing_down() -> None:
    """A pipe that fills its buffers runs fast for its first second. The depth chosen is then
    judged against what it delivers once held, so the end of the burst is no "pipe changed"."""
    steady = Pipe(per_request=25 * MB, cap=1.4e9, delay=0.03, latency=0.36)
    burst = Pipe(per_request=50 * MB, cap=2.2e9, delay=0.03, latency=0.36)
    c = DepthController(initial=128, maximum=512, streaming=True)
    t, delivered, _ = drive(c, burst, 1.0)
    drive(c, steady, 10.0, start=t, delivered=delivered)
    assert not [d for d in c.decisions if "pipe changed" in d.reason]


def test_epochs_span_enough_counted_pieces_when_flows_deliver_in_waves() -> None:
    """Profile (c): a 1 Gbit/s link shared by 128 flows, each counted in 768 KiB pieces, so
    flows that started together deliver in waves (here, every 0.8 s). Epochs of 200 pieces
    average the waves out: the tuner settles and stays, at the link's rate."""
    pipe = Pipe(per_request=50 * MB, cap=0.125e9, delay=0.07, latency=0.8, wave=0.8)
    c = DepthController(initial=128, maximum=512, streaming=True)
    c.sizes(grain=768 << 10)
    _, _, trace = drive(c, pipe, 30.0)
    assert len(c.decisions) <= 6 and c.settled_at is not None
    assert mean_rate(trace, 5.0) >= 0.95 * pipe.cap


def test_noisy_epochs_raise_the_gain_a_probe_must_show() -> None:
    """The same waves measured over epochs of a few first-byte delays (no piece size known):
    each epoch's quarters disagree, so the tuner asks for a larger gain before it believes one,
    and a larger change before it calls the pipe changed. With the fixed 8 % and 20 % it
    changed depth 53 times in 30 s."""
    pipe = Pipe(per_request=50 * MB, cap=0.125e9, delay=0.07, latency=0.8, wave=0.8)
    c = DepthController(initial=128, maximum=512, streaming=True)
    _, _, trace = drive(c, pipe, 30.0)
    assert c.noise > 0.05 and c._gain() > c.gain
    assert len(c.decisions) < 20
    assert mean_rate(trace, 5.0) >= 0.95 * pipe.cap
    quiet = DepthController(initial=128, maximum=512, streaming=True)
    drive(quiet, Pipe(per_request=50 * MB, cap=0.125e9, delay=0.07, latency=0.8), 30.0)
    assert quiet.noise < 0.01 and quiet._gain() == quiet.gain  # a smooth pipe keeps the 8 %


def test_the_end_of_the_opening_search_is_reported() -> None:
    from weightstream.tuning.online import Tuning

    c = DepthController(initial=128, maximum=512)
    tuning = Tuning(c, chunk_size=8 * MiB, min_chunk=4 * MiB, inflight=2048 * MiB)
    assert tuning.summary()["settled_at_s"] is None
    drive(c, Pipe(per_request=25 * MB, cap=1.4e9, delay=0.03, latency=0.36), 5.0)
    assert c.settled_at is not None and 0 < c.settled_at < 5.0
    assert tuning.summary()["settled_at_s"] == round(c.settled_at, 3)


def test_reads_into_the_returned_tensors_keep_their_size_at_any_depth() -> None:
    """``load()`` into host memory reads into the tensors it returns (``room``): its reads in
    flight are not bounded by the memory limit, so at any depth they keep their full size
    instead of shrinking to fit half of it (the ``stream()`` rule)."""
    cfg = StreamConfig(concurrency=128, chunk_size=64 * MiB, memory_limit=2 << 30)
    tuning = make_tuning(cfg, chunk_size=64 * MiB, room=4 << 30)
    assert tuning is not None and tuning.maximum == 512
    for depth in (128, 256, 512):
        tuning.controller.depth = depth
        assert tuning.chunk_size() == 64 * MiB
    limited = make_tuning(cfg, chunk_size=64 * MiB)
    assert limited is not None
    limited.controller.depth = 256
    assert limited.chunk_size() == 8 * MiB  # the memory limit (the start needs all of it) / 256


def test_an_object_store_load_into_its_tensors_may_open_the_connections_a_fast_link_needs() -> None:
    """An object store's connections each carry a fraction of the link (S3: about 90 MB/s), so
    400 Gbit/s takes about 560 of them at any request size. Where reads land in the returned
    tensors nothing else bounds them: the ceiling is the hard one, not four times the start.
    A file system's (one read's latency, not a connection's rate) and a set ``max_concurrency``
    stay as they were."""
    from weightstream.sources.flow import RequestStats

    cfg = StreamConfig().for_remote()
    store = make_tuning(cfg, chunk_size=8 * MiB, network=RequestStats(), room=64 << 30)
    assert store is not None and store.maximum == 1024 and store.depth == cfg.concurrency
    files = make_tuning(cfg, chunk_size=8 * MiB, room=64 << 30)
    assert files is not None and files.maximum == 4 * cfg.concurrency
    capped = make_tuning(
        cfg.replace(max_concurrency=300), chunk_size=8 * MiB, network=RequestStats(), room=64 << 30
    )
    assert capped is not None and capped.maximum == 300
    streamed = make_tuning(cfg, chunk_size=8 * MiB, network=RequestStats())  # within memory_limit
    assert streamed is not None and streamed.maximum * 4 * MiB <= cfg.memory_limit
