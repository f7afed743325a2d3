"""Object storage against a real S3-compatible server (moto's server mode) on a loopback port."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import weightstream as ws
from weightstream.config import KiB, ObjectStoreConfig
from weightstream.errors import ConfigError, NotFoundError, WeightStreamError

from ..conftest import ALL_TORCH_DTYPES, assert_same, random_tensor
from .conftest import bucket, put_checkpoint


def small() -> ws.StreamConfig:
    store = ObjectStoreConfig.from_env(chunk_size=64 * KiB, concurrency=4)
    return ws.StreamConfig.from_env(memory_limit=256 * KiB, object_store=store)


def test_sharded_prefix_with_index_bit_for_bit(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "models")
    shards = [{f"{dt}.{s}": random_tensor((37, 11), dt, seed=s) for dt in ALL_TORCH_DTYPES} for s in range(2)]
    shards[0]["big"] = random_tensor((200_001,), torch.float32)  # many chunks of 64 KiB
    want = put_checkpoint(s3, b, "llama/v1", shards)
    stream = ws.stream(f"s3://{b}/llama/v1", config=small())
    assert_same(dict(stream), want)
    assert stream.stats.complete and stream.stats.network_bytes == stream.stats.bytes_read > 0
    # the index object itself, and a trailing slash, name the same checkpoint
    assert_same(ws.load(f"s3://{b}/llama/v1/model.safetensors.index.json"), want)
    assert_same(ws.load(f"s3://{b}/llama/v1/"), want)
    # load() into host memory reads into the tensors it returns. Where the transport receives
    # straight into them (the one-copy path this plain-HTTP endpoint gets), the reads in flight
    # cost nothing beyond them: every block is admitted at once, as for a local load, and the
    # tuner may go as deep as the link needs
    ck = ws.open_checkpoint(f"s3://{b}/llama/v1", config=small())
    assert_same(ck.load(), want)
    stats = ck.last_stats
    assert stats is not None and stats.peak_held_bytes >= stats.bytes_read  # (blocks are 4 KiB aligned)
    assert stats.tuning is not None and stats.tuning["max_depth"] == 1024
    # obstore stages what it receives in buffers of its own: there load() keeps to the memory
    # budget like stream() ("big" is a block larger than the budget, admitted alone)
    staged = small().replace(object_store=dataclasses.replace(small().object_store, transport="obstore"))
    ck = ws.open_checkpoint(f"s3://{b}/llama/v1", config=staged)
    assert_same(ck.load(), want)
    stats = ck.last_stats
    assert stats is not None and 0 < stats.peak_held_bytes < stats.bytes_read
    assert stats.tuning is not None and stats.tuning["max_depth"] * 4 * KiB <= staged.memory_limit


def test_single_object_and_unindexed_prefix(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "models")
    want = put_checkpoint(s3, b, "plain", [{"a": torch.arange(10)}, {"b": torch.ones(3, 3)}], index=False)
    assert_same(ws.load(f"s3://{b}/plain"), want)
    assert_same(ws.load(f"s3://{b}/plain/model-00002-of-00002.safetensors"), {"b": want["b"]})
    assert list(ws.load(f"s3://{b}/plain", tensors=["b"])) == ["b"]


def test_missing_object_is_not_found(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "models")
    with pytest.raises(NotFoundError) as info:
        ws.load(f"s3://{b}/nothing/here.safetensors")
    assert isinstance(info.value, FileNotFoundError)
    assert f"s3://{b}/nothing/here.safetensors" in str(info.value)


def test_empty_prefix_is_not_found(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "models")
    with pytest.raises(NotFoundError, match="neither"):
        ws.load(f"s3://{b}/empty-prefix")


def test_missing_bucket_is_not_found(s3) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NotFoundError) as info:
        ws.load("s3://no-such-bucket/model.safetensors")
    assert "no-such-bucket" in str(info.value)


def test_index_naming_a_missing_shard(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "models")
    put_checkpoint(s3, b, "broken", [{"a": torch.ones(2)}, {"b": torch.ones(2)}])
    s3.delete_object(Bucket=b, Key="broken/model-00002-of-00002.safetensors")
    with pytest.raises(NotFoundError, match="model-00002-of-00002") as info:
        ws.load(f"s3://{b}/broken")
    assert f"s3://{b}/broken/model-00002-of-00002.safetensors" in str(info.value)
    # the backend words it as the caller asked, as a file system's does
    assert "names shard 'model-00002-of-00002.safetensors', which cannot be opened: no such object" in str(
        info.value
    )


def test_truncated_object_fails_before_reading_data(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "models")
    blob = save({"w": random_tensor((5000,), torch.float32)})
    s3.put_object(Bucket=b, Key="cut/model.safetensors", Body=blob[:-100])
    with pytest.raises(WeightStreamError, match="truncated") as info:
        ws.load(f"s3://{b}/cut/model.safetensors")
    assert f"s3://{b}/cut/model.safetensors" in str(info.value)


def test_unreachable_endpoint_fails_fast_and_clearly(s3, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = ObjectStoreConfig(
        endpoint=f"http://127.0.0.1:{port}", max_attempts=2, backoff_initial=0.05, connect_timeout=1
    )
    started = time.monotonic()
    with pytest.raises(WeightStreamError) as info:
        ws.load("s3://models/x.safetensors", config=ws.StreamConfig(object_store=store))
    assert time.monotonic() - started < 30
    assert "s3://models" in str(info.value)


def test_environment_configures_the_store(s3, s3_endpoint: str) -> None:  # type: ignore[no-untyped-def]
    """AWS_ENDPOINT_URL and the credential variables alone reach a local http:// endpoint."""
    c = ws.StreamConfig.from_env()
    assert c.object_store.endpoint == s3_endpoint and c.object_store.region == "us-east-1"


