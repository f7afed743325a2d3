"""S3 and S3-compatible stores, GCS and Azure: ranged GETs through obstore (Rust object_store).

Why obstore: its requests run in Rust with the GIL released, a ranged GET returns a buffer-protocol
``Bytes`` (one copy into the destination, no ``bytes`` object), and it reads the standard
configuration (``AWS_*`` variables, web identity, instance metadata) itself. It is imported here
only, so a user of local files never needs it (``pip install weightstream[s3]``).

Every response's length is checked against the request; a short or failed body is read again
whole, into the same place.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import numpy as np

from weightstream.config import ObjectStoreConfig, StreamConfig
from weightstream.errors import (
    ConfigError,
    FormatError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    StorageTimeoutError,
    WeightStreamError,
)
from weightstream.location import ObjectLocation, object_location
from weightstream.sources.base import ReadHow
from weightstream.sources.flow import _PIECE_CAP, _PIECE_FLOOR, RequestStats

__all__ = ["ObjectLocation", "ObjectSource", "download", "list_objects", "parse_object_uri"]

log = logging.getLogger(__name__)

T = TypeVar("T")


parse_object_uri = object_location
"""``s3://bucket/key`` -> location; ``None`` for anything that is not an object-store URI."""


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:  # pragma: no cover - depends on the installation
        raise ConfigError("reading object storage needs obstore: pip install 'weightstream[s3]'") from None
    return obstore


_STORES: dict[tuple[Any, ...], Any] = {}
_CREDENTIAL_ENV = ("AWS_", "GOOGLE_", "AZURE_")


def make_store(loc: ObjectLocation, config: StreamConfig) -> Any:
    """One obstore store per (scheme, bucket, settings, credentials in the environment), shared
    by every source of a load so connections are reused across shards."""
    oc = config.object_store
    creds = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_CREDENTIAL_ENV)))
    key = (loc.scheme, loc.bucket, oc, creds)
    store = _STORES.get(key)
    if store is not None:
        return store
    from obstore.store import from_url as _from_url

    from_url: Any = _from_url  # its overloads want TypedDict literals; ours are built at run time

    client: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=oc.connect_timeout),
        "timeout": timedelta(seconds=oc.request_timeout),
    }
    kwargs: dict[str, Any] = {}
    if loc.scheme == "s3":
        if oc.endpoint:
            kwargs["endpoint"] = oc.endpoint
            if oc.endpoint.startswith("http://"):
                client["allow_http"] = True
        if oc.region:
            kwargs["region"] = oc.region
        if oc.addressing != "auto":
            kwargs["virtual_hosted_style_request"] = oc.addressing == "virtual"
        elif oc.endpoint:
            # A custom endpoint (MinIO, Ceph, moto, ...) nearly always wants path-style URLs.
            kwargs["virtual_hosted_style_request"] = False
        if oc.anonymous:
            kwargs["skip_signature"] = True
    if oc.ca_bundle:
        from weightstream.localfs import regular_file

        try:
            regular_file(oc.ca_bundle, what="cannot read the CA bundle")  # a FIFO would block open()
            with open(oc.ca_bundle, "rb") as fh:
                client["root_certificate"] = fh.read(16 << 20)
        except WeightStreamError as exc:
            raise ConfigError(exc.reason, uri=oc.ca_bundle) from exc
        except OSError as exc:
            raise ConfigError(f"cannot read the CA bundle: {exc.strerror}", uri=oc.ca_bundle) from exc
    # Retries are ours (ObjectSource._fetch): one policy, counted, with full jitter and the
    # low-speed abort; obstore's own would retry underneath it and multiply the attempts.
    retry: dict[str, Any] = {"max_retries": 0}
    if loc.scheme == "s3" and not oc.anonymous:
        provider = _profile_credentials()
        if provider is not None:
            kwargs["credential_provider"] = provider
    try:
        store = from_url(f"{loc.scheme}://{loc.bucket}", client_options=client, retry_config=retry, **kwargs)
    except Exception as exc:
        raise ConfigError(f"cannot configure the object store: {exc}", uri=loc.with_key("").uri) from None
    _STORES[key] = store
    return store


