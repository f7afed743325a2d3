"""The node cache (``cache_dir``) against a real S3-compatible server (moto) on loopback: filled
while a load streams, read by the next load, safe against killed fillers, new versions, a full
disk and several processes at once."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

import weightstream as ws
from weightstream import cache
from weightstream.cache.store import key_of
from weightstream.cli.main import main as cli
from weightstream.config import KiB

from ..conftest import assert_same, random_tensor
from .conftest import bucket, put_checkpoint


def cfg(root: Path, **kw: object) -> ws.StreamConfig:
    return ws.StreamConfig.from_env(cache_dir=str(root), chunk_size=64 * KiB, **kw)


def shards(n: int = 2, rows: int = 300, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"w{s}.{i}": random_tensor((rows + 7 * i, 64), torch.float32, seed=seed + 10 * s + i)
            for i in range(4)
        }
        for s in range(n)
    ]


def names(b: str, prefix: str, n: int = 2) -> list[str]:
    return [f"s3://{b}/{prefix}/model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def whole(root: Path) -> dict[str, cache.Entry]:
    cache.drain()
    return {e.uri: e for e in cache.Cache(str(root)).entries() if e.whole and e.uri}


def written(journal: Path) -> int:
    """Bytes a journal names as written."""
    raw = journal.read_bytes()
    raw = raw[raw.index(b"\n") + 1 :]
    raw = raw[: len(raw) - len(raw) % 24]
    return sum(n for kind, _, _, n in struct.iter_unpack("<IIQQ", raw) if kind == 2)


@pytest.fixture(autouse=True)
def _drained() -> Iterator[None]:
    yield
    cache.drain()  # nothing of one test's publishing runs into the next


def test_second_load_reads_the_cache_and_the_entry_is_a_safetensors_file(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    parts = shards()
    want = put_checkpoint(s3, b, "m", parts)
    first = ws.open_checkpoint(f"s3://{b}/m", config=cfg(tmp_path))
    assert first.remote
    assert_same(first.load(), want)
    assert first.last_stats is not None and first.last_stats.network_bytes > 0
    first.close()
    entries = whole(tmp_path)
    assert sorted(entries) == names(b, "m")
    for uri, part in zip(names(b, "m"), parts, strict=True):
        assert entries[uri].size == len(save(part))
        assert_same(load_file(entries[uri].path), part)  # any tool reads it
        assert (
            entries[uri].version
            == json.loads(Path(entries[uri].path).with_suffix(".json").read_text())["version"]
        )
    # the next load checks each version (the header request) and reads the local copies
    again = ws.open_checkpoint(f"s3://{b}/m", config=cfg(tmp_path))
    assert not again.remote and all(s.source.uri.startswith(str(tmp_path)) for s in again.shards)
    assert_same(again.load(), want)
    assert again.last_stats is not None and again.last_stats.network_bytes == 0
    # every front door reads through it
    assert_same(dict(ws.stream(f"s3://{b}/m", config=cfg(tmp_path))), want)
    with ws.safe_open(names(b, "m")[0], framework="pt", config=cfg(tmp_path)) as f:
        assert_same({k: f.get_tensor(k) for k in f.keys()}, parts[0])  # noqa: SIM118 (its API)


def test_a_new_version_is_read_from_the_store_and_refills_the_entry(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    put_checkpoint(s3, b, "v", shards(seed=1))
    ws.load(f"s3://{b}/v", config=cfg(tmp_path))
    old = whole(tmp_path)
    new = put_checkpoint(s3, b, "v", shards(seed=2))  # same keys, other bytes, new ETags
    assert_same(ws.load(f"s3://{b}/v", config=cfg(tmp_path)), new)
    now = whole(tmp_path)
    assert sorted(now) == sorted(old)
    for uri in now:
        assert now[uri].version != old[uri].version
    assert [e for e in cache.Cache(str(tmp_path)).entries() if not e.whole] == []  # no part left
    assert_same(ws.load(f"s3://{b}/v", config=cfg(tmp_path)), new)


_FILLER = """
import sys, weightstream as ws
cfg = ws.StreamConfig.from_env(cache_dir=sys.argv[2], chunk_size=64 * 1024, max_bandwidth=ws.config.parse_size(sys.argv[3]))
ck = ws.open_checkpoint(sys.argv[1], config=cfg)
ck.load()
print(ck.last_stats.network_bytes, flush=True)
"""


def test_a_killed_filler_leaves_no_entry_that_looks_whole(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(s3, b, "k", shards(rows=3000))
    total = sum(t.nbytes for t in want.values())
    proc = subprocess.Popen([sys.executable, "-c", _FILLER, f"s3://{b}/k", str(tmp_path), "2MB"])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            journals = list(tmp_path.glob("*.log"))
            if journals and sum(written(j) for j in journals) >= 1 << 20:
                break
            assert proc.poll() is None, "the filler ended before it was killed"
            time.sleep(0.05)
        else:
            pytest.fail("the filler wrote nothing in 60 s")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert whole(tmp_path) == {}  # the part is not a whole entry
    ck = ws.open_checkpoint(f"s3://{b}/k", config=cfg(tmp_path))
    assert ck.remote
    assert_same(ck.load(), want)
    stats = ck.last_stats
    assert stats is not None and 0 < stats.network_bytes < total  # what the killed one wrote is reused
    assert sorted(whole(tmp_path)) == names(b, "k")
    assert_same(ws.load(f"s3://{b}/k", config=cfg(tmp_path)), want)


def test_a_part_from_before_the_last_boot_is_not_trusted(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(s3, b, "p", shards(n=1), index=False)
    uri = f"s3://{b}/p/model-00001-of-00001.safetensors"
    ck = ws.open_checkpoint(uri, config=cfg(tmp_path))
    version, size = ck.shards[0].version, ck.shards[0].size
    ck.close()
    assert version is not None
    # a part of garbage whose journal names every byte written, last touched long ago
    c = cache.Cache(str(tmp_path))
    part, journal = c.fill_paths(key_of(uri), version)  # this node's own
    Path(part).write_bytes(b"\xee" * size)
    head = json.dumps({"uri": uri, "version": version, "size": size}).encode() + b"\n"
    Path(journal).write_bytes(head + struct.pack("<IIQQ", 2, 1, 0, size))
    os.utime(journal, (1, 1))
    assert_same(ws.load(uri, config=cfg(tmp_path)), want)
    assert_same(load_file(whole(tmp_path)[uri].path), want)


def test_a_part_another_node_fills_is_never_read(s3_endpoint: str, s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A cache folder that several nodes share (on a network file system): a range another
    node's journal names may not be on the server yet (its client writes it back later, or
    never if the node dies), so no part but this kernel's own is read. The parts are made here
    as such a node leaves them (this machine has one kernel): every byte named written, none
    there; one as this version names another node's, one as versions before it named every
    node's. The objects carry no checksum, so nothing else would catch a hole."""
    import boto3
    from botocore.config import Config

    plain = boto3.client(
        "s3", endpoint_url=s3_endpoint, region_name="us-east-1",
        config=Config(request_checksum_calculation="when_required"),
    )  # fmt: skip
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(plain, b, "o", shards(n=1), index=False)
    uri = f"s3://{b}/o/model-00001-of-00001.safetensors"
    with ws.open_checkpoint(uri) as ck:  # not through the cache: this node has started no fill
        version, size = ck.shards[0].version, ck.shards[0].size
        assert version is not None and ck.shards[0].digest is None
    c = cache.Cache(str(tmp_path))
    key = key_of(uri)
    head = json.dumps({"uri": uri, "version": version, "size": size}).encode() + b"\n"
    theirs = {
        "live": c.fill_paths(key, version, node="another node, filling now"),
        "before": (c.path(key, ".part", version), c.path(key, ".log", version)),
        "idle": c.fill_paths(key, version, node="another node, gone"),
    }
    assert len({p for pair in theirs.values() for p in pair} | set(c.fill_paths(key, version))) == 8
    for part, journal in theirs.values():
        with open(part, "wb") as f:
            f.truncate(size)  # a hole where the node's bytes never arrived
        Path(journal).write_bytes(head + struct.pack("<IIQQ", 2, 1, 0, size))
    os.utime(theirs["idle"][1], (1, 1))  # not written since this machine started

    assert_same(ws.load(uri, config=cfg(tmp_path)), want)
    assert_same(load_file(whole(tmp_path)[uri].path), want)  # filled from the store, by this node
    for part, journal in (theirs["live"], theirs["before"]):  # another node may be filling them
        assert os.path.getsize(part) == size and written(Path(journal)) == size
    assert not any(os.path.exists(p) for p in theirs["idle"])  # left idle: removed