def test_cli_loads_from_s3(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "models")
    want = put_checkpoint(s3, b, "cli", [{"a": torch.ones(1000)}])
    exe = Path(sys.executable).parent / "weightstream"
    out = subprocess.run(
        [str(exe), "load", f"s3://{b}/cli", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["complete"] and stats["bytes"] == sum(t.numel() * t.element_size() for t in want.values())
    assert stats["network_bytes"] > 0


def test_ca_bundle_is_read_from_the_named_file(s3, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """AWS_CA_BUNDLE names a PEM file (as the AWS CLI reads it); a missing file is a clear error."""
    b = bucket(s3, "models")
    want = put_checkpoint(s3, b, "ca", [{"a": torch.ones(4)}])
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    if system.exists():
        monkeypatch.setenv("AWS_CA_BUNDLE", str(system))
        assert_same(ws.load(f"s3://{b}/ca"), want)
    monkeypatch.setenv("AWS_CA_BUNDLE", "/nonexistent/bundle.pem")
    with pytest.raises(ws.errors.ConfigError, match="CA bundle") as info:
        ws.load(f"s3://{b}/ca")
    assert "/nonexistent/bundle.pem" in str(info.value)


def _use_auth_server(monkeypatch: pytest.MonkeyPatch, s3_auth: dict[str, str]) -> None:
    for key in list(os.environ):
        if key.startswith(("AWS_", "WEIGHTSTREAM_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_auth["endpoint"])
    monkeypatch.setenv("AWS_REGION", "us-east-1")


def test_wrong_credentials_are_denied_at_once(
    s3_auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _use_auth_server(monkeypatch, s3_auth)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    started = time.monotonic()
    with pytest.raises(ws.errors.PermissionDeniedError) as info:
        ws.load("s3://private/m/model.safetensors")
    assert isinstance(info.value, PermissionError)
    assert "s3://private/m" in str(info.value) and "denied" in str(info.value)
    assert time.monotonic() - started < 10  # no retry storm with backoff


def test_environment_credentials_are_used(s3_auth: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _use_auth_server(monkeypatch, s3_auth)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth["key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_auth["secret"])
    got = ws.load("s3://private/m/model.safetensors")
    assert torch.equal(got["w"], torch.arange(1000, dtype=torch.int32))


def test_aws_profile_is_used(
    s3_auth: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _use_auth_server(monkeypatch, s3_auth)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = AKIAWRONGWRONGWRONG0\naws_secret_access_key = wrong\n\n"
        f"[loader]\naws_access_key_id = {s3_auth['key_id']}\naws_secret_access_key = {s3_auth['secret']}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_PROFILE", "loader")
    got = ws.load("s3://private/m/model.safetensors")
    assert torch.equal(got["w"], torch.arange(1000, dtype=torch.int32))
    monkeypatch.setenv("AWS_PROFILE", "default")  # the profile really decides
    with pytest.raises(ws.errors.PermissionDeniedError):
        ws.load("s3://private/m/model.safetensors")


def test_list_mixing_objects_and_local_files(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    b = bucket(s3, "models")
    remote = put_checkpoint(s3, b, "mixed", [{"a": torch.arange(5)}], index=False)
    local = tmp_path / "local.safetensors"
    save_file({"b": torch.ones(3)}, str(local))
    got = ws.load([f"s3://{b}/mixed/model-00001-of-00001.safetensors", f"file://{local}"])
    assert_same(got, {**remote, "b": torch.ones(3)})
    with pytest.raises(NotFoundError, match="missing"):
        ws.load([f"s3://{b}/mixed/model-00001-of-00001.safetensors", str(tmp_path / "missing.safetensors")])


def test_an_object_replaced_after_its_header_was_read_fails_the_load(s3) -> None:  # type: ignore[no-untyped-def]
    """Reads are pinned to the ETag the header was read at. Replacing a shard with one of the
    same size and layout between open_checkpoint() and the load must fail, naming the object,
    not return tensors mixing two versions."""
    from weightstream.errors import FormatError

    b = bucket(s3, "pinned")
    old = {"w": random_tensor((64 * KiB,), torch.uint8, seed=1)}
    put_checkpoint(s3, b, "m", [old])
    ckpt = ws.open_checkpoint(f"s3://{b}/m", config=small())
    assert ckpt.versions  # the listing's ETags were kept
    new = {"w": random_tensor((64 * KiB,), torch.uint8, seed=2)}
    s3.put_object(Bucket=b, Key="m/model-00001-of-00001.safetensors", Body=save(new))
    with pytest.raises(FormatError, match="changed since its header was read") as info:
        ckpt.load()
    assert "s3://pinned/m/model-00001-of-00001.safetensors" in str(info.value)
    # opened again, the new version loads
    assert_same(ws.load(f"s3://{b}/m", config=small()), new)


def test_an_endpoint_password_never_shows(s3, s3_endpoint: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Not in an error or anything it chains, repr(StreamConfig), the load's statistics, or the
    CLI's JSON and messages."""
    secret = "s3cr3t-Pa55"
    with socket.socket() as sock:  # nothing listens: the client's error prints the request URL
        sock.bind(("127.0.0.1", 0))
        dead = f"http://loader:{secret}@127.0.0.1:{sock.getsockname()[1]}"
    config = ws.StreamConfig(
        object_store=ObjectStoreConfig(
            endpoint=dead, region="us-east-1", max_attempts=2, backoff_initial=0.01
        )
    )
    assert secret not in repr(config) and secret not in json.dumps(config.as_dict())
    assert "loader:***@" in repr(config)
    with pytest.raises(WeightStreamError) as info:
        ws.load("s3://models/m/", config=config)
    texts, e = [], info.value
    while e is not None:
        texts.append(f"{e!r} {e}")
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    assert len(texts) >= 2 and not [t for t in texts if secret in t], texts
    # a store that answers (the password is ignored by moto): statistics and the CLI
    b = bucket(s3, "models")
    put_checkpoint(s3, b, "m", [{"w": torch.ones(3)}])
    live = s3_endpoint.replace("http://", f"http://loader:{secret}@")
    stream = ws.stream(f"s3://{b}/m", config=ws.StreamConfig(object_store=ObjectStoreConfig(endpoint=live)))
    dict(stream)
    assert secret not in json.dumps(stream.stats.as_dict())
    env = {**os.environ, "AWS_ENDPOINT_URL": live}
    out = subprocess.run(
        [sys.executable, "-m", "weightstream", "load", f"s3://{b}/m", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0 and secret not in out.stdout + out.stderr, out.stderr
    env["AWS_ENDPOINT_URL"] = dead
    out = subprocess.run(
        [sys.executable, "-m", "weightstream", "load", f"s3://{b}/m"], capture_output=True, text=True, timeout=120, env=env
    )  # fmt: skip
    assert out.returncode == 2 and secret not in out.stdout + out.stderr and "loader:***@" in out.stderr, (
        out.stderr
    )


class _Redirecting:
    """A store that answers every request with a redirect (an S3 bucket in another region), to
    another server (``to``) that refuses the request as signed for the first host, or nowhere."""

    def __init__(self, code: int, to: str | None) -> None:
        import http.server
        import threading

        self.hits = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.hits += 1
                body = (
                    b"<Error><Code>PermanentRedirect</Code><Message>The bucket you are attempting to access "
                    b"must be addressed using the specified endpoint.</Message></Error>"
                )
                self.send_response(code)
                if to is not None:
                    self.send_header("Location", to + self.path)
                self.send_header("x-amz-bucket-region", "eu-west-1")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Refusing(_Redirecting):
    """The redirect's target: refuses a request signed for another host."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.hits = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"<Error><Code>SignatureDoesNotMatch</Code><Message>no</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize(("code", "target"), [(301, None), (307, None), (307, "refusing"), (307, "nowhere")])
def test_a_redirect_says_redirect_and_is_not_retried(s3, code: int, target: str | None) -> None:  # type: ignore[no-untyped-def]
    """It was reported as "access denied" (the client follows a redirect with a Location, and the
    request there fails as signed for another host)."""
    refusing = _Refusing() if target == "refusing" else None
    to = refusing.url if refusing else ("http://127.0.0.1:9" if target == "nowhere" else None)
    store = _Redirecting(code, to)
    try:
        config = ws.StreamConfig(
            object_store=ObjectStoreConfig(endpoint=store.url, region="us-east-1", backoff_initial=0.01)
        )
        for uri in ("s3://bkt/m/", ["s3://bkt/m/model.safetensors"]):
            store.hits = 0
            with pytest.raises(ConfigError, match="redirect") as info:
                ws.load(uri, config=config)
            assert "region" in str(info.value) and "us-east-1" in str(info.value)
            assert "access denied" not in str(info.value).split("(the request failed so")[0]
            assert store.hits <= 2  # not retried (a redirect followed to a failure: one probe more)
    finally:
        store.close()
        if refusing:
            refusing.close()


def test_a_load_into_host_memory_takes_the_host_s_share_of_memory(s3) -> None:  # type: ignore[no-untyped-def]
    """As on a network file system: the store's depth and read size, and a sixteenth of the
    host's available memory a loading process (8 GiB a rank of a 2 TiB node of 8), where the
    host is known (a load into host memory); the default 2 GiB where it is not."""
    b = bucket(s3, "models")
    put_checkpoint(s3, b, "share", [{"a": torch.arange(10)}])
    ck = ws.open_checkpoint(f"s3://{b}/share")
    try:
        node = ck.defaults(ck.config, host=lambda: (2048 << 30, 8))
        assert node.memory_limit == 8 << 30
        assert node.concurrency == ck.config.for_remote().concurrency == 128
        assert node.chunk_size == ck.config.for_remote().chunk_size == 8 << 20
        assert ck.defaults(ck.config).memory_limit == 2 << 30
    finally:
        ck.close()


@pytest.mark.parametrize("transport", ["direct", "obstore"])
def test_requests_joined_at_issue_deliver_every_byte(
    s3, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Where a process's requests would hold its interpreter, reads join their block's
    waiting chunks when they are issued (tuning.online). This machine never gets there, so the
    rule is made to fire at once (the process's CPU clock reads as if one core were busy all
    the time, measured after every read): every load, stream and transport still delivers
    each byte, with fewer, larger requests than its chunks."""
    from weightstream.tuning import online

    monkeypatch.setattr(online, "_user_cpu", time.monotonic)
    monkeypatch.setattr(online, "CPU_WINDOW", 0.0)
    b = bucket(s3, "joined")
    shard = {f"small.{i}": random_tensor((333,), torch.float16, seed=i) for i in range(40)}
    shard["big"] = random_tensor((700_001,), torch.float32)  # 2.8 MB: 43 chunks of 64 KiB
    want = put_checkpoint(s3, b, "m", [shard])
    store = ObjectStoreConfig.from_env(chunk_size=64 * KiB, concurrency=4, transport=transport)
    config = ws.StreamConfig.from_env(memory_limit=64 << 20, object_store=store)
    ck = ws.open_checkpoint(f"s3://{b}/m", config=config)
    assert_same(ck.load(), want)
    stats = ck.last_stats
    assert stats is not None and stats.tuning is not None
    assert stats.tuning["largest_request"] > 64 * KiB, stats.tuning
    assert stats.chunks < stats.bytes_read // (64 * KiB), stats  # fewer reads than chunks
    stream = ws.stream(f"s3://{b}/m", config=config)
    assert_same(dict(stream), want)
    assert stream.stats.complete and stream.stats.tuning is not None
