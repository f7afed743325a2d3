"""A bounded parallel map on daemon threads, with a deadline: for many small requests (headers)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from weightstream.errors import StorageTimeoutError

__all__ = ["parallel_map"]

T = TypeVar("T")
R = TypeVar("R")


def parallel_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    workers: int,
    timeout: float,
    what: str,
    serial_seconds: float = 0.0,
) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads; results in input order.

    The first exception raised by ``fn`` is re-raised (the rest of the work is abandoned). If no
    item finishes within ``timeout`` seconds of the previous one, :class:`StorageTimeoutError`
    names ``what`` and the item that is late. Threads are daemons: a call stuck in the kernel
    cannot block interpreter exit, and the caller never waits on one past ``timeout``.

    ``serial_seconds > 0``: start with one thread, and start the others only once an item takes
    longer than that. Items that answer from memory (cached file headers, ~0.2 ms each) then
    cost no thread start-ups (~0.1 ms each); slow ones (a cold disk, NFS) still go in parallel.
    """
    if not items:
        return []
    todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    # The caller sleeps on one condition and is woken when all is done or an item failed, not
    # once per item: with many small items (cached headers) each wake-up of the caller would
    # cost more than the item.
    cond = threading.Condition()
    results: dict[int, R] = {}
    failure: list[BaseException] = []
    last = time.monotonic()
    stop = threading.Event()

    def work() -> None:
        nonlocal last
        while (i := todo.get()) is not None:
            if stop.is_set():
                continue
            try:
                value = fn(items[i])
            except BaseException as exc:
                with cond:
                    failure.append(exc)
                    cond.notify()
                continue
            with cond:
                results[i] = value
                last = time.monotonic()
                if len(results) == len(items):
                    cond.notify()

    n = max(1, min(workers, len(items)))
    for i in range(len(items)):
        todo.put(i)
    for _ in range(n):
        todo.put(None)
    started = 0

    def start(k: int) -> None:
        nonlocal started
        while started < k:
            threading.Thread(target=work, name=f"weightstream-meta-{started}", daemon=True).start()
            started += 1

    start(1 if serial_seconds > 0 else n)
    try:
        with cond:
            while len(results) < len(items) and not failure:
                now = time.monotonic()
                if now >= last + timeout:
                    late = next(j for j in range(len(items)) if j not in results)
                    raise StorageTimeoutError(
                        f"{what}: no answer within {timeout:g} s for {items[late]!r}"
                    ) from None
                wake = last + timeout
                if started < n:
                    if now >= last + serial_seconds:
                        start(n)  # an item is slow: the rest in parallel
                        continue
                    wake = min(wake, last + serial_seconds)
                cond.wait(max(0.0, wake - now))
            if failure:
                raise failure[0]
    finally:
        stop.set()
    return [results[i] for i in range(len(items))]
