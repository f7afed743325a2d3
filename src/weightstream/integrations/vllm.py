"""A vLLM model loader: ``vllm serve MODEL --load-format weightstream``.

Installed with ``pip install 'weightstream[vllm]'``; vLLM finds it through the
``vllm.general_plugins`` entry point (:func:`register`), which registers the loader with
``vllm.model_executor.model_loader.register_model_loader``. Settings come from
``--model-loader-extra-config`` (JSON); keys not given fall back to ``WEIGHTSTREAM_*`` (and
``RUNAI_STREAMER_*``) variables, then to the defaults::

    vllm serve s3://models/llama-3-70b --load-format weightstream --tensor-parallel-size 8 \\
        --model-loader-extra-config '{"concurrency": 32, "memory_limit": "4GiB", "distributed": true}'

Interface followed: ``BaseModelLoader(load_config)`` with ``download_model(model_config)`` and
``load_weights(model, model_config)``, the model consuming ``(name, tensor)`` pairs through
``model.load_weights(iterator)``: the same from vLLM v0.12 through v0.32 and on its main branch
in November 2026 (read from vLLM's API docs and source).
This adapter has not been run under vLLM: vLLM needs a GPU and a CUDA build of torch. Everything
below the interface (settings, the choice of distributed mode, model paths, the weights
iterator) is tested without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

import weightstream
from weightstream.config import StreamConfig, parse_size
from weightstream.distributed import Distributed
from weightstream.errors import ConfigError
from weightstream.sources.object_store import parse_object_uri

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "config_from_extra",
    "register",
    "resolve_model_path",
    "use_distributed",
    "weights_iterator",
]

EXTRA_CONFIG_KEYS: dict[str, str] = {
    "concurrency": "reads in flight at the start (int); for object stores too unless s3_concurrency is given",
    "max_concurrency": "most reads in flight the tuner may choose (int)",
    "chunk_size": "bytes per read (int or size string, e.g. '16MiB'); for object stores too unless "
    "s3_chunk_size is given",
    "memory_limit": "bytes read but not yet consumed (int, size string, or -1 for unlimited)",
    "autotune": "let the online tuner set the depth (bool)",
    "direct_io": "'auto', 'on' or 'off'",
    "io_timeout": "seconds without a completed read before failing (number)",
    "exchange_timeout": "distributed: seconds a rank waits for the others (number)",
    "s3_concurrency": "object stores: reads in flight at the start (int)",
    "s3_chunk_size": "object stores: bytes per read (int or size string)",
    "s3_request_timeout": "object stores: seconds per request (number)",
    "distributed": "split the reads across the tensor-parallel ranks: true, false or 'auto' (default: auto, "
    "on when tensor parallelism > 1)",
}
"""The ``--model-loader-extra-config`` keys this loader reads."""

_STREAM_FIELDS = {
    "concurrency": "concurrency",
    "max_concurrency": "max_concurrency",
    "chunk_size": "chunk_size",
    "memory_limit": "memory_limit",
    "autotune": "autotune",
    "direct_io": "direct_io",
    "io_timeout": "io_timeout",
    "exchange_timeout": "exchange_timeout",
}
_STORE_FIELDS = {
    "s3_concurrency": "concurrency",
    "s3_chunk_size": "chunk_size",
    "s3_request_timeout": "request_timeout",
}
_SIZES = {"chunk_size", "memory_limit", "s3_chunk_size"}


def config_from_extra(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> tuple[StreamConfig, Distributed]:
    """``--model-loader-extra-config`` as a :class:`StreamConfig` and a ``distributed`` choice.

    Unknown keys raise :class:`ConfigError` naming the known ones (a typo must not be silently
    ignored); values are validated by ``StreamConfig`` as usual.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown --model-loader-extra-config keys for weightstream: {', '.join(unknown)} "
            f"(known: {', '.join(EXTRA_CONFIG_KEYS)})"
        )
    distributed = extra.pop("distributed", "auto")
    if distributed not in (True, False, "auto"):
        raise ConfigError(f'distributed must be true, false or "auto", got {distributed!r}')
    values: dict[str, Any] = {}
    for key, value in extra.items():
        if key in _SIZES and isinstance(value, str):
            value = parse_size(value, name=key)
        if key == "memory_limit" and value == -1:
            value = 1 << 62
        values[key] = value
    config = StreamConfig.from_env(
        env, **{_STREAM_FIELDS[k]: v for k, v in values.items() if k in _STREAM_FIELDS}
    )
    store = {_STORE_FIELDS[k]: v for k, v in values.items() if k in _STORE_FIELDS}
    # One "concurrency" / "chunk_size" for every backend, as the Run:ai loader's keys mean: a user
    # who sets them for an s3:// model expects them to apply there.
    for key in ("concurrency", "chunk_size"):
        if key in values and f"s3_{key}" not in values:
            store[key] = getattr(config, key)
    if store:
        config = config.replace_object_store(**store)
    return config, distributed


def use_distributed(distributed: Distributed, tensor_parallel_size: int, *, initialized: bool) -> bool:
    """Whether to split the reads across the tensor-parallel group: ``"auto"`` when TP > 1 and
    torch.distributed is up; ``True`` insists (and needs torch.distributed); ``False`` never."""
    if distributed is True and not initialized:
        raise ConfigError("distributed=true, but torch.distributed is not initialised")
    return bool(distributed) and tensor_parallel_size > 1 and initialized


def resolve_model_path(model: str) -> str | None:
    """The checkpoint location weightstream reads for vLLM's ``model`` (or ``model_weights``):
    a local folder or file, or an ``s3://`` / ``gs://`` / ``az://`` URI, taken as it is (never as
    a hub id). ``None`` for anything else: a hub id, which vLLM must download first."""
    if parse_object_uri(model) is not None:
        return model
    path = model[len("file://") :] if model.startswith("file://") else model
    if os.path.exists(path):
        return path
    return None


def weights_iterator(
    path: str,
    config: StreamConfig,
    *,
    device: str | torch.device = "cpu",
    process_group: Any = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs for ``model.load_weights``, as each tensor arrives. With
    ``process_group``, the ranks of the group split the reads (each yields every tensor)."""
    with weightstream.stream(path, device=device, config=config, process_group=process_group) as s:
        yield from s


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``weightstream`` load format."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader("weightstream")
    class WeightStreamModelLoader(BaseModelLoader):
        """Loads safetensors checkpoints with weightstream (local paths and object URIs)."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.config, self.distributed = config_from_extra(load_config.model_loader_extra_config)

        def _path(self, model_config: Any) -> str:
            model = getattr(model_config, "model_weights", None) or model_config.model
            path = resolve_model_path(model)
            if path is None:  # a hub id: vLLM's own download, safetensors only
                from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

                path = download_weights_from_hf(
                    model,
                    self.load_config.download_dir,
                    ["*.safetensors", "*.safetensors.index.json"],
                    model_config.revision,
                    ignore_patterns=self.load_config.ignore_patterns,
                )
            return str(path)

        def download_model(self, model_config: Any) -> None:
            self._path(model_config)

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            from vllm.distributed import get_tp_group

            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            group = None
            tp = get_tp_group()
            if use_distributed(
                self.distributed, tp.world_size, initialized=torch.distributed.is_initialized()
            ):
                group = tp.device_group if device.startswith("cuda") else tp.cpu_group
            model.load_weights(  # type: ignore[operator]
                weights_iterator(self._path(model_config), self.config, device=device, process_group=group)
            )
