"""A checkpoint opened for reading: its shards, each with a validated header and an open
source that serves the tensor reads too.

``open_checkpoint`` parses the location once, finds the files (:mod:`weightstream.uri`), reads
every header through the source that stays open for the data (one set of descriptors per local
shard, one pinned version per object), validates them, and places every tensor name in the
shard that holds it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import posixpath
import queue
import resource
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from weightstream import cache
from weightstream.config import Storage, StreamConfig, settled
from weightstream.devices import Device
from weightstream.engine.parallel import parallel_map
from weightstream.errors import ConfigError, FormatError, NotFoundError, UnsupportedDtypeError
from weightstream.format.checksums import ALGORITHMS
from weightstream.format.manifest import MANIFEST_NAME, FileDigest, parse_manifest
from weightstream.format.safetensors import (
    PREFIX_SIZE,
    CheckpointIndex,
    TensorEntry,
    parse_header,
    parse_index,
    parse_prefix,
)
from weightstream.localfs import thread_in_read
from weightstream.location import Location, parse_location
from weightstream.memory.room import loading_share
from weightstream.shard import Shard
from weightstream.sources.base import Allowance, Hedgeable, KnownChecksum, Prefetching, Source
from weightstream.sources.registry import backend_for
from weightstream.uri import Layout, UriLike, resolve

if TYPE_CHECKING:
    import torch

    from weightstream.distributed import Distributed
    from weightstream.pipeline import LoadContext, LoadStats, TensorStream
    from weightstream.sources.registry import Backend

__all__ = ["Checkpoint", "Device", "Shard", "checked_config", "checked_names", "open_checkpoint"]

log = logging.getLogger(__name__)

DUPLICATE_NAME = "appears in two files"
"""How a checkpoint without an index that holds a name twice is refused (the Run:ai drop-in
recognises it: Run:ai streams such files one by one and yields the name twice)."""

_FIRST_READ = 64 << 10
"""Bytes read at the start of each shard: the prefix and, nearly always, the whole header."""
_MAX_INDEX_SIZE = 256 << 20
_HEADER_WORKERS = 64
"""Headers read at once when they come slowly: a round trip each (NFS, an object store), so a
checkpoint of 64 shards waits one round trip for them, not four."""
_SERIAL_HEADER_SECONDS = 0.001


class Checkpoint:
    """A safetensors checkpoint whose headers are read and validated; no tensor data read yet.

    It holds each shard's source open (descriptors, a pinned object version) until
    :meth:`close` (or the ``with`` block ends, or it is garbage collected).

    Attributes:
        uri: what was opened.
        shards: one :class:`Shard` per file, in load order.
        files: one :class:`FileIndex` per shard, in load order.
        tensors: name -> :class:`TensorEntry`, in file order.
        metadata: the index's ``metadata`` or, for unindexed checkpoints, the merged
            ``__metadata__`` of the files.
    """

    def __init__(
        self,
        layout: Layout,
        shards: Sequence[Shard],
        index: CheckpointIndex | None,
        config: StreamConfig,
        *,
        placement: dict[str, Location] | None = None,
    ):
        """``placement``: where each shard the index names is (``weight_map`` value -> location)."""
        self.uri = layout.uri
        self.index_uri = None if layout.index is None else layout.index.uri
        self.shards = tuple(shards)
        self.files = tuple(s.header for s in self.shards)
        self.config = config
        self.last_stats: LoadStats | None = None
        """Statistics of the last :meth:`load`."""
        remote = any(s.remote for s in self.shards)
        self.remote = remote
        """Whether any shard lives in an object store (the load then runs with that backend's
        defaults: :meth:`defaults`)."""
        self.network_fs = None if remote else _network_fs(self.shards)
        """The type of network file system a shard lies on (``"nfs4"``, ``"fuse.s3fs"``), or
        ``None``: loads there start deeper (:meth:`StreamConfig.for_network_fs`)."""
        self._closer = weakref.finalize(self, _close_all, list(self.shards))
        self.tensors: dict[str, TensorEntry] = {}
        if index is not None:
            self.metadata: dict[str, Any] = dict(index.metadata)
            self._place(index, placement or {})
        else:
            self.metadata = {}
            owner: dict[str, str] = {}
            for f in self.files:
                self.metadata.update(f.metadata)
                for t in f.tensors:
                    if t.name in owner:
                        raise FormatError(
                            f"tensor {t.name!r} {DUPLICATE_NAME}: {owner[t.name]} and {f.uri}",
                            uri=f.uri,
                            tensor=t.name,
                        )
                    owner[t.name] = f.uri
                    self.tensors[t.name] = t

    def _place(self, index: CheckpointIndex, placement: dict[str, Location]) -> None:
        """Each name is read from the shard the index places it in: another shard may hold a
        tensor of the same name (a stale copy, a draft layer), and it is not this one."""
        by_location = {s.location: {t.name: t for t in s.header.tensors} for s in self.shards}
        placed: dict[str, TensorEntry] = {}
        for name, shard in index.weight_map.items():
            where = placement[shard]
            found = by_location[where].get(name)
            if found is None:
                raise FormatError(
                    f"index {index.uri} places tensor {name!r} in shard {shard!r}, which does not hold it",
                    uri=where.uri,
                    tensor=name,
                )
            placed[name] = found
        for f in self.files:  # file order, then offset order
            for t in f.tensors:
                if placed.get(t.name) is t:
                    self.tensors[t.name] = t
        extra = sum(len(f.tensors) for f in self.files) - len(self.tensors)
        if extra:
            log.debug("%s: %d tensors in the shards are not in the index; ignored", self.uri, extra)

    def defaults(
        self, config: StreamConfig, *, host: Callable[[], tuple[int, int]] | None = None
    ) -> StreamConfig:
        """The settings a load of this checkpoint runs with: ``config`` resolved
        (:meth:`StreamConfig.resolved`) for the storage its shards are on (an object store where
        one is remote, a network file system, or a local one), with ``host`` (asked only on
        network storage, or for a node's bandwidth cap: available bytes and loading processes on
        the machine) for the memory in flight there and each process's share of the cap."""
        storage: Storage = "object_store" if self.remote else "network_fs" if self.network_fs else "local"
        asked = host is not None and (storage != "local" or config.max_node_bandwidth is not None)
        available, processes = host() if asked and host is not None else (0, 1)
        return config.resolved(storage, available=available, processes=processes)

    def shard_of(self, entry: TensorEntry) -> Shard:
        """The shard a tensor entry was read from."""
        return next(s for s in self.shards if s.header.uri == entry.uri)

    @property
    def versions(self) -> dict[str, str]:
        """Object ETags the headers were read at (tensor reads are pinned to them), by URI."""
        return {s.location.uri: v for s in self.shards if (v := s.version) and s.remote}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        return f"Checkpoint({self.uri!r}, files={len(self.files)}, tensors={len(self.tensors)}, bytes={self.total_bytes})"

    def close(self) -> None:
        """Close every shard's source (descriptors); the checkpoint cannot be read after."""
        self._closer()

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def select(self, tensors: Iterable[str] | None) -> list[TensorEntry]:
        """Entries for ``tensors`` (all if ``None``); unknown names raise :class:`NotFoundError`."""
        if tensors is None:
            return list(self.tensors.values())
        names = checked_names(tensors)
        missing = [n for n in names if n not in self.tensors]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise NotFoundError(f"checkpoint has no tensor {shown}", uri=self.uri, tensor=missing[0])
        return [self.tensors[n] for n in names]

    def stream(
        self,
        *,
        device: Device = "cpu",
        tensors: Iterable[str] | None = None,
        config: StreamConfig | None = None,
        on_bytes: Callable[[int], None] | None = None,
        process_group: Any = None,
        distributed: Distributed = False,
        borrow_cached: bool = False,
    ) -> TensorStream:
        """Stream the selected tensors; see :func:`weightstream.stream`. ``config`` defaults to
        the one the checkpoint was opened with."""
        from weightstream.pipeline import opening

        self._check_open()
        config = self.config if config is None else checked_config(config)
        with opening(process_group, distributed, config, device) as load:
            return self.open_stream(load, tensors, on_bytes=on_bytes, borrow_cached=borrow_cached)

    def load(
        self,
        *,
        device: Device = "cpu",
        tensors: Iterable[str] | None = None,
        config: StreamConfig | None = None,
        process_group: Any = None,
        distributed: Distributed = False,
    ) -> dict[str, torch.Tensor]:
        """Load the selected tensors into a dict (in checkpoint order); see :func:`weightstream.load`."""
        stream = self.stream(
            device=device,
            tensors=tensors,
            config=config,
            process_group=process_group,
            distributed=distributed,
        )
        return self.collect(stream)

    def open_stream(
        self,
        load: LoadContext,
        tensors: Iterable[str] | None,
        *,
        on_bytes: Callable[[int], None] | None = None,
        borrow_cached: bool = False,
        owned: bool = False,
    ) -> TensorStream:
        """The stream of a load already resolved (:func:`weightstream.pipeline.opening`: the
        settings, the device and the group, once): the one place a stream is built, for
        :func:`weightstream.stream` and :meth:`stream` alike. The stream runs with this
        checkpoint's defaults applied to ``load.config`` (:meth:`defaults`); ``owned``: it
        closes the checkpoint when it ends."""
        from weightstream.pipeline import TensorStream

        self._check_open()
        if not isinstance(borrow_cached, bool):
            raise ConfigError(
                f"borrow_cached must be True or False, got {borrow_cached!r}", setting="borrow_cached"
            )
        entries = self.select(tensors)
        for e in entries:
            check_torch_type(e)
        host = load.device.type == "cpu"
        settings = self.defaults(load.config, host=lambda: loading_share(host))
        return TensorStream(
            self.uri,
            self.shards,
            entries,
            load.replace(settings),
            on_bytes=on_bytes,
            on_end=self.close if owned else None,
            borrow_cached=borrow_cached,
        )

    def collect(self, stream: TensorStream) -> dict[str, torch.Tensor]:
        """Every tensor of ``stream`` (one of this checkpoint's), in a dict in checkpoint or
        request order: what a load returns. Its statistics become :attr:`last_stats`."""
        with stream:
            got = stream.collect()
        self.last_stats = stream.stats
        # The stream's own selection: ``tensors`` may have been a one-shot iterator, consumed.
        return {name: got[name] for name in stream.names}

    def _check_open(self) -> None:
        if self.closed:
            raise ConfigError(f"checkpoint {self.uri} is closed")


