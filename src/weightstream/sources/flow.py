"""What the requests of a load did, and how fast its flows move: shared by a load's sources
of a network backend, read by the online tuner (a flow meter) and reported in ``LoadStats``."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Histogram", "RequestStats"]

_PIECE_MIN = 64 << 10
_PIECE_FIRST = 256 << 10


_RECENT = 256
"""Requests whose seconds per byte judge a straggler (see ``HedgePolicy``), and first-byte
delays kept for the tuner between two of its reads."""


class Histogram:
    """Durations counted in buckets 2 % wide, from 10 us to 10,000 s (about 1,050 of them):
    percentiles within 2 % in a fixed amount of memory, however many requests a load makes."""

    _LOW = 1e-5
    _STEP = math.log(1.02)
    _BUCKETS = int(math.log(1e4 / 1e-5) / math.log(1.02)) + 2

    def __init__(self) -> None:
        self.counts = [0] * self._BUCKETS
        self.n = 0
        self.largest = 0.0

    def add(self, seconds: float) -> None:
        i = (
            0
            if seconds <= self._LOW
            else min(self._BUCKETS - 1, 1 + int(math.log(seconds / self._LOW) / self._STEP))
        )
        self.counts[i] += 1
        self.n += 1
        self.largest = max(self.largest, seconds)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (the upper edge of its bucket, at most the largest value seen);
        ``None`` when nothing was counted."""
        if not self.n:
            return None
        rank = min(self.n - 1, int(q * self.n))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen > rank:
                return min(self.largest, self._LOW * math.exp(self._STEP * i))
        return self.largest  # pragma: no cover - the counts add up to n

    def __len__(self) -> int:
        return self.n


@dataclass
class RequestStats:
    """What the object-store requests of a load did (shared by its sources)."""

    piece: int = 0
    """Bytes per counted piece of a response (``received`` grows by about this much at a time):
    the size the last request was given (see :meth:`piece_for`)."""
    requests: int = 0
    retries: int = 0
    stalls_aborted: int = 0
    """Requests aborted for moving less than ``low_speed_limit`` over ``low_speed_window``."""
    timeouts: int = 0
    """Requests aborted at ``request_timeout``."""
    throttled: int = 0
    """429 / 503 slow-down answers."""
    latencies: Histogram = field(default_factory=Histogram)
    """Seconds per successful request (``len``: how many succeeded)."""
    first_byte: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    """Seconds from issuing a request to its first body bytes: the most recent ones (the tuner
    reads those that came since it last looked: ``first_byte_times`` counts them all)."""
    first_byte_times: Histogram = field(default_factory=Histogram)
    hedges: int = 0
    """Straggling requests re-issued for the same range (see ``hedge_multiple``)."""
    hedge_wins: int = 0
    """Hedges that finished first (the straggler was cancelled)."""
    congestion_retries: int = 0
    """Stall retries that did not use up an attempt, because other requests completed meanwhile
    (congestion, not a dead store)."""
    # Live state, touched only on the event loop thread:
    inflight: int = 0
    received: int = 0
    wasted: int = 0
    """Bytes received by attempts that failed or lost a hedge race (read again elsewhere)."""
    seconds_per_byte: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    """Per successful request, the most recent: its duration over its size (stragglers are
    judged by this)."""

    _mark: tuple[float, int] = (0.0, 0)
    _flow_rate: float = 0.0

    def piece_for(self, largest: int, now: float) -> int:
        """The piece size for a request issued now (event loop thread): about 50 ms of one
        flow's recent rate, within ``[min(64 KiB, largest), largest]``. Bytes count as pieces
        arrive (the client holds a piece back until it is whole), so on a
        slow or crowded link (1 MB/s a flow) small pieces let the tuner measure in a fraction
        of a second what 768 KiB pieces take seconds to show; on a fast one, large pieces keep
        the per-piece Python work small."""
        t, received = self._mark
        if now - t >= 0.25:
            if t > 0:
                self._flow_rate = (self.received - received) / (now - t) / max(1, self.inflight)
            self._mark = (now, self.received)
        # Nothing measured yet: a piece small enough to report early on a crowded link, and
        # large enough that a fast one does not spend its first quarter second on Python work
        # per piece (each flow then delivers about 20 pieces a second, whatever the link).
        size = int(self._flow_rate * 0.05) if self._flow_rate > 0 else _PIECE_FIRST
        self.piece = max(min(_PIECE_MIN, largest), min(largest, size - size % _PIECE_MIN))
        return self.piece

    def succeeded(self, seconds: float, nbytes: int) -> None:
        """A request of ``nbytes`` succeeded after ``seconds`` (event loop thread)."""
        self.latencies.add(seconds)
        self.seconds_per_byte.append(seconds / max(1, nbytes))

    def answered(self, seconds: float) -> None:
        """A request's first body bytes came ``seconds`` after it was issued."""
        self.first_byte.append(seconds)
        self.first_byte_times.add(seconds)

    def first_bytes_since(self, seen: int) -> tuple[list[float], int]:
        """The first-byte delays that came after the first ``seen`` (those still kept), and how
        many came in all: from any thread (a delay that arrives meanwhile may be counted in the
        next call instead)."""
        recent = list(self.first_byte)  # (one call in C: the event loop cannot append meanwhile)
        total = len(self.first_byte_times)
        new = min(len(recent), max(0, total - seen))
        return (recent[len(recent) - new :] if new else []), total

    def as_dict(self) -> dict[str, Any]:
        lat = self.latencies

        def pct(q: float) -> float | None:
            value = lat.quantile(q)
            return None if value is None else round(value, 4)

        return {
            "requests": self.requests,
            "retries": self.retries,
            "stalls_aborted": self.stalls_aborted,
            "timeouts": self.timeouts,
            "throttled": self.throttled,
            "congestion_retries": self.congestion_retries,
            "hedges": self.hedges,
            "hedge_wins": self.hedge_wins,
            "latency_p50_s": pct(0.50),
            "latency_p90_s": pct(0.90),
            "latency_p99_s": pct(0.99),
            "latency_max_s": round(lat.largest, 4) if len(lat) else None,
            "first_byte_p50_s": (
                round(v, 4) if (v := self.first_byte_times.quantile(0.5)) is not None else None
            ),
        }
