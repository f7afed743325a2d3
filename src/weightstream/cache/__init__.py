"""A node's cache of remote checkpoints, filled while a load streams (``StreamConfig.cache_dir``).

A remote shard (an object store's) opened with the cache on is one of:

* **whole in the cache** at the version the store holds now (checked by the header read the
  open makes anyway: one request per shard): the shard is read from the cache's file, a local
  file like any other (O_DIRECT, the page cache, lending);
* **not yet whole**: the shard is read from the store as before, and each read's bytes are
  also written to the cache, by whichever of the node's processes read them
  (:mod:`weightstream.cache.fill`); the first process to see every byte written makes the
  entry whole.

The folder's layout, locks and room are :mod:`weightstream.cache.store`'s. A cache that cannot
be used (a full disk, no room under ``cache_max_bytes``, a file without a version) is skipped
with a log line: the cache never fails a load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Hashable

from weightstream.cache.fill import Fill, FillingSource, drain
from weightstream.cache.store import PART, Cache, Entry, key_of
from weightstream.config import StreamConfig
from weightstream.localfs import network_file_system, regular_file
from weightstream.location import LocalPath, Location
from weightstream.shard import Shard
from weightstream.sources.base import Source
from weightstream.sources.file import BACKEND as FILE
from weightstream.sources.file import FileSource

__all__ = ["Cache", "CachedFile", "Entry", "attach", "drain", "forget", "reading", "stall_seconds"]

log = logging.getLogger(__name__)

_caches: dict[tuple[str, int | None], Cache] = {}
_lock = threading.Lock()


def cache_of(config: StreamConfig) -> Cache | None:
    """The cache ``config`` names (made once per folder and limit), or ``None``."""
    if config.cache_dir is None:
        return None
    key = (os.path.abspath(os.path.expanduser(config.cache_dir)), config.cache_max_bytes)
    with _lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = Cache(*key)
        return cache


def stall_seconds(config: StreamConfig) -> float:
    """How long a read waits for another process's read of the same bytes while the journal
    shows no progress."""
    return min(30.0, max(2.0, config.io_timeout / 4))


class CachedFile(FileSource):
    """A whole cache entry read as a local file, holding the entry in use until closed."""

    def __init__(self, path: str, *, use: int, direct_io: str) -> None:
        self._use = use
        super().__init__(path, direct_io=direct_io)  # type: ignore[arg-type]

    def close(self) -> None:
        try:
            super().close()
        finally:
            use, self._use = self._use, -1
            if use >= 0:
                with contextlib.suppress(OSError):
                    os.close(use)


@dataclasses.dataclass(frozen=True)
class CacheBackend:
    """The backend of a shard read from its cache entry: a local file at ``path`` named by the
    remote location it copies (see :class:`~weightstream.sources.registry.Backend`)."""

    path: str
    remote = False

    def settings(self, config: StreamConfig) -> Hashable:
        return config.direct_io

    def network_fs(self, location: Location) -> str | None:
        return network_file_system(os.path.dirname(self.path))

    def is_folder(self, location: Location, config: StreamConfig) -> bool:
        return False

    def list(self, location: Location, config: StreamConfig) -> dict[Location, int | None]:
        return {}

    def check(
        self, location: Location, config: StreamConfig, listed: object = None, *, what: str = "cannot open"
    ) -> None:
        regular_file(self.path, what=what)

    def read_all(self, location: Location, config: StreamConfig, *, size: int | None, limit: int) -> bytes:
        return FILE.read_all(LocalPath(self.path), config, size=size, limit=limit)

    def open(
        self, location: Location, config: StreamConfig, *, size: int | None = None, version: str | None = None
    ) -> Source:
        return FileSource(self.path, direct_io=config.direct_io)


def attach(shard: Shard, config: StreamConfig) -> Shard:
    """``shard`` (its header read from the store) as the cache serves it: read from its whole
    entry, or filled while it is read (module docstring; the first bytes its open read are
    written to the entry at once: a load reads the tensors, never the header again).
    Unchanged where the cache is off or cannot be used."""
    cache = cache_of(config)
    version = shard.version
    if cache is None or not shard.remote or version is None:
        return shard
    uri, size = shard.location.uri, shard.size
    key = key_of(uri)
    use = -1
    try:
        use = cache.use(key)
        data = cache.whole(uri, version, size)
        if data is not None:
            source = CachedFile(data, use=use, direct_io=config.direct_io)
            use = -1
            shard.source.close()
            log.info("cache: %s read from %s", uri, data)
            return dataclasses.replace(
                shard, source=source, settings=config.direct_io, backend=CacheBackend(data)
            )
        part = cache.path(key, PART, version)
        have = os.stat(part).st_blocks * 512 if os.path.exists(part) else 0
        if not cache.make_room(max(0, size - have), keep=key):
            log.warning("cache: no room for %s (%.2f GB) in %s", uri, size / 1e9, cache.root)
            return shard
        fill = Fill(cache, uri, version, size, use=use, stall=stall_seconds(config))
        use = -1
        fill.seed(shard.prefix)
        return dataclasses.replace(shard, cache=fill)
    except OSError as exc:
        log.warning("cache: not used for %s: %s", uri, exc)
        return shard
    finally:
        if use >= 0:
            os.close(use)


def reading(shard: Shard, source: Source) -> Source:
    """The source one load reads ``shard`` through: ``source`` itself, or with the shard's
    fill."""
    fill = shard.cache
    if isinstance(fill, Fill) and not fill.dropped:
        return FillingSource(source, fill)
    return source


def forget(shard: Shard) -> None:
    """``shard``'s bytes failed a check: keep none of them in the cache (its part, and a whole
    entry of that version, even one this process is reading: its open descriptors keep reading
    the removed file)."""
    fill = shard.cache
    if isinstance(fill, Fill):
        fill.drop("its bytes failed the manifest's check", remove=True)
        cache = fill.cache
    elif isinstance(shard.backend, CacheBackend):
        cache = Cache(os.path.dirname(shard.backend.path))
    else:
        return
    if shard.published is not None:
        try:
            cache.discard(shard.location.uri, shard.published)
        except OSError as exc:
            log.warning("cache: cannot remove %s's entry: %s", shard.location.uri, exc)
