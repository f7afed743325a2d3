"""The object-store client: one obstore store per bucket and settings, shared by every source of
the process, its credentials (the environment's chain; boto3 for ``AWS_PROFILE``), the event
loop every request runs on, and metadata requests (LIST, HEAD) bounded and retried.

Why obstore: its requests run in Rust with the GIL released, a ranged GET returns a
buffer-protocol ``Bytes`` (one copy into the destination, no ``bytes`` object), and it reads the
standard configuration (``AWS_*`` variables, web identity, instance metadata) itself. It is
imported here only, so a user of local files never needs it (``pip install weightstream[s3]``).
It serves every listing and HEAD, and the GETs the one-copy transport (:mod:`.direct`) does not.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

from weightstream import _process
from weightstream.config import ObjectStoreConfig, StreamConfig
from weightstream.errors import (
    ConfigError,
    PermissionDeniedError,
    ReadError,
    StorageTimeoutError,
    WeightStreamError,
    redact,
)
from weightstream.localfs import file_version, regular_file
from weightstream.location import ObjectLocation
from weightstream.sources.object_store.failures import Failure, classify, first_line, to_error
from weightstream.sources.object_store.policy import Attempts, RetryPolicy

__all__ = [
    "EventLoop",
    "check_usable",
    "explain_redirect",
    "make_store",
    "metadata_call",
    "obstore_module",
    "track_request",
    "wait_future",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


def obstore_module() -> Any:
    """The obstore package, or a :class:`ConfigError` saying how to install it."""
    try:
        import obstore
    except ImportError:  # pragma: no cover - depends on the installation
        raise ConfigError("reading object storage needs obstore: pip install 'weightstream[s3]'") from None
    return obstore


_STORES: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_MOST_STORES = 32
"""Stores kept for reuse, the most recently used (a process that loads from many buckets or
with many settings keeps at most this many clients and their connection pools)."""
"""Stores by (scheme, bucket, settings, credentials digest)."""
_CREDENTIAL_ENV = ("AWS_", "GOOGLE_", "AZURE_")


def _credentials_digest() -> str:
    """A digest of the credential variables in the environment: a new store is made when they
    change (rotated keys), and the long-lived cache key holds no secret."""
    h = hashlib.sha256()
    for k, v in sorted(os.environ.items()):
        if k.startswith(_CREDENTIAL_ENV):
            h.update(f"{k}={v}\0".encode())
    return h.hexdigest()


def _backstop(*timeouts: float) -> float:
    """The client's own request timeout: past every timeout of ours (which start no later than
    the client's clock for the same request), so that ours always fires first."""
    return 2 * max(timeouts) + 10


def make_store(loc: ObjectLocation, config: StreamConfig) -> Any:
    """One obstore store per (scheme, bucket, settings, credentials in the environment, and the
    version of each file it was built from: a CA bundle or key file rewritten in place, or
    replaced, makes a new one), shared by every source of a load so connections are reused
    across shards."""
    check_usable()
    oc = config.object_store
    files = (oc.ca_bundle, os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "").strip() or None)
    key = (loc.scheme, loc.bucket, oc, _credentials_digest(), tuple(file_version(f) for f in files))
    store = _STORES.get(key)
    if store is not None:
        with contextlib.suppress(KeyError):  # (another thread may have just let it go)
            _STORES.move_to_end(key)
        return store
    from obstore.store import from_url as _from_url

    from_url: Any = _from_url  # its overloads want TypedDict literals; ours are built at run time

    # The request timeout is ours, applied once per attempt (ObjectSource, metadata_call), with
    # the cause kept. The client's is set only as a backstop that cannot fire first: left unset,
    # the client's default (30 s) would cut a legal request under our 60 s default.
    client: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=oc.connect_timeout),
        "timeout": timedelta(seconds=_backstop(oc.request_timeout, oc.metadata_timeout)),
    }
    kwargs = _scheme_options(loc.scheme, oc, client)
    if oc.ca_bundle:
        client["root_certificate"] = _ca_bundle(oc.ca_bundle)
    # Retries are ours (ObjectSource._attempts): one policy, counted, with full jitter and the
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
    mark_used()
    _STORES[key] = store
    while len(_STORES) > _MOST_STORES:
        _STORES.popitem(last=False)
    return store