def test_a_partial_load_caches_what_it_read(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(s3, b, "s", shards(rows=1000))
    some = ["w0.1", "w1.3"]
    ck = ws.open_checkpoint(f"s3://{b}/s", config=cfg(tmp_path))
    assert_same(ck.load(tensors=some), {k: want[k] for k in some})
    ck.close()
    cache.drain()
    assert whole(tmp_path) == {}
    parts = [e for e in cache.Cache(str(tmp_path)).entries() if not e.whole]
    assert len(parts) == 2 and all(0 < e.size < 2 * want["w0.1"].nbytes + 64 * KiB for e in parts)
    again = ws.open_checkpoint(f"s3://{b}/s", config=cfg(tmp_path))
    assert_same(again.load(tensors=some), {k: want[k] for k in some})
    assert again.last_stats is not None and again.last_stats.network_bytes == 0
    assert_same(again.load(), want)  # the rest is read from the store and the entries are whole
    assert sorted(whole(tmp_path)) == names(b, "s")


def test_least_recently_used_entries_make_room_but_not_those_in_use(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    ckpts = {p: put_checkpoint(s3, b, p, shards(n=1), index=False) for p in "abc"}
    uri = {p: f"s3://{b}/{p}/model-00001-of-00001.safetensors" for p in "abc"}
    size = len(save(shards(n=1)[0]))
    limit = int(2.5 * size)
    for p in "ab":
        ws.load(uri[p], config=cfg(tmp_path, cache_max_bytes=limit))
    assert sorted(whole(tmp_path)) == sorted([uri["a"], uri["b"]])
    held = ws.open_checkpoint(uri["a"], config=cfg(tmp_path, cache_max_bytes=limit))  # in use
    time.sleep(0.01)
    ws.load(uri["b"], config=cfg(tmp_path, cache_max_bytes=limit))  # b is now the last used
    assert_same(ws.load(uri["c"], config=cfg(tmp_path, cache_max_bytes=limit)), ckpts["c"])
    assert sorted(whole(tmp_path)) == sorted([uri["a"], uri["c"]])  # b went: a was in use
    assert_same(held.load(), ckpts["a"])
    held.close()
    # a file larger than the whole cache is not cached, and loads
    ws.load(uri["b"], config=cfg(tmp_path, cache_max_bytes=size // 2))
    assert uri["b"] not in whole(tmp_path)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: a real file system that fills up."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.fail(f"mounting a tmpfs needs root (as CI runs): {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_drops_the_entry_and_the_load_completes(s3, small_disk: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(s3, b, "f", shards(rows=2000))  # two shards of ~2.1 MB, 3 MiB of disk
    with caplog.at_level(logging.WARNING, logger="weightstream.cache"):
        assert_same(ws.load(f"s3://{b}/f", config=cfg(small_disk)), want)
    assert "not keeping" in caplog.text and "No space left" in caplog.text
    assert len(whole(small_disk)) <= 1
    # the dropped part gave its room back: the disk holds at most one shard
    st = os.statvfs(small_disk)
    assert (st.f_blocks - st.f_bfree) * st.f_frsize < 2_300_000
    assert_same(ws.load(f"s3://{b}/f", config=cfg(small_disk)), want)


def test_four_processes_at_once_read_the_store_about_once(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(s3, b, "c", shards(rows=1500))
    total = sum(t.nbytes for t in want.values())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FILLER, f"s3://{b}/c", str(tmp_path), "8MB"], stdout=subprocess.PIPE
        )
        for _ in range(4)
    ]
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    fetched = [int(o.split()[-1]) for o in out]
    print("fetched", fetched, "of", total)
    assert sum(fetched) < 2 * total, fetched  # not four times: the others waited for the bytes
    assert sorted(whole(tmp_path)) == names(b, "c")
    for uri, entry in whole(tmp_path).items():
        part = load_file(entry.path)
        assert_same(part, {k: want[k] for k in part})
        assert uri.endswith(".safetensors")
    ck = ws.open_checkpoint(f"s3://{b}/c", config=cfg(tmp_path))
    assert_same(ck.load(), want)
    assert ck.last_stats is not None and ck.last_stats.network_bytes == 0


def test_cache_cli_lists_verifies_and_prunes(s3, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    put_checkpoint(s3, b, "cli", shards())
    ws.load(f"s3://{b}/cli", config=cfg(tmp_path))
    cache.drain()
    d = ["--cache-dir", str(tmp_path)]
    assert cli(["cache", "list", *d]) == 0
    out = capsys.readouterr().out
    assert all(u in out for u in names(b, "cli")) and "2 entries" in out
    assert cli(["cache", "list", "--json", *d]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {e["uri"] for e in listed} == set(names(b, "cli")) and all(e["whole"] for e in listed)
    assert cli(["cache", "verify", *d]) == 0
    assert capsys.readouterr().out.count(": ok") == 2
    # one object replaced, one file damaged
    s3.put_object(Bucket=b, Key="cli/model-00001-of-00002.safetensors", Body=save(shards(seed=5)[0]))
    damaged = whole(tmp_path)[names(b, "cli")[1]]
    with open(damaged.path, "r+b") as f:  # the last byte of a tensor: only the checksum sees it
        f.seek(damaged.size - 1)
        last = f.read(1)
        f.seek(damaged.size - 1)
        f.write(bytes([last[0] ^ 1]))
    assert cli(["cache", "verify", *d]) == 1
    out = capsys.readouterr().out
    assert f"{names(b, 'cli')[0]}: stale" in out and f"{names(b, 'cli')[1]}: damaged" in out
    assert "crc32c" in out
    assert cli(["cache", "verify", "--offline", *d]) == 1  # the damage is found without the store
    capsys.readouterr()
    assert cli(["cache", "prune", *d]) == 0
    assert whole(tmp_path) == {}
    assert cli(["cache", "list"]) == 2  # no folder named
    assert "cache-dir" in capsys.readouterr().err


def test_a_cache_folder_that_cannot_be_made_is_refused_by_name(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ws.errors.ConfigError, match="cache_dir"):
        cache.Cache(str(blocker / "sub"))


def test_an_entry_is_whole_when_the_load_never_reads_the_header_again(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A header longer than a page: the load's reads start past it, and only the open read it."""
    b = bucket(s3, "cache-tests")
    part = {
        f"layer.{i}.a_rather_long_parameter_name.weight": random_tensor((64, 64), torch.float16, seed=i)
        for i in range(300)
    }
    want = put_checkpoint(s3, b, "h", [part], index=False)
    uri = f"s3://{b}/h/model-00001-of-00001.safetensors"
    ck = ws.open_checkpoint(uri, config=cfg(tmp_path))
    assert ck.files[0].data_start > 3 * 4096
    assert_same(ck.load(), want)
    ck.close()
    assert_same(load_file(whole(tmp_path)[uri].path), want)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode() + tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rank(rank: int, root: str, uri: str) -> None:
    """One of two gloo ranks loading ``uri`` with ``distributed=True`` and the shared cache."""
    import torch.distributed as dist

    base = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{base / 'rdzv'}", rank=rank, world_size=2)
    out = []
    for _ in range(2):
        ck = ws.open_checkpoint(uri, config=cfg(base / "cache", exchange_timeout=60.0))
        got = ck.load(distributed=True)
        assert ck.last_stats is not None
        out.append(
            {
                "remote": ck.remote,
                "network": ck.last_stats.network_bytes,
                "digest": digest(got),
            }
        )
        ck.close()
        cache.drain()
        dist.barrier()  # both ranks' parts are written and published before the second load
    (base / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_distributed_ranks_fill_one_entry_together(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(s3, b, "d", shards(rows=1000))
    total = sum(t.nbytes for t in want.values())
    runs = spawn2(_rank, tmp_path, f"s3://{b}/d")
    assert [[r["digest"] for r in run] for run in runs] == [[digest(want)] * 2] * 2
    first = [run[0]["network"] for run in runs]
    assert all(0 < n < 0.75 * total for n in first) and sum(first) < 1.2 * total  # each read its part
    assert sorted(whole(tmp_path / "cache")) == names(b, "d")
    assert [run[1] for run in runs] == [
        {"remote": False, "network": 0, "digest": run[1]["digest"]} for run in runs
    ]


def _rank_copies(rank: int, root: str, uris: list[str]) -> None:
    """Rank ``r`` loads ``uris[r]`` with ``distributed=True``: the same layout, maybe other bytes."""
    import torch.distributed as dist

    base = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{base / 'rdzv'}", rank=rank, world_size=2)
    try:
        got = ws.load(uris[rank], config=ws.StreamConfig.from_env(exchange_timeout=60.0), distributed=True)
        out = {"ok": True, "digest": digest(got)}
    except ws.errors.WeightStreamError as exc:
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    (base / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def spawn2(fn, root: Path, arg: object) -> list:  # type: ignore[no-untyped-def,type-arg]
    """Two gloo ranks running ``fn(rank, root, arg)``; what each wrote to ``root/rankN.json``."""
    import torch.multiprocessing as mp

    root.mkdir(exist_ok=True)
    ctx = mp.start_processes(fn, args=(str(root), arg), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish in 120 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_reading_other_copies_of_a_shard_all_fail_naming_it(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Same layout, other bytes (an object replaced, a bucket's stale replica): the ranks would
    return a mix equal to neither; they fail instead, every one, naming the shard."""
    b = bucket(s3, "cache-tests")
    parts = shards(rows=400)
    want = put_checkpoint(s3, b, "x", parts)
    other = [dict(p) for p in parts]
    other[1] = {k: v.clone() for k, v in parts[1].items()}
    other[1]["w1.2"].view(torch.int32)[5, 5] ^= 1
    put_checkpoint(s3, b, "y", other)
    same = spawn2(_rank_copies, tmp_path / "same", [f"s3://{b}/x"] * 2)
    assert [r["digest"] for r in same] == [digest(want)] * 2
    runs = spawn2(_rank_copies, tmp_path / "mixed", [f"s3://{b}/x", f"s3://{b}/y"])
    assert [r["ok"] for r in runs] == [False, False], runs
    for r in runs:
        assert "DistributedError" in str(r["error"]) and "model-00002-of-00002.safetensors" in str(
            r["error"]
        ), r
        assert "model-00001" not in str(r["error"])


def test_within_the_ttl_a_cached_checkpoint_starts_with_the_store_gone(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "cache-tests")
    want = put_checkpoint(s3, b, "ttl", shards())
    config = cfg(tmp_path, cache_ttl=3600)
    assert_same(ws.load(f"s3://{b}/ttl", config=config), want)  # fills the cache, notes the layout
    cache.drain()
    for key in [o["Key"] for o in s3.list_objects_v2(Bucket=b, Prefix="ttl/")["Contents"]]:
        s3.delete_object(Bucket=b, Key=key)  # the store has nothing now
    ck = ws.open_checkpoint(f"s3://{b}/ttl", config=config)
    assert not ck.remote and ck.index_uri == f"s3://{b}/ttl/model.safetensors.index.json"
    assert_same(ck.load(), want)
    assert ck.last_stats is not None and ck.last_stats.network_bytes == 0
    ck.close()
    with pytest.raises(ws.errors.NotFoundError):  # without a TTL every open asks the store
        ws.open_checkpoint(f"s3://{b}/ttl", config=cfg(tmp_path))
    record = next(tmp_path.glob("*.layout.json"))
    noted = json.loads(record.read_text())
    record.write_text(json.dumps({**noted, "checked": noted["checked"] - 7200}))  # two hours ago
    with pytest.raises(ws.errors.NotFoundError):  # past the TTL: the store is asked again
        ws.open_checkpoint(f"s3://{b}/ttl", config=config)
    record.write_text(json.dumps(noted))
    for entry in cache.Cache(str(tmp_path)).entries():
        os.unlink(entry.path)  # a file gone from the cache: the store is asked
    with pytest.raises(ws.errors.NotFoundError):
        ws.open_checkpoint(f"s3://{b}/ttl", config=config)
