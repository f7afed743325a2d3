"""Local file-system checks every layer shares: a path that must be a regular file, opened
safely, and an ``OSError`` mapped to the error a user can act on. Standard library only."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import platform
import re
import signal
import stat

from weightstream.errors import NotFoundError, PermissionDeniedError, ReadError, WeightStreamError

__all__ = [
    "file_version",
    "list_folder",
    "mount_table",
    "network_file_system",
    "open_regular",
    "os_error",
    "regular_file",
    "thread_in_read",
    "times_miss_writes",
]

NETWORK_FILE_SYSTEMS = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
        "wekafs", "9p", "afs", "orangefs", "pvfs2", "panfs", "quobyte", "xtreemfs", "ocfs2", "gfs2",
        "cvfs", "scale", "davfs", "sshfs", "vboxsf", "virtiofs", "dfs",
    }
)  # fmt: skip
"""File-system types whose every read crosses a network (``fuse.*`` too: s3fs, gcsfuse,
JuiceFS, blobfuse, a user-space NFS). Their reads wait a round trip each, so a load needs many
more of them in flight than a local disk does (Little's law)."""


def os_error(
    exc: OSError, *, uri: str, what: str, byte_range: tuple[int, int] | None = None
) -> WeightStreamError:
    """Map an OSError to the weightstream error a caller can act on (the OSError is chained by
    the caller's ``raise ... from exc``)."""
    reason = f"{what}: {exc.strerror or exc}"
    if exc.errno == errno.ELOOP:
        reason = f"{what}: too many levels of symbolic links (a symbolic link loop)"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFoundError(reason, uri=uri, byte_range=byte_range)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDeniedError(reason, uri=uri, byte_range=byte_range)
    return ReadError(reason, uri=uri, byte_range=byte_range)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)


def read_lease(fd: int) -> bool | None:
    """Take a read lease (``F_SETLEASE``) on ``fd``, a descriptor opened read-only: ``True``
    where taken; ``False`` where the kernel refuses it because the file is open for writing
    somewhere (a process could be changing it, through ``write()`` or a shared mapping);
    ``None`` where the kernel keeps no lease for it (NFS, FUSE, another user's file without
    ``CAP_LEASE``). Closing the descriptor gives it back.

    A lease's break (a process opening the file for writing, or truncating it, waits for the
    lease) never signals this process. The kernel makes the lease's taker its owner and sends
    it ``SIGIO``, whose default action ends the process: the break's signal is set to
    ``SIGURG`` (ignored by default) before the lease is taken, so a break between the two calls
    is harmless, and the owner is cleared right after. A break is seen by polling
    (``F_GETLEASE``)."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return False if exc.errno in (errno.EAGAIN, errno.EBUSY) else None
    fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
    return True


def open_for_writing(path: str) -> bool | None:
    """Whether some process holds the file at ``path`` open for writing now (a read lease is
    refused); ``None`` where that cannot be told (no leases for it, or it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        taken = read_lease(fd)
    finally:
        os.close(fd)
    return None if taken is None else not taken


def file_version(path: str | None) -> tuple[int, int, int, int] | None:
    """What tells one version of a file from the next: ``(device, inode, size, mtime_ns)``;
    ``None`` for no path or one that cannot be read (whoever reads it says why). Something
    built from a file's contents and kept (a TLS context from a CA bundle) is kept by this as
    well as by the name, so that a file rewritten in place or replaced is read again."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def regular_file(path: str, *, what: str = "cannot open") -> os.stat_result:
    """``stat`` a path that must be a regular file (symbolic links followed), without opening it.

    Every way it can fail is reported with its real cause, naming the path: no such file, a
    dangling symbolic link (and where it points), a link loop, no permission, or something that
    is not a regular file (a directory, FIFO, socket or device). ``what`` starts the message.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT and os.path.islink(path):
            try:
                target = f"it points to {os.readlink(path)!r}, which does not exist"
            except OSError:
                target = "its target does not exist"
            raise NotFoundError(f"{what}: dangling symbolic link ({target})", uri=path) from exc
        raise os_error(exc, uri=path, what=what) from exc
    if not stat.S_ISREG(st.st_mode):
        raise NotFoundError(f"{what}: it is {_kind(st.st_mode)}, not a regular file", uri=path)
    return st


def open_regular(path: str, flags: int = 0, *, what: str = "cannot open") -> tuple[int, os.stat_result]:
    """Open a regular file for reading; returns the descriptor and its ``fstat``.

    The path is checked before it is opened (a FIFO would block ``open`` until a writer came,
    and opening a device can have effects), and opened non-blocking, then checked again on the
    descriptor, so a path swapped in between is caught too.
    """
    regular_file(path, what=what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flags)
    except OSError as exc:
        raise os_error(exc, uri=path, what=what) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotFoundError(f"{what}: it is {_kind(st.st_mode)}, not a regular file", uri=path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except OSError as exc:
        os.close(fd)
        raise os_error(exc, uri=path, what=what) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def list_folder(path: str) -> list[str]:
    """Names in a folder, sorted; an unreadable folder is an error naming its cause."""
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries)
    except OSError as exc:
        raise os_error(exc, uri=path, what="cannot list the folder") from exc


def mount_table(path: str = "/proc/self/mountinfo") -> list[tuple[str, str, str]]:
    """``(mount point, file-system type, super options)`` of each mount, in the table's order
    (later mounts over earlier ones); empty where the table cannot be read."""
    out: list[tuple[str, str, str]] = []
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space
        out.append((point, tail[0], tail[2]))
    return out


def _mount_of(path: str, table: str) -> tuple[str, str, str] | None:
    """The innermost mount ``path`` lies in: ``(mount point, type, super options)``."""
    try:
        real = os.path.realpath(path)
    except (OSError, ValueError):
        return None
    found: tuple[str, str, str] | None = None
    for row in mount_table(table):
        point = row[0]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found[0])):
            found = row
    return found


