"""Checks a local file passed, kept so that the file is not checked again while it is unchanged
(``StreamConfig.checks_dir``).

Checking a load's bytes (``verify``) costs nothing measurable where storage binds, but on a hot
local load, where the copy out of the page cache binds, its CRC and the Python that drives it
step by step cost about a tenth of the load on two cores (``bench/RESULTS.md``), and the Hub's
SHA-256 several times the load. A model server starts again and again from the same files on a
node: each start would pay for a check the files already passed. So a local file's passed
pieces are written down, with what identifies the file's version, and a later load of the same
version against the same checksums takes them as checked without reading them through the check.

A record holds the file's identity (:func:`~weightstream.sources.file.file_identity`: device,
inode, size, modification and change time) and is used only while the file still has it. A
write through the file system changes the change time, which no user can set back (a rewrite
that puts the modification time back, a copy over it, a rename over it, a truncation: each
gives another identity). What the times could hide is a write through a shared writable
mapping. Where the file system asks to be told of a mapped page's first write (ext4, XFS,
btrfs, NFS, ...), a mapped page is read-only until a write to it faults, and that fault changes
the times; a page already dirty may still be written, without a fault, through a mapping that
was writing it before. Three rules close it:

* records are kept only on a file system that changes the times at every write
  (:func:`~weightstream.localfs.times_miss_writes`). Not on tmpfs (``/dev/shm``, ``/tmp`` on
  many systems) or hugetlbfs, whose mapped pages are writable from their first fault, a read's
  included: a process may map a file there, read it, write it and go, and the times never
  change. Not on an overlay written to tmpfs, nor on FUSE, whose daemon says what the times are;
* a file changed less than :func:`settle_ns` before its check began is not recorded (35 s
  with the kernel's defaults). A second write in the same tick of the file system's clock
  would leave the same times; and every page dirty at the check was made so at or before the
  change time, while the kernel writes dirty pages back (cleaning them, so that the next write
  faults) within ``vm.dirty_expire_centisecs`` plus ``vm.dirty_writeback_centisecs``;
* a file some process holds open for writing (a mapping holds it so) when the check begins or
  when it ends is not recorded, and a record is not used while one does
  (:func:`~weightstream.localfs.open_for_writing`: the kernel refuses a read lease). Where the
  kernel keeps no leases for the file (NFS, another user's file without ``CAP_LEASE``), the
  times alone decide.

The record is checked against the file's identity when it is written (after the check) and
when it is used: a file written during the check has another identity by then.

A record belongs to one machine and one boot (:func:`node`, the kernel's ``boot_id``): a folder
shared by several machines (a home directory on NFS) must not let one machine's record vouch
for another's local file that happens to have the same device, inode, size and times (two
nodes copying the same model at once onto file systems made the same way). Containers on one
machine share its kernel's boot, so they share records; after a reboot, files are checked again
(the first load after one is cold: the storage binds, and the check costs nothing measurable).

Bytes changed under the file system (a failing disk, writes to the raw device) keep the file's
times: a record does not see them. ``checks_dir="off"`` checks every byte of every load.

One small JSON file per file version and set of checksums, named by a hash of both, written to a
temporary name and renamed: a reader finds a whole record or none. Processes adding pieces
to one record at once (ranks that each checked their part of a file) take turns under a lock
on a file in the folder, so that none loses another's. Anything unreadable counts as no
record; the folder holds at most :data:`MAX_RECORDS`, the least recently used going first. A
folder that is not this user's, or that others may write in, is not used (a record written
there by someone else would let a changed file through).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from weightstream.cache.store import boot_id
from weightstream.config import StreamConfig
from weightstream.format.manifest import FileDigest
from weightstream.localfs import open_for_writing, times_miss_writes
from weightstream.shard import Shard
from weightstream.sources.file import FileSource, file_identity

__all__ = [
    "MAX_RECORDS",
    "SETTLE_NS",
    "PassedChecks",
    "checks_folder",
    "local_file",
    "passed_checks",
    "settle_ns",
]

log = logging.getLogger(__name__)

SETTLE_NS: int | None = None
"""A file changed less than this before its check began is not recorded; ``None``:
:func:`settle_ns`."""

_TICK_NS = 2_000_000_000
"""The coarsest clock tick of common file systems (FAT's; most count in jiffies)."""


def settle_ns() -> int:
    """How long after its last change a file's times show every write to it: a clock tick, plus
    the longest a page can stay dirty (``vm.dirty_expire_centisecs``, then the next
    ``vm.dirty_writeback_centisecs`` wake-up of the flusher). With periodic writeback off
    (``0``) a dirty page may stay dirty for good: nothing is ever recorded."""
    total = _TICK_NS
    for name, default in (("dirty_expire_centisecs", 3000), ("dirty_writeback_centisecs", 500)):
        try:
            with open(f"/proc/sys/vm/{name}") as f:
                centis = int(f.read())
        except (OSError, ValueError):
            centis = default
        if centis <= 0 and name == "dirty_writeback_centisecs":
            return 1 << 62
        total += max(0, centis) * 10_000_000
    return total


MAX_RECORDS = 10_000
"""Records kept at most (about 300 bytes each)."""

LOCK_WAIT_S = 2.0
"""How long adding to a record waits for another's addition (under a millisecond each)."""

_ADDING = threading.Lock()
"""Held by the thread adding to a record (:meth:`PassedChecks._locked`)."""


def _after_fork_in_child() -> None:
    global _ADDING
    _ADDING = threading.Lock()  # a thread of the parent may have held it: not one of the child's


os.register_at_fork(after_in_child=_after_fork_in_child)


def checks_folder(config: StreamConfig) -> str | None:
    """The folder ``config.checks_dir`` names: ``auto`` is ``checks`` in the node cache's folder
    where there is one (it outlives a container, as the cache does), else
    ``$XDG_CACHE_HOME/weightstream/checks`` (``~/.cache/...``); ``None`` for ``off``."""
    where = config.checks_dir
    if where is None or where == "off":
        return None
    if where == "auto":
        if config.cache_dir is not None:
            return os.path.join(os.path.abspath(os.path.expanduser(config.cache_dir)), "checks")
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        return os.path.join(os.path.abspath(os.path.expanduser(base)), "weightstream", "checks")
    return os.path.abspath(os.path.expanduser(where))


node = boot_id
"""This machine and boot (:func:`weightstream.cache.store.boot_id`)."""


def passed_checks(config: StreamConfig) -> PassedChecks | None:
    """The records ``config`` names, or ``None`` where they are off."""
    root = checks_folder(config)
    if root is None:
        return None
    return PassedChecks(root, settle_ns=SETTLE_NS)


def local_file(shard: Shard) -> tuple[str, str] | None:
    """``(path, identity)`` of the local file a shard's bytes are read from (a file, or a node
    cache entry), as it was when opened; ``None`` for anything else."""
    source = shard.source
    if isinstance(source, FileSource) and source.version is not None:
        return source.uri, source.version
    return None


def expectation(digest: FileDigest) -> str:
    """What a check compares a file with: the algorithm, the sizes and every checksum (not
    where they came from: a manifest and a store giving the same CRCs are one expectation)."""
    text = json.dumps(
        [
            digest.algorithm,
            digest.size,
            digest.whole,
            digest.piece_size,
            list(digest.pieces),
            digest.composite,
            list(digest.bounds),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


class PassedChecks:
    """The records in one folder (see the module docstring). ``settle_ns``: ``None`` for
    :func:`settle_ns`, read from the kernel when a record is first written (not by every load)."""

    _said: ClassVar[set[str]] = set()
    """What was logged already (once a process: every load would say it again; no lock, so
    that a fork never inherits one held: two threads may both say it)."""

    def __init__(
        self,
        root: str,
        *,
        settle_ns: int | None,
        max_records: int = MAX_RECORDS,
        node_id: str | None = None,
    ) -> None:
        self.root = root
        self.settle_ns = settle_ns
        self.max_records = max_records
        self.node = node() if node_id is None else node_id
        """Records are this machine's and boot's (:func:`node`)."""
        self._trusted: bool | None = None
        self._kept: dict[int, bool] = {}
        """Whether each device's file system keeps times that follow every write."""

    def trusted(self) -> bool:
        """Whether the folder is this user's and no one else may write in it (a record written
        by someone else would let a changed file through unchecked); a folder not made yet is
        made so. Asked once."""
        if self._trusted is None:
            try:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
                st = os.stat(self.root)
            except OSError as exc:
                self._say(f"checks passed are not kept in {self.root}: {exc}")
                self._trusted = False
                return False
            self._trusted = st.st_uid == os.geteuid() and not st.st_mode & 0o022
            if not self._trusted:
                self._say(
                    f"checks passed are not kept in {self.root}: the folder is not this user's, or "
                    "others may write in it (chmod go-w, or another checks_dir)"
                )
        return self._trusted

    def _path(self, identity: str, expect: str) -> str:
        name = hashlib.sha256(f"{self.node}\n{identity}\n{expect}".encode()).hexdigest()[:40]
        return os.path.join(self.root, name + ".json")

    def _read(self, identity: str, expect: str) -> set[int]:
        try:
            with open(self._path(identity, expect), "rb") as f:
                record: Any = json.loads(f.read(1 << 20))
            if record["identity"] != identity or record["expect"] != expect or record["node"] != self.node:
                return set()
            return {i for lo, hi in record["pieces"] for i in range(int(lo), int(hi))}
        except (OSError, ValueError, KeyError, TypeError):
            return set()

    def known(self, path: str, identity: str, digest: FileDigest) -> frozenset[int]:
        """The pieces of ``digest`` the file at ``path`` passed at the version ``identity``
        names, provided the file still has it (its header was read at that version, and a load
        checks it again before reading)."""
        if not self.trusted() or not self.same(path, identity) or not self.times_kept(path):
            return frozenset()
        expect = expectation(digest)
        pieces = self._read(identity, expect)
        if pieces:  # used: the last to be trimmed
            with contextlib.suppress(OSError):
                os.utime(self._path(identity, expect))
        return frozenset(i for i in pieces if 0 <= i < digest.count)

    def add(
        self, path: str, identity: str, digest: FileDigest, pieces: Iterable[int], *, began_ns: int
    ) -> bool:
        """Write down that ``pieces`` of ``digest`` passed for the file at ``path``, at the
        version ``identity`` names, in a check that began at ``began_ns`` (``time.time_ns()``);
        whether it was written (never for a file changed since, one changed within
        ``settle_ns`` before the check, or one open for writing now: the caller asks
        :meth:`quiet` when the check begins)."""
        new = set(pieces)
        if not new or not self.trusted() or not self._unchanged(path, identity, began_ns):
            return False
        expect = expectation(digest)
        target = self._path(identity, expect)
        with self._locked():  # ranks adding their parts of one file at once: each keeps the others'
            have = self._read(identity, expect)
            if new <= have:
                return False
            record = {
                "path": path,
                "node": self.node,
                "identity": identity,
                "expect": expect,
                "pieces": _runs(new | have),
                "at": time.time(),
            }
            tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                fresh = not os.path.exists(target)
                with open(tmp, "w") as f:
                    json.dump(record, f)
                os.replace(tmp, target)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                self._say(f"checks passed are not kept in {self.root}: {exc}")
                return False
        if fresh:
            self._trim()
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Records locked while one is read, merged and renamed, so that processes and threads
        adding pieces to one at once (ranks that each checked their part of a file) lose none:
        a POSIX lock on ``.lock`` in the folder between processes (a forked child does not
        inherit it: a fork in the middle of an addition leaves no lock held for good), and
        :data:`_ADDING` between this process's threads. Where the lock cannot be had within
        :data:`LOCK_WAIT_S` (a holder stopped, a file system without locks), the record is
        written without it: the last rename wins, and pieces lost so are checked again at the
        next load."""
        ours = _ADDING.acquire(timeout=LOCK_WAIT_S)
        fd = None
        try:
            try:
                fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                deadline = time.monotonic() + LOCK_WAIT_S
                while True:
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as exc:
                        if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                            raise
                        time.sleep(0.001)
            except OSError as exc:
                self._say(f"records in {self.root} are written without a lock: {exc}")
            yield
        finally:
            if fd is not None:
                os.close(fd)  # and the lock with it
            if ours:
                _ADDING.release()

    @staticmethod
    def same(path: str, identity: str) -> bool:
        """Whether the file at ``path`` still has the identity ``identity``."""
        try:
            return file_identity(os.stat(path)) == identity
        except OSError:
            return False

    def times_kept(self, path: str) -> bool:
        """Whether the file system ``path`` lies on changes a file's times with every write to
        it (:func:`~weightstream.localfs.times_miss_writes`): elsewhere a record could vouch for
        bytes changed since. Asked once a device."""
        try:
            device = os.stat(path).st_dev
        except OSError:
            return False
        kept = self._kept.get(device)
        if kept is None:
            why = times_miss_writes(path)
            kept = self._kept[device] = why is None
            if why is not None:
                self._say(
                    f"checks passed are not kept for files in {os.path.dirname(path)}, on {why}: "
                    "they are checked at every load"
                )
        return kept

    @staticmethod
    def quiet(path: str) -> bool:
        """Whether no process holds the file open for writing (or that cannot be told): a
        check beginning now may be recorded if this still holds when it ends."""
        return open_for_writing(path) is not True

    def _unchanged(self, path: str, identity: str, began_ns: int) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        if self.settle_ns is None:
            self.settle_ns = settle_ns()
        if file_identity(st) != identity or st.st_ctime_ns > began_ns - self.settle_ns:
            return False
        return self.times_kept(path) and self.quiet(path)

    def _trim(self) -> None:
        """Remove the least recently used records past :attr:`max_records` (and temporary
        files a killed process left)."""
        try:
            with os.scandir(self.root) as it:
                found = [(e.stat().st_mtime, e.path) for e in it if e.name.endswith((".json", ".tmp"))]
        except OSError:
            return
        now = time.time()
        stale = [p for t, p in found if p.endswith(".tmp") and now - t > 3600]
        records = sorted((t, p) for t, p in found if p.endswith(".json"))
        stale += [p for _, p in records[: max(0, len(records) - self.max_records)]]
        for p in stale:
            with contextlib.suppress(OSError):
                os.unlink(p)

    @classmethod
    def _say(cls, text: str) -> None:
        if text not in cls._said:
            cls._said.add(text)
            log.info("%s", text)


def _runs(pieces: set[int]) -> list[list[int]]:
    """``pieces`` as ``[first, past_last]`` runs."""
    runs: list[list[int]] = []
    for i in sorted(pieces):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs
