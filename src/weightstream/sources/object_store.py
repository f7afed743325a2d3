"""S3 and S3-compatible stores, GCS and Azure: ranged GETs through obstore (Rust object_store).

Why obstore: its requests run in Rust with the GIL released, a ranged GET returns a buffer-protocol
``Bytes`` (one copy into the destination, no ``bytes`` object), and it reads the standard
configuration (``AWS_*`` variables, web identity, instance metadata) itself. It is imported here
only, so a user of local files never needs it (``pip install weightstream[s3]``).

Every response's length is checked against the request; a short or failed body is read again
whole, into the same place.
"""

from __future__ import annotations

import logging
import os
import posixpath
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from weightstream.config import StreamConfig
from weightstream.errors import (
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    StorageTimeoutError,
    WeightStreamError,
)
from weightstream.sources.base import ReadHow

__all__ = ["ObjectLocation", "ObjectSource", "list_objects", "parse_object_uri"]

log = logging.getLogger(__name__)

SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
T = TypeVar("T")


@dataclass(frozen=True)
class ObjectLocation:
    scheme: str
    bucket: str
    key: str
    """Object key, or a prefix without a trailing slash ('' for the bucket root)."""

    def uri(self, key: str | None = None) -> str:
        k = self.key if key is None else key
        return f"{self.scheme}://{self.bucket}/{k}"


def parse_object_uri(uri: str) -> ObjectLocation | None:
    """``s3://bucket/key`` -> location; ``None`` for anything that is not an object-store URI."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in SCHEMES:
        return None
    if not parsed.netloc:
        raise ConfigError("object-store URI has no bucket", uri=uri)
    return ObjectLocation(parsed.scheme, parsed.netloc, urllib.parse.unquote(parsed.path).strip("/"))


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
        try:
            with open(oc.ca_bundle, "rb") as fh:
                client["root_certificate"] = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read the CA bundle: {exc.strerror}", uri=oc.ca_bundle) from None
    retry: dict[str, Any] = {
        "max_retries": oc.max_attempts - 1,
        "backoff": {
            "init_backoff": timedelta(seconds=oc.backoff_initial),
            "max_backoff": timedelta(seconds=oc.backoff_max),
            "base": 2,
        },
        "retry_timeout": timedelta(seconds=oc.request_timeout * oc.max_attempts),
    }
    try:
        store = from_url(f"{loc.scheme}://{loc.bucket}", client_options=client, retry_config=retry, **kwargs)
    except Exception as exc:
        raise ConfigError(f"cannot configure the object store: {exc}", uri=loc.uri("")) from None
    _STORES[key] = store
    return store


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
    if "NoSuchBucket" in text:
        return NotFoundError(f"{what}: no such bucket", uri=uri, byte_range=byte_range)
    # obstore maps 404/403 on GET and HEAD to its own classes, but not on LIST: read the status.
    if isinstance(exc, ex.NotFoundError | FileNotFoundError) or "404 Not Found" in text:
        return NotFoundError(f"{what}: no such object (or no such bucket)", uri=uri, byte_range=byte_range)
    if (
        isinstance(exc, ex.PermissionDeniedError | ex.UnauthenticatedError | PermissionError)
        or "403 Forbidden" in text
        or "401 Unauthorized" in text
    ):
        return PermissionDeniedError(f"{what}: access denied ({first_line})", uri=uri, byte_range=byte_range)
    if isinstance(exc, TimeoutError) or "timed out" in first_line.lower():
        return StorageTimeoutError(reason, uri=uri, byte_range=byte_range)
    if isinstance(exc, ex.BaseError | OSError | RuntimeError | ValueError):
        return ReadError(reason, uri=uri, byte_range=byte_range)
    return exc


def _call(fn: Callable[[], T], *, uri: str, byte_range: tuple[int, int] | None, what: str) -> T:
    try:
        return fn()
    except Exception as exc:
        raise _map_error(exc, uri=uri, byte_range=byte_range, what=what) from exc


def list_objects(loc: ObjectLocation, config: StreamConfig) -> dict[str, int]:
    """Keys directly under ``loc.key`` (a prefix) -> size."""
    obstore = _obstore()
    store = make_store(loc, config)
    prefix = loc.key + "/" if loc.key else ""

    def run() -> dict[str, int]:
        found = obstore.list_with_delimiter(store, prefix or None)
        return {o["path"]: int(o["size"]) for o in found["objects"]}

    return _call(run, uri=loc.uri(), byte_range=None, what="cannot list")


class ObjectSource:
    """One object, read with ranged GETs (see the module docstring)."""

    def __init__(self, loc: ObjectLocation, config: StreamConfig, *, size: int | None = None) -> None:
        self._obstore = _obstore()
        self.loc = loc
        self.uri = loc.uri()
        self._store = make_store(loc, config)
        self._attempts = config.object_store.max_attempts
        if size is None:
            meta = _call(
                lambda: self._obstore.head(self._store, loc.key),
                uri=self.uri,
                byte_range=None,
                what="cannot open",
            )
            size = int(meta["size"])
        self.size = size

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

    def _get_into(self, buf: memoryview, offset: int, expected: int) -> None:
        rng = (offset, offset + expected)
        got_bytes = 0
        for attempt in range(1, self._attempts + 1):
            try:
                data = self._obstore.get_range(self._store, self.loc.key, start=offset, end=offset + expected)
            except Exception as exc:
                # obstore has already retried what is worth retrying (5xx, resets, timeouts) with
                # backoff, up to max_attempts; not-found and access denied are never retried.
                raise _map_error(
                    exc,
                    uri=self.uri,
                    byte_range=rng,
                    what=f"GET failed after up to {self._attempts} attempts",
                ) from exc
            got = memoryview(data)
            if got.nbytes != expected:
                got_bytes = got.nbytes
                log.debug("%s bytes %d-%d: short response on attempt %d", self.uri, *rng, attempt)
                continue
            buf[:expected] = got  # the one copy: client buffer -> destination
            return
        raise ReadError(
            f"every response had the wrong length (last: {got_bytes} bytes for {expected} requested; "
            f"{self._attempts} attempts)",
            uri=self.uri,
            byte_range=rng,
        )

    def close(self) -> None:
        pass


def join_key(prefix: str, name: str) -> str:
    return posixpath.normpath(posixpath.join(prefix, name)) if prefix else posixpath.normpath(name)
