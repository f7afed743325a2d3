"""The contract every storage backend meets, and the small capabilities some sources add.

Small on purpose: plan, schedule, retry and tune live above it and work for every backend. The
engine knows these protocols, never a backend class: a capability is asked for with
``isinstance(source, Resident)``, not by probing for attributes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "Allowance",
    "Cancellable",
    "Closable",
    "Hedgeable",
    "KnownChecksum",
    "Landed",
    "Lendable",
    "Lent",
    "Metered",
    "Prefetching",
    "ReadHow",
    "Resident",
    "Source",
    "Staged",
    "Stepwise",
    "Versioned",
    "Wrapped",
]

ReadHow = Literal["direct", "cached", "buffered", "network"]
"""How a range was read: ``direct`` (O_DIRECT, bypassing the page cache), ``cached`` (a
buffered read of a range found in the page cache), ``buffered`` (any other buffered read), ``network`` (an object-store request)."""


@runtime_checkable
class Closable(Protocol):
    """Holds something (descriptors, buffers, threads) until closed; closing twice is harmless."""

    def close(self) -> None: ...


@runtime_checkable
class Source(Closable, Protocol):
    """One readable file or object of known size.

    Thread safety: ``read_into`` is called from many threads at once, on disjoint buffers.
    """

    uri: str
    size: int

    def read_prefix(self, length: int) -> bytes:
        """The first ``min(length, size)`` bytes (headers; small)."""
        ...

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        """Fill ``buf`` with the bytes at ``[offset, offset + len(buf))``.

        ``buf`` may run past the end of the source (alignment padding); bytes past the end are
        left as they were. Returns the number of bytes filled, ``min(len(buf), size - offset)``,
        and how they were read. Raises a :class:`~weightstream.errors.WeightStreamError` naming
        the source and range on failure; never returns fewer bytes than promised.
        ``offset`` and the buffer's address are multiples of 4096.
        """
        ...


Landed = Callable[[memoryview, int], None]
"""Told of bytes as a read lands them: ``landed(view, offset)``."""


@runtime_checkable
class Stepwise(Protocol):
    """A source that can hand a read's bytes on as they land, in file order (local files: a
    copy out of the page cache lands in the CPU's cache, where reading it again is cheap)."""

    def read_stepwise(self, buf: memoryview, *, offset: int, landed: Landed | None) -> tuple[int, ReadHow]:
        """:meth:`Source.read_into`, calling ``landed`` with each contiguous run of the bytes
        as it lands, in file order, together covering exactly the bytes filled."""
        ...


@runtime_checkable
class Resident(Protocol):
    """A source that knows which of its ranges are in memory already (the page cache)."""

    def cached(self, offset: int, length: int) -> bool | None:
        """Whether the range is cached enough to be read as a copy from memory (``cached``);
        ``None`` where this source's reads do not choose by it."""
        ...


class Lent(Protocol):
    """A file's bytes lent from the page cache, under a promise that the file does not change
    while lent (see :mod:`weightstream.sources.mapping`)."""

    uri: str
    size: int
    reads_pending: bool
    """Some of the file's blocks are read, not lent: hold the promise to the end of the load."""

    @property
    def closed(self) -> bool: ...

    def resident(self, start: int, end: int) -> bool:
        """Whether the page cache holds ``[start, end)``."""
        ...

    def intact(self) -> bool:
        """Whether the promise still holds (no writer is waiting for it)."""
        ...

    def view(self, start: int, end: int) -> torch.Tensor:
        """``[start, min(end, size))`` as a uint8 host tensor over the cached pages."""
        ...

    def let_go(self) -> bool:
        """End the promise now if no view is held any more; ``False`` (nothing done) while one is."""
        ...

    def close(self) -> None:
        """End the promise (a waiting writer goes on); views still held stay readable."""
        ...


@runtime_checkable
class Lendable(Protocol):
    """A source that can lend its cached bytes instead of reading them (local files)."""

    def lend(self) -> Lent | None:
        """The file lent for the length of a load, or ``None`` where it cannot be promised
        unchanged (the kernel refuses a read lease)."""
        ...


@runtime_checkable
class Versioned(Protocol):
    """A source whose reads are bound to the version of the file or object its header was read
    at, so one load never mixes two versions."""

    version: str | None
    """The version (an object's ETag; a file's identity, size and modification time)."""

    def verify(self) -> None:
        """Raise :class:`~weightstream.errors.FormatError` (or NotFoundError) if the storage no
        longer holds that version. Called when a load starts; an object store also checks it on
        every request (``If-Match``)."""
        ...


@runtime_checkable
class Metered(Protocol):
    """A source whose requests are counted (object stores: requests, retries, flow rate)."""

    def metered(self, stats: Any) -> Source:
        """The same source (same connection pool, size and version) counting into ``stats``."""
        ...


