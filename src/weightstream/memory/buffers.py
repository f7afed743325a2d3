"""Destination buffers: the memory tensors will live in, allocated so reads can land in it.

Why not ``torch.empty``: freshly allocated memory is faulted in 4 KiB at a time by whoever
first writes it (here, the kernel copying file data in), and on a small machine that caps a
read from the page cache at a fraction of memory bandwidth per thread. Buffers of 2 MiB and more are therefore
anonymous mmaps advised ``MADV_HUGEPAGE``: one fault per 2 MiB, which is what lets a hot
(page cache) load run at memory bandwidth. Only the whole 2 MiB pages inside the buffer are
advised, so the tail never costs more than the bytes asked for. mmaps are page aligned, which
is also what ``O_DIRECT`` needs.

The returned tensor owns its memory (torch keeps the mmap object alive), so a tensor viewed out
of it stays valid for as long as the caller holds it and is freed when the caller drops it.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

from weightstream.errors import MemoryBudgetError
from weightstream.memory.align import ALIGN

__all__ = ["ALIGN", "HUGE_PAGE", "allocate"]

HUGE_PAGE = 2 << 20
_MMAP_MIN = HUGE_PAGE


def allocate(nbytes: int, *, uri: str | None = None) -> tuple[torch.Tensor, memoryview]:
    """A 4096-aligned uint8 tensor of ``nbytes`` and a writable memoryview of the same memory."""
    try:
        if nbytes >= _MMAP_MIN:
            # The kernel 2 MiB-aligns an anonymous mapping only when its length is a multiple of
            # 2 MiB; block sizes rarely are, and a misaligned buffer loses a huge page at each end
            # (measured: 6.5 instead of 8.5 GB/s per thread from the page cache). Map 2 MiB more
            # and start on a boundary; the untouched slack costs address space, not memory.
            mem = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            whole = torch.frombuffer(mem, dtype=torch.uint8)
            skip = -whole.data_ptr() % HUGE_PAGE
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # Only whole huge pages inside the buffer: a partial last one would cost a full
                # 2 MiB of memory for a few KiB of tensor.
                with contextlib.suppress(OSError):
                    mem.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE_PAGE * HUGE_PAGE)
            return whole[skip : skip + nbytes], memoryview(mem)[skip : skip + nbytes]
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % ALIGN
        tensor = raw[skip : skip + nbytes]
        return tensor, tensor.numpy().data.cast("B")
    except (MemoryError, OSError, RuntimeError) as exc:
        raise MemoryBudgetError(
            f"cannot allocate a {nbytes}-byte destination buffer: {exc}", uri=uri
        ) from exc
