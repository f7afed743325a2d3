"""The one load pipeline, for one rank and many: a stream of ``(name, tensor)`` over a
checkpoint's shards.

    select tensors -> plan (engine.plan) -> exchange.open (agree across ranks; no-op alone)
      -> sources (the checkpoint's, verified unchanged) -> tuner -> exchange.blocks (the
      engine's reads; the group's share of them) -> delivery.tensors (own storages, on the
      device) -> caller

A plain load runs through :class:`~weightstream.engine.exchange.LocalExchange`, a distributed
one through the group's exchange: the code path is the same. What a load resolves (its settings,
the device, the group) is resolved once, by :func:`opening`, into a :class:`LoadContext`; the
stream takes what it reads (the shards, the settings, the exchange), not the checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import resource
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from weightstream import cache
from weightstream.config import StreamConfig, settled
from weightstream.devices import Device, device_of, device_or_cpu
from weightstream.engine.delivery import Delivery
from weightstream.engine.exchange import Exchange, Job, LocalExchange
from weightstream.engine.plan import Block, ReadPlan, make_plan
from weightstream.engine.scheduler import ReadCounters
from weightstream.engine.verify import Checked, InOrder, Verifier, verifier_for
from weightstream.errors import ConfigError, FormatError, MemoryBudgetError, ReadError
from weightstream.format.safetensors import FileIndex, TensorEntry
from weightstream.memory.room import available_bytes
from weightstream.sources.base import Lendable, Lent, Metered, Source, Staged, Versioned
from weightstream.sources.flow import RequestStats
from weightstream.tuning.online import block_size, make_tuning

if TYPE_CHECKING:
    from weightstream.distributed import Distributed
    from weightstream.shard import Shard

log = logging.getLogger(__name__)

__all__ = ["LoadContext", "LoadStats", "TensorStream", "opening"]


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
    checked_bytes: int = 0
    """Bytes checked against the checkpoint's manifest (``verify``; whole pieces)."""
    recalled_bytes: int = 0
    """Of ``checked_bytes``: bytes an earlier load checked in the same, unchanged local file
    (``checks_dir``), not checked again."""
    unchecked_bytes: int = 0
    """Bytes of manifest pieces the load read only in part, so not checked."""
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
        uri: str,
        shards: Sequence[Shard],
        entries: list[TensorEntry],
        load: LoadContext,
        *,
        on_bytes: Callable[[int], None] | None = None,
        on_end: Callable[[], None] | None = None,
        borrow_cached: bool = False,
    ) -> None:
        """``shards``: the checkpoint's (those ``entries`` lie in are read); ``load``: the
        resolved settings (the checkpoint's defaults applied), device and exchange.
        ``on_end``: called once when the stream ends, however it ends (:func:`weightstream.stream`
        closes the checkpoint it opened for the stream). ``borrow_cached``: see
        :func:`weightstream.stream`."""
        config = load.config
        self.config = config
        self.device = load.device
        self.names = [e.name for e in entries]
        """The tensors this stream yields (in checkpoint or request order)."""
        self.files: tuple[FileIndex, ...] = tuple(s.header for s in shards)
        """The validated header of every shard of the checkpoint."""
        self.expected = len(entries)
        self.stats = LoadStats(uri=uri, files=len(shards), settings=config.as_dict())
        self.on_bytes = on_bytes
        per_file: dict[str, list[TensorEntry]] = {s.header.uri: [] for s in shards}
        for e in entries:
            per_file[e.uri].append(e)
        self._used = [s for s in shards if per_file[s.header.uri]]
        self._remote = any(s.remote for s in self._used)
        # An object store's small tensors are joined into blocks larger than its reads, so that
        # a read can grow with the rate when it is issued (tuning.online: request size follows
        # the rate).
        self._plan = make_plan(
            [per_file[s.header.uri] for s in self._used],
            chunk_size=config.read_size,
            block_size=block_size(config, remote=self._remote),
        )
        self._exchange: Exchange = load.exchange
        self.stats.rank, self.stats.world_size = self._exchange.rank, self._exchange.world
        self._on_end = on_end
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
        end, self._on_end = self._on_end, None
        if end is not None:
            end()

    def _copies(self) -> list[tuple[str, str]]:
        """What names each shard's bytes, for the ranks to agree on: an object's version (an
        ETag), and the manifest's checksum where there is one (a store's own checksum goes with its
        ETag, and one rank may have had no answer to its HEAD). A local file's identity is its
        own node's (inode, times) and names nothing to another rank; its size is in the plan."""
        return [
            (
                s.location.uri,
                " ".join(
                    ([f"version {s.published}"] if s.published is not None else [])
                    + (
                        [f"crc32c {s.digest.whole:08x}"]
                        if s.digest is not None and s.digest.from_manifest
                        else []
                    )
                ),
            )
            for s in self._used
        ]

    def _sources(
        self,
        opened: list[Source],
        requests: Any,
        verifiers: dict[int, Verifier | InOrder],
        records: cache.PassedChecks | None,
        files: dict[int, tuple[str, str]],
    ) -> list[Source]:
        """The shards' sources for this load: the checkpoint's own (verified unchanged since
        their headers were read), or, where this load's settings differ from those they were
        opened with, new ones (closed when the load ends); each seen through the node cache's
        fill and the manifest's check where those apply (``verifiers``: the checks made, by the
        plan's file index; pieces ``records`` says an earlier load checked in the same local
        file are taken as checked, and a shard with nothing left to check is read as is).
        ``files``: the local files, ``(path, identity)`` by file index, whose checks this load
        may record and whose records it may use (none that a process holds open for writing
        as the load begins: its bytes may change while they are read)."""
        sources = []
        hold_max = settled(self.config.memory_limit) // 4  # stream() holds a piece of at most this
        for i, shard in enumerate(self._used):
            backend = shard.backend
            src = shard.source
            if backend.settings(self.config) != shard.settings:
                src = backend.open(shard.location, self.config, size=shard.size, version=shard.version)
                opened.append(src)
                if src.size != shard.size:
                    raise FormatError(
                        f"file changed since its header was read: {shard.size} bytes then, {src.size} now",
                        uri=shard.location.uri,
                    )
                # A source opened anew reads the version the header was read at, or none: a
                # backend that cannot ask for a version (a local file) names the one it opened.
                now = getattr(src, "version", None)
                if shard.version is not None and now is not None and now != shard.version:
                    raise FormatError(
                        "file changed since its header was read (modified in place)",
                        uri=shard.location.uri,
                        byte_range=(0, shard.size),
                    )
            if isinstance(src, Versioned):
                src.verify()
            if isinstance(src, Metered):
                src = src.metered(requests)
            if shard.cache is not None:
                src = cache.reading(shard, src)
            if shard.digest is not None and self.config.verify != "off":
                local = cache.local_file(shard) if records is not None else None
                if (
                    records is not None
                    and local is not None
                    and records.trusted()
                    and records.quiet(local[0])
                ):
                    files[i] = local
                known = records.known(*files[i], shard.digest) if records and i in files else frozenset()
                v = verifiers[i] = verifier_for(
                    shard.location.uri,
                    shard.digest,
                    shard.prefix,
                    hold_max=hold_max,
                    known=known,
                    shared=not isinstance(self._exchange, LocalExchange),
                )
                # (a distributed load's hash in order is fed with the gathered rounds instead)
                if v.pending and not (isinstance(v, InOrder) and v.shared):
                    src = Checked(src, v)
            sources.append(src)
        return sources

    def _keep_passed(
        self,
        verifiers: dict[int, Verifier | InOrder],
        records: cache.PassedChecks | None,
        files: dict[int, tuple[str, str]],
        began_ns: int,
    ) -> None:
        """Write down the pieces of local files (``files``) this load checked and found right."""
        if records is None:
            return
        for i, (path, identity) in files.items():
            v, digest = verifiers[i], self._used[i].digest
            pieces = v.passed()
            if pieces and digest is not None:
                records.add(path, identity, digest, pieces, began_ns=began_ns)

    def _still_as_recorded(
        self,
        verifiers: dict[int, Verifier | InOrder],
        records: cache.PassedChecks | None,
        files: dict[int, tuple[str, str]],
    ) -> None:
        """Raise if a file whose pieces an earlier load's record vouched for (not read through
        the check) was written to during this load: its bytes may not be those checked."""
        if records is None:
            return
        for i, (path, identity) in files.items():
            if verifiers[i].known and not records.same(path, identity):
                raise self._changed_while_read(i)

    def _changed_while_read(self, i: int) -> FormatError:
        return FormatError(
            "file changed while it was read: its pieces checked by an earlier load of it "
            "(checks_dir) no longer describe it; load it again to check it",
            uri=self._used[i].location.uri,
            byte_range=(0, self._used[i].size),
        )

    def _unchanged_first(
        self,
        blocks: Iterator[tuple[Block, torch.Tensor]],
        verifiers: dict[int, Verifier | InOrder],
        records: cache.PassedChecks,
        files: dict[int, tuple[str, str]],
    ) -> Iterator[tuple[Block, torch.Tensor]]:
        """``blocks``, each handed on only while the file it was read from still has the
        identity whose record vouched for some of its pieces (one ``stat`` a block). A write
        changes the times before it changes a byte, so a block read before this look holds the
        bytes checked; a block read after a write is never handed over (``stream()`` would
        otherwise hand tensors that no check saw before the load's end raised)."""
        vouched = {i: f for i, f in files.items() if verifiers[i].known}
        for item in blocks:
            i = item[0].source
            if i in vouched and not records.same(*vouched[i]):
                raise self._changed_while_read(i)
            yield item
            del item

    def _run(self, *, keep_all: bool) -> Generator[tuple[str, torch.Tensor], None, None]:
        counters = ReadCounters()
        requests = RequestStats()
        start = time.perf_counter()
        began_ns = time.time_ns()
        c = self.config
        memory_limit = settled(c.memory_limit)
        log.info(
            "%s: %s %d tensors, %.2f GB from %d file(s) to %s (concurrency %d%s, reads of %d MiB, "
            "memory_limit %.1f GiB%s)", self.stats.uri, "load()" if keep_all else "stream()", self.expected,
            self._plan.read_bytes / 1e9, len(self._used), self.device, c.concurrency,
            ", tuned" if c.autotune else "", c.read_size >> 20, memory_limit / 2**30,
            f", rank {self._exchange.rank} of {self._exchange.world}" if self._exchange.world > 1 else "",
        )  # fmt: skip
        opened: list[Source] = []
        verifiers: dict[int, Verifier | InOrder] = {}
        records = cache.passed_checks(c) if c.verify != "off" else None
        files: dict[int, tuple[str, str]] = {}
        mappings: dict[int, Lent] = {}
        tuning = None
        exchange = self._exchange
        self._started = True
        delivery = Delivery(
            self.device,
            uri=self.stats.uri,
            chunk_size=self._plan.chunk_size,
            memory_limit=memory_limit,
            concurrency=settled(c.concurrency),
            on_copy=counters.copied,
        )
        try:
            if keep_all:
                self._check_room()
            exchange.open(
                self._plan, [s.size for s in self._used], memory_limit=memory_limit, copies=self._copies()
            )
            sources = self._sources(opened, requests, verifiers, records, files)
            network = requests if self._remote else None
            # load() into host memory reads into the tensors it returns: their memory is taken
            # anyway, so the reads in flight need not fit the memory limit (see make_tuning),
            # unless a source stages what it receives in buffers of its own (obstore's).
            staged = any(isinstance(s, Staged) and s.staged for s in sources)
            direct_to_tensors = keep_all and self.device.type == "cpu" and not staged
            tuning = make_tuning(
                self.config,
                chunk_size=self._plan.chunk_size,
                network=network,
                room=self._plan.read_bytes if direct_to_tensors else 0,
            )
            # Bytes lent from the page cache are checked where they are lent (a CRC combines
            # in any order); a hash in file order (InOrder) is not lent to.
            lends = self._borrow and all(isinstance(v, Verifier) for v in verifiers.values())
            mappings = self._mappings(keep_all) if lends else {}
            plan, borrowed = _borrowable(self._plan, mappings)
            self.stats.mapped_bytes = sum(min(b.end, mappings[b.source].size) - b.start for b in borrowed)
            job = Job(
                plan,
                sources,
                self.config,
                counters,
                tuning=tuning,
                on_bytes=self.on_bytes,
                # Every block admitted at once and one wake-up at the end: the reads land in
                # the tensors load() returns, so holding them back would save nothing.
                keep_all=direct_to_tensors,
                checks={i: v for i, v in verifiers.items() if isinstance(v, Verifier) and v.shared},
                hashes={i: v for i, v in verifiers.items() if isinstance(v, InOrder) and v.shared},
            )
            blocks: Iterator[tuple[Block, torch.Tensor]] = exchange.blocks(job, delivery=delivery)
            blocks = _with_borrowed(blocks, borrowed, mappings, verifiers)
            if verifiers and isinstance(exchange, LocalExchange):
                blocks = _checked_first(blocks, verifiers)
            if not keep_all and records is not None and any(verifiers[i].known for i in files):
                blocks = self._unchanged_first(blocks, verifiers, records, files)
            for block, buf in blocks:
                for entry, tensor in delivery.tensors(block, buf):
                    self.stats.tensors += 1
                    self.stats.bytes += entry.nbytes
                    yield entry.name, tensor
                    del tensor
                del buf
            for m in mappings.values():
                if not m.closed:
                    _check_lease(m)
            self._still_as_recorded(verifiers, records, files)
            self.stats.complete = self.stats.tensors == self.expected
        except BaseException as exc:
            if os.getpid() == self._pid:  # not from a forked child: the group is the parent's
                exchange.report(exc)  # the other ranks raise it too, instead of waiting
            if isinstance(exc, FormatError) and exc.byte_range is not None:
                for i, v in verifiers.items():  # bytes that failed their check stay out of the cache
                    if v.failed:
                        cache.forget(self._used[i])
            raise
        finally:
            for m in mappings.values():
                m.close()
            for src in opened:
                src.close()
            self.stats.checked_bytes = sum(v.checked_bytes for v in verifiers.values())
            self.stats.recalled_bytes = sum(v.recalled_bytes for v in verifiers.values())
            self.stats.unchecked_bytes = sum(v.unchecked for v in verifiers.values())
            self._keep_passed(verifiers, records, files, began_ns)
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
        how = ", ".join(f"{n / 1e9:.2f} GB {k}" for k, n in counters.by_how.items() if n)
        extra = ""
        if requests.requests:
            extra = f"; {requests.requests} requests, {requests.retries} retried, {requests.hedges} hedged"
        if s.tuning:
            extra += f"; depth {s.tuning['start_depth']} -> {s.tuning['final_depth']}"
        log.info(
            "%s: %s after %.2f s: %.2f GB read (%s), %.2f GB/s%s", s.uri,
            "complete" if self.stats.tensors == self.expected else f"{self.stats.tensors} of {self.expected} tensors",
            s.seconds, s.bytes_read / 1e9, how or "nothing", s.bytes_read / 1e9 / max(s.seconds, 1e-9), extra,
        )  # fmt: skip
        if s.unchecked_bytes:
            log.log(
                logging.WARNING if self.config.verify == "on" else logging.INFO,
                "%s: %.3f GB of checksummed pieces not checked: the load read them only in part "
                "(some tensors of a file; or, where ranks stopped sharing the reads, a hash in "
                "file order another rank took)",
                s.uri, s.unchecked_bytes / 1e9,
            )  # fmt: skip


