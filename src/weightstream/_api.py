"""The two entry points, :func:`load` and :func:`stream` (re-exported by the package)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weightstream.checkpoint import Checkpoint, checked_config, checked_names, open_checkpoint
from weightstream.config import StreamConfig
from weightstream.devices import device_of
from weightstream.distributed import Distributed as _Distributed
from weightstream.engine.exchange import LocalExchange
from weightstream.pipeline import TensorStream, opening
from weightstream.uri import UriLike, check_uri

__all__ = ["load", "stream"]


def load(
    uri: UriLike,
    *,
    device: str | torch.device = "cpu",
    config: StreamConfig | None = None,
    tensors: Iterable[str] | None = None,
    process_group: Any = None,
    distributed: _Distributed = False,
) -> dict[str, torch.Tensor]:
    """Read a checkpoint (or the ``tensors`` named) into a dict of tensors on ``device``.

    ``uri``: a ``.safetensors`` file, a folder (with ``model.safetensors.index.json`` or
    ``*.safetensors`` files), an index file, a ``file://`` URI, or a list of files.
    ``config`` defaults to :meth:`StreamConfig.from_env`. Returns only once every tensor is in;
    any failure raises a :class:`~weightstream.errors.WeightStreamError` and returns nothing.

    Distributed: with ``process_group`` (a torch.distributed group this rank belongs to), or
    ``distributed=True`` (the default group) or ``"auto"`` (the default group when
    torch.distributed is initialised with more than one rank), every rank of the group must make
    the same call. Each reads about 1/N of the bytes and receives the rest from the others over
    the group (gloo for CPU tensors, NCCL for CUDA ones); every rank returns every tensor. A
    failure on any rank raises on all of them (:class:`~weightstream.errors.DistributedError` on
    the others, naming the failed rank and its error).
    """
    tensors = _check_arguments(uri, device, config, tensors)
    with opening(process_group, distributed, config, device) as load:
        # Every tensor, read by this process alone: every byte after the headers is read, so
        # the first ones can be read while the headers are (on a network file system).
        whole = tensors is None and isinstance(load.exchange, LocalExchange)
        ckpt = open_checkpoint(uri, config=load.config, prefetch=whole)
        with _closed_on_failure(ckpt):
            s = ckpt.open_stream(load, tensors, owned=True)
    return ckpt.collect(s)


def stream(
    uri: UriLike,
    *,
    device: str | torch.device = "cpu",
    config: StreamConfig | None = None,
    tensors: Iterable[str] | None = None,
    process_group: Any = None,
    distributed: _Distributed = False,
    borrow_cached: bool = False,
) -> TensorStream:
    """Yield ``(name, tensor)`` pairs as each tensor's bytes arrive (completion order).

    Headers are read and validated before this returns. A yielded tensor belongs to the caller:
    it is never overwritten or freed afterwards, so there is no need to ``clone()`` it. Bytes read
    but not yet yielded stay under ``config.memory_limit``; the returned
    :class:`TensorStream` exposes ``stats`` and can be closed early to cancel the rest.

    ``process_group`` / ``distributed``: as for :func:`load`. Every rank yields the same tensors
    in the same order; a rank that closes its stream early makes the others raise.

    ``borrow_cached=True`` (for a consumer that copies each tensor into memory of its own, as
    vLLM's ``load_weights`` does): CPU tensors of local files that the page cache already holds
    are views of a private mapping of the file instead of a copy; the rest is read as usual.
    The file is mapped only under a read lease, so no other process can write or truncate it
    while the stream runs; one that tries makes the stream raise
    :class:`~weightstream.errors.ReadError` before anything changes. A view stays readable as
    long as it is held, after the stream too, but its bytes are promised unchanged only until the
    stream ends (see :mod:`weightstream.sources.mapping`). Not for distributed loads (ignored there).
    """
    tensors = _check_arguments(uri, device, config, tensors)
    with opening(process_group, distributed, config, device) as load:
        ckpt = open_checkpoint(uri, config=load.config)
        with _closed_on_failure(ckpt):
            return ckpt.open_stream(load, tensors, borrow_cached=borrow_cached, owned=True)


@contextlib.contextmanager
def _closed_on_failure(ckpt: Checkpoint) -> Iterator[None]:
    """Close ``ckpt`` if the stream over it could not be made (the stream closes it otherwise)."""
    try:
        yield
    except BaseException:
        ckpt.close()
        raise


def _check_arguments(
    uri: object, device: object, config: object, tensors: Iterable[str] | None
) -> list[str] | None:
    """Every argument checked before any I/O (a :class:`ConfigError` naming it); ``tensors`` is
    read once, here (it may be a one-shot iterator)."""
    check_uri(uri)
    device_of(device)  # type: ignore[arg-type]
    if config is not None:
        checked_config(config)
    return None if tensors is None else checked_names(tensors)