def _profile_credentials() -> Any:
    """boto3's credential chain when a shared-config profile is in play.

    The Rust client reads keys, web identity and instance metadata itself, but not the shared
    ``~/.aws/config`` / ``credentials`` files: with ``AWS_PROFILE`` set (and no keys in the
    environment) the profile is resolved by boto3, which also covers SSO and ``credential_process``.
    """
    if not os.environ.get("AWS_PROFILE") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        log.warning("AWS_PROFILE is set but boto3 is not installed: pip install boto3 to use profiles")
        return None
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=os.environ["AWS_PROFILE"]))
    except Exception as exc:
        raise ConfigError(f"cannot use AWS_PROFILE={os.environ['AWS_PROFILE']!r}: {exc}") from None


def _map_error(
    exc: BaseException, *, uri: str, byte_range: tuple[int, int] | None, what: str
) -> BaseException:
    """obstore's exceptions -> weightstream's, naming the object, range and cause."""
    if isinstance(exc, WeightStreamError):
        return exc
    obstore = _obstore()
    ex = obstore.exceptions
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = f"{what}: {first_line}"
    text = str(exc)
    if "169.254.169.254" in text or "/latest/api/token" in text:
        return PermissionDeniedError(
            f"{what}: no credentials found (not in the environment, no AWS_PROFILE, and no instance "
            "metadata service answered); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
            "or anonymous=True (WEIGHTSTREAM_S3_ANONYMOUS=1) for a public bucket",
            uri=uri,
            byte_range=byte_range,
        )
    if isinstance(exc, ex.PreconditionError) or "412 Precondition Failed" in text:
        return FormatError(
            f"{what}: the object changed since its header was read (its ETag no longer matches); "
            "load the checkpoint again",
            uri=uri,
            byte_range=byte_range,
        )
    if "NoSuchBucket" in text:
        return NotFoundError(f"{what}: no such bucket", uri=uri, byte_range=byte_range)
    # obstore maps 404/403 on GET and HEAD to its own classes, but not on LIST: read the status.
    if isinstance(exc, ex.NotFoundError | FileNotFoundError) or "404 Not Found" in text:
        return NotFoundError(f"{what}: no such object (or no such bucket)", uri=uri, byte_range=byte_range)
    if (
        isinstance(exc, ex.PermissionDeniedError | ex.UnauthenticatedError | PermissionError)
        or "403 Forbidden" in text
        or "401 Unauthorized" in text
        or "InvalidAccessKeyId" in text
        or "SignatureDoesNotMatch" in text
    ):
        return PermissionDeniedError(f"{what}: access denied ({first_line})", uri=uri, byte_range=byte_range)
    if isinstance(exc, TimeoutError) or "timed out" in first_line.lower():
        return StorageTimeoutError(reason, uri=uri, byte_range=byte_range)
    if isinstance(exc, ex.BaseError | OSError | RuntimeError | ValueError):
        return ReadError(reason, uri=uri, byte_range=byte_range)
    return exc


def _call(
    make: Callable[[], Awaitable[T]],
    *,
    uri: str,
    what: str,
    config: StreamConfig,
) -> T:
    """A metadata request (LIST, HEAD) on the event loop, each attempt cancelled after
    ``metadata_timeout`` (a blocking call could only be waited out), retried like GETs on
    transient failures. A store that leaves ``max_silent_attempts`` attempts unanswered is
    unreachable: :class:`StorageTimeoutError` after about that many timeouts, not minutes.
    The last cause stays chained (``__cause__``)."""
    oc = config.object_store
    silent = 0
    for attempt in range(1, oc.max_attempts + 1):

        async def bounded() -> T:
            return await asyncio.wait_for(make(), timeout=oc.metadata_timeout)

        future = asyncio.run_coroutine_threadsafe(bounded(), _Loop.get())
        try:
            return future.result()
        except BaseException as exc:
            future.cancel()  # the caller gave up (KeyboardInterrupt): abort the request
            if not isinstance(exc, Exception):
                raise
            if isinstance(exc, TimeoutError):
                final: BaseException = StorageTimeoutError(
                    f"{what}: no answer within metadata_timeout={oc.metadata_timeout:g} s", uri=uri
                )
            else:
                final = _map_error(exc, uri=uri, byte_range=None, what=what)
            if isinstance(final, StorageTimeoutError):
                silent += 1
            permanent = isinstance(final, NotFoundError | PermissionDeniedError | ConfigError | FormatError)
            last = attempt == oc.max_attempts or silent >= oc.max_silent_attempts
            if permanent or last or not isinstance(final, WeightStreamError):
                if last and not permanent and isinstance(final, WeightStreamError):
                    final = type(final)(
                        f"{final.reason} (gave up after {attempt} attempts"
                        + (f", {silent} of them unanswered" if silent else "")
                        + ")",
                        uri=uri,
                    )
                raise final from exc
        time.sleep(random.uniform(0, min(oc.backoff_max, oc.backoff_initial * 2**attempt)))
    raise AssertionError("unreachable")


