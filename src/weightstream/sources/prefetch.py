"""The first bytes of a file, read while its header is read: no round trip at the start of a load.

On a network file system every read waits a round trip (the seed's NFS: 188 ms on average). A
load cannot place a tensor before it has parsed the headers, so without a guess the link idles
for the header's round trip and then for the first data read's: at 188 ms and 1 GB/s that is
0.19 s of a 4.5 s load, the whole gap to fio, which parses nothing. The guess is safe because a
load of every tensor reads every byte after the header: the first bytes of the first shards,
in load order, are read speculatively from the moment the header reads are sent, and the data
reads then copy them out of memory instead of waiting.

A :class:`Prefetch` reads ``[0, length)`` of one file in parts, one thread each, and serves the
engine's reads of that range with a copy (``ctypes.memmove``, outside the GIL). A part is freed
once reads have copied every byte of it, and every part when the source closes, so the memory it
holds is at most its length, for the start of one load. A part often serves two reads (the
engine's reads are cut at other offsets than the parts), and they finish in any order: the part
stays until both have copied their bytes, else the first read, finding it gone, would send its
own request at the very end of the load and wait out one more round trip (on the emulated NFS's
tail, the load's last requests, 0.1-0.25 s after everything else). The part holding the file's
header, whose first bytes no read copies, is freed when the source closes. A part whose read fails is
simply not served: the engine's own read of that range reads it again and reports its own error
in the ordinary words, so a guess never changes what a load says or returns.

*While the open lasts* (an :class:`Allowance`): the first guess covers about one round trip of
the link, and an open that waits for a read in the latency tail (a header, the index) lasts
several. A part's thread that has read its part then reads the next one past the end, as long
as the allowance has room and is not closed, so the reads ahead in flight stay about where
they started until the open ends and the link never idles while it waits. The allowance is
closed before the load's first read: from then on the range is fixed, so no byte is both read
ahead and read by the load.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from weightstream.memory.align import ALIGN, align_up
from weightstream.sources.base import Allowance

__all__ = ["Prefetch", "part_size"]

log = logging.getLogger(__name__)

_MIN_PART = 4 << 20
_MAX_PART = 64 << 20
_PARTS = 32
"""About this many parts (threads) per prefetch: enough reads in flight to keep a link busy
over one round trip, few enough threads to start in a millisecond."""


def part_size(length: int) -> int:
    """The read size a prefetch of ``length`` bytes is cut into: about :data:`_PARTS` reads,
    each 4-64 MiB (4096-aligned)."""
    return max(_MIN_PART, min(_MAX_PART, align_up(-(-length // _PARTS))))


def _start(part: _Part) -> int:
    return part.start


@dataclass(eq=False)
class _Part:
    start: int
    end: int
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the part's memory is set, copied from or freed (parts copy in parallel)."""
    memory: mmap.mmap | None = None
    address: int = 0
    anchor: ctypes.c_char | None = None
    """Keeps the mapping's buffer exported while its address is used (freed with it)."""
    copied: list[tuple[int, int]] = field(default_factory=list)
    """The ranges of the file copied out of it so far, merged, in order."""

    def copied_out(self, start: int, end: int) -> bool:
        """Record ``[start, end)`` as copied out; whether every byte of the part now is."""
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.copied, (start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.copied = merged
        return merged[0][0] <= self.start and merged[0][1] >= self.end

    def free(self) -> None:
        memory, self.memory, self.anchor, self.address = self.memory, None, None, 0
        if memory is not None:
            with contextlib.suppress(BufferError):
                memory.close()


class Prefetch:
    """``[0, length)`` of one file, read in parts by ``read`` (the source's own read of a range
    into a buffer; it returns the bytes filled), served by :meth:`serve`."""

    def __init__(
        self,
        read: Callable[[memoryview, int], int],
        length: int,
        *,
        uri: str,
        go: threading.Event | None = None,
        allowance: Allowance | None = None,
        limit: int | None = None,
    ) -> None:
        """``go``: the reads are sent when it is set (by :meth:`start`, or by the caller for
        several prefetches at once). ``allowance``: parts may be added past ``length``, up to
        ``limit`` (the file's size), while it has room (see the module docstring)."""
        self.uri = uri
        self.end = length
        """The range read ahead is ``[0, end)`` (it grows only before the allowance closes)."""
        self._chunk = part_size(length)
        self._closed = False
        self._parts = [
            _Part(start, min(start + self._chunk, length)) for start in range(0, length, self._chunk)
        ]
        self._allowance = allowance
        self._limit = length if limit is None else max(length, limit)
        self._read = read
        self._go = go if go is not None else threading.Event()
        for part in self._parts:
            threading.Thread(
                target=self._fill, args=(part,), name="weightstream-prefetch", daemon=True
            ).start()

    def start(self) -> None:
        """Send the reads. Their threads are all started before (in ``__init__``): a thread's
        start maps its stack, which waits for the page faults of reads already running."""
        self._go.set()

    @property
    def held(self) -> int:
        """Bytes of memory the parts read and not yet copied out hold now."""
        return sum(p.end - p.start for p in self._parts if p.memory is not None)

    def _fill(self, part: _Part) -> None:
        self._go.wait()
        more: _Part | None = part
        while more is not None:
            self._fill_one(more)
            more = self._next()

    def _next(self) -> _Part | None:
        """One more part past the end, where the allowance has room (see the module docstring)."""
        allowance = self._allowance
        if allowance is None or self._closed:
            return None
        with allowance.lock:
            start = self.end
            n = min(self._chunk, self._limit - start)
            if allowance.closed or n <= 0 or allowance.left < n:
                return None
            allowance.left -= n
            part = _Part(start, start + n)
            self._parts.append(part)
            self.end = start + n
        return part

    def _fill_one(self, part: _Part) -> None:
        if self._closed:
            part.done.set()
            return
        n = part.end - part.start
        memory: mmap.mmap | None = None
        try:
            memory = mmap.mmap(-1, align_up(n), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                with contextlib.suppress(OSError):
                    memory.madvise(mmap.MADV_HUGEPAGE)
            with memoryview(memory) as view:
                filled = self._read(view, part.start)
            if filled < n:
                raise OSError(f"{filled} of {n} bytes")
        except Exception as exc:  # the engine's own read of the range says what is wrong
            log.debug("%s: bytes [%d, %d) not read ahead (%s)", self.uri, part.start, part.end, exc)
            if memory is not None:
                with contextlib.suppress(BufferError):
                    memory.close()
            memory = None
        with part.lock:
            if memory is not None and not self._closed:
                part.memory = memory
                part.anchor = ctypes.c_char.from_buffer(memory)
                part.address = ctypes.addressof(part.anchor)
                memory = None
        if memory is not None:
            with contextlib.suppress(BufferError):
                memory.close()
        part.done.set()

    def serve(self, buf: memoryview, offset: int, expected: int) -> int:
        """Copy into ``buf`` the bytes of ``[offset, offset + expected)`` read ahead, from
        ``offset`` on and without a gap (waiting for parts still being read); returns how many.
        The caller reads the rest itself."""
        done = 0
        if offset % ALIGN or offset >= self.end or not self._go.is_set():
            return 0  # (not sent: never waited for)
        target = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if expected else 0
        while done < expected:
            pos = offset + done
            if pos >= self.end:
                break
            part = self._parts[bisect.bisect_right(self._parts, pos, key=_start) - 1]
            part.done.wait()
            n = min(part.end, offset + expected) - pos
            with part.lock:
                if part.memory is None:
                    break  # failed, closed, or every byte copied out (a second load reads anew)
                ctypes.memmove(target + done, part.address + pos - part.start, n)
                if part.copied_out(pos, pos + n):
                    part.free()
            done += n
        return done

    def close(self) -> None:
        """Free every part (reads still running free theirs when they end)."""
        self._closed = True
        self._go.set()
        for part in self._parts:
            with part.lock:
                part.free()
