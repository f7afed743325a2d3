"""The object-store request state machine, driven through every order of its events.

One ranged request meets: body pieces arriving (or not), the low-speed timer firing once per
window, the request timeout, a hedge issued for a straggler and finishing first or last, bodies
that end short, run long, or fail, and retries with backoff. Hypothesis draws what each attempt
of the (fake) store does and when; the real request code (``ObjectSource._fetch``, the policies,
the attempts record) runs on an event loop with a virtual clock, so a 30-second stall costs no
time; the worker's real placement (``_Placement``) receives the pieces. The rules checked:

* a request whose bytes have all been handed over is complete, whatever fires after (never a
  failed load for work already done);
* no request is ever sent for zero bytes, or for bytes outside the range;
* a request that completes hands over exactly the object's bytes, each at its place;
* a failure is a WeightStreamError that keeps every attempt's kind and cause;
* a cancelled request ends at the instant of its cancel, leaves none of its parts running, and
  sends nothing more, and no error of its parts is left for asyncio to print.

The store is faked here (no server decides when a timer fires relative to a piece); the same code
runs against a real S3 server, cut at random bytes, in tests/functional/test_object_store_resume.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import selectors
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from weightstream.config import ObjectStoreConfig, StreamConfig
from weightstream.errors import WeightStreamError
from weightstream.location import ObjectLocation
from weightstream.sources.object_store.source import ObjectSource, _Placement

OBJECT = bytes(range(256)) * 64  # 16 KiB
ETAG = '"v1"'


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to the next timer when nothing is ready: sleeps,
    timeouts and the low-speed timer cost no real time, in the order their times give."""

    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self.now = 0.0
        real = self._selector.select  # type: ignore[attr-defined]

        def select(timeout: float | None = None) -> Any:
            if timeout is None:
                raise AssertionError("the request waits for nothing: no timer, no piece (it would hang)")
            self.now += max(0.0, timeout)
            return real(0)

        self._selector.select = select  # type: ignore[attr-defined]

    def time(self) -> float:
        return self.now


@dataclass
class Step:
    delay: float
    """Seconds before this step (virtual)."""
    what: str
    """``piece`` (``size`` bytes of the body), ``end``, ``hang`` (silence for good), ``fail``
    (a reset), ``long`` (bytes past the range)."""
    size: int = 0


class FakeResponse:
    def __init__(self, body: bytes, rng: tuple[int, int], steps: list[Step], headers_after: float) -> None:
        self.range = rng
        self.meta = {"e_tag": ETAG}
        self._body, self._steps, self._headers_after = body, steps, headers_after

    async def stream(self, min_chunk_size: int = 0) -> Any:
        pos = 0
        for step in self._steps:
            await asyncio.sleep(step.delay)
            if step.what == "piece":
                if pos >= len(self._body):
                    continue
                n = min(step.size, len(self._body) - pos)
                yield self._body[pos : pos + n]
                pos += n
            elif step.what == "hang":
                await asyncio.sleep(1e9)
            elif step.what == "fail":
                raise ConnectionResetError("connection reset by peer")
            elif step.what == "long":
                yield self._body[pos:] + b"extra"
                pos = len(self._body)
            else:
                break
        if pos < len(self._body) and not any(s.what == "end" for s in self._steps):
            await asyncio.sleep(1e9)  # a body that neither ends nor moves: the timers decide


class FakeStore:
    """A store whose n-th request behaves as attempt n was drawn (the last drawn one repeats)."""

    def __init__(self, attempts: list[tuple[float, list[Step]]]) -> None:
        self.attempts = attempts
        self.requests: list[tuple[int, int]] = []
        self.sent_at: list[float] = []  # (virtual) times the requests went out

    async def get_async(self, store: Any, key: str, options: dict[str, Any]) -> FakeResponse:
        lo, hi = options["range"]
        assert 0 <= lo < hi <= len(OBJECT), f"a request for bytes {lo}-{hi}"  # never zero bytes
        assert options.get("if_match") == ETAG
        headers_after, steps = self.attempts[min(len(self.requests), len(self.attempts) - 1)]
        self.requests.append((lo, hi))
        self.sent_at.append(asyncio.get_running_loop().time())
        await asyncio.sleep(headers_after)
        return FakeResponse(OBJECT[lo:hi], (lo, hi), steps, headers_after)


