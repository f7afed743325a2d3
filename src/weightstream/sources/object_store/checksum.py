"""An S3 object's own checksum: the one the store keeps with the object, for a load to check the
bytes it reads against (``StreamConfig.verify``), where no manifest gives one.

S3 keeps a checksum with every object uploaded with one (``ChecksumAlgorithm``; the AWS SDKs
send CRC32 by default since 2025) and computes CRC64/NVME for every object uploaded without one
since December 2024. It answers it only to a ``HEAD`` (or a whole-object ``GET``) that asks
(``x-amz-checksum-mode: ENABLED``), never to a ranged ``GET``: so one ``HEAD`` per object, sent
at open for every object at once.

A *full-object* checksum is used as it is: a CRC (CRC64/NVME, CRC32C or CRC32: they combine,
see :mod:`weightstream.format.checksums`) with ``verify="auto"``, and SHA-256 or SHA-1
(single-part uploads) with ``verify="on"`` only: they need the bytes in order, at 1.8 GB/s a
file. A *composite* CRC (a multipart upload's checksum of its parts' checksums, ``...-N``) is
checked by its parts: part 1 and the last are asked for their ranges at open (a ``HEAD
?partNumber=N`` each, at once). Where they show parts of one size (as every common uploader
makes them), the load computes each part's CRC as it reads and checks their composite at the
object's last byte; only where it does not match are the parts asked for their own CRCs, to
name the one that differs. Where they show parts of other sizes (an uploader that sends parts
as its writes come), every part is asked for its range and CRC at open (up to
``_MAX_UNEVEN_PARTS``), and each is checked as it is read. Anything else is not checked, and
the log says why. A multipart object whose answer does not say its checksum's type is taken as composite (that
is what such objects had before full-object types existed), so that it is never checked against
a checksum of something else.

The request is signed with AWS Signature V4 from the standard credential chain (environment,
profile, web identity, container, instance metadata) by ``awscrt``, the chain obstore reads too.
A store that refuses the request, has no checksum or does not answer in ``metadata_timeout``
leaves the object unchecked (with ``verify="on"``, the load refuses it as having none): the
checksum never fails a load that would otherwise succeed.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import http.client
import os
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

from awscrt import checksums as _crt
from zlib_ng import zlib_ng

from weightstream.config import ObjectStoreConfig
from weightstream.localfs import file_version
from weightstream.location import ObjectLocation
from weightstream.sources.base import KnownChecksum

__all__ = ["store_checksum"]

_BITS = {"crc64nvme": 64, "crc32c": 32, "crc32": 32, "sha256": 256, "sha1": 160}
"""The full-object checksums S3 keeps (in the order one is taken where an object had several:
the CRCs, checked as read in any order, first), by their width."""


_none = KnownChecksum.none


def store_checksum(loc: ObjectLocation, oc: ObjectStoreConfig, *, etag: str | None) -> KnownChecksum:
    """The full-object CRC the store keeps for ``loc`` (version ``etag``: asked with
    ``If-Match``, so that a checksum of another version is never used; ``None``: of the
    version there now, which the answer's ``version`` names, for the caller to match)."""
    if loc.scheme != "s3":
        return _none(f"{loc.scheme}:// stores keep no checksum this reads")
    try:
        status, headers = _head(loc, oc, etag)
    except Exception as exc:  # never a load's failure: the object stays unchecked
        return _none(f"its HEAD failed: {type(exc).__name__}: {exc}")
    if status == 412:
        return _none("the object changed since it was opened")
    if status >= 300:
        return _none(f"its HEAD was answered {status}")
    if etag is None:
        etag = headers.get("etag")
        if not etag or etag.startswith("W/"):
            return _none("its HEAD named no version")
    answer = _parse(headers, etag=etag)
    if answer.algorithm is None and answer.composite:  # the parts' checksums: asked for now
        answer = _parts(loc, oc, etag, headers, answer)
    return dataclasses.replace(answer, version=etag)


_COMBINE_PARTS = {"crc64nvme": _crt.crc64nvme, "crc32c": _crt.crc32c, "crc32": zlib_ng.crc32}
"""A composite checksum is the checksum of the parts' checksums (their bytes, big-endian, in
part order): :meth:`weightstream.format.checksums.Algorithm.composite`, which this room may not
import."""
_MAX_UNEVEN_PARTS = 1024
"""Parts of other sizes asked for their ranges and checksums at open (one ``HEAD
?partNumber=`` each, up to 64 at once); an object of more such parts is not checked. Each
``HEAD`` costs about 0.5 ms of this process's CPU (signing, Python's HTTP), so parts of one
size are not asked (see :func:`_parts`)."""
_HEAD_THREADS = (64, 256, 4)
"""Threads asking parts for their checksums: at most 64 an object and 256 in all (the objects
of a checkpoint are asked at once, up to 32), but at least 4 an object."""
_head_threads_used = 0
_head_threads_lock = threading.Lock()


@contextlib.contextmanager
def _head_threads(n: int) -> Iterator[int]:
    """Threads for ``n`` parts' ``HEAD``s, taken from what the process's other asks leave."""
    global _head_threads_used
    most, total, least = _HEAD_THREADS
    with _head_threads_lock:
        k = min(n, max(least, min(most, total - _head_threads_used)))
        _head_threads_used += k
    try:
        yield k
    finally:
        with _head_threads_lock:
            _head_threads_used -= k


def _parse(headers: dict[str, str], *, etag: str | None) -> KnownChecksum:
    kind = headers.get("x-amz-checksum-type", "").upper()
    multipart = "-" in (etag or headers.get("etag", "")).strip('"')
    for name, bits in _BITS.items():
        value = headers.get(f"x-amz-checksum-{name}")
        if value is None:
            continue
        if "-" in value or kind == "COMPOSITE" or (multipart and kind != "FULL_OBJECT"):
            return KnownChecksum(
                None, why=f"composite: its {name} is a multipart upload's checksum of its parts' checksums",
                composite=True,
            )  # fmt: skip
        raw = _decode(value, bits)
        if isinstance(raw, str):
            return _none(f"its {name} {raw}")
        return KnownChecksum(name, raw, origin=f"the store (x-amz-checksum-{name})")
    return _none("the store keeps no checksum for it")


def _decode(value: str, bits: int) -> int | str:
    """A checksum header's value (base64, big-endian), or what is wrong with it."""
    try:
        raw = base64.b64decode(value.partition("-")[0], validate=True)
    except ValueError:
        return f"{value!r} is not base64"
    if len(raw) != bits // 8:
        return f"{value!r} is not {bits} bits"
    return int.from_bytes(raw, "big")


def _parts(
    loc: ObjectLocation,
    oc: ObjectStoreConfig,
    etag: str | None,
    headers: dict[str, str],
    whole: KnownChecksum,
) -> KnownChecksum:
    """A multipart upload's composite checksum, checked by its parts (see the module's text and
    :func:`_by_parts`). Anything else leaves the object unchecked, saying why."""
    tag = (etag or headers.get("etag", "")).strip('"')
    count = tag.rpartition("-")[2]
    if not count.isdigit():
        return whole
    n = int(count)
    name = next(
        (a for a in _BITS if f"x-amz-checksum-{a}" in headers and a in ("crc64nvme", "crc32c", "crc32")), None
    )
    if name is None:
        return whole
    said = _decode(headers[f"x-amz-checksum-{name}"], _BITS[name])
    if isinstance(said, str):
        return _none(f"{whole.why}; its {name} {said}")
    return _by_parts(loc, oc, etag, whole, name, n, said)


def _each_part(
    whole: KnownChecksum, name: str, said: int, ranges: list[tuple[int, int]], crcs: tuple[int, ...]
) -> KnownChecksum:
    """The composite ``said`` by its parts' ranges and checksums (as the store answered them: a
    piece each, of whatever size), where they give it; else the object unchecked, saying why."""
    width = _BITS[name] // 8
    composite = int(_COMBINE_PARTS[name](b"".join(c.to_bytes(width, "big") for c in crcs)))
    if said != composite:  # the parts' checksums are not the ones the object's composite is of
        return _none(f"{whole.why}; its parts' {name}s do not give its composite {said!r}")
    return KnownChecksum(
        name,
        composite,
        origin=f"the store (x-amz-checksum-{name} of each of {len(crcs)} parts)",
        piece_size=max(b - a for a, b in ranges),
        pieces=crcs,
        bounds=tuple(a for a, _ in ranges),
    )


def _part_checksums(
    loc: ObjectLocation, oc: ObjectStoreConfig, etag: str | None, name: str, n: int
) -> tuple[list[tuple[int, int]], tuple[int, ...]] | str:
    """Each of the ``n`` parts' byte range ``[start, end)`` and checksum (one ``HEAD
    ?partNumber=`` each, as many at once as :func:`_head_threads` gives), where the ranges
    follow one another from the object's first byte to its last; else why not."""
    try:
        answers = _part_heads(loc, oc, etag, list(range(1, n + 1)))
    except Exception as exc:
        return f"a part's HEAD failed: {type(exc).__name__}: {exc}"
    ranges, crcs = [], []
    end, total = 0, ""
    for i, (status, h) in enumerate(answers, 1):
        rng = _range(h)
        value = h.get(f"x-amz-checksum-{name}")
        crc = _decode(value, _BITS[name]) if value is not None else "missing"
        if status >= 300 or rng is None or isinstance(crc, str):
            return f"part {i} was answered {status} without its range or {name}"
        if rng[0] != end or rng[1] <= rng[0]:
            return f"part {i}'s range {rng[0]}-{rng[1]} does not follow part {i - 1}'s end ({end})"
        end, total = rng[1], h.get("content-range", "").rpartition("/")[2]
        ranges.append(rng)
        crcs.append(crc)
    if total != str(end):
        return f"its parts end at byte {end}, the object at {total or 'an unknown size'}"
    return ranges, tuple(crcs)


def _part_heads(
    loc: ObjectLocation, oc: ObjectStoreConfig, etag: str | None, parts: list[int]
) -> list[tuple[int, dict[str, str]]]:
    """``HEAD ?partNumber=`` of each of ``parts``, as many at once as :func:`_head_threads`
    gives, each thread on a connection it keeps for its next: the answers, in order."""
    from concurrent.futures import ThreadPoolExecutor

    kept = _Kept()
    try:
        with (
            _head_threads(len(parts)) as workers,
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightstream-head") as pool,
        ):
            return list(pool.map(lambda i: _head(loc, oc, etag, part=i, kept=kept), parts))
    finally:
        kept.close()


def _range(headers: dict[str, str]) -> tuple[int, int] | None:
    """A part's byte range ``[start, end)`` from its ``Content-Range``."""
    first, _, rest = headers.get("content-range", "").removeprefix("bytes ").partition("-")
    last = rest.partition("/")[0]
    return (int(first), int(last) + 1) if first.isdigit() and last.isdigit() else None


def _by_parts(
    loc: ObjectLocation,
    oc: ObjectStoreConfig,
    etag: str | None,
    whole: KnownChecksum,
    name: str,
    n: int,
    said: int,
) -> KnownChecksum:
    """A composite of ``n`` parts: part 1 and the last are asked for their ranges (two
    ``HEAD``s, at once). Where they show parts of part 1's size, the load computes each such
    piece's checksum and checks their composite at the file's last byte; where it does not
    match, the parts are asked for theirs then
    (:attr:`~weightstream.format.manifest.FileDigest.confirm`), to name the piece that
    differs, or to leave the object unchecked where the parts between were of other sizes
    after all. Where they show other sizes, every part is asked for its range and checksum now
    (up to ``_MAX_UNEVEN_PARTS``), a piece each, checked as read (:func:`_each_part`).

    Not every part at open where they are of one size: a ``HEAD`` costs about 0.5 ms of CPU
    here and a round trip, against 33 ms to read an 8 MiB part at 2 Gbit/s and 0.2 ms at 400:
    asking 51 parts of each of five shards cost a 2 GB load's open 0.16-0.26 s on the emulated
    store, asking two 0.03-0.07 s (one round trip; bench/RESULTS.md)."""
    try:
        answers = _part_heads(loc, oc, etag, sorted({1, n}))
    except Exception as exc:
        return _none(f"{whole.why}; a part's HEAD failed: {type(exc).__name__}: {exc}")
    (status, h), (last_status, last) = answers[0], answers[-1]
    rng, last_rng = _range(h), _range(last)
    total = h.get("content-range", "").rpartition("/")[2]
    if status >= 300 or rng is None or rng[0] != 0 or not total.isdigit():
        return _none(f"{whole.why}; part 1 was answered {status} without its range")
    if last_status >= 300 or last_rng is None:
        return _none(f"{whole.why}; part {n} was answered {last_status} without its range")
    size, length = rng[1], int(total)
    if last_rng != ((n - 1) * size, length) or not (n - 1) * size < length <= n * size:
        if n > _MAX_UNEVEN_PARTS:
            return _none(
                f"{whole.why}; its {n} parts are not all of part 1's size ({size} bytes), and only "
                f"up to {_MAX_UNEVEN_PARTS} such parts are asked for their checksums"
            )
        parts = _part_checksums(loc, oc, etag, name, n)
        return (
            _none(f"{whole.why}; {parts}")
            if isinstance(parts, str)
            else _each_part(whole, name, said, *parts)
        )

    def confirm() -> tuple[int, ...] | str:
        parts = _part_checksums(loc, oc, etag, name, n)
        if isinstance(parts, str):
            return parts
        ranges, crcs = parts
        return (
            crcs
            if all(a == i * size for i, (a, _) in enumerate(ranges))
            else "its parts are not all of part 1's size"
        )

    return KnownChecksum(
        name,
        said,
        origin=f"the store (x-amz-checksum-{name}, the composite of {n} parts)",
        piece_size=size,
        composite=True,
        confirm=confirm,
    )


class _Kept:
    """The connection each thread keeps for its next ``HEAD``s of one ask (a part's ``HEAD``
    then costs no connect, nor TLS handshake); all of them closed when the ask is done."""

    def __init__(self) -> None:
        self._mine = threading.local()
        self._every: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    @property
    def conn(self) -> http.client.HTTPConnection | None:
        return getattr(self._mine, "conn", None)

    def keep(self, conn: http.client.HTTPConnection) -> None:
        self._mine.conn = conn
        with self._lock:
            self._every.append(conn)

    def close(self) -> None:
        with self._lock:
            every, self._every = self._every, []
        for conn in every:
            conn.close()


def _head(
    loc: ObjectLocation, oc: ObjectStoreConfig, etag: str | None, *, part: int = 0, kept: _Kept | None = None
) -> tuple[int, dict[str, str]]:
    """``HEAD`` of the object (``part``: of that part of a multipart upload) asking for its
    checksum: the status and headers (names lower-case). ``kept``: on the connection this
    thread kept (once more on a new one where the server had closed it), and kept open."""
    region = oc.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    key = urllib.parse.quote(loc.key, safe="-_.~/")
    if oc.endpoint:
        host, tls, prefix = _split(oc.endpoint)
        if oc.addressing == "virtual":
            host = f"{loc.bucket}.{host}"
            path = f"{prefix}/{key}"
        else:
            path = f"{prefix}/{urllib.parse.quote(loc.bucket)}/{key}"
    elif oc.addressing == "path":
        host, tls, path = f"s3.{region}.amazonaws.com", True, f"/{urllib.parse.quote(loc.bucket)}/{key}"
    else:
        host, tls, path = f"{loc.bucket}.s3.{region}.amazonaws.com", True, f"/{key}"
    if part:
        path += f"?partNumber={part}"
    headers = [("host", host), ("x-amz-checksum-mode", "ENABLED")]
    if etag:
        headers.append(("if-match", etag))
    if not oc.anonymous:
        headers = _signed("HEAD", path, headers, region, timeout=oc.metadata_timeout)
    held = kept.conn if kept is not None else None
    conn = held if held is not None else _connect(host, tls, oc)
    if kept is not None and held is None:
        kept.keep(conn)

    def ask() -> tuple[int, dict[str, str]]:
        conn.request("HEAD", path, headers=dict(headers))
        answer = conn.getresponse()
        answer.read()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}

    try:
        try:
            return ask()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if held is None:
                raise
            conn.close()  # the server closed the kept connection while it was idle: once more
            return ask()
    except BaseException:
        conn.close()  # a kept one opens anew at its next request
        raise
    finally:
        if kept is None:
            conn.close()


