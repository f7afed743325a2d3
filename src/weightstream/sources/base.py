"""The contract every storage backend meets. Small on purpose: plan, schedule, retry and tune
live above it and work for every backend."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

__all__ = ["ReadHow", "Source"]

ReadHow = Literal["direct", "cached", "buffered", "network"]
"""How a range was read: ``direct`` (O_DIRECT, bypassing the page cache), ``cached`` (a
buffered read of a range found in the page cache), ``buffered`` (any other buffered read), ``network`` (an object-store request)."""


@runtime_checkable
class Source(Protocol):
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

    def close(self) -> None: ...
