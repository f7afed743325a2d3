"""A bounded parallel map on daemon threads, with a deadline: for many small requests (headers)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

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

    The first exception raised by ``fn`` is re-raised once the items already running have ended
    (waiting at most ``timeout``; the items not yet started are dropped), so nothing they open
    outlives the error unseen by the caller's clean-up. If no
    item finishes within ``timeout`` seconds of the previous one, :class:`StorageTimeoutError`
    names ``what`` and the item that is late. Threads are daemons: a call stuck in the kernel
    cannot block interpreter exit, and the caller never waits on one past ``timeout``.

    ``serial_seconds > 0``: start with one thread, and start the others only once an item takes
    longer than that. Items that answer from memory (cached file headers, ~0.2 ms each) then
    cost no thread start-ups (~0.1 ms each); slow ones (a cold disk, NFS) still go in parallel.
    """
    if not items:
        return []
    run: _Run[T, R] = _Run(fn, items, workers=workers)
    run.start(1 if serial_seconds > 0 else run.n)
    try:
        return run.wait(timeout=timeout, what=what, serial_seconds=serial_seconds)
    finally:
        run.stop.set()


class _Run(Generic[T, R]):
    """One ``parallel_map`` call: its queue of item indexes, its threads, and what they found.

    The caller sleeps on one condition and is woken when all is done or an item failed, not once
    per item: with many small items (cached headers) each wake-up of the caller would cost more
    than the item."""

    def __init__(self, fn: Callable[[T], R], items: Sequence[T], *, workers: int) -> None:
        self.fn, self.items = fn, items
        self.todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.results: dict[int, R] = {}
        self.failure: list[BaseException] = []
        self.last = time.monotonic()
        self.stop = threading.Event()
        self.n = max(1, min(workers, len(items)))
        self.started = 0
        self.active = 0
        """Items being worked on now."""
        for i in range(len(items)):
            self.todo.put(i)
        for _ in range(self.n):
            self.todo.put(None)

    def start(self, k: int) -> None:
        while self.started < k:
            threading.Thread(target=self._work, name=f"weightstream-meta-{self.started}", daemon=True).start()
            self.started += 1

    def _work(self) -> None:
        while (i := self.todo.get()) is not None:
            with self.cond:
                if self.stop.is_set() or self.failure:
                    continue
                self.active += 1
            try:
                value = self.fn(self.items[i])
            except BaseException as exc:
                with self.cond:
                    self.active -= 1
                    self.failure.append(exc)
                    self.cond.notify()
                continue
            with self.cond:
                self.active -= 1
                if self.failure:
                    self.cond.notify()
                self.results[i] = value
                self.last = time.monotonic()
                if len(self.results) == len(self.items):
                    self.cond.notify()

    def wait(self, *, timeout: float, what: str, serial_seconds: float) -> list[R]:
        items, results = self.items, self.results
        with self.cond:
            while len(results) < len(items) and not self.failure:
                now = time.monotonic()
                if now >= self.last + timeout:
                    late = next(j for j in range(len(items)) if j not in results)
                    raise StorageTimeoutError(
                        f"{what}: no answer within {timeout:g} s for {items[late]!r}"
                    ) from None
                wake = self.last + timeout
                if self.started < self.n:
                    if now >= self.last + serial_seconds:
                        self.start(self.n)  # an item is slow: the rest in parallel
                        continue
                    wake = min(wake, self.last + serial_seconds)
                self.cond.wait(max(0.0, wake - now))
            if self.failure:
                deadline = time.monotonic() + timeout
                while self.active and (left := deadline - time.monotonic()) > 0:
                    self.cond.wait(left)
                raise self.failure[0]
        return [results[i] for i in range(len(items))]
