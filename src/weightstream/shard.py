"""One file or object of a checkpoint, as the load pipeline reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightstream.format.manifest import FileDigest
from weightstream.format.safetensors import FileIndex
from weightstream.location import Location
from weightstream.sources.base import Closable, Source

if TYPE_CHECKING:
    from weightstream.sources.registry import Backend

__all__ = ["Shard"]


@dataclass(frozen=True)
class Shard:
    """One file or object of a checkpoint: where it is, the backend that reads it, its
    validated header, and the source its header was read through (which serves the tensor
    reads too)."""

    location: Location
    header: FileIndex
    source: Source
    settings: object
    """The backend settings ``source`` was opened with (a load with other settings opens its
    own source)."""
    backend: Backend[Any]
    """The backend that opened ``source`` (asked once, when the shard was opened)."""
    prefix: bytes = b""
    """The file's first bytes, read when it was opened (its header): a load reads the tensors
    only, and the cache and the checksum check need these too."""
    published: str | None = None
    """The store's version of the object these bytes are (an ETag): set for an object-store
    shard and for its copy in the node cache; ``None`` for a local file (its identity is its
    node's own)."""
    digest: FileDigest | None = None
    """Its checksums from the checkpoint's manifest, if one names it."""
    cache: Closable | None = None
    """The node cache's entry this shard's reads fill (a :class:`weightstream.cache.fill.Fill`),
    if any; closed with the shard."""

    def close(self) -> None:
        """Close its source (and let its cache entry go)."""
        try:
            self.source.close()
        finally:
            if self.cache is not None:
                self.cache.close()

    @property
    def remote(self) -> bool:
        """Whether reads of it cross a network a request at a time (an object store)."""
        return self.backend.remote

    @property
    def size(self) -> int:
        return self.source.size

    @property
    def version(self) -> str | None:
        """The object version (ETag) the header was read at, or the file's identity."""
        return getattr(self.source, "version", None)
