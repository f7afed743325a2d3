"""Whether a thread is inside a read system call (``weightstream.localfs.thread_in_read``):
what lets the reads ahead on a network file system go as soon as the header reads are in the
kernel, rather than after a fixed guess."""

from __future__ import annotations

import os
import platform
import threading
import time

import pytest

from weightstream.localfs import thread_in_read

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64", "arm64"),
    reason="read from /proc on Linux, for the architectures whose numbers it lists",
)


def _state_of(run, release) -> tuple[bool | None, int]:  # type: ignore[no-untyped-def]
    """Start ``run`` in a thread; once it has settled, its state; then ``release`` it."""
    ids: list[int] = []

    def body() -> None:
        ids.append(threading.get_native_id())
        run()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    while not ids:
        time.sleep(0.001)
    time.sleep(0.2)  # in its call by now
    state = thread_in_read(ids[0])
    release()
    t.join(10)
    return state, ids[0]


def test_a_thread_blocked_in_a_read_is_in_a_read() -> None:
    r, w = os.pipe()
    try:
        state, _ = _state_of(lambda: os.read(r, 1), lambda: os.write(w, b"x"))
        assert state is True
        state, _ = _state_of(lambda: os.readv(r, [bytearray(1)]), lambda: os.write(w, b"x"))
        assert state is True
    finally:
        os.close(r)
        os.close(w)


def test_a_thread_waiting_on_a_lock_or_sleeping_is_not() -> None:
    lock = threading.Lock()
    lock.acquire()
    state, _ = _state_of(lambda: lock.acquire(timeout=10), lock.release)
    assert state is False  # a futex, as a thread waiting for the GIL is
    stop = threading.Event()
    state, _ = _state_of(lambda: stop.wait(10), stop.set)
    assert state is False


def test_a_thread_running_python_is_not() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    state, _ = _state_of(spin, stop.set)
    assert state is False


def test_a_thread_that_has_ended_cannot_be_told() -> None:
    _, tid = _state_of(lambda: None, lambda: None)
    assert thread_in_read(tid) is None