@runtime_checkable
class Staged(Protocol):
    """A source whose reads may hold their bytes in buffers of their own on the way to the
    destination (an object-store client's), so that bytes in flight cost memory beyond the
    destinations. A source that is not one reads straight into the destination (``preadv``,
    the one-copy transport's ``recv_into``)."""

    @property
    def staged(self) -> bool:
        """Whether this source's reads are staged so (it may depend on its transport)."""
        ...


@runtime_checkable
class Cancellable(Protocol):
    """A source whose requests in flight can be abandoned at once (object stores: a request is
    a coroutine, cancelled with its connection). A file read in the kernel cannot be, and is
    waited for instead."""

    def cancel(self) -> None:
        """Abort every request of this source in flight, and refuse new ones: the load using it
        is over (closed, interrupted, or failed elsewhere). Called from the load's own thread."""
        ...


class Allowance:
    """Bytes the reads ahead of one open may add past their first guess, until :meth:`close`
    (shared by the open's :class:`Prefetching` sources; see :mod:`weightstream.sources.prefetch`)."""

    def __init__(self, nbytes: int) -> None:
        self.lock = threading.Lock()
        self.nbytes = nbytes
        self.left = nbytes
        self.closed = False

    @property
    def added(self) -> int:
        """Bytes added so far."""
        return self.nbytes - self.left

    def close(self) -> None:
        """Add nothing more; every part added before is in its prefetch's range when this
        returns (parts are added under :attr:`lock`)."""
        with self.lock:
            self.closed = True


@runtime_checkable
class Prefetching(Protocol):
    """A source that can read its first bytes ahead, before the load asks for them (files: see
    :mod:`weightstream.sources.prefetch`), and serve the load's reads of them from memory."""

    size: int

    def prefetch(
        self, length: int, *, go: threading.Event | None = None, allowance: Allowance | None = None
    ) -> object | None:
        """Ready a read of ``[0, min(length, size))``, sent when ``go`` is set (or by the
        returned value's ``start()``), extended past it while ``allowance`` has room; ``None``
        where the source declines (cached already, no ``O_DIRECT``, closed)."""
        ...


@runtime_checkable
class Hedgeable(Protocol):
    """A source whose header read can be sent again as a request of its own, when the first is
    slow (a network file system's latency tail: the open waits for the slowest header)."""

    def read_prefix_again(self, length: int) -> bytes | None:
        """What :meth:`Source.read_prefix` returns, read by a separate request; ``None`` where
        the source cannot send one."""
        ...


@dataclass(frozen=True)
class KnownChecksum:
    """A file's checksum that its storage keeps (an S3 object's ``x-amz-checksum-*``, the
    SHA-256 the Hugging Face Hub names a downloaded file by): ``algorithm`` and ``value`` of the
    whole file, ``origin`` naming where it came from, or why there is none (``algorithm``
    ``None``). Asked for by a backend's optional ``checksum(location, config, version=...)``."""

    algorithm: str | None
    value: int = 0
    why: str = ""
    origin: str = ""
    piece_size: int = 0
    """With ``pieces``: each piece's size (the last one's at most), for a checksum per piece (the
    parts of an S3 multipart upload); ``value`` is then the checksum of their checksums."""
    pieces: tuple[int, ...] = ()
    bounds: tuple[int, ...] = ()
    """Where the pieces are not all of ``piece_size`` (then the largest): each one's first byte."""
    composite: bool = False
    """``value`` is the checksum of the pieces' checksums, which are not known (``pieces`` is
    empty; ``confirm`` asks for them): see :class:`~weightstream.format.manifest.FileDigest`.
    With ``algorithm`` ``None``: the store keeps a composite whose parts were not (or could
    not be) asked for."""
    confirm: Callable[[], tuple[int, ...] | str] | None = None
    version: str | None = None
    """The version (ETag) the answer is of, where it was asked for whatever version is there
    (the open asks before it knows the version it reads: see ``checkpoint``)."""

    @staticmethod
    def none(why: str) -> KnownChecksum:
        return KnownChecksum(None, why=why)


class Wrapped:
    """A source seen through a layer of one load (the node cache's fill, the checksum check):
    it reads through ``inner`` and keeps what the engine asks of a load's source, ``staged``,
    ``cancel`` and ``cached``. A subclass overrides :meth:`read_into`. Closing it leaves ``inner`` open
    (its owner closes it)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.size = inner.size
        self.cancelled = threading.Event()

    @property
    def staged(self) -> bool:
        return isinstance(self.inner, Staged) and self.inner.staged

    def cancel(self) -> None:
        self.cancelled.set()
        if isinstance(self.inner, Cancellable):
            self.inner.cancel()

    def read_prefix(self, length: int) -> bytes:
        return self.inner.read_prefix(length)

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        return self.inner.read_into(buf, offset=offset)

    def cached(self, offset: int, length: int) -> bool | None:
        """``inner``'s answer (:class:`Resident`): a layer must not hide that a load's first
        reads are copies out of the page cache (the engine then starts one copy per CPU, not
        the storage's depth)."""
        return self.inner.cached(offset, length) if isinstance(self.inner, Resident) else None

    def close(self) -> None:
        """``inner`` is its owner's to close."""
