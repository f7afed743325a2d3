"""Local and network file systems (ext4, xfs, NFS, Lustre, ...): positioned reads that release
the GIL, straight into the destination buffer.

Direct or buffered, per chunk (``direct_io="auto"``): a chunk whose pages are mostly in the page
cache is copied out of it with a buffered ``preadv`` (memory speed); any other chunk is read with
``O_DIRECT`` (device speed, no page-cache insertion or extra copy). No single static choice gets
both: O_DIRECT re-reads the device for data already cached, and buffered reads of cold data pay
for page-cache insertion and a copy on a CPU that is also faulting in the destination.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import resource
import threading
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

from weightstream.errors import ConfigError, FormatError, ReadError
from weightstream.localfs import list_folder, network_file_system, open_regular, os_error, regular_file
from weightstream.location import LocalPath
from weightstream.memory.align import ALIGN
from weightstream.sources._pagecache import resident_fraction
from weightstream.sources.base import Allowance, KnownChecksum, Landed, ReadHow
from weightstream.sources.mapping import FileMapping
from weightstream.sources.prefetch import Prefetch

if TYPE_CHECKING:
    from weightstream.config import DirectIO, StreamConfig

__all__ = [
    "BACKEND",
    "CACHED_ENOUGH",
    "FileBackend",
    "FileSource",
    "file_identity",
    "list_folder",
    "open_regular",
    "os_error",
    "regular_file",
]

log = logging.getLogger(__name__)

CACHED_ENOUGH = 0.5
"""A chunk at least this resident is read buffered: re-reading its cached part from the device
would cost more than faulting in the rest through the page cache."""

STEP = 1 << 20
"""A buffered read whose bytes are handed on as they land (:meth:`FileSource.read_stepwise`)
goes in steps of this size, so that the kernel's copy leaves each step in the CPU's cache for
the reader of it: a CRC32C ran at 91-106 GB/s there against 12 from memory (this machine, 2 MiB
of L2 a core). In a hot 4.27 GB ``load()`` with the manifest's check, 1 MiB measured best of
64 KiB to 4 MiB (512 KiB as good): smaller steps cost more in Python and in handing the GIL back
and forth, larger ones fall out of the cache (bench/RESULTS.md)."""


class _Descriptors:
    """The descriptors open shards hold, within what the process may open.

    A source keeps its descriptors (a buffered one and an ``O_DIRECT`` one) between reads, so
    every read of a load goes through the file its header was read from. A checkpoint of more
    shards than the open-files limit allows (1,200 shards under a hard limit of 1,024) would fail
    to open: so the sources open at once are capped at what the limit leaves (with headroom for
    the rest of the process), and an idle source past the cap gives its descriptors back, least
    recently used first. It reopens them by path when next read, and refuses a path that names
    another file by then (the same rule as :meth:`FileSource.verify`). While the limit is high
    enough, nothing is ever closed early: one lock and a dictionary move per read.
    """

    _RESERVE = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, FileSource] = {}  # in least-recently-used order

    def cap(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return 1 << 30
        return max(8, (soft - self._RESERVE) // 2)

    def touch(self, source: FileSource | None) -> None:
        """``source`` is about to read: its descriptors stay open; others may be asked to close.
        ``None``: make room for a source about to open (it is added once it is whole)."""
        key = id(source)
        with self._lock:
            if source is not None and key in self._open:
                self._open[key] = self._open.pop(key)  # most recently used
                return
            cap = self.cap()
            if len(self._open) >= cap:
                for other_key in list(self._open):
                    if len(self._open) < cap:
                        break
                    if self._open[other_key]._release_if_idle():
                        del self._open[other_key]
            if source is not None:
                self._open[key] = source

    def forget(self, source: FileSource) -> None:
        with self._lock:
            self._open.pop(id(source), None)


_DESCRIPTORS = _Descriptors()


class FileSource:
    """A file opened for positioned reads; see the module docstring for the direct/buffered choice."""

    def __init__(self, path: str, *, direct_io: DirectIO = "auto", readahead: bool = True) -> None:
        """``readahead=False`` turns off kernel readahead for this descriptor's buffered reads
        (for small header reads that should not pull megabytes into the page cache)."""
        self.uri = path
        self.direct_io = direct_io
        self._readahead = readahead
        self._lock = threading.Lock()
        self._users = 0
        """Reads in progress (their descriptors must not be closed under them)."""
        self._closed = False
        self._direct_ok = direct_io != "off"
        """O_DIRECT is still to be tried (it is dropped for the file once refused)."""
        self._fd = -1
        self._direct_fd: int | None = None
        self._spare: list[int] = []
        self._prefetch: Prefetch | None = None
        _DESCRIPTORS.touch(None)
        st = self._open_fds(first=True)
        self._ino = (st.st_dev, st.st_ino)
        self.size = st.st_size
        self.version: str | None = file_identity(st)
        """The file's identity, size, modification and change time when it was opened (see
        :meth:`verify`)."""
        _DESCRIPTORS.touch(self)  # whole now: the budget may take its descriptors back when idle

    def _open_fds(self, *, first: bool = False) -> os.stat_result:
        """Open the descriptors (at first, or again after the budget took them back): the path
        must still name the file the header was read from."""
        fd, st = open_regular(self.uri)
        if first:
            self._ino = (st.st_dev, st.st_ino)
        try:
            if not first and ((st.st_dev, st.st_ino) != self._ino or file_identity(st) != self.version):
                raise FormatError(
                    "file changed since its header was read: the path names another file now"
                    if (st.st_dev, st.st_ino) != self._ino
                    else "file changed since its header was read (modified in place)",
                    uri=self.uri,
                )
            direct = self._open_direct(self.uri, self._ino) if self._direct_ok else None
        except BaseException:
            os.close(fd)
            raise
        if direct is None:
            self._direct_ok = False
        if direct is not None or not self._readahead:
            # Readahead would be self-defeating here: a buffered read of a partly cached chunk
            # would pull the *next* chunks into the page cache, those would then look cached and
            # be read buffered too, and a cold load would slide into slow buffered reads while
            # O_DIRECT sat unused. Buffered reads here fetch exactly what they are asked for.
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._fd, self._direct_fd = fd, direct
        return st

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """Hold the descriptors open for one read (reopening them if the budget took them)."""
        _DESCRIPTORS.touch(self)
        with self._lock:
            if self._closed:
                raise ReadError("the source is closed", uri=self.uri)
            if self._fd < 0:
                self._open_fds()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._closed and not self._users:
                    self._close_fds()  # closed while this read ran: its descriptor is free now

    def _release_if_idle(self) -> bool:
        """Give the descriptors back if no read is using them (the budget asks)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._users:
                return False
            self._close_fds()
            return True
        finally:
            self._lock.release()

    def _close_fds(self) -> None:
        for fd in (self._fd, self._direct_fd, *self._spare):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd, self._direct_fd, self._spare = -1, None, []

    def _open_direct(self, path: str, ino: tuple[int, int]) -> int | None:
        flag = getattr(os, "O_DIRECT", 0)
        try:
            if not flag:
                raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flag)
        except OSError as exc:
            if self.direct_io == "on":
                raise ConfigError(
                    f"direct_io='on' but the file system refuses O_DIRECT ({exc.strerror}); "
                    "use direct_io='auto' or 'off'",
                    uri=path,
                ) from exc
            log.debug("%s: O_DIRECT unavailable (%s); reading buffered", path, exc.strerror)
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ino:
                raise ReadError("the file was replaced while it was being opened", uri=path)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except OSError as exc:
            os.close(fd)
            raise os_error(exc, uri=path, what="cannot open") from exc
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- Source protocol -------------------------------------------------------------------

    def read_prefix(self, length: int) -> bytes:
        length = min(length, self.size)
        with self._using():
            try:
                data = os.pread(self._fd, length, 0)
            except OSError as exc:
                raise os_error(exc, uri=self.uri, what="read failed", byte_range=(0, length)) from exc
        if len(data) != length:
            raise ReadError(
                f"short read: got {len(data)} of {length} bytes (file shrank while reading?)",
                uri=self.uri,
                byte_range=(0, length),
            )
        return data

    def read_prefix_again(self, length: int) -> bytes | None:
        """The first ``min(length, size)`` bytes by a request of its own: ``O_DIRECT``, so not
        waiting on the page a buffered :meth:`read_prefix` of the same bytes is filling (a hedge
        of a header read stuck in a network file system's latency tail). ``None`` where this
        file is not read ``O_DIRECT``."""
        length = min(length, self.size)
        span = -(-length // ALIGN) * ALIGN
        with self._using():
            fd = self._direct_fd
            if fd is None or span == 0:
                return None
            memory = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                with memoryview(memory) as view:
                    done = self._read_direct(view, 0, length)
                    if done < 0:
                        return None
                    if done < length:
                        self._read(self._fd, view, 0, length, done)
                    return bytes(view[:length])
            finally:
                with contextlib.suppress(BufferError):
                    memory.close()

    def prefetch(
        self, length: int, *, go: threading.Event | None = None, allowance: Allowance | None = None
    ) -> Prefetch | None:
        """Ready a read of ``[0, length)`` ahead, for a load that reads it soon (see
        :mod:`weightstream.sources.prefetch`), sent by its ``start()`` (or when ``go`` is set),
        and extended past ``length`` while ``allowance`` lets it; :meth:`read_into` then
        copies from what arrived. Only where reads go ``O_DIRECT`` and the range is not in the
        page cache already (a copy from there needs no guess); else ``None``."""
        length = min(length, self.size)
        if length < self.size:
            length -= length % ALIGN  # O_DIRECT reads end aligned, or at the end of the file
        if length <= 0 or self._closed or self._direct_fd is None:
            return None
        try:
            if self.cached(0, length):
                return None
        except ReadError:  # closed meanwhile
            return None
        with self._lock:
            if self._closed or self._prefetch is not None:
                return None
            self._prefetch = Prefetch(
                self._read_range, length, uri=self.uri, go=go, allowance=allowance, limit=self.size
            )
            return self._prefetch

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        return self.read_stepwise(buf, offset=offset, landed=None)

    def read_stepwise(self, buf: memoryview, *, offset: int, landed: Landed | None) -> tuple[int, ReadHow]:
        """:meth:`read_into`, handing ``landed`` the bytes as they land, in file order: a
        buffered read in steps of :data:`STEP`, each while it is still in the CPU's cache; any
        other read (O_DIRECT: the device wrote it, the CPU never saw it) once, whole."""
        expected = max(0, min(len(buf), self.size - offset))
        if expected == 0:
            return 0, "buffered"
        ahead = self._prefetch
        if ahead is not None and offset < ahead.end:
            inside = min(expected, ahead.end - offset)  # 4096-aligned where it ends before EOF
            if inside < expected:
                # The rest first: sent now, not once the parts read ahead have arrived (on a
                # latency tail they can arrive late, and a request sent then waits a tail of
                # its own at the very end of the load).
                self._read_range(buf[inside:], offset + inside)
            done = ahead.serve(buf, offset, inside)
            if done < inside:  # a part that failed or was copied out already: read it here
                self._read_range(buf[done:inside], offset + done)
            if landed is not None:
                landed(buf[:expected], offset)
            return expected, "direct"
        return expected, self._read_range_how(buf, offset, expected, landed)

    def _read_range(self, buf: memoryview, offset: int) -> int:
        """Read ``buf``'s range as the module docstring says (no prefetch); the bytes filled."""
        expected = max(0, min(len(buf), self.size - offset))
        if expected:
            self._read_range_how(buf, offset, expected, None)
        return expected

    def _read_range_how(self, buf: memoryview, offset: int, expected: int, landed: Landed | None) -> ReadHow:
        with self._using():
            how = self._choose(offset, expected)
            done = 0
            if how == "direct":
                done = self._read_direct(buf, offset, expected)
                if done < 0:  # the device refused this O_DIRECT read; buffered from here on
                    done, how = 0, "buffered"
                elif landed is not None and done:
                    landed(buf[:done], offset)
            if done < expected:
                self._read(self._fd, buf, offset, expected, done, landed)
        return how

    def cached(self, offset: int, length: int) -> bool | None:
        """Whether the range is at least :data:`CACHED_ENOUGH` in the page cache (it is then
        read as ``cached``); ``None`` where this file's reads do not choose by it."""
        fraction = self.resident(offset, length)
        return None if fraction is None else fraction >= CACHED_ENOUGH

    def lend(self) -> FileMapping | None:
        """This file mapped under a read lease, for a load that borrows its cached blocks."""
        return FileMapping.open(self.uri, version=self.version, identity=file_identity)

    def verify(self) -> None:
        """Raise if the path no longer names the file as it was opened: removed, replaced by
        another file, or written to (size, modification or change time changed). The descriptor
        would still read the old bytes; a load must read what the path holds, as validated."""
        with self._using():
            try:
                now = os.fstat(self._fd)
            except OSError as exc:
                raise os_error(exc, uri=self.uri, what="cannot read") from exc
        st = regular_file(self.uri, what="the file is gone since its header was read")
        if (st.st_dev, st.st_ino) != self._ino:
            raise FormatError(
                "file changed since its header was read: the path names another file now", uri=self.uri
            )
        if file_identity(now) != self.version:
            raise FormatError(
                f"file changed since its header was read: {self.size} bytes then, {now.st_size} now"
                + ("" if now.st_size != self.size else " (modified in place)"),
                uri=self.uri,
            )

    def resident(self, offset: int, length: int) -> float | None:
        """Fraction of the range in the page cache, where reads of this file choose by it (a
        range at least half resident is read as ``cached``); ``None`` where they do not."""
        if not self._direct_ok or self.direct_io == "on":
            return None
        with self._using():
            return resident_fraction(self._fd, offset, length)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ahead, self._prefetch = self._prefetch, None
            if not self._users:  # else the last read in flight closes them (see _using)
                self._close_fds()
        if ahead is not None:
            ahead.close()
        _DESCRIPTORS.forget(self)

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _choose(self, offset: int, length: int) -> ReadHow:
        if self._direct_fd is None:
            return "buffered"
        return "cached" if self.cached(offset, length) else "direct"  # None when direct_io="on"

    def _read_direct(self, buf: memoryview, offset: int, expected: int) -> int:
        """O_DIRECT read; returns bytes read (a multiple of ALIGN unless at EOF), -1 if refused."""
        fd = self._direct_fd
        if fd is None:
            return -1
        done = 0
        while done < expected:
            try:
                n = os.preadv(fd, [buf[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.direct_io != "on":
                    # Alignment stricter than 4096 or a file system that accepts the flag but not
                    # the read: stop using O_DIRECT for this file.
                    log.warning("%s: O_DIRECT read refused (%s); reading buffered", self.uri, exc.strerror)
                    self._direct_ok = False
                    # Other threads may be reading through it: closed with the others, later.
                    self._spare.append(fd)
                    self._direct_fd = None
                    return -1 if done == 0 else done
                raise os_error(
                    exc, uri=self.uri, what="read failed", byte_range=(offset + done, offset + expected)
                ) from exc
            if n == 0:
                raise _short(self.uri, offset, expected, done)
            done += n
            if done % ALIGN and done < expected:
                break  # short, unaligned: finish buffered
        return min(done, expected)

    def _read(
        self, fd: int, buf: memoryview, offset: int, expected: int, done: int, landed: Landed | None = None
    ) -> None:
        uri = self.uri
        step = expected if landed is None else STEP
        while done < expected:
            try:
                n = os.preadv(fd, [buf[done : min(expected, done + step)]], offset + done)
            except OSError as exc:
                raise os_error(
                    exc, uri=uri, what="read failed", byte_range=(offset + done, offset + expected)
                ) from exc
            if n == 0:
                raise _short(uri, offset, expected, done)
            if landed is not None:
                landed(buf[done : done + n], offset + done)
            done += n


def _short(uri: str, offset: int, expected: int, done: int) -> ReadError:
    return ReadError(
        f"short read: end of file after {done} of {expected} bytes (file truncated while reading?)",
        uri=uri,
        byte_range=(offset + done, offset + expected),
    )


def file_identity(st: os.stat_result) -> str:
    """Device, inode, size, modification and change time: a file rewritten in place with its
    modification time put back (``touch -d``, a copy tool keeping times) still changes its change
    time, which no user can set. (A chmod or a new hard link changes it too: such a file is
    refused as changed, which is the safe side.)"""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class FileBackend:
    """Local and network file systems (see :class:`~weightstream.sources.registry.Backend`)."""

    remote = False

    def settings(self, config: StreamConfig) -> Hashable:
        return config.direct_io

    def network_fs(self, location: LocalPath) -> str | None:
        return network_file_system(os.path.dirname(location.path) or ".")

    def is_folder(self, location: LocalPath, config: StreamConfig) -> bool:
        return os.path.isdir(location.path)

    def list(self, location: LocalPath, config: StreamConfig) -> dict[LocalPath, int | None]:
        return {location.child(n): None for n in list_folder(location.path)}

    def check(
        self, location: LocalPath, config: StreamConfig, listed: object = None, *, what: str = "cannot open"
    ) -> None:
        regular_file(location.path, what=what)

    def read_all(self, location: LocalPath, config: StreamConfig, *, size: int | None, limit: int) -> bytes:
        uri = location.path
        fd, st = open_regular(uri, what="cannot read")
        try:
            if st.st_size > limit:
                raise FormatError(f"file is {st.st_size} bytes, more than {limit}", uri=uri)
            raw = os.pread(fd, st.st_size + 1, 0)
        except OSError as exc:
            raise os_error(exc, uri=uri, what="cannot read") from exc
        finally:
            os.close(fd)
        if len(raw) != st.st_size:
            raise ReadError(f"file changed while it was read ({st.st_size} bytes, then {len(raw)})", uri=uri)
        return raw

    def checksum(self, location: LocalPath, config: StreamConfig, *, version: str | None) -> KnownChecksum:
        """The SHA-256 the Hugging Face Hub published for a file downloaded from it (an
        optional member of a backend; see :func:`hub_sha256`)."""
        return hub_sha256(location.path)

    def open(
        self,
        location: LocalPath,
        config: StreamConfig,
        *,
        size: int | None = None,
        version: str | None = None,
    ) -> FileSource:
        return FileSource(location.path, direct_io=config.direct_io)


_SHA256 = re.compile(r"[0-9a-f]{64}")
_HUB_LEVELS = 4
"""Folders above a file looked at for a ``--local-dir`` download's metadata."""


def hub_sha256(path: str) -> KnownChecksum:
    """The SHA-256 the Hugging Face Hub publishes for an LFS file (every ``.safetensors``),
    where ``path`` was downloaded from the Hub, with no request:

    - in the Hub's cache (``hf download``, ``from_pretrained``), a snapshot's file is a link to
      ``blobs/<sha256>``: the blob's name is its SHA-256;
    - in a ``--local-dir`` download, ``.cache/huggingface/download/<file>.metadata`` beside the
      files keeps the commit, then the ETag (the SHA-256 for an LFS file), then a time.

    A file changed since it was downloaded no longer has the bytes the Hub published, and the
    check says so."""
    real = os.path.realpath(path)
    folder, name = os.path.split(real)
    if os.path.basename(folder) == "blobs" and _SHA256.fullmatch(name):
        return KnownChecksum("sha256", int(name, 16), origin=f"the Hugging Face Hub (its blob name, {real})")
    top = os.path.dirname(os.path.abspath(path))
    rel = os.path.basename(path)
    for _ in range(_HUB_LEVELS):
        meta = os.path.join(top, ".cache", "huggingface", "download", rel + ".metadata")
        try:
            with open(meta, encoding="utf-8") as f:
                lines = f.read(4096).splitlines()
        except OSError:
            pass
        else:
            etag = lines[1].strip().strip('"') if len(lines) > 1 else ""
            if _SHA256.fullmatch(etag):
                return KnownChecksum("sha256", int(etag, 16), origin=f"the Hugging Face Hub ({meta})")
            return KnownChecksum.none(f"{meta} names no SHA-256 (not an LFS file)")
        top, part = os.path.split(top)
        if not part:
            break
        rel = f"{part}/{rel}"
    return KnownChecksum.none("not downloaded from the Hugging Face Hub (no blob name or download metadata)")


BACKEND = FileBackend()