def list_objects(loc: ObjectLocation, config: StreamConfig, *, recursive: bool = False) -> dict[str, int]:
    """Keys under ``loc.key`` (a prefix) -> size: those directly under it, or every one below it
    with ``recursive``."""
    obstore = _obstore()
    store = make_store(loc, config)
    prefix = loc.key + "/" if loc.key else ""

    async def run() -> dict[str, int]:
        if recursive:
            out: dict[str, int] = {}
            async for batch in obstore.list(store, prefix or None):
                out.update({o["path"]: int(o["size"]) for o in batch})
            return out
        found = await obstore.list_with_delimiter_async(store, prefix or None)
        return {o["path"]: int(o["size"]) for o in found["objects"]}

    return _call(run, uri=loc.uri, what="cannot list", config=config)


_DOWNLOAD_PIECE = 64 << 20


def download(loc: ObjectLocation, target: str, config: StreamConfig, *, size: int | None = None) -> None:
    """One object to a local file, through the same GET path as tensor reads (retries, resumption,
    the low-speed rule, a version pinned for the whole object); written whole, then renamed into
    place, so a failed download never leaves a file that looks complete."""
    import mmap

    source = ObjectSource(loc, config, size=size)
    partial = f"{target}.part-{os.getpid()}"
    try:
        with open(partial, "w+b") as fh:
            fh.truncate(source.size)
            if source.size:
                with mmap.mmap(fh.fileno(), source.size) as view:
                    for offset in range(0, source.size, _DOWNLOAD_PIECE):
                        length = min(_DOWNLOAD_PIECE, source.size - offset)
                        source.read_into(memoryview(view)[offset : offset + length], offset=offset)
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


