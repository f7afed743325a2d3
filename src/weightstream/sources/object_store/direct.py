"""The one-copy transport: ranged GETs to a plain-HTTP S3-compatible endpoint, each body received
by the kernel straight into the destination's memory.

obstore receives a body into its own buffers and the engine copies each piece out of them: two
copies per byte, and a hand-over from the event loop to the placing thread per piece. On this
path a blocking socket receives the whole range with one ``recv_into(..., MSG_WAITALL)`` into
the tensor's memory (the kernel's copy is the only one), woken every ``_TICK`` seconds by
``SO_RCVTIMEO`` so that the low-speed rule sees progress and an aborted transfer ends; Python
runs per request and per tick, never per piece. Requests are signed with AWS Signature V4 (the
standard library's ``hmac``), connections are kept alive and reused.

It is used where it can do everything obstore does for a GET (:func:`transport_for`): an
``s3://`` location, a custom ``http://`` endpoint with path-style addressing (in-cluster MinIO,
Ceph RGW, VAST, ...), and keys in the environment or unsigned requests. TLS endpoints, AWS
itself, and credentials the client must fetch (web identity, instance metadata, profiles) keep
obstore. The request state machine (retries, the low-speed rule, hedges, the version pin) is the
one in :mod:`.source`; this module only moves bytes and says what the store answered.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import http
import os
import queue
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weightstream import _process
from weightstream.config import ObjectStoreConfig
from weightstream.errors import ConfigError
from weightstream.location import ObjectLocation

__all__ = ["Answer", "DirectS3", "Get", "StoreAnswer", "Transfer", "transport_for"]

_TICK = 0.25
"""Seconds a receive blocks at most before it returns what it has (``SO_RCVTIMEO``)."""
_HEAD_MAX = 64 << 10
"""Bytes of response headers (and of an error answer's body) read at most."""
_HEAD_READ = 4 << 10
"""Bytes looked at a time while the headers come in (an S3 answer's headers fit in under
1 KiB). The headers are peeked at and then taken exactly (:meth:`DirectS3._receive_head`), so
no byte of a body ever passes through Python: every one is received by ``recv_into`` with the
GIL released. A body's first bytes copied out of the header buffer, as before, were the
process's largest GIL holder (the copy is the first touch of fresh tensor memory: a page
fault, with the GIL held)."""
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNRESERVED = "-_.~/"


class StoreAnswer(RuntimeError):
    """The store answered with an error status; the message reads like obstore's
    (``HTTP 404 Not Found: NoSuchKey ...``), so one classifier serves both transports."""

    def __init__(self, status: int, reason: str, body: bytes) -> None:
        self.status = status
        detail = body[:2000].decode("utf-8", "replace")
        code = _xml_field(detail, "Code")
        message = _xml_field(detail, "Message")
        # The status's standard phrase, whatever the server spelled (werkzeug: "NOT FOUND"): the
        # classifier reads "404 Not Found" as obstore prints it.
        phrase = _phrase(status) if _phrase(status) != "Unknown" else reason
        text = f"HTTP {status} {phrase}" + (f": {code}" if code else "") + (f": {message}" if message else "")
        super().__init__(text)


def _xml_field(text: str, name: str) -> str:
    start = text.find(f"<{name}>")
    end = text.find(f"</{name}>", start)
    return text[start + len(name) + 2 : end].strip() if start >= 0 and end > start else ""


@dataclass(frozen=True)
class Answer:
    """What the store said about a range before its body: checked by the caller before a byte of
    the body is written."""

    status: int
    first: int
    """The range's first byte, as ``Content-Range`` gives it."""
    end: int
    """One past its last byte."""
    etag: str | None


@dataclass(eq=False)
class Transfer:
    """One GET on a thread of the transport: abortable from any thread (its connection is shut
    down, which wakes the receive at once), and known to have ended (``done``): no byte is
    written into the destination after ``done`` is set."""

    deadline: float
    """``time.monotonic()`` after which the transfer ends by itself (the request timeout)."""
    done: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    _sock: socket.socket | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            aborted = self.aborted
        if aborted and sock is not None:
            self.abort()


@dataclass(frozen=True)
class Get:
    """One ranged GET for the transport: bytes ``rng`` (``[first, end)``) of ``key`` into
    ``dest`` (``len(dest)`` is the range's length). ``on_answer`` sees the status, range and ETag
    before the body and may raise to refuse it; ``on_bytes`` is told of the bytes received, at
    most once a tick."""

    key: str
    rng: tuple[int, int]
    dest: memoryview
    transfer: Transfer
    if_match: str | None
    on_answer: Callable[[Answer], None]
    on_bytes: Callable[[int], None]


class Aborted(Exception):
    """The transfer was aborted (a timer of the request machine, a hedge won, the load ended)."""


@dataclass(frozen=True)
class _Credentials:
    key: str
    secret: str
    token: str | None


class DirectS3:
    """One endpoint: its address, the request signer and the pool of kept-alive connections."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        base_path: str,
        bucket: str,
        region: str,
        credentials: _Credentials | None,
        connect_timeout: float,
    ) -> None:
        self.host, self.port, self.bucket, self.region = host, port, bucket, region
        self.base_path = base_path.rstrip("/")
        name = f"[{host}]" if ":" in host else host  # an IPv6 address, as URLs and Host spell it
        self.host_header = name if port == 80 else f"{name}:{port}"
        self.credentials = credentials
        self.connect_timeout = connect_timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._keys: dict[str, bytes] = {}
        self._paths: dict[str, str] = {}

    # -- signing -------------------------------------------------------------------------------

    def path(self, key: str) -> str:
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = urllib.parse.quote(
                f"{self.base_path}/{self.bucket}/{key}", safe=_UNRESERVED
            )
        return path

    def headers(
        self, key: str, rng: tuple[int, int], *, if_match: str | None, now: float
    ) -> list[tuple[str, str]]:
        """The request's headers, signed (AWS Signature V4, every header sent is signed)."""
        headers = [("host", self.host_header), ("range", f"bytes={rng[0]}-{rng[1] - 1}")]
        if if_match:
            headers.append(("if-match", if_match))
        if self.credentials is None:
            return headers
        stamp = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        headers += [("x-amz-content-sha256", _EMPTY_SHA256), ("x-amz-date", stamp)]
        if self.credentials.token:
            headers.append(("x-amz-security-token", self.credentials.token))
        headers.sort()
        names = ";".join(n for n, _ in headers)
        canonical = "\n".join(
            [
                "GET",
                self.path(key),
                "",
                *(f"{n}:{' '.join(v.split())}" for n, v in headers),
                "",
                names,
                _EMPTY_SHA256,
            ]
        )
        scope = f"{stamp[:8]}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(stamp[:8]), to_sign.encode(), hashlib.sha256).hexdigest()
        headers.append(
            (
                "authorization",
                f"AWS4-HMAC-SHA256 Credential={self.credentials.key}/{scope}, "
                f"SignedHeaders={names}, Signature={signature}",
            )
        )
        return headers

    def _signing_key(self, day: str) -> bytes:
        key = self._keys.get(day)
        if key is None:
            assert self.credentials is not None
            key = f"AWS4{self.credentials.secret}".encode()
            for part in (day, self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._keys = {day: key}
        return key

    # -- connections ---------------------------------------------------------------------------

    def _kept(self) -> socket.socket | None:
        """A kept-alive connection, if there is one (the store may have closed it meanwhile)."""
        with self._lock:
            return self._idle.pop() if self._idle else None

    def _dial(self) -> socket.socket:
        """A new connection."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"connect to {self.host_header} timed out after {self.connect_timeout:g} s"
            ) from None
        sock.settimeout(None)
        tick = struct.pack("ll", int(_TICK), int((_TICK % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tick)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tick)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def forget(self) -> None:
        """Drop every kept connection without shutting it down (after ``fork()`` they are the
        parent's too)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- one GET -------------------------------------------------------------------------------

    def get_into(self, get: Get) -> None:
        """Bytes ``get.rng`` of ``get.key`` into ``get.dest``, on the calling thread (see :class:`Get`).
        Returns only with every byte received; anything else raises.

        The GET goes on a kept connection if there is one; if the store had closed it (no
        answer at all), once more on a new connection, never on another kept one (a kept
        connection released meanwhile by another transfer may be just as closed)."""
        transfer = get.transfer
        try:
            if transfer.aborted:  # aborted before this thread took it up
                raise Aborted()
            sock = self._kept()
            if sock is not None:
                try:
                    self._get_on(sock, get)
                    return
                except _NoAnswer:
                    if transfer.aborted:
                        raise Aborted() from None
                    self._drop_kept()  # a closed kept connection: the others may be too
            try:
                self._get_on(self._dial(), get)
            except _NoAnswer:
                if transfer.aborted:
                    raise Aborted() from None
                raise ConnectionResetError(
                    f"{self.host_header} closed the connection without an answer"
                ) from None
        finally:
            transfer.done.set()

    def _get_on(self, sock: socket.socket, get: Get) -> None:
        """The GET on ``sock``, which it keeps for the next GET where the answer allows, and
        closes on any failure (``_NoAnswer``: the connection gave no answer at all)."""
        get.transfer.attach(sock)
        try:
            keep = self._exchange(sock, get)
        except BaseException:
            sock.close()
            raise
        get.transfer.attach(None)
        if keep:
            self._release(sock)
        else:
            sock.close()

    def _drop_kept(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    def _exchange(self, sock: socket.socket, get: Get) -> bool:
        """One request and its answer on ``sock``; ``True`` if the connection may be kept."""
        key, rng, dest, transfer = get.key, get.rng, get.dest, get.transfer
        lines = [f"GET {self.path(key)} HTTP/1.1"]
        lines += [f"{n}: {v}" for n, v in self.headers(key, rng, if_match=get.if_match, now=time.time())]
        lines.append("user-agent: weightstream")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode()
        try:
            sock.sendall(request)
        except OSError as exc:
            raise _NoAnswer() from exc
        status, reason, headers = self._read_head(sock, transfer)
        if status >= 300:
            raise StoreAnswer(status, reason, self._error_body(sock, headers, transfer))
        length = headers.get("content-length")
        if length is None or not length.isdigit():
            raise StoreAnswer(
                502,
                "Bad Gateway",
                b"<Message>an answer without Content-Length (chunked?): not a ranged GET</Message>",
            )
        n = int(length)
        first, end = _content_range(headers.get("content-range"), status, n)
        get.on_answer(Answer(status, first, end, headers.get("etag")))
        if n != len(dest):  # on_answer refuses another range; a length that disagrees is refused here
            raise StoreAnswer(
                502, "Bad Gateway", f"<Message>{n} bytes answered for {len(dest)}</Message>".encode()
            )
        got = 0
        while got < n:
            try:
                k = sock.recv_into(dest[got:], n - got, socket.MSG_WAITALL)
            except (BlockingIOError, InterruptedError):
                k = -1  # a tick with nothing received
            except OSError as exc:
                if transfer.aborted:
                    raise Aborted() from exc
                raise
            if k == 0:
                if transfer.aborted:
                    raise Aborted()
                raise ConnectionResetError(
                    f"{self.host_header} closed the connection after {got} of {n} bytes"
                )
            if k > 0:
                got += k
                get.on_bytes(k)
            if transfer.aborted:
                raise Aborted()
            if got < n and time.monotonic() > transfer.deadline:
                raise TimeoutError(f"request timed out with {got} of {n} bytes received")
        return headers.get("connection", "").lower() != "close"

    def _read_head(self, sock: socket.socket, transfer: Transfer) -> tuple[int, str, dict[str, str]]:
        """The answer's status, reason and headers (lower-case names); the socket is left at
        the body's first byte."""
        head = self._receive_head(sock, transfer).decode("latin-1").split("\r\n")
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise StoreAnswer(
                502, "Bad Gateway", f"<Message>not an HTTP answer: {head[0][:80]!r}</Message>".encode()
            )
        status = int(parts[1])
        reason = parts[2].strip() if len(parts) > 2 and parts[2].strip() else _phrase(status)
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if parts[0] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        return status, reason, headers

    def _receive_head(self, sock: socket.socket, transfer: Transfer) -> bytes:
        """The answer's status line and headers, without the blank line that ends them: what has
        arrived is peeked at (``MSG_PEEK``) and only header bytes are taken off the socket, so
        the body is left whole for ``recv_into``. A peek that finds no end of the headers takes
        what it saw (all header bytes) before it looks again: it never spins on the same bytes."""
        buf = bytearray()
        while True:
            try:
                chunk = sock.recv(_HEAD_READ, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                chunk = None
            except OSError as exc:
                if transfer.aborted:
                    raise Aborted() from exc
                if not buf:
                    raise _NoAnswer() from exc
                raise
            if transfer.aborted:
                raise Aborted()
            if chunk == b"":
                if not buf:
                    raise _NoAnswer()
                raise ConnectionResetError(f"{self.host_header} closed the connection inside the headers")
            if chunk is None:
                if time.monotonic() > transfer.deadline:
                    raise TimeoutError("request timed out before the store answered")
                continue
            tail = buf[-3:]  # the end of the headers may straddle what was taken and what is new
            end = (tail + chunk).find(b"\r\n\r\n")
            take = len(chunk) if end < 0 else end + 4 - len(tail)
            buf += _take(sock, take)
            if len(buf) > _HEAD_MAX:
                raise StoreAnswer(502, "Bad Gateway", b"<Message>response headers too long</Message>")
            if end >= 0:
                return bytes(buf[:-4])

    def _error_body(self, sock: socket.socket, headers: dict[str, str], transfer: Transfer) -> bytes:
        """The error answer's body (S3's XML ``<Code>``), bounded: the connection is not reused."""
        length = headers.get("content-length", "")
        if not length.isdigit():  # (chunked, or up to the close): what has arrived with the headers
            with contextlib.suppress(OSError):
                return sock.recv(_HEAD_MAX, socket.MSG_DONTWAIT)
            return b""
        want = min(int(length), _HEAD_MAX)
        body = bytearray()
        deadline = min(transfer.deadline, time.monotonic() + 2.0)
        while len(body) < want and time.monotonic() < deadline and not transfer.aborted:
            try:
                chunk = sock.recv(want - len(body))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                break
            if not chunk:
                break
            body += chunk
        return bytes(body)


def _take(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes that a peek has just seen on ``sock`` (they are there: nothing else reads it)."""
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) != n:  # pragma: no cover - the kernel keeps what a peek saw
        raise ConnectionResetError(f"the connection lost {n - len(data)} bytes it had received")
    return data


class _NoAnswer(Exception):
    """The connection ended before one byte of an answer."""


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _content_range(value: str | None, status: int, length: int) -> tuple[int, int]:
    """``(first, end)`` of the answered range: from ``Content-Range`` (``bytes a-b/total``), or
    the whole object for a 200 without one."""
    if value is None:
        if status == 200:
            return 0, length
        raise StoreAnswer(502, "Bad Gateway", b"<Message>a partial answer without Content-Range</Message>")
    unit, _, spec = value.partition(" ")
    span, _, _total = spec.partition("/")
    a, _, b = span.partition("-")
    if unit != "bytes" or not a.isdigit() or not b.isdigit():
        raise StoreAnswer(502, "Bad Gateway", f"<Message>a Content-Range of {value!r}</Message>".encode())
    return int(a), int(b) + 1


# -- which locations take this path ----------------------------------------------------------

_ENDPOINTS: dict[tuple[object, ...], DirectS3 | str] = {}
"""By (scheme, bucket, settings, keys, proxy variables): the endpoint, or why the transport
cannot serve it."""
_AUTO = "direct"
"""What ``transport="auto"`` picks where this transport can serve (the tests run their fault
suites with both)."""


def transport_for(loc: ObjectLocation, oc: ObjectStoreConfig) -> DirectS3 | None:
    """The one-copy transport for ``loc``, or ``None`` where obstore is used (see the module
    docstring; ``oc.transport``: ``"auto"`` decides, ``"obstore"`` never, ``"direct"`` always, or
    a :class:`ConfigError` saying why it cannot). Decided once per bucket, settings and keys."""
    if oc.transport == "obstore" or (oc.transport == "auto" and _AUTO == "obstore"):
        return None
    keys = tuple(os.environ.get(k) or None for k in _KEY_VARS)
    proxies = tuple((k, v) for k, v in sorted(os.environ.items()) if k.lower().endswith("_proxy"))
    cache_key = (loc.scheme, loc.bucket, oc, keys, proxies)
    if cache_key not in _ENDPOINTS:
        _ENDPOINTS[cache_key] = _endpoint(loc, oc, keys)
    endpoint = _ENDPOINTS[cache_key]
    if isinstance(endpoint, str):
        if oc.transport == "direct":
            raise ConfigError(
                f"transport='direct' cannot read this object: {endpoint}", uri=loc.uri, setting="transport"
            )
        return None
    return endpoint


_KEY_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _endpoint(loc: ObjectLocation, oc: ObjectStoreConfig, keys: tuple[str | None, ...]) -> DirectS3 | str:
    """The endpoint for ``loc``, or why this transport cannot serve it."""
    why = _unsuitable(loc, oc, keys)
    if why:
        return why
    assert oc.endpoint is not None
    base = urllib.parse.urlsplit(oc.endpoint)
    credentials = None if oc.anonymous else _Credentials(keys[0] or "", keys[1] or "", keys[2])
    return DirectS3(
        host=base.hostname or "",
        port=base.port or 80,
        base_path=base.path,
        bucket=loc.bucket,
        region=oc.region or "us-east-1",
        credentials=credentials,
        connect_timeout=oc.connect_timeout,
    )


def _unsuitable(loc: ObjectLocation, oc: ObjectStoreConfig, keys: tuple[str | None, ...]) -> str:
    if loc.scheme != "s3":
        return f"it is on {loc.scheme}://, the transport speaks S3 only"
    if not oc.endpoint or not oc.endpoint.startswith("http://"):
        return "it needs a plain http:// endpoint (TLS and AWS itself use obstore)"
    base = urllib.parse.urlsplit(oc.endpoint)
    if base.username or base.password or base.query or not base.hostname:
        return "the endpoint has credentials, a query or no host in it"
    if oc.addressing == "virtual":
        return "it sends path-style requests only"
    if _proxied(base.hostname):
        return "an HTTP proxy is set for the endpoint (HTTP_PROXY / ALL_PROXY, not bypassed by NO_PROXY)"
    if not oc.anonymous and not (keys[0] and keys[1]):
        return "it signs with keys from the environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
    return ""


def _proxied(host: str) -> bool:
    """Whether the environment sends plain-HTTP requests to ``host`` through a proxy (as obstore's
    client and every other HTTP client here would): this transport connects directly, so it
    stands aside there."""
    import urllib.request

    proxies = urllib.request.getproxies_environment()
    if not (proxies.get("http") or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(host)


# -- the threads transfers run on --------------------------------------------------------------


_Done = Callable[[BaseException | None], None]
"""What a job's thread calls with its outcome: ``None``, or what the job raised."""
_Job = tuple[Callable[[Any], None], Any, _Done]


class _Threads:
    """Daemon threads for transfers, one per transfer in flight, started as needed and kept for
    the process (a load's depth is the number of transfers, bounded by the engine's concurrency).
    Daemon threads, unlike ``concurrent.futures``' pool, which joins its threads when the
    interpreter exits: a process that exits mid-load never waits for a transfer to end.

    A job is a function, its argument and what to call with its outcome, on the thread that ran
    it: no future per job (the request machine settles its own on its loop)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0

    def run(self, fn: Callable[[Any], None], arg: Any, done: _Done) -> None:
        """``fn(arg)`` on a thread of the pool, then ``done(None)``, or ``done(exc)`` if it raised."""
        with self._lock:
            start = self._idle == 0
            if start:
                self._started += 1
            else:
                self._idle -= 1
        self._jobs.put((fn, arg, done))
        if start:
            threading.Thread(target=self._run, name=f"weightstream-http-{self._started}", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, arg, done = self._jobs.get()
            try:
                fn(arg)
            except BaseException as exc:
                done(exc)
                del exc
            else:
                done(None)
            del fn, arg, done  # nothing of a finished transfer is kept
            with self._lock:
                self._idle += 1


_POOL: _Threads | None = None
_POOL_LOCK = threading.Lock()


def pool() -> _Threads:
    """The transport's threads (see :class:`_Threads`)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Threads()
        return _POOL


def _after_fork() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()
    for endpoint in _ENDPOINTS.values():
        if isinstance(endpoint, DirectS3):
            endpoint._lock = threading.Lock()
            endpoint.forget()


_process.at_fork(_after_fork)