def network_file_system(path: str, *, table: str = "/proc/self/mountinfo") -> str | None:
    """The type of the network file system ``path`` lies on (``"nfs4"``, ``"fuse.s3fs"``, ...),
    or ``None`` for a local one or where it cannot be told."""
    mount = _mount_of(path, table)
    if mount is None:
        return None
    kind = mount[1]
    if kind in NETWORK_FILE_SYSTEMS or kind.startswith(("fuse.", "fuseblk.")) or kind == "fuse":
        return kind
    return None


TIMES_MISS_MAPPED_WRITES = frozenset({"tmpfs", "devtmpfs", "hugetlbfs"})
"""File systems on which a write through a shared mapping can change a file's bytes and not its
times: the kernel makes their mapped pages writable at the first fault, a read's included, and
asks the file system nothing at a later write (no ``page_mkwrite``; shmem and hugetlbfs). On
the others (ext4, XFS, btrfs, NFS, ramfs, ...) a page is mapped read-only until the first write
to it faults, and that fault updates the times."""


def times_miss_writes(path: str, *, table: str = "/proc/self/mountinfo", _depth: int = 0) -> str | None:
    """Why a file's times at ``path`` may stay as they were while its bytes change (the file
    system's type, and why), or ``None`` where every write changes them:

    - tmpfs (``/dev/shm``, and ``/tmp`` on many systems), devtmpfs and hugetlbfs: a write
      through a shared mapping (:data:`TIMES_MISS_MAPPED_WRITES`);
    - an overlay whose upper layer (where its files are written) is one of the above, where
      that layer can be seen from here (inside a container it usually cannot; the engines put it
      on the host's disk);
    - FUSE: the times are whatever its daemon says (some say the mount's time for every file).

    A file system that cannot be told (no mount table) counts as keeping them."""
    mount = _mount_of(path, table)
    if mount is None:
        return None
    _, kind, options = mount
    if kind in TIMES_MISS_MAPPED_WRITES:
        return f"{kind}: a write through a shared mapping there changes no time"
    if kind.startswith("fuse"):  # fuse, fuse.*, fuseblk
        return f"{kind}: a FUSE daemon gives the times, which need not change with the bytes"
    if kind == "overlay" and _depth < 8:
        upper = next((o[len("upperdir=") :] for o in options.split(",") if o.startswith("upperdir=")), None)
        if upper and os.path.isdir(upper):
            below = times_miss_writes(upper, table=table, _depth=_depth + 1)
            return None if below is None else f"an overlay written to {below}"
    return None


_READS = {
    # read, pread64, readv, preadv, preadv2
    "x86_64": frozenset({0, 17, 19, 295, 327}),
    # read, readv, pread64, preadv, preadv2 (the unified table)
    "aarch64": frozenset({63, 65, 67, 69, 286}),
}
_READS["arm64"] = _READS["aarch64"]
_TABLE = _READS.get(platform.machine())


def thread_in_read(tid: int) -> bool | None:
    """Whether the thread ``tid`` (a native id, :func:`threading.get_native_id`) of this process
    is blocked in a read system call now: a read sent to a network file system is queued to its
    server once its thread is in the kernel, and one still waiting for the GIL is not. ``None``
    where that cannot be told (not Linux, an architecture whose numbers are not listed here, no
    ``/proc``, or the thread has ended)."""
    if _TABLE is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/syscall", "rb") as fh:
            first = fh.read(32).split(None, 1)[0]
    except (OSError, IndexError):
        return None
    if first == b"running":
        return False
    try:
        return int(first) in _TABLE  # -1: blocked, but not in a system call
    except ValueError:
        return None
