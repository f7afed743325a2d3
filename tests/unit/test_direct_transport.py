"""The one-copy transport's own rules: its requests are signed exactly as AWS's own SDK signs
them, it is chosen only where it can do all a GET needs, and a store's error answers read as
the same failure kinds as obstore's. (Its reads, faults and hedges run against a real S3 server
in the functional fault suites, on both transports.)"""

from __future__ import annotations

import contextlib
import datetime
import time
import urllib.parse
from typing import Any

import pytest

from weightstream.config import ObjectStoreConfig, StreamConfig
from weightstream.errors import ConfigError, ReadError
from weightstream.location import ObjectLocation, object_location
from weightstream.sources.object_store import direct
from weightstream.sources.object_store.failures import Failure, classify
from weightstream.sources.object_store.source import ObjectSource

NOW = datetime.datetime(2026, 12, 3, 14, 5, 9, tzinfo=datetime.timezone.utc)
KEYS = ["m/model-00001-of-00002.safetensors", "a b/c+d/ü=%.safetensors", "x/~y_z-1.2/w"]


def endpoint(token: str | None, base_path: str = "") -> direct.DirectS3:
    return direct.DirectS3(
        host="10.0.0.7",
        port=9000,
        base_path=base_path,
        bucket="models",
        region="eu-west-1",
        credentials=direct._Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token),
        connect_timeout=5.0,
    )


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEBYaDJ//token=="])
@pytest.mark.parametrize("if_match", [None, '"9b2cf535f27731c974343645a3985328"'])
@pytest.mark.parametrize("base_path", ["", "/s3"])
def test_requests_are_signed_as_botocore_signs_them(
    key: str, token: str | None, if_match: str | None, base_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    botocore_auth = pytest.importorskip("botocore.auth")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    ep = endpoint(token, base_path)
    ours = dict(ep.headers(key, (4096, 8392704), if_match=if_match, now=NOW.timestamp()))

    monkeypatch.setattr(botocore_auth, "get_current_datetime", lambda: NOW.replace(tzinfo=None))
    headers = {"Range": "bytes=4096-8392703"}
    if if_match:
        headers["If-Match"] = if_match
    request = AWSRequest(
        method="GET",
        url=f"http://10.0.0.7:9000{base_path}/models/{urllib.parse.quote(key, safe='/~')}",
        headers=headers,
    )
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    botocore_auth.S3SigV4Auth(creds, "s3", "eu-west-1").add_auth(request)

    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]
    assert ours["x-amz-content-sha256"] == request.headers["X-Amz-Content-SHA256"]
    assert ours.get("x-amz-security-token") == request.headers.get("X-Amz-Security-Token")
    assert ep.path(key) == urllib.parse.urlsplit(request.url).path


def test_an_ipv6_endpoint_is_named_as_urls_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    loc = object_location("s3://b/m/")
    assert loc is not None
    ep = direct.transport_for(loc, ObjectStoreConfig(endpoint="http://[fd00::7]:9000"))
    assert ep is not None and (ep.host, ep.port, ep.host_header) == ("fd00::7", 9000, "[fd00::7]:9000")


def test_unsigned_requests_carry_no_authorization() -> None:
    ep = direct.DirectS3(
        host="h", port=80, base_path="", bucket="b", region="r", credentials=None, connect_timeout=1.0
    )
    headers = dict(ep.headers("k", (0, 10), if_match=None, now=NOW.timestamp()))
    assert headers == {"host": "h", "range": "bytes=0-9"}


KEYED = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


