"""Where a load's bytes go and how its tensors are handed over, for one device: the device and
sink policy in one room.

* CPU: reads land in host buffers the tensors keep (:class:`HostSink`).
* CUDA: reads go through a bounded ring of pinned staging buffers straight into device memory
  (:class:`StagedSink`).
* Other devices: into host memory, then each tensor is moved (``tensor.to(device)``).

Every tensor handed over has a storage of exactly its own bytes (see :meth:`Delivery.tensors`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from weightstream.engine.plan import Block
from weightstream.engine.sink import HostSink, Sink, StagedSink
from weightstream.format.safetensors import TensorEntry
from weightstream.memory.buffers import allocate

__all__ = ["Allocator", "Delivery", "torch_type"]

Allocator = Callable[[Block, str], tuple[torch.Tensor, Any]]
"""Gives a block its destination instead of the sink's own allocation (distributed rounds hand
out slices of one buffer)."""

_STAGING_SLOT = 16 << 20


class Delivery:
    """The device policy of one load: its sink, its exchange buffers, its tensors."""

    def __init__(
        self,
        device: torch.device,
        *,
        uri: str,
        chunk_size: int,
        memory_limit: int,
        concurrency: int,
        on_copy: Callable[[int], None] | None = None,
    ):
        """``on_copy(n)``: a copy of ``n`` bytes was made beside a block while handing its tensors
        over (counted in the load's peak)."""
        self.device = device
        self._on_copy = on_copy
        self.uri = uri
        self._chunk_size = chunk_size
        self._memory_limit = memory_limit
        self._concurrency = concurrency
        self._move = device.type not in ("cpu", "cuda")

    def make_sink(self, allocator: Allocator | None = None) -> Sink:
        """A new sink for this device; whoever makes one closes it."""
        if self.device.type != "cuda":
            return HostSink(allocator)
        # Staging buffers of up to 16 MiB (a larger chunk is staged in pieces): enough per copy
        # to run at the link's speed, small enough that the ring stays small. Up to two per read
        # in flight at the start, within half the memory budget (the other half: device blocks
        # not yet handed over). Made as needed, not up front.
        slot = min(self._chunk_size, _STAGING_SLOT)
        slots = max(1, min(self._memory_limit // 2 // slot, 2 * self._concurrency))
        return StagedSink(self.device, slots=slots, slot_size=slot, uri=self.uri, allocator=allocator)

    def allocate_round(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """One buffer for a distributed round (device memory for CUDA, else aligned host memory)."""
        if self.device.type == "cuda":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return buf, buf
        return allocate(nbytes, uri=self.uri)

    def tensors(self, block: Block, buf: torch.Tensor) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
        """The block's tensors on the device, each with a storage of its own.

        A block packs neighbouring tensors into one buffer (one read, one allocation). Views of
        that buffer would share one storage, and code that treats tensors as independent breaks
        on that: ``torch.save`` refuses a storage viewed as two dtypes, pickling writes the whole
        block once per tensor, ``torch.multiprocessing`` moves the whole block. So on the host
        each tensor gets a storage of exactly its own bytes, over the block's memory (no copy;
        every storage keeps the block alive, and the block is freed when the last of them goes).
        Device memory cannot be aliased that way from Python: a tensor that would share its
        device block with others is copied out of it (device-to-device, once; the block is then
        freed), and a tensor alone in its block stays a view of it.
        """
        for entry, tensor in _own_tensors(block, buf, self._on_copy):
            yield entry, tensor.to(self.device) if self._move else tensor


def _own_tensors(
    block: Block, buf: torch.Tensor, on_copy: Callable[[int], None] | None
) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
    if buf.device.type == "cpu":
        moved = len(block.tensors) == 1 and _align_in_place(buf, block.tensors[0], block.start)
        host = buf.numpy()  # exports the block's memory; each storage below holds a reference
        for entry in block.tensors:
            yield entry, _host_tensor(host, entry, block.start, on_copy, moved=moved)
        return
    shared = len(block.tensors) > 1 or buf.untyped_storage().nbytes() > buf.nbytes
    for entry in block.tensors:
        dtype, shape = torch_type(entry)
        if entry.nbytes == 0:
            yield entry, torch.empty(shape, dtype=dtype, device=buf.device)
            continue
        off = entry.start - block.start
        raw = buf[off : off + entry.nbytes]
        if shared or off % dtype.itemsize:
            raw = raw.clone()
        yield entry, raw.view(dtype).view(shape)


def _align_in_place(buf: torch.Tensor, entry: TensorEntry, base: int) -> bool:
    """A tensor alone in its block, at an offset its dtype cannot be viewed at (the file placed it
    so; safetensors' own writer never does): its bytes are moved a few bytes left inside the same
    buffer (over the alignment padding before it), so it is viewed in place. Copying it out would
    hold it twice (a 3 GiB tensor as 6 GiB) until the block is freed."""
    dtype = entry.dtype.torch
    off = entry.start - base
    if dtype is None or entry.nbytes == 0 or not off % dtype.itemsize:
        return False
    start = buf.data_ptr()
    ctypes.memmove(start + off - off % dtype.itemsize, start + off, entry.nbytes)  # overlapping: memmove
    return True


def _host_tensor(
    host: Any,
    entry: TensorEntry,
    base: int,
    on_copy: Callable[[int], None] | None = None,
    *,
    moved: bool = False,
) -> torch.Tensor:
    """``moved``: the block's one tensor was moved to its dtype's alignment (_align_in_place)."""
    dtype, shape = torch_type(entry)
    if entry.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    off = entry.start - base
    if moved:
        off -= off % dtype.itemsize
    raw = torch.frombuffer(host, dtype=torch.uint8, count=entry.nbytes, offset=off)
    if raw.data_ptr() % dtype.itemsize:
        # The file places this tensor, among others of its block, at an offset its dtype cannot
        # be viewed at: copy it once into aligned memory of its own (at most a block's worth, a
        # read's size; counted in the load's peak). numpy's copy: one thread, no torch pool.
        own = torch.empty(entry.nbytes, dtype=torch.uint8)
        np.copyto(own.numpy(), raw.numpy())
        if on_copy is not None:
            on_copy(entry.nbytes)
        raw = own
    return raw.view(dtype).view(shape)


def torch_type(entry: TensorEntry) -> tuple[torch.dtype, tuple[int, ...]]:
    """The entry's torch dtype and shape (checked when the load was planned)."""
    dtype, shape = entry.dtype.torch, entry.torch_shape
    assert dtype is not None and shape is not None  # checked when the load was planned
    return dtype, shape
