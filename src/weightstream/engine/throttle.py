"""A load's bandwidth cap (``max_bandwidth``): reads are issued no faster than the cap allows.

One :class:`Throttle` per load, taken by every worker before it issues a read: the engine
caps what it asks of the storage, whatever the backend, so what it delivers follows. It is the
generic cell rate algorithm (a token bucket written as one time): each read of ``n`` bytes is
given the moment ``n / rate`` after the one before it, so reads are spaced in the order they
asked (a load's first read goes at once, and pays for its bytes after it).

A read is let go up to :attr:`Throttle.ahead` seconds before its moment: the time a read takes
(the median of the last reads, at most a second). Bytes are delivered as a read runs, not when it
is issued, so without this a load's last read would arrive one read's time after the cap's
schedule ends: where each connection is slow (25 MB/s, 8 MiB reads: 0.36 s a read) a 2 s load
lost 15 % of its cap to that tail alone (bench/RESULTS.md, issue 25). With it, reads are issued
one read's time early and arrive on the schedule. Issued bytes over any stretch of ``W`` seconds
stay within ``rate * (W + ahead)`` plus one read; no more is let go after a pause. Time comes from
``clock`` and waits go to ``wait``, so a test can run it on a simulated clock.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["Throttle"]

_MOST_AHEAD = 1.0
"""Seconds a read goes before its moment at most (a read at the cap is cut to a quarter second)."""


class Throttle:
    """Reads of a load spaced to ``rate`` bytes/s (see the module docstring)."""

    def __init__(
        self,
        rate: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[threading.Event, float], object] | None = None,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"a bandwidth cap must be positive, got {rate}")
        self.rate = float(rate)
        self._clock = clock
        self._wait = wait if wait is not None else (lambda event, seconds: event.wait(seconds))
        self._lock = threading.Lock()
        self._next = float("-inf")
        """When the bytes asked for so far will all have gone at the cap (the algorithm's
        theoretical arrival time): the next read goes then."""
        self.waited = 0.0
        """Seconds reads spent waiting for the cap, summed."""
        self.ahead = 0.0
        """Seconds a read may go before its moment: the time reads take (:meth:`observe`)."""
        self._took: deque[float] = deque(maxlen=32)

    def take(self, nbytes: int, cancelled: threading.Event) -> bool:
        """Wait until ``nbytes`` may be read (``False``: the load was cancelled meanwhile)."""
        with self._lock:
            now = self._clock()
            go = max(now, self._next - self.ahead)
            self._next = max(go, self._next) + nbytes / self.rate
            delay = go - now
            self.waited += max(0.0, delay)
        if delay > 0:
            self._wait(cancelled, delay)
        return not cancelled.is_set()

    def observe(self, seconds: float) -> None:
        """A read took ``seconds`` from its issue to its last byte."""
        with self._lock:
            self._took.append(seconds)
            self.ahead = min(_MOST_AHEAD, statistics.median(self._took))