@pytest.mark.parametrize(
    ("uri", "settings", "env", "chosen"),
    [
        ("s3://b/m/", {"endpoint": "http://10.1.2.3:9000"}, KEYED, True),
        ("s3://b/m/", {"endpoint": "http://minio", "addressing": "path"}, KEYED, True),
        ("s3://b/m/", {"endpoint": "http://minio", "anonymous": True}, {}, True),
        # TLS, AWS itself, virtual-hosted names, credentials the client must fetch: obstore
        ("s3://b/m/", {"endpoint": "https://minio"}, KEYED, False),
        ("s3://b/m/", {}, KEYED, False),
        ("s3://b/m/", {"endpoint": "http://minio", "addressing": "virtual"}, KEYED, False),
        ("s3://b/m/", {"endpoint": "http://minio"}, {}, False),
        ("s3://b/m/", {"endpoint": "http://minio"}, {"AWS_ACCESS_KEY_ID": "k"}, False),
        ("s3://b/m/", {"endpoint": "http://user:pw@minio"}, KEYED, False),
        ("gs://b/m/", {"endpoint": "http://minio"}, KEYED, False),
        ("s3://b/m/", {"endpoint": "http://10.1.2.3:9000", "transport": "obstore"}, KEYED, False),
    ],
)
def test_the_transport_is_chosen_only_where_it_can_do_all_a_get_needs(
    uri: str, settings: dict[str, object], env: dict[str, str], chosen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    loc = object_location(uri)
    assert loc is not None
    got = direct.transport_for(loc, ObjectStoreConfig(**settings))  # type: ignore[arg-type]
    assert (got is not None) is chosen
    if not chosen and settings.get("transport") != "obstore":
        with pytest.raises(ConfigError, match="transport='direct' cannot read this object") as info:
            direct.transport_for(loc, ObjectStoreConfig(**{**settings, "transport": "direct"}))  # type: ignore[arg-type]
        assert info.value.uri == loc.uri and info.value.setting == "transport"


@pytest.mark.parametrize(
    ("proxy", "no_proxy", "chosen"),
    [
        ({"HTTP_PROXY": "http://proxy:3128"}, "", False),
        ({"http_proxy": "http://proxy:3128"}, "", False),
        ({"ALL_PROXY": "http://proxy:3128"}, "", False),
        ({"HTTP_PROXY": "http://proxy:3128"}, "minio,.svc", True),
        ({"HTTP_PROXY": "http://proxy:3128"}, "*", True),
        ({"HTTPS_PROXY": "http://proxy:3128"}, "", True),  # for https:// only
    ],
)
def test_a_proxy_for_the_endpoint_leaves_it_to_obstore(
    proxy: dict[str, str], no_proxy: str, chosen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every HTTP client here sends a plain-HTTP request through the environment's proxy; this
    transport connects directly, so where a proxy applies it stands aside."""
    for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    for k, v in {**KEYED, **proxy}.items():
        monkeypatch.setenv(k, v)
    if no_proxy:
        monkeypatch.setenv("NO_PROXY", no_proxy)
    loc = object_location("s3://b/m/")
    assert loc is not None
    got = direct.transport_for(loc, ObjectStoreConfig(endpoint="http://minio:9000"))
    assert (got is not None) is chosen


def test_a_bad_transport_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match="transport must be"):
        ObjectStoreConfig(transport="sockets")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "reason", "body", "kind"),
    [
        (404, "NOT FOUND", b"<Error><Code>NoSuchKey</Code></Error>", Failure.NOT_FOUND),
        (404, "Not Found", b"<Error><Code>NoSuchBucket</Code></Error>", Failure.NO_BUCKET),
        (403, "", b"<Error><Code>SignatureDoesNotMatch</Code></Error>", Failure.DENIED),
        (412, "PRECONDITION FAILED", b"", Failure.CHANGED),
        (503, "Slow Down", b"<Error><Code>SlowDown</Code></Error>", Failure.THROTTLED),
        (429, "", b"", Failure.THROTTLED),
        (500, "Internal Server Error", b"<Error><Code>InternalError</Code></Error>", Failure.TRANSIENT),
        (301, "Moved Permanently", b"<Error><Code>PermanentRedirect</Code></Error>", Failure.REDIRECT),
        (502, "Bad Gateway", b"", Failure.TRANSIENT),
    ],
)
def test_error_answers_read_as_the_failure_kinds_obstore_s_do(
    status: int, reason: str, body: bytes, kind: Failure
) -> None:
    """The status decides, however the server spells its reason (werkzeug: upper case)."""
    assert classify(direct.StoreAnswer(status, reason, body)) is kind


# -- the request machine on this transport: its real threads, a scripted store ----------------

OBJECT = bytes(range(256)) * 256  # 64 KiB
ETAG = '"v1"'


class ScriptedStore:
    """Stands in for :class:`direct.DirectS3` (the store's side of each GET, a script per call),
    run on the transport's real threads by the real request machine and worker."""

    def __init__(self, *scripts: Any) -> None:
        self.scripts = list(scripts)
        self.calls: list[tuple[int, int]] = []

    def get_into(self, get: direct.Get) -> None:
        try:
            script = self.scripts[min(len(self.calls), len(self.scripts) - 1)]
            self.calls.append(get.rng)
            get.on_answer(direct.Answer(206, get.rng[0], get.rng[1], ETAG))
            script(get.rng, get.dest, get.transfer, get.on_bytes)
        finally:
            get.transfer.done.set()


def scripted_source(store: ScriptedStore, *, hedge: bool = False) -> ObjectSource:
    oc = ObjectStoreConfig(
        endpoint="http://127.0.0.1:9",
        region="us-east-1",
        low_speed_limit=1000,
        low_speed_window=0.2,
        request_timeout=10.0,
        max_attempts=2,
        backoff_initial=0.01,
        backoff_max=0.02,
        hedge_multiple=1.0 if hedge else 0,
        hedge_min_delay=0.3,
    )
    src = ObjectSource(
        ObjectLocation("s3", "bkt", "m.safetensors"),
        StreamConfig(object_store=oc),
        size=len(OBJECT),
        etag=ETAG,
    )
    src._direct = store  # type: ignore[assignment]
    if hedge:  # enough finished requests for a p95: a straggler is hedged after 0.3 s
        src.stats.seconds_per_byte.extend([1e-9] * 32)
    return src


def test_a_timer_firing_after_the_last_byte_leaves_the_request_complete() -> None:
    """Every byte is in and reported; the answer's end is late, and the low-speed timer fires
    (0 bytes in a 0.2 s window) before the transfer returns. The request is complete: one GET,
    no retry, no request for nothing."""

    def whole_then_late(
        rng: tuple[int, int], dest: memoryview, transfer: direct.Transfer, on_bytes: Any
    ) -> None:
        dest[:] = OBJECT[rng[0] : rng[1]]
        on_bytes(len(dest))
        time.sleep(0.8)

    store = ScriptedStore(whole_then_late)
    src = scripted_source(store)
    buf = bytearray(16384)
    assert src.read_into(memoryview(buf), offset=4096) == (16384, "network")
    assert bytes(buf) == OBJECT[4096 : 4096 + 16384]
    assert store.calls == [(4096, 4096 + 16384)] and src.stats.retries == 0


def test_no_transfer_writes_into_the_buffer_after_the_read_returns() -> None:
    """A straggler is hedged and the hedge wins; the straggler, aborted, takes 0.3 s more to
    end (a receive in the kernel). The read returns only once it has: the caller may hand the
    buffer on at once."""
    ended: list[float] = []

    def straggler(rng: tuple[int, int], dest: memoryview, transfer: direct.Transfer, on_bytes: Any) -> None:
        half = len(dest) // 2
        dest[:half] = OBJECT[rng[0] : rng[0] + half]
        on_bytes(half)
        while not transfer.aborted:
            time.sleep(0.01)
        time.sleep(0.3)
        ended.append(time.monotonic())
        raise direct.Aborted()

    def fast(rng: tuple[int, int], dest: memoryview, transfer: direct.Transfer, on_bytes: Any) -> None:
        dest[:] = OBJECT[rng[0] : rng[1]]
        on_bytes(len(dest))

    store = ScriptedStore(straggler, fast)
    src = scripted_source(store, hedge=True)
    buf = bytearray(32768)
    src.read_into(memoryview(buf), offset=0)
    returned = time.monotonic()
    assert ended and ended[0] <= returned
    assert bytes(buf) == OBJECT[:32768]
    assert src.stats.hedges == 1 and src.stats.hedge_wins == 1 and len(store.calls) == 2


# -- the answer's headers: taken exactly, the body left whole for recv_into ------------------

HEAD = b'HTTP/1.1 206 Partial Content\r\nContent-Length: 300\r\nETag: "v1"\r\n\r\n'
BODY = bytes(range(256)) + bytes(44)


def _head_then_rest(pieces: list[bytes]) -> tuple[bytes, bytes]:
    """The store sends ``pieces`` (headers and body, cut anywhere) a moment apart; what the
    header reader returns, and what it left on the socket."""
    import socket
    import threading

    ours, theirs = socket.socketpair()

    def send() -> None:
        with contextlib.suppress(OSError):  # the reader may refuse the answer and close
            for piece in pieces:
                theirs.sendall(piece)
                time.sleep(0.005)
            theirs.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        head = endpoint(None)._receive_head(ours, direct.Transfer(deadline=time.monotonic() + 10))
        rest = b""
        while chunk := ours.recv(65536):
            rest += chunk
        return head, rest
    finally:
        ours.close()
        sender.join()
        theirs.close()


@pytest.mark.parametrize("cut", range(1, len(HEAD) + 8))
def test_the_header_reader_takes_the_headers_and_no_byte_of_the_body(cut: int) -> None:
    """Cut anywhere, the end of the headers straddling two arrivals included: the reader
    returns the headers and leaves every body byte on the socket, so the body is received by
    the kernel into place (no body byte is copied by Python with the GIL held)."""
    answer = HEAD + BODY
    head, rest = _head_then_rest([answer[:cut], answer[cut:]])
    assert head == HEAD[:-4]
    assert rest == BODY


def test_headers_that_trickle_byte_by_byte_and_run_past_a_peek_are_read_whole() -> None:
    long_head = HEAD[:-2] + b"".join(b"x-amz-meta-%d: %s\r\n" % (i, b"v" * 90) for i in range(60)) + b"\r\n"
    assert len(long_head) > direct._HEAD_READ
    head, rest = _head_then_rest([long_head + BODY[:10], BODY[10:]])
    assert head == long_head[:-4] and rest == BODY
    head, rest = _head_then_rest([bytes([b]) for b in HEAD[:40]] + [HEAD[40:] + BODY])
    assert head == HEAD[:-4] and rest == BODY


def test_headers_past_the_bound_are_refused() -> None:
    endless = b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"p" * (direct._HEAD_MAX + 10) + b"\r\n\r\n"
    with pytest.raises(direct.StoreAnswer, match="headers too long"):
        _head_then_rest([endless])


# -- a GET is complete by its bytes, never because something returned -------------------------


def test_a_transfer_that_returns_short_is_a_short_read_and_the_rest_is_asked_for() -> None:
    """The store's side returns, having delivered half the range: the request is not whole, the
    retry asks for exactly the rest, and the buffer ends up exact."""

    def half(rng: tuple[int, int], dest: memoryview, transfer: direct.Transfer, on_bytes: Any) -> None:
        n = len(dest) // 2
        dest[:n] = OBJECT[rng[0] : rng[0] + n]
        on_bytes(n)

    def whole(rng: tuple[int, int], dest: memoryview, transfer: direct.Transfer, on_bytes: Any) -> None:
        dest[:] = OBJECT[rng[0] : rng[1]]
        on_bytes(len(dest))

    store = ScriptedStore(half, whole)
    src = scripted_source(store)
    buf = bytearray(16384)
    assert src.read_into(memoryview(buf), offset=4096) == (16384, "network")
    assert bytes(buf) == OBJECT[4096 : 4096 + 16384]
    assert store.calls == [(4096, 4096 + 16384), (4096 + 8192, 4096 + 16384)]
    assert src.stats.retries == 1


def test_a_transfer_that_returns_with_nothing_never_completes_the_read() -> None:
    """Every attempt returns without one byte: the read fails, naming the range; it never
    returns a buffer nobody wrote."""

    def nothing(rng: tuple[int, int], dest: memoryview, transfer: direct.Transfer, on_bytes: Any) -> None:
        return None

    store = ScriptedStore(nothing)
    src = scripted_source(store)
    with pytest.raises(ReadError) as info:
        src.read_into(memoryview(bytearray(4096)), offset=0)
    assert info.value.byte_range == (0, 4096) and "0 of 4096 bytes" in str(info.value)
    assert len(store.calls) == 2  # max_attempts


class CloseAfterEachAnswer:
    """A store on loopback that answers one ranged GET per connection, whole, then closes the
    connection without saying so (as stores drop idle kept-alive connections); ``silent``: it
    closes every connection without an answer."""

    def __init__(self, *, silent: bool = False) -> None:
        import socket
        import threading

        self.silent = silent
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        with conn:
            if self.silent:
                return
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            rng = next(line for line in head.decode().split("\r\n") if line.lower().startswith("range:"))
            first, last = (int(x) for x in rng.split("=")[1].split("-"))
            body = OBJECT[first : last + 1]
            conn.sendall(
                f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n"
                f"Content-Range: bytes {first}-{last}/{len(OBJECT)}\r\nETag: {ETAG}\r\n\r\n".encode()
                + body
            )

    def close(self) -> None:
        self.listener.close()


def _loopback(port: int) -> direct.DirectS3:
    return direct.DirectS3(
        host="127.0.0.1",
        port=port,
        base_path="",
        bucket="b",
        region="us-east-1",
        credentials=None,
        connect_timeout=2.0,
    )


def _get(store: direct.DirectS3, first: int, end: int) -> tuple[bytearray, list[int]]:
    dest = bytearray(end - first)
    counted: list[int] = []
    store.get_into(
        direct.Get(
            "k",
            (first, end),
            memoryview(dest),
            direct.Transfer(deadline=time.monotonic() + 10),
            None,
            lambda a: None,
            counted.append,
        )
    )
    return dest, counted


def test_gets_on_connections_the_store_closes_after_each_answer_are_whole_or_raise() -> None:
    """Eight threads, each GET on a kept connection the store has closed meanwhile (the case a
    fresh retry is for, with other transfers releasing their closed connections at the same
    time): every GET that returns has every byte, counted; none returns short."""
    import random
    import threading

    server = CloseAfterEachAnswer()
    store = _loopback(server.port)
    failures: list[str] = []

    def run(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(60):
            first = rnd.randrange(0, len(OBJECT) - 1)
            end = rnd.randrange(first + 1, min(len(OBJECT), first + 8192) + 1)
            try:
                dest, counted = _get(store, first, end)
            except ConnectionResetError:
                continue  # a failed GET is the request machine's to retry; a short one is not
            if bytes(dest) != OBJECT[first:end] or sum(counted) != end - first:
                failures.append(f"bytes {first}-{end}: {sum(counted)} counted")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.close()
        store.forget()
    assert not failures, failures[:5]


def test_a_get_whose_kept_and_new_connections_all_go_unanswered_raises() -> None:
    """Kept connections the store has closed, and a store that closes every new one too: the
    GET raises, after one new connection (never a second kept one)."""
    import socket

    server = CloseAfterEachAnswer(silent=True)
    store = _loopback(server.port)
    for _ in range(3):
        a, b = socket.socketpair()
        b.close()
        store._release(a)
    try:
        with pytest.raises(ConnectionResetError, match="without an answer"):
            _get(store, 0, 100)
        assert server.accepted == 1
        assert store._kept() is None  # the closed kept connections were dropped
    finally:
        server.close()
        store.forget()


def test_a_kept_connection_released_while_a_get_starts_afresh_is_not_taken_for_it() -> None:
    """A GET's kept connection was closed by the store, so it goes again on a new one (the other
    kept ones are dropped); just then another transfer releases its own kept connection, closed
    too. The GET must not take
    that one for its fresh try (and, unanswered there, return with nothing): it dials, and
    returns with every byte."""
    import socket

    server = CloseAfterEachAnswer()
    store = _loopback(server.port)

    def closed_kept() -> socket.socket:
        a, b = socket.socketpair()
        b.close()
        return a

    class ReleasesAnotherOnClose(socket.socket):
        def close(self) -> None:
            if self.fileno() >= 0:
                store._release(closed_kept())  # another transfer, ending at this moment
            super().close()

    other = closed_kept()
    store._release(ReleasesAnotherOnClose(fileno=other.detach()))  # dropped as the GET starts afresh
    store._release(closed_kept())  # the GET's own
    try:
        dest, counted = _get(store, 100, 5000)
        assert bytes(dest) == OBJECT[100:5000] and sum(counted) == 4900
        assert server.accepted == 1
    finally:
        server.close()
        store.forget()