def _checked_first(
    blocks: Iterator[tuple[Block, torch.Tensor]], verifiers: dict[int, Verifier | InOrder]
) -> Iterator[tuple[Block, torch.Tensor]]:
    """``blocks`` in the same order, each held until every manifest piece its tensors lie in is
    checked (the reads completing a piece check it; a mismatch raises from the blocks). A block
    still unchecked when every read is done lies in pieces the load read only in part (some
    tensors of a shard), which cannot be checked: those are handed over as read."""
    held: collections.deque[tuple[Block, torch.Tensor]] = collections.deque()

    def checked(block: Block) -> bool:
        v = verifiers.get(block.source)
        if v is None or not v.holds or not block.tensors:
            return True
        return v.verified(min(t.start for t in block.tensors), max(t.end for t in block.tensors))

    for item in blocks:
        held.append(item)
        del item  # a lent block held here would keep its file mapped (see _with_borrowed)
        while held and checked(held[0][0]):
            yield held.popleft()
    yield from held


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
    blocks: Iterator[tuple[Block, torch.Tensor]],
    borrowed: list[Block],
    mappings: dict[int, Lent],
    verifiers: dict[int, Verifier | InOrder],
) -> Iterator[tuple[Block, torch.Tensor]]:
    """The engine's blocks, and the borrowed ones as views of their mapping: those after the
    engine's first block, so that the cold reads run while they are consumed. A lease that a
    writer waits for ends the load (checked before a view is made and once it was taken). A
    borrowed block's bytes are checked (``verifiers``) as its view is made, before it is
    handed on: the lease keeps them as checked while it is held.

    A file whose views were all taken is let go (lease and mapping: its pages count in the
    process's RSS until then, as with a loader that maps one file at a time) once none of them
    is held any more: at the next block, or the one after, for a consumer that copies each
    tensor at once. One held longer (blocks held until their piece is checked, a consumer that
    keeps tensors) keeps its file mapped and leased to the stream's end."""
    if not borrowed:
        yield from blocks
        return
    it = iter(blocks)
    first = next(it, None)
    if first is not None:
        yield first
        del first
    left = Counter(b.source for b in borrowed)
    taken: list[Lent] = []  # files whose views were all taken, not yet let go

    def let_go_unheld() -> None:
        taken[:] = [m for m in taken if not m.let_go()]

    for b in borrowed:
        let_go_unheld()
        m = mappings[b.source]
        _check_lease(m)
        view = m.view(b.start, b.end)
        v = verifiers.get(b.source)
        if v is not None:  # here, not on a thread ahead: the consumer's copy then finds it cached
            v.add(_bytes(view), b.start)
        yield b, view
        del view  # held here, it would keep its file mapped
        _check_lease(m)
        left[b.source] -= 1
        if not left[b.source] and not m.reads_pending:
            taken.append(m)
    for item in it:
        let_go_unheld()
        yield item