def source(store: FakeStore, *, hedge: bool) -> ObjectSource:
    oc = ObjectStoreConfig(
        endpoint="http://127.0.0.1:9",
        region="us-east-1",
        low_speed_limit=1000,  # 1,000 bytes per 1 s window, or the request is stalled
        low_speed_window=1.0,
        request_timeout=5.0,
        max_attempts=4,
        max_silent_attempts=3,
        backoff_initial=0.1,
        backoff_max=0.5,
        hedge_multiple=1.0 if hedge else 0,
        hedge_min_delay=1.5,
    )
    src = ObjectSource(
        ObjectLocation("s3", "bkt", "m.safetensors"),
        StreamConfig(object_store=oc),
        size=len(OBJECT),
        etag=ETAG,
    )
    src._obstore = store
    if hedge:  # enough finished requests for a p95: stragglers are hedged after 1.5 s
        src.stats.seconds_per_byte.extend([1e-6] * 32)
    return src


steps = st.lists(
    st.builds(
        Step,
        delay=st.sampled_from([0.0, 0.1, 0.6, 1.2, 2.5, 6.0]),
        what=st.sampled_from(["piece", "piece", "piece", "end", "hang", "fail", "long"]),
        size=st.sampled_from([500, 1500, 4096, 16384]),
    ),
    max_size=6,
)
attempt = st.tuples(st.sampled_from([0.0, 0.05, 1.2, 6.0]), steps)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    attempts=st.lists(attempt, min_size=1, max_size=5),
    hedge=st.booleans(),
    offset=st.sampled_from([0, 4096]),
    expected=st.sampled_from([4096, 12288]),
)
def test_every_order_of_events_ends_whole_or_fails_clearly_never_for_work_done(
    attempts: list[tuple[float, list[Step]]], hedge: bool, offset: int, expected: int
) -> None:
    store = FakeStore(attempts)
    src = source(store, hedge=hedge)
    pieces: queue.SimpleQueue[Any] = queue.SimpleQueue()
    loop = VirtualClockLoop()
    try:
        try:
            loop.run_until_complete(src._fetch(pieces, offset, expected))
            failure: BaseException | None = None
        except WeightStreamError as exc:
            failure = exc
    finally:
        loop.close()
    buf = bytearray(expected)
    placement = _Placement(memoryview(buf), offset, expected, uri=src.uri)
    while True:
        at, body = pieces.get_nowait()
        if body is None:
            break
        placement.place(at, body)
    for lo, hi in store.requests:
        assert offset <= lo < hi <= offset + expected, (lo, hi)
    if failure is None:
        placement.whole()
        assert bytes(buf) == OBJECT[offset : offset + expected]
    else:
        kinds = [k for k, _ in getattr(failure, "attempts", [])]
        assert kinds, f"the error keeps no attempts: {failure!r}"
        # Never a failure for work already done: the bytes handed over fall short of the range
        # (unless the store's answers ran past the range: a malformed answer is read again whole,
        # and one that never stops being malformed fails, whatever came before it).
        assert placement.written < expected or "long" in kinds, f"failed with every byte in: {failure}"
        assert failure.uri == src.uri and failure.byte_range == (offset, offset + expected)


def test_a_timer_firing_after_the_last_piece_does_not_fail_the_request() -> None:
    """The congested-link failure the issue saw: every byte of the range had arrived, then a
    stall timer fired before the body ended; the retry asked for zero bytes, refused each time."""
    whole_then_silence = [(0.0, [Step(0.0, "piece", 16384), Step(0.0, "hang")])]
    store = FakeStore(whole_then_silence)
    src = source(store, hedge=False)
    pieces: queue.SimpleQueue[Any] = queue.SimpleQueue()
    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(src._fetch(pieces, 0, 8192))
    finally:
        loop.close()
    assert store.requests == [(0, 8192)]  # one request, no retry for nothing
    assert src.stats.retries == 0 and src.stats.latencies


