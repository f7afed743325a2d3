"""Object storage under injected faults: stalls, trickles, resets, 500s and 503 slow-downs.

Each test loads through the fault proxy, then asserts the tensors are bit-exact, that the
retries / aborts were counted, and that the load finished within a generous bound (a hang
detector, not a speed test). Exhausting the attempts must give one clear error.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch

import weightstream as ws
from weightstream.config import KiB, ObjectStoreConfig
from weightstream.errors import ReadError, StorageTimeoutError
from weightstream.pipeline import opening

from ..conftest import assert_same, random_tensor
from ..faultproxy import FaultProxy
from .conftest import assert_aborts_retried, bucket, put_checkpoint, unexplained_retries

pytestmark = pytest.mark.usefixtures("transport")  # every fault, on both transports

BOUND_S = 60


def fast_policy(proxy: FaultProxy, **overrides: float) -> ws.StreamConfig:
    store = ObjectStoreConfig(
        endpoint=proxy.url,
        region="us-east-1",
        low_speed_limit=64 * KiB,
        low_speed_window=0.5,
        request_timeout=10,
        connect_timeout=2,
        max_attempts=int(overrides.pop("max_attempts", 5)),
        backoff_initial=0.01,
        backoff_max=0.05,
        chunk_size=256 * KiB,
        concurrency=4,
        **overrides,
    )
    return ws.StreamConfig(memory_limit=1 << 20, object_store=store)


def span(header: str) -> tuple[int, int]:
    lo, hi = header.removeprefix("bytes=").split("-")
    return int(lo), int(hi)


@pytest.fixture
def model(s3):  # type: ignore[no-untyped-def]
    b = bucket(s3, "faults")
    tensors = {f"w{i}": random_tensor((300 * KiB,), torch.uint8, seed=i) for i in range(4)}
    tensors["norm"] = random_tensor((1000,), torch.float32)
    put_checkpoint(s3, b, "m", [tensors])
    return f"s3://{b}/m", tensors


def load_with(proxy: FaultProxy, uri: str, config: ws.StreamConfig, kind: str, count: int, **params: float):  # type: ignore[no-untyped-def]
    checkpoint = ws.open_checkpoint(uri, config=config)  # headers first, undisturbed
    proxy.fail_next(kind, count, **params)
    started = time.monotonic()
    stream = checkpoint.stream()
    got = dict(stream)
    assert time.monotonic() - started < BOUND_S
    assert proxy.injected.get(kind) == count  # the faults really happened
    return got, stream.stats


@pytest.mark.parametrize("kind", ["stall", "trickle"])
def test_slow_responses_are_aborted_and_read_again(proxy: FaultProxy, model, kind: str) -> None:  # type: ignore[no-untyped-def]
    uri, want = model
    got, stats = load_with(proxy, uri, fast_policy(proxy), kind, 2, seconds=30, rate=2000)
    assert_same(got, want)
    assert_aborts_retried(stats.requests, at_least=2)


def test_connection_resets_are_retried(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    uri, want = model
    got, stats = load_with(proxy, uri, fast_policy(proxy), "reset", 3)
    assert_same(got, want)
    assert unexplained_retries(stats.requests) == 3


def test_a_kept_connection_the_store_closed_costs_no_attempt(
    proxy: FaultProxy, model, transport: str
) -> None:  # type: ignore[no-untyped-def]
    """Stores drop idle kept-alive connections; the next request on one gets no answer. On the
    one-copy transport that is not a failed attempt: the request is sent again on a fresh
    connection (max_attempts=1: a counted attempt would end the load). obstore's client mostly
    sees the close before it reuses a connection; when it does not, the request fails and is
    retried as a transient failure (one attempt of five)."""
    uri, want = model
    attempts = 1 if transport == "direct" else 5
    got, stats = load_with(proxy, uri, fast_policy(proxy, max_attempts=attempts), "close-after", 6)
    assert_same(got, want)
    if transport == "direct":
        assert unexplained_retries(stats.requests) == 0


@pytest.mark.parametrize("code", [500, 503])
def test_server_errors_and_slow_downs_back_off(proxy: FaultProxy, model, code: int) -> None:  # type: ignore[no-untyped-def]
    uri, want = model
    got, stats = load_with(proxy, uri, fast_policy(proxy), "status", 3, code=code)
    assert_same(got, want)
    assert unexplained_retries(stats.requests) == 3
    assert stats.requests["throttled"] == (3 if code == 503 else 0)
    assert stats.requests["latency_p50_s"] is not None


def test_exhausted_attempts_give_one_clear_error(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    uri, _ = model
    config = fast_policy(proxy, max_attempts=3)
    checkpoint = ws.open_checkpoint(uri, config=config)
    proxy.fail_next("stall", 1000, seconds=30)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError) as info:
        checkpoint.load()
    assert time.monotonic() - started < BOUND_S
    err = info.value
    text = str(err)
    assert err.uri is not None and err.uri.startswith(uri) and err.byte_range is not None
    assert "after 3 attempts" in text and "stalled" in text


def test_exhausted_attempts_on_errors(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    uri, _ = model
    config = fast_policy(proxy, max_attempts=2)
    checkpoint = ws.open_checkpoint(uri, config=config)
    proxy.fail_next("status", 1000, code=500)
    with pytest.raises(ReadError) as info:
        checkpoint.load()
    assert "after 2 attempts" in str(info.value) and "500" in str(info.value)


def test_stalls_under_congestion_do_not_use_up_attempts(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    """max_attempts=1: any counted failure would end the load. Two requests stall while the others
    complete (what a saturated link does to a few of many flows): they are retried for free."""
    uri, want = model
    got, stats = load_with(proxy, uri, fast_policy(proxy, max_attempts=1), "stall", 2, seconds=30)
    assert_same(got, want)
    assert_aborts_retried(stats.requests, at_least=2, counter="congestion_retries")


def test_low_speed_threshold_respects_contention() -> None:
    from weightstream.sources.object_store.policy import LowSpeedRule

    rule = LowSpeedRule.from_config(ObjectStoreConfig(low_speed_limit=1 << 20, low_speed_window=3))
    limit = 3 << 20
    assert rule.required(0, 0, 1) == limit  # alone: the configured limit
    assert rule.required(0, 100 * limit, 10) == limit  # fast peers: the limit
    # 96 flows sharing ~125 MB/s: peers move ~3.9 MB in 3 s; a quarter of that is required
    congested = rule.required(0, 95 * 3_900_000, 96)
    assert congested == pytest.approx(3_900_000 / 4)
    assert rule.required(0, 0, 96) == limit / 16  # never below 1/16 of the limit


@pytest.fixture
def many_small(s3):  # type: ignore[no-untyped-def]
    b = bucket(s3, "hedges")
    tensors = {f"w{i:02d}": random_tensor((64 * KiB,), torch.uint8, seed=100 + i) for i in range(40)}
    put_checkpoint(s3, b, "m", [tensors])
    return f"s3://{b}/m", tensors


def hedge_policy(proxy: FaultProxy, *, multiple: float) -> ws.StreamConfig:
    store = ObjectStoreConfig(
        endpoint=proxy.url,
        region="us-east-1",
        low_speed_limit=1 * KiB,  # the trickle below stays above it: only a hedge can help
        low_speed_window=0.5,
        request_timeout=30,
        chunk_size=64 * KiB,
        concurrency=4,
        hedge_multiple=multiple,
        hedge_min_delay=0.3,
    )
    return ws.StreamConfig(memory_limit=1 << 20, autotune=False, object_store=store)


def load_with_straggler(proxy: FaultProxy, many_small, *, multiple: float, rate: int):  # type: ignore[no-untyped-def]
    """Load with the 25th ranged GET trickling at ``rate`` bytes/s (above the low-speed limit)."""
    uri, want = many_small
    checkpoint = ws.open_checkpoint(uri, config=hedge_policy(proxy, multiple=multiple))
    proxy.fail_next("trickle", 1, rate=rate, after=24)
    stream = checkpoint.stream()
    got = dict(stream)
    assert proxy.injected.get("trickle") == 1
    assert_same(got, want)
    assert stream.stats.requests is not None
    return stream.stats.requests


def test_a_straggler_is_hedged_and_the_hedge_wins(proxy: FaultProxy, many_small) -> None:  # type: ignore[no-untyped-def]
    """The 25th request trickles at 8 KB/s (64 KiB would take 8 s), above the low-speed limit,
    so it is not aborted; once it runs past the p95 of its peers a second copy is issued,
    finishes first, and the straggler is cancelled."""
    r = load_with_straggler(proxy, many_small, multiple=1, rate=8000)
    assert r["hedges"] >= 1 and r["hedge_wins"] >= 1
    assert unexplained_retries(r) == 0


def test_hedging_off_waits_for_the_straggler(proxy: FaultProxy, many_small) -> None:  # type: ignore[no-untyped-def]
    r = load_with_straggler(proxy, many_small, multiple=0, rate=64000)
    assert r["hedges"] == 0


def test_a_stalled_request_resumes_where_it_stopped(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    """The stalled response delivered half its body before going silent: the retry asks only
    for the other half, and the tensors are still bit-exact."""
    uri, want = model
    cfg = fast_policy(proxy)
    cfg = cfg.replace(autotune=False, object_store=dataclasses.replace(cfg.object_store, concurrency=1))
    checkpoint = ws.open_checkpoint(uri, config=cfg)
    proxy.ranges.clear()
    proxy.fail_next("stall", 1, seconds=30, after=1)  # the second GET: a full 256 KiB read
    stream = checkpoint.stream()
    got = dict(stream)
    assert_same(got, want)
    (stalled,) = proxy.faulted
    ((cut, length),) = proxy.cuts
    lo, hi = span(stalled)
    assert hi - lo + 1 == length and 0 < cut < length
    # The request after it for the same end is its retry: it asks only for the tail, from at
    # most the bytes the stalled answer delivered (what arrived before the stall is kept).
    later = proxy.ranges[proxy.ranges.index(stalled) + 1 :]
    lo2, hi2 = next(r for r in map(span, later) if r[1] == hi)
    assert lo < lo2 <= lo + cut and hi2 == hi
    assert_aborts_retried(stream.stats.requests, at_least=1)


def test_only_a_strong_etag_from_a_get_answer_is_pinned() -> None:
    from weightstream.sources.object_store import ObjectSource

    src: Any = object.__new__(ObjectSource)
    src.etag, src._get_options = None, {}
    ObjectSource._pin(src, 'W/"weak"')  # a weak ETag never matches If-Match: not pinned
    assert src.etag is None and src._get_options == {}
    ObjectSource._pin(src, '"v1"')
    ObjectSource._pin(src, '"v2"')  # the first version stays
    assert src.etag == '"v1"' and src._get_options == {"if_match": '"v1"'}


def _io_threads() -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("weightstream-io") and t.is_alive()]


def _gone(deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while _io_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return not _io_threads()


def _stalled(proxy: FaultProxy, model) -> ws.TensorStream:  # type: ignore[no-untyped-def]
    """A stream whose first block arrives (its two reads, taken first by the two workers) while
    the second block's reads are in flight, never answered (nothing of ours would abort them for
    a minute: a window and a timeout far off)."""
    uri, _ = model
    config = fast_policy(proxy, hedge_multiple=0).replace(memory_limit=640 * KiB, autotune=False)
    config = config.replace_object_store(concurrency=2)
    config = config.replace_object_store(low_speed_window=60.0, request_timeout=120.0)
    checkpoint = ws.open_checkpoint(uri, config=config)
    proxy.fail_next("silent", 1000, seconds=60, after=2)
    with opening(None, False, config, "cpu") as load:
        return checkpoint.open_stream(load, ["w0", "w1", "w2", "w3"], owned=True)


def test_closing_a_stream_over_stalled_requests_cancels_them_at_once(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    """Before: the close waited 5 s for the stalled requests, and their I/O threads ran on for 10 s."""
    s = _stalled(proxy, model)
    next(s)
    started = time.monotonic()
    s.close()
    assert time.monotonic() - started < 2.0  # at once, not after a wait for the requests
    assert _gone(2.0), _io_threads()


def test_ctrl_c_during_stalled_requests_cancels_them_at_once(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    import signal

    s = _stalled(proxy, model)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            for _ in s:
                pass
        took = time.monotonic() - started
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert took < 3.0  # the interrupt (at 1 s), then at once
    assert _gone(2.0), _io_threads()
    assert s.stats.complete is False


def test_a_wait_on_an_event_loop_that_is_gone_is_bounded(proxy: FaultProxy, model) -> None:  # type: ignore[no-untyped-def]
    """Every wait on another thread has a bound: if the loop thread running the requests stops,
    the workers waiting on them fail within a second or so, and the next load starts a new loop."""
    from weightstream.sources.object_store.client import EventLoop

    s = _stalled(proxy, model)
    next(s)
    loop = EventLoop.get()
    loop.call_soon_threadsafe(loop.stop)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="event loop is gone"):
        for _ in s:
            pass
    assert time.monotonic() - started < 10
    proxy.faults.clear()
    uri, want = model
    assert_same(ws.load(uri, config=fast_policy(proxy)), want)
    assert EventLoop.get() is not loop


def test_a_store_that_ignores_if_match_still_cannot_mix_two_versions(proxy: FaultProxy, s3) -> None:  # type: ignore[no-untyped-def]
    """Some S3-compatible stores (and emulators) ignore If-Match on GET: every answer's version is
    checked against the one the header was read at, so a replaced object fails the load."""
    from safetensors.torch import save

    from weightstream.errors import FormatError

    b = bucket(s3, "ignores")
    s3.put_object(
        Bucket=b,
        Key="m/model.safetensors",
        Body=save({"w": random_tensor((200_000,), torch.float32, seed=1)}),
    )
    proxy.drop_headers = (b"if-match",)
    checkpoint = ws.open_checkpoint(f"s3://{b}/m/model.safetensors", config=fast_policy(proxy))
    s3.put_object(
        Bucket=b,
        Key="m/model.safetensors",
        Body=save({"w": random_tensor((200_000,), torch.float32, seed=2)}),
    )
    with pytest.raises(FormatError, match="changed since its header was read"):
        checkpoint.load()


_EXIT_MID_LOAD = """
import sys, weightstream as ws
from weightstream.config import KiB, ObjectStoreConfig
store = ObjectStoreConfig(endpoint=sys.argv[2], region="us-east-1", low_speed_window=60.0,
                          request_timeout=120.0, hedge_multiple=0, chunk_size=256 * KiB, concurrency=2)
config = ws.StreamConfig(memory_limit=640 * KiB, autotune=False, object_store=store)
checkpoint = ws.open_checkpoint(sys.argv[1], config=config)
print("opened", flush=True)
sys.stdin.readline()  # the parent makes the next reads stall
s = checkpoint.stream(tensors=["w0", "w1", "w2", "w3"])
next(s)
print("first", flush=True)
# the script ends here, its stream open and two requests stalled for a minute
"""


def test_a_process_that_exits_mid_load_does_not_wait_for_its_stalled_requests(
    proxy: FaultProxy, model
) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    uri, _ = model
    with subprocess.Popen(
        [sys.executable, "-c", _EXIT_MID_LOAD, uri, proxy.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None and child.stdin is not None and child.stderr is not None
            assert child.stdout.readline().strip() == "opened", child.stderr.read()
            proxy.fail_next("silent", 1000, seconds=60, after=2)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "first", child.stderr.read()
            started = time.monotonic()
            child.wait(timeout=BOUND_S)
            assert time.monotonic() - started < 10  # a hang detector: the requests stall for 60 s
            assert proxy.injected.get("silent", 0) >= 1  # a request was stalled at the exit
        finally:
            child.kill()