def _connect(host: str, tls: bool, oc: ObjectStoreConfig) -> http.client.HTTPConnection:
    if tls:
        context = _tls_context(oc.ca_bundle, file_version(oc.ca_bundle))
        return http.client.HTTPSConnection(host, timeout=oc.metadata_timeout, context=context)
    return http.client.HTTPConnection(host, timeout=oc.metadata_timeout)


@functools.lru_cache(maxsize=4)
def _tls_context(ca_bundle: str | None, version: object) -> ssl.SSLContext:
    """One TLS context a CA bundle and its ``version`` (:func:`file_version`: a bundle rewritten
    in place, or replaced, is read again). Building one reads the bundle: milliseconds, not
    per request."""
    return ssl.create_default_context(cafile=ca_bundle)


@functools.lru_cache(maxsize=16)
def _split(endpoint: str) -> tuple[str, bool, str]:
    """An endpoint URL's host (and port), whether it is TLS, and its path (parsed once)."""
    base = urllib.parse.urlsplit(endpoint)
    return base.netloc, base.scheme == "https", base.path.rstrip("/")


_CHAIN: list[object] = []
_CHAIN_LOCK = threading.Lock()


def _provider() -> Any:
    """Keys in the environment as they are now (a test, or a process, may change them); else
    the standard chain, one per process (it caches and refreshes what it fetched)."""
    from awscrt import auth

    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return auth.AwsCredentialsProvider.new_static(
            key, secret, os.environ.get("AWS_SESSION_TOKEN") or None
        )
    with _CHAIN_LOCK:
        if not _CHAIN:
            _CHAIN.append(auth.AwsCredentialsProvider.new_default_chain())
        return _CHAIN[0]


def _signed(
    method: str, path: str, headers: list[tuple[str, str]], region: str, *, timeout: float
) -> list[tuple[str, str]]:
    """``headers`` with an AWS Signature V4 (awscrt's)."""
    from awscrt import auth
    from awscrt.http import HttpHeaders, HttpRequest

    config = auth.AwsSigningConfig(
        algorithm=auth.AwsSigningAlgorithm.V4,
        signature_type=auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
        credentials_provider=_provider(),
        region=region,
        service="s3",
        signed_body_value=auth.AwsSignedBodyValue.EMPTY_SHA256,
        signed_body_header_type=auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
    )
    request = HttpRequest(method, path, HttpHeaders(headers))
    signed = auth.aws_sign_request(request, config).result(timeout)
    return list(signed.headers)
