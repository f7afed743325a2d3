"""The rules a request lives by, as value objects built once from :class:`ObjectStoreConfig`
(in the manner of urllib3's ``Retry``): how often and how long apart to try
(:class:`RetryPolicy`), how slow is stalled (:class:`LowSpeedRule`), and when a straggler gets
a second copy (:class:`HedgePolicy`). Pure: the request code applies them in one place."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from weightstream.config import ObjectStoreConfig
from weightstream.errors import ReadError, StorageTimeoutError, WeightStreamError
from weightstream.sources.object_store.failures import Failure

__all__ = ["Attempts", "HedgePolicy", "LowSpeedRule", "RetryPolicy"]

_PIECE_FLOOR = 1 << 10
_PIECE_CAP = 4 << 20


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per request, and the full-jitter backoff between them."""

    max_attempts: int
    max_silent_attempts: int
    """Attempts the store leaves unanswered before it counts as unreachable."""
    backoff_initial: float
    backoff_max: float
    request_timeout: float
    """Seconds one attempt may take, body included (enforced by the request code, once)."""
    free_stall_retries: int = 50
    """Stall retries per request that do not use up an attempt while other requests complete
    (congestion among our own flows, not a dead store)."""

    @classmethod
    def from_config(cls, oc: ObjectStoreConfig) -> RetryPolicy:
        return cls(
            oc.max_attempts, oc.max_silent_attempts, oc.backoff_initial, oc.backoff_max, oc.request_timeout
        )

    def backoff(self, retry: int, *, throttled: bool, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(cap, initial * 2^retry)]; slow-downs start 4x higher."""
        base = self.backoff_initial * (4 if throttled else 1)
        return rng.uniform(0, min(self.backoff_max, base * 2**retry))


class Attempts:
    """One request's attempts: the state beside the :class:`RetryPolicy` (as object_store's
    ``RetryContext`` beside its ``RetryConfig``), shared by the data and the metadata loops.

    Each failure is recorded with its kind (a :class:`Failure`, never a message to match) and
    cause. A stall while other requests completed is congestion among our own flows, and does not
    use up an attempt (up to ``free_stall_retries``). An attempt that got no answer at all (a
    timeout, or a stall before the headers) counts toward ``max_silent_attempts``. The error that
    ends the request keeps every attempt's kind and cause (``error.attempts``).
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures: list[tuple[Failure, str]] = []
        self.counted = 0
        """Failed attempts that used one up."""
        self.free = 0
        """Congestion stalls retried without using one up."""
        self.silent = 0
        """Failed attempts the store sent no answer to."""

    @property
    def last(self) -> Failure | None:
        return self.failures[-1][0] if self.failures else None

    def failed(self, kind: Failure, cause: str, *, answered: bool, congested: bool = False) -> bool:
        """Record a failed attempt; ``True`` if it used one up (``False``: a free congestion retry)."""
        self.failures.append((kind, cause))
        if kind is Failure.STALLED and congested and self.free < self.policy.free_stall_retries:
            self.free += 1
            return False
        self.counted += 1
        if not answered and kind in (Failure.TIMEOUT, Failure.STALLED):
            self.silent += 1
        return True

    def exhausted(self) -> bool:
        return self.counted >= self.policy.max_attempts or self.silent >= self.policy.max_silent_attempts

    def delay(self, rng: random.Random) -> float:
        """The backoff before the next attempt (higher after a slow-down answer)."""
        return self.policy.backoff(max(1, self.counted), throttled=self.last is Failure.THROTTLED, rng=rng)

    def error(self, *, uri: str, byte_range: tuple[int, int] | None, what: str = "") -> WeightStreamError:
        """The error that ends the request: a timeout when the store stopped answering or the
        last attempt timed out or stalled, else a read error; it keeps every attempt's cause."""
        kind, cause = self.failures[-1]
        prefix = f"{what}: " if what else ""
        if self.silent >= self.policy.max_silent_attempts:
            error: WeightStreamError = StorageTimeoutError(
                f"{prefix}the store sent no answer to {self.silent} attempts (gave up after "
                f"{len(self.failures)}); last cause: {cause}",
                uri=uri,
                byte_range=byte_range,
            )
        else:
            cls = StorageTimeoutError if kind in (Failure.TIMEOUT, Failure.STALLED) else ReadError
            error = cls(
                f"{prefix}giving up after {self.counted} attempts; last cause: {cause}",
                uri=uri,
                byte_range=byte_range,
            )
        return self.keep(error)

    def keep(self, error: WeightStreamError) -> WeightStreamError:
        """``error`` with every attempt's kind and cause (``error.attempts``), for whoever must
        find out why the request gave up."""
        error.attempts = [(k.value, c) for k, c in self.failures]  # type: ignore[attr-defined]
        return error


@dataclass(frozen=True)
class LowSpeedRule:
    """A request that moves less than ``limit`` bytes/s over ``window`` seconds is stalled
    (``limit`` 0: never)."""

    limit: float
    window: float

    @classmethod
    def from_config(cls, oc: ObjectStoreConfig) -> LowSpeedRule:
        return cls(oc.low_speed_limit, oc.low_speed_window)

    def required(self, own: float, everyone: float, inflight: int) -> float:
        """Bytes a request must have moved in the last window not to count as stalled.

        Alone, or among fast peers, that is ``limit * window``. When our own requests share a
        saturated link, each one's fair share can fall near the limit and TCP shares unevenly;
        then a request is judged against a quarter of the others' average (never less than 1/16
        of the limit), so only a request starving far below its peers is cut.
        """
        floor = self.limit * self.window
        if inflight <= 1:
            return floor
        others_share = max(0, everyone - own) / (inflight - 1)
        return min(floor, max(others_share / 4, floor / 16))

    def largest_piece(self) -> int:
        """The largest piece a response is handed over in: a quarter of the bytes the rule asks
        of a request per window, so a connection just above the limit still delivers several
        pieces in every window. The rule sees bytes only as whole pieces arrive, so a larger
        piece would make a slow but legal request look stalled (1 KiB at the least, 4 MiB at
        the most; 4 MiB with the rule off)."""
        if self.limit == 0:
            return _PIECE_CAP
        quarter = self.limit * self.window / 4
        return int(max(_PIECE_FLOOR, min(_PIECE_CAP, quarter)))


@dataclass(frozen=True)
class HedgePolicy:
    """A request still running after ``multiple`` x the p95 time its peers took for as many
    bytes (and at least ``min_delay`` seconds) gets a second copy; the first to finish wins
    (``multiple`` 0: never)."""

    multiple: float
    min_delay: float
    min_samples: int = 16
    """Finished requests needed before stragglers are judged against their p95."""

    @classmethod
    def from_config(cls, oc: ObjectStoreConfig) -> HedgePolicy:
        return cls(oc.hedge_multiple, oc.hedge_min_delay)

    def after(self, nbytes: int, seconds_per_byte: Sequence[float]) -> float | None:
        """Seconds after which a request of ``nbytes`` still running is hedged; ``None`` until
        enough requests finished to know a p95, or with hedging off. Requests differ in size,
        so they are compared per byte (the last 256)."""
        if self.multiple <= 0 or len(seconds_per_byte) < self.min_samples:
            return None
        recent = sorted(list(seconds_per_byte)[-256:])
        return max(self.min_delay, self.multiple * recent[int(0.95 * (len(recent) - 1))] * nbytes)
