"""One object read with ranged GETs, with resumption, the low-speed rule, hedging and the version
pin. Every response's length and range are checked against the request; a short or failed body
is read again from where it stopped.

Two transports move the bytes; the request machine (``_attempts``, ``_hedged``) is the same for
both. On a plain-HTTP S3-compatible endpoint each GET is received by the kernel straight into
the destination (:mod:`.direct`: one copy a byte, Python per request); elsewhere obstore streams
each response piece by piece to the waiting worker, which copies the pieces into place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import logging
import queue
import random
import threading
import time
from typing import Any, NoReturn, Protocol

import numpy as np

from weightstream.config import ObjectStoreConfig, StreamConfig
from weightstream.errors import FormatError, ReadError, StorageTimeoutError, WeightStreamError
from weightstream.location import ObjectLocation
from weightstream.sources.base import ReadHow
from weightstream.sources.flow import RequestStats
from weightstream.sources.object_store import direct
from weightstream.sources.object_store.client import (
    EventLoop,
    explain_redirect,
    make_store,
    metadata_call,
    obstore_module,
    outcome_taken,
    submit,
    track_request,
    wait_future,
)
from weightstream.sources.object_store.failures import Failure, classify, first_line, scrub, to_error
from weightstream.sources.object_store.policy import Attempts, HedgePolicy, LowSpeedRule, RetryPolicy

__all__ = ["ObjectSource"]

log = logging.getLogger(__name__)


_Piece = tuple[int, Any]
"""``(at, body)``: ``body`` holds the bytes of the range from offset ``at`` on (``body`` is
``None`` for the end of the request)."""


class _Sink(Protocol):
    def put(self, item: _Piece) -> None: ...


class _ListSink:
    """Where a hedge's pieces wait until it is known to have won."""

    def __init__(self, items: list[_Piece]) -> None:
        self.items = items

    def put(self, item: _Piece) -> None:
        self.items.append(item)


class _Direct:
    """Where the one-copy transport writes one range: the destination itself, for the request
    and its hedge alike (every byte any transfer writes is the pinned version's byte at that
    place, checked before the body, so two transfers over the same bytes write the same
    values), and the transfers made for it, which the worker waits out before it returns."""

    def __init__(self, buf: Any, expected: int) -> None:
        view = memoryview(buf)
        self._views = [view]
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
            self._views.append(view)
        self.dest = view[:expected]
        self._views.append(self.dest)
        self.transfers: list[direct.Transfer] = []
        self.moved = 0
        """Bytes received by the transfers of this sink (a lost hedge's count as wasted)."""

    def hedge(self) -> _Direct:
        other = copy.copy(self)
        other.moved = 0
        return other

    def part(self, start: int, end: int) -> memoryview:
        view = self.dest[start:end]
        self._views.append(view)
        return view

    def settle(self, wait: float) -> None:
        """Abort what is still running, wait until no transfer can write into ``dest``, and
        release every view of the caller's buffer (a mapped file can then be closed at once,
        whatever still holds this object)."""
        for t in self.transfers:
            if not t.done.is_set():
                t.abort()
        for t in self.transfers:
            t.done.wait(wait)
        for view in reversed(self._views):
            with contextlib.suppress(BufferError):  # a transfer past every bound still holds it
                view.release()


class _Retryable(Exception):
    """An attempt that failed in a way another attempt may mend; ``kind`` decides how."""

    def __init__(self, reason: str, *, kind: Failure, answered: bool = True) -> None:
        super().__init__(reason)
        self.kind = kind
        self.answered = answered
        """Whether the store sent any answer (response headers) to the attempt."""


