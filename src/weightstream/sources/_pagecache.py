"""How much of a file range is in the page cache, without reading it.

Why not "try a buffered read with RWF_NOWAIT, fall back to O_DIRECT": on Linux a NOWAIT read
of an uncached range returns EAGAIN *and* starts readahead of that range, so the O_DIRECT read
that follows reads the device a second time.

Preferred: ``cachestat(2)`` (Linux 6.5+) counts the cached pages of a file range in the kernel,
with no mapping. Fallback: map the range and ask ``mincore(2)``; that works everywhere but the
``munmap`` costs a TLB shootdown across the reader threads (a hot load loses about a third of its
speed with 16 readers), so it is used only where cachestat is missing. Figures: bench/RESULTS.md,
"The measurements behind the code".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import platform

__all__ = ["resident_fraction"]

_PAGE = mmap.PAGESIZE
# cachestat has the same number on every architecture that uses the unified syscall table.
_SYS_CACHESTAT = (
    451 if platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x") else None
)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    ]


_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    _libc.syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # not Linux/glibc-like: callers fall back to buffered reads
    _libc = None

_MAP_FAILED = ctypes.c_void_p(-1).value
_have_cachestat = _SYS_CACHESTAT is not None and _libc is not None


def _cachestat(fd: int, offset: int, length: int) -> float | None:
    global _have_cachestat
    assert _libc is not None and _SYS_CACHESTAT is not None
    rng, st = _Range(offset, length), _Stat()
    rc = _libc.syscall(
        _SYS_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st), ctypes.c_uint(0)
    )
    if rc != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # old kernel, or blocked by seccomp
            _have_cachestat = False
        return None
    pages = (offset % _PAGE + length + _PAGE - 1) // _PAGE
    return min(1.0, st.nr_cache / pages)


def _mincore(fd: int, offset: int, length: int) -> float | None:
    assert _libc is not None
    start = offset - offset % _PAGE
    span = offset + length - start
    addr = _libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        pages = (span + _PAGE - 1) // _PAGE
        vec = ctypes.create_string_buffer(pages)
        if _libc.mincore(addr, span, vec) != 0:
            return None
        # The kernel sets the low bit of each byte for a resident page and leaves the rest 0.
        return 1.0 - vec.raw[:pages].count(0) / pages
    finally:
        _libc.munmap(addr, span)


_SAMPLES = 8
_WINDOW = 64 << 10


def resident_fraction(fd: int, offset: int, length: int) -> float | None:
    """Fraction (0..1) of ``[offset, offset+length)`` of ``fd`` in the page cache.

    Ranges over ``8 x 64 KiB`` are estimated from 8 evenly spaced 64 KiB windows: both calls
    cost about 22 ns per page walked (90 us for a whole 16 MiB chunk, 15 % of the time it takes
    to copy that chunk from the cache), and the caller only needs "mostly cached or not". A wrong
    estimate only picks the slower of two correct ways to read.
    ``None`` when it cannot be told (no cachestat or mincore, or the file cannot be mapped).
    """
    if _libc is None or length <= 0:
        return None
    if length <= _SAMPLES * _WINDOW:
        windows = [(offset, length)]
    else:
        step = (length - _WINDOW) // (_SAMPLES - 1)
        windows = [(offset + i * step, _WINDOW) for i in range(_SAMPLES)]
    total = 0.0
    for off, n in windows:
        got = _cachestat(fd, off, n) if _have_cachestat else None
        if got is None:
            got = _mincore(fd, off, n)
        if got is None:
            return None
        total += got * n
    return total / sum(n for _, n in windows)