def _bytes(view: torch.Tensor) -> memoryview:
    """A host uint8 tensor's bytes."""
    return memoryview(view.numpy())  # type: ignore[arg-type]


def peak_rss() -> int:
    """Peak resident set size of this process, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class LoadContext:
    """What one load resolves once: its settings, the device its tensors go to, and the
    exchange it runs through (the group's, or the no-op one of a plain load)."""

    config: StreamConfig
    device: torch.device
    exchange: Exchange

    def replace(self, config: StreamConfig) -> LoadContext:
        """The same load with ``config`` (a checkpoint's defaults applied)."""
        return dataclasses.replace(self, config=config)


@contextlib.contextmanager
def opening(
    process_group: Any, distributed: Distributed, config: StreamConfig | None, device: Device
) -> Iterator[LoadContext]:
    """Resolve a load once: ``config`` (:meth:`StreamConfig.from_env` if ``None``), the group
    (``process_group`` / ``distributed``) and its exchange, and ``device``. A failure inside
    (an invalid device, reading the headers, choosing the tensors) is reported to the other
    ranks before it is raised here, so they raise too instead of waiting at the opening
    exchange."""
    from weightstream.distributed import GroupExchange, resolve_group

    config = config if config is not None else StreamConfig.from_env()
    group = resolve_group(process_group, distributed)
    exchange: Exchange = LocalExchange()
    try:
        if group is not None:
            exchange = GroupExchange(group, device=device_or_cpu(device), timeout=config.exchange_timeout)
        yield LoadContext(config=config, device=device_of(device), exchange=exchange)
    except BaseException as exc:
        exchange.report(exc)
        raise
