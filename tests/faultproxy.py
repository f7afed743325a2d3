"""A fault-injecting HTTP proxy for tests: sits on a loopback port in front of a real server.

Each client request is forwarded upstream on its own connection and the whole response is read;
then it is sent back to the client as-is, or, for the next N ranged GETs, broken in one of these
ways:

* ``stall``:   headers and ``at`` body bytes, then silence for ``seconds``, then close
* ``trickle``: headers and ``at`` body bytes, then the rest at ``rate`` bytes/s (``step`` bytes
  at a time)
* ``reset``:   headers and ``at`` body bytes, then a TCP reset
* ``short``:   headers and ``at`` body bytes, then a clean close (a body shorter than its
  Content-Length)
* ``silent``:  nothing at all: the request is read and never answered, for ``seconds``
* ``wrong-range``: the request is forwarded for the range ``at`` bytes earlier, and that answer
  (another range of the object, its Content-Range saying so) is sent back as it is
* ``status``:  an error answer (``code``: 500 InternalError, 503 SlowDown) instead of forwarding
* ``close-after``: the whole answer, then the connection closed (no ``Connection: close`` said:
  a store that drops idle kept-alive connections)
* ``flip``:    the whole answer, with one bit of body byte ``at`` flipped (a bad NIC, switch or
  middlebox: the store's object is intact, the bytes that arrive are not)

``at`` defaults to half the body for ``stall``, ``reset`` and ``short``, and to 0 for ``trickle``;
a negative ``at`` counts from the end of the body.

Bounded in time and traffic: every connection and sleep is capped, and ``close()`` ends all of them.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Fault:
    kind: str
    count: int
    seconds: float = 10.0
    rate: int = 2000
    code: int = 503
    after: int = 0
    """Ranged GETs to let through untouched before this fault starts."""
    at: int | None = None
    """Body bytes sent at full speed before the fault (see the module docstring)."""
    through: int | None = None
    """Instead of ``at``: bytes of the whole answer, its head included, sent at full speed (the
    first bytes of a connection, for the first answer on it)."""
    step: int = 0
    """Trickle: bytes per send (default ``rate / 20``, one send every 50 ms)."""


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    faults: list[Fault] = field(default_factory=list)
    injected: dict[str, int] = field(default_factory=dict)
    ranged_gets: int = 0
    ranges: list[str] = field(default_factory=list)
    """The Range header of every ranged GET, in arrival order."""
    cuts: list[tuple[int, int]] = field(default_factory=list)
    """``(at, body length)`` of every answer a fault broke."""
    faulted: list[str] = field(default_factory=list)
    """The Range header of every ranged GET a fault was taken for, in the order taken (a test
    finds the request it broke by its range, not by its place among the others: on a loaded
    host an unfaulted request may be slow enough to be retried too, which shifts places)."""
    drop_headers: tuple[bytes, ...] = ()
    """Request headers removed before forwarding (lower case, e.g. ``b"if-match"``: a store that
    ignores conditional requests)."""
    rewrite_host: bool = False
    """Send requests upstream with the upstream's own Host header, as a reverse proxy does (a
    server that routes by Host, such as the GCS emulator, would take the proxy's for a bucket)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port = self._server.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        t = threading.Thread(target=self._accept, name="faultproxy", daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, kind: str, count: int, **params: float) -> None:
        with self._lock:
            self.faults.append(Fault(kind, count, **params))  # type: ignore[arg-type]

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        for conn in list(self._conns):  # wake threads blocked on idle keep-alive connections
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5)

    # -- internals -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _take_fault(self, request_head: bytes) -> Fault | None:
        ranged_get = request_head.startswith(b"GET ") and b"\r\nrange:" in request_head.lower()
        if not ranged_get:
            return self._take_meta_fault()
        with self._lock:
            self.ranged_gets += 1
            lo = 0
            for line in request_head.split(b"\r\n"):
                if line.lower().startswith(b"range:"):
                    self.ranges.append(line.split(b":", 1)[1].strip().decode())
                    lo = int(line.split(b"=", 1)[1].split(b"-")[0])
            for fault in self.faults:
                if fault.kind == "silent-meta":
                    continue
                if fault.kind == "wrong-range" and lo < (fault.at or 1):
                    continue  # a range this close to the start cannot be shifted: not a fault here
                if fault.after > 0:
                    fault.after -= 1
                    continue
                if fault.count > 0:
                    fault.count -= 1
                    self.injected[fault.kind] = self.injected.get(fault.kind, 0) + 1
                    self.faulted.append(self.ranges[-1])
                    return fault
        return None

    def _take_meta_fault(self) -> Fault | None:
        """Faults of kind ``silent-meta`` apply to requests other than ranged GETs (LIST, HEAD)."""
        with self._lock:
            for fault in self.faults:
                if fault.kind == "silent-meta" and fault.count > 0:
                    fault.count -= 1
                    self.injected[fault.kind] = self.injected.get(fault.kind, 0) + 1
                    return Fault("silent", 1, seconds=fault.seconds)
        return None

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        with conn:
            buf = b""
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                body_len = _content_length(head)
                while len(buf) < body_len:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:body_len], buf[body_len:]
                fault = self._take_fault(head)
                if fault is not None and fault.kind == "status":
                    self._send_status(conn, fault.code)
                    continue
                if fault is not None and fault.kind == "silent":
                    self._stop.wait(min(fault.seconds, 60))
                    return
                if fault is not None and fault.kind == "wrong-range":
                    head = _shift_range(head, fault.at or 1)
                    fault = None
                response = self._forward(head + b"\r\n\r\n" + body)
                if response is None:
                    return
                if fault is None:
                    try:
                        conn.sendall(response)
                    except OSError:  # the client went away (a load cancelled its requests)
                        return
                    continue
                if not self._break(conn, response, fault):
                    return

    def _forward(self, request: bytes) -> bytes | None:
        # One upstream connection per request, closed by the server after its answer.
        lines = request.split(b"\r\n")
        kept = [ln for ln in lines if not ln.lower().startswith(b"connection:")]
        if self.drop_headers:
            kept = [ln for ln in kept if ln.split(b":", 1)[0].strip().lower() not in self.drop_headers]
        if self.rewrite_host:
            host = f"Host: {self.upstream[0]}:{self.upstream[1]}".encode()
            kept = [host if ln.lower().startswith(b"host:") else ln for ln in kept]
        idx = kept.index(b"")
        kept.insert(idx, b"Connection: close")
        try:
            with socket.create_connection(self.upstream, timeout=30) as up:
                up.sendall(b"\r\n".join(kept))
                chunks = []
                while data := up.recv(1 << 20):
                    chunks.append(data)
        except OSError:
            return None
        # The upstream closes after each answer (asked to); the client's connection stays open,
        # as a store's does: its Connection header is not passed on.
        response = b"".join(chunks)
        head, sep, body = response.partition(b"\r\n\r\n")
        lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
        return b"\r\n".join(lines) + sep + body

    def _break(self, conn: socket.socket, response: bytes, fault: Fault) -> bool:
        head, _, body = response.partition(b"\r\n\r\n")
        head += b"\r\n\r\n"
        at = fault.at if fault.through is None else max(0, fault.through - len(head))
        if at is None:
            at = 0 if fault.kind in ("trickle", "close-after") else len(body) // 2
        elif at < 0:
            at = max(0, len(body) + at)
        at = min(at, len(body))
        with self._lock:
            self.cuts.append((at, len(body)))
        try:
            conn.sendall(head + body[:at])
            if fault.kind == "trickle":
                step = fault.step or max(1, fault.rate // 20)
                interval = step / fault.rate
                deadline = time.monotonic() + 60
                for i in range(at, len(body), step):
                    if self._stop.is_set() or time.monotonic() > deadline:
                        return False
                    conn.sendall(body[i : i + step])
                    time.sleep(interval)
                return True
            if fault.kind == "stall":
                self._stop.wait(min(fault.seconds, 60))
                return False
            if fault.kind == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False
            if fault.kind == "short":
                return False
            if fault.kind == "close-after":
                conn.sendall(body[at:])
                return False
            if fault.kind == "flip":
                conn.sendall(bytes([body[at] ^ 0x10]) + body[at + 1 :] if at < len(body) else b"")
                return True
        except OSError:
            return False
        raise ValueError(f"unknown fault {fault.kind!r}")

    @staticmethod
    def _send_status(conn: socket.socket, code: int) -> None:
        name, reason = {
            500: ("InternalError", "Internal Server Error"),
            503: ("SlowDown", "Service Unavailable"),
        }.get(code, ("Error", "Error"))
        body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{name}</Code><Message>injected</Message></Error>".encode()
        with contextlib.suppress(OSError):
            conn.sendall(
                f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _shift_range(head: bytes, by: int) -> bytes:
    lines = head.split(b"\r\n")
    for i, line in enumerate(lines):
        if line.lower().startswith(b"range:"):
            lo, hi = (int(x) for x in line.split(b"=", 1)[1].split(b"-"))
            shift = min(by, lo)
            lines[i] = b"Range: bytes=%d-%d" % (lo - shift, hi - shift)
    return b"\r\n".join(lines)