def _scheme_options(scheme: str, oc: ObjectStoreConfig, client: dict[str, Any]) -> dict[str, Any]:
    """The store's own settings for one scheme (``client``'s options are added to in place)."""
    kwargs: dict[str, Any] = {}
    if scheme == "s3":
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
    if scheme == "gs" and oc.gcs_endpoint:
        base = oc.gcs_endpoint if "://" in oc.gcs_endpoint else f"http://{oc.gcs_endpoint}"
        if base.startswith("http://"):
            client["allow_http"] = True
        kwargs["service_account_key"] = _gcs_key(base.rstrip("/"), anonymous=oc.anonymous)
    return kwargs


def _ca_bundle(path: str) -> bytes:
    try:
        regular_file(path, what="cannot read the CA bundle")  # a FIFO would block open()
        with open(path, "rb") as fh:
            return fh.read(16 << 20)
    except WeightStreamError as exc:
        raise ConfigError(exc.reason, uri=path) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read the CA bundle: {exc.strerror}", uri=path) from exc


def _gcs_key(base_url: str, *, anonymous: bool) -> str:
    """The service-account key the GCS client takes its base URL from: the user's own key file
    (``GOOGLE_APPLICATION_CREDENTIALS``, a service account) with the endpoint set in it, or,
    without one (an emulator), a key that sends requests unsigned."""
    import json

    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "").strip()
    if path and not anonymous:
        try:
            regular_file(path, what="cannot read GOOGLE_APPLICATION_CREDENTIALS")
            with open(path, encoding="utf-8") as fh:
                key = json.loads(fh.read(1 << 20))
        except WeightStreamError as exc:
            raise ConfigError(exc.reason, uri=path) from exc
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read GOOGLE_APPLICATION_CREDENTIALS: {exc}", uri=path) from None
        if isinstance(key, dict) and key.get("type") == "service_account":
            return json.dumps({**key, "gcs_base_url": base_url})
    return json.dumps(
        {
            "gcs_base_url": base_url,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
    )


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


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Runs ``coro`` on the event loop, for a thread to wait on. Its outcome is always taken,
    also where the thread gave up first (cancelled the future) and the coroutine then ended in
    an error rather than cancelled: asyncio would print that error to stderr as "Task exception
    was never retrieved" whenever the task is collected, long after the caller's own error."""
    return asyncio.run_coroutine_threadsafe(outcome_taken(coro), EventLoop.get())


async def outcome_taken(coro: Awaitable[T]) -> T:
    """``coro``, in a task whose outcome is taken when it ends, whoever else looks at it: for a
    task that may be given up on (``asyncio.wait_for`` cancels its inner task when its own
    caller is cancelled and does not look at how it ended)."""
    task = asyncio.current_task()
    if task is not None:
        task.add_done_callback(_take_outcome)
    return await coro


def _take_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def metadata_call(
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
    attempts = Attempts(RetryPolicy.from_config(oc))
    while True:

        async def bounded() -> T:
            return await asyncio.wait_for(outcome_taken(make()), timeout=oc.metadata_timeout)

        future = submit(bounded())
        try:
            return wait_future(future, oc.metadata_timeout, uri=uri, what=what)
        except BaseException as exc:
            future.cancel()  # the caller gave up (KeyboardInterrupt): abort the request
            if not isinstance(exc, Exception):
                raise
            final = _metadata_failure(exc, attempts, uri=uri, what=what, oc=oc)
            if final is not None:
                raise final from exc
        time.sleep(attempts.delay(_RANDOM))


def _metadata_failure(
    exc: Exception, attempts: Attempts, *, uri: str, what: str, oc: ObjectStoreConfig
) -> BaseException | None:
    """What one failed metadata attempt means: the error that ends the request (a permanent
    failure, or the attempts used up), or ``None`` to try again. Recorded by kind in the same
    attempts record as the data requests use."""
    if isinstance(exc, TimeoutError):
        kind, cause = Failure.TIMEOUT, f"no answer within metadata_timeout={oc.metadata_timeout:g} s"
        final: BaseException = StorageTimeoutError(f"{what}: {cause}", uri=uri)
    else:
        kind = classify(exc, endpoint=oc.endpoint)
        final = to_error(exc, uri=uri, byte_range=None, what=what, endpoint=oc.endpoint, region=oc.region)
        if not attempts.failures and isinstance(final, PermissionDeniedError | ReadError):
            final = explain_redirect(final, uri=uri, config=oc)
        cause = getattr(final, "reason", None) or first_line(exc)
    if not isinstance(final, WeightStreamError):
        return final  # not a storage failure (a bug): as it is
    if isinstance(final, ConfigError) or kind.permanent:
        return final  # retrying cannot help
    attempts.failed(kind, cause, answered=kind is not Failure.TIMEOUT)
    if not attempts.exhausted():
        return None
    unanswered = f", {attempts.silent} of them unanswered" if attempts.silent else ""
    return attempts.keep(
        type(final)(f"{final.reason} (gave up after {len(attempts.failures)} attempts{unanswered})", uri=uri)
    )


_RANDOM = random.Random()


def explain_redirect(error: BaseException, *, uri: str, config: ObjectStoreConfig) -> BaseException:
    """``error``, or a :class:`ConfigError` saying the store redirects: the client follows a
    redirect that names a new location, and the request there fails (refused as signed for
    the first host, or no answer), which reads as "access denied" or a failed connection. So
    when a request to a configured endpoint fails that way, one unsigned HEAD of the same path,
    with redirects not followed, asks the store itself (a failure path only)."""
    import http.client
    import urllib.parse

    from weightstream.location import object_location

    loc = object_location(uri)
    if not config.endpoint or loc is None or loc.scheme != "s3":
        return error
    base = urllib.parse.urlsplit(config.endpoint)
    path = urllib.parse.quote(f"{base.path.rstrip('/')}/{loc.bucket}/{loc.key}".replace("//", "/"))
    conn_cls = http.client.HTTPSConnection if base.scheme == "https" else http.client.HTTPConnection
    try:
        conn = conn_cls(base.hostname or "", base.port, timeout=min(config.connect_timeout, 5.0))
        try:
            conn.request("HEAD", path)
            answer = conn.getresponse()
            status, where = answer.status, answer.getheader("Location")
            region = answer.getheader("x-amz-bucket-region")
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ValueError):
        return error
    if not 300 <= status < 400:
        return error
    return ConfigError(
        f"the store redirects requests for this object (HTTP {status}"
        + (f" to {redact(where)}" if where else "")
        + f"): the bucket is probably in another region than {config.region or 'the one configured'}"
        + (f" (the store says {region})" if region else "")
        + "; set AWS_REGION (ObjectStoreConfig.region) to the bucket's region, or the endpoint to the "
        f"one the store names (the request failed so: {getattr(error, 'reason', error)})",
        uri=uri,
        setting="region",
    )


_BACKSTOP = 5.0
"""Seconds past its own timeout a waiter gives a request's coroutine to end (it is cancelled
on the loop at its timeout; this only catches a loop that can no longer run it)."""


def wait_future(future: concurrent.futures.Future[T], timeout: float, *, uri: str, what: str) -> T:
    """The result of a coroutine run on the event loop, waited for at most ``timeout`` plus a
    backstop: every wait on another thread is bounded, even if that thread is gone."""
    try:
        return future.result(timeout=timeout + _BACKSTOP)
    except concurrent.futures.TimeoutError:
        if future.done():
            raise  # the request's own timeout (a TimeoutError too), not the wait's
        future.cancel()
        raise StorageTimeoutError(
            f"{what}: the request did not end {timeout + _BACKSTOP:g} s after it was sent"
            + ("" if EventLoop.alive() else " (the object-store event loop is gone)"),
            uri=uri,
        ) from None


class EventLoop:
    """One asyncio loop on a daemon thread for every object-store request of the process.

    Requests are coroutines so that a stalled or trickling one can be *cancelled* (obstore then
    drops the connection): a blocking call could only be waited out. Engine workers block on the
    coroutine's future, so the engine's concurrency is the number of requests in flight.

    After ``fork()`` the child has neither this thread nor the client's runtime threads (obstore
    runs its requests on a Rust runtime whose workers do not survive a fork, and it has no way
    to start a new one): the loop and its lock are made anew, and a child of a process that had
    made requests refuses at once (:func:`check_usable`) instead of waiting for ever.
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _drain_registered = False

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        check_usable()
        with cls._lock:
            if cls._loop is None or cls._thread is None or not cls._thread.is_alive():
                cls._retire(cls._loop)
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                thread = threading.Thread(target=run, name="weightstream-aio", daemon=True)
                thread.start()
                if not ready.wait(_START_WAIT):  # pragma: no cover - a machine out of threads
                    raise ReadError(f"the object-store event loop did not start within {_START_WAIT:g} s")
                cls._loop, cls._thread = loop, thread
                if not cls._drain_registered:
                    atexit.register(cls._drain_at_exit)
                    cls._drain_registered = True
            return cls._loop

    @classmethod
    def _drain_at_exit(cls) -> None:
        """Before the interpreter finalizes: cancel what is still pending on the loop (a hedge
        that lost, an attempt of a request that failed) and give the client's runtime threads
        the moment they need to hand back its outcome. A runtime thread that enters Python while
        the interpreter finalizes is killed inside Rust code, which aborts the process: a
        command that had already said its error exited with SIGABRT instead of its code."""
        loop, thread = cls._loop, cls._thread
        if loop is None or thread is None or not thread.is_alive() or os.getpid() != _used_in:
            return

        async def cancel_pending() -> None:
            me = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not me]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=_DRAIN_S)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_pending(), loop).result(_DRAIN_S + 0.5)
        deadline = time.monotonic() + _DRAIN_S
        while _REQUESTS.open and time.monotonic() < deadline:
            time.sleep(0.01)  # the GIL released: the runtime's threads finish their callbacks
        time.sleep(_DRAIN_GRACE_S)

    @classmethod
    def alive(cls) -> bool:
        """Whether the loop's thread is running (a request's waiter checks it while it waits)."""
        return cls._thread is not None and cls._thread.is_alive()

    @classmethod
    def _retire(cls, loop: asyncio.AbstractEventLoop | None) -> None:
        """A loop whose thread is gone: closed if it stopped with nothing pending; else kept
        (never run again, never collected, which would warn about each pending request): a
        fork's copy, marked running with no thread behind it, or a loop that died mid-request."""
        if loop is None:
            return
        if loop.is_running() or asyncio.all_tasks(loop):
            _ABANDONED.append(loop)
        else:
            with contextlib.suppress(Exception):
                loop.close()

    @classmethod
    def _after_fork(cls) -> None:
        cls._lock = threading.Lock()
        cls._retire(cls._loop)
        cls._loop = cls._thread = None