def _network_fs(shards: Iterable[Shard]) -> str | None:
    """The type of network file system one of ``shards`` lies on (each folder asked once: the
    file backend reads the mount table), or ``None``."""
    folders = {(id(s.backend), posixpath.dirname(s.location.uri)): s for s in shards}
    return next((kind for s in folders.values() if (kind := s.backend.network_fs(s.location))), None)


def _close_all(shards: Sequence[Shard]) -> None:
    for shard in shards:
        with contextlib.suppress(Exception):
            shard.close()


def checked_names(tensors: object) -> list[str]:
    """``tensors`` (a name, or an iterable of names, read once) as a list of distinct names in
    order, or a :class:`ConfigError` naming what is wrong with it."""
    if isinstance(tensors, str):
        tensors = [tensors]
    try:
        names = list(dict.fromkeys(tensors))  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError(
            f"tensors must be an iterable of tensor names, got {type(tensors).__name__}",
            setting="tensors",
        ) from None
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise ConfigError(
            f"tensors must hold tensor names (str), got {type(odd[0]).__name__} {odd[0]!r:.80}",
            setting="tensors",
        )
    return names


def checked_config(config: object) -> StreamConfig:
    """``config`` if it is a :class:`StreamConfig`, else a :class:`ConfigError` saying so."""
    if not isinstance(config, StreamConfig):
        raise ConfigError(
            f"config must be a weightstream.StreamConfig (or None for StreamConfig.from_env()), got "
            f"{type(config).__name__}",
            setting="config",
        )
    return config


