"""What the requests of a load did, and how fast its flows move: shared by a load's sources
of a network backend, read by the online tuner (a flow meter) and reported in ``LoadStats``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestStats"]

_PIECE_MIN = 64 << 10
_PIECE_FIRST = 256 << 10


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
    latencies: list[float] = field(default_factory=list)
    """Seconds per successful request."""
    first_byte: list[float] = field(default_factory=list)
    """Seconds from issuing a request to its first body bytes."""
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
    seconds_per_byte: list[float] = field(default_factory=list)
    """Per successful request: its duration over its size (stragglers are judged by this)."""

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

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 4) if lat else None

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
            "latency_max_s": round(lat[-1], 4) if lat else None,
            "first_byte_p50_s": round(statistics.median(self.first_byte), 4) if self.first_byte else None,
        }