_ABANDONED: list[asyncio.AbstractEventLoop] = []
_DRAIN_S = 2.0
_DRAIN_GRACE_S = 0.05


class _OpenRequests:
    """The client's futures not yet done (a done future's runtime thread is about to return,
    or has): what the exit drain waits for."""

    def __init__(self) -> None:
        self.open = 0
        self._lock = threading.Lock()

    def track(self, future: Any) -> Any:
        """``future`` (an awaitable the client returned), counted until it is done."""
        if not isinstance(future, asyncio.Future):
            return future
        with self._lock:
            self.open += 1
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Any) -> None:
        with self._lock:
            self.open -= 1


_REQUESTS = _OpenRequests()


_START_WAIT = 10.0
_used_in: int | None = None
"""The process that made object-store requests (its client runtime is running)."""
_unusable = False
"""This process was forked from one whose client runtime was running."""


def mark_used() -> None:
    """The client's runtime runs in this process from now on."""
    global _used_in
    _used_in = os.getpid()


def check_usable() -> None:
    """Refuse object-store work, at once, in a child forked after the client was used."""
    if _unusable:
        raise ConfigError(
            "object-store reads cannot run in a process forked from one that had already read from an "
            "object store: the client's runtime threads do not survive fork(), and every request would "
            "wait for ever. Load in the parent before forking (forked children share its tensors), "
            "start the workers with the 'spawn' or 'forkserver' start method, or read a local copy"
        )


def _reset_after_fork() -> None:
    global _unusable
    _unusable = _unusable or _used_in is not None
    _STORES.clear()
    EventLoop._after_fork()


_process.at_fork(_reset_after_fork)


def track_request(future: Any) -> Any:
    """Count an object-store client future until it is done (see :meth:`EventLoop._drain_at_exit`)."""
    return _REQUESTS.track(future)
