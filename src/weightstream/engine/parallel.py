"""A bounded parallel map on daemon threads, with a deadline: for many small requests (headers)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from weightstream.errors import StorageTimeoutError

__all__ = ["parallel_map"]

T = TypeVar("T")
R = TypeVar("R")


def parallel_map(
    fn: Callable[[T], R], items: Sequence[T], *, workers: int, timeout: float, what: str
) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads; results in input order.

    The first exception raised by ``fn`` is re-raised (the rest of the work is abandoned). If no
    item finishes within ``timeout`` seconds of the previous one, :class:`StorageTimeoutError`
    names ``what`` and the item that is late. Threads are daemons: a call stuck in the kernel
    cannot block interpreter exit.
    """
    if len(items) <= 1 or workers <= 1:
        return [fn(x) for x in items]
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

    n = min(workers, len(items))
    for i in range(len(items)):
        todo.put(i)
    for _ in range(n):
        todo.put(None)
    for k in range(n):
        threading.Thread(target=work, name=f"weightstream-meta-{k}", daemon=True).start()
    results: dict[int, R | None] = {}
    try:
        while len(results) < len(items):
            try:
                i, value, exc = done.get(timeout=timeout)
            except queue.Empty:
                late = next(j for j in range(len(items)) if j not in results)
                raise StorageTimeoutError(
                    f"{what}: no answer within {timeout:g} s for {items[late]!r}"
                ) from None
            if exc is not None:
                raise exc
            results[i] = value
    finally:
        stop.set()
    return [results[i] for i in range(len(items))]  # type: ignore[misc]
