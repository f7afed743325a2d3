"""One classifier for everything an object-store request can fail with: a kind (an enum) that
decides whether to retry, and the weightstream error the user sees, naming the object, range
and cause. The original exception stays chained by the caller (``raise ... from exc``).

obstore's exception classes say "not found", "denied", "precondition failed" for GET and HEAD,
but a LIST's failures, throttling answers and S3 error codes arrive as a generic error whose
message carries the HTTP status and the S3 code: those are read here, and only here.
"""

from __future__ import annotations

import contextlib
import enum
import re
from typing import Any

from weightstream.errors import (
    ConfigError,
    FormatError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    StorageTimeoutError,
    WeightStreamError,
    redact,
)

__all__ = ["Failure", "classify", "first_line", "to_error"]


class Failure(enum.Enum):
    """What went wrong with a request, as far as retrying is concerned."""

    NO_CREDENTIALS = "no credentials"
    DENIED = "denied"
    NO_BUCKET = "no bucket"
    NOT_FOUND = "not found"
    CHANGED = "changed"
    """The object no longer has the version (ETag) the reads are pinned to."""
    REDIRECT = "redirect"
    """The store sent the request elsewhere (HTTP 3xx): a bucket in another region than the one
    configured, or an endpoint that forwards; asking again gives the same answer."""
    BAD_KEY = "bad key"
    """The store holds (or was asked for) a key the client cannot represent (an empty or a
    ``.`` segment): asking again gives the same answer."""
    THROTTLED = "throttled"
    TIMEOUT = "timeout"
    """No answer within the time allowed (the client's, or our request or metadata timeout)."""
    STALLED = "stalled"
    """The low-speed rule cut a request that moved too little in a window."""
    SHORT = "short"
    """The body ended before the range did: the retry resumes where it stopped."""
    LONG = "long"
    """The body ran past the range: it disagrees with the request, so the range is read whole again."""
    WRONG_RANGE = "wrong range"
    """The store answered another range than the one asked for."""
    TRANSIENT = "transient"
    """A connection reset, a 5xx: worth another attempt."""
    UNKNOWN = "unknown"
    """Not a storage failure (a bug, an interrupt): raised as it is."""

    @property
    def permanent(self) -> bool:
        """Retrying cannot help, and would hammer the store."""
        return self in (
            Failure.NO_CREDENTIALS,
            Failure.DENIED,
            Failure.NO_BUCKET,
            Failure.NOT_FOUND,
            Failure.CHANGED,
            Failure.BAD_KEY,
            Failure.REDIRECT,
        )


_STATUS = re.compile(r"\b([345]\d\d) [A-Z][a-z]")
"""An HTTP status as the client prints it: "404 Not Found", "503 Service Unavailable"."""


_REQUEST_HOST = re.compile(r"Error performing [A-Z]+ (?:[a-z]+://)(?:[^/\s@]*@)?([^/\s?]+)")
"""The host of the request that failed, as the client prints it."""


def redirected_to(exc: BaseException, endpoint: str | None) -> str | None:
    """The host the store redirected a request to, when the failed request (as the client
    prints it) went to another host than the configured ``endpoint`` (the client follows a
    redirect that names where to, and the request there fails: a signature made for the first
    host, a host that does not answer)."""
    if not endpoint:
        return None
    m = _REQUEST_HOST.search(str(exc))
    if m is None:
        return None
    want = _REQUEST_HOST.search(f"Error performing GET {endpoint}")
    return m.group(1) if want is not None and m.group(1).lower() != want.group(1).lower() else None


