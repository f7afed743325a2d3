"""Every coroutine a thread hands to the object-store event loop has its outcome taken, also where
the thread gave up on it first (cancelled its future) and the coroutine then ended in an error
instead of being cancelled (a request that failed as the load stopped, or one whose own stall
timer absorbed the cancel). Otherwise asyncio prints the error to stderr as "Task exception was
never retrieved" when the task is collected, well after the load has reported its own error: a
traceback that looks like a crash, in the user's log, for a request no one was waiting for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading

import pytest

from weightstream.errors import ReadError
from weightstream.sources.object_store.client import EventLoop, submit
from weightstream.sources.object_store.source import _InFlight

URI = "s3://bucket/model.safetensors"


async def _fails_when_cancelled(started: threading.Event, ended: threading.Event, how: str) -> None:
    """A request that turns the cancel into a failure of its own (as a request does when its
    stall timer fired at the same moment) or that fails before the cancel reaches it."""
    started.set()
    try:
        if how == "before the cancel arrives":
            raise ReadError("the request failed", uri=URI)
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        raise ReadError("the request failed as the load stopped", uri=URI) from None
    finally:
        ended.set()


def _flush_loop() -> None:
    """Lets the loop run every callback already scheduled (a task's done callbacks)."""
    for _ in range(3):
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), EventLoop.get()).result(5)


def _unretrieved(caplog: pytest.LogCaptureFixture) -> list[str]:
    gc.collect()
    return [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.parametrize("how", ["cancel turned into a failure", "before the cancel arrives"])
@pytest.mark.parametrize("start", ["data request", "any request"])
def test_a_request_given_up_on_that_then_fails_is_not_reported_as_unretrieved(
    caplog: pytest.LogCaptureFixture, start: str, how: str
) -> None:
    """(Where the failure comes before the cancel reaches the loop, asyncio itself clears the
    report as it cancels the finished task; the case is kept so that a change of either part
    that loses it shows.)"""
    caplog.set_level(logging.ERROR, logger="asyncio")
    started, ended = threading.Event(), threading.Event()
    flights = _InFlight()
    running, gate = threading.Event(), threading.Event()

    async def held_then(coro_how: str) -> None:
        # "before the cancel arrives": the waiter cancels while the loop is busy in the request,
        # which has failed by the time the loop gets to the cancel
        if coro_how == "before the cancel arrives":
            running.set()
            gate.wait(5)
        await _fails_when_cancelled(started, ended, coro_how)

    coro = held_then(how)
    future: concurrent.futures.Future[None] = (
        flights.start(coro, uri=URI) if start == "data request" else submit(coro)
    )
    if how == "before the cancel arrives":
        assert running.wait(5)
        future.cancel()  # the loop is held in the coroutine: the cancel is still queued
        gate.set()
    else:
        assert started.wait(5)
        if start == "data request":
            flights.cancel()  # the load stopped: every request in flight cancelled
        else:
            future.cancel()
    assert ended.wait(5)
    _flush_loop()
    assert future.cancelled()
    del future, coro
    assert _unretrieved(caplog) == []


def test_an_outcome_still_reaches_the_waiter() -> None:
    """Taking the outcome does not take it from the thread that waits for it."""

    async def fails() -> None:
        raise ReadError("the request failed", uri=URI)

    async def returns() -> int:
        return 7

    with pytest.raises(ReadError, match="the request failed"):
        submit(fails()).result(5)
    assert submit(returns()).result(5) == 7
