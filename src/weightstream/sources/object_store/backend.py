"""The object-store backend: what the registry asks of S3, GCS and Azure."""

from __future__ import annotations

from collections.abc import Hashable

from weightstream.config import StreamConfig
from weightstream.errors import FormatError, NotFoundError
from weightstream.location import ObjectLocation
from weightstream.sources.base import KnownChecksum
from weightstream.sources.object_store.checksum import store_checksum
from weightstream.sources.object_store.listing import list_objects
from weightstream.sources.object_store.source import ObjectSource

__all__ = ["BACKEND", "ObjectBackend"]


class ObjectBackend:
    """S3, GCS and Azure (see :class:`~weightstream.sources.registry.Backend`)."""

    remote = True

    def settings(self, config: StreamConfig) -> Hashable:
        return config.object_store

    def network_fs(self, location: ObjectLocation) -> None:
        return None

    def is_folder(self, location: ObjectLocation, config: StreamConfig) -> bool:
        return not location.key.endswith((".safetensors", ".index.json"))

    def list(self, location: ObjectLocation, config: StreamConfig) -> dict[ObjectLocation, int | None]:
        found = list_objects(location, config)
        return {location.with_key(k): n for k, n in sorted(found.items())}

    def check(
        self,
        location: ObjectLocation,
        config: StreamConfig,
        listed: dict[ObjectLocation, int | None] | None,
        *,
        what: str = "cannot open",
    ) -> None:
        if listed is not None and location not in listed:
            raise NotFoundError(f"{what}: no such object", uri=location.uri)

    def read_all(
        self, location: ObjectLocation, config: StreamConfig, *, size: int | None, limit: int
    ) -> bytes:
        src = ObjectSource(location, config, size=size)
        if src.size > limit:
            raise FormatError(f"object is {src.size} bytes, more than {limit}", uri=location.uri)
        return src.read_prefix(src.size)

    def checksum(
        self, location: ObjectLocation, config: StreamConfig, *, version: str | None
    ) -> KnownChecksum:
        """The object's own full-object CRC, where the store keeps one (an optional member of a
        backend: :func:`~weightstream.sources.object_store.checksum.store_checksum`)."""
        return store_checksum(location, config.object_store, etag=version)

    def open(
        self,
        location: ObjectLocation,
        config: StreamConfig,
        *,
        size: int | None = None,
        version: str | None = None,
    ) -> ObjectSource:
        return ObjectSource(location, config, size=size, etag=version)


BACKEND = ObjectBackend()
