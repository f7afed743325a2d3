"""Measure storage, and sweep static settings: what ``weightstream bench`` and ``tune`` run.

* :func:`probe` is the raw capability of the storage behind a checkpoint, like fio: large
  sequential reads of its files at increasing depth, each thread reusing one aligned buffer
  (no tensors, no allocation per read). Files are read with ``O_DIRECT`` where the file system
  allows it, so the figure is the device or the network file system, not the page cache.
* :func:`sweep` loads the checkpoint (or a bounded part of it) once per (depth, read size) with
  the tuner off, and reports GB/s for each.

Both are bounded by bytes and by seconds, and only ever read: nothing is written to the storage
under test.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from weightstream.checkpoint import Checkpoint
from weightstream.config import StreamConfig, settled
from weightstream.errors import ConfigError, WeightStreamError
from weightstream.sources.base import Metered, Source
from weightstream.sources.flow import RequestStats

__all__ = ["ProbePoint", "SweepPoint", "probe", "select_bytes", "sweep"]


@dataclass(frozen=True)
class ProbePoint:
    """Raw read bandwidth at one depth."""

    depth: int
    block: int
    bytes: int
    seconds: float
    how: str = "direct"
    """How the bytes were read: ``direct`` (O_DIRECT), ``cached``/``buffered`` (the file system
    refused O_DIRECT), ``network``."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "gb_per_s": round(self.gb_per_s, 4)}


@dataclass(frozen=True)
class SweepPoint:
    """One point of a sweep: a load at one depth and read size, and how fast it went."""

    depth: int
    chunk_size: int
    bytes: int
    seconds: float
    error: str | None = None
    memory_limit: int = 0
    """The memory limit the point ran with (at least twice its bytes in flight)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and not self.error else 0.0

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "gb_per_s": round(self.gb_per_s, 4)}


def _ranges(ckpt: Checkpoint, block: int) -> Iterator[tuple[int, int]]:
    """(file index, offset) of every ``block``-sized read of the checkpoint's files, in order,
    starting past each file's header; cycles forever (the caller bounds it)."""
    spans = [(i, (f.data_start // 4096) * 4096, f.size) for i, f in enumerate(ckpt.files)]
    while True:
        any_ = False
        for i, start, size in spans:
            for off in range(start, size, block):
                any_ = True
                yield i, off
        if not any_:
            return


def probe(
    ckpt: Checkpoint,
    *,
    config: StreamConfig,
    depths: Sequence[int] = (1, 4, 16, 64),
    block: int = 16 << 20,
    max_bytes: int = 4 << 30,
    max_seconds: float = 20.0,
    on_bytes: Callable[[int], None] | None = None,
) -> list[ProbePoint]:
    """Raw sequential-read bandwidth at each depth; each depth gets an equal share of
    ``max_bytes`` and ``max_seconds`` (and never more than the checkpoint's size)."""
    if block % 4096 or block <= 0:
        raise ConfigError(f"probe block must be a positive multiple of 4096, got {block}")
    remote = ckpt.remote
    cfg = ckpt.defaults(config) if remote else config.replace(direct_io="on")
    stats = RequestStats()
    sources: list[Source] = []
    try:
        for shard in ckpt.shards:
            backend = shard.backend
            try:
                src = backend.open(shard.location, cfg, size=shard.size, version=shard.version)
            except WeightStreamError:
                if remote:
                    raise
                # this file system refuses O_DIRECT: buffered it is (the page cache may show)
                src = backend.open(shard.location, config.replace(direct_io="off"), size=shard.size)
            sources.append(src)
        sources = [s.metered(stats) if isinstance(s, Metered) else s for s in sources]
        data = sum(f.size - f.data_start for f in ckpt.files)
        share_bytes = max(block, min(data, max_bytes // max(1, len(depths))))
        share_s = max_seconds / max(1, len(depths))
        return [_probe_depth(ckpt, sources, d, block, share_bytes, share_s, on_bytes) for d in depths]
    finally:
        for s in sources:
            s.close()


def _probe_depth(
    ckpt: Checkpoint,
    sources: list[Source],
    depth: int,
    block: int,
    max_bytes: int,
    max_seconds: float,
    on_bytes: Callable[[int], None] | None,
) -> ProbePoint:
    from weightstream.memory.buffers import allocate  # torch, once a probe runs

    todo = _ranges(ckpt, block)
    lock = threading.Lock()
    done = [0]
    hows: set[str] = set()
    errors: list[BaseException] = []
    start = time.perf_counter()
    deadline = start + max_seconds

    def work() -> None:
        _, view = allocate(block)
        while True:
            with lock:
                if done[0] >= max_bytes or time.perf_counter() >= deadline or errors:
                    return
                nxt = next(todo, None)
                if nxt is None:
                    return
                done[0] += block  # claimed now, so the threads stop at max_bytes together
            i, off = nxt
            try:
                n, how = sources[i].read_into(view, offset=off)
                hows.add(how)
            except BaseException as exc:
                errors.append(exc)
                return
            with lock:
                done[0] += n - block
            if on_bytes is not None:
                on_bytes(n)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_seconds + 60)
    if errors:
        raise errors[0]
    how = "direct" if hows <= {"direct"} else "network" if "network" in hows else "buffered"
    return ProbePoint(depth, block, done[0], time.perf_counter() - start, how)


def select_bytes(ckpt: Checkpoint, max_bytes: int) -> list[str]:
    """Tensor names, in file order, whose bytes add up to at most ``max_bytes`` (at least one)."""
    names: list[str] = []
    total = 0
    for t in sorted(ckpt.tensors.values(), key=lambda t: (t.uri, t.start)):
        if names and total + t.nbytes > max_bytes:
            break
        names.append(t.name)
        total += t.nbytes
    return names


def sweep(
    ckpt: Checkpoint,
    *,
    config: StreamConfig,
    depths: Iterable[int],
    chunk_sizes: Iterable[int],
    max_bytes: int,
    max_seconds: float,
    before_each: Callable[[], None] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Load up to ``max_bytes`` of the checkpoint once per (depth, read size), tuner off,
    tensors dropped as they arrive. Stops early (the rest unmeasured) at ``max_seconds``."""
    remote = ckpt.remote
    names = select_bytes(ckpt, max_bytes)
    points: list[SweepPoint] = []
    deadline = time.monotonic() + max_seconds
    for depth, chunk in itertools.product(list(depths), list(chunk_sizes)):
        if time.monotonic() >= deadline:
            break
        # Memory for the reads in flight and as much again for finished ones, so a deep point
        # is not quietly held back by the budget (as it would be at the default 2 GiB).
        memory = max(settled(ckpt.defaults(config).memory_limit), 2 * depth * chunk)
        if remote:
            cfg = config.replace(autotune=False, memory_limit=memory).replace_object_store(
                concurrency=depth, chunk_size=chunk
            )
        else:
            cfg = config.replace(autotune=False, concurrency=depth, chunk_size=chunk, memory_limit=memory)
        if before_each is not None:
            before_each()
        stream = ckpt.stream(tensors=names, config=cfg)
        try:
            with stream:
                for _name, tensor in stream:
                    del tensor
            point = SweepPoint(depth, chunk, stream.stats.bytes, stream.stats.seconds, memory_limit=memory)
        except WeightStreamError as exc:
            point = SweepPoint(depth, chunk, 0, 0.0, error=str(exc), memory_limit=memory)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points
