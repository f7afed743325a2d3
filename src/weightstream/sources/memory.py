"""An in-memory store: objects held in this process, read as ``memory://NAME/KEY``.

Two uses. It is the smallest complete backend (one module and one line in the registry), so it
shows what a new store costs and keeps the layers above honest: every load path works on it
unchanged. And it is a store a test can see into: every read is logged with how many ran at
once, reads can be made slow, an object can be replaced mid-load (its version changes), and a
checkpoint needs no disk. The engine's own tests read through it.

    store = MemoryStore("models")
    store.put("llama/model.safetensors", data)
    weightstream.load("memory://models/llama/model.safetensors")

``memory://NAME/PREFIX`` is a folder (its ``model.safetensors.index.json``, or its
``*.safetensors`` objects), as a prefix is on an object store. A store is found by name while it
is open; :meth:`MemoryStore.close` (or leaving its ``with`` block) takes it away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightstream.errors import ConfigError, FormatError, NotFoundError
from weightstream.location import ObjectLocation
from weightstream.sources.base import ReadHow

if TYPE_CHECKING:
    from weightstream.config import StreamConfig

__all__ = ["BACKEND", "MemoryBackend", "MemorySource", "MemoryStore", "ReadLog"]

_stores_lock = threading.Lock()
_stores: dict[str, MemoryStore] = {}


@dataclass
class ReadLog:
    """The reads a store served: ``(reads running at its start, offset, length)`` each, and the
    most that ran at once."""

    entries: list[tuple[int, int, int]] = field(default_factory=list)
    active: int = 0
    most: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.most = self.active


@dataclass(frozen=True)
class _Object:
    data: bytes
    version: str


class MemoryStore:
    """A named set of objects, readable as ``memory://NAME/KEY`` while open.

    ``delay``: seconds each read waits before its bytes are copied (a store with latency).
    ``resident_upto``: an object's first bytes up to this offset report as ``cached`` (held in
    memory already) and the rest as ``direct``, to exercise the engine's page-cache split;
    ``None``: every read reports ``buffered``.
    """

    def __init__(
        self, name: str = "default", *, delay: float = 0.0, resident_upto: int | None = None
    ) -> None:
        if not name or "/" in name:
            raise ConfigError(f"a memory store's name cannot be empty or hold '/', got {name!r}")
        self.name = name
        self.delay = delay
        self.resident_upto = resident_upto
        self.reads = ReadLog()
        self._objects: dict[str, _Object] = {}
        self._lock = threading.Lock()
        self._generation = 0
        with _stores_lock:
            if name in _stores:
                raise ConfigError(f"a memory store named {name!r} is open already")
            _stores[name] = self

    def uri(self, key: str = "") -> str:
        return f"memory://{self.name}/{key}"

    def put(self, key: str, data: bytes | bytearray | memoryview) -> str:
        """Store ``data`` (copied) as ``key``, replacing what was there (a new version); its URI."""
        with self._lock:
            self._generation += 1
            self._objects[key] = _Object(bytes(data), f"m{self._generation}")
        return self.uri(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._objects)

    def get(self, key: str, *, uri: str | None = None) -> _Object:
        with self._lock:
            obj = self._objects.get(key)
        if obj is None:
            raise NotFoundError("no such object", uri=uri or self.uri(key))
        return obj

    def source(self, key: str) -> MemorySource:
        """A source reading ``key`` at its current version."""
        return MemorySource(self, key)

    def close(self) -> None:
        with _stores_lock:
            if _stores.get(self.name) is self:
                del _stores[self.name]

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _store(location: ObjectLocation) -> MemoryStore:
    with _stores_lock:
        store = _stores.get(location.bucket)
    if store is None:
        raise NotFoundError(f"no memory store named {location.bucket!r} is open", uri=location.uri)
    return store


class MemorySource:
    """One object of a :class:`MemoryStore`, bound to the version it was opened at."""

    def __init__(self, store: MemoryStore, key: str) -> None:
        self.store = store
        self.key = key
        self.uri = store.uri(key)
        obj = store.get(key)
        self._data = memoryview(obj.data)
        self.size = len(obj.data)
        self.version: str | None = obj.version

    def read_prefix(self, length: int) -> bytes:
        return bytes(self._data[: max(0, min(length, self.size))])

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        log = self.store.reads
        n = max(0, min(len(buf), self.size - offset))
        with log.lock:
            log.active += 1
            log.most = max(log.most, log.active)
            log.entries.append((log.active, offset, len(buf)))
        try:
            if self.store.delay:
                time.sleep(self.store.delay)
            buf.cast("B")[:n] = self._data[offset : offset + n]
        finally:
            with log.lock:
                log.active -= 1
        upto = self.store.resident_upto
        return n, "buffered" if upto is None else ("cached" if offset < upto else "direct")

    def cached(self, offset: int, length: int) -> bool | None:
        """The :class:`~weightstream.sources.base.Resident` capability, where the store sets
        ``resident_upto``."""
        upto = self.store.resident_upto
        return None if upto is None else offset + length <= upto

    def verify(self) -> None:
        """The :class:`~weightstream.sources.base.Versioned` capability: the object must still be
        the one opened."""
        now = self.store.get(self.key, uri=self.uri).version
        if now != self.version:
            raise FormatError(
                f"object changed since its header was read (version {self.version}, now {now})", uri=self.uri
            )

    def close(self) -> None:
        pass


class MemoryBackend:
    """``memory://`` (see :class:`~weightstream.sources.registry.Backend`)."""

    remote = False

    def settings(self, config: StreamConfig) -> Hashable:
        return None

    def network_fs(self, location: ObjectLocation) -> None:
        return None

    def is_folder(self, location: ObjectLocation, config: StreamConfig) -> bool:
        names = _store(location).names()
        prefix = f"{location.key}/" if location.key else ""
        return location.key not in names and any(k.startswith(prefix) for k in names)

    def list(self, location: ObjectLocation, config: StreamConfig) -> dict[ObjectLocation, int | None]:
        store = _store(location)
        prefix = f"{location.key}/" if location.key else ""
        return {
            location.with_key(k): len(store.get(k).data)
            for k in store.names()
            if k.startswith(prefix) and "/" not in k[len(prefix) :]
        }

    def check(
        self,
        location: ObjectLocation,
        config: StreamConfig,
        listed: dict[ObjectLocation, int | None] | None,
        *,
        what: str = "cannot open",
    ) -> None:
        if location.key not in _store(location).names():
            raise NotFoundError(f"{what}: no such object", uri=location.uri)

    def read_all(
        self, location: ObjectLocation, config: StreamConfig, *, size: int | None, limit: int
    ) -> bytes:
        data = _store(location).get(location.key, uri=location.uri).data
        if len(data) > limit:
            raise FormatError(f"object is {len(data)} bytes, more than {limit}", uri=location.uri)
        return data

    def open(
        self,
        location: ObjectLocation,
        config: StreamConfig,
        *,
        size: int | None = None,
        version: str | None = None,
    ) -> MemorySource:
        source = MemorySource(_store(location), location.key)
        if version is not None and source.version != version:
            raise FormatError(f"object changed (version {version}, now {source.version})", uri=location.uri)
        return source


BACKEND = MemoryBackend()
