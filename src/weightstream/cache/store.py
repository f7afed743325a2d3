"""The cache folder on disk: which entries it holds, which are whole and current, and room.

One folder per node (``StreamConfig.cache_dir``), shared by every loading process there. Each
remote file the cache has seen is keyed by its URI (``key``: a hash of it) and holds:

``KEY.safetensors``
    The whole file, byte for byte: a valid safetensors file any tool can read. Present only
    once every byte was written and synced.
``KEY.json``
    What the entry is: the URI, the version it was filled at (an ETag), its size, when it was
    made. Renamed into place last: an entry is whole only when this names the data file's size
    and the version the store holds now.
``KEY.VERSION.NODE.part`` and ``KEY.VERSION.NODE.log``
    An entry being filled (:mod:`weightstream.cache.fill`): the file's bytes where they were
    written (a sparse file), and the journal of which ranges are written and which are being
    read. Any loading process of the node writes into it; the first to see it whole renames it.
    ``NODE`` names the kernel that fills it (its ``boot_id``): a journal names a range once its
    ``pwrite`` returned, which makes the bytes visible to that kernel's processes (its page
    cache) and no others. A folder on a network file system that several nodes share holds a
    part per node, and none reads another's: there a range can be in one node's journal before
    its bytes reach the server (the client writes them back later, or never if it crashes), and
    another node's cached pages of the part can be older than the journal.
``KEY.lock``
    Taken (``flock``) to make an entry whole or to remove it. A lock dies with its process, so
    a killed process leaves no stale lock.
``KEY.use``
    Held shared (``flock``) by every process reading or filling the entry: an entry in use is
    never removed to make room.

Nothing is ever changed in place once whole: a new version is filled beside the old one and
renamed over it, so a process reading the old file keeps reading the old bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator

from weightstream.errors import ConfigError

__all__ = ["Cache", "Entry", "boot_id", "boot_time", "key_of"]

log = logging.getLogger(__name__)

DATA = ".safetensors"
META = ".json"
PART = ".part"
JOURNAL = ".log"


def key_of(uri: str) -> str:
    """The entry name for ``uri``."""
    return hashlib.sha256(uri.encode()).hexdigest()[:32]


def version_tag(version: str) -> str:
    """A file-name-safe name for one version of an entry."""
    return hashlib.sha256(version.encode()).hexdigest()[:12]


_boot_id: str | None = None


def boot_id() -> str:
    """This machine and boot: the kernel's ``boot_id`` (random at each boot, the same in every
    container of the machine, which share one page cache); ``""`` where it cannot be read."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
        except OSError:
            _boot_id = ""
    return _boot_id


def boot_time() -> float:
    """When this machine booted: a part written before it may have lost bytes its journal names
    (a journal record follows its write into the page cache, not onto the disk)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of the cache folder, as ``weightstream cache list`` shows it."""

    key: str
    uri: str | None
    """The remote file it copies (``None``: a part whose journal names none yet)."""
    version: str | None
    size: int
    """The file's size (whole entries) or the bytes written so far (parts)."""
    last_use: float
    whole: bool
    path: str
    in_use: bool
    crc32c: str | None = None
    """The whole file's CRC32C, computed when it was made whole (``cache verify`` checks it)."""


