"""Tensors that view the page cache: a local file mapped under a read lease.

When a checkpoint's bytes are already in the page cache, a consumer that copies every tensor
into memory of its own anyway (vLLM's ``load_weights`` copies each into its parameter) gains
nothing from a loader that first copies them out of the cache into fresh memory: that is a second
copy, and first touches of fresh pages, on the cores the consumer needs. ``stream(...,
borrow_cached=True)`` hands such a consumer views of a mapping of the file instead, for the
blocks the cache holds; cold blocks are read as before (``O_DIRECT``, the storage's depth).

A mapping is only as good as the file under it: a file truncated under a mapping raises SIGBUS
when a page past the new end is touched (the process dies), and one rewritten in place changes
the tensors' bytes silently. So a file is mapped only under a **read lease** (``F_SETLEASE``):
while it is held, the kernel blocks any other open for writing and any truncation of the file
(for up to ``/proc/sys/fs/lease-break-time``, 45 s by default) and marks the lease as breaking.
The stream checks the lease after each block's tensors are taken (``F_GETLEASE``: one system
call) and at the end, and fails the load with a :class:`~weightstream.errors.ReadError` when a
writer is waiting; it lets the writer go only after that (closing the lease). So every byte
handed out is the byte the header was read with, and no writer gets in while a view is used.
The break is polled, never signalled (:func:`~weightstream.localfs.read_lease`: the default
action of the ``SIGIO`` a break sends is to end the process).

Where the kernel refuses a lease (a file open for writing somewhere, one this user does not own
without ``CAP_LEASE``, file systems without leases such as NFS and FUSE), nothing is mapped and the
file is read as usual. The mapping is private and writable: a consumer that writes into a view
writes into its own copy of the page (copy-on-write), never into the file or the cache.

A view stays readable for as long as anything holds it, after the stream too: the pages stay
mapped until the last view of them is gone (each view holds a ``memoryview`` of the mapping;
``torch.frombuffer`` alone keeps the mapping object but not its buffer, and a mapping closed
under a view crashed the process on the next touch). Its bytes are promised unchanged until the
stream ends. A file whose views were all taken is let go (lease and mapping) once none of them is
held any more, so a consumer that copies each tensor at once, as vLLM's loader does, lets each
file go while the load goes on; after the stream's end the lease is gone, and a writer may change
the file under a view still held (truncating it makes the next touch of a page past the end a
SIGBUS). Replacing the file by a rename, as downloaders and ``save_file`` do, never touches the
mapped inode.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from typing import TYPE_CHECKING

from weightstream.localfs import read_lease
from weightstream.sources._pagecache import resident_fraction

if TYPE_CHECKING:
    import torch

__all__ = ["FileMapping", "cached_fraction"]

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)


def cached_fraction(path: str) -> float:
    """The share (0..1) of a local file the page cache holds (sampled: ``resident_fraction``);
    0 for an object URI or a file that cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return 0.0
    try:
        size = os.fstat(fd).st_size
        got = resident_fraction(fd, 0, size) if size else 1.0
    finally:
        os.close(fd)
    return got if got is not None else 0.0


class FileMapping:
    """One local file mapped read-only for the length of a load, under a read lease."""

    def __init__(self, fd: int, mem: mmap.mmap, size: int, uri: str) -> None:
        self._fd, self.size, self.uri = fd, size, uri
        self._mem: mmap.mmap | None = mem
        self.reads_pending = False
        """Blocks of this file are read, not lent: the lease is held to the end of the load."""

    @classmethod
    def open(cls, path: str, *, version: str | None, identity: object) -> FileMapping | None:
        """The file mapped under a read lease, or ``None`` where the kernel refuses the lease or
        the file is not the one whose header was read (``version``: ``identity(fstat)`` then;
        the usual read path then says how it changed)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if read_lease(fd) is not True:  # no signal on a break: the stream polls for it
                raise OSError("no lease")
            # Checked under the lease: a write that came between the header's read and the
            # lease is seen here, and none can come after it.
            st = os.fstat(fd)
            if version is None or identity(st) != version or st.st_size == 0:  # type: ignore[operator]
                raise OSError("changed")
            mem = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            os.close(fd)  # closing the descriptor gives the lease back
            return None
        return cls(fd, mem, st.st_size, path)

    def resident(self, start: int, end: int) -> bool:
        """Whether the page cache holds ``[start, end)`` (sampled: see ``resident_fraction``)."""
        end = min(end, self.size)
        if end <= start:
            return False
        got = resident_fraction(self._fd, start, end - start)
        return got is not None and got >= 0.999

    def intact(self) -> bool:
        """Whether the lease still holds: no writer or truncation is waiting for it."""
        if self._fd < 0:
            return False
        try:
            return fcntl.fcntl(self._fd, _F_GETLEASE) == fcntl.F_RDLCK
        except OSError:
            return False

    def view(self, start: int, end: int) -> torch.Tensor:
        """``[start, min(end, size))`` of the file, as a uint8 tensor over the mapping: the
        pages stay mapped while it (or any tensor sharing its memory) is held."""
        import torch  # here: opening a checkpoint's headers needs no torch

        end = min(end, self.size)
        assert self._mem is not None, "a view of a mapping already let go"
        if end <= start:
            return torch.empty(0, dtype=torch.uint8)
        # The tensor keeps the memoryview, and the memoryview holds the mapping's buffer: until
        # it goes, mmap.close() raises BufferError instead of unmapping the pages under it.
        return torch.frombuffer(memoryview(self._mem)[start:end], dtype=torch.uint8)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def let_go(self) -> bool:
        """Give the lease back and unmap the file, if no view of it is held any more; ``False``,
        with nothing changed, while one is (a consumer still uses it: the promise goes on)."""
        try:
            if self._mem is not None:
                self._mem.close()
        except BufferError:
            return False
        self.close()
        return True

    def close(self) -> None:
        """Give the lease back (a waiting writer goes on). The mapping itself stays until the
        last view of it is gone."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.fcntl(self._fd, _F_SETLEASE, fcntl.F_UNLCK)
            os.close(self._fd)
            self._fd = -1
        if self._mem is not None:
            with contextlib.suppress(BufferError):
                self._mem.close()  # only when no view exports it; else when the last one goes
            self._mem = None
