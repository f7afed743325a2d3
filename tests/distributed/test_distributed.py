"""Distributed loads on real gloo process groups (CPU), started with torch.multiprocessing.

One world of 4 processes runs every scenario in turn, in the same group: a scenario that fails
on one rank must leave no collective unmatched, or the ones after it (and the final clean load)
would hang or fail. Each rank writes what it saw to a JSON file per scenario; the tests below
assert on those records. A world of 2 checks the exchange timeout (a rank that never joins).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import weightstream as ws

from ..conftest import ALL_TORCH_DTYPES, as_bytes, random_tensor, reference, write_sharded

KiB = 1024
# Small reads and a small memory budget: many rounds, parts that cut inside tensors and files.
CONFIG = dict(chunk_size=64 * KiB, memory_limit=768 * KiB, concurrency=4, exchange_timeout=60.0)


def make_checkpoint(folder: Path, seed: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for i, dt in enumerate(ALL_TORCH_DTYPES):
        shards[i % 3][f"small.{i}"] = random_tensor((7, 13 + i), dt, seed=seed + i)
    shards[0]["scalar"] = random_tensor((), torch.float32, seed=seed)
    shards[1]["empty"] = torch.empty((0, 5), dtype=torch.float16)
    shards[1]["big"] = random_tensor((700_001,), torch.bfloat16, seed=seed + 100)  # > one round
    shards[2]["odd"] = random_tensor((123_457,), torch.uint8, seed=seed + 200)
    write_sharded(folder, shards)


def expected(folder: Path) -> dict[str, torch.Tensor]:
    want: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        want.update(reference(f))
    return want


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names of tensors that differ from the reference in any way (empty: bit-exact)."""
    bad = sorted(set(got) ^ set(want))
    for name in set(got) & set(want):
        g, w = got[name], want[name]
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(as_bytes(g), as_bytes(w)):
            bad.append(name)
    return bad


