"""Where a block's bytes go: host memory the tensors will live in, or a device through a bounded
ring of staging buffers.

The scheduler asks a sink for each block's destination (``allocate``), hands every chunk to
``fill`` on a worker thread, tells it when a block's last chunk is in (``block_done``, worker
thread) and asks for the finished buffer before yielding it (``ready``, coordinator thread).

* :class:`HostSink`: the default. Reads land straight in the block's buffer.
* :class:`StagedSink`: for a CUDA device. The block's memory is allocated on the device once;
  each chunk is read into one of a bounded ring of pinned host buffers (made as reads need them),
  copied to the device asynchronously on a side stream, and its staging buffer is reused once
  that copy has finished. Host memory is at most the ring (``slots x slot_size``) whatever the
  size of the model; the copies of one chunk overlap the reads of the next ones.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from weightstream.engine.plan import Block, Chunk
from weightstream.memory.buffers import ALIGN, allocate
from weightstream.sources.base import ReadHow, Source

__all__ = ["HostSink", "Sink", "StagedSink"]


class Sink(Protocol):
    """Where a block's bytes go (see the module docstring); whoever makes a sink closes it."""

    def allocate(self, block: Block, uri: str) -> tuple[torch.Tensor, Any]:
        """The block's destination tensor (uint8, ``block.nbytes``) and a handle ``target``
        slices per chunk."""
        ...

    def target(self, handle: Any, chunk: Chunk) -> Any:
        """What ``fill`` needs for one read (called on the worker thread that issues it: a read
        may cover several of a block's chunks)."""
        ...

    def map_ahead(self, block: Block, uri: str) -> bool:
        """Prepare the destination of a block that will be allocated later, if that costs no
        memory now (coordinator thread); ``False`` if this sink does not."""
        ...

    def drop_ahead(self) -> None:
        """Release what ``map_ahead`` prepared and no ``allocate`` took (coordinator thread)."""
        ...

    def fill(self, source: Source, chunk: Chunk, target: Any) -> tuple[int, ReadHow]:
        """Read the chunk into its destination (worker thread)."""
        ...

    def block_done(self, block: Block) -> None:
        """The block's last chunk was filled (worker thread, after its ``fill``)."""
        ...

    def ready(self, block: Block, buf: torch.Tensor) -> torch.Tensor:
        """The block's buffer, safe for the caller to use (coordinator thread)."""
        ...

    def close(self) -> None:
        """Release what the sink holds (staging buffers, streams); called once by whoever made
        the sink, when the load is over or abandoned."""
        ...


class HostSink:
    """Reads land in host memory: page-aligned buffers (huge pages from 2 MiB) that the tensors
    keep. ``allocator`` replaces the allocation (distributed rounds hand out slices of one
    buffer).

    Buffers can be mapped ahead of their blocks (``map_ahead``): an anonymous mapping costs no
    memory until it is written, but mapping it costs far more while other threads fault in fresh
    pages (the new mapping waits for the address-space lock they hold; figures in
    bench/RESULTS.md, "The measurements behind the code").
    """

    def __init__(self, allocator: Callable[[Block, str], tuple[torch.Tensor, memoryview]] | None = None):
        self._allocator = allocator
        self._ahead: dict[int, tuple[torch.Tensor, memoryview]] = {}

    def allocate(self, block: Block, uri: str) -> tuple[torch.Tensor, memoryview]:
        if self._allocator is not None:
            return self._allocator(block, uri)
        mapped = self._ahead.pop(block.index, None)
        return mapped if mapped is not None else allocate(block.nbytes, uri=uri)

    def map_ahead(self, block: Block, uri: str) -> bool:
        if self._allocator is not None:
            return False
        if block.index not in self._ahead:
            self._ahead[block.index] = allocate(block.nbytes, uri=uri)
        return True

    def drop_ahead(self) -> None:
        self._ahead.clear()

    def target(self, handle: memoryview, chunk: Chunk) -> memoryview:
        return handle[chunk.pos : chunk.pos + chunk.length]

    def fill(self, source: Source, chunk: Chunk, target: memoryview) -> tuple[int, ReadHow]:
        return source.read_into(target, offset=chunk.offset)

    def block_done(self, block: Block) -> None:
        pass

    def ready(self, block: Block, buf: torch.Tensor) -> torch.Tensor:
        return buf

    def close(self) -> None:
        self.drop_ahead()