class Cache:
    """A node's cache folder (see the module docstring). ``max_bytes``: what its entries may
    take together (``None``: until the disk is full)."""

    def __init__(self, root: str, max_bytes: int | None = None) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_bytes = max_bytes
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cache_dir {self.root!r} cannot be made: {exc.strerror}", setting="cache_dir"
            ) from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"cache_dir {self.root!r} is not writable", setting="cache_dir")

    def path(self, key: str, suffix: str, version: str | None = None) -> str:
        name = key if version is None else f"{key}.{version_tag(version)}"
        return os.path.join(self.root, name + suffix)

    def fill_paths(self, key: str, version: str, node: str | None = None) -> tuple[str, str]:
        """The part and journal in which ``node`` (default: this kernel, :func:`boot_id`) fills
        ``key``'s entry at ``version`` (module docstring)."""
        tag = hashlib.sha256((boot_id() if node is None else node).encode()).hexdigest()[:8]
        name = f"{key}.{version_tag(version)}.{tag}"
        return os.path.join(self.root, name + PART), os.path.join(self.root, name + JOURNAL)

    def drop_idle_parts(self, key: str, keep: str) -> None:
        """Remove ``key``'s parts other than ``keep`` whose journal was not written since this
        machine booted (or is gone): an earlier boot's, or a version no longer asked for, which
        this kernel never reads, or one that another node sharing the folder left idle (that
        node loses its copy, never a load: a fill whose part is gone is dropped)."""
        since = boot_time()
        with self.locked(key):
            for name in os.listdir(self.root):
                if not (name.startswith(key + ".") and name.endswith(PART)):
                    continue
                part = os.path.join(self.root, name)
                journal = part[: -len(PART)] + JOURNAL
                if part == keep:
                    continue
                try:
                    idle = os.stat(journal).st_mtime < since
                except FileNotFoundError:
                    idle = True
                except OSError:
                    continue
                if idle:
                    for p in (part, journal):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(p)
                    log.info("cache: removed %s, not written since this machine started", part)

    # -- whole entries -----------------------------------------------------------------------

    def meta(self, key: str) -> dict[str, object] | None:
        """The entry's description, or ``None`` where it has none (or an unreadable one)."""
        try:
            with open(self.path(key, META), "rb") as f:
                meta = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def whole(self, uri: str, version: str | None, size: int) -> str | None:
        """The data file of ``uri``'s whole entry at ``version`` and ``size``, marked used now;
        ``None`` where there is none (or it is of another version, or damaged)."""
        found = self.whole_entry(uri, version, size)
        return None if found is None else found[0]

    def whole_entry(self, uri: str, version: str | None, size: int) -> tuple[str, int | None] | None:
        """As :meth:`whole`, with the CRC32C the entry's description holds (``None``: none, as
        an older version wrote it), read from the same description."""
        if version is None:
            return None  # a file without a version cannot be told apart from its next one
        key = key_of(uri)
        meta = self.meta(key)
        if meta is None or (meta.get("uri"), meta.get("version"), meta.get("size")) != (uri, version, size):
            return None
        data = self.path(key, DATA)
        try:
            if os.stat(data).st_size != size:
                return None
            os.utime(self.path(key, META))  # last use, for eviction
        except OSError:
            return None
        crc = _str(meta.get("crc32c"))
        try:
            return data, None if crc is None else int(crc, 16)
        except ValueError:
            return data, None

    def publish(self, uri: str, version: str, size: int, part: str, journal: str, fd: int) -> bool:
        """Make the filled ``part`` (open as ``fd``) the whole entry of ``uri``: synced, its
        ``journal`` removed, then renamed into place, its description last; all under the
        entry's lock, which a fill takes to open a part, so none opens a journal whose part is
        gone. ``False`` where another process (another node's, in a shared folder) published it
        first: the part is removed. Raises ``OSError`` (a full disk, a removed part): the caller
        drops the fill."""
        key = key_of(uri)
        with self.locked(key):
            if self.whole(uri, version, size) is not None:
                for p in (journal, part):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                return False
            crc = file_crc32c(fd, size)  # read back from the page cache: later damage is found
            os.fsync(fd)
            os.unlink(journal)  # first: a part without its journal is started again, never trusted
            meta = self.path(key, META)
            tmp = f"{meta}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(
                    {
                        "uri": uri,
                        "version": version,
                        "size": size,
                        "crc32c": f"{crc:08x}",
                        "made": time.time(),
                    },
                    f,
                )
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileNotFoundError):
                os.unlink(meta)  # the old version's description first: no moment names new bytes old
            os.rename(part, self.path(key, DATA))
            os.rename(tmp, meta)
            _sync_dir(self.root)
        return True

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """The entry's lock, held (a short wait: publishing and removing take it briefly)."""
        fd = os.open(self.path(key, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def use(self, key: str) -> int:
        """Hold the entry as in use (a descriptor; close it to let go)."""
        fd = os.open(self.path(key, ".use"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    # -- room ----------------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """Every entry and part in the folder, least recently used first."""
        found: list[Entry] = []
        for name in sorted(os.listdir(self.root)):
            key, _, rest = name.partition(".")
            if len(key) != 32 or (rest != "json" and not rest.endswith(".part")):
                continue
            in_use = self._in_use(key)
            if rest == "json":
                meta = self.meta(key) or {}
                data = self.path(key, DATA)
                try:
                    st, used = os.stat(data), os.stat(self.path(key, META)).st_mtime
                except OSError:
                    continue
                uri, version = meta.get("uri"), meta.get("version")
                crc = _str(meta.get("crc32c"))
                found.append(Entry(key, _str(uri), _str(version), st.st_size, used, True, data, in_use, crc))
            else:
                part = os.path.join(self.root, name)
                try:
                    st = os.stat(part)
                except OSError:
                    continue
                uri, version = _journal_names(part[: -len(PART)] + JOURNAL)
                found.append(Entry(key, uri, version, st.st_blocks * 512, st.st_mtime, False, part, in_use))
        return sorted(found, key=lambda e: e.last_use)

    def make_room(self, nbytes: int, *, keep: str) -> bool:
        """Remove the least recently used entries not in use (never ``keep``'s) until ``nbytes``
        more fit under ``max_bytes`` and on the disk; whether they fit."""
        try:
            free = os.statvfs(self.root)
        except OSError:
            return False
        room = free.f_bavail * free.f_frsize
        if self.max_bytes is None and nbytes <= room:
            return True  # (no listing of the folder: every shard of a load asks this)
        entries = self.entries()
        used = sum(e.size for e in entries)
        limit = None if self.max_bytes is None else self.max_bytes - used
        for e in entries:
            if nbytes <= room and (limit is None or nbytes <= limit):
                return True
            if e.key == keep or e.in_use:
                continue
            if self.remove(e):
                log.info("cache: removed %s (%s, %.2f GB) to make room", e.uri, e.path, e.size / 1e9)
                room += e.size
                if limit is not None:
                    limit += e.size
        return nbytes <= room and (limit is None or nbytes <= limit)

    def discard(self, uri: str, version: str) -> None:
        """Remove ``uri``'s whole entry if it is of ``version``, in use or not (its bytes are
        bad: a reader keeps its open descriptor on the removed file)."""
        key = key_of(uri)
        with self.locked(key):
            meta = self.meta(key)
            if meta is None or meta.get("version") != version:
                return
            for p in (self.path(key, META), self.path(key, DATA)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        log.warning("cache: removed %s (version %s): its bytes failed a check", uri, version)

    def remove(self, entry: Entry) -> bool:
        """Remove an entry or part not in use; whether it was removed."""
        with self.locked(entry.key):
            fd = os.open(self.path(entry.key, ".use"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in (errno.EAGAIN, errno.EACCES):
                        return False
                    raise
                if entry.whole:
                    paths = [self.path(entry.key, META), self.path(entry.key, DATA)]
                else:
                    paths = [entry.path, entry.path[: -len(PART)] + JOURNAL]
                for p in paths:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                return True
            finally:
                os.close(fd)

    def _in_use(self, key: str) -> bool:
        try:
            fd = os.open(self.path(key, ".use"), os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)


def file_crc32c(fd: int, size: int) -> int:
    """The CRC32C of the first ``size`` bytes of ``fd`` (read in 16 MiB pieces)."""
    from weightstream.format.manifest import CRC32C

    buf = bytearray(16 << 20)
    view = memoryview(buf)
    crc, pos = 0, 0
    while pos < size:
        n = os.preadv(fd, [view[: min(len(buf), size - pos)]], pos)
        if n <= 0:
            raise OSError(5, f"the file ended at {pos} of {size} bytes")
        crc = CRC32C.of(view[:n], crc)
        pos += n
    return crc


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _journal_names(path: str) -> tuple[str | None, str | None]:
    """The URI and version a journal's first line names."""
    try:
        with open(path, "rb") as f:
            first = f.readline(65536)
        head = json.loads(first)
        return _str(head.get("uri")), _str(head.get("version"))
    except (OSError, ValueError, AttributeError):
        return None, None


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
