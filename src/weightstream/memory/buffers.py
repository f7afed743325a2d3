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
import ctypes
import ctypes.util
import mmap
from collections.abc import Iterable

import torch

from weightstream.errors import MemoryBudgetError
from weightstream.memory.align import ALIGN

__all__ = ["ALIGN", "HUGE_PAGE", "advise_huge_pages", "allocate"]

HUGE_PAGE = 2 << 20
_MMAP_MIN = HUGE_PAGE


def allocate(nbytes: int, *, uri: str | None = None) -> tuple[torch.Tensor, memoryview]:
    """A 4096-aligned uint8 tensor of ``nbytes`` and a writable memoryview of the same memory."""
    try:
        if nbytes >= _MMAP_MIN:
            # The kernel 2 MiB-aligns an anonymous mapping only when its length is a multiple of
            # 2 MiB; block sizes rarely are, and a misaligned buffer loses a huge page at each end
            # (a copy from the page cache into it runs about a quarter slower; bench/RESULTS.md). Map 2 MiB more
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


_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_madvise: ctypes._CFuncPtr | None  # type: ignore[name-defined]
try:
    _madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # no libc madvise: the advice is only an optimisation
    _madvise = None


def advise_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Advise ``MADV_HUGEPAGE`` over the whole 2 MiB pages of host tensors that someone else
    allocated (a model's parameters, before a loader copies weights into them); returns the
    bytes advised.

    Memory from ``torch.empty`` is faulted in 4 KiB at a time by its first writer; where
    transparent huge pages are on ``madvise`` (the usual default), the copy of every weight into
    a fresh parameter then costs a fault per 4 KiB, and on a VM a host fault too: measured, a
    hot vLLM load spends most of its weights time there (bench/RESULTS.md, vLLM). Pages already
    touched keep their size; the advice changes nothing else (no data is moved or lost).
    """
    if _madvise is None:
        return 0
    done = 0
    seen: set[int] = set()
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse:
            continue
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start in seen or not start:
            continue
        seen.add(start)
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if hi > lo and _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0:
            done += hi - lo
    return done
