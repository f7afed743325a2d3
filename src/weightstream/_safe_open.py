"""``weightstream.safe_open``: the handle safetensors users reach for, with partial reads.

    with weightstream.safe_open("model.safetensors") as f:
        names = f.keys()
        bias = f.get_tensor("lm_head.bias")
        rows = f.get_slice("embed.weight")[rank * n : (rank + 1) * n]   # reads those rows only

The same semantics as ``safetensors.safe_open(path, framework="pt")`` (keys sorted, ``metadata()``
``None`` when the file has none, slices indexed as torch indexes a tensor: integers, slices with
steps and negative bounds, ``...``), over any location weightstream reads: a file, a folder, an
index, an object-store URI. ``get_slice(...)[index]`` reads only the rows of the first dimension
that the index touches (one range read), which is what tensor-parallel loaders need, and
returns a tensor that owns exactly its bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from weightstream.checkpoint import Checkpoint, Device, check_torch_type, open_checkpoint
from weightstream.config import StreamConfig
from weightstream.engine.delivery import torch_type
from weightstream.errors import ConfigError, NotFoundError
from weightstream.format.safetensors import TensorEntry
from weightstream.memory.buffers import ALIGN, allocate
from weightstream.pipeline import device_of
from weightstream.sources.base import Versioned
from weightstream.uri import UriLike

__all__ = ["SafeOpen", "TensorSlice", "safe_open"]


def safe_open(
    uri: UriLike, framework: str = "pt", device: Device = "cpu", *, config: StreamConfig | None = None
) -> SafeOpen:
    """Open a checkpoint's headers for reading tensors one by one; see the module docstring."""
    if framework not in ("pt", "torch"):
        raise ConfigError(f"framework must be 'pt' (torch), got {framework!r}", setting="framework")
    dev = device_of(device)  # before any I/O
    return SafeOpen(open_checkpoint(uri, config=config), device=dev)


class SafeOpen:
    """A checkpoint opened for reading single tensors and slices (use as a context manager)."""

    def __init__(self, checkpoint: Checkpoint, *, device: Device = "cpu") -> None:
        self.checkpoint = checkpoint
        self.device = device_of(device)

    def keys(self) -> list[str]:
        """Every tensor name, sorted (as safetensors lists them)."""
        return sorted(self.checkpoint.tensors)

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` of the file (of the index for a sharded checkpoint); ``None``
        when there is none."""
        return dict(self.checkpoint.metadata) or None

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, read with the engine (many reads in flight for a large one)."""
        return self.checkpoint.load(device=self.device, tensors=[self._entry(name).name])[name]

    def get_slice(self, name: str) -> TensorSlice:
        """A handle on the tensor whose indexing reads only what the index needs."""
        return TensorSlice(self, self._entry(name))

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _entry(self, name: str) -> TensorEntry:
        if not isinstance(name, str):
            raise ConfigError(
                f"a tensor name must be a str, got {type(name).__name__} {name!r:.80}", setting="name"
            )
        entry = self.checkpoint.tensors.get(name)
        if entry is None:
            raise NotFoundError(f"checkpoint has no tensor {name!r}", uri=self.checkpoint.uri, tensor=name)
        check_torch_type(entry)
        return entry

    def _read(self, entry: TensorEntry, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` of the file of ``entry``, as a uint8 tensor of its own, read
        through the shard's open source (one aligned range read)."""
        out = torch.empty(end - start, dtype=torch.uint8)
        if end > start:
            source = self.checkpoint.shard_of(entry).source
            if isinstance(source, Versioned):
                source.verify()  # as get_tensor's load does: the file must be the one validated
            lo, hi = start - start % ALIGN, -(-end // ALIGN) * ALIGN
            buf, view = allocate(hi - lo, uri=entry.uri)
            source.read_into(view, offset=lo)
            np.copyto(out.numpy(), buf.numpy()[start - lo : end - lo])
        return out


class TensorSlice:
    """``f.get_slice(name)``: its shape and dtype, and ``[index]`` to read part of it."""

    def __init__(self, handle: SafeOpen, entry: TensorEntry) -> None:
        self._handle = handle
        self._entry = entry

    def get_shape(self) -> list[int]:
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        """The safetensors dtype name (``"BF16"``, ``"F32"``, ...)."""
        return self._entry.dtype.name

    def __getitem__(self, index: Any) -> torch.Tensor:
        entry = self._entry
        dtype, shape = torch_type(entry)
        items = _expand(index, len(shape))
        # The result's shape, and every index error, exactly as torch gives them.
        wanted = torch.empty(shape, dtype=dtype, device="meta")[items].shape
        if not shape or wanted.numel() == 0:
            if not shape:
                return self._whole(dtype, shape)[items].clone().to(self._handle.device)
            return torch.empty(wanted, dtype=dtype, device=self._handle.device)
        rows = torch.arange(shape[0])[items[0]].reshape(-1)
        first, last = int(rows.min()), int(rows.max()) + 1
        row_bytes = entry.nbytes // shape[0]
        raw = self._handle._read(entry, entry.start + first * row_bytes, entry.start + last * row_bytes)
        block = raw.view(dtype).view(last - first, *shape[1:])
        if isinstance(items[0], int):  # the first dimension goes: index the rest of that row
            picked = block[int(rows[0]) - first][items[1:]]
        else:  # the rows asked for (every one of the block, or some of them), then the rest
            if len(rows) != last - first or int(rows[0]) != first:
                block = block.index_select(0, rows - first)
            picked = block[(slice(None),) + tuple(items[1:])]  # noqa: RUF005 (Python 3.10)
        result = picked.contiguous()
        if result.untyped_storage().nbytes() != result.nbytes:
            result = result.clone()  # a tensor of exactly its bytes, like every tensor weightstream returns
        return result.to(self._handle.device)

    def _whole(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raw = self._handle._read(self._entry, self._entry.start, self._entry.end)
        return raw.view(dtype).view(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def _expand(index: Any, ndim: int) -> tuple[Any, ...]:
    """``index`` as one item per dimension (``...`` expanded, missing ones full slices); only the
    basic indexing safetensors slices take: integers, slices and one ``...``."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if not (
            item is Ellipsis
            or isinstance(item, slice)
            or (isinstance(item, int) and not isinstance(item, bool))
        ):
            raise ConfigError(
                f"a slice index must hold integers, slices and '...', got {type(item).__name__}",
                setting="index",
            )
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = ndim - (len(items) - 1)
        items = items[:at] + (slice(None),) * max(fill, 0) + items[at + 1 :]
    if len(items) > ndim:
        raise IndexError(f"too many indices for tensor of dimension {ndim}")
    return items + (slice(None),) * (ndim - len(items))