class _Loop:
    """One asyncio loop on a daemon thread for every object-store request of the process.

    Requests are coroutines so that a stalled or trickling one can be *cancelled* (obstore then
    drops the connection): a blocking call could only be waited out. Engine workers block on the
    coroutine's future, so the engine's concurrency is the number of requests in flight.
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or not cls._loop.is_running():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                threading.Thread(target=run, name="weightstream-aio", daemon=True).start()
                ready.wait()
                cls._loop = loop
            return cls._loop


def largest_piece(oc: ObjectStoreConfig) -> int:
    """The largest piece a response is handed over in: a quarter of the bytes the low-speed
    rule asks of a request per window, so a connection just above the limit still delivers
    several pieces in every window. The low-speed rule sees bytes only as whole pieces arrive,
    so a larger piece would make a slow but legal request look stalled (1 KiB at the least,
    4 MiB at the most; 4 MiB with the rule off)."""
    quarter = oc.low_speed_limit * oc.low_speed_window / 4
    if oc.low_speed_limit == 0:
        return _PIECE_CAP
    return int(max(_PIECE_FLOOR, min(_PIECE_CAP, quarter)))


_FREE_STALL_RETRIES = 50
"""Most stall retries per request that do not use up an attempt (see ``_attempts``)."""


_HEDGE_MIN_SAMPLES = 16
"""Finished requests needed before stragglers are judged against their p95."""


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


class _Retryable(Exception):
    def __init__(self, reason: str, *, kind: str, answered: bool = True) -> None:
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
        self._obstore = _obstore()
        self.loc = loc
        self.uri = loc.uri
        self._store = make_store(loc, config)
        self._oc = config.object_store
        self.stats = stats if stats is not None else RequestStats()
        self._piece = largest_piece(self._oc)
        self._random = rng or random.Random()
        if size is None:
            meta = _call(
                lambda: self._obstore.head_async(self._store, loc.key),
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
        self._pin(etag)

    @property
    def version(self) -> str | None:
        return self.etag

    def verify(self) -> None:
        """Nothing to do up front: every GET carries ``If-Match`` with the pinned version, so a
        replaced object fails the read that meets it (``FormatError``)."""

    def metered(self, stats: RequestStats) -> ObjectSource:
        """The same object (store, size, pinned version) counting its requests into ``stats``."""
        other = copy.copy(self)
        other.stats = stats
        return other

    def _pin(self, etag: str | None) -> None:
        if self.etag is None and etag and not etag.startswith("W/"):
            self.etag = etag
            self._get_options = {"if_match": etag}

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
        the engine's threads share the copying instead of the one loop thread doing it all
        (measured: the loop thread spent 85 % of a load in that copy).

        Every piece carries the offset in the range it belongs at, set by the request that
        received it, so this thread, the only one writing ``buf``, places each piece by its own
        position, whatever retries, resumptions and hedges came before it. It also keeps the
        proof that the range is whole: no piece may start past the bytes already written
        (no gap), and the request ends with all ``expected`` bytes written, or it fails."""
        pieces: queue.SimpleQueue[_Piece] = queue.SimpleQueue()
        future = asyncio.run_coroutine_threadsafe(self._fetch(pieces, offset, expected), _Loop.get())
        dest = np.frombuffer(buf, dtype=np.uint8, count=expected)
        written = 0  # bytes [0, written) of the range are in place
        try:
            while True:
                at, body = pieces.get()
                if body is None:
                    break
                src = np.frombuffer(body, dtype=np.uint8)
                if at > written or at + src.size > expected:
                    raise ReadError(
                        f"internal error: a piece for bytes {at}-{at + src.size} of the range does not "
                        f"follow the {written} bytes in place",
                        uri=self.uri,
                        byte_range=(offset + at, offset + at + src.size),
                    )
                np.copyto(dest[at : at + src.size], src)
                written = max(written, at + src.size)
            future.result()
        except BaseException:
            future.cancel()  # the caller gave up (e.g. KeyboardInterrupt): abort the request
            raise
        if written != expected:
            raise ReadError(
                f"internal error: the request ended with {written} of {expected} bytes in place",
                uri=self.uri,
                byte_range=(offset + written, offset + expected),
            )

    async def _fetch(self, pieces: queue.SimpleQueue[_Piece], offset: int, expected: int) -> None:
        """Fetch ``[offset, offset+expected)`` as pieces for the waiting worker; whatever happens,
        the worker is told when the request is over."""
        try:
            await self._attempts(pieces, offset, expected)
        finally:
            pieces.put((expected, None))

    async def _attempts(self, pieces: queue.SimpleQueue[_Piece], offset: int, expected: int) -> None:
        """Try the request up to ``max_attempts`` times. A retry asks only for the bytes not
        yet handed over (``progress[0]``: a contiguous prefix of the range), so a stall late in
        a large request costs its tail, not the whole range again."""
        oc = self._oc
        rng = (offset, offset + expected)
        causes: list[str] = []
        last: BaseException | None = None
        attempt = free = silent = 0
        progress = [0]  # bytes of the range handed to the worker, contiguous from its start
        while attempt < oc.max_attempts:
            attempt += 1
            if causes:
                self.stats.retries += 1
                await asyncio.sleep(self._backoff(attempt - 1, throttled=causes[-1].startswith("throttled")))
            self.stats.requests += 1
            started = time.monotonic()
            completed_before = len(self.stats.latencies)
            answered = [False]
            try:
                await asyncio.wait_for(
                    self._hedged(pieces, offset, expected, progress, answered), timeout=oc.request_timeout
                )
            except asyncio.TimeoutError as exc:
                self.stats.timeouts += 1
                causes.append(f"request timed out after {oc.request_timeout:g} s")
                last = exc
                silent += not answered[0]
            except _Retryable as exc:
                causes.append(str(exc))
                last = exc
                if exc.kind == "length":  # a body that disagrees with the request: read it all again
                    self.stats.wasted += progress[0]
                    progress[0] = 0
                congested = len(self.stats.latencies) > completed_before
                if exc.kind == "stall":
                    self.stats.stalls_aborted += 1
                    if congested and free < _FREE_STALL_RETRIES:
                        # Other requests completed while this one starved: congestion among our
                        # own flows (TCP shares a saturated link unevenly), not a dead store.
                        # Retry without using up an attempt; the engine's io_timeout still bounds
                        # the whole load.
                        free += 1
                        attempt -= 1
                        self.stats.congestion_retries += 1
                    elif not exc.answered:
                        silent += 1
                elif exc.kind == "throttled":
                    self.stats.throttled += 1
            else:
                took = time.monotonic() - started
                self.stats.latencies.append(took)
                self.stats.seconds_per_byte.append(took / max(1, expected))
                return
            log.debug("%s bytes %d-%d: attempt %d failed: %s", self.uri, *rng, attempt, causes[-1])
            if silent >= oc.max_silent_attempts:
                raise StorageTimeoutError(
                    f"the store sent no answer to {silent} attempts (gave up after {attempt}); "
                    f"last cause: {causes[-1]}",
                    uri=self.uri,
                    byte_range=rng,
                ) from last
        error_cls = (
            StorageTimeoutError if causes[-1].startswith(("request timed out", "stalled")) else ReadError
        )
        raise error_cls(
            f"giving up after {oc.max_attempts} attempts; last cause: {causes[-1]}",
            uri=self.uri,
            byte_range=rng,
        ) from last

    def _hedge_after(self, nbytes: int) -> float | None:
        """Seconds after which a request of ``nbytes`` still running is hedged:
        ``hedge_multiple`` x the p95 time its peers took for that many bytes (requests differ
        in size, so they are compared per byte), and at least ``hedge_min_delay``. ``None``
        until enough requests finished to know a p95, or with hedging off."""
        oc, spb = self._oc, self.stats.seconds_per_byte
        if oc.hedge_multiple <= 0 or len(spb) < _HEDGE_MIN_SAMPLES:
            return None
        recent = sorted(spb[-256:])
        return max(oc.hedge_min_delay, oc.hedge_multiple * recent[int(0.95 * (len(recent) - 1))] * nbytes)

    async def _hedged(
        self,
        pieces: queue.SimpleQueue[_Piece],
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
        after = self._hedge_after(expected - start)
        primary = asyncio.ensure_future(
            self._one_request(pieces, offset, expected, start, progress, answered)
        )
        if after is None:
            await primary
            return
        done, _ = await asyncio.wait({primary}, timeout=after)
        if done:
            primary.result()
            return
        self.stats.hedges += 1
        held: list[_Piece] = []
        hedge = asyncio.ensure_future(self._one_request(_ListSink(held), offset, expected, start, None, answered))
        log.debug("%s bytes %d-%d: hedged after %.2f s", self.uri, offset + start, offset + expected, after)
        racing = {primary, hedge}
        try:
            while racing:
                done, racing = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        continue
                    if task is hedge:
                        self.stats.hedge_wins += 1
                        self.stats.wasted += progress[0] - start
                        for item in held:
                            pieces.put(item)
                        progress[0] = expected
                    else:
                        self.stats.wasted += sum(len(memoryview(body)) for _, body in held)
                    return
            primary.result()  # both failed: the first request's error decides the retry
        finally:
            for task in (primary, hedge):
                if not task.done():
                    task.cancel()
            for task in (primary, hedge):
                with contextlib.suppress(BaseException):
                    await task
            held.clear()

    async def _one_request(
        self,
        pieces: _Sink,
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
        oc = self._oc
        rng = (offset + start, offset + expected)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        stats = self.stats
        issued = time.monotonic()
        state = {"window": 0, "stalled": False, "since": issued, "global": stats.received}
        headers = False

        timers: list[asyncio.TimerHandle] = []

        def check() -> None:
            if state["window"] < self._required(
                state["window"], stats.received - state["global"], stats.inflight
            ):
                state["stalled"] = True
                task.cancel()
                return
            state["window"], state["since"], state["global"] = 0, time.monotonic(), stats.received
            timers[0] = loop.call_later(oc.low_speed_window, check)

        timers.append(loop.call_later(oc.low_speed_window, check))
        pos = start
        stats.inflight += 1
        try:
            response = await self._obstore.get_async(
                self._store, self.loc.key, options={"range": rng, **self._get_options}
            )
            headers = answered[0] = True
            stats.first_byte.append(time.monotonic() - issued)
            got = tuple(response.range)
            if got != rng:
                raise _Retryable(
                    f"the store answered bytes {got[0]}-{got[1]} to a request for {rng[0]}-{rng[1]}",
                    kind="range",
                )
            if self.etag is None:  # the first answer sets the version later reads must match
                self._pin(response.meta.get("e_tag"))
            async for chunk in response.stream(min_chunk_size=stats.piece_for(self._piece, time.monotonic())):
                n = len(memoryview(chunk))
                if pos + n > expected:
                    raise _Retryable(f"response longer than the {expected - start} bytes requested", kind="length")
                pieces.put((pos, chunk))  # copied into the destination, at pos, by the waiting worker
                pos += n
                if progress is not None:
                    progress[0] = pos
                state["window"] += n
                stats.received += n
        except asyncio.CancelledError:
            if not state["stalled"]:
                raise
            # Our own timer cancelled the request (and with it obstore's connection); the
            # cancellation is ours to absorb, so later awaits of this task are not affected.
            if hasattr(task, "uncancel"):
                task.uncancel()
            what = "" if headers else " (no answer yet)"
            raise _Retryable(
                f"stalled{what}: {state['window']} bytes in {time.monotonic() - state['since']:.1f} s, "
                f"under the low-speed limit of {oc.low_speed_limit} B/s",
                kind="stall",
                answered=headers,
            ) from None
        except _Retryable:
            raise
        except Exception as exc:
            mapped = _map_error(exc, uri=self.uri, byte_range=rng, what="GET failed")
            if isinstance(mapped, NotFoundError | PermissionDeniedError | ConfigError | FormatError):
                raise mapped from exc  # retrying cannot help, and would hammer the store
            text = str(exc)
            if any(code in text for code in ("429", "503 Service Unavailable", "SlowDown")):
                raise _Retryable(f"throttled by the store ({_first_line(exc)})", kind="throttled") from exc
            raise _Retryable(_first_line(exc), kind="error", answered=headers) from exc
        finally:
            timers[0].cancel()
            stats.inflight -= 1
        if pos != expected:  # a short body: the retry resumes at pos
            raise _Retryable(f"response ended after {pos - start} of {expected - start} bytes", kind="short")

    def _required(self, own: float, everyone: float, inflight: int) -> float:
        """Bytes this request must have moved in the last window not to count as stalled.

        Alone, or among fast peers, that is ``low_speed_limit * window``. When our own requests
        share a saturated link, each one's fair share can fall near the limit and TCP shares
        unevenly; then a request is judged against a quarter of the others' average (never less
        than 1/16 of the limit), so only a request starving far below its peers is cut.
        """
        oc = self._oc
        limit = oc.low_speed_limit * oc.low_speed_window
        if inflight <= 1:
            return limit
        others_share = max(0, everyone - own) / (inflight - 1)
        return min(limit, max(others_share / 4, limit / 16))

    def _backoff(self, retry: int, *, throttled: bool) -> float:
        """Full jitter: uniform in [0, min(cap, initial * 2^retry)]; slow-downs start 4x higher."""
        oc = self._oc
        base = oc.backoff_initial * (4 if throttled else 1)
        return self._random.uniform(0, min(oc.backoff_max, base * 2**retry))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ObjectBackend:
    """S3, GCS and Azure (see :class:`~weightstream.sources.registry.Backend`)."""

    remote = True

    def defaults(self, config: StreamConfig) -> StreamConfig:
        return config.for_remote()

    def settings(self, config: StreamConfig) -> Hashable:
        return config.object_store

    def is_folder(self, location: ObjectLocation, config: StreamConfig) -> bool:
        return not location.key.endswith((".safetensors", ".index.json"))

    def list(self, location: ObjectLocation, config: StreamConfig) -> dict[ObjectLocation, int | None]:
        found = list_objects(location, config)
        return {location.with_key(k): n for k, n in sorted(found.items())}

    def check(
        self,
        location: ObjectLocation,
        config: StreamConfig,
        listed: dict[ObjectLocation, int | None] | None,
        *,
        what: str = "no such object",
    ) -> None:
        if listed is not None and location not in listed:
            raise NotFoundError("no such object", uri=location.uri)

    def read_all(self, location: ObjectLocation, config: StreamConfig, *, size: int | None, limit: int) -> bytes:
        src = ObjectSource(location, config, size=size)
        if src.size > limit:
            raise FormatError(f"object is {src.size} bytes, more than {limit}", uri=location.uri)
        return src.read_prefix(src.size)

    def open(
        self, location: ObjectLocation, config: StreamConfig, *, size: int | None = None, version: str | None = None
    ) -> ObjectSource:
        return ObjectSource(location, config, size=size, etag=version)


BACKEND = ObjectBackend()
