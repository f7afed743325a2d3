"""The one load pipeline, for one rank and many: a stream of ``(name, tensor)`` over a
checkpoint's shards.

    select tensors -> plan (engine.plan) -> exchange.open (agree across ranks; no-op alone)
      -> sources (the checkpoint's, verified unchanged) -> tuner -> exchange.blocks (the
      engine's reads; the group's share of them) -> delivery.tensors (own storages, on the
      device) -> caller

A plain load runs through :class:`~weightstream.engine.exchange.LocalExchange`, a distributed
one through the group's exchange: the code path is the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from weightstream.config import StreamConfig
from weightstream.engine.delivery import Delivery
from weightstream.engine.exchange import Exchange, LocalExchange
from weightstream.engine.plan import Block, ReadPlan, make_plan
from weightstream.engine.scheduler import ReadCounters
from weightstream.errors import ConfigError, FormatError, MemoryBudgetError, ReadError
from weightstream.format.safetensors import TensorEntry
from weightstream.memory.room import available_bytes, loading_share
from weightstream.sources.base import Lendable, Lent, Metered, Source, Versioned
from weightstream.sources.flow import RequestStats
from weightstream.sources.registry import backend_for
from weightstream.tuning.online import make_tuning

if TYPE_CHECKING:
    from weightstream.checkpoint import Checkpoint, Device
    from weightstream.distributed import Distributed

__all__ = ["LoadStats", "TensorStream"]


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
    mapped_bytes: int = 0
    """``borrow_cached`` streams: bytes handed out as views of the page cache (not read)."""
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
    split_stopped_after: int | None = None
    """Distributed loads: the rounds gathered before the ranks measured that splitting did not
    pay (the exchange slower than reading) and each read the rest itself; ``None`` if the
    reads were split to the end."""

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
        exchange: Exchange | None = None,
        owns_checkpoint: bool = False,
        borrow_cached: bool = False,
    ) -> None:
        """``owns_checkpoint``: the stream closes the checkpoint when it ends (the checkpoint
        was opened for it alone, by :func:`weightstream.stream`). ``borrow_cached``: see
        :func:`weightstream.stream`."""
        self.checkpoint = checkpoint
        config = checkpoint.defaults(config, host=lambda: loading_share(device.type == "cpu"))
        self.config = config
        self.device = device
        self.names = [e.name for e in entries]
        """The tensors this stream yields (in checkpoint or request order)."""
        self.expected = len(entries)
        self.stats = LoadStats(uri=checkpoint.uri, files=len(checkpoint.files), settings=config.as_dict())
        self.on_bytes = on_bytes
        per_file: dict[str, list[TensorEntry]] = {s.header.uri: [] for s in checkpoint.shards}
        for e in entries:
            per_file[e.uri].append(e)
        self._used = [s for s in checkpoint.shards if per_file[s.header.uri]]
        self._plan = make_plan([per_file[s.header.uri] for s in self._used], chunk_size=config.read_size)
        self._exchange: Exchange = exchange if exchange is not None else LocalExchange()
        self.stats.rank, self.stats.world_size = self._exchange.rank, self._exchange.world
        self._owns = owns_checkpoint
        self._borrow = borrow_cached
        self._started = False
        self._pid = os.getpid()
        self._gen = self._run(keep_all=False)

    @property
    def bytes_to_read(self) -> int:
        """Bytes this stream reads from storage (tensor bytes plus alignment padding): the total
        that ``on_bytes`` callbacks add up to."""
        return self._plan.read_bytes

    def __iter__(self) -> TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if os.getpid() != self._pid:
            raise ConfigError(
                f"this stream of {self.stats.uri} was started in process {self._pid}, and this process "
                "was forked from it: its reads run on that process's threads. Start a stream here"
            )
        return next(self._gen)

    def owns_checkpoint(self) -> None:
        """Close the checkpoint when this stream ends (it was opened for the stream alone)."""
        self._owns = True

    def collect(self) -> dict[str, torch.Tensor]:
        """Every tensor, in a dict: what ``load`` does. The caller keeps every block until the
        end, so the engine may hold them back too (see ``run_plan``'s ``keep_all``)."""
        if self._started:
            raise ConfigError("collect() must be the first use of a stream")
        self._gen.close()
        self._gen = self._run(keep_all=True)
        return dict(self)

    def close(self) -> None:
        if not self._started:
            # Closed before the first tensor: the generator never ran, so tell the other ranks here.
            if os.getpid() == self._pid:  # a forked child's copy is not a rank of the group
                self._exchange.report(GeneratorExit())
            self._finish()
        self._gen.close()

    def __enter__(self) -> TensorStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish(self) -> None:
        if self._owns:
            self.checkpoint.close()

    def _sources(self, opened: list[Source], requests: Any) -> list[Source]:
        """The shards' sources for this load: the checkpoint's own (verified unchanged since
        their headers were read), or, where this load's settings differ from those they were
        opened with, new ones (closed when the load ends)."""
        sources = []
        for shard in self._used:
            backend = backend_for(shard.location)
            src = shard.source
            if backend.settings(self.config) != shard.settings:
                src = backend.open(shard.location, self.config, size=shard.size, version=shard.version)
                opened.append(src)
                if src.size != shard.size:
                    raise FormatError(
                        f"file changed since its header was read: {shard.size} bytes then, {src.size} now",
                        uri=shard.location.uri,
                    )
            if isinstance(src, Versioned):
                src.verify()
            if isinstance(src, Metered):
                src = src.metered(requests)
            sources.append(src)
        return sources

    def _run(self, *, keep_all: bool) -> Generator[tuple[str, torch.Tensor], None, None]:
        counters = ReadCounters()
        requests = RequestStats()
        start = time.perf_counter()
        opened: list[Source] = []
        mappings: dict[int, Lent] = {}
        tuning = None
        exchange = self._exchange
        self._started = True
        delivery = Delivery(
            self.device,
            uri=self.checkpoint.uri,
            chunk_size=self._plan.chunk_size,
            memory_limit=self.config.memory_limit,
            concurrency=self.config.concurrency,
            on_copy=counters.copied,
        )
        try:
            if keep_all:
                self._check_room()
            exchange.open(self._plan, [s.size for s in self._used], memory_limit=self.config.memory_limit)
            sources = self._sources(opened, requests)
            remote = any(backend_for(s.location).remote for s in self._used)
            network = requests if remote else None
            # load() into host memory reads into the tensors it returns: their memory is taken
            # anyway, so the reads in flight need not fit the memory limit (see make_tuning).
            direct_to_tensors = keep_all and self.device.type == "cpu" and not remote
            tuning = make_tuning(
                self.config,
                chunk_size=self._plan.chunk_size,
                network=network,
                room=self._plan.read_bytes if direct_to_tensors else 0,
            )
            mappings = self._mappings(keep_all) if self._borrow else {}
            plan, borrowed = _borrowable(self._plan, mappings)
            self.stats.mapped_bytes = sum(min(b.end, mappings[b.source].size) - b.start for b in borrowed)
            blocks = exchange.blocks(
                plan,
                sources,
                self.config,
                delivery=delivery,
                counters=counters,
                on_bytes=self.on_bytes,
                tuning=tuning,
                # Local files only: there the caller's wake-ups compete with the copies for the
                # CPU; an object store's reads keep the tuner's read sizes per block.
                keep_all=direct_to_tensors,
            )
            for block, buf in _with_borrowed(blocks, borrowed, mappings):
                for entry, tensor in delivery.tensors(block, buf):
                    self.stats.tensors += 1
                    self.stats.bytes += entry.nbytes
                    yield entry.name, tensor
                    del tensor
                del buf
            for m in mappings.values():
                if not m.closed:
                    _check_lease(m)
            self.stats.complete = self.stats.tensors == self.expected
        except BaseException as exc:
            if os.getpid() == self._pid:  # not from a forked child: the group is the parent's
                exchange.report(exc)  # the other ranks raise it too, instead of waiting
            raise
        finally:
            for m in mappings.values():
                m.close()
            for src in opened:
                src.close()
            self._record(start, counters, requests, tuning)
            self._finish()

    def _mappings(self, keep_all: bool) -> dict[int, Lent]:
        """By file index in the plan: the local files whose cached blocks the caller borrows
        (``borrow_cached``): host tensors of a plain stream (``load()`` keeps its tensors, which
        must be its own memory; a distributed load's rounds are the group's)."""
        if keep_all or self.device.type != "cpu" or not isinstance(self._exchange, LocalExchange):
            return {}
        out: dict[int, Lent] = {}
        for i, shard in enumerate(self._used):
            if isinstance(shard.source, Lendable):
                m = shard.source.lend()
                if m is not None:
                    out[i] = m
        return out

    def _check_room(self) -> None:
        """``load()`` keeps every tensor: refuse, before any read, a load larger than the memory
        this process may still use (the kernel would kill it part way, with nothing to catch)."""
        needed = self._plan.read_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            room, why = int(free), f"the free memory of {self.device}"
        else:
            room, why = available_bytes()
        if needed > room:
            raise MemoryBudgetError(
                f"load() keeps every tensor: {needed} bytes, but this process may use {room} bytes more "
                f"({why}); stream() holds at most memory_limit ({self.config.memory_limit} bytes) at a "
                "time: for name, tensor in weightstream.stream(uri): ...",
                uri=self.stats.uri,
            )

    def _record(self, start: float, counters: ReadCounters, requests: Any, tuning: Any) -> None:
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
        s.bytes_received = self._exchange.received
        s.split_stopped_after = self._exchange.stopped
        if requests.requests:
            s.requests = requests.as_dict()
        if tuning is not None:
            s.tuning = tuning.summary()


def _borrowable(plan: ReadPlan, mappings: dict[int, Lent]) -> tuple[ReadPlan, list[Block]]:
    """The plan of the blocks to read, and the blocks the page cache holds in a mapped file
    (handed out as views of the mapping; see :mod:`weightstream.sources.mapping`)."""
    if not mappings:
        return plan, []
    borrowed: list[Block] = []
    cold: list[Block] = []
    for b in plan.blocks:
        m = mappings.get(b.source)
        if m is not None and m.resident(b.start, b.end):
            borrowed.append(b)
        else:
            cold.append(b)
            if m is not None:  # the lease keeps writers out of this file's reads too
                m.reads_pending = True
    if not borrowed:
        return plan, []
    blocks = tuple(dataclasses.replace(b, index=i) for i, b in enumerate(cold))
    return ReadPlan(blocks, plan.chunk_size, sum(e.nbytes for b in cold for e in b.tensors)), borrowed


def _check_lease(m: Lent) -> None:
    if not m.intact():
        raise ReadError(
            "another process opened the file for writing or truncated it during the load: the "
            "load stops here, before the file can change under the tensors it handed out (it "
            "waits for this load's read lease); load again once the file is written",
            uri=m.uri,
        )


def _with_borrowed(
    blocks: Iterator[tuple[Block, torch.Tensor]], borrowed: list[Block], mappings: dict[int, Lent]
) -> Iterator[tuple[Block, torch.Tensor]]:
    """The engine's blocks, and the borrowed ones as views of their mapping: those after the
    engine's first block, so that the cold reads run while they are consumed. A lease that a
    writer waits for ends the load (checked before a view is made and once it was taken)."""
    it = iter(blocks)
    first = next(it, None) if borrowed else None
    if first is not None:
        yield first
    left = Counter(b.source for b in borrowed)
    for b in borrowed:
        m = mappings[b.source]
        _check_lease(m)
        yield b, m.view(b.start, b.end)
        _check_lease(m)
        left[b.source] -= 1
        if not left[b.source] and not m.reads_pending:
            # The file's last view was taken: let its mapping go (the pages it maps count in
            # the process's RSS until then), as a loader that maps one file at a time would.
            m.close()
    yield from it


def peak_rss() -> int:
    """Peak resident set size of this process, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_of(device: Device) -> torch.device:
    """``device`` as a torch device this machine has and that can hold a load's tensors, or a
    :class:`ConfigError` (checked before any read: a device torch would refuse at the first
    tensor is refused here, and ``meta``, which would return tensors without their data)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}", setting="device") from None
    if dev.type == "meta":
        raise ConfigError(
            "device 'meta' holds no data: a load would return tensors without their bytes (use "
            "open_checkpoint() for names, dtypes and shapes)",
            setting="device",
        )
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {device!r} asked for, but this machine or torch build has no CUDA device",
                setting="device",
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {device!r}: this machine has {count} CUDA device(s)", setting="device")
        return dev
    try:  # mps, xpu, privateuseone, ...: torch knows the name; is the device here?
        torch.empty(0, device=dev)
    except Exception as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"device {device!r} is not available here: {line[:200]}", setting="device"
        ) from None
    return dev


def _device_or_cpu(device: Device) -> torch.device:
    try:
        return device_of(device)
    except ConfigError:
        return torch.device("cpu")


@contextlib.contextmanager
def collective(
    process_group: Any, distributed: Distributed, config: StreamConfig | None, device: Device
) -> Iterator[Exchange]:
    """The exchange a load runs through: the group's, or a no-op one for a plain load. A
    failure inside (reading the headers, choosing the tensors) is reported to the other ranks
    before it is raised here, so they raise too instead of waiting at the opening exchange."""
    from weightstream.distributed import GroupExchange, resolve_group

    config = config if config is not None else StreamConfig.from_env()
    group = resolve_group(process_group, distributed)
    exchange: Exchange = LocalExchange()
    try:
        if group is not None:
            exchange = GroupExchange(group, device=_device_or_cpu(device), timeout=config.exchange_timeout)
        yield exchange
    except BaseException as exc:
        exchange.report(exc)
        raise
