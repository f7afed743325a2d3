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

import base64
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Hashable, Sequence

from weightstream.cache.fill import Fill, FillingSource, drain
from weightstream.cache.passed import PassedChecks, local_file, passed_checks
from weightstream.cache.store import Cache, Entry, key_of
from weightstream.config import StreamConfig
from weightstream.errors import WeightStreamError
from weightstream.localfs import network_file_system, regular_file
from weightstream.location import LocalPath, Location, ObjectLocation, parse_location
from weightstream.shard import Shard
from weightstream.sources.base import Source
from weightstream.sources.file import BACKEND as FILE
from weightstream.sources.file import FileSource

__all__ = [
    "Cache",
    "CachedFile",
    "Entry",
    "PassedChecks",
    "attach",
    "drain",
    "forget",
    "local_file",
    "open_whole",
    "passed_checks",
    "reading",
    "recall",
    "remember",
    "stall_seconds",
]

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
    crc32c: int | None = None
    """The entry's CRC32C, taken when it was made whole (read back from what was written): a
    load checks the entry against it where nothing else gives the object's checksum."""
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
        found = cache.whole_entry(uri, version, size)
        if found is not None:
            data, crc = found
            source = CachedFile(data, use=use, direct_io=config.direct_io)
            use = -1
            shard.source.close()
            log.info("cache: %s read from %s", uri, data)
            return dataclasses.replace(
                shard,
                source=source,
                settings=config.direct_io,
                backend=CacheBackend(data, crc),
            )
        part, _ = cache.fill_paths(key, version)
        have = os.stat(part).st_blocks * 512 if os.path.exists(part) else 0
        if not have:  # a fill starts (once a file and boot): a folder listing, 1.7 ms at 1,000 entries
            cache.drop_idle_parts(key, keep=part)
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


# -- starting without the store (cache_ttl) --------------------------------------------------

LAYOUT = ".layout.json"


def remember(
    uri: str, index: Location | None, index_raw: bytes | None, shards: Sequence[Shard], config: StreamConfig
) -> None:
    """Note what the store said of checkpoint ``uri`` just now: its index and each file's version
    and size, so a start within ``cache_ttl`` need not ask it again (:func:`recall`). Only for a
    checkpoint whose files all have a store version; never fails the open."""
    c = cache_of(config)
    if c is None or not shards or any(s.published is None for s in shards):
        return
    record = {
        "uri": uri,
        "checked": time.time(),
        "index": None if index is None else index.uri,
        "index_raw": None if index_raw is None else base64.b64encode(index_raw).decode(),
        "files": [[s.location.uri, s.published, s.size] for s in shards],
    }
    path = os.path.join(c.root, key_of(uri) + LAYOUT)
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cache: cannot note %s's layout: %s", uri, exc)


def recall(
    uri: object, config: StreamConfig
) -> tuple[str, Location | None, bytes | None, dict[str, tuple[str, int]]] | None:
    """What :func:`remember` noted of ``uri`` (a string or an object location), if it was less
    than ``cache_ttl`` seconds ago: its text, index location, the index's bytes, and each file's
    version and size by URI. ``None`` otherwise."""
    c = cache_of(config)
    if c is None or config.cache_ttl <= 0:
        return None
    if isinstance(uri, ObjectLocation):
        text = uri.uri
    elif isinstance(uri, str):
        text = uri
    else:
        return None
    try:
        with open(os.path.join(c.root, key_of(text) + LAYOUT)) as f:
            record = json.load(f)
        if record["uri"] != text or time.time() - float(record["checked"]) > config.cache_ttl:
            return None
        index = None if record["index"] is None else parse_location(record["index"])
        raw = None if record["index_raw"] is None else base64.b64decode(record["index_raw"])
        files = {str(u): (str(v), int(n)) for u, v, n in record["files"]}
    except (OSError, ValueError, KeyError, TypeError, WeightStreamError):
        return None
    return text, index, raw, files


def open_whole(uri: str, version: str, size: int, config: StreamConfig) -> tuple[Source, CacheBackend] | None:
    """``uri``'s whole entry at ``version`` and ``size`` opened (held in use), with its backend;
    ``None`` where there is none."""
    c = cache_of(config)
    if c is None:
        return None
    use = c.use(key_of(uri))
    try:
        found = c.whole_entry(uri, version, size)
        if found is None:
            return None
        data, crc = found
        source = CachedFile(data, use=use, direct_io=config.direct_io)
        use = -1
        return source, CacheBackend(data, crc)
    finally:
        if use >= 0:
            os.close(use)
