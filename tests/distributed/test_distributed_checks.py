"""Checked distributed loads (``verify`` with a manifest) on a real gloo group of 3 processes.

The ranks split every round's bytes at 4 KiB boundaries, so a manifest piece is read by several
ranks and no rank could check it from its own reads. Each rank must still check every byte: the
CRCs of the parts go to the other ranks, and a changed byte that only one rank read fails every
rank. One world runs the scenarios in turn (each leaves no collective unmatched, or the next
would hang), and the tests assert on what each rank wrote down.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import weightstream as ws
from weightstream.format.manifest import MANIFEST_NAME, dump_manifest
from weightstream.tools.manifest import digests

from ..conftest import flip, hub_metadata, random_tensor, write_sharded
from .test_distributed import compare, expected, outcome, spawn

KiB = 1024
WORLD = 3
# Rounds of about 256 KiB, parts of about 85 KiB: pieces of 16 or 64 KiB cut by parts, and
# runs of small tensors whose blocks share pages.
CONFIG = dict(chunk_size=64 * KiB, memory_limit=768 * KiB, concurrency=4, exchange_timeout=60.0)
# Rounds of about 4 MiB: 4 KiB pieces give each rank more CRCs per round than a status record holds.
MANY = dict(CONFIG, memory_limit=12 << 20)


def shards(seed: int, big: int = 300_001) -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"s{s}.t{i}": random_tensor((1000 + 17 * i, 13), torch.float32, seed=seed + 10 * s + i)
            for i in range(9)
        }
        | {f"s{s}.big": random_tensor((big,), torch.bfloat16, seed=seed + 100 + s)}
        for s in range(2)
    ]


def with_manifest(folder: Path, piece: int) -> None:
    with ws.open_checkpoint(folder, config=ws.StreamConfig(verify="off")) as ck:
        found = digests(ck, piece_size=piece)
    (folder / MANIFEST_NAME).write_text(dump_manifest(found, piece_size=piece))


def byte_only_rank_reads(
    folder: Path, config: dict[str, Any], rank: int, piece: int, rounds: slice
) -> tuple[str, int]:
    """A file and an offset that only ``rank`` reads (inside its part of one of ``rounds``, a
    page away from the part's ends), in a manifest piece that other ranks read bytes of too (so
    no rank could check it from its own reads alone)."""
    from weightstream.distributed import make_rounds, round_target
    from weightstream.engine.plan import make_plan
    from weightstream.format.ranges import Ranges

    cfg = ws.StreamConfig(**config)
    with ws.open_checkpoint(folder, config=cfg) as ck:
        plan = make_plan([f.tensors for f in ck.files], chunk_size=cfg.read_size)
        names = [Path(f.uri).name for f in ck.files]
    every = make_rounds(plan, WORLD, target=round_target(cfg))
    reads: dict[int, Ranges] = {}  # by file: every byte this rank reads in the load
    for rd in every:
        for i, start, end, _ in rd.extents(rank):
            reads.setdefault(rd.blocks[i].source, Ranges()).add(start, end)
    for rd in every[rounds]:
        for i, start, end, _ in rd.extents(rank):
            for offset in range(start + 4096 + 100, end - 4096 - 100, 512):
                first = offset // piece * piece
                if not reads[rd.blocks[i].source].covers(first, first + piece):
                    return names[rd.blocks[i].source], offset
    raise AssertionError("no byte found")


def most_pieces_in_a_part(folder: Path, config: dict[str, Any], piece: int) -> int:
    """The most manifest pieces any rank's part of one round touches."""
    from weightstream.distributed import make_rounds, round_target
    from weightstream.engine.plan import make_plan

    cfg = ws.StreamConfig(**config)
    with ws.open_checkpoint(folder, config=cfg) as ck:
        plan = make_plan([f.tensors for f in ck.files], chunk_size=cfg.read_size)
    most = 0
    for rd in make_rounds(plan, WORLD, target=round_target(cfg)):
        for r in range(WORLD):
            touched = {
                (rd.blocks[i].source, p)
                for i, a, b, _ in rd.extents(r)
                for p in range(a // piece, -(-b // piece))
            }
            most = max(most, len(touched))
    return most


def record_room() -> int:
    """CRCs one status record carries."""
    from weightstream import distributed as wd

    return (wd._CRCS - 3) // wd._CRC.size


def world(rank: int, root: str) -> None:
    base = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{base / 'rdzv'}", rank=rank, world_size=WORLD)
    results: dict[str, Any] = {}

    def checked(folder: str, config: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
        want = expected(base / folder)
        c = ws.open_checkpoint(
            base / folder, config=ws.StreamConfig(**{"verify": "on", "checks_dir": "off", **config})
        )
        if stream:
            with c.stream(process_group=dist.group.WORLD) as s:
                got = {n: t.clone() for n, t in s}
            st = s.stats
        else:
            got = c.load(process_group=dist.group.WORLD)
            st = c.last_stats
        assert st is not None
        return {
            "bad": compare(got, want),
            "checked": st.checked_bytes,
            "unchecked": st.unchecked_bytes,
            "read": st.bytes_read,
            "received": st.bytes_received,
            "stopped_after": st.split_stopped_after,
            "sizes": [p.stat().st_size for p in sorted((base / folder).glob("*.safetensors"))],
            "root": str(base),
            "files": sum(p.stat().st_size for p in (base / folder).glob("*.safetensors")),
        }

    for name in ("small", "whole"):
        results[name] = outcome(lambda name=name: checked(name, CONFIG))
    results["small_stream"] = outcome(lambda: checked("small", CONFIG, stream=True))
    results["many"] = outcome(lambda: checked("many", MANY))
    results["changed"] = outcome(lambda: checked("changed", CONFIG))
    results["changed_stream"] = outcome(lambda: checked("changed", CONFIG, stream=True))

    import weightstream.distributed as wd

    rule = wd.split_pays

    # The ranks stop exchanging after two rounds and each reads the rest itself: the bytes of
    # the rounds gathered are checked with the others' CRCs, the rest from this rank's reads.
    def stop_after_two(measured: Any, world: int) -> bool | None:
        return None if min(m.gathers for m in measured) < 2 else False

    # The Hub's SHA-256 of each file (a hash in file order, which no part can be hashed with
    # alone): one rank a file hashes the gathered rounds, and every rank hears its verdict.
    results["hub"] = outcome(lambda: checked("hub", CONFIG))
    results["hub_stream"] = outcome(lambda: checked("hub", CONFIG, stream=True))
    results["hub_changed"] = outcome(lambda: checked("hub_changed", CONFIG))

    wd.split_pays = stop_after_two
    try:
        results["stop"] = outcome(lambda: checked("small", CONFIG))
        results["stop_changed"] = outcome(lambda: checked("changed_early", CONFIG))
        results["hub_stop"] = outcome(lambda: checked("hub", CONFIG))
        results["hub_stop_changed"] = outcome(lambda: checked("hub_changed", CONFIG))
    finally:
        wd.split_pays = rule
    results["after"] = outcome(lambda: checked("small", CONFIG))  # the group still works

    # Ranks of which only some check a file (as where a store's checksum reached one rank's HEAD
    # and not another's, or one node's cache holds an entry with its CRC): rank 2 checks nothing.
    # Every rank must still end together (the last CRCs are exchanged by all, or by none), and
    # the others check what they can and count the rest.
    from weightstream.pipeline import TensorStream

    copies = TensorStream._copies
    TensorStream._copies = lambda self: [(s.location.uri, "") for s in self._used]  # type: ignore[method-assign]
    try:
        mixed = dict(CONFIG, verify="off") if rank == 2 else CONFIG
        results["some_check"] = outcome(lambda: checked("small", mixed))
    finally:
        TensorStream._copies = copies  # type: ignore[method-assign]
    (base / f"result{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("checked3")
    for name, piece, big in (
        ("small", 16 * KiB, 300_001),
        ("whole", 64 << 20, 300_001),
        ("many", 4096, 3_000_001),
    ):
        write_sharded(root / name, shards(seed=len(name), big=big))
        with_manifest(root / name, piece)
    assert most_pieces_in_a_part(root / "many", MANY, 4096) > record_room(), "the case is not made"
    # A byte of a middle round (read by rank 2 alone, also when the ranks stop exchanging after
    # two rounds), and one of the second round (gathered before that stop).
    for folder, rounds in (("changed", slice(3, None)), ("changed_early", slice(1, 2))):
        shutil.copytree(root / "small", root / folder)
        name, offset = byte_only_rank_reads(root / folder, CONFIG, 2, 16 * KiB, rounds)
        flip(root / folder / name, offset)
    # The same files with the Hub's SHA-256 of each and no manifest; then a byte changed that
    # rank 2 alone reads (it hashes no file: two files, the larger two ranks' each).
    shutil.copytree(root / "small", root / "hub", ignore=shutil.ignore_patterns(MANIFEST_NAME))
    hub_metadata(root / "hub")
    shutil.copytree(root / "hub", root / "hub_changed")
    name, offset = byte_only_rank_reads(root / "hub_changed", CONFIG, 2, 16 * KiB, slice(3, None))
    flip(root / "hub_changed" / name, offset)
    (root / "hub_changed_file").write_text(name)
    started = time.monotonic()
    out = spawn(world, WORLD, root, timeout=150)
    assert time.monotonic() - started < 150
    return out


def ok(run: dict[str, Any]) -> dict[str, Any]:
    assert run["ok"], run.get("trace")
    return run


@pytest.mark.parametrize("case", ["small", "whole", "small_stream", "many", "after"])
def test_every_rank_checks_every_byte_though_each_reads_a_part(runs: list[dict[str, Any]], case: str) -> None:
    for r in map(ok, (run[case] for run in runs)):
        assert r["bad"] == []
        assert r["received"] > 0 and r["read"] < r["files"]  # the reads were split
        assert (r["checked"], r["unchecked"]) == (r["files"], 0)


def test_ranks_that_stop_exchanging_still_check_every_byte(runs: list[dict[str, Any]]) -> None:
    for r in map(ok, (run["stop"] for run in runs)):
        assert r["stopped_after"] == 2 and r["bad"] == []
        assert (r["checked"], r["unchecked"]) == (r["files"], 0)


@pytest.mark.parametrize("case", ["changed", "changed_stream", "stop_changed"])
def test_a_byte_only_one_rank_read_fails_every_rank(
    runs: list[dict[str, Any]], case: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    for rank, run in enumerate(runs):
        r = run[case]
        assert not r["ok"], f"rank {rank} loaded a changed file"
        assert r["error"] in ("FormatError", "DistributedError"), r["trace"]
        assert "checksum mismatch" in r["message"] and "changed" in r["message"], r["message"]
    # where every rank put the same CRCs together, each names the mismatch itself
    assert any(run[case]["error"] == "FormatError" for run in runs)


def test_ranks_of_which_only_some_check_end_together(runs: list[dict[str, Any]]) -> None:
    results = [ok(run["some_check"]) for run in runs]
    assert all(r["bad"] == [] for r in results)
    for r in results[:2]:  # what rank 2 read came with no CRC: counted, not failed, not waited for
        assert r["checked"] > 0 and r["unchecked"] > 0 and r["checked"] + r["unchecked"] <= r["files"]
    assert (results[2]["checked"], results[2]["unchecked"]) == (0, 0)


def test_a_hash_in_file_order_is_taken_by_one_rank_and_heard_by_all(runs: list[dict[str, Any]]) -> None:
    for case in ("hub", "hub_stream"):
        for r in map(ok, (run[case] for run in runs)):
            assert r["bad"] == []
            assert r["received"] > 0 and r["read"] < r["files"]  # the reads were split
            assert (r["checked"], r["unchecked"]) == (r["files"], 0)


def test_a_byte_changed_under_a_hash_in_file_order_fails_every_rank(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        r = run["hub_changed"]
        assert not r["ok"], f"rank {rank} loaded a changed file"
        assert "checksum mismatch" in r["message"] and "sha256" in r["message"], r["message"]
        assert "hub_changed" in r["message"], r["message"]
    # the rank that hashed the file names the mismatch; the others raise its error
    assert sorted(run["hub_changed"]["error"] for run in runs).count("FormatError") == 1


def test_after_a_stop_the_rank_that_hashes_a_file_checks_it_and_the_others_say_they_did_not(
    runs: list[dict[str, Any]],
) -> None:
    from weightstream.distributed import _hashers

    results = [ok(run["hub_stop"]) for run in runs]
    sizes = results[0]["sizes"]
    given = _hashers(dict(enumerate(sizes)), WORLD)
    for rank, r in enumerate(results):
        assert r["stopped_after"] == 2 and r["bad"] == []
        mine = sum(size for f, size in enumerate(sizes) if given[f] == rank)
        assert (r["checked"], r["unchecked"]) == (mine, r["files"] - mine)
    assert sum(r["checked"] for r in results) == results[0]["files"]


def test_after_a_stop_a_changed_byte_fails_the_rank_that_hashes_its_file(
    runs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The byte lies in a round after the stop, which every rank reads from its own copy: the
    rank that hashes the file fails naming it; a rank that returns says the file was not checked
    (with ``verify="on"``, a warning), since no exchange follows to tell it."""
    from weightstream.distributed import _hashers

    sizes = ok(runs[0]["hub_stop"])["sizes"]
    given = _hashers(dict(enumerate(sizes)), WORLD)
    files = sorted(p.name for p in (Path(runs[0]["hub_stop"]["root"]) / "hub").glob("*.safetensors"))
    changed = files.index((Path(runs[0]["hub_stop"]["root"]) / "hub_changed_file").read_text())
    for rank, run in enumerate(runs):
        r = run["hub_stop_changed"]
        if given[changed] == rank:
            assert not r["ok"] and r["error"] == "FormatError", r
            assert "checksum mismatch" in r["message"] and "sha256" in r["message"], r["message"]
        else:
            assert ok(r)["unchecked"] >= sizes[changed]
