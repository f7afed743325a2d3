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
    done: queue.SimpleQueue[tuple[int, R | None, BaseException | None]] = queue.SimpleQueue()
    stop = threading.Event()

    def work() -> None:
        while (i := todo.get()) is not None:
            if stop.is_set():
                continue
            try:
                done.put((i, fn(items[i]), None))
            except BaseException as exc:
                done.put((i, None, exc))

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
    results: dict[int, R | None] = {}
    last = time.monotonic()
    try:
        while len(results) < len(items):
            wait = timeout - (time.monotonic() - last)
            if started < n:
                wait = min(wait, serial_seconds)
            try:
                i, value, exc = done.get(timeout=max(0.0, wait))
            except queue.Empty:
                if started < n:
                    start(n)  # an item is slow: the rest in parallel
                    continue
                late = next(j for j in range(len(items)) if j not in results)
                raise StorageTimeoutError(
                    f"{what}: no answer within {timeout:g} s for {items[late]!r}"
                ) from None
            if exc is not None:
                raise exc
            results[i] = value
            last = time.monotonic()
    finally:
        stop.set()
    return [results[i] for i in range(len(items))]  # type: ignore[misc]
