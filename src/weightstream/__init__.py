"""weightstream: stream safetensors checkpoints into tensors at the full bandwidth of the storage.

>>> import weightstream
>>> tensors = weightstream.load("/models/llama/")                  # dict name -> tensor
>>> for name, t in weightstream.stream("/models/llama/"):          # as each tensor arrives
...     model.load_state_dict({name: t}, strict=False)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weightstream import errors
from weightstream._checkpoint import Checkpoint, LoadStats, TensorStream, open_checkpoint
from weightstream.config import StreamConfig
from weightstream.uri import UriLike

__all__ = [
    "Checkpoint",
    "LoadStats",
    "StreamConfig",
    "TensorStream",
    "__version__",
    "errors",
    "load",
    "open_checkpoint",
    "stream",
]

__version__ = "0.1.0"


def load(
    uri: UriLike,
    *,
    device: str | torch.device = "cpu",
    config: StreamConfig | None = None,
    tensors: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Read a checkpoint (or the ``tensors`` named) into a dict of tensors on ``device``.

    ``uri``: a ``.safetensors`` file, a folder (with ``model.safetensors.index.json`` or
    ``*.safetensors`` files), an index file, a ``file://`` URI, or a list of files.
    ``config`` defaults to :meth:`StreamConfig.from_env`. Returns only once every tensor is in;
    any failure raises a :class:`~weightstream.errors.WeightStreamError` and returns nothing.
    """
    return open_checkpoint(uri, config=config).load(device=device, tensors=tensors)


def stream(
    uri: UriLike,
    *,
    device: str | torch.device = "cpu",
    config: StreamConfig | None = None,
    tensors: Iterable[str] | None = None,
) -> TensorStream:
    """Yield ``(name, tensor)`` pairs as each tensor's bytes arrive (completion order).

    Headers are read and validated before this returns. A yielded tensor belongs to the caller:
    it is never overwritten or freed afterwards, so there is no need to ``clone()`` it. Bytes read
    but not yet yielded stay under ``config.memory_limit``; the returned
    :class:`TensorStream` exposes ``stats`` and can be closed early to cancel the rest.
    """
    return open_checkpoint(uri, config=config).stream(device=device, tensors=tensors)