def classify(exc: BaseException, *, endpoint: str | None = None) -> Failure:
    """The kind of failure ``exc`` is (an obstore exception, an OSError, a timeout).
    ``endpoint``: the configured one (a failed request to another host was redirected)."""
    ex: Any
    try:
        from obstore import exceptions as ex
    except ImportError:  # pragma: no cover - the object-store extra is not installed
        ex = None
    text = str(exc)
    statuses = {int(m) for m in _STATUS.findall(text)}
    if "169.254.169.254" in text or "/latest/api/token" in text:
        return Failure.NO_CREDENTIALS  # the client fell back to instance metadata, and none answered
    if "redirect" in text.lower() or statuses & {301, 302, 303, 307, 308} or redirected_to(exc, endpoint):
        return Failure.REDIRECT
    if (ex is not None and isinstance(exc, ex.PreconditionError)) or 412 in statuses:
        return Failure.CHANGED
    if ex is not None and isinstance(exc, ex.InvalidPathError):
        return Failure.BAD_KEY
    if "NoSuchBucket" in text:
        return Failure.NO_BUCKET
    if (
        (ex is not None and isinstance(exc, ex.NotFoundError))
        or isinstance(exc, FileNotFoundError)
        or 404 in statuses
    ):
        return Failure.NOT_FOUND
    if (
        (ex is not None and isinstance(exc, ex.PermissionDeniedError | ex.UnauthenticatedError))
        or isinstance(exc, PermissionError)
        or statuses & {401, 403}
        or "InvalidAccessKeyId" in text
        or "SignatureDoesNotMatch" in text
    ):
        return Failure.DENIED
    if 429 in statuses or 503 in statuses or "SlowDown" in text:
        return Failure.THROTTLED
    if isinstance(exc, TimeoutError) or "timed out" in first_line(exc).lower():
        return Failure.TIMEOUT
    if (ex is not None and isinstance(exc, ex.BaseError)) or isinstance(
        exc, OSError | RuntimeError | ValueError
    ):
        return Failure.TRANSIENT
    return Failure.UNKNOWN


def scrub(exc: BaseException) -> BaseException:
    """``exc`` and the exceptions it chains, their messages redacted in place (the client prints
    the request's URL, an endpoint's ``user:password@`` included): they stay chained as causes,
    and a traceback must not show a secret either."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not isinstance(e, WeightStreamError):
            with contextlib.suppress(Exception):
                e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
        e = e.__cause__ or e.__context__
    return exc


def to_error(
    exc: BaseException,
    *,
    uri: str,
    byte_range: tuple[int, int] | None,
    what: str,
    endpoint: str | None = None,
    region: str | None = None,
) -> BaseException:
    """The weightstream error for ``exc`` (``exc`` itself if it is one, or not a storage
    failure). ``endpoint`` and ``region``: the store's settings, for a redirect's message."""
    if isinstance(exc, WeightStreamError):
        return exc
    scrub(exc)
    kind = classify(exc, endpoint=endpoint)
    line = first_line(exc)
    if kind is Failure.REDIRECT:
        host = redirected_to(exc, endpoint)
        return ConfigError(
            f"{what}: the store redirected the request"
            + (f" to {host}" if host else "")
            + f" (HTTP 3xx): the bucket is probably in another region than {region or 'the one configured'}; "
            "set AWS_REGION (ObjectStoreConfig.region) to the bucket's region, or the endpoint to the one "
            f"the store names ({line})",
            uri=uri,
            byte_range=byte_range,
            setting="region",
        )
    if kind is Failure.NO_CREDENTIALS:
        return PermissionDeniedError(
            f"{what}: no credentials found (not in the environment, no AWS_PROFILE, and no instance "
            "metadata service answered); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
            "or anonymous=True (WEIGHTSTREAM_S3_ANONYMOUS=1) for a public bucket",
            uri=uri,
            byte_range=byte_range,
        )
    if kind is Failure.CHANGED:
        return FormatError(
            f"{what}: the object changed since its header was read (its ETag no longer matches); "
            "load the checkpoint again",
            uri=uri,
            byte_range=byte_range,
        )
    if kind is Failure.BAD_KEY:
        return ReadError(
            f"{what}: the store holds a key its client cannot address as it is (an empty, '.' or '..' "
            f"segment): {line}",
            uri=uri,
            byte_range=byte_range,
        )
    if kind is Failure.NO_BUCKET:
        return NotFoundError(f"{what}: no such bucket", uri=uri, byte_range=byte_range)
    if kind is Failure.NOT_FOUND:
        return NotFoundError(f"{what}: no such object (or no such bucket)", uri=uri, byte_range=byte_range)
    if kind is Failure.DENIED:
        return PermissionDeniedError(f"{what}: access denied ({line})", uri=uri, byte_range=byte_range)
    if kind is Failure.TIMEOUT:
        return StorageTimeoutError(f"{what}: {line}", uri=uri, byte_range=byte_range)
    if kind in (Failure.TRANSIENT, Failure.THROTTLED):
        return ReadError(f"{what}: {line}", uri=uri, byte_range=byte_range)
    return exc


def first_line(exc: BaseException) -> str:
    text = redact(str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__