def outcome(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return {"ok": True, **fn()}
    except Exception as exc:
        return {
            "ok": False,
            "error": type(exc).__name__,
            "message": str(exc),
            "rank_attr": getattr(exc, "rank", None),
            "trace": traceback.format_exc(),
        }


def world4(rank: int, root: str) -> None:
    base = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{base / 'rdzv4'}", rank=rank, world_size=4)
    cfg = ws.StreamConfig(**CONFIG)
    ck, ck_a, ck_b = base / "ck", base / "ck_a", base / "ck_b"
    results: dict[str, Any] = {}
    want = expected(ck)

    def full() -> dict[str, Any]:
        c = ws.open_checkpoint(ck, config=cfg)
        got = c.load(process_group=dist.group.WORLD)
        s = c.last_stats
        assert s is not None
        return {
            "bad": compare(got, want),
            "bytes_read": s.bytes_read,
            "bytes_received": s.bytes_received,
            "stopped_after": s.split_stopped_after,
            "rank": s.rank,
            "world": s.world_size,
            "complete": s.complete,
            "total": s.bytes,
        }

    results["full"] = outcome(full)

    def auto_stream() -> dict[str, Any]:
        names = ["odd", "small.3", "big", "empty", "scalar"]
        with ws.stream(ck, config=cfg, tensors=names, distributed="auto") as s:
            got = list(s)
        return {"order": [n for n, _ in got], "bad": compare(dict(got), {n: want[n] for n in names})}

    results["auto_stream"] = outcome(auto_stream)

    # A node's bandwidth cap, shared by the launcher's ranks on it (LOCAL_WORLD_SIZE, as torchrun
    # sets it): each rank reads its part of the checkpoint under its share, so together they stay
    # under the node's cap.
    def capped() -> dict[str, Any]:
        os.environ["LOCAL_WORLD_SIZE"] = "4"
        try:
            c = ws.open_checkpoint(ck, config=cfg.replace(max_node_bandwidth=400_000_000))
            got = c.load(process_group=dist.group.WORLD)
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
        s = c.last_stats
        assert s is not None
        return {"bad": compare(got, want), "cap": s.settings["max_bandwidth"], "bytes_read": s.bytes_read}

    results["capped"] = outcome(capped)

    # Rank 1's part of the first round is late: its read waits until rank 0 has been handed a
    # tensor (a file flag), at most 20 s. Rounds are gathered in the order every rank has its part,
    # so the rounds after the first go ahead and rank 0 gets one; gathered in plan order, rank 0
    # would get nothing until the read gave up waiting. Meanwhile every rank reads ahead only
    # within its budget.
    def straggler() -> dict[str, Any]:
        from weightstream.distributed import make_rounds, round_target
        from weightstream.engine.plan import make_plan
        from weightstream.sources.file import FileSource

        many = base / "many"  # rounds of small tensors, each part well within a rank's budget
        c = ws.open_checkpoint(many, config=cfg)
        plan = make_plan([f.tensors for f in c.files], chunk_size=cfg.read_size)
        first = make_rounds(plan, 4, target=round_target(cfg))[0]
        late_ranges = {(first.blocks[i].source, a, b) for i, a, b, _ in first.extents(1)}
        uris = [f.uri for f in c.files]
        plain = FileSource.read_into
        gate = base / "gate"
        opened: list[bool] = []

        def late(self: FileSource, buf: memoryview, *, offset: int) -> Any:
            if any(uris[f] == self.uri and a <= offset < b for f, a, b in late_ranges):
                deadline = time.monotonic() + 20
                while not gate.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                opened.append(gate.exists())
            return plain(self, buf, offset=offset)

        from weightstream.engine import host

        cpus = host.usable_cpus
        if rank == 1:
            FileSource.read_into = late  # type: ignore[method-assign]
            # The files are in the page cache, where a rank copies on at most one thread per CPU;
            # a late read there holds one of them (on a 2-core machine, the late part's two reads
            # would hold both). The storage's depth applies, as to reads that are late on storage.
            host.usable_cpus = lambda: 4
        order = []
        try:
            with c.stream(process_group=dist.group.WORLD) as s:
                for name, t in s:
                    order.append((name, t.clone()))
                    if rank == 0 and len(order) == 1:
                        gate.touch()
        finally:
            FileSource.read_into = plain  # type: ignore[method-assign]
            host.usable_cpus = cpus
        st = s.stats
        return {
            "order": [n for n, _ in order],
            "bad": compare(dict(order), expected(many)),
            "opened": opened,
            "peak_held": st.peak_held_bytes,
        }

    results["straggler"] = outcome(straggler)

    # The ranks stop exchanging once the split does not pay (the rule is made to say so at the
    # first exchange after two gathers; the real rule reads the same records). Rank 1's part of
    # a late round is still being read then: that read is let go only when the ranks have
    # stopped, and it must be kept, not read again. As a stream (memory_limit holds the rest)
    # and as a load() (which keeps every tensor: the rest is admitted at once).
    def stop(load: bool) -> dict[str, Any]:
        import weightstream.distributed as wd
        from weightstream.engine.plan import make_plan
        from weightstream.sources.file import FileSource

        many = base / "many"
        c = ws.open_checkpoint(many, config=cfg)
        plan = make_plan([f.tensors for f in c.files], chunk_size=cfg.read_size)
        rounds = wd.make_rounds(plan, 4, target=wd.round_target(cfg))
        late_round = rounds[len(rounds) // 2]
        late_ranges = {(late_round.blocks[i].source, a, b) for i, a, b, _ in late_round.extents(1)}
        uris = [f.uri for f in c.files]
        plain, rule = FileSource.read_into, wd.split_pays
        heard: list[list[Any]] = []
        released: list[bool] = []
        late_reads: list[tuple[str, int, int, int]] = []  # (uri, file offset, bytes, address)

        def late(self: FileSource, buf: memoryview, *, offset: int) -> Any:
            # the reads of the late ranges wait for the stop: in flight when it comes
            if not heard and any(uris[f] == self.uri and a <= offset < b for f, a, b in late_ranges):
                deadline = time.monotonic() + 20
                while not heard and time.monotonic() < deadline:
                    time.sleep(0.01)
                released.append(bool(heard))
                address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
                late_reads.append((self.uri, offset, len(buf), address))
            return plain(self, buf, offset=offset)

        entries = {t.name: t for f in c.files for t in f.tensors}
        moved: list[str] = []
        checked: list[str] = []

        def where_read(name: str, t: torch.Tensor) -> None:
            # A tensor whose bytes were read before the stop holds them where they were read:
            # the rest of the round is read around them, not the kept bytes copied (host loads).
            # Only tensors wholly inside a late read and past its first page: blocks are read in
            # whole pages, and that first page may be the end of the block before (in another
            # place of the round, which holds those bytes twice).
            e = entries[name]
            for uri, offset, n, address in late_reads:
                if uri == e.uri and offset + 4096 <= e.start and e.end <= offset + n and e.nbytes:
                    checked.append(name)
                    if t.data_ptr() != address + (e.start - offset):
                        moved.append(name)

        def stop_after_two(measured: Any, world: int) -> bool | None:
            if min(m.gathers for m in measured) < 2:
                return None
            heard.extend(
                [m.read_bytes, m.read_seconds, m.gathered, m.gather_seconds, m.gathers] for m in measured
            )
            return False

        wd.split_pays = stop_after_two
        if rank == 1:
            FileSource.read_into = late  # type: ignore[method-assign]
        try:
            if load:
                got = c.load(process_group=dist.group.WORLD)
                for name, t in got.items():
                    where_read(name, t)
                st = c.last_stats
                assert st is not None
            else:
                got = {}
                with c.stream(process_group=dist.group.WORLD) as s:
                    for name, t in s:
                        where_read(name, t)
                        got[name] = t.clone()
                st = s.stats
        finally:
            FileSource.read_into = plain  # type: ignore[method-assign]
            wd.split_pays = rule
        return {
            "bad": compare(got, expected(many)),
            "heard": heard,
            "released": released,
            "checked": checked,
            "moved": moved,
            "bytes_read": st.bytes_read,
            "received": st.bytes_received,
            "stopped_after": st.split_stopped_after,
            "total": st.bytes,
            "peak_held": st.peak_held_bytes,
            "late_round_bytes": late_round.nbytes,
            "files": len(c.files),
            "planned": plan.read_bytes,
            # the same, without the bytes of blocks past the end of their file (rounded to pages)
            "in_files": sum(min(b.end, c.files[b.source].size) - b.start for b in plan.blocks),
        }

    results["stop"] = outcome(lambda: stop(load=False))
    results["stop_load"] = outcome(lambda: stop(load=True))

    # Two sub-groups load different checkpoints at the same time. A collective on the wrong
    # group would pair ranks of different loads (sizes differ): an error or a timeout.
    g01 = dist.new_group([0, 1])
    g23 = dist.new_group([2, 3])

    def sub() -> dict[str, Any]:
        mine, folder = (g01, ck_a) if rank < 2 else (g23, ck_b)
        c = ws.open_checkpoint(folder, config=cfg)
        got = c.load(process_group=mine)
        assert c.last_stats is not None
        return {
            "bad": compare(got, expected(folder)),
            "bytes_read": c.last_stats.bytes_read,
            "total": c.last_stats.bytes,
            "rank": c.last_stats.rank,
        }

    results["subgroup"] = outcome(sub)

    # Rank 2's copy is truncated: its headers fail; the other ranks must hear of it.
    def open_fails() -> dict[str, Any]:
        folder = base / f"trunc{rank}"
        ws.load(folder, config=cfg, process_group=dist.group.WORLD)
        return {}

    results["open_fails"] = outcome(open_fails)

    # Rank 1's copy shrinks mid-load, after its first tensor: its reads fail part way.
    def read_fails() -> dict[str, Any]:
        folder = base / f"shrink{rank}"
        n = 0
        with ws.stream(folder, config=cfg, process_group=dist.group.WORLD) as s:
            for _ in s:
                n += 1
                if rank == 1 and n == 1:
                    victim = folder / "model-00002-of-00003.safetensors"
                    os.truncate(victim, victim.stat().st_size // 3)
        return {"yielded": n}

    results["read_fails"] = outcome(read_fails)

    # Rank 3 stops after one tensor and closes its stream.
    def early_close() -> dict[str, Any]:
        n = 0
        with ws.stream(ck, config=cfg, process_group=dist.group.WORLD) as s:
            for _ in s:
                n += 1
                if rank == 3:
                    break
        return {"yielded": n}

    results["early_close"] = outcome(early_close)

    # Rank 2 closes its stream before taking any tensor: the others must hear of it at once.
    def never() -> dict[str, Any]:
        s = ws.stream(ck, config=cfg, process_group=dist.group.WORLD)
        if rank == 2:
            s.close()
            return {"yielded": 0}
        with s:
            return {"yielded": sum(1 for _ in s)}

    results["never"] = outcome(never)

    # Rank 0 stops one tensor before the end, when the last round is already exchanged: the
    # others finish, and rank 0's close must not wait for an exchange that no one will join
    # (exchange_timeout is 60 s here; a wait would show as a close of a minute).
    def late() -> dict[str, Any]:
        n = 0
        with ws.stream(ck, config=cfg, process_group=dist.group.WORLD) as s:
            for _ in s:
                n += 1
                if rank == 0 and n == len(s.names) - 1:
                    t0 = time.monotonic()
                    break
        return {"yielded": n, "close_s": time.monotonic() - t0 if rank == 0 else 0.0}

    results["late"] = outcome(late)

    # Rank 0 asks for other tensors than the rest.
    def mismatch() -> dict[str, Any]:
        names = ["big"] if rank == 0 else ["odd"]
        ws.load(ck, config=cfg, tensors=names, process_group=dist.group.WORLD)
        return {}

    results["mismatch"] = outcome(mismatch)

    # A memory limit is a rank's own (on a network file system its default follows the memory
    # its host has available): ranks whose limits differ but give the same rounds load together;
    # a limit that makes other rounds is a different load.
    def own_budgets() -> dict[str, Any]:
        mine = cfg.replace(memory_limit=CONFIG["memory_limit"] + 1000 * rank)
        return {"bad": compare(ws.load(ck, config=mine, process_group=dist.group.WORLD), want)}

    def other_rounds() -> dict[str, Any]:
        mine = cfg.replace(memory_limit=CONFIG["memory_limit"] * (2 if rank == 0 else 1))
        ws.load(ck, config=mine, process_group=dist.group.WORLD)
        return {}

    results["own_budgets"] = outcome(own_budgets)
    results["other_rounds"] = outcome(other_rounds)

    # Every rank forks a child (as a data-loader worker or a pre-forking server would): the group
    # is the parent's. The child's "auto" load is a plain one; an explicit group is refused at
    # once; neither touches the parent's group, which the load after this one proves.
    results["forked"] = outcome(lambda: forked_child(ck, cfg, want))

    # After all of that the group still works: nothing was left unmatched.
    results["after"] = outcome(full)
    (base / f"result{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def forked_child(ck: Path, cfg: ws.StreamConfig, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a child forked from this rank gets (compared with numpy: torch's own parallel
    operations deadlock in a child forked after its OpenMP pool ran)."""
    import numpy as np

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(30)
        out: dict[str, Any] = {}
        try:
            got = ws.load(ck, config=cfg, distributed="auto")
            out["auto_same"] = set(got) == set(want) and all(
                np.array_equal(as_bytes(got[k]).numpy(), as_bytes(want[k]).numpy()) for k in want
            )
            for how, kwargs in (
                ("true", {"distributed": True}),
                ("group", {"process_group": dist.group.WORLD}),
            ):
                try:
                    ws.load(ck, config=cfg, **kwargs)
                    out[how] = "loaded"
                except ws.errors.ConfigError as exc:
                    out[how] = str(exc)
        except BaseException as exc:
            out["error"] = traceback.format_exc() + repr(exc)
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        raw = fh.read()  # the child ends within its alarm
    _, status = os.waitpid(pid, 0)
    return {"child": json.loads(raw or b"{}"), "status": status}


def world2(rank: int, root: str) -> None:
    base = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{base / 'rdzv2'}", rank=rank, world_size=2)
    result: dict[str, Any] = {}
    want = expected(base / "ck")

    def full() -> dict[str, Any]:
        c = ws.open_checkpoint(base / "ck", config=ws.StreamConfig(**CONFIG))
        got = c.load(distributed=True)
        assert c.last_stats is not None
        return {"bad": compare(got, want), "bytes_read": c.last_stats.bytes_read, "total": c.last_stats.bytes}

    result["full"] = outcome(full)
    if rank == 1:  # never calls the load; stays alive (a dead peer is noticed sooner) until rank 0 is done
        while not (base / "result0.json").exists():
            time.sleep(0.05)
    else:

        def lonely() -> dict[str, Any]:
            ws.load(
                base / "ck", config=ws.StreamConfig(**{**CONFIG, "exchange_timeout": 2.0}), distributed=True
            )
            return {}

        result["lonely"] = outcome(lonely)
    (base / f"result{rank}.json").write_text(json.dumps(result))
    # After a timeout the group is unusable by design: leave without tearing it down.
    os._exit(0)


def spawn(fn: Callable[[int, str], None], n: int, root: Path, timeout: float = 150) -> list[dict[str, Any]]:
    ctx = mp.start_processes(fn, args=(str(root),), nprocs=n, join=False, start_method="spawn")
    try:
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed test world of {n} did not finish in {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((root / f"result{r}.json").read_text()) for r in range(n)]


@pytest.fixture(scope="module")
def runs4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("world4")
    make_checkpoint(root / "ck", seed=1)
    make_checkpoint(root / "ck_a", seed=2)
    write_sharded(
        root / "many", [{f"t{i}": random_tensor((4096,), torch.float32, seed=i) for i in range(100)}]
    )
    # A different layout from ck_a: paired with a rank of the other group, it would not match.
    write_sharded(root / "ck_b", [{"only": random_tensor((999_999,), torch.int8, seed=9)}])
    for r in range(4):
        shutil.copytree(root / "ck", root / f"trunc{r}")
        shutil.copytree(root / "ck", root / f"shrink{r}")
    victim = root / "trunc2" / "model-00002-of-00003.safetensors"
    os.truncate(victim, victim.stat().st_size - 100)
    return spawn(world4, 4, root)


@pytest.fixture(scope="module")
def runs2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("world2")
    make_checkpoint(root / "ck", seed=4)
    return spawn(world2, 2, root, timeout=90)


def ok(run: dict[str, Any]) -> dict[str, Any]:
    assert run["ok"], run.get("trace")
    return run


def test_every_rank_gets_every_tensor_bit_exact(runs4: list[dict[str, Any]]) -> None:
    for r, runs in enumerate(runs4):
        got = ok(runs["full"])
        assert got["bad"] == [] and got["complete"]
        assert (got["rank"], got["world"]) == (r, 4)


def test_each_rank_reads_about_a_quarter_and_receives_the_rest(runs4: list[dict[str, Any]]) -> None:
    fulls = [ok(runs["full"]) for runs in runs4]
    total = sum(f["bytes_read"] for f in fulls)
    data = fulls[0]["total"]
    assert data <= total <= data * 1.05  # alignment padding only: nothing is read twice
    for f in fulls:
        # Balanced by bytes, to 4 KiB per round (rounds here are ~256 KiB).
        assert abs(f["bytes_read"] - total / 4) <= 0.05 * total
        assert f["stopped_after"] is None  # too small a load to judge the split: kept
    # Read + received: the whole plan on every rank (received may include the 4 KiB padding
    # past the end of a file, which no rank reads).
    for f in fulls:
        assert total <= f["bytes_read"] + f["bytes_received"] <= total * 1.05


def test_auto_uses_the_default_group_and_all_ranks_yield_the_same_order(runs4: list[dict[str, Any]]) -> None:
    orders = [ok(runs["auto_stream"])["order"] for runs in runs4]
    assert all(o == orders[0] for o in orders)
    assert sorted(orders[0]) == sorted(["odd", "small.3", "big", "empty", "scalar"])
    assert all(runs["auto_stream"]["bad"] == [] for runs in runs4)


def test_a_late_part_holds_only_its_own_round(runs4: list[dict[str, Any]]) -> None:
    runs = [ok(r["straggler"]) for r in runs4]
    # rank 1's late read was let go by rank 0 holding a tensor: later rounds went first
    assert runs[1]["opened"] and all(runs[1]["opened"])
    assert all(r["bad"] == [] for r in runs)
    assert all(r["order"] == runs[0]["order"] for r in runs)  # every rank the same order
    # the budget holds each rank's parts until their round is gathered: never more than
    # rank_budget (memory_limit less two rounds) plus one block
    budget = CONFIG["memory_limit"] - 2 * (CONFIG["memory_limit"] // 3)
    assert all(r["peak_held"] <= budget + CONFIG["memory_limit"] // 3 for r in runs)


@pytest.mark.parametrize("case", ["stop", "stop_load"])
def test_ranks_that_stop_exchanging_read_the_rest_themselves(runs4: list[dict[str, Any]], case: str) -> None:
    runs = [ok(r[case]) for r in runs4]
    assert all(r["bad"] == [] for r in runs)
    # every rank heard the same records, from every rank, at the same exchange
    assert all(r["heard"] == runs[0]["heard"] for r in runs) and len(runs[0]["heard"]) == 4
    for read_bytes, read_seconds, gathered, gather_seconds, gathers in runs[0]["heard"]:
        assert read_bytes > 0 and read_seconds > 0 and gather_seconds > 0 and gathers >= 2
        assert gathered == runs[0]["heard"][0][2]  # the same rounds were gathered on every rank
    assert all(r["stopped_after"] == 2 for r in runs)  # what the stats say: two rounds, then alone
    # rank 1's reads in flight at the stop were let go by it
    assert runs[1]["released"] and all(runs[1]["released"])
    # and what they read was handed out where it was read: kept in place, not copied
    assert runs[1]["checked"] and runs[1]["moved"] == []
    total = runs[0]["total"]
    for r in runs:
        # what was received is what was gathered before the stop; the rest this rank read, each
        # byte once: the reads in flight at the stop were kept, not read again
        assert r["received"] < total
        assert r["in_files"] <= r["bytes_read"] + r["received"] <= r["planned"]
        assert r["planned"] - r["in_files"] < 4096 * r["files"]
        assert r["bytes_read"] > total / 4 + r["late_round_bytes"]
        round_bytes = CONFIG["memory_limit"] // 3
        if case == "stop":  # memory: memory_limit, plus at most one round while the rest is read
            assert r["peak_held"] <= CONFIG["memory_limit"] + round_bytes
        else:  # a load() keeps every tensor: the rest was admitted at once, beyond the limit
            assert r["peak_held"] > CONFIG["memory_limit"] + round_bytes


def test_sub_groups_load_independently(runs4: list[dict[str, Any]]) -> None:
    subs = [ok(runs["subgroup"]) for runs in runs4]
    assert all(s["bad"] == [] for s in subs)
    assert [s["rank"] for s in subs] == [0, 1, 0, 1]
    for pair in (subs[:2], subs[2:]):
        assert sum(s["bytes_read"] for s in pair) >= pair[0]["total"]
        for s in pair:
            assert abs(s["bytes_read"] - pair[0]["total"] / 2) <= 0.1 * pair[0]["total"]


def test_a_rank_failing_its_headers_fails_every_rank(runs4: list[dict[str, Any]]) -> None:
    runs = [r["open_fails"] for r in runs4]
    assert runs[2]["error"] == "FormatError" and "trunc2" in runs[2]["message"]
    for r in (0, 1, 3):
        assert runs[r]["error"] == "DistributedError", runs[r]
        assert runs[r]["rank_attr"] == 2
        assert "rank 2 of 4 failed" in runs[r]["message"]
        assert "FormatError" in runs[r]["message"] and "trunc2" in runs[r]["message"]


def test_a_rank_failing_mid_load_fails_every_rank(runs4: list[dict[str, Any]]) -> None:
    runs = [r["read_fails"] for r in runs4]
    assert not runs[1]["ok"]
    assert runs[1]["error"] in ("ReadError", "FormatError"), runs[1]
    assert "shrink1" in runs[1]["message"]
    for r in (0, 2, 3):
        assert runs[r]["error"] == "DistributedError", runs[r]
        assert runs[r]["rank_attr"] == 1 and "shrink1" in runs[r]["message"]


def test_a_rank_closing_early_stops_the_others(runs4: list[dict[str, Any]]) -> None:
    runs = [r["early_close"] for r in runs4]
    assert runs[3]["ok"] and runs[3]["yielded"] == 1
    for r in (0, 1, 2):
        assert runs[r]["error"] == "DistributedError", runs[r]
        assert "rank 3 of 4 stopped" in runs[r]["message"] and "closed" in runs[r]["message"]


def test_closing_after_the_last_exchange_does_not_wait(runs4: list[dict[str, Any]]) -> None:
    runs = [ok(r["late"]) for r in runs4]
    n = runs[1]["yielded"]
    assert [r["yielded"] for r in runs] == [n - 1, n, n, n]
    assert runs[0]["close_s"] < 30  # not the 60 s exchange_timeout: nothing was waited for


def test_closing_before_the_first_tensor_is_reported(runs4: list[dict[str, Any]]) -> None:
    runs = [r["never"] for r in runs4]
    assert runs[2]["ok"] and runs[2]["yielded"] == 0
    for r in (0, 1, 3):
        assert runs[r]["error"] == "DistributedError" and "rank 2 of 4 stopped" in runs[r]["message"]


def test_ranks_planning_different_loads_all_fail(runs4: list[dict[str, Any]]) -> None:
    for runs in runs4:
        for case in ("mismatch", "other_rounds"):  # other tensors; a limit that cuts other rounds
            run = runs[case]
            assert run["error"] == "DistributedError" and "planned different loads" in run["message"]


def test_ranks_with_their_own_memory_limits_load_together(runs4: list[dict[str, Any]]) -> None:
    assert all(ok(runs["own_budgets"])["bad"] == [] for runs in runs4)


def test_a_child_forked_from_a_rank_loads_alone_and_never_uses_the_group(runs4: list[dict[str, Any]]) -> None:
    for run in runs4:
        got = ok(run["forked"])
        assert got["status"] == 0, got
        child = got["child"]
        assert "error" not in child, child.get("error")
        assert child["auto_same"] is True
        for how in ("true", "group"):
            assert "forked from the one that made the process group" in child[how], child


def test_the_group_is_usable_after_every_failure(runs4: list[dict[str, Any]]) -> None:
    for runs in runs4:
        assert ok(runs["after"])["bad"] == []


def test_a_node_s_bandwidth_cap_is_shared_by_its_ranks(runs4: list[dict[str, Any]]) -> None:
    runs = [ok(r["capped"]) for r in runs4]
    assert all(r["bad"] == [] for r in runs)
    assert [r["cap"] for r in runs] == [100_000_000] * 4  # 400 MB/s over the node's 4 ranks
    full = [ok(r["full"]) for r in runs4]
    assert sum(r["bytes_read"] for r in runs) == sum(r["bytes_read"] for r in full)  # each its part


def test_two_ranks_split_the_reads(runs2: list[dict[str, Any]]) -> None:
    fulls = [ok(r["full"]) for r in runs2]
    assert all(f["bad"] == [] for f in fulls)
    for f in fulls:
        assert abs(f["bytes_read"] - f["total"] / 2) <= 0.05 * f["total"]


def test_a_rank_that_never_joins_times_out(runs2: list[dict[str, Any]]) -> None:
    run = runs2[0]["lonely"]
    assert run["error"] == "DistributedError", run
    assert "exchange_timeout=2" in run["message"] and "opening exchange" in run["message"]


def test_plain_loads_ignore_distributed_settings_without_a_group(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "ck", seed=5)
    got = ws.load(tmp_path / "ck", config=ws.StreamConfig(**CONFIG), distributed="auto")
    assert compare(got, expected(tmp_path / "ck")) == []
    with pytest.raises(ws.errors.ConfigError, match="not initialised"):
        ws.load(tmp_path / "ck", distributed=True)
    with pytest.raises(ws.errors.ConfigError, match="distributed must be"):
        ws.load(tmp_path / "ck", distributed="yes")  # type: ignore[arg-type]
