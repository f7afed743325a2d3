"""The online tuner: how many requests to keep in flight, decided from measured delivery.

A pure object. The engine feeds it the running total of bytes delivered (``tick``) and the
latency of each finished request (``latency``); it answers with the depth to use. It never
sleeps and reads no clock of its own: every call carries ``now``, so a test drives it with a
simulated pipe in microseconds.

How it decides (hill climbing on measured gain, in epochs):

1. *Settle, then measure.* After a depth change the pipe needs about one first-byte delay to
   show it, so that long is discarded; then one epoch gives the delivered rate at that depth.
   Where bytes count only when a request completes (files), an epoch is one typical request
   latency, so requests finishing in waves average out; where they count as they arrive
   (object stores), a few first-byte delays. Both within ``[min_epoch, max_epoch]``.
   An epoch in which the engine had nothing queued (the plan is ending, or the caller is not
   consuming) says nothing about the pipe and is thrown away.
2. *Climb.* From the start depth, try ``depth * 1.5``. A gain of at least ``gain`` (8 %: about
   the noise of one epoch's measurement on a busy machine; the rule below for streaming sources
   measures it instead) keeps
   the new depth and climbs again: by doubling while each step gives most of its ideal gain
   (bytes in flight are far below the pipe's bandwidth x delay), by 1.25 once gains diminish.
   The first epoch (connections opening, socket buffers filling) is not used.
3. *Back off.* No gain: go back to the best depth. A lower depth that delivers as much is
   preferred (fewer flows, less memory, less congestion), so a failed climb is followed by a
   probe downward. Above the start depth "as fast" is enough to step down; below it, a step
   down must be clearly faster (one noisy epoch must not undo a configured depth: too deep
   costs memory, too shallow costs speed).
4. *React.* While holding, each epoch is compared with the rate the depth was chosen at; a
   change of more than ``change`` (20 %), e.g. background traffic starting or stopping,
   restarts the search from the current depth, upward and downward. Every ``reprobe_every``
   epochs it probes upward anyway (cheap: a deeper queue on a full pipe costs only memory).

The depth stays within ``[minimum, maximum]``; the engine sets ``maximum`` from the memory
limit, so the tuner can never overrun it.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["Decision", "DepthController"]

_SQRT2 = 2**0.5

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """One change of depth, kept for the load statistics and logged at DEBUG."""

    at: float
    """Seconds since the first tick."""
    depth: int
    rate: float
    """Bytes/s measured at the depth that was left (0 when unknown)."""
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {
            "at_s": round(self.at, 3),
            "depth": self.depth,
            "rate_gbps": round(self.rate / 1e9, 4),
            "reason": self.reason,
        }


_AT_CAP = 0.95
"""A rate this close to the cap is at it."""


class DepthController:
    """The depth (requests in flight) a load should use now, from the bytes it has delivered.

    Pure: fed ``tick(now, delivered)`` and request latencies, it answers with a depth within
    ``[minimum, maximum]`` and keeps every change as a :class:`Decision` (see the module docstring
    for how it climbs, backs off and reacts). No clock, no sleep, no I/O.
    """

    def __init__(
        self,
        *,
        initial: int,
        minimum: int = 1,
        maximum: int,
        min_epoch: float = 0.2,
        max_epoch: float = 2.0,
        gain: float = 0.08,
        change: float = 0.2,
        reprobe_every: int = 20,
        epoch_delays: float = 5.0,
        epoch_grains: int = 200,
        streaming: bool = False,
    ) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {minimum}, {maximum}")
        self.minimum, self.maximum = minimum, maximum
        self.depth = max(minimum, min(maximum, initial))
        self.min_epoch, self.max_epoch = min_epoch, max_epoch
        self.gain, self.change, self.reprobe_every = gain, change, reprobe_every
        self.decisions: list[Decision] = []
        self.rates: dict[int, float] = {}
        """Latest rate measured at each depth (bytes/s)."""
        self.cap = 0.0
        """Bytes/s the load may not pass (``max_bandwidth``; 0: none): at it, nothing deeper is
        tried."""
        self._latencies: deque[float] = deque(maxlen=64)
        """Seconds per request, or per byte once ``request_bytes`` is set."""
        self.request_bytes = 0
        """Size of a full request (reported with :meth:`sizes`); epochs are then one full
        request long, not one of the small requests that finish first."""
        self._delays: deque[float] = deque(maxlen=64)
        self.streaming = streaming
        """Bytes count as they arrive (object stores). An epoch then need not
        span whole requests, whose arrivals are smooth over many flows: a few first-byte delays
        (``epoch_delays``) are enough for a change of depth to show and be measured."""
        self.epoch_delays = epoch_delays
        self.grain = 0
        """Bytes per counted piece of a streaming source (reported with :meth:`sizes`; 0:
        fine-grained)."""
        self.epoch_grains = epoch_grains
        self._last_rate = 0.0
        self.noise = 0.0
        """Relative standard error of an epoch's rate, measured (streaming sources only)."""
        self._samples: list[tuple[float, int]] = []
        self.settled_at: float | None = None
        """Seconds from the first tick to the first hold: when the opening search ended."""
        self._t0: float | None = None
        self._epoch_start: float | None = None
        self._epoch_bytes = 0
        self._starved = False
        self._state = "climb"
        self._step = 1.5
        self._base: int | None = None
        """The depth a probe is compared against (the best known)."""
        self._reference = 0.0
        """Rate measured when the held depth was chosen."""
        self._held_epochs = 0
        self._tried_down = False
        self._start = self.depth
        self._warm = False
        """The first epoch (connections opening, buffers filling) is measured but not used."""

    # -- inputs -----------------------------------------------------------------------------

    def sizes(self, *, request_bytes: int | None = None, grain: int | None = None) -> None:
        """What the engine knows now of its requests: the size of a full one, and the bytes per
        counted piece of a streaming source (both change as the read size follows the depth)."""
        if request_bytes is not None:
            self.request_bytes = request_bytes
        if grain is not None:
            self.grain = grain

    def latency(self, seconds: float, *, nbytes: int = 0, first_byte: float | None = None) -> None:
        """A request of ``nbytes`` finished ``seconds`` after it was issued; its first bytes
        counted in ``delivered`` after ``first_byte`` seconds (where bytes count as they arrive;
        else the whole read). The first sets how long an epoch must be to average over
        requests finishing in waves (scaled to ``request_bytes`` when sizes differ); the second
        how long a change takes to show."""
        if seconds > 0:
            self._latencies.append(seconds / nbytes if nbytes > 0 and self.request_bytes else seconds)
            if first_byte is not None:
                self._delays.append(max(0.0, first_byte))
            elif not self.streaming:  # counted on completion: the whole read is the delay
                self._delays.append(seconds)

    def first_byte(self, seconds: float) -> None:
        """A request's first bytes arrived ``seconds`` after it was issued (streaming sources
        report this as it happens, before the request completes)."""
        self._delays.append(max(0.0, seconds))

    def tick(self, now: float, delivered: int, *, starved: bool = False) -> int:
        """``delivered``: bytes delivered since the load began (monotonic). ``starved``: the
        engine had no request waiting for a slot at this moment. Returns the depth to use."""
        if self._t0 is None:
            self._t0 = now
            self._restart_epoch(now, delivered)
            return self.depth
        self._starved |= starved
        assert self._epoch_start is not None
        if now < self._epoch_start:  # still settling after a change
            self._epoch_bytes = delivered
            return self.depth
        elapsed = now - self._epoch_start
        # The opening epoch is thrown away whatever it measures; it only has to last until the
        # first requests have told how long an epoch must be (their delays while connections
        # open are no guide to that, and would stretch it to ``max_epoch``).
        if self.streaming:  # for the epoch's noise (see _measure_noise)
            self._samples.append((now, delivered))
        if elapsed < (self._epoch_length() if self._warm else self.min_epoch):
            return self.depth
        rate = (delivered - self._epoch_bytes) / elapsed if elapsed > 0 else 0.0
        if self._starved or rate <= 0:
            # Nothing queued (the depth was not what limited it), or nothing arrived at all (a
            # stall, which timeouts and hedges deal with): no measurement of the depth.
            self._restart_epoch(now, delivered, settle=False)
            return self.depth
        known = self._delays if self.streaming else self._latencies
        if not self._warm or not known:
            # How long an epoch must be is not known yet (no request finished, or for streaming
            # sources none has started to arrive), and the first wave of requests is still
            # ramping up: this epoch is not used.
            self._warm = bool(known)
            self._last_rate = rate  # not used to decide; it sizes the next epoch
            self._restart_epoch(now, delivered)
            return self.depth
        self.rates[self.depth] = rate
        self._last_rate = rate
        if self.streaming:
            self._measure_noise(now, elapsed)
        self._decide(now, rate)
        self._restart_epoch(now, delivered)
        return self.depth

    # -- the search -------------------------------------------------------------------------

    def _decide(self, now: float, rate: float) -> None:
        d = self.depth
        if self.cap and rate >= _AT_CAP * self.cap:
            # The pipe is the cap (max_bandwidth): no deeper probe can be faster.
            if self._state == "climb":
                self._hold(now, rate, "at the bandwidth cap")
            else:
                self._held_epochs = 0
            return
        if self._state == "climb":
            if self._base is None:
                self._base = d
                self._probe(now, d * self._step, rate, "start: probe upward")
                return
            base_rate = self.rates.get(self._base, 0.0)
            if base_rate <= 0:  # cannot happen (only positive rates are kept); never divide by it
                self._hold(now, rate, "no rate to compare with")
                return
            # Below the start depth a step down must be clearly faster (one noisy epoch must not
            # undo a configured depth); above it, as fast is enough (fewer requests, less memory).
            gain = self._gain()
            need = base_rate * (1 + gain) if d < self._start else base_rate * (1 - gain / 2)
            if d < self._base and rate >= need:
                self._base = d
                self._probe(now, d / 1.25, rate, f"{rate / base_rate - 1:+.0%} at {d}: probe lower")
                return
            if rate >= base_rate * (1 + gain):
                ideal, got = d / self._base - 1, rate / base_rate - 1
                if ideal > 0 and got < 0.5 * ideal:
                    self._step = 1.25  # diminishing returns: finer steps from here
                elif ideal > 0 and got >= 0.7 * ideal and self._step > 1.25:
                    self._step = 2.0  # the gain was nearly proportional: far from full
                self._base = d
                if d >= self.maximum:
                    self._hold(now, rate, "gain, at the maximum")
                else:
                    self._probe(now, d * self._step, rate, f"gain {rate / base_rate - 1:+.0%}: climb")
                return
            if d > self._base and not self._tried_down and self._base > self.minimum:
                self._tried_down = True
                self._probe(
                    now, self._base / 1.25, rate, f"no gain ({rate / base_rate - 1:+.0%}): probe lower"
                )
                return
            self._set(
                now, self._base, rate, f"no gain ({rate / base_rate - 1:+.0%} vs {self._base}): back off"
            )
            self._hold(now, base_rate, "hold")
            return
        # holding
        if self._reference <= 0:
            # The first epoch at the held depth is its reference, not the rate seen while
            # searching: that one may include the burst of a pipe filling its buffers.
            self._reference = rate
            return
        self._held_epochs += 1
        moved = abs(rate - self._reference) > max(self.change, 3 * _SQRT2 * self.noise) * self._reference
        if moved or self._held_epochs >= self.reprobe_every:
            why = (
                f"rate {rate / 1e9:.3f} vs {self._reference / 1e9:.3f} GB/s: pipe changed"
                if moved
                else "periodic probe"
            )
            self.rates = {d: rate}
            # periodic probes only look upward; after a change, both ways
            self._state, self._base, self._step, self._tried_down = "climb", d, 1.25, not moved
            if d < self.maximum:
                self._probe(now, d * self._step, rate, why + ", probe upward")
            else:
                self._tried_down = True
                self._probe(now, d / 1.25, rate, why + ", probe lower")

    def _hold(self, now: float, rate: float, why: str) -> None:
        self._state, self._reference, self._held_epochs, self._tried_down = "hold", 0.0, 0, False
        if self.settled_at is None and self._t0 is not None:
            self.settled_at = now - self._t0
        log.debug("tuner: hold depth %d at %.3f GB/s (%s)", self.depth, rate / 1e9, why)

    def _probe(self, now: float, target: float, rate: float, why: str) -> None:
        t = max(self.minimum, min(self.maximum, round(target)))
        if t == self.depth:
            t = self.depth + (1 if target > self.depth else -1)
            t = max(self.minimum, min(self.maximum, t))
        if t == self.depth:
            self._hold(now, rate, why + " (at a bound)")
            return
        self._set(now, t, rate, why)

    def _set(self, now: float, depth: int, rate: float, why: str) -> None:
        if depth == self.depth:
            return
        assert self._t0 is not None
        self.depth = depth
        self.decisions.append(Decision(now - self._t0, depth, rate, why))
        log.debug("tuner: depth %d (%s)", depth, why)

    # -- epochs -----------------------------------------------------------------------------

    def _epoch_length(self) -> float:
        typical = statistics.median(self._latencies) if self._latencies else 0.0
        if self.request_bytes:
            typical *= self.request_bytes
        typical_request = typical
        if self.streaming and self._delays:
            # Bytes counted as they arrive need no whole request, only enough of them: a few
            # first-byte delays for a change of depth to show, and enough counted pieces
            # (``grain`` bytes each) at the last measured rate that their granularity is noise
            # of a few percent (flows that start together deliver their pieces in waves).
            typical = self.epoch_delays * statistics.median(self._delays)
            if self.grain and self._last_rate > 0:
                typical = max(typical, self.epoch_grains * self.grain / self._last_rate)
            elif self.grain:
                typical = max(typical, typical_request / 2)
        return min(self.max_epoch, max(self.min_epoch, typical))

    def _gain(self) -> float:
        """The gain a probe must show: ``gain``, or more where epochs measure noisily (the
        difference of two epochs has about sqrt(2) times the noise of one)."""
        return max(self.gain, 2 * _SQRT2 * self.noise)

    def _measure_noise(self, now: float, elapsed: float) -> None:
        """How precisely this epoch measured its rate: the spread of its quarters' rates (a
        stalled server, a busy CPU, flows delivering in waves), as the standard error of their
        mean, averaged over epochs."""
        start = now - elapsed
        quarter = elapsed / 4
        samples, i, level = self._samples, 0, self._epoch_bytes
        edges = []
        for k in range(1, 5):
            edge = start + k * quarter
            while i < len(samples) and samples[i][0] <= edge + 1e-9:
                level = samples[i][1]
                i += 1
            edges.append(level)
        rates = [b - a for a, b in zip([self._epoch_bytes, *edges[:-1]], edges, strict=True)]
        mean = sum(rates) / 4
        if mean <= 0:
            return
        error = statistics.pstdev(rates) / mean / 2
        self.noise = error if self.noise == 0 else (self.noise + error) / 2

    def _restart_epoch(self, now: float, delivered: int, *, settle: bool = True) -> None:
        delay = statistics.median(self._delays) if self._delays else 0.0
        wait = min(self.max_epoch, delay) if settle else 0.0
        self._epoch_start = now + wait
        self._epoch_bytes = delivered
        self._samples = []
        self._starved = False