def check_torch_type(e: TensorEntry) -> None:
    """Raise :class:`UnsupportedDtypeError` for a tensor torch cannot hold."""
    if e.dtype.torch is None:
        raise UnsupportedDtypeError(
            f"dtype {e.dtype.name} has no torch equivalent in this torch version",
            uri=e.uri,
            tensor=e.name,
            byte_range=(e.start, e.end),
        )
    if e.torch_shape is None:
        raise UnsupportedDtypeError(
            f"shape {list(e.shape)} of {e.dtype.name} cannot be held by torch's {e.dtype.torch_name}, "
            f"which packs {e.dtype.packed} values per element along the last dimension",
            uri=e.uri,
            tensor=e.name,
            byte_range=(e.start, e.end),
        )


def ensure_fd_budget(needed: int) -> None:
    """Raise the soft open-files limit toward the hard one if a load needs more descriptors
    (a checkpoint of hundreds of shards against a default soft limit of 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256  # headroom for the rest of the process
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            log.debug("raised RLIMIT_NOFILE soft limit from %d to %d", soft, new)
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit to %d (%s)", new, exc)


def open_shard(
    location: Location,
    config: StreamConfig,
    *,
    size: int | None = None,
    version: str | None = None,
    net: _NetworkOpen | None = None,
) -> Shard:
    """Open one shard and read and validate its header through the source that stays open.
    ``net``: the open is on a network file system (its header read is hedged there)."""
    backend = backend_for(location)
    source = backend.open(location, config, size=size, version=version)
    shard = _read_header(location, source, backend, config, net)
    return shard if config.cache_dir is None else cache.attach(shard, config)


def _read_header(
    location: Location,
    source: Source,
    backend: Backend[Any],
    config: StreamConfig,
    net: _NetworkOpen | None = None,
    *,
    published: str | None = None,
) -> Shard:
    """The shard of ``source`` (opened by ``backend``), its header read and validated; the
    source is closed if that fails."""
    try:
        uri = location.uri
        if net is not None:
            net.reading(location, source)
            head = net.read_header(source, _FIRST_READ, location)
        else:
            head = source.read_prefix(_FIRST_READ)
        n = parse_prefix(head, uri=uri, file_size=source.size, max_header_size=config.max_header_size)
        if PREFIX_SIZE + n > len(head):
            head = source.read_prefix(PREFIX_SIZE + n)
        header = parse_header(head[PREFIX_SIZE : PREFIX_SIZE + n], uri=uri, file_size=source.size)
    except BaseException:
        source.close()
        raise
    if published is None and backend.remote:
        published = getattr(source, "version", None)
    return Shard(
        location,
        header,
        source,
        backend.settings(config),
        backend,
        prefix=head[: header.data_start],  # the header: a load never reads it again
        published=published,
    )


def open_checkpoint(
    uri: UriLike, *, config: StreamConfig | None = None, prefetch: bool = False
) -> Checkpoint:
    """Find a checkpoint's files and read and validate every header (no tensor data is read,
    unless ``prefetch``).

    ``uri``: a local path, ``file://`` URI, ``s3://`` / ``gs://`` / ``az://`` URI, or a list of
    them. ``config`` defaults to :meth:`StreamConfig.from_env`. The checkpoint holds its files
    open until :meth:`Checkpoint.close` (or garbage collection).

    ``prefetch=True``: a load of every tensor follows at once (what :func:`weightstream.load`
    does). On a network file system the first bytes of the data (an eighth of the memory limit
    a load there runs with) are then read while the headers are, so the load does not wait out
    a round trip at its start (:mod:`weightstream.sources.prefetch`); elsewhere it changes
    nothing. Bytes read ahead are held until the load copies them out, or the checkpoint closes.
    """
    config = StreamConfig.from_env() if config is None else checked_config(config)
    if config.cache_dir is not None and config.cache_ttl > 0:
        cached = _open_cached(uri, config)
        if cached is not None:
            return cached
    layout = resolve(uri, config)
    net = _NetworkOpen.start(layout, config, prefetch=prefetch)
    try:
        return _open(layout, config, net)
    finally:
        if net is not None:
            net.finish()  # before the load's first read


def _open(layout: Layout, config: StreamConfig, net: _NetworkOpen | None) -> Checkpoint:
    """The rest of :func:`open_checkpoint`, with ``net`` (the network file system's open) made."""
    index = None
    index_raw: bytes | None = None
    locations = list(layout.files)
    placement: dict[str, Location] = {}
    early = None
    sums = _EarlyChecksums.start(layout, config)
    if layout.index is not None:
        early = _EarlyHeaders.start(layout, config, net)
        try:
            if net is not None:
                net.reading(layout.index, None)
            with net.sending(layout.index) if net is not None else contextlib.nullcontext():
                raw = backend_for(layout.index).read_all(
                    layout.index, config, size=layout.size(layout.index), limit=_MAX_INDEX_SIZE
                )
            index = parse_index(raw, uri=layout.index.uri)
            index_raw = raw
            names = sorted(set(index.weight_map.values()))
            placement = {s: layout.index.sibling(s) for s in names}
            locations = list(dict.fromkeys(placement.values()))
            layout = layout.covering(locations, config)
            for shard, loc in placement.items():
                layout.check_shard(loc, shard, config)
        except BaseException:
            if early is not None:
                early.take(())
            raise
    ready = early.take(locations) if early is not None else {}
    try:
        rest = _open_shards([loc for loc in locations if loc not in ready], layout, config, net)
    except BaseException:
        _close_all(list(ready.values()))
        raise
    by_location = {**ready, **{s.location: s for s in rest}}
    shards = [by_location[loc] for loc in locations]
    try:
        if config.verify != "off":
            shards = _with_digests(shards, layout, config, ask_store=True, early=sums)
        ckpt = Checkpoint(layout, shards, index, config, placement=placement)
        if config.cache_dir is not None:
            cache.remember(layout.uri, layout.index, index_raw, shards, config)
        return ckpt
    except BaseException:
        _close_all(shards)
        raise


def _open_cached(uri: UriLike, config: StreamConfig) -> Checkpoint | None:
    """The checkpoint from the node cache alone, asking the store nothing, where its layout was
    checked against the store less than ``cache_ttl`` seconds ago and every file is whole in the
    cache at the version seen then (``None``: otherwise, and the store is asked)."""
    recalled = cache.recall(uri, config)
    if recalled is None:
        return None
    text, index_loc, raw, files = recalled
    index = None
    placement: dict[str, Location] = {}
    if index_loc is not None and raw is not None:
        index = parse_index(raw, uri=index_loc.uri)
        placement = {s: index_loc.sibling(s) for s in sorted(set(index.weight_map.values()))}
        locations = list(dict.fromkeys(placement.values()))
    else:
        locations = [parse_location(u) for u in files]
    shards: list[Shard] = []
    try:
        for loc in locations:
            found = files.get(loc.uri)
            opened = None if found is None else cache.open_whole(loc.uri, *found, config)
            if opened is None:
                _close_all(shards)
                return None
            source, backend = opened
            shards.append(_read_header(loc, source, backend, config, published=found[0] if found else None))
        layout = Layout(uri=text, files=() if index is not None else tuple(locations), index=index_loc)
        if config.verify != "off":
            shards = _with_digests(shards, layout, config, ask_store=False)
        return Checkpoint(layout, shards, index, config, placement=placement)
    except BaseException:
        _close_all(shards)
        raise


def _with_digests(
    shards: list[Shard],
    layout: Layout,
    config: StreamConfig,
    *,
    ask_store: bool,
    early: _EarlyChecksums | None = None,
) -> list[Shard]:
    """The shards with their checksums from the checkpoint's manifest (``config.manifest``, or
    ``weightstream.manifest.json`` beside the index or the first file, where one is there: a
    listing made already says so, with no request); where it names none, an S3 object's own
    full-object CRC (one ``HEAD`` per object, all at once; ``ask_store``: not on a start that
    asks the store nothing; ``early``: those asked while the headers were read).
    ``verify="on"``: every shard must have one."""
    named = config.manifest
    if named is not None:
        where = parse_location(named)
    else:
        where = (layout.index or shards[0].location).sibling(MANIFEST_NAME)
    digests: dict[str, FileDigest] = {}
    listed = layout.listed
    if named is not None or (where in listed if listed is not None else not backend_for(where).remote):
        try:
            raw = backend_for(where).read_all(where, config, size=layout.size(where), limit=_MAX_INDEX_SIZE)
        except NotFoundError:
            if named is not None:
                raise
        else:
            digests = parse_manifest(raw, uri=where.uri)
    unnamed = [s for s in shards if s.location.name not in digests]
    store = _own_checksums(unnamed, config, early) if ask_store else {}
    out = []
    for shard in shards:
        digest = digests.get(shard.location.name)
        answer = store.get(shard.location)
        if digest is None and answer is not None and answer.algorithm is not None:
            if answer.algorithm in ALGORITHMS or config.verify == "on":
                name, size = answer.algorithm, shard.size
                if answer.pieces or answer.composite:  # a multipart upload's parts: a piece each
                    digest = FileDigest(
                        shard.location.name, size, answer.value, answer.piece_size, answer.pieces,
                        algorithm=name, origin=answer.origin, composite=answer.composite,
                        confirm=answer.confirm, bounds=answer.bounds,
                    )  # fmt: skip
                else:
                    digest = FileDigest.whole_object(
                        shard.location.name, size, name, answer.value, answer.origin
                    )
            else:
                answer = KnownChecksum.none(
                    f"its {answer.algorithm} is checked with verify='on' only (it needs the bytes in "
                    "order, at about 1.8 GB/s a file)"
                )
        if digest is None and config.verify != "on":
            digest = _entry_digest(shard)
        if digest is None:
            why = f"{where.uri} does not name it" + (
                f"; the store: {answer.why}" if answer is not None else ""
            )
            if config.verify == "on":
                raise FormatError(
                    f"verify='on' and no checksum is known for it ({why})", uri=shard.location.uri
                )
            log.debug("%s: not checked while read: %s", shard.location.uri, why)
            out.append(shard)
            continue
        if digest.size != shard.size:
            raise FormatError(
                f"the manifest {where.uri} gives {digest.size} bytes, the file has {shard.size}",
                uri=shard.location.uri,
            )
        out.append(dataclasses.replace(shard, digest=digest))
    return out


def _entry_digest(shard: Shard) -> FileDigest | None:
    """The CRC32C the node cache took of ``shard``'s entry when it was made whole, where the
    shard is read from one: it finds a copy the disk damaged since (it vouches for no more than
    the store's bytes as they were read, so ``verify="on"`` still asks for a published one)."""
    backend = shard.backend
    if not isinstance(backend, cache.CacheBackend) or backend.crc32c is None:
        return None
    return FileDigest.whole_object(
        shard.location.name,
        shard.size,
        "crc32c",
        backend.crc32c,
        "the node cache's CRC of its copy (taken when it was filled)",
    )


def _own_checksums(
    shards: list[Shard], config: StreamConfig, early: _EarlyChecksums | None = None
) -> dict[Location, KnownChecksum]:
    """Each file's checksum that its storage keeps, where the backend of its location can say
    (an optional member of a backend, ``checksum``): an S3 object's (one ``HEAD`` each, all at
    once; also for a shard the node cache serves, whose bytes are then checked against the
    store's), and, with ``verify="on"`` only, the SHA-256 of a file downloaded from the Hugging
    Face Hub (no request; it needs the bytes in order: :class:`~weightstream.engine.verify.InOrder`)."""
    found = [(s, backend_for(s.location)) for s in shards]
    asking = [
        (s, b.checksum) for s, b in found if hasattr(b, "checksum") and (b.remote or config.verify == "on")
    ]
    known: dict[Location, KnownChecksum] = {}
    if early is not None:
        for s, _ in asking:
            answer = early.answer(s.location, s.published)
            if answer is not None:
                known[s.location] = answer
        asking = [job for job in asking if job[0].location not in known]
    return known | _ask_store([(s.location, ask, s.published) for s, ask in asking], config)


def _ask_store(
    jobs: list[tuple[Location, Any, str | None]], config: StreamConfig
) -> dict[Location, KnownChecksum]:
    """Each location's answer to its backend's ``checksum`` (for that version; ``None``: the
    version there now), all at once."""
    answers = parallel_map(
        lambda job: job[1](job[0], config, version=job[2]),
        jobs,
        workers=max(1, min(32, len(jobs))),
        timeout=_checksum_timeout(config),
        what="checksum HEAD",
    )
    return dict(zip((loc for loc, _, _ in jobs), answers, strict=True))


def _checksum_timeout(config: StreamConfig) -> float:
    return 2 * config.object_store.metadata_timeout + 1


def _listed_beside(layout: Layout, beside: Location) -> list[Location]:
    """The ``*.safetensors`` files the layout's listing shows in ``beside``'s folder."""
    return [
        loc
        for loc in layout.listed or ()
        if loc.name.endswith(".safetensors") and beside.sibling(loc.name) == loc
    ]


class _EarlyChecksums:
    """The store's own checksums of the shards a listing shows beside the index (or of the
    files listed), asked while the index and the headers are read: one ``HEAD`` each, of the
    version there now, so that a load that checks them waits no round trip of its own. An
    answer is used only where it is of the version the shard's header read found (the ETag);
    any other shard is asked again as before, with ``If-Match``. Not started where a manifest
    lies beside them (it names the shards, as a rule) or is named: the ``HEAD`` would be
    wasted."""

    def __init__(self, asking: list[tuple[Location, Any]], config: StreamConfig) -> None:
        self._answers: dict[Location, KnownChecksum] = {}
        self._done = threading.Event()
        self._timeout = _checksum_timeout(config)

        def run() -> None:
            try:
                self._answers = _ask_store([(loc, ask, None) for loc, ask in asking], config)
            except Exception as exc:  # asked again, each with its own version, by the open
                log.debug("checksum HEADs sent early: %s", exc)
            finally:
                self._done.set()

        threading.Thread(target=run, name="weightstream-early-checksums", daemon=True).start()

    @classmethod
    def start(cls, layout: Layout, config: StreamConfig) -> _EarlyChecksums | None:
        listed = layout.listed
        if config.verify == "off" or config.manifest is not None or listed is None:
            return None
        beside = layout.index or (layout.files[0] if layout.files else None)
        if beside is None or beside.sibling(MANIFEST_NAME) in listed:
            return None
        asking = []
        for loc in _listed_beside(layout, beside):
            backend = backend_for(loc)
            if backend.remote and hasattr(backend, "checksum"):
                asking.append((loc, backend.checksum))
        return cls(asking, config) if asking else None

    def answer(self, location: Location, version: str | None) -> KnownChecksum | None:
        """The answer for ``location`` if it was asked and is of ``version``, else ``None``."""
        if version is None or not self._done.wait(self._timeout):
            return None
        answer = self._answers.get(location)
        if answer is None or answer.version is None or answer.version.strip('"') != version.strip('"'):
            return None
        return answer


class _EarlyHeaders:
    """The headers of the ``*.safetensors`` files listed beside an index, read while the index
    itself is read: on storage where every read is a round trip (NFS, an object store) the
    index's answer and the headers' then arrive together, one round trip after the listing
    instead of two.

    Only what the index names is used (:meth:`take`); every other file opened early is closed
    again before the open returns. A file that fails to open early is opened again by the
    ordinary path, which reports its error in the ordinary words: reading early never changes
    what a load says or does. Each file is checked to be a regular file before it is opened (a
    FIFO among the files would block an open)."""

    def __init__(
        self,
        candidates: list[Location],
        layout: Layout,
        config: StreamConfig,
        net: _NetworkOpen | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._opened: dict[Location, Shard] = {}
        self._taken = False
        self._timeout = config.io_timeout

        def one(loc: Location) -> None:
            shard = None
            try:
                backend_for(loc).check(loc, config, layout.listed)
                shard = open_shard(loc, config, size=layout.size(loc), net=net)
            except Exception as exc:  # opened again by the ordinary path, which reports it
                log.debug("%s: header not read early (%s); read with the others", loc.uri, exc)
            if shard is None:
                return
            with self._lock:
                if self._taken:
                    shard.close()
                else:
                    self._opened[loc] = shard

        def run() -> None:
            with contextlib.suppress(Exception):  # a late header: the ordinary path's deadline rules
                parallel_map(
                    one,
                    candidates,
                    workers=_HEADER_WORKERS,
                    timeout=config.io_timeout,
                    what="reading headers",
                    serial_seconds=0.0 if layout_remote(candidates) else _SERIAL_HEADER_SECONDS,
                )

        self._thread = threading.Thread(target=run, name="weightstream-early-headers", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls, layout: Layout, config: StreamConfig, net: _NetworkOpen | None = None
    ) -> _EarlyHeaders | None:
        """Start reading, where the index lies in a listed folder or prefix with shards beside it."""
        index = layout.index
        if index is None or layout.listed is None:
            return None
        candidates = _listed_beside(layout, index)
        if not candidates:
            return None
        ensure_fd_budget(2 * len(candidates))
        candidates = sorted(candidates, key=str)
        if net is not None:
            net.expect(candidates)
        return cls(candidates, layout, config, net)

    def take(self, wanted: Iterable[Location]) -> dict[Location, Shard]:
        """The shards of ``wanted`` whose headers were read early; every other shard opened early
        is closed. Waits for the early reads to end (they were all sent together, so about one
        round trip; at most ``io_timeout``), so that no read of the open outlives it; one still
        running after that closes its shard when it ends."""
        wanted = set(wanted)
        self._thread.join(self._timeout)
        with self._lock:
            self._taken = True
            opened, self._opened = self._opened, {}
        _close_all([s for loc, s in opened.items() if loc not in wanted])
        return {loc: s for loc, s in opened.items() if loc in wanted}


def layout_remote(locations: Sequence[Location]) -> bool:
    return any(backend_for(loc).remote for loc in locations)


def _open_shards(
    locations: list[Location], layout: Layout, config: StreamConfig, net: _NetworkOpen | None = None
) -> list[Shard]:
    """Every shard opened, its header read. Local headers are read one after another while they
    come fast (from the page cache, ~0.2 ms a shard, less than starting a thread); the first
    slow one (a cold disk, NFS) brings in parallel reads. Object stores read in parallel from
    the start: each request is a round trip. On any failure, every shard opened is closed,
    including those whose open finishes after the failure was raised."""
    if not locations:
        return []
    ensure_fd_budget(2 * len(locations))  # a buffered and an O_DIRECT descriptor each
    if net is not None:
        net.expect(locations)
    lock = threading.Lock()
    opened: list[Shard] = []
    failed = [False]

    def one(loc: Location) -> Shard:
        shard = open_shard(loc, config, size=layout.size(loc), net=net)
        with lock:
            if failed[0]:
                shard.close()
            else:
                opened.append(shard)
        return shard

    local = not layout_remote(locations)
    try:
        return parallel_map(
            one,
            locations,
            workers=_HEADER_WORKERS,
            timeout=config.io_timeout,
            what="reading headers",
            serial_seconds=_SERIAL_HEADER_SECONDS if local else 0.0,
        )
    except BaseException:
        with lock:
            failed[0] = True
            _close_all(opened)
        raise


class _NetworkOpen:
    """An open on a network file system, where every read is a round trip with a latency tail
    and the open waits for the slowest of them.

    *Hedged header reads.* A header read still unanswered after :data:`_HEDGE_FACTOR` times
    the fastest header read of this open (and at least :data:`_HEDGE_FLOOR`) is sent again as a
    request of its own (``O_DIRECT``: a buffered read would wait on the page the first is
    filling); the first answer wins. With the seed's tail (p50 126 ms, p99 1.8 s) an open of
    64 shards waits for about the 98.5th percentile of 64 draws, nearly every time; a hedge costs
    one more 64 KiB request.

    *Reads ahead* (for a load of every tensor, ``prefetch``): the first ``budget`` bytes of the
    load order (the headers' order: the index sorts its shards by name, as the listing is sorted
    here), each shard from its start; see :mod:`weightstream.sources.prefetch`. They are sent
    only once the index read and every header read of the first round have been sent (or
    :data:`_WAIT_FOR_HEADERS` after the first was): a header read queued behind a gigabyte read
    ahead would arrive that much later, and every data read waits for the headers. Where a
    shard's header read is never sent (its open failed), it is not read ahead; the load's own
    reads say what is wrong with it."""

    def __init__(self, budget: int, index: Location | None) -> None:
        self._budget = budget
        self._index = index
        self._fastest: float | None = None
        """The fastest header read of this open so far, in seconds."""
        self._cond = threading.Condition()
        self._order: list[Location] | None = None
        self._sources: dict[Location, Source | None] = {}
        self._first: float | None = None
        self._allowance = Allowance(budget * _EXTEND_SHARE)
        """What the reads ahead may add while the open lasts (see :meth:`finish`)."""
        self._senders: dict[Location, int | None] = {}
        """The thread sending each first read (a native id), ``None`` once it is answered."""
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, layout: Layout, config: StreamConfig, *, prefetch: bool) -> _NetworkOpen | None:
        """The open of ``layout`` where it lies on a network file system; else ``None``.

        With ``prefetch``, it reads ahead an eighth of the memory limit a load there runs with
        (:meth:`StreamConfig.for_network_fs`, with this host's memory: what is read ahead is
        host memory, whatever the load's device): 256 MiB at the default limit, 1 GiB at the
        8 GiB of a large host. It need only cover the time from its start to the load's own
        reads being in flight, about one round trip (at 188 ms and 1 GB/s, 0.2-0.3 s); every
        byte more is one more copy. Measured on the emulated NFS (188 ms, 1 GB/s, 2 cores):
        128 MiB 0.924 of the link, 256 MiB 0.941, 512 MiB 0.933, 1 GiB 0.922, none 0.893
        (bench/RESULTS.md)."""
        where = layout.index if layout.index is not None else (layout.files[0] if layout.files else None)
        if where is None or not backend_for(where).network_fs(where):
            return None
        if not prefetch:
            return cls(0, layout.index)
        available, processes = loading_share(True)
        limit = settled(config.for_network_fs(available=available, processes=processes).memory_limit)
        return cls(limit // _AHEAD_SHARE, layout.index)

    def read_header(self, source: Source, length: int, location: Location) -> bytes:
        """``source.read_prefix(length)``, hedged (see the class docstring)."""
        if not isinstance(source, Hedgeable):
            with self.sending(location):
                return source.read_prefix(length)
        answers: queue.SimpleQueue[tuple[bytes | None, BaseException | None]] = queue.SimpleQueue()

        def attempt(read: Callable[[int], bytes | None], first: bool) -> None:
            try:
                with self.sending(location) if first else contextlib.nullcontext():
                    data = read(length)
                answers.put((data, None))
            except BaseException as exc:  # the caller raises it, if no attempt succeeds
                answers.put((None, exc))

        start = time.monotonic()
        threading.Thread(
            target=attempt, args=(source.read_prefix, True), name="weightstream-header", daemon=True
        ).start()
        pending, hedged, failure = 1, False, None
        while pending:
            wait = None
            if not hedged:
                after = self._hedge_after()
                wait = _CLOCK_POLL if after is None else max(0.0, start + after - time.monotonic())
            try:
                data, exc = answers.get(timeout=wait)
            except queue.Empty:
                after = self._hedge_after()
                if after is not None and time.monotonic() - start >= after:
                    log.debug("%s: header read unanswered after %.3f s; sent again", source.uri, after)
                    hedged, pending = True, pending + 1
                    threading.Thread(
                        target=attempt,
                        args=(source.read_prefix_again, False),
                        name="weightstream-header",
                        daemon=True,
                    ).start()
                continue
            pending -= 1
            if data is not None:
                with self._cond:
                    seconds = time.monotonic() - start
                    self._fastest = seconds if self._fastest is None else min(self._fastest, seconds)
                return data
            if failure is None:
                failure = exc  # the first attempt's words, unless the other answers
        assert failure is not None
        raise failure

    def _hedge_after(self) -> float | None:
        with self._cond:
            fastest = self._fastest
        return None if fastest is None else max(_HEDGE_FLOOR, _HEDGE_FACTOR * fastest)

    def expect(self, order: list[Location]) -> None:
        """The shards whose headers are about to be read, in load order (the first call wins)."""
        with self._cond:
            if self._order is not None or self._budget <= 0:
                return
            self._order = list(order)
        self._thread = threading.Thread(target=self._run, name="weightstream-read-ahead", daemon=True)
        self._thread.start()

    def reading(self, location: Location, source: Source | None) -> None:
        """``source``'s header read (``None``: the index's read) is about to be sent."""
        with self._cond:
            self._sources[location] = source
            if self._first is None:
                self._first = time.monotonic()
            self._cond.notify_all()

    def finish(self) -> None:
        """The open is over: the reads ahead add nothing more from now on, so the load's own
        reads, which start after this, never read a byte the reads ahead read too. Until then
        each part's thread reads one more part once it has read its own (at most
        :data:`_EXTEND_SHARE` times the first guess in all), so an open held up by a read in
        the latency tail does not leave the link idle."""
        self._allowance.close()
        if self._allowance.added:
            log.debug("read %d bytes more ahead while the open lasted", self._allowance.added)

    @contextlib.contextmanager
    def sending(self, location: Location) -> Iterator[None]:
        """The calling thread sends ``location``'s first read in this block (see :meth:`_sent`)."""
        with self._cond:
            self._senders[location] = threading.get_native_id()
        try:
            yield
        finally:
            with self._cond:
                self._senders[location] = None
                self._cond.notify_all()

    def _sent(self, locations: set[Location]) -> bool | None:
        """Whether the first read of each of ``locations`` whose read is about to be sent
        (:meth:`reading`) has reached the kernel (its thread is in a read system call) or
        been answered; ``None`` where a thread's state cannot be told."""
        with self._cond:
            senders = [self._senders.get(loc, 0) for loc in locations if loc in self._sources]
        for tid in senders:
            if tid is None:
                continue  # answered already
            if tid == 0:
                return False  # its thread has not begun the read
            state = thread_in_read(tid)
            if not state:
                return state
        return True

    def _wait_sent(self, locations: set[Location]) -> None:
        """Until the header reads of ``locations`` are in the kernel, or :data:`_SEND_GAP`."""
        until = time.monotonic() + _SEND_GAP
        while (left := until - time.monotonic()) > 0:
            sent = self._sent(locations)
            if sent:
                return
            time.sleep(left if sent is None else min(left, _SENT_POLL))

    def _run(self) -> None:
        order = self._order or []
        first_round = set(order[:_HEADER_WORKERS])
        if self._index is not None:
            first_round.add(self._index)
        with self._cond:
            self._cond.wait_for(lambda: self._first is not None, timeout=_WAIT_FOR_OPENS)
            if self._first is None:
                return
            deadline = self._first + _WAIT_FOR_HEADERS
            while not first_round <= self._sources.keys() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            sources = dict(self._sources)
        self._wait_sent(first_round)  # the header reads reach the kernel first
        left, go = self._budget, threading.Event()
        for loc in order:
            source = sources.get(loc)
            if left <= 0:
                break
            if (
                isinstance(source, Prefetching)
                and source.prefetch(left, go=go, allowance=self._allowance) is not None
            ):
                log.debug("%s: reading the first %d bytes ahead", loc.uri, min(left, source.size))
            if source is not None:
                left -= source.size
        go.set()  # every thread started first (see Prefetch.start), and sent at once


_HEDGE_FACTOR = 3.0
_HEDGE_FLOOR = 0.02
_CLOCK_POLL = 0.01
"""How often a header read checks whether another has answered (no hedge before one has)."""
_AHEAD_SHARE = 8
"""The reads ahead take this fraction of the memory limit (see :meth:`_NetworkOpen.start`)."""
_EXTEND_SHARE = 3
"""While the open lasts, the reads ahead may add this many times their first guess (see
:meth:`_NetworkOpen.finish`): with the default half the memory limit in all."""
_WAIT_FOR_OPENS = 10.0
"""How long the reads ahead wait for the first header read to be sent (the opens before it
are round trips too on a network file system)."""
_WAIT_FOR_HEADERS = 0.05
"""How long after the first header read the reads ahead wait for the others to be sent."""
_SEND_GAP = 0.02
"""At most this long between the last header read's start and the reads ahead: its thread
must still get the GIL to send it, and a read sent after a gigabyte of reads ahead would wait
behind them. The reads ahead go as soon as every header read's thread is in the kernel
(:func:`~weightstream.localfs.thread_in_read`; within 1-3 ms on the emulated NFS), and after
this long where that cannot be told. A round trip of a network file system is 1-200 ms."""
_SENT_POLL = 0.0005
