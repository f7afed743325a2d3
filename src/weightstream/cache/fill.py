"""Filling a cache entry while a load streams: the bytes a read brings go to the part file too.

A :class:`Fill` is one remote file's part (``KEY.VERSION.part``) and its journal
(``KEY.VERSION.log``), shared by every loading process of the node:

* A read of a range the journal names as written is served from the part (a local read).
* A read of a range another live process is reading waits for it (polling the journal), so
  eight ranks starting at once read each byte from the store about once, not eight times. A
  claim whose process died, or a journal that stops growing for ``stall`` seconds, is not
  waited for: the read goes to the store.
* Any other read goes to the store, into the load's own buffer, and those bytes are then
  written to the part with ``pwrite`` from that same buffer (no second read, no copy in
  memory), and named in the journal.
* The process that sees every byte written makes the entry whole
  (:meth:`~weightstream.cache.store.Cache.publish`: fsync, then rename), on a background
  thread, off the load's path.

The journal is a JSON first line (URI, version, size) and then fixed 24-byte records, each
appended with one ``write`` (``O_APPEND``: records of concurrent writers never interleave):
a claim before a read from the store, the range written after its ``pwrite`` returned, or a
claim given up (the read failed). A record follows its write, so a killed process leaves a
journal that names only bytes that are in the page cache; a journal from before the last boot
is not trusted and the part is started again.

A fill never fails a load: a full disk, an I/O error or a disk slower than the store (its
writes taking more than a quarter of the reads' time) drops the fill with a log line, and the
load goes on from the store.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import struct
import threading
import time

from weightstream.cache.store import Cache, boot_time, key_of
from weightstream.format.ranges import Ranges
from weightstream.sources.base import ReadHow, Source, Wrapped

__all__ = ["Fill", "FillingSource"]

log = logging.getLogger(__name__)

_RECORD = struct.Struct("<IIQQ")  # kind, pid, offset, length
CLAIM, WRITTEN, RELEASED = 1, 2, 3
_SLOW_AFTER = 64 << 20
"""Bytes written before the slow-disk rule is applied (its first writes fill the page cache)."""
_SLOW_SHARE = 0.25
"""A fill whose writes take more than this share of its reads' time is dropped."""
_POLL = (0.001, 0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Fill:
    """One remote file's part, shared by the node's loading processes (module docstring).
    ``use``: the entry's in-use descriptor (:meth:`Cache.use`), closed with the fill."""

    def __init__(self, cache: Cache, uri: str, version: str, size: int, *, use: int, stall: float) -> None:
        self.cache, self.uri, self.version, self.size = cache, uri, version, size
        self.key = key_of(uri)
        self.part, self.journal = cache.fill_paths(self.key, version)
        self.stall = stall
        self.dropped = False
        self.lock = threading.Lock()
        self.written = Ranges()
        self.claims: dict[tuple[int, int, int], int] = {}  # (pid, start, end) -> count
        self._use = use
        self._pos = 0
        self._grown = time.monotonic()
        self._wrote = 0
        self._write_s = 0.0
        self._read_s = 0.0
        self._publishing = False
        self._closed = False
        self._pid = os.getpid()
        with cache.locked(self.key):
            if self._stale():
                for p in (self.part, self.journal):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
            self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                self._log = os.open(self.journal, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except BaseException:
                os.close(self._fd)
                raise
            if os.fstat(self._log).st_size == 0:
                head = {"uri": uri, "version": version, "size": size}
                os.write(self._log, json.dumps(head).encode() + b"\n")
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)
        self._refresh()

    def _stale(self) -> bool:
        """Whether the part on disk is not to be trusted: written before this boot, gone (made
        whole, or removed), or its journal names another file."""
        try:
            os.stat(self.part)
            st = os.stat(self.journal)
            with open(self.journal, "rb") as f:
                head = json.loads(f.readline(65536))
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            return True
        if st.st_mtime < boot_time():
            return True
        return not isinstance(head, dict) or (head.get("uri"), head.get("version"), head.get("size")) != (
            self.uri,
            self.version,
            self.size,
        )

    # -- the journal ---------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Read the records appended since the last look (under ``lock``, or before threads)."""
        st = os.fstat(self._log)
        if st.st_size <= self._pos:
            return
        raw = os.pread(self._log, st.st_size - self._pos, self._pos)
        if self._pos == 0:
            nl = raw.find(b"\n")
            if nl < 0:
                return
            self._pos = nl + 1
            raw = raw[nl + 1 :]
        usable = len(raw) - len(raw) % _RECORD.size
        for kind, pid, offset, length in _RECORD.iter_unpack(raw[:usable]):
            key = (pid, offset, offset + length)
            if kind == CLAIM:
                self.claims[key] = self.claims.get(key, 0) + 1
            else:
                if kind == WRITTEN:
                    self.written.add(offset, offset + length)
                left = self.claims.get(key, 0) - 1
                if left > 0:
                    self.claims[key] = left
                else:
                    self.claims.pop(key, None)
        self._pos += usable
        self._grown = time.monotonic()

    def _record(self, kind: int, offset: int, length: int) -> None:
        os.write(self._log, _RECORD.pack(kind, self._pid, offset, length))

    @property
    def whole(self) -> bool:
        return self.written.covers(0, self.size)

    def _waitable(self, gaps: list[tuple[int, int]]) -> bool:
        """Whether every gap is being read by a live process."""
        live = [(s, e) for (pid, s, e) in self.claims if pid == self._pid or _alive(pid)]
        return all(any(s <= gs and ge <= e for s, e in live) for gs, ge in gaps)

    def seed(self, data: bytes) -> None:
        """Write the file's first bytes, read already (the header), unless written before."""
        with self.lock:
            if self.written.covers(0, len(data)):
                return
        self._write(memoryview(data), 0, 0.0)

    # -- reads -----------------------------------------------------------------------------

    def read_into(
        self, remote: Source, buf: memoryview, offset: int, cancelled: threading.Event
    ) -> tuple[int, ReadHow]:
        """Read ``buf``'s range: from the part where it is written (or will be, by a live
        process), else from ``remote``, then written to the part."""
        end = min(offset + len(buf), self.size)
        if end <= offset or self.dropped:
            return remote.read_into(buf, offset=offset)
        if self._await(offset, end, cancelled):
            try:
                self._pread(buf[: end - offset], offset)
                return end - offset, "buffered"
            except OSError as exc:
                self.drop(f"reading it back failed ({exc.strerror})")
                return remote.read_into(buf, offset=offset)
        claimed = self._claim(offset, end)
        started = time.monotonic()
        try:
            n, how = remote.read_into(buf, offset=offset)
        except BaseException:
            if claimed:
                self._release(offset, end)
            raise
        if claimed:
            self._write(buf[:n], offset, time.monotonic() - started)
        return n, how

    def _await(self, start: int, end: int, cancelled: threading.Event) -> bool:
        """Whether ``[start, end)`` is written, waiting while live processes are reading it."""
        pause = _POLL[0]
        while True:
            with self.lock:
                if self.dropped:
                    return False
                try:
                    self._refresh()
                except OSError:
                    return False
                if self.written.covers(start, end):
                    return True
                gaps = self.written.gaps(start, end)
                if not self._waitable(gaps) or time.monotonic() - self._grown > self.stall:
                    return False
            if cancelled.is_set():
                return False
            time.sleep(pause)
            pause = min(pause * 2, _POLL[1])

    def _claim(self, start: int, end: int) -> bool:
        try:
            self._record(CLAIM, start, end - start)
            return True
        except OSError as exc:
            self.drop(f"its journal cannot be written ({exc.strerror})")
            return False

    def _release(self, start: int, end: int) -> None:
        with contextlib.suppress(OSError):
            self._record(RELEASED, start, end - start)

    def _pread(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                raise OSError(5, "the part ended early")
            done += n

    def _write(self, data: memoryview, offset: int, read_s: float) -> None:
        if self.dropped:
            return
        started = time.monotonic()
        try:
            done = 0
            while done < len(data):
                done += os.pwritev(self._fd, [data[done:]], offset + done)
            self._record(WRITTEN, offset, len(data))
        except OSError as exc:
            self._release(offset, offset + len(data))
            self.drop(f"writing it failed ({exc.strerror})", remove=True)
            return
        took = time.monotonic() - started
        with self.lock:
            self._write_s += took
            self._read_s += read_s
            self._wrote += len(data)
            self.written.add(offset, offset + len(data))
            if self._wrote >= _SLOW_AFTER and self._write_s > _SLOW_SHARE * self._read_s:
                slow = f"the disk is slower than the store ({self._write_s:.2f} s writing, {self._read_s:.2f} s reading)"
            else:
                slow = ""
                with contextlib.suppress(OSError):
                    self._refresh()
                if self.whole and not self._publishing:
                    self._publishing = True
                    _PUBLISHER.put(self)
        if slow:
            self.drop(slow)

    # -- the end -----------------------------------------------------------------------------

    def publish(self) -> None:
        """Make the entry whole (publisher thread), unless dropped meanwhile."""
        try:
            if not self.dropped and self.cache.publish(
                self.uri, self.version, self.size, self.part, self.journal, self._fd
            ):
                log.info("cache: %s is whole (%.2f GB)", self.uri, self.size / 1e9)
        except OSError as exc:
            self.drop(f"it could not be made whole ({exc.strerror})", remove=True)
        finally:
            with self.lock:
                self._publishing = False
                closing = self._closed
            if closing:
                self._close_fds()

    def drop(self, why: str, *, remove: bool = False) -> None:
        """Stop filling (the load goes on from the store); ``remove``: the part too (a full
        disk gets its room back)."""
        with self.lock:
            if self.dropped:
                return
            self.dropped = True
        log.warning("cache: not keeping %s: %s", self.uri, why)
        if remove:
            for p in (self.part, self.journal):
                with contextlib.suppress(OSError):
                    os.unlink(p)

    def close(self) -> None:
        """Let the entry go (its publication, if under way, finishes first)."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            publishing = self._publishing
        if not publishing:
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._fd, self._log, self._use):
            with contextlib.suppress(OSError):
                os.close(fd)


class FillingSource(Wrapped):
    """``remote`` as one load reads it with ``fill`` (see :class:`Fill`)."""

    def __init__(self, remote: Source, fill: Fill) -> None:
        super().__init__(remote)
        self.fill = fill

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        return self.fill.read_into(self.inner, buf, offset, self.cancelled)


class _Publisher:
    """One background thread making filled entries whole; the process waits for it at exit."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Fill | None] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def put(self, fill: Fill) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="weightstream-cache", daemon=True)
                self.thread.start()
                atexit.register(self.drain)
        self.queue.put(fill)

    def _run(self) -> None:
        while True:
            fill = self.queue.get()
            try:
                if fill is None:
                    return
                fill.publish()
            finally:
                self.queue.task_done()

    def drain(self) -> None:
        """Wait until every filled entry is made whole (at exit)."""
        self.queue.join()


_PUBLISHER = _Publisher()


def drain() -> None:
    """Wait until every entry filled so far is whole (tests; the process does it at exit)."""
    if _PUBLISHER.thread is not None:
        _PUBLISHER.drain()