@pytest.mark.parametrize("what", ["hang", "fail"])
def test_exhaustion_keeps_every_attempt_and_its_kind(what: str) -> None:
    store = FakeStore([(0.0, [Step(0.0, "piece", 500), Step(0.0, what)])])
    src = source(store, hedge=False)
    loop = VirtualClockLoop()
    try:
        with pytest.raises(WeightStreamError) as info:
            loop.run_until_complete(src._fetch(queue.SimpleQueue(), 0, 8192))
    finally:
        loop.close()
    kinds = [k for k, _ in info.value.attempts]  # type: ignore[attr-defined]
    assert kinds == (["stalled"] if what == "hang" else ["transient"]) * 4, kinds  # max_attempts
    assert isinstance(info.value, TimeoutError) == (what == "hang")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    attempts=st.lists(attempt, min_size=1, max_size=5),
    hedge=st.booleans(),
    cancel_at=st.sampled_from([0.0, 0.05, 0.1, 0.6, 1.0, 1.2, 1.25, 1.5, 2.0, 2.5, 3.7, 6.0, 7.2]),
    steps_later=st.integers(0, 8),
)
# the cancel two steps after a failure (wait_for's race), and one while waiting to hedge
@example(attempts=[(0.0, [Step(0.6, "fail")])], hedge=False, cancel_at=0.6, steps_later=2)
@example(attempts=[(0.0, [])], hedge=True, cancel_at=0.0, steps_later=0)
# the cancel in the step the low-speed timer fires (the request turns it into a stall)
@example(attempts=[(6.0, [])], hedge=False, cancel_at=1.0, steps_later=0)
def test_a_cancelled_request_stops_at_once_whatever_it_meets(
    attempts: list[tuple[float, list[Step]]], hedge: bool, cancel_at: float, steps_later: int
) -> None:
    """The load stops (another shard failed, the user pressed Ctrl-C): each request in flight is
    cancelled. Whatever the cancel meets (a piece, a failure or a timer in the same instant, at
    any step of the loop,
    a backoff, a hedge), the request ends at that instant, leaves none of its parts running (a
    GET that goes on after its load stopped writes into memory no one waits for), and never
    sends another: a cancel is
    never taken for a failure to retry (asyncio's ``wait_for`` before 3.12 returns the inner
    outcome when both land at once, which the request used to retry, for all its attempts)."""
    store = FakeStore(attempts)
    src = source(store, hedge=hedge)
    loop = VirtualClockLoop()
    made: list[asyncio.Task[Any]] = []  # every task of the request, to see how each ended
    loop.set_task_factory(lambda loop, coro: made.append(asyncio.Task(coro, loop=loop)) or made[-1])
    try:
        task = loop.create_task(src._fetch(queue.SimpleQueue(), 0, 12288))
        delivered: list[bool] = []

        def cancel(steps: int) -> None:  # at ``cancel_at``, after that many more steps of the loop
            if steps:
                loop.call_soon(cancel, steps - 1)
            else:
                delivered.append(task.cancel())

        loop.call_at(cancel_at, cancel, steps_later)
        with contextlib.suppress(asyncio.CancelledError, WeightStreamError):
            loop.run_until_complete(task)
        ended = loop.time()
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in left:  # (so that closing the loop does not complain of them too)
            t.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left))
    finally:
        loop.close()
    assert not left, f"the request ended, leaving {len(left)} of its tasks running"
    # an error no one took: asyncio prints it to stderr as the task is collected
    unretrieved = [t for t in made if t.done() and not t.cancelled() and t._log_traceback]
    assert not unretrieved, f"errors left for asyncio to print: {[t.exception() for t in unretrieved]}"
    if delivered == [True]:  # the request was still running when the cancel came
        assert ended == cancel_at, f"the request went on {ended - cancel_at:g} s after its cancel"
        assert all(at <= cancel_at for at in store.sent_at), (store.sent_at, cancel_at)
