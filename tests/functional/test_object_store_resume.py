"""Resumption is exact: wherever a response is cut, and however the request is retried,
resumed or hedged, the bytes handed back are the object's bytes, or the load fails.

Each request hands its pieces over with their offsets, and the one thread that writes the
destination places each piece by its own offset and checks that no piece leaves a gap and that
the whole range was written (``ObjectSource._get_into``). These tests cut real responses of a
real S3 server (moto, on loopback) at random byte positions through the fault proxy, in every
way a connection can fail, and compare every byte with what was stored.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import weightstream as ws
from weightstream.config import KiB, ObjectStoreConfig
from weightstream.errors import ReadError, StorageTimeoutError

from ..conftest import assert_same, random_tensor
from ..faultproxy import FaultProxy
from .conftest import bucket, put_checkpoint, unexplained_retries

pytestmark = pytest.mark.usefixtures("transport")  # every fault, on both transports

CHUNK = 256 * KiB
SETTINGS = settings(
    max_examples=24,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    print_blob=True,
)


@pytest.fixture
def twelve(s3):  # type: ignore[no-untyped-def]
    """A 12-tensor single-file checkpoint of bf16 [256, 1024] tensors (6 MiB)."""
    b = bucket(s3, "resume")
    tensors = {f"t{i:02d}": random_tensor((256, 1024), torch.bfloat16, seed=i) for i in range(12)}
    put_checkpoint(s3, b, "m", [tensors], index=False)
    return f"s3://{b}/m", tensors


def policy(proxy: FaultProxy, *, hedge: bool = False) -> ws.StreamConfig:
    store = ObjectStoreConfig(
        endpoint=proxy.url,
        region="us-east-1",
        low_speed_limit=64 * KiB,
        # With hedging the primary must outlive the hedge delay; without, stalls end fast.
        low_speed_window=5.0 if hedge else 0.3,
        request_timeout=30,
        backoff_initial=0.01,
        backoff_max=0.02,
        chunk_size=CHUNK,
        concurrency=4,
        hedge_multiple=1 if hedge else 0,
        hedge_min_delay=0.05,
    )
    return ws.StreamConfig(memory_limit=2 << 20, autotune=False, object_store=store)


def cut_load(proxy: FaultProxy, uri: str, config: ws.StreamConfig, kind: str, **params: float):  # type: ignore[no-untyped-def]
    checkpoint = ws.open_checkpoint(uri, config=config)
    proxy.faults.clear()
    proxy.injected.clear()
    proxy.cuts.clear()
    base = len(proxy.ranges)
    proxy.fail_next(kind, 1, **params)
    stream = checkpoint.stream()
    got = dict(stream)
    assert proxy.injected.get(kind) == 1, proxy.injected  # the fault really happened
    # Whether the request the fault hit asked for a range asked before: a hedge (or a retry) of
    # another request, which the first request then rightly wins.
    hit = base + int(params.get("after", 0))
    stream.stats.requests["fault_on_repeat"] = proxy.ranges[hit] in proxy.ranges[base:hit]
    return got, stream.stats.requests


@SETTINGS
@given(
    kind=st.sampled_from(["stall", "trickle", "reset", "short"]),
    at=st.integers(0, CHUNK),
    after=st.integers(0, 20),
    step=st.sampled_from([1, 100, 512, 4096]),
)
def test_a_response_cut_anywhere_resumes_exactly(
    proxy, twelve, kind: str, at: int, after: int, step: int
) -> None:  # type: ignore[no-untyped-def]
    uri, want = twelve
    got, requests = cut_load(
        proxy, uri, policy(proxy), kind, at=at, after=after, seconds=5, rate=max(step, 2048) * 4, step=step
    )
    assert_same(got, want)
    (cut, length), *_ = proxy.cuts
    if cut < length and kind != "trickle":  # the answer was really cut: it was read again
        assert requests["retries"] >= 1


# 12 examples, not 24: each waits out the hedge delay (2 s) against a real server, and the event
# orders of hedges against stalls, timeouts and piece arrival are covered in depth, on a virtual
# clock, by tests/unit/test_request_machine.py.
@settings(SETTINGS, max_examples=12)
@given(kind=st.sampled_from(["stall", "trickle"]), at=st.integers(0, CHUNK - 1), after=st.integers(20, 28))
def test_a_hedge_that_wins_at_any_point_is_exact(proxy, twelve, kind: str, at: int, after: int) -> None:  # type: ignore[no-untyped-def]
    """The primary delivers ``at`` bytes, then stalls or trickles far below its peers; a second
    copy of the request is issued, and whichever wins, its bytes replace the range from where
    its attempt started: the load is exact."""
    uri, want = twelve
    got, requests = cut_load(
        proxy, uri, policy(proxy, hedge=True), kind, at=at, after=after, seconds=10, rate=1024
    )
    assert_same(got, want)
    (cut, length), *_ = proxy.cuts
    # The answer was really held up (a stall, or a trickle of at least a second's worth at 1 KiB/s):
    # a hedge was issued. Which copy wins is a race on the real clock (on a machine whose cores
    # are taken, the hedge itself can be slower); every order of that race is driven on a
    # virtual clock by tests/unit/test_request_machine.py, and here the bytes are exact whoever
    # won.
    if cut < length and (kind == "stall" or length - cut >= 1024) and not requests["fault_on_repeat"]:
        # Whether the hedge went out before the low-speed rule ended the attempt is that race
        # too (CI saw one example of many where the rule won): such an example is exact (above)
        # but makes no hedge case, so it does not count as one.
        assume(requests["hedges"] >= 1)


def test_the_reported_trickle_is_exact(s3) -> None:  # type: ignore[no-untyped-def]
    """The case as it was reported: a 6-tensor single-file checkpoint of bf16 [256, 1024]
    tensors; a proxy passes the first 256 KiB of the data connection at full speed, then
    trickles 512 bytes every 0.25 s; default settings. The low-speed rule aborts that GET, the
    retry resumes it, and every byte is the stored one."""
    b = bucket(s3, "reported")
    tensors = {f"t{i}": random_tensor((256, 1024), torch.bfloat16, seed=40 + i) for i in range(6)}
    put_checkpoint(s3, b, "m", [tensors], index=False)
    host, port = s3.meta.endpoint_url.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)))
    try:
        config = ws.StreamConfig(object_store=ObjectStoreConfig(endpoint=proxy.url, region="us-east-1"))
        uri = f"s3://{b}/m/model-00001-of-00001.safetensors"
        checkpoint = ws.open_checkpoint(uri, config=config)
        proxy.fail_next("trickle", 1, through=256 * KiB, step=512, rate=2048)
        got = checkpoint.load()
        assert proxy.injected == {"trickle": 1}
    finally:
        proxy.close()
    assert_same(got, tensors)
    stats = checkpoint.last_stats
    assert stats is not None and stats.requests is not None
    assert stats.requests["stalls_aborted"] == 1 and stats.requests["retries"] == 1


def test_an_answer_for_another_range_is_refused_and_read_again(proxy, twelve) -> None:  # type: ignore[no-untyped-def]
    """A cache or proxy that answers a different range than asked (one byte earlier, same
    length): written as it came, every byte of the range would be off by one."""
    uri, want = twelve
    got, requests = cut_load(proxy, uri, policy(proxy), "wrong-range", at=1, after=3)
    assert_same(got, want)
    assert unexplained_retries(requests) == 1


# -- stores that never answer -------------------------------------------------------------------


@pytest.fixture
def black_hole():  # type: ignore[no-untyped-def]
    """An endpoint that accepts connections, reads what is sent, and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    server.close()


