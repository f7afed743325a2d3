"""A load's bandwidth cap (``max_bandwidth``): reads are issued no faster than the cap allows.

One :class:`Throttle` per load, taken by every worker before it issues a read: the engine
caps what it asks of the storage, whatever the backend, so what it delivers follows. It is the
generic cell rate algorithm (a token bucket written as one time): each read of ``n`` bytes is
given the moment ``n / rate`` after the one before it, so reads are spaced in the order they
asked (a load's first read goes at once, and pays for its bytes after it): over a load of ``N``
reads it passes the cap by at most one read's worth (a load of 160 reads: 0.6 %). No burst is
allowed after a pause. Time comes from ``clock`` and waits go to ``wait``, so a test can run it
on a simulated clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Throttle"]


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

    def take(self, nbytes: int, cancelled: threading.Event) -> bool:
        """Wait until ``nbytes`` may be read (``False``: the load was cancelled meanwhile)."""
        with self._lock:
            now = self._clock()
            go = max(now, self._next)
            self._next = go + nbytes / self.rate
            delay = go - now
            self.waited += max(0.0, delay)
        if delay > 0:
            self._wait(cancelled, delay)
        return not cancelled.is_set()
