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

import logging
from typing import Any

import numpy as np
import torch

from weightstream.checkpoint import Checkpoint, check_torch_type, open_checkpoint
from weightstream.config import StreamConfig
from weightstream.devices import Device, device_of
from weightstream.engine.delivery import torch_type
from weightstream.engine.verify import InOrder, Verifier, verifier_for
from weightstream.errors import ConfigError, NotFoundError
from weightstream.format.safetensors import TensorEntry
from weightstream.memory.buffers import ALIGN, allocate
from weightstream.sources.base import Versioned
from weightstream.uri import UriLike

__all__ = ["SafeOpen", "TensorSlice", "safe_open"]

log = logging.getLogger(__name__)


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
        self._said = False
        """Whether the log said that slices are read unchecked."""

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
        through the shard's open source (one aligned range read).

        With ``verify="on"`` the read covers the checksummed pieces the bytes lie in (the whole
        file, for a checksum of the whole), which are checked before anything is handed over.
        Otherwise a slice is read as is (``get_tensor`` is checked as a load is); the log says
        so once."""
        out = torch.empty(end - start, dtype=torch.uint8)
        if end > start:
            shard = self.checkpoint.shard_of(entry)
            source = shard.source
            if isinstance(source, Versioned):
                source.verify()  # as get_tensor's load does: the file must be the one validated
            lo, hi = start, end
            check = None
            if shard.digest is not None and self.checkpoint.config.verify == "on":
                check = verifier_for(shard.location.uri, shard.digest, b"", hold_max=1 << 62)
                lo, hi = _checked_span(check, start, end)
            elif shard.digest is not None and not self._said:
                self._said = True
                log.info(
                    "%s: slices are read unchecked (verify='on' checks the pieces they lie in)",
                    self.checkpoint.uri,
                )
            lo, hi = lo - lo % ALIGN, -(-hi // ALIGN) * ALIGN
            buf, view = allocate(hi - lo, uri=entry.uri)
            source.read_into(view, offset=lo)
            if check is not None:
                # Raises on a mismatch; a composite found not to be the pieces read is left
                # unchecked, and the log says why (as a load does).
                check.add(view[: min(hi, shard.size) - lo], lo)
            np.copyto(out.numpy(), buf.numpy()[start - lo : end - lo])
        return out


def _checked_span(check: Verifier | InOrder, start: int, end: int) -> tuple[int, int]:
    """The bytes to read so that ``[start, end)`` can be checked: the pieces it lies in, or the
    whole file where its checksum is of the whole (a hash in order, an S3 composite)."""
    digest = check.digest
    if isinstance(check, InOrder) or digest.composite:
        return 0, digest.size
    return digest.piece(digest.index(start))[0], digest.piece(digest.index(end - 1))[1]


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
        """``tensor[index]`` as torch (and safetensors) answer it, every error included: integers
        (Python, numpy, 0-d tensors), slices, ``...`` (more than one, as torch takes them),
        ``None``, booleans, and lists, arrays or 1-d tensors of indices or a mask. Only the rows of
        the first dimension the index touches are read (one range read); anything more exotic
        on the first dimension reads the whole tensor, and answers the same."""
        entry = self._entry
        dtype, shape = torch_type(entry)
        items = index if isinstance(index, tuple) else (index,)
        # The result's shape, and every index error, exactly as torch gives them: on a tensor of
        # zeros expanded to the shape (a view of one element for basic indices).
        probe = torch.zeros((), dtype=torch.uint8).expand(shape)
        try:
            wanted = probe[index].shape
        except (IndexError, ValueError):
            raise
        except (TypeError, RuntimeError) as exc:
            raise ConfigError(f"bad slice index {index!r:.80}: {exc}", setting="index") from None
        if wanted.numel() == 0:
            return torch.empty(wanted, dtype=dtype, device=self._handle.device)
        first = _first_dim(items, len(shape))
        rows = None if first is None else _rows(items[first], shape[0])
        if rows is None:  # the whole tensor, indexed as it is
            result = self._whole(dtype, shape)[index]
        else:
            assert first is not None
            lo, hi, shifted = rows
            row_bytes = entry.nbytes // shape[0]
            raw = self._handle._read(entry, entry.start + lo * row_bytes, entry.start + hi * row_bytes)
            block = raw.view(dtype).view(hi - lo, *shape[1:])
            result = block[items[:first] + (shifted,) + items[first + 1 :]]  # noqa: RUF005 (Python 3.10)
        result = result.contiguous()
        if result.untyped_storage().nbytes() != result.nbytes:
            result = result.clone()  # a tensor of exactly its bytes, like every tensor weightstream returns
        return result.to(self._handle.device)

    def _whole(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raw = self._handle._read(self._entry, self._entry.start, self._entry.end)
        return raw.view(dtype).view(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def _as_int(item: Any) -> int | None:
    """``item`` as a Python int when torch takes it as one integer index (an int, a numpy
    integer, a 0-d integer tensor), else ``None``."""
    if isinstance(item, bool | np.bool_):
        return None
    if isinstance(item, int | np.integer):
        return int(item)
    if isinstance(item, torch.Tensor) and item.ndim == 0 and not item.dtype.is_floating_point:
        return None if item.dtype == torch.bool else int(item)
    return None


def _scalar_bool(item: Any) -> bool:
    return isinstance(item, bool) or (
        isinstance(item, torch.Tensor) and item.ndim == 0 and item.dtype == torch.bool
    )


def _first_dim(items: tuple[Any, ...], ndim: int) -> int | None:
    """The position in ``items`` of the one that indexes the first dimension, or ``None`` when
    the first dimension is not indexed by a single item (taken whole by ``...`` or by nothing)."""
    for i, item in enumerate(items):
        if item is None or _scalar_bool(item):
            continue  # a new dimension: consumes none of the tensor's
        if item is Ellipsis:
            consumed = sum(
                1 for it in items if it is not None and it is not Ellipsis and not _scalar_bool(it)
            )
            if ndim - consumed > 0:
                return None  # the ellipsis takes the first dimension (with others) whole
            continue  # it covers no dimension here
        return i if ndim > 0 else None
    return None


def _rows(item: Any, n: int) -> tuple[int, int, Any] | None:
    """``(lo, hi, shifted)``: the rows ``[lo, hi)`` that ``item`` (indexing a first dimension of
    ``n`` rows, already checked by torch) touches, and the item re-based to index the block of
    those rows. ``None`` for an item to be answered on the whole tensor."""
    k = _as_int(item)
    if k is not None:
        row = k + n if k < 0 else k
        return row, row + 1, 0
    if isinstance(item, slice):
        start, stop, step = item.indices(n)
        picked = range(start, stop, step)
        return picked[0], picked[-1] + 1, slice(0, picked[-1] + 1 - picked[0], step)
    if isinstance(item, list | np.ndarray | torch.Tensor):
        t = torch.as_tensor(np.asarray(item) if isinstance(item, list) else item)
        if t.ndim != 1 or t.numel() == 0:
            return None
        if t.dtype == torch.bool:
            where = t.nonzero().reshape(-1)
            lo, hi = int(where.min()), int(where.max()) + 1
            return lo, hi, t[lo:hi]
        if t.dtype.is_floating_point or t.dtype.is_complex:
            return None
        t = t.to(torch.int64)
        t = torch.where(t < 0, t + n, t)
        lo, hi = int(t.min()), int(t.max()) + 1
        return lo, hi, t - lo
    return None