class ObjectSource:
    """One object, read with ranged GETs (see the module docstring)."""

    def __init__(
        self,
        loc: ObjectLocation,
        config: StreamConfig,
        *,
        size: int | None = None,
        etag: str | None = None,
        stats: RequestStats | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._obstore = obstore_module()
        self.loc = loc
        self.uri = loc.uri
        self._store = make_store(loc, config)
        oc = config.object_store
        self._settings = oc
        self._retry = RetryPolicy.from_config(oc)
        self._low_speed = LowSpeedRule.from_config(oc)
        self._hedge = HedgePolicy.from_config(oc)
        self.stats = stats if stats is not None else RequestStats()
        self._piece = self._low_speed.largest_piece()
        self._random = rng or random.Random()
        if size is None:
            meta = metadata_call(
                lambda: track_request(self._obstore.head_async(self._store, loc.key)),
                uri=self.uri,
                what="cannot open",
                config=config,
            )
            size = int(meta["size"])
        self.size = size
        self.etag: str | None = None
        """The object version every read is pinned to (``If-Match``): an object replaced during
        a load fails the load instead of mixing two versions in one checkpoint. Given by the
        caller (the version the header was read at), or learnt from the first GET's answer;
        never from a listing or HEAD, whose ETags some S3-compatible stores and proxies spell
        differently. Weak ETags (``W/...``) cannot be matched strongly and are not used."""
        self._get_options: dict[str, Any] = {}
        self._pin_lock = threading.Lock()
        self._pin(etag)
        self._direct = direct.transport_for(loc, oc)
        """The one-copy transport, where it serves this object (else obstore's streamed GETs)."""
        self._requests = _InFlight()
        # A waiter gives up on a request only past every attempt it may make (the request's own
        # timeouts end it first; this catches a loop that can no longer run it).
        attempts = self._retry.max_attempts + self._retry.free_stall_retries
        self._bound = attempts * (self._retry.request_timeout + self._retry.backoff_max)

    @property
    def version(self) -> str | None:
        return self.etag

    def verify(self) -> None:
        """Nothing to do up front: every GET carries ``If-Match`` with the pinned version, so a
        replaced object fails the read that meets it (``FormatError``)."""

    @property
    def staged(self) -> bool:
        """obstore's transport receives each body into its own buffers; the one-copy transport
        receives straight into the destination (see :class:`~weightstream.sources.base.Staged`)."""
        return self._direct is None

    def metered(self, stats: RequestStats) -> ObjectSource:
        """The same object (store, size, pinned version) counting its requests into ``stats``."""
        other = copy.copy(self)
        other.stats = stats
        other._requests = _InFlight()  # cancelling one load's requests leaves the others'
        return other

    def cancel(self) -> None:
        """Abort this source's requests in flight at once (their connections are closed) and
        refuse new ones; the waiting workers wake up now, not when a stalled request ends."""
        self._requests.cancel()

    def _pin(self, etag: str | None) -> None:
        if self.etag is None and etag and not etag.startswith("W/"):
            self.etag = etag
            self._get_options = {"if_match": etag}

    def _check_answer(self, got: tuple[int, int], answered_etag: str | None, rng: tuple[int, int]) -> None:
        """An answer's range and version, before a byte of its body is used: the range asked
        for, and the version the load is pinned to (the first strong ETag answered pins it)."""
        if got != rng:
            raise _Retryable(
                f"the store answered bytes {got[0]}-{got[1]} to a request for {rng[0]}-{rng[1]}",
                kind=Failure.WRONG_RANGE,
            )
        with self._pin_lock:
            if self.etag is None:  # the first answer sets the version later reads must match
                self._pin(answered_etag)
                return
        if answered_etag and not answered_etag.startswith("W/") and answered_etag != self.etag:
            # The store sent another version despite If-Match (emulators and some
            # S3-compatible stores ignore it on GET): every answer is checked, not trusted.
            raise FormatError(
                "the object changed since its header was read (the store answered version "
                f"{answered_etag}, the load is pinned to {self.etag}); load the checkpoint again",
                uri=self.uri,
                byte_range=rng,
            )

    def read_prefix(self, length: int) -> bytes:
        length = min(length, self.size)
        view = bytearray(length)
        if length:
            self._get_into(memoryview(view), 0, length)
        return bytes(view)

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        expected = max(0, min(len(buf), self.size - offset))
        if expected:
            self._get_into(buf, offset, expected)
        return expected, "network"

    def close(self) -> None:
        pass

    def _get_into(self, buf: memoryview, offset: int, expected: int) -> None:
        """Runs on an engine worker thread. The request runs on the event loop, which hands each
        body piece over without copying it; the copy into ``buf`` happens here, GIL released, so
        the engine's threads share the copying instead of the one loop thread doing it all (where
        it would be most of the loop thread's time).

        Every piece carries the offset in the range it belongs at, set by the request that
        received it, so this thread, the only one writing ``buf``, places each piece by its own
        position, whatever retries, resumptions and hedges came before it. It also keeps the
        proof that the range is whole: no piece may start past the bytes already written
        (no gap), and the request ends with all ``expected`` bytes written, or it fails."""
        if self._direct is not None:
            self._get_direct(buf, offset, expected)
            return
        pieces: queue.SimpleQueue[_Piece] = queue.SimpleQueue()
        future = self._requests.start(self._fetch(pieces, offset, expected), uri=self.uri)
        placement = _Placement(buf, offset, expected, uri=self.uri)
        deadline = time.monotonic() + self._bound
        try:
            while True:
                at, body = self._next_piece(pieces, deadline, offset, expected)
                if body is None:
                    break
                placement.place(at, body)
            wait_future(future, 0.0, uri=self.uri, what=f"bytes {offset}-{offset + expected}")
        except BaseException:
            future.cancel()  # the caller gave up (e.g. KeyboardInterrupt): abort the request
            raise
        finally:
            self._requests.done(future)
        placement.whole()

    def _get_direct(self, buf: memoryview, offset: int, expected: int) -> None:
        """The one-copy transport: the request machine runs on the event loop as for obstore,
        and its transfers receive straight into ``buf``; this thread waits for the machine's
        verdict, then until no transfer of the range can write into ``buf`` any more."""
        sink = _Direct(buf, expected)
        future = self._requests.start(self._attempts(sink, offset, expected), uri=self.uri)
        deadline = time.monotonic() + self._bound
        try:
            while True:
                try:  # (the outcome returned, not raised: a StorageTimeoutError is a TimeoutError too)
                    failure = future.exception(timeout=_POLL)
                    break
                except concurrent.futures.TimeoutError:
                    self._still_waiting(deadline, offset, expected)
                except concurrent.futures.CancelledError:
                    raise ReadError(
                        "the load was cancelled", uri=self.uri, byte_range=(offset, offset + expected)
                    ) from None
            if failure is not None:
                raise failure
        except BaseException:
            future.cancel()
            raise
        finally:
            self._requests.done(future)
            sink.settle(_BACKSTOP_WAIT)

    def _next_piece(
        self, pieces: queue.SimpleQueue[_Piece], deadline: float, offset: int, expected: int
    ) -> _Piece:
        """The next piece of the request; waits are bounded (the loop's thread must be alive, and
        the request must end within every attempt it may make)."""
        while True:
            try:
                return pieces.get(timeout=_POLL)
            except queue.Empty:
                pass
            self._still_waiting(deadline, offset, expected)

    def _still_waiting(self, deadline: float, offset: int, expected: int) -> None:
        """A waiting worker's checks that its request can still end."""
        if self._requests.cancelled:
            raise ReadError("the load was cancelled", uri=self.uri, byte_range=(offset, offset + expected))
        if not EventLoop.alive() or time.monotonic() > deadline:
            raise StorageTimeoutError(
                "the request neither ended nor failed within every attempt it may make"
                + ("" if EventLoop.alive() else " (the object-store event loop is gone)"),
                uri=self.uri,
                byte_range=(offset, offset + expected),
            )

    async def _fetch(self, pieces: queue.SimpleQueue[_Piece], offset: int, expected: int) -> None:
        """Fetch ``[offset, offset+expected)`` as pieces for the waiting worker; whatever happens,
        the worker is told when the request is over."""
        try:
            await self._attempts(pieces, offset, expected)
        finally:
            pieces.put((expected, None))

    async def _attempts(
        self, pieces: queue.SimpleQueue[_Piece] | _Direct, offset: int, expected: int
    ) -> None:
        """Try the request until it is whole or its attempts are used up. A retry asks only for
        the bytes not yet handed over (``progress[0]``: a contiguous prefix of the range), so a
        stall late in a large request costs its tail, not the whole range again.

        A request whose bytes have all been handed over is complete, whatever fires after the
        last of them (a stall timer, the request timeout, a hedge): it is never failed for work
        already done, and a request for zero bytes is never sent."""
        rng = (offset, offset + expected)
        attempts = Attempts(self._retry)
        last: BaseException | None = None
        progress = [0]  # bytes of the range handed to the worker, contiguous from its start
        while progress[0] < expected:
            if attempts.failures:
                self.stats.retries += 1
                await asyncio.sleep(attempts.delay(self._random))
            self.stats.requests += 1
            started = time.monotonic()
            completed_before = len(self.stats.latencies)
            answered = [False]
            try:
                await asyncio.wait_for(
                    outcome_taken(self._hedged(pieces, offset, expected, progress, answered)),
                    timeout=self._retry.request_timeout,
                )
            except asyncio.TimeoutError as exc:
                if progress[0] >= expected:
                    break  # every byte is in: the timeout fired after the work was done
                self.stats.timeouts += 1
                last = exc
                attempts.failed(
                    Failure.TIMEOUT,
                    f"request timed out after {self._retry.request_timeout:g} s",
                    answered=answered[0],
                )
            except _Retryable as exc:
                if progress[0] >= expected and exc.kind is not Failure.LONG:
                    break  # a stall or a short read reported after the last byte arrived
                last = exc
                if exc.kind is Failure.LONG:  # a body that disagrees with the request: read it all again
                    self.stats.wasted += progress[0]
                    progress[0] = 0
                elif exc.kind is Failure.STALLED:
                    self.stats.stalls_aborted += 1
                elif exc.kind is Failure.THROTTLED:
                    self.stats.throttled += 1
                # Other requests completed while this one starved: congestion among our own flows
                # (TCP shares a saturated link unevenly), not a dead store. Such a stall does not
                # use up an attempt; the engine's io_timeout still bounds the whole load.
                congested = len(self.stats.latencies) > completed_before
                if not attempts.failed(exc.kind, str(exc), answered=exc.answered, congested=congested):
                    self.stats.congestion_retries += 1
            else:
                break
            _raise_if_cancelled()
            log.debug("%s bytes %d-%d: attempt %d failed: %s", self.uri, *rng, len(attempts.failures), last)
            if attempts.exhausted():
                raise attempts.error(uri=self.uri, byte_range=rng) from last
        took = time.monotonic() - started  # the attempt that completed the range
        self.stats.succeeded(took, expected)

    async def _hedged(
        self,
        pieces: queue.SimpleQueue[_Piece] | _Direct,
        offset: int,
        expected: int,
        progress: list[int],
        answered: list[bool],
    ) -> None:
        """One attempt for the bytes from ``progress[0]`` on: the request, and a second copy
        of it if it becomes a straggler.

        The first request streams to the worker as it arrives. A hedge keeps its pieces (the
        client's buffers, no copy) until it is known to have won; then they are handed over,
        each with its own offset, and overwrite the same bytes of the same object version
        (reads are pinned to its ETag). The loser is cancelled (its connection closed) and its
        bytes count as wasted."""
        start = progress[0]
        if start >= expected:
            return  # nothing left to ask for: never a request for zero bytes
        after = self._hedge.after(expected - start, self.stats.seconds_per_byte)
        primary = asyncio.ensure_future(
            self._one_request(pieces, offset, expected, start, progress, answered)
        )
        if after is None:
            await primary  # (a cancel of this task cancels the request it awaits)
            return
        tasks = [primary]
        held: list[_Piece] = []
        try:
            done, _ = await asyncio.wait({primary}, timeout=after)
            if done:
                primary.result()
                return
            self.stats.hedges += 1
            sink: _Sink | _Direct = pieces.hedge() if isinstance(pieces, _Direct) else _ListSink(held)
            hedge = asyncio.ensure_future(self._one_request(sink, offset, expected, start, None, answered))
            tasks.append(hedge)
            log.debug(
                "%s bytes %d-%d: hedged after %.2f s", self.uri, offset + start, offset + expected, after
            )
            racing = {primary, hedge}
            while racing:
                done, racing = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        continue
                    if task is hedge:
                        self.stats.hedge_wins += 1
                        self.stats.wasted += progress[0] - start
                        for item in held:
                            pieces.put(item)  # type: ignore[union-attr]  # (held: the queue's hedge only)
                        progress[0] = expected
                    else:
                        lost = sink.moved if isinstance(sink, _Direct) else 0
                        self.stats.wasted += lost + sum(len(memoryview(body)) for _, body in held)
                    return
            primary.result()  # both failed: the first request's error decides the retry
        finally:
            try:
                await _end_all(tasks)
            finally:
                held.clear()

    async def _one_request(
        self,
        pieces: _Sink | _Direct,
        offset: int,
        expected: int,
        start: int,
        progress: list[int] | None,
        answered: list[bool],
    ) -> None:
        """One ranged GET for bytes ``[start, expected)`` of the range at ``offset``, its body
        handed over piece by piece, each piece with its offset in the range; ``progress[0]``
        follows the bytes handed over. The response must be the range asked for. The low-speed
        limit is a timer that fires once per window and cancels the request if it moved too
        little, headers not yet received included: no per-piece timeouts."""
        if start >= expected:  # pragma: no cover - _hedged never asks for nothing
            raise ReadError(
                f"internal error: a request for bytes {start}-{expected} of the range", uri=self.uri
            )

        if isinstance(pieces, _Direct):
            await self._one_direct(pieces, offset, expected, start, progress, answered)
            return
        rng = (offset + start, offset + expected)
        task = asyncio.current_task()
        assert task is not None
        stats = self.stats
        issued = time.monotonic()
        watchdog = _Watchdog(self._low_speed, stats, task)
        headers = False
        pos = start
        stats.inflight += 1
        try:
            response = await track_request(
                self._obstore.get_async(
                    self._store, self.loc.key, options={"range": rng, **self._get_options}
                )
            )
            headers = answered[0] = True
            stats.answered(time.monotonic() - issued)
            self._check_answer(tuple(response.range), response.meta.get("e_tag"), rng)
            async for chunk in response.stream(min_chunk_size=stats.piece_for(self._piece, time.monotonic())):
                n = len(memoryview(chunk))
                if pos + n > expected:
                    raise _Retryable(
                        f"response longer than the {expected - start} bytes requested", kind=Failure.LONG
                    )
                pieces.put((pos, chunk))  # copied into the destination, at pos, by the waiting worker
                pos += n
                if progress is not None:
                    progress[0] = pos
                watchdog.moved(n)
        except asyncio.CancelledError:
            if not watchdog.stalled:
                raise
            # Our own timer cancelled the request (and with it obstore's connection); the
            # cancellation is ours to absorb, so later awaits of this task are not affected.
            if hasattr(task, "uncancel"):
                task.uncancel()
            raise watchdog.stall(answered=headers) from None
        except (_Retryable, WeightStreamError):
            raise  # ours already: a retry, or a failure retrying cannot mend
        except Exception as exc:
            self._reraise(exc, rng, answered=headers)
        finally:
            watchdog.stop()
            stats.inflight -= 1
        if pos != expected:  # a short body: the retry resumes at pos
            raise _Retryable(
                f"response ended after {pos - start} of {expected - start} bytes", kind=Failure.SHORT
            )

    def _reraise(self, exc: Exception, rng: tuple[int, int], *, answered: bool) -> NoReturn:
        """``exc``, from a request for ``rng``, as the failure it is (itself where it is ours)."""
        error = _failure(exc, uri=self.uri, byte_range=rng, answered=answered, store=self._settings)
        if error is exc:
            raise exc
        raise error from exc

    async def _one_direct(
        self,
        sink: _Direct,
        offset: int,
        expected: int,
        start: int,
        progress: list[int] | None,
        answered: list[bool],
    ) -> None:
        """:meth:`_one_request` on the one-copy transport: the GET runs on a transport thread
        and receives ``[start, expected)`` straight into the destination; the thread reports
        its bytes to this loop at most once a tick, where the low-speed rule and ``progress``
        see them. Cancelled (a timer, a lost hedge race, the load's end), the transfer is
        aborted; the worker waits out every transfer before it returns."""
        rng = (offset + start, offset + expected)
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        stats = self.stats
        issued = time.monotonic()
        watchdog = _Watchdog(self._low_speed, stats, task)
        pos = [start]

        def advance(to: int) -> None:  # on the loop: bytes [start, to) are in place
            n = to - pos[0]
            if n <= 0:
                return  # a report that arrived after the request ended
            pos[0] = to
            sink.moved += n
            if progress is not None:  # never back: a hedge that won has set it to the end
                progress[0] = max(progress[0], to)
            watchdog.moved(n)

        received = [start]  # the transfer thread's count

        def on_bytes(n: int) -> None:  # on the transfer's thread
            received[0] += n
            loop.call_soon_threadsafe(advance, received[0])

        def on_answer(a: direct.Answer) -> None:  # on the transfer's thread, before the body
            answered[0] = True
            stats.answered(time.monotonic() - issued)
            self._check_answer((a.first, a.end), a.etag, rng)

        transfer = direct.Transfer(deadline=issued + self._retry.request_timeout + 1.0)
        sink.transfers.append(transfer)
        assert self._direct is not None
        ended = loop.create_future()

        def on_end(exc: BaseException | None) -> None:  # on the transfer's thread
            loop.call_soon_threadsafe(_settle, ended, exc)

        stats.inflight += 1
        try:
            get = direct.Get(
                self.loc.key, rng, sink.part(start, expected), transfer, self.etag, on_answer, on_bytes
            )
            direct.pool().run(self._direct.get_into, get, on_end)
            await ended
        except asyncio.CancelledError:
            transfer.abort()
            finished = received[0] == expected  # (counted on the transfer's thread as they landed)
            if finished:  # every byte had arrived when a timer fired: the request is complete
                advance(expected)
            if not watchdog.stalled:
                raise  # not ours: a timeout (which sees the progress), a lost race, the load's end
            if hasattr(task, "uncancel"):
                task.uncancel()
            if finished:
                return
            raise watchdog.stall(answered=answered[0]) from None
        except (_Retryable, WeightStreamError):
            raise
        except Exception as exc:
            self._reraise(exc, rng, answered=answered[0])
        finally:
            watchdog.stop()
            stats.inflight -= 1
            if not transfer.done.is_set():
                transfer.abort()
        advance(received[0])  # (its reports may still be queued behind it)
        _require_whole(received[0], start, expected)


def _require_whole(received: int, start: int, expected: int) -> None:
    """A transfer is complete by the bytes counted, not because it returned: one that returned
    short is a short read (the retry asks for the rest), never a whole range."""
    if received != expected:
        raise _Retryable(
            f"the transfer ended after {received - start} of {expected - start} bytes", kind=Failure.SHORT
        )


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    """A transfer's outcome on the request machine's future (on its loop), unless the machine
    has given the future up."""
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


_POLL = 1.0
"""Seconds between a waiting worker's checks that its request can still end."""
_BACKSTOP_WAIT = 5.0
"""Seconds a worker waits for an aborted transfer's thread to end (a shutdown wakes it at once)."""


class _Placement:
    """The worker's side of one request: each piece placed at its own offset in the range, and
    the proof that the range is whole (no piece starts past the bytes in place, none runs past
    the range, and every byte is in when the request ends)."""

    def __init__(self, buf: Any, offset: int, expected: int, *, uri: str) -> None:
        self.dest = np.frombuffer(buf, dtype=np.uint8, count=expected)
        self.offset, self.expected, self.uri = offset, expected, uri
        self.written = 0
        """Bytes ``[0, written)`` of the range are in place."""

    def place(self, at: int, body: Any) -> None:
        src = np.frombuffer(body, dtype=np.uint8)
        if at > self.written or at + src.size > self.expected:
            raise ReadError(
                f"internal error: a piece for bytes {at}-{at + src.size} of the range does not "
                f"follow the {self.written} bytes in place",
                uri=self.uri,
                byte_range=(self.offset + at, self.offset + at + src.size),
            )
        np.copyto(self.dest[at : at + src.size], src)
        self.written = max(self.written, at + src.size)

    def whole(self) -> None:
        if self.written != self.expected:
            raise ReadError(
                f"internal error: the request ended with {self.written} of {self.expected} bytes in place",
                uri=self.uri,
                byte_range=(self.offset + self.written, self.offset + self.expected),
            )


async def _end_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancels the tasks still running, waits until every one has ended and takes each outcome
    (nothing is left running, writing into memory, after the request that started them, and no
    error is left for asyncio to print when the task is collected). A cancel of the calling
    task while it waits is raised once they have ended, not swallowed."""
    for task in tasks:
        if not task.done():
            task.cancel()
    cancelled = False
    while running := [task for task in tasks if not task.done()]:
        try:
            await asyncio.wait(running)
        except asyncio.CancelledError:
            cancelled = True
    for task in tasks:
        if not task.cancelled():
            task.exception()
    if cancelled:
        raise asyncio.CancelledError


def _raise_if_cancelled() -> None:
    """Ends the request if it was cancelled (the load stopped) whatever its attempt ended in:
    before Python 3.12, ``asyncio.wait_for`` returns the inner outcome when the cancel and the
    inner's end land in one step of the loop, and a failure so returned would be retried."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # (Python 3.11+: 3.10 cannot tell)
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


class _InFlight:
    """A source's requests in flight on the event loop, so that a load that ends early cancels
    them at once (:meth:`ObjectSource.cancel`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: set[concurrent.futures.Future[None]] = set()
        self.cancelled = False

    def start(self, coro: Any, *, uri: str) -> concurrent.futures.Future[None]:
        with self._lock:
            if self.cancelled:
                coro.close()
                raise ReadError("the load was cancelled", uri=uri)
            future = submit(coro)
            self._futures.add(future)
            return future

    def done(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            futures, self._futures = self._futures, set()
        for future in futures:
            future.cancel()


def _failure(
    exc: Exception, *, uri: str, byte_range: tuple[int, int], answered: bool, store: ObjectStoreConfig
) -> BaseException:
    """What a failed GET raises: a permanent failure as the user's error (retrying cannot help,
    and would hammer the store), anything else of the store's as a retry, and what is not a
    storage failure (a bug) as it is."""
    scrub(exc)  # chained as the cause either way: no endpoint password in it
    kind = classify(exc, endpoint=store.endpoint)
    if kind.permanent:
        error = to_error(
            exc,
            uri=uri,
            byte_range=byte_range,
            what="GET failed",
            endpoint=store.endpoint,
            region=store.region,
        )
        return explain_redirect(error, uri=uri, config=store) if kind is Failure.DENIED else error
    if kind is Failure.UNKNOWN:
        return exc
    if kind is Failure.THROTTLED:
        return _Retryable(f"throttled by the store ({first_line(exc)})", kind=Failure.THROTTLED)
    return _Retryable(first_line(exc), kind=Failure.TRANSIENT, answered=answered)


class _Watchdog:
    """The low-speed rule on one request: a timer that fires once per window and cancels the
    request if it moved too little in it (headers not yet received included), judged against its
    peers when our own requests share a saturated link. No per-piece timeouts."""

    def __init__(self, rule: LowSpeedRule, stats: RequestStats, task: asyncio.Task[Any]) -> None:
        self.rule, self.stats, self.task = rule, stats, task
        self.loop = asyncio.get_running_loop()
        self.window = 0
        self.since = time.monotonic()
        self.everyone = stats.received
        self.stalled = False
        self.timer = self.loop.call_later(rule.window, self._check)

    def moved(self, n: int) -> None:
        self.window += n
        self.stats.received += n

    def _check(self) -> None:
        if self.window < self.rule.required(
            self.window, self.stats.received - self.everyone, self.stats.inflight
        ):
            self.stalled = True
            self.task.cancel()
            return
        self.window, self.since, self.everyone = 0, time.monotonic(), self.stats.received
        self.timer = self.loop.call_later(self.rule.window, self._check)

    def stall(self, *, answered: bool) -> _Retryable:
        what = "" if answered else " (no answer yet)"
        return _Retryable(
            f"stalled{what}: {self.window} bytes in {time.monotonic() - self.since:.1f} s, "
            f"under the low-speed limit of {self.rule.limit:g} B/s",
            kind=Failure.STALLED,
            answered=answered,
        )

    def stop(self) -> None:
        self.timer.cancel()