def test_an_endpoint_that_never_answers_fails_within_seconds_at_default_settings(
    black_hole, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Before: 5 attempts of the 60 s request timeout on the listing (319 s), and a message
    that never said "timed out"."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    config = ws.StreamConfig(object_store=ObjectStoreConfig(endpoint=black_hole, region="us-east-1"))
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError) as info:
        ws.load("s3://bucket/model/", config=config)
    took = time.monotonic() - started
    text = str(info.value)
    assert "no answer within metadata_timeout=5 s" in text and "3 of them unanswered" in text
    assert info.value.uri == "s3://bucket/model" and isinstance(info.value, TimeoutError)
    assert isinstance(info.value.__cause__, TimeoutError)
    assert took < 60  # a hang detector: about 3 x 5 s


def test_a_listing_left_unanswered_once_is_retried(proxy, twelve) -> None:  # type: ignore[no-untyped-def]
    uri, want = twelve
    store = ObjectStoreConfig(
        endpoint=proxy.url, region="us-east-1", metadata_timeout=0.5, backoff_initial=0.01
    )
    proxy.fail_next("silent-meta", 1, seconds=30)
    assert_same(ws.load(uri, config=ws.StreamConfig(object_store=store)), want)
    assert proxy.injected == {"silent-meta": 1}


def test_a_head_left_unanswered_fails_as_a_timeout(proxy, twelve) -> None:  # type: ignore[no-untyped-def]
    """A list of objects is opened with a HEAD each (no listing): the same bound applies."""
    uri, _ = twelve
    store = ObjectStoreConfig(
        endpoint=proxy.url, region="us-east-1", metadata_timeout=0.3, backoff_initial=0.01
    )
    proxy.fail_next("silent-meta", 100, seconds=30)
    with pytest.raises(StorageTimeoutError, match=r"no answer within metadata_timeout=0\.3 s") as info:
        ws.load([f"{uri}/model-00001-of-00001.safetensors"], config=ws.StreamConfig(object_store=store))
    assert "3 of them unanswered" in str(info.value)


def test_data_requests_left_unanswered_fail_as_a_timeout(proxy, twelve) -> None:  # type: ignore[no-untyped-def]
    uri, _ = twelve
    config = policy(proxy)
    checkpoint = ws.open_checkpoint(uri, config=config)
    proxy.fail_next("silent", 1000, seconds=30)
    with pytest.raises(StorageTimeoutError, match="sent no answer to 3 attempts") as info:
        checkpoint.load()
    assert info.value.byte_range is not None and "no answer yet" in str(info.value)
    assert info.value.__cause__ is not None


def test_retry_exhaustion_keeps_the_cause(proxy, twelve) -> None:  # type: ignore[no-untyped-def]
    uri, _ = twelve
    config = policy(proxy).replace_object_store(max_attempts=2)
    checkpoint = ws.open_checkpoint(uri, config=config)
    proxy.fail_next("status", 1000, code=500)
    with pytest.raises(ReadError) as info:
        checkpoint.load()
    assert "giving up after 2 attempts; last cause:" in str(info.value) and "500" in str(info.value)
    cause = info.value.__cause__
    assert (
        cause is not None and "500" in str(cause) and cause.__cause__ is not None
    )  # down to obstore's error