class _Slot:
    __slots__ = ("event", "host", "view")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.view = host.numpy().data.cast("B")
        self.event: Any = None
        """The copy out of this slot; the slot is free once it has completed."""


class StagedSink:
    """Reads land in a ring of ``slots`` staging buffers of ``slot_size`` bytes and are copied
    to ``device`` asynchronously, on a side stream for CUDA.

    Memory: host at most ``slots * slot_size`` (pinned for CUDA), device the blocks themselves. A
    worker waits for a free slot, so reads in flight never exceed ``slots``. A chunk larger than a slot
    is read and copied a slot at a time.

    For a non-CUDA ``device`` the copy is synchronous and the staging buffers are ordinary page-
    aligned memory: the same ring, exercised where no GPU is present.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        slots: int,
        slot_size: int,
        uri: str | None = None,
        allocator: Callable[[Block, str], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if slots < 1 or slot_size < ALIGN or slot_size % ALIGN:
            raise ValueError(f"bad staging ring: {slots} slots of {slot_size} bytes")
        self.device = device
        self.slot_size = slot_size
        self.cuda = device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device=device) if self.cuda else None
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        self.slots = slots
        self.created = 0
        """Staging buffers made so far: made when a read finds none free, up to ``slots`` (pinning
        host memory costs time per GiB pinned, which a small or shallow load should not pay)."""
        self._uri = uri
        self._done: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._grow = threading.Lock()
        self.copies = 0
        """Host-to-device copies issued."""
        self._allocator = allocator

    def allocate(self, block: Block, uri: str) -> tuple[torch.Tensor, torch.Tensor]:
        # On the caller's (current) stream: the side stream's uses are recorded per copy below.
        if self._allocator is not None:
            buf = self._allocator(block, uri)[0]
        else:
            buf = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            # Work queued on the current stream before this allocation (e.g. a free of the same
            # memory by the caller) must finish before the side stream writes into it.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return buf, buf

    def target(self, handle: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        return handle[chunk.pos : chunk.pos + chunk.length]

    def map_ahead(self, block: Block, uri: str) -> bool:
        return False  # device memory is real memory from the start

    def drop_ahead(self) -> None:
        pass

    def fill(self, source: Source, chunk: Chunk, target: torch.Tensor) -> tuple[int, ReadHow]:
        filled = 0
        how: ReadHow = "buffered"
        for pos in range(0, chunk.length, self.slot_size):
            length = min(self.slot_size, chunk.length - pos)
            slot = self._take()
            try:
                if slot.event is not None:
                    slot.event.synchronize()  # its previous copy is done (releases the GIL)
                    slot.event = None
                n, how = source.read_into(slot.view[:length], offset=chunk.offset + pos)
                filled += n
                self._copy(target[pos : pos + n], slot, n)
            finally:
                self._free.put(slot)
            if n < length:  # the source ended (alignment padding past the end of the file)
                break
        return filled, how

    def _take(self) -> _Slot:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._grow:
            if self.created < self.slots:
                self.created += 1
                return _Slot(self._new_buffer())
        return self._free.get()  # the ring is full: wait for a slot to come back

    def _new_buffer(self) -> torch.Tensor:
        if not self.cuda:
            return allocate(self.slot_size, uri=self._uri)[0]
        host = torch.empty(self.slot_size, dtype=torch.uint8, pin_memory=True)
        if host.data_ptr() % ALIGN:
            # O_DIRECT wants 4 KiB-aligned addresses. Pinned blocks normally are (and asking for
            # more would round the block up to the next power of two).
            raw = torch.empty(self.slot_size + ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = -raw.data_ptr() % ALIGN
            host = raw[skip : skip + self.slot_size]
        return host

    def _copy(self, dst: torch.Tensor, slot: _Slot, n: int) -> None:
        if n == 0:
            return
        if not self.cuda:
            dst.copy_(slot.host[:n])
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(slot.host[:n], non_blocking=True)
            dst.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        slot.event = event
        with self._lock:
            self.copies += 1

    def block_done(self, block: Block) -> None:
        if not self.cuda:
            return
        # Every copy of this block was issued on the side stream before this point, so an
        # event recorded now completes after all of them.
        event = torch.cuda.Event()
        event.record(self._stream)
        with self._lock:
            self._done[block.index] = event

    def ready(self, block: Block, buf: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            with self._lock:
                event = self._done.pop(block.index, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        return buf

    def close(self) -> None:
        """Wait for the copies in flight (their staging buffers are about to be freed)."""
        if self.cuda:
            self._stream.synchronize()
