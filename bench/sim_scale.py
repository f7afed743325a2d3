"""The seed's scale, simulated: the real tuner, budget and split against simulated storage.

This machine has 2 cores and a 1 GB/s emulated link; the seed's node has 8 ranks and a
40.7 GB/s NFS share. What cannot be run here is simulated with the project's own control code:
the read plan (``make_plan``), the budget's admission rule (``scheduler.admits``), the online
tuner (``make_tuning``: ``Tuning`` and ``DepthController``, fed exactly as the engine feeds it),
the network-file-system defaults (``StreamConfig.for_network_fs``), the object-store meter
(``RequestStats``) and, with ``--ranks``, the distributed split (``make_rounds``, ``rank_budget``).
Only the storage, the threads and the clock are simulated: a discrete-event loop on a virtual
clock, so 595 GB "load" in seconds of CPU.

Storage models (both as the FUSE and nginx emulators in bench/ have them):

* ``nfs``: every read waits a latency drawn from percentiles (log-linear between them, as
  bench/nfsemu.c draws), then its bytes cross one shared link in the order reads became ready,
  one after another at the link's rate (as the emulator serves them); a read counts when it
  completes. The seed's figures: 40.7 GB/s, p50 126 ms, p90 305 ms, p99 1.8 s. These are
  fio's completion latencies *at 2,048 reads in flight*, so they already hold queueing; taking
  them as a pure round trip on top of the link is pessimistic.
* ``s3``: every request waits a first-byte latency, then streams at ``min(per-connection rate,
  link / flows)``; bytes count as they arrive (``RequestStats.received``).

Each rank is a model of ``run_plan``: blocks admitted by the budget's rule, cut into reads of the
tuner's size, at most the tuner's depth in flight, blocks handed over in completion order (or,
distributed, round by round, each round waiting for every rank's part). The consumer takes each
block at once (GPU copies are not the limit here).

CPU, with ``--python-per-request`` / ``--python-per-gb``: each process has one interpreter (one
GIL), and a request holds it that long before it is sent (the measured Python cost of a request:
signing, the request machine, the hand-over to a transport thread; per GB, what a transport
copies with the GIL held). A process's requests queue for it, counted in its depth while they
wait. Off (0) by default: CPU is then not modelled (see bench/RESULTS.md's cost per byte).

    python bench/sim_scale.py                          # the seed's cases, the defaults
    python bench/sim_scale.py --case nfs --ranks 8 --memory-limit 4GiB
    python bench/sim_scale.py --case s3 --python-per-request 386e-6 --s3-chunk 32MiB
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from weightstream.config import StreamConfig, parse_size  # noqa: E402
from weightstream.distributed import make_rounds, rank_budget, round_target  # noqa: E402
from weightstream.engine.plan import Block, Chunk, ReadPlan, make_plan  # noqa: E402
from weightstream.engine.scheduler import FINAL_THREADS, Budget, ReadCounters  # noqa: E402
from weightstream.format.dtypes import DTYPES  # noqa: E402
from weightstream.format.safetensors import TensorEntry  # noqa: E402
from weightstream.sources.flow import RequestStats  # noqa: E402
from weightstream.tuning.online import block_size, make_tuning  # noqa: E402

GB = 1e9
SEED_PERCENTILES = ((0.0, 0.060), (0.50, 0.126), (0.90, 0.305), (0.99, 1.8), (1.0, 2.0))
"""The seed's fio run (p50 126 ms, p90 305 ms, p99 1.8 s); p0 and p100 as bench_nfs's tail."""


@dataclass(frozen=True)
class Storage:
    kind: str  # "nfs" or "s3"
    link: float
    """Bytes/s of the shared link."""
    percentiles: tuple[tuple[float, float], ...]
    """(quantile, seconds) of the per-request latency (first byte, for s3)."""
    per_flow: float = math.inf
    """Bytes/s one connection can move (s3)."""


def draw(rng: random.Random, percentiles: tuple[tuple[float, float], ...]) -> float:
    u = rng.random()
    for (p0, v0), (p1, v1) in itertools.pairwise(percentiles):
        if u <= p1:
            f = (u - p0) / (p1 - p0) if p1 > p0 else 0.0
            return math.exp(math.log(v0) + f * (math.log(v1) - math.log(v0)))
    return percentiles[-1][1]


def kimi_like(total: float, *, shards: int = 64) -> list[list[TensorEntry]]:
    """A checkpoint shaped like Kimi-K2.5's (about 595 GB in 64 shards): mostly expert matrices
    of about 7 MB (int4 with scales), some attention matrices of about 30 MB, one embedding and one
    head of 2.3 GB each."""
    u8 = DTYPES["U8"]
    per_shard = int(total / shards)
    files: list[list[TensorEntry]] = []
    for s in range(shards):
        entries: list[TensorEntry] = []
        pos = 4096
        big = s in (0, shards - 1)
        while pos < per_shard:
            if big and not entries:
                size = 2_348_810_240
            elif len(entries) % 40 == 39:
                size = 29_360_128
            else:
                size = 7_340_032 + 57_344
            size = min(size, per_shard - pos) if per_shard - pos > 4096 else size
            entries.append(TensorEntry(f"s{s}.t{len(entries)}", u8, (size,), pos, pos + size, f"shard{s}"))
            pos += size
        files.append(entries)
    return files


class Link:
    """Processor sharing of one link among the transfers on it, each also capped at ``per_flow``:
    every transfer moves at ``min(per_flow, link / n)``, so one "virtual work" clock serves them
    all (each ends when it has advanced by the transfer's size)."""

    def __init__(self, link: float, per_flow: float) -> None:
        self.link, self.per_flow = link, per_flow
        self.work = 0.0
        self.at = 0.0
        self.heap: list[tuple[float, int, object]] = []
        self.starts: dict[int, tuple[float, int]] = {}
        self._seq = 0
        self.starts_popped = 0.0
        """The start (in work) of the transfer popped last."""

    def rate(self) -> float:
        n = len(self.starts)
        return min(self.per_flow, self.link / n) if n else 0.0

    def advance(self, t: float) -> None:
        dt = t - self.at
        if dt > 0:
            self.work += self.rate() * dt
        self.at = t

    def add(self, nbytes: int, item: object) -> int:
        self._seq += 1
        heapq.heappush(self.heap, (self.work + nbytes, self._seq, item))
        self.starts[self._seq] = (self.work, nbytes)
        return self._seq

    def next_end(self) -> float:
        if not self.heap:
            return math.inf
        return self.at + max(0.0, self.heap[0][0] - self.work) / self.rate()

    def pop(self) -> object:
        _, seq, item = heapq.heappop(self.heap)
        self.starts_popped = self.starts.pop(seq)[0]
        return item


@dataclass
class RankStats:
    bytes: int = 0
    peak_inflight: int = 0
    depths: list[int] = field(default_factory=list)
    chunk: int = 0
    done_at: float = 0.0
    python_s: float = 0.0
    """Seconds the process's interpreter was held by requests (``--python-per-request``)."""


class Rank:
    """One process's engine: the budget, the tuner's depth and read size, completion order."""

    def __init__(
        self,
        sim: Sim,
        plan: ReadPlan,
        config: StreamConfig,
        *,
        keep_all: bool,
        tuning_config: StreamConfig | None = None,
        give_back_on_take: bool = True,
        python: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """``config``: the budget of this engine (a distributed rank's is ``rank_budget``);
        ``tuning_config``: the load's settings, which the tuner is made from (the pipeline makes
        it once per load, before the split)."""
        self.sim, self.plan, self.config = sim, plan, config
        self.give_back_on_take = give_back_on_take
        """False: the driver gives bytes back (``run_plan``'s ``budget``: a distributed rank's
        parts are held until their round is gathered)."""
        self.net = RequestStats() if sim.storage.kind == "s3" else None
        # load() into host memory (``keep_all``): reads land in the returned tensors, as the
        # engine has them for files and the one-copy object-store transport (obstore's staged
        # reads keep to memory_limit; not modelled)
        room = plan.read_bytes if keep_all else 0
        self.tuning = make_tuning(
            tuning_config or config,
            chunk_size=plan.chunk_size,
            network=self.net,
            room=room,
            cpu=lambda: self.stats.python_s,  # the interpreter time its requests were charged
        )
        self.pending: deque[Block] = deque(plan.blocks)
        self.queue: deque[Chunk] = deque()
        self.left: dict[int, int] = {}
        self.queued = 0
        """Bytes of the chunks queued."""
        self.final = False
        self.covers: dict[tuple[int, int], int] = {}
        """Chunks each read in flight covers, by (block, offset)."""
        self.counters = ReadCounters()
        self.budget = Budget(config.memory_limit, self.counters, keep_all=keep_all)
        self.active = 0
        self.inflight_bytes = 0
        self.completed = 0
        self.ready: deque[Block] = deque()
        self.stats = RankStats()
        self.last_finish = 0.0
        self.flows = 0
        self.flow_starts = 0.0
        self.python = python
        """(seconds a request, seconds a byte) of interpreter time; 0: not modelled."""
        self.interpreter_free = 0.0

    @property
    def depth(self) -> int:
        depth = self.tuning.depth if self.tuning is not None else self.config.concurrency
        # The engine's last reads go out together (scheduler._Workers._finishing): once every
        # block is admitted and the bytes queued are within the tuner's final_bytes.
        if (
            self.tuning is not None
            and not self.pending
            and self.queued
            and (self.final or self.queued <= self.tuning.final_bytes())
        ):
            self.final = True
            return max(depth, FINAL_THREADS)
        return depth

    def begin(self) -> None:
        if self.tuning is not None:
            self.tuning.begin(0.0)
        self.admit()

    def admit(self) -> None:
        while self.pending and self.budget.admits(self.pending[0].nbytes):
            block = self.pending.popleft()
            self.budget.take(block.nbytes)
            size = self.tuning.chunk_size() if self.tuning is not None else self.plan.chunk_size
            chunks = list(block.chunks(size))
            self.stats.chunk = max(self.stats.chunk, size)
            self.left[block.index] = len(chunks)
            self.queue.extend(chunks)
            self.queued += sum(c.length for c in chunks)
        self.start()

    def start(self) -> None:
        while self.queue and self.active < self.depth:
            chunk = self.queue.popleft()
            # The engine's join at issue (scheduler._Workers._claim): the block's next chunks
            # still waiting, up to the tuner's issue size.
            most = self.tuning.issue_size() if self.tuning is not None else 0
            covers = 1
            while (
                self.queue
                and self.queue[0].block == chunk.block
                and chunk.length + self.queue[0].length <= most
            ):
                nxt = self.queue.popleft()
                chunk = Chunk(chunk.block, chunk.offset, chunk.length + nxt.length, chunk.pos)
                covers += 1
            self.covers[(chunk.block, chunk.offset)] = covers
            self.queued -= chunk.length
            self.stats.chunk = max(self.stats.chunk, chunk.length)
            self.active += 1
            self.inflight_bytes += chunk.length
            self.stats.peak_inflight = max(self.stats.peak_inflight, self.inflight_bytes)
            cost = self.python[0] + self.python[1] * chunk.length
            if cost <= 0:
                self.sim.issue(self, chunk)
                continue
            # the request waits for the process's interpreter, then holds it for ``cost``
            self.interpreter_free = max(self.sim.now, self.interpreter_free) + cost
            self.stats.python_s += cost
            self.sim.at(self.interpreter_free, ("issue", self, chunk))

    def first_byte(self, now: float, seconds: float) -> None:
        if self.net is not None:
            self.net.answered(seconds)
            self.net.inflight += 1

    def finished(self, now: float, chunk: Chunk, seconds: float) -> None:
        self.active -= 1
        self.inflight_bytes -= chunk.length
        self.completed += chunk.length
        self.last_finish = now
        if self.net is not None:
            self.net.inflight -= 1
            self.net.piece_for(chunk.length, now)
            self.sync_received()
        if self.tuning is not None:
            d = self.tuning.after_read(
                now, seconds, self.completed, starved=not self.queue, nbytes=chunk.length
            )
            self.stats.depths.append(d)
        left = self.left[chunk.block] - self.covers.pop((chunk.block, chunk.offset))
        if left:
            self.left[chunk.block] = left
        else:
            del self.left[chunk.block]
            self.ready.append(self.plan.blocks[chunk.block])
        self.start()

    def sync_received(self) -> None:
        assert self.net is not None
        self.net.received = self.completed + int(self.sim.arriving(self))

    def idle_tick(self, now: float) -> None:
        if self.tuning is not None and self.net is not None and now - self.last_finish >= 0.25:
            self.sync_received()
            self.tuning.idle_tick(now, self.completed, starved=not self.queue)

    def take(self) -> Block | None:
        """The caller takes the next finished block (and, as ``run_plan`` does on resuming,
        the budget gets its bytes back)."""
        if not self.ready:
            return None
        block = self.ready.popleft()
        self.stats.bytes += block.nbytes
        if self.give_back_on_take:
            self.give(block.nbytes)
        return block

    def give(self, nbytes: int) -> None:
        self.budget.give(nbytes)
        self.admit()


class Sim:
    def __init__(self, storage: Storage, *, seed: int = 1) -> None:
        self.storage = storage
        self.rng = random.Random(seed)
        self.now = 0.0
        self.timers: list[tuple[float, int, tuple]] = []
        self._seq = 0
        self.link = Link(storage.link, storage.per_flow)
        self.link_free = 0.0
        """When the FIFO link (nfs) has sent every read given to it."""
        self.flows: dict[int, Rank] = {}
        """Transfers of bytes counted as they arrive (s3): per transfer, its rank."""

    def at(self, t: float, what: tuple) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (t, self._seq, what))

    def issue(self, rank: Rank, chunk: Chunk) -> None:
        self.at(self.now + draw(self.rng, self.storage.percentiles), ("transfer", rank, chunk, self.now))

    def arriving(self, rank: Rank) -> float:
        """Bytes of ``rank``'s transfers now on the link (each has moved ``work - start``)."""
        return rank.flows * self.link.work - rank.flow_starts

    def run(self, ranks: list[Rank], driver) -> float:
        for r in ranks:
            r.begin()
        self.at(0.25, ("tick",))
        while not driver.done():
            t_timer = self.timers[0][0] if self.timers else math.inf
            t_link = self.link.next_end()
            t = min(t_timer, t_link)
            if t == math.inf:
                raise RuntimeError("simulation deadlocked: nothing in flight and the load is not done")
            self.link.advance(t)
            self.now = t
            if t_link <= t_timer:
                seq_item = self.link.pop()
                rank, chunk, issued, seq = seq_item  # type: ignore[misc]
                if self.flows.pop(seq, None) is not None:
                    rank.flows -= 1
                    rank.flow_starts -= self.link.starts_popped
                rank.finished(t, chunk, t - issued)
            else:
                _, _, what = heapq.heappop(self.timers)
                if what[0] == "done":
                    _, rank, chunk, issued = what
                    rank.finished(t, chunk, t - issued)
                elif what[0] == "transfer" and self.storage.kind == "nfs":
                    _, rank, chunk, issued = what
                    self.link_free = max(self.link_free, t) + chunk.length / self.storage.link
                    self.at(self.link_free, ("done", rank, chunk, issued))
                elif what[0] == "transfer":
                    _, rank, chunk, issued = what
                    rank.first_byte(t, t - issued)
                    seq = self.link._seq + 1
                    self.link.add(chunk.length, (rank, chunk, issued, seq))
                    if self.storage.kind == "s3":
                        self.flows[seq] = rank
                        rank.flows += 1
                        rank.flow_starts += self.link.work
                elif what[0] == "tick":
                    for r in ranks:
                        r.idle_tick(t)
                    self.at(t + 0.25, ("tick",))
                elif what[0] == "call":
                    what[1]()
                elif what[0] == "issue":
                    self.issue(what[1], what[2])
            driver.step(self.now)
        return self.now


class Streams:
    """Each rank streams its whole plan and hands blocks over as they finish."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks

    def step(self, now: float) -> None:
        for r in self.ranks:
            while r.take() is not None:
                pass
            if not r.pending and not r.left and not r.ready and not r.stats.done_at:
                r.stats.done_at = now

    def done(self) -> bool:
        return all(r.stats.done_at for r in self.ranks)


class Rounds:
    """``run_distributed``: each rank takes its parts in round order; a round is exchanged once
    every rank has its part (then, after ``gather`` seconds, the next can be)."""

    def __init__(
        self, sim: Sim, ranks: list[Rank], where: list[list[int]], rounds: int, gather: list[float]
    ) -> None:
        self.sim, self.ranks, self.where, self.rounds, self.gather = sim, ranks, where, rounds, gather
        self.round = 0
        self.have: list[dict[int, int]] = [dict() for _ in ranks]
        self.need = [[0] * rounds for _ in ranks]
        self.part_bytes = [[0] * rounds for _ in ranks]
        for i, w in enumerate(where):
            for b, k in enumerate(w):
                self.need[i][k] += 1
                self.part_bytes[i][k] += ranks[i].plan.blocks[b].nbytes
        self.busy_until = 0.0
        self.finished_at = 0.0

    def step(self, now: float) -> None:
        while self.round < self.rounds:
            k = self.round
            for i, r in enumerate(self.ranks):
                # run_distributed pulls blocks until its parts of round k are in
                while self.have[i].get(k, 0) < self.need[i][k]:
                    block = r.take()
                    if block is None:
                        break
                    kk = self.where[i][block.index]
                    self.have[i][kk] = self.have[i].get(kk, 0) + 1
            if any(self.have[i].get(k, 0) < self.need[i][k] for i in range(len(self.ranks))):
                return
            if now < self.busy_until:
                return
            self.busy_until = now + self.gather[k]
            self.round += 1
            for i, r in enumerate(self.ranks):  # the round is gathered: its parts are given back
                if not r.give_back_on_take:
                    r.give(self.part_bytes[i][k])
            if self.gather[k] > 0:
                self.sim.at(self.busy_until, ("call", lambda: None))
                return
        if not self.finished_at and now >= self.busy_until:
            self.finished_at = now

    def done(self) -> bool:
        return bool(self.finished_at)


class AnyRounds(Rounds):
    """Rounds gathered in the order they are complete on every rank (lowest first)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.complete = [0] * self.rounds  # ranks whose part of round k is in
        self.left = set(range(self.rounds))
        self.ripe: list[int] = []

    def step(self, now: float) -> None:
        for i, r in enumerate(self.ranks):
            while (block := r.take()) is not None:
                k = self.where[i][block.index]
                self.have[i][k] = self.have[i].get(k, 0) + 1
                if self.have[i][k] == self.need[i][k]:
                    self.complete[k] += 1
                    if self.complete[k] == len(self.ranks):
                        heapq.heappush(self.ripe, k)
        while self.ripe and now >= self.busy_until:
            k = heapq.heappop(self.ripe)
            self.left.discard(k)
            self.busy_until = now + self.gather[k]
            for i, r in enumerate(self.ranks):
                if not r.give_back_on_take:
                    r.give(self.part_bytes[i][k])
            if self.gather[k] > 0:
                self.sim.at(self.busy_until, ("call", lambda: None))
                break
        if not self.left and not self.finished_at and now >= self.busy_until:
            self.finished_at = now


def simulate(
    storage: Storage,
    files: list[list[TensorEntry]],
    config: StreamConfig,
    *,
    ranks: int = 1,
    distributed: bool = False,
    keep_all: bool = False,
    exchange_rate: float = 300 * GB,
    seed: int = 1,
    budget=rank_budget,
    plan_order: bool = False,
    give_back_on_take: bool = False,
    python: tuple[float, float] = (0.0, 0.0),
) -> dict:
    """``plan_order``: gather rounds in plan order (as before issue 21), not as every rank has
    its part; ``give_back_on_take``: a rank's budget gets a part back when the part is taken,
    not when its round is gathered (as before issue 21); ``budget``: the rank's budget rule."""
    """Load ``files`` on ``ranks`` processes sharing ``storage``; returns the simulated result."""
    sim = Sim(storage, seed=seed)
    plan = make_plan(
        files, chunk_size=config.read_size, block_size=block_size(config, remote=storage.kind == "s3")
    )
    total = plan.read_bytes
    if distributed and ranks > 1:
        rounds = make_rounds(plan, ranks, target=round_target(config))
        inner = config.replace(memory_limit=budget(config, ranks))
        engines, where = [], []
        for rk in range(ranks):
            mine, w = [], []
            for rd in rounds:
                for i, start, end, _pos in rd.extents(rk):
                    mine.append(Block(len(mine), rd.blocks[i].source, start, end, ()))
                    w.append(rd.index)
            my_plan = ReadPlan(tuple(mine), plan.chunk_size, sum(b.nbytes for b in mine))
            engines.append(
                Rank(
                    sim,
                    my_plan,
                    inner,
                    keep_all=False,
                    tuning_config=config,
                    give_back_on_take=give_back_on_take,
                    python=python,
                )
            )
            where.append(w)
        # an all_gather of a round moves (world-1)/world of it into each rank
        gather = [rd.nbytes * (ranks - 1) / ranks / exchange_rate for rd in rounds]
        kind = Rounds if plan_order else AnyRounds
        driver: Streams | Rounds = kind(sim, engines, where, len(rounds), gather)
        if not plan_order:
            for k in range(len(rounds)):  # a rank with no part in a round has it complete
                for i in range(ranks):
                    if driver.need[i][k] == 0:
                        driver.complete[k] += 1
                if driver.complete[k] == ranks:
                    heapq.heappush(driver.ripe, k)
        read = total
    else:
        engines = [Rank(sim, plan, config, keep_all=keep_all, python=python) for _ in range(ranks)]
        driver = Streams(engines)
        read = total * ranks
    t = sim.run(engines, driver)
    limit = read / storage.link
    r0 = engines[0]
    depths = r0.stats.depths
    return {
        "case": storage.kind,
        "ranks": ranks,
        "distributed": distributed,
        "keep_all": keep_all,
        "bytes_read_gb": round(read / GB, 1),
        "seconds": round(t, 2),
        "limit_s": round(limit, 2),
        "ratio_to_limit": round(t / limit, 3),
        "link_share": round(limit / t, 3),
        "memory_limit": config.memory_limit,
        "rank_memory_limit": engines[0].config.memory_limit,
        "start_depth": depths[0] if depths else config.concurrency,
        "final_depth": depths[-1] if depths else config.concurrency,
        "max_depth_seen": max(depths) if depths else config.concurrency,
        "read_size_mib": round(r0.stats.chunk / 2**20, 1),
        "peak_inflight_per_rank_gb": round(max(e.stats.peak_inflight for e in engines) / GB, 3),
        "peak_held_per_rank_gb": round(max(e.counters.peak_held for e in engines) / GB, 3),
        "decisions": len(r0.tuning.controller.decisions) if r0.tuning is not None else 0,
        "requests_per_rank": max(len(e.stats.depths) for e in engines),
        "interpreter_share": round(max(e.stats.python_s for e in engines) / t, 3),
    }


CASES = {
    "nfs": Storage("nfs", 40.7 * GB, SEED_PERCENTILES),
    "nfs_fixed": Storage("nfs", 40.7 * GB, ((0.0, 0.188), (1.0, 0.188))),
    "s3": Storage("s3", 50 * GB, ((0.0, 0.015), (0.5, 0.030), (0.99, 0.2), (1.0, 0.4)), per_flow=90e6),
}


def rank_budget_before(config: StreamConfig, world: int) -> int:
    """The split's rule before issue 21 (bench A/B): each rank read into its place in whole
    round buffers, so its budget was two rounds' parts."""
    return max(4096, 2 * round_target(config) // world)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="all", help="nfs, nfs_fixed, s3, or all (the seed's set)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--size", default="595GB")
    ap.add_argument("--memory-limit", default="", help="instead of the default")
    ap.add_argument(
        "--host-memory", default="2TiB", help="the node's available memory (an 8 x H200 node has 2 TiB)"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--max-concurrency", type=int, default=0, help="the tuner's ceiling, instead of automatic"
    )
    ap.add_argument("--s3-chunk", default="", help="the object store's request size, instead of the default")
    ap.add_argument(
        "--python-per-request",
        type=float,
        default=0.0,
        help="seconds of interpreter time a request holds in its process (0: CPU not modelled)",
    )
    ap.add_argument(
        "--python-per-gb", type=float, default=0.0, help="and seconds a GB (a transport's copies)"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--before", action="store_true", help="also the split before issue 21, and rounds in plan order"
    )
    args = ap.parse_args()
    total = parse_size(args.size)
    files = kimi_like(total)
    base = StreamConfig()
    if args.memory_limit:
        base = base.replace(memory_limit=parse_size(args.memory_limit))
    if args.max_concurrency:
        base = base.replace(max_concurrency=args.max_concurrency)
    if args.s3_chunk:
        base = base.replace(
            object_store=dataclasses.replace(base.object_store, chunk_size=parse_size(args.s3_chunk))
        )
    python = (args.python_per_request, args.python_per_gb / GB)
    runs = []
    names = ["nfs", "nfs_fixed", "s3"] if args.case == "all" else args.case.split(",")
    for name in names:
        storage = CASES[name]
        if storage.kind == "nfs":  # the node's host memory, shared by its ranks
            config = base.for_network_fs(available=parse_size(args.host_memory), processes=args.ranks)
        else:  # the store's settings, and the same rule for host memory
            config = base.for_remote(available=parse_size(args.host_memory), processes=args.ranks)
        variants = [
            ("distributed", dict(ranks=args.ranks, distributed=True)),
            ("one process, stream()", dict(ranks=1)),
        ]
        variants.append(("one process, load() to host", dict(ranks=1, keep_all=True)))
        if args.before:
            split = dict(ranks=args.ranks, distributed=True)
            variants[1:1] = [
                ("distributed, in plan order", dict(split, plan_order=True)),
                (
                    "distributed, as before",
                    dict(split, plan_order=True, give_back_on_take=True, budget=rank_budget_before),
                ),
            ]
        for label, kw in variants:
            res = simulate(storage, files, config, seed=args.seed, python=python, **kw)  # type: ignore[arg-type]
            res["name"], res["variant"] = name, label
            runs.append(res)
            if not args.json:
                print(
                    f"{name:10s} {label:30s} {res['seconds']:8.2f} s  limit {res['limit_s']:6.2f} s  "
                    f"x{res['ratio_to_limit']:.3f}  depth {res['start_depth']}->{res['final_depth']} "
                    f"(max {res['max_depth_seen']})  read {res['read_size_mib']} MiB  "
                    f"in flight/rank {res['peak_inflight_per_rank_gb']} GB  "
                    f"held/rank {res['peak_held_per_rank_gb']} GB  "
                    f"interpreter {res['interpreter_share']:.0%}",
                    flush=True,
                )
    if args.json:
        print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
