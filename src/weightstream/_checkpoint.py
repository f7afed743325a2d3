"""A checkpoint opened for reading: validated headers of every shard, and the loads over them."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import resource
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from weightstream.config import StreamConfig
from weightstream.distributed import (
    Distributed,
    Exchange,
    plan_digest,
    report_failure,
    resolve_group,
    run_distributed,
)
from weightstream.engine.parallel import parallel_map
from weightstream.engine.plan import Block, make_plan
from weightstream.engine.scheduler import ReadCounters, run_plan
from weightstream.engine.sink import HostSink, Sink, StagedSink
from weightstream.errors import (
    ConfigError,
    FormatError,
    NotFoundError,
    ReadError,
    UnsupportedDtypeError,
)
from weightstream.format.safetensors import (
    PREFIX_SIZE,
    CheckpointIndex,
    FileIndex,
    TensorEntry,
    parse_header,
    parse_index,
    parse_prefix,
)
from weightstream.memory.buffers import allocate
from weightstream.sources.base import Source
from weightstream.sources.file import FileSource, open_regular, os_error
from weightstream.sources.object_store import ObjectSource, RequestStats, parse_object_uri
from weightstream.tuning.online import make_tuning
from weightstream.uri import Layout, UriLike, resolve

__all__ = ["Checkpoint", "LoadStats", "TensorStream", "open_checkpoint"]

log = logging.getLogger(__name__)

DUPLICATE_NAME = "appears in two files"
"""How a checkpoint without an index that holds a name twice is refused (the Run:ai drop-in
recognises it: Run:ai streams such files one by one and yields the name twice)."""

_FIRST_READ = 64 << 10
"""Bytes read at the start of each shard: the prefix and, nearly always, the whole header."""
_MAX_INDEX_SIZE = 256 << 20
_HEADER_WORKERS = 16
_SERIAL_HEADER_SECONDS = 0.001
_STAGING_SLOT = 16 << 20

Device = str | torch.device


@dataclass
class LoadStats:
    """What a load did. Filled in while it runs; final once the stream is exhausted or closed."""

    uri: str
    files: int
    tensors: int = 0
    bytes: int = 0
    """Tensor bytes handed to the caller."""
    bytes_read: int = 0
    """Bytes read from storage (tensor bytes plus alignment padding)."""
    seconds: float = 0.0
    direct_bytes: int = 0
    cached_bytes: int = 0
    buffered_bytes: int = 0
    network_bytes: int = 0
    """Bytes fetched from an object store."""
    chunks: int = 0
    peak_held_bytes: int = 0
    """Most bytes read but not yet handed to the caller (bounded by ``memory_limit``)."""
    peak_rss_bytes: int = 0
    """Peak resident memory of the whole process so far."""
    complete: bool = False
    requests: dict[str, Any] | None = None
    """Object stores only: requests, retries, stalls aborted, timeouts, throttling answers and
    request latency percentiles (see :class:`~weightstream.sources.object_store.RequestStats`)."""
    settings: dict[str, Any] = field(default_factory=dict)
    tuning: dict[str, Any] | None = None
    """What the online tuner did: start and final depth, read size, and each decision (time,
    depth, measured rate, reason). ``None`` with ``autotune=False``."""
    rank: int | None = None
    """Distributed loads: this rank's number within the group (``None`` for a plain load)."""
    world_size: int = 1
    """Ranks that shared the reads (1 for a plain load)."""
    bytes_received: int = 0
    """Distributed loads: bytes this rank received from the other ranks instead of reading."""

    @property
    def gb_per_s(self) -> float:
        """Tensor bytes per second, in GB/s (10^9)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gb_per_s"] = round(self.gb_per_s, 4)
        return out


class TensorStream(Iterator[tuple[str, torch.Tensor]]):
    """Iterator of ``(name, tensor)`` in completion order; ``stats`` says what it did.

    Each tensor belongs to the caller: the stream never writes to or frees it after yielding it.
    Closing the stream (or leaving its ``with`` block) early cancels outstanding reads.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        entries: list[TensorEntry],
        *,
        device: torch.device,
        config: StreamConfig,
        on_bytes: Callable[[int], None] | None = None,
        group: Any = None,
    ) -> None:
        self.checkpoint = checkpoint
        if checkpoint.remote:
            config = config.for_remote()
        self.config = config
        self.device = device
        self.names = [e.name for e in entries]
        """The tensors this stream yields (in checkpoint or request order)."""
        self.expected = len(entries)
        self.stats = LoadStats(uri=checkpoint.uri, files=len(checkpoint.files), settings=config.as_dict())
        self.on_bytes = on_bytes
        per_file: dict[str, list[TensorEntry]] = {f.uri: [] for f in checkpoint.files}
        for e in entries:
            per_file[e.uri].append(e)
        self._used = [f for f in checkpoint.files if per_file[f.uri]]
        self._plan = make_plan([per_file[f.uri] for f in self._used], chunk_size=config.read_size)
        self._exchange = (
            None if group is None else Exchange(group, device=device, timeout=config.exchange_timeout)
        )
        if self._exchange is not None:
            self.stats.rank, self.stats.world_size = self._exchange.rank, self._exchange.world
        self._started = False
        self._keep_all = False
        """Set by ``load``, which keeps every tensor until the end (see ``run_plan``)."""
        self._gen = self._run()

    @property
    def bytes_to_read(self) -> int:
        """Bytes this stream reads from storage (tensor bytes plus alignment padding): the total
        that ``on_bytes`` callbacks add up to."""
        return self._plan.read_bytes

    def __iter__(self) -> TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._gen)

    def close(self) -> None:
        if not self._started and self._exchange is not None:
            # Closed before the first tensor: the generator never ran, so tell the other ranks here.
            self._exchange.report(GeneratorExit())
        self._gen.close()

    def __enter__(self) -> TensorStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        counters = ReadCounters()
        requests = RequestStats()
        start = time.perf_counter()
        sources: list[Source] = []
        tuning = None
        sink: Sink | None = None
        exchange = self._exchange
        self._started = True
        try:
            if exchange is not None:
                sizes = [f.size for f in self._used]
                exchange.check(plan_digest(self._plan, sizes, memory_limit=self.config.memory_limit))
            _ensure_fd_budget(2 * len(self._used))  # a buffered and an O_DIRECT descriptor each
            for f in self._used:
                src = open_source(
                    f.uri,
                    self.config,
                    size=self.checkpoint.sizes.get(f.uri),
                    version=self.checkpoint.versions.get(f.uri),
                    stats=requests,
                )
                sources.append(src)
                if src.size != f.size:
                    raise FormatError(
                        f"file changed since its header was read: {f.size} bytes then, {src.size} now",
                        uri=f.uri,
                    )
            # CUDA: through the staging ring straight into device memory. Other non-CPU devices:
            # into host memory, then moved per tensor.
            move = self.device.type not in ("cpu", "cuda")
            network = requests if any(isinstance(src, ObjectSource) for src in sources) else None
            tuning = make_tuning(self.config, chunk_size=self._plan.chunk_size, network=network)
            if exchange is None:
                sink = self._sink(None)
                blocks = run_plan(
                    self._plan,
                    sources,
                    self.config,
                    counters=counters,
                    on_bytes=self.on_bytes,
                    tuning=tuning,
                    sink=sink,
                    # Local files only: there the caller's wake-ups compete with the copies
                    # for the CPU; an object store's reads keep the tuner's read sizes per block.
                    keep_all=self._keep_all and self.device.type == "cpu" and network is None,
                )
            else:

                def make_sink(allocator: Callable[[Block, str], tuple[torch.Tensor, Any]]) -> Sink:
                    nonlocal sink
                    sink = self._sink(allocator)
                    return sink

                blocks = run_distributed(
                    self._plan,
                    sources,
                    self.config,
                    exchange,
                    make_sink=make_sink,
                    allocate_round=self._allocate_round,
                    counters=counters,
                    on_bytes=self.on_bytes,
                    tuning=tuning,
                )
            for block, buf in blocks:
                for entry, tensor in _own_tensors(block, buf):
                    if move:
                        tensor = tensor.to(self.device)
                    self.stats.tensors += 1
                    self.stats.bytes += entry.nbytes
                    yield entry.name, tensor
                    del tensor
                del buf
            self.stats.complete = self.stats.tensors == self.expected
        except BaseException as exc:
            if exchange is not None:
                exchange.report(exc)  # the other ranks raise it too, instead of waiting
            raise
        finally:
            if isinstance(sink, StagedSink):
                sink.close()
            for src in sources:
                src.close()
            s = self.stats
            s.seconds = time.perf_counter() - start
            s.bytes_read = counters.bytes_read
            s.chunks = counters.chunks
            s.direct_bytes = counters.by_how.get("direct", 0)
            s.cached_bytes = counters.by_how.get("cached", 0)
            s.buffered_bytes = counters.by_how.get("buffered", 0)
            s.network_bytes = counters.by_how.get("network", 0)
            s.peak_held_bytes = counters.peak_held
            s.peak_rss_bytes = peak_rss()
            if exchange is not None:
                s.bytes_received = exchange.received
            if requests.requests:
                s.requests = requests.as_dict()
            if tuning is not None:
                s.tuning = tuning.summary()

    def _sink(self, allocator: Any) -> Sink:
        if self.device.type != "cuda":
            return HostSink(allocator)
        # Staging buffers of up to 16 MiB (a larger chunk is staged in pieces): enough per copy
        # to run at the link's speed, small enough that the ring stays small. Up to two per read
        # in flight at the start, within half the memory budget (the other half: device blocks
        # not yet handed over). Made as needed, not up front.
        slot = min(self._plan.chunk_size, _STAGING_SLOT)
        slots = max(1, min(self.config.memory_limit // 2 // slot, 2 * self.config.concurrency))
        return StagedSink(
            self.device, slots=slots, slot_size=slot, uri=self.checkpoint.uri, allocator=allocator
        )

    def _allocate_round(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        if self.device.type == "cuda":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return buf, buf
        return allocate(nbytes, uri=self.checkpoint.uri)


def _own_tensors(block: Block, buf: torch.Tensor) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
    """The block's tensors, each with a storage of its own.

    A block packs neighbouring tensors into one buffer (one read, one allocation). Views of that
    buffer would share one storage, and code that treats tensors as independent breaks on that:
    ``torch.save`` refuses a storage viewed as two dtypes, pickling writes the whole block once
    per tensor, ``torch.multiprocessing`` moves the whole block. So on the host each tensor gets
    a storage of exactly its own bytes, over the block's memory (no copy; every storage keeps
    the block alive, and the block is freed when the last of them goes). Device memory cannot be
    aliased that way from Python: a tensor that would share its device block with others is
    copied out of it (device-to-device, once; the block is then freed), and a tensor alone in
    its block stays a view of it.
    """
    if buf.device.type == "cpu":
        host = buf.numpy()  # exports the block's memory; each storage below holds a reference
        for entry in block.tensors:
            yield entry, _host_tensor(host, entry, block.start)
        return
    shared = len(block.tensors) > 1 or buf.untyped_storage().nbytes() > buf.nbytes
    for entry in block.tensors:
        dtype, shape = _torch_type(entry)
        if entry.nbytes == 0:
            yield entry, torch.empty(shape, dtype=dtype, device=buf.device)
            continue
        off = entry.start - block.start
        raw = buf[off : off + entry.nbytes]
        if shared or off % dtype.itemsize:
            raw = raw.clone()
        yield entry, raw.view(dtype).view(shape)


def _host_tensor(host: Any, entry: TensorEntry, base: int) -> torch.Tensor:
    dtype, shape = _torch_type(entry)
    if entry.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    off = entry.start - base
    raw = torch.frombuffer(host, dtype=torch.uint8, count=entry.nbytes, offset=off)
    if raw.data_ptr() % dtype.itemsize:
        # The file places this tensor at an offset its dtype cannot be viewed at: copy it once
        # into aligned memory of its own (safetensors' own writer never does this).
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _torch_type(entry: TensorEntry) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype, shape = entry.dtype.torch, entry.torch_shape
    assert dtype is not None and shape is not None  # checked when the load was planned
    return dtype, shape


def _ensure_fd_budget(needed: int) -> None:
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


def peak_rss() -> int:
    """Peak resident set size of this process, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Checkpoint:
    """A safetensors checkpoint whose headers are read and validated; no tensor data read yet.

    Attributes:
        uri: what was opened.
        files: one :class:`FileIndex` per shard, in load order.
        tensors: name -> :class:`TensorEntry`, in file order.
        metadata: the index's ``metadata`` or, for unindexed checkpoints, the merged
            ``__metadata__`` of the files.
    """

    def __init__(
        self,
        layout: Layout,
        files: list[FileIndex],
        index: CheckpointIndex | None,
        config: StreamConfig,
        *,
        shard_uris: dict[str, str] | None = None,
        sizes: dict[str, int] | None = None,
        versions: dict[str, str] | None = None,
    ):
        self.uri = layout.uri
        self.index_uri = layout.index
        self.files = tuple(files)
        self.config = config
        self.last_stats: LoadStats | None = None
        """Statistics of the last :meth:`load`."""
        self.sizes: dict[str, int] = dict(sizes or {})
        """File or object sizes as validated (no second HEAD per shard for object stores)."""
        self.versions: dict[str, str] = dict(versions or {})
        """Object ETags the headers were read at; tensor reads are pinned to them."""
        self.tensors: dict[str, TensorEntry] = {}
        if index is not None:
            # Each name is read from the shard the index places it in: another shard may hold a
            # tensor of the same name (a stale copy, a draft layer), and it is not this one.
            self.metadata: dict[str, Any] = dict(index.metadata)
            by_file = {f.uri: {t.name: t for t in f.tensors} for f in files}
            shard_uris = shard_uris or {}
            placed: dict[str, TensorEntry] = {}
            for name, shard in index.weight_map.items():
                path = shard_uris[shard]
                found = by_file[path].get(name)
                if found is None:
                    raise FormatError(
                        f"index {index.uri} places tensor {name!r} in shard {shard!r}, which does not hold it",
                        uri=path,
                        tensor=name,
                    )
                placed[name] = found
            for f in files:  # file order, then offset order
                for t in f.tensors:
                    if placed.get(t.name) is t:
                        self.tensors[t.name] = t
            extra = sum(len(f.tensors) for f in files) - len(self.tensors)
            if extra:
                log.debug("%s: %d tensors in the shards are not in the index; ignored", self.uri, extra)
        else:
            self.metadata = {}
            owner: dict[str, str] = {}
            for f in files:
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

    @property
    def remote(self) -> bool:
        """Whether the checkpoint lives in an object store (it is then read with
        ``config.for_remote()``)."""
        return any(parse_object_uri(f.uri) is not None for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        return f"Checkpoint({self.uri!r}, files={len(self.files)}, tensors={len(self.tensors)}, bytes={self.total_bytes})"

    def select(self, tensors: Iterable[str] | None) -> list[TensorEntry]:
        """Entries for ``tensors`` (all if ``None``); unknown names raise :class:`NotFoundError`."""
        if tensors is None:
            return list(self.tensors.values())
        if isinstance(tensors, str):
            tensors = [tensors]
        try:
            names = list(dict.fromkeys(tensors))
        except TypeError:
            raise ConfigError(
                f"tensors must be an iterable of tensor names, got {type(tensors).__name__}", setting="tensors"
            ) from None
        odd = [n for n in names if not isinstance(n, str)]
        if odd:
            raise ConfigError(
                f"tensors must hold tensor names (str), got {type(odd[0]).__name__} {odd[0]!r:.80}",
                setting="tensors",
            )
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
    ) -> TensorStream:
        """Stream the selected tensors; see :func:`weightstream.stream`."""
        config = self.config if config is None else checked_config(config)
        with _collective(process_group, distributed, config, device) as group:
            dev = _device(device)
            entries = self.select(tensors)
            for e in entries:
                _check_torch_type(e)
            return TensorStream(
                self, entries, device=dev, config=config, on_bytes=on_bytes, group=group
            )

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
        with self.stream(
            device=device,
            tensors=tensors,
            config=config,
            process_group=process_group,
            distributed=distributed,
        ) as s:
            s._keep_all = True
            got = dict(s)
        self.last_stats = s.stats
        # The stream's own selection: ``tensors`` may be a one-shot iterator, already consumed.
        return {name: got[name] for name in s.names}


def checked_config(config: object) -> StreamConfig:
    """``config`` if it is a :class:`StreamConfig`, else a :class:`ConfigError` saying so."""
    if not isinstance(config, StreamConfig):
        raise ConfigError(
            f"config must be a weightstream.StreamConfig (or None for StreamConfig.from_env()), got "
            f"{type(config).__name__}",
            setting="config",
        )
    return config


def _check_torch_type(e: TensorEntry) -> None:
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


def _device(device: Device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but this machine or torch build has no CUDA device")
    return dev


def _device_or_cpu(device: Device) -> torch.device:
    try:
        return _device(device)
    except ConfigError:
        return torch.device("cpu")


def open_source(
    uri: str,
    config: StreamConfig,
    *,
    size: int | None = None,
    headers: bool = False,
    version: str | None = None,
    stats: RequestStats | None = None,
) -> Source:
    """A Source for a local path or an object-store URI. ``headers=True``: for small reads only."""
    loc = parse_object_uri(uri)
    if loc is not None:
        return ObjectSource(loc, config, size=size, etag=version, stats=stats)
    if headers:
        return FileSource(uri, direct_io="off", readahead=False)
    return FileSource(uri, direct_io=config.direct_io)


def _read_file_index(
    uri: str, config: StreamConfig, size: int | None, version: str | None = None
) -> tuple[FileIndex, str | None]:
    """The validated header, and the object version it was read at (``None`` for files)."""
    src = open_source(uri, config, size=size, headers=True, version=version)
    try:
        head = src.read_prefix(_FIRST_READ)
        n = parse_prefix(head, uri=uri, file_size=src.size, max_header_size=config.max_header_size)
        if PREFIX_SIZE + n > len(head):
            head = src.read_prefix(PREFIX_SIZE + n)
        parsed = parse_header(head[PREFIX_SIZE : PREFIX_SIZE + n], uri=uri, file_size=src.size)
        return parsed, getattr(src, "etag", None)
    finally:
        src.close()


def _read_index(uri: str, config: StreamConfig, size: int | None) -> CheckpointIndex:
    if parse_object_uri(uri) is None:
        fd, st = open_regular(uri, what="cannot read index")
        try:
            if st.st_size > _MAX_INDEX_SIZE:
                raise FormatError(f"index file is {st.st_size} bytes, more than {_MAX_INDEX_SIZE}", uri=uri)
            raw = os.pread(fd, st.st_size + 1, 0)
        except OSError as exc:
            raise os_error(exc, uri=uri, what="cannot read index") from exc
        finally:
            os.close(fd)
        if len(raw) != st.st_size:
            raise ReadError(f"index file changed while it was read ({st.st_size} bytes, then {len(raw)})", uri=uri)
        return parse_index(raw, uri=uri)
    src = open_source(uri, config, size=size)
    if src.size > _MAX_INDEX_SIZE:
        raise FormatError(f"index object is {src.size} bytes, more than {_MAX_INDEX_SIZE}", uri=uri)
    return parse_index(src.read_prefix(src.size), uri=uri)


def _shard_uri(index_uri: str, shard: str) -> str:
    loc = parse_object_uri(index_uri)
    if loc is None:
        return os.path.join(os.path.dirname(index_uri), shard)
    return loc.uri(posixpath.normpath(posixpath.join(posixpath.dirname(loc.key), shard)))


def open_checkpoint(uri: UriLike, *, config: StreamConfig | None = None) -> Checkpoint:
    """Find a checkpoint's files and read and validate every header (no tensor data is read).

    ``uri``: a local path, ``file://`` URI, ``s3://`` / ``gs://`` / ``az://`` URI, or a list of
    them. ``config`` defaults to :meth:`StreamConfig.from_env`.
    """
    config = StreamConfig.from_env() if config is None else checked_config(config)
    layout = resolve(uri, config)
    index = None
    paths = list(layout.files)
    shard_uris: dict[str, str] = {}
    if layout.index is not None:
        index = _read_index(layout.index, config, layout.sizes.get(layout.index))
        shards = sorted(set(index.weight_map.values()))
        shard_uris = {s: _shard_uri(layout.index, s) for s in shards}
        paths = [shard_uris[s] for s in shards]
        for shard, path in shard_uris.items():
            if not layout.exists(path):
                raise NotFoundError(
                    f"index {layout.index} names shard {shard!r}, which does not exist", uri=path
                )

    # Local headers are read one after another while they come fast (from the page cache, ~0.2 ms
    # a shard, less than starting a thread); the first slow one (a cold disk, NFS) brings in
    # parallel reads. Object stores read in parallel from the start: each request is a round trip.
    local = all(parse_object_uri(p) is None for p in paths)
    read = parallel_map(
        lambda p: _read_file_index(p, config, layout.sizes.get(p)),
        paths,
        workers=_HEADER_WORKERS,
        timeout=config.io_timeout,
        what="reading headers",
        serial_seconds=_SERIAL_HEADER_SECONDS if local else 0.0,
    )
    headers = [h for h, _ in read]
    sizes = {h.uri: h.size for h in headers}
    versions = {h.uri: v for h, v in read if v}
    return Checkpoint(layout, headers, index, config, shard_uris=shard_uris, sizes=sizes, versions=versions)


@contextlib.contextmanager
def _collective(
    process_group: Any, distributed: Distributed, config: StreamConfig | None, device: Device
) -> Iterator[Any]:
    """Yield the group a load runs across (``None`` for a plain load). A failure inside (reading
    the headers, choosing the tensors) is reported to the other ranks before it is raised here,
    so they raise too instead of waiting at the opening exchange."""
    group = resolve_group(process_group, distributed)
    try:
        yield group
    except BaseException as exc:
        if group is not None:
            timeout = (config or StreamConfig()).exchange_timeout
            report_failure(group, exc, device=_device_or_cpu(device), timeout=timeout)
        raise
