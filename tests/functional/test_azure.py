"""az:// against Azurite, Microsoft's Azure Storage emulator, on a free loopback port.

Azurite comes from npm (`make test` installs it under .node/ where npm exists). Without it these
tests are skipped and say so; the S3 path, which shares all of the request engine, is tested
against moto either way."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import weightstream as ws
from weightstream.config import KiB
from weightstream.errors import NotFoundError

from ..conftest import assert_same, free_port, random_tensor, wait_listening

blob = pytest.importorskip("azure.storage.blob")

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # Azurite's published dev key


def _azurite() -> str | None:
    local = ROOT / ".node" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = _azurite()
    if exe is None:
        pytest.skip("azurite is not installed (npm install --prefix .node azurite)")
    port = free_port()
    work = tmp_path_factory.mktemp("azurite")  # its working directory (debug logs, if any)
    proc = subprocess.Popen(
        [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--skipApiVersionCheck"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=work,
    )  # fmt: skip
    try:
        wait_listening(port, what="azurite", proc=proc)
        yield f"http://127.0.0.1:{port}/{ACCOUNT}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def az(azurite: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for key in list(os.environ):
        if key.startswith(("AZURE_", "AZURITE_", "WEIGHTSTREAM_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", azurite.rsplit("/", 1)[0])
    conn = f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={azurite};"
    return blob.BlobServiceClient.from_connection_string(conn)


def test_sharded_container_prefix_bit_for_bit(az) -> None:  # type: ignore[no-untyped-def]
    container = az.create_container("models")
    shards = [
        {
            "a": random_tensor((300, 257), torch.bfloat16, seed=1),
            "b": random_tensor((7,), torch.int64, seed=2),
        },
        {"c": random_tensor((64 * KiB,), torch.uint8, seed=3), "d": random_tensor((), torch.float32, seed=4)},
    ]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-00002.safetensors"
        container.upload_blob(f"llm/{name}", save(shard))
        weight_map.update(dict.fromkeys(shard, name))
    import json

    container.upload_blob(
        "llm/model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    want = {k: v for s in shards for k, v in s.items()}
    cfg = ws.StreamConfig.from_env(chunk_size=64 * KiB)
    assert_same(ws.load("az://models/llm/", config=cfg), want)
    assert_same(ws.load("az://models/llm/model-00002-of-00002.safetensors", config=cfg), shards[1])


def test_missing_container_and_blob(az) -> None:  # type: ignore[no-untyped-def]
    az.create_container("empty")
    with pytest.raises(NotFoundError, match="az://empty/nothing"):
        ws.load("az://empty/nothing/model.safetensors")
    with pytest.raises(NotFoundError, match="az://nosuchcontainer"):
        ws.load("az://nosuchcontainer/m/")
