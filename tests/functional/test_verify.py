"""Checking the bytes read against the checkpoint's manifest (``verify``): local files, a real
S3-compatible server (moto), the node cache, ``stream()`` holding tensors until checked."""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest
import torch

import weightstream as ws
from weightstream.cli.main import main as cli
from weightstream.engine.host import starts_cached
from weightstream.engine.plan import Block, ReadPlan
from weightstream.engine.verify import Checked, Verifier
from weightstream.errors import FormatError
from weightstream.format.manifest import MANIFEST_NAME, FileDigest, dump_manifest
from weightstream.sources import file as file_module
from weightstream.sources.base import Resident
from weightstream.sources.file import FileSource
from weightstream.tools.manifest import digests

from ..conftest import assert_same, drop_from_page_cache, flip, random_tensor, write_sharded
from .conftest import bucket, put_checkpoint

PIECE = 64 << 10


def shards(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"s{s}.t{i}": random_tensor((1000 + 17 * i, 16), torch.float32, seed=seed + 10 * s + i)
            for i in range(6)
        }
        for s in range(2)
    ]


def with_manifest(folder: Path, *, piece: int = PIECE) -> dict[str, object]:
    """Write the folder's manifest (small pieces, so a test file has many) beside its index."""
    with ws.open_checkpoint(folder, config=ws.StreamConfig(verify="off")) as ck:
        found = digests(ck, piece_size=piece)
    (folder / MANIFEST_NAME).write_text(dump_manifest(found, piece_size=piece))
    return json.loads((folder / MANIFEST_NAME).read_text())


def tensor_offset(path: Path, name: str) -> tuple[int, int]:
    with ws.open_checkpoint(path, config=ws.StreamConfig(verify="off")) as ck:
        t = ck.tensors[name]
        return t.start, t.end


def test_a_load_checks_every_byte_against_the_manifest(tmp_path: Path) -> None:
    want = write_sharded(tmp_path, shards())
    assert cli(["manifest", str(tmp_path), "-o", str(tmp_path / MANIFEST_NAME)]) == 0
    doc = json.loads((tmp_path / MANIFEST_NAME).read_text())
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / MANIFEST_NAME).stat().st_mode & 0o777 == 0o666 & ~umask  # readable by a service
    files = sorted(tmp_path.glob("*.safetensors"))
    assert sorted(doc["files"]) == [f.name for f in files]
    for f in files:  # the whole file's CRC32C, as any tool computes it
        assert doc["files"][f.name]["crc32c"] == f"{crc32c.crc32c(f.read_bytes()):08x}"
    ck = ws.open_checkpoint(tmp_path)
    assert_same(ck.load(), want)
    assert ck.last_stats is not None
    assert ck.last_stats.checked_bytes == sum(f.stat().st_size for f in files)
    assert ck.last_stats.unchecked_bytes == 0
    stream = ws.stream(tmp_path)
    assert_same(dict(stream), want)
    assert stream.stats.checked_bytes == ck.last_stats.checked_bytes


@pytest.mark.parametrize("state", ["cached", "cold, O_DIRECT", "buffered only"])
def test_a_local_files_read_hands_its_bytes_over_in_file_order(tmp_path: Path, state: str) -> None:
    """What the stepwise check relies on: the runs handed over are the bytes filled, in file
    order, with nothing missed or repeated; a buffered read hands them over a step at a time
    (each while in the CPU's cache), an O_DIRECT read once, whole."""
    path = tmp_path / "f.bin"
    data = os.urandom(5 * file_module.STEP + 12345)
    path.write_bytes(data)
    direct = {"cached": "auto", "cold, O_DIRECT": "on", "buffered only": "off"}[state]
    try:
        src = FileSource(str(path), direct_io=direct)  # type: ignore[arg-type]
    except Exception:
        pytest.skip("this file system refuses O_DIRECT")
    with src:
        for offset, length in [
            (0, len(data) + 4096),
            (4096, 3 * file_module.STEP),
            (len(data) // 4096 * 4096, 8192),
        ]:
            if state == "cold, O_DIRECT":
                drop_from_page_cache(path)
            else:
                path.read_bytes()  # in the page cache
            buf = mmap.mmap(-1, length)  # page-aligned, as the engine's buffers are
            runs: list[tuple[int, bytes]] = []
            n, how = src.read_stepwise(memoryview(buf), offset=offset, landed=_keeping(runs))
            want = data[offset : offset + length]
            assert n == len(want) and bytes(buf[:n]) == want
            assert b"".join(r for _, r in runs) == want
            assert [o for o, _ in runs] == [
                offset + sum(len(r) for _, r in runs[:k]) for k in range(len(runs))
            ]
            if how == "direct":
                assert len(runs) == 1
            else:
                assert all(len(r) <= file_module.STEP for _, r in runs)
                assert len(runs) == -(-n // file_module.STEP)


def test_a_checked_source_still_says_what_the_page_cache_holds(tmp_path: Path) -> None:
    """The check's layer keeps the file's capability of saying what is cached: without it, a
    hot load with the check started as storage reads (the storage's depth in threads, 16, on 2
    CPUs), not one copy out of the page cache per CPU."""
    path = tmp_path / "f.bin"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    digest = FileDigest.whole_object("f.bin", len(data), "crc32c", crc32c.crc32c(data), "a test")
    with FileSource(str(path)) as src:
        checked = Checked(src, Verifier(src.uri, digest, b"", hold_max=1 << 30))
        plan = ReadPlan((Block(0, 0, 0, len(data), ()),), 256 << 10, len(data))
        path.read_bytes()
        assert isinstance(checked, Resident) and checked.cached(0, len(data)) is True
        assert starts_cached(plan, [checked], 4)
        drop_from_page_cache(path)
        assert checked.cached(0, len(data)) is False
        assert not starts_cached(plan, [checked], 4)


def _keeping(runs: list[tuple[int, bytes]]) -> Callable[[memoryview, int], None]:
    return lambda view, offset: runs.append((offset, bytes(view)))


def test_a_hot_local_load_checks_step_by_step_and_names_a_changed_byte(tmp_path: Path) -> None:
    """A hot load's reads are checked as they land, step by step (steps much smaller than the
    pieces and the reads here), and a byte changed in the page cache's copy is still found."""
    big = [
        {f"s{s}.t{i}": random_tensor((700 + 300 * i, 1024), torch.float32, seed=s * 10 + i) for i in range(3)}
        for s in range(2)
    ]  # 2.9 to 6.4 MiB a tensor
    want = write_sharded(tmp_path, big)
    with_manifest(tmp_path, piece=3 << 20)
    config = ws.StreamConfig(chunk_size=8 << 20, verify="on")
    ck = ws.open_checkpoint(tmp_path, config=config)
    assert_same(ck.load(), want)
    assert ck.last_stats is not None and ck.last_stats.unchecked_bytes == 0
    assert ck.last_stats.checked_bytes == sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    flip(victim, victim.stat().st_size - 100)
    with pytest.raises(FormatError) as info:
        ws.load(tmp_path, config=config)
    assert info.value.uri is not None and victim.name in info.value.uri


@pytest.mark.parametrize("where", ["header", "first tensor", "middle", "last byte"])
def test_a_changed_byte_fails_the_load_naming_the_shard_range_and_both_checksums(
    tmp_path: Path, where: str
) -> None:
    write_sharded(tmp_path, shards())
    doc = with_manifest(tmp_path)
    victim = tmp_path / "model-00002-of-00002.safetensors"
    size = victim.stat().st_size
    start, _ = tensor_offset(tmp_path, "s1.t0")
    if where == "header":  # a header that still parses: one tensor's dtype, F32 read as I32
        offset = victim.read_bytes().index(b'"F32"') + 1
        with open(victim, "r+b") as f:
            f.seek(offset)
            f.write(b"I")
    else:
        offset = {"first tensor": start + 5, "middle": size // 2, "last byte": size - 1}[where]
        flip(victim, offset)
    piece = offset // PIECE
    lo, hi = piece * PIECE, min(size, (piece + 1) * PIECE)
    want = doc["files"][victim.name]["pieces"][piece]  # type: ignore[index]
    got = f"{crc32c.crc32c(victim.read_bytes()[lo:hi]):08x}"
    for load in (lambda: ws.load(tmp_path), lambda: dict(ws.stream(tmp_path))):
        with pytest.raises(FormatError) as info:
            load()
        msg = str(info.value)
        assert str(victim) in msg and want in msg and got in msg, msg
        assert info.value.byte_range == (lo, hi)
    unchecked = ws.load(tmp_path, config=ws.StreamConfig(verify="off"))  # off: loads what is there
    assert_same({"s0.t0": unchecked["s0.t0"]}, {"s0.t0": shards()[0]["s0.t0"]})


def test_stream_hands_over_nothing_of_a_piece_that_fails(tmp_path: Path) -> None:
    """A stream holds each tensor until every piece it lies in is checked: when the check of a
    piece fails, no tensor lying in it has been handed over."""
    want = write_sharded(
        tmp_path, [{f"t{i:03d}": random_tensor((2000,), torch.float32, seed=i) for i in range(120)}]
    )
    with_manifest(tmp_path)
    path = next(tmp_path.glob("*.safetensors"))
    size = path.stat().st_size
    flip(path, size // 2)
    bad = (size // 2 // PIECE * PIECE, min(size, (size // 2 // PIECE + 1) * PIECE))
    got = {}
    config = ws.StreamConfig(memory_limit=256 << 10, chunk_size=32 << 10, concurrency=2, autotune=False)
    with pytest.raises(FormatError, match="checksum mismatch"):
        for name, tensor in ws.stream(tmp_path, config=config):
            got[name] = tensor.clone()
    with ws.open_checkpoint(tmp_path, config=ws.StreamConfig(verify="off")) as ck:
        spans = {n: (ck.tensors[n].start, ck.tensors[n].end) for n in got}
    assert got, "the tensors before the bad piece were handed over"
    assert all(e <= bad[0] or s >= bad[1] for s, e in spans.values()), (
        "a tensor of the bad piece was handed over"
    )
    assert_same(got, {n: want[n] for n in got})


def test_a_partial_load_checks_what_it_reads_whole_and_says_what_it_could_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    want = write_sharded(tmp_path, shards())
    with_manifest(tmp_path)
    for verify, level in (("auto", logging.INFO), ("on", logging.WARNING)):
        ck = ws.open_checkpoint(tmp_path, config=ws.StreamConfig(verify=verify, checks_dir="off"))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="weightstream"):
            assert_same(ck.load(tensors=["s1.t3"]), {"s1.t3": want["s1.t3"]})
        stats = ck.last_stats
        assert stats is not None and stats.unchecked_bytes > 0  # the tensor's first and last pieces
        said = [r for r in caplog.records if "not checked" in r.getMessage()]
        assert [r.levelno for r in said] == [level]
        assert (
            str(tmp_path) in said[0].getMessage()
            and f"{stats.unchecked_bytes / 1e9:.3f} GB" in said[0].getMessage()
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="weightstream"):
            ck.load()  # every piece read whole: nothing to say
        assert not [r for r in caplog.records if "not checked" in r.getMessage()]


def test_verify_on_needs_a_checksum_for_every_shard(tmp_path: Path) -> None:
    write_sharded(tmp_path, shards())
    with pytest.raises(FormatError, match="no checksum is known") as info:
        ws.load(tmp_path, config=ws.StreamConfig(verify="on"))
    assert "model-00001-of-00002.safetensors" in str(info.value)
    with_manifest(tmp_path)
    ws.load(tmp_path, config=ws.StreamConfig(verify="on"))


def test_a_manifest_elsewhere_and_a_wrong_or_broken_one(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    write_sharded(folder, shards())
    with_manifest(folder)
    elsewhere = tmp_path / "sums.json"
    (folder / MANIFEST_NAME).rename(elsewhere)
    ck = ws.open_checkpoint(folder, config=ws.StreamConfig(manifest=str(elsewhere)))
    ck.load()
    assert ck.last_stats is not None and ck.last_stats.checked_bytes > 0
    doc = json.loads(elsewhere.read_text())
    doc["files"]["model-00001-of-00002.safetensors"]["size"] += PIECE
    doc["files"]["model-00001-of-00002.safetensors"]["pieces"].append("00000000")
    elsewhere.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"gives \d+ bytes, the file has"):
        ws.open_checkpoint(folder, config=ws.StreamConfig(manifest=str(elsewhere)))
    for broken in (b"{", b"[]", json.dumps({**doc, "algorithm": "md5"}).encode()):
        elsewhere.write_bytes(broken)
        with pytest.raises(FormatError, match="not a weightstream manifest") as info:
            ws.open_checkpoint(folder, config=ws.StreamConfig(manifest=str(elsewhere)))
        assert str(elsewhere) in str(info.value)
    with pytest.raises(ws.errors.NotFoundError):
        ws.open_checkpoint(folder, config=ws.StreamConfig(manifest=str(tmp_path / "missing.json")))


def put_with_manifest(s3, b: str, prefix: str, parts: list[dict[str, torch.Tensor]], work: Path):  # type: ignore[no-untyped-def]
    """The checkpoint in the store, its manifest beside the index (made from a local copy)."""
    want = put_checkpoint(s3, b, prefix, parts)
    write_sharded(work, parts)
    with_manifest(work)
    s3.put_object(Bucket=b, Key=f"{prefix}/{MANIFEST_NAME}", Body=(work / MANIFEST_NAME).read_bytes())
    return want


def test_an_object_replaced_by_other_bytes_of_the_same_size_fails(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "verify-tests")
    parts = shards()
    want = put_with_manifest(s3, b, "v", parts, tmp_path / "local")
    ck = ws.open_checkpoint(f"s3://{b}/v")  # found in the prefix listing
    assert_same(ck.load(), want)
    assert ck.last_stats is not None and ck.last_stats.checked_bytes > 0
    other = {k: v.clone() for k, v in parts[1].items()}
    other["s1.t2"].view(torch.int32)[3, 3] ^= 1  # one bit changed: same layout, same size
    from safetensors.torch import save

    s3.put_object(Bucket=b, Key="v/model-00002-of-00002.safetensors", Body=save(other))
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        ws.load(f"s3://{b}/v")
    assert f"s3://{b}/v/model-00002-of-00002.safetensors" in str(info.value)


def test_the_cache_is_checked_with_the_same_checksums(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from weightstream import cache

    b = bucket(s3, "verify-tests")
    want = put_with_manifest(s3, b, "c", shards(), tmp_path / "local")
    config = ws.StreamConfig.from_env(cache_dir=str(tmp_path / "cache"))
    assert_same(ws.load(f"s3://{b}/c", config=config), want)
    cache.drain()
    entry = next(e for e in cache.Cache(str(tmp_path / "cache")).entries() if e.whole)
    flip(Path(entry.path), entry.size - 10)  # the disk, not the store, went bad
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        ws.load(f"s3://{b}/c", config=config)
    assert entry.uri is not None and entry.uri in str(info.value)
    # the bad entry is gone: the next load reads the store again, and fills it anew
    assert entry.uri not in {e.uri for e in cache.Cache(str(tmp_path / "cache")).entries() if e.whole}
    assert_same(ws.load(f"s3://{b}/c", config=config), want)
    cache.drain()
    assert entry.uri in {e.uri for e in cache.Cache(str(tmp_path / "cache")).entries() if e.whole}


def test_an_entry_of_an_object_without_a_checksum_is_checked_against_its_own(
    s3_endpoint: str, s3, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """An object the store keeps no checksum for (uploaded by an older SDK, or to a store that
    computes none) and no manifest names: its cache entry's CRC, made when it was filled, is
    checked when the entry is read, so a copy the disk damaged since is not served."""
    import boto3
    from botocore.config import Config

    from weightstream import cache

    plain = boto3.client(
        "s3", endpoint_url=s3_endpoint, region_name="us-east-1",
        config=Config(request_checksum_calculation="when_required"),
    )  # fmt: skip
    b = bucket(s3, "verify-tests")
    want = put_checkpoint(plain, b, "own", shards())
    config = ws.StreamConfig.from_env(cache_dir=str(tmp_path / "cache"))
    with ws.open_checkpoint(f"s3://{b}/own", config=config) as ck:
        assert all(s.digest is None for s in ck.shards)  # the store's bytes: nothing to check them by
        assert_same(ck.load(), want)
    cache.drain()
    with ws.open_checkpoint(f"s3://{b}/own", config=config) as ck:  # read from the entries
        assert all(s.digest is not None and "node cache" in s.digest.origin for s in ck.shards)
        assert_same(ck.load(), want)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == sum(s.size for s in ck.shards)
    with ws.open_checkpoint(f"s3://{b}/own", config=config.replace(verify="off")) as ck:
        assert all(s.digest is None for s in ck.shards)
    entry = next(e for e in cache.Cache(str(tmp_path / "cache")).entries() if e.whole)
    flip(Path(entry.path), entry.size - 10)  # the disk went bad
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        ws.load(f"s3://{b}/own", config=config)
    assert entry.uri is not None and entry.uri in str(info.value)
    assert entry.uri not in {e.uri for e in cache.Cache(str(tmp_path / "cache")).entries() if e.whole}
    assert_same(ws.load(f"s3://{b}/own", config=config), want)  # read from the store, filled anew
    with pytest.raises(FormatError, match="keeps no checksum"):  # 'on' asks for one published
        ws.open_checkpoint(f"s3://{b}/own", config=config.replace(verify="on"))


def test_bytes_from_the_store_that_fail_the_check_are_not_cached(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save

    from weightstream import cache

    b = bucket(s3, "verify-tests")
    parts = shards()
    put_with_manifest(s3, b, "bad", parts, tmp_path / "local")
    other = {k: v.clone() for k, v in parts[0].items()}
    other["s0.t5"].view(torch.int32)[-1, -1] ^= 1  # the last piece of the first shard
    s3.put_object(Bucket=b, Key="bad/model-00001-of-00002.safetensors", Body=save(other))
    config = ws.StreamConfig.from_env(cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FormatError, match="checksum mismatch"):
        ws.load(f"s3://{b}/bad", config=config)
    cache.drain()
    kept = cache.Cache(str(tmp_path / "cache")).entries()
    assert not any(e.uri and e.uri.endswith("model-00001-of-00002.safetensors") for e in kept), kept


@pytest.mark.parametrize("pieces", ["manifest", "whole file"])
def test_a_slice_is_checked_with_on_and_said_unchecked_with_auto(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pieces: str
) -> None:
    """``get_slice`` reads only some rows: with ``verify="on"`` the pieces they lie in (the whole
    file, for one checksum of the whole) are read and checked, so a changed byte next to the rows
    fails it, naming the piece; with ``auto`` the rows are read as they are, and the log says so."""
    want = write_sharded(tmp_path, shards())
    piece = PIECE if pieces == "manifest" else 1 << 30
    with_manifest(tmp_path, piece=piece)
    name, rows = "s1.t3", slice(10, 20)
    start, end = tensor_offset(tmp_path, name)
    row = (end - start) // want[name].shape[0]
    a, b = start + rows.start * row, start + rows.stop * row  # the bytes the slice reads
    path = tmp_path / "model-00002-of-00002.safetensors"
    size = path.stat().st_size
    first = a - a % piece
    last = min(size, first + piece)
    bad = a - 1 if first < a else b  # in the rows' piece, outside the rows (a tensor byte)
    assert not a <= bad < b and bad < last
    flip(path, bad)

    def sliced(verify: str) -> torch.Tensor:
        with ws.safe_open(tmp_path, config=ws.StreamConfig(verify=verify, checks_dir="off")) as f:
            first_read = f.get_slice(name)[rows]
            assert torch.equal(f.get_slice(name)[rows], first_read)
            return first_read

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="weightstream"):
        assert torch.equal(sliced("auto"), want[name][rows])
    said = [r.getMessage() for r in caplog.records if "slices are read unchecked" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0]
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        sliced("on")
    assert str(path) in str(info.value) and info.value.byte_range == (first, last)
    flip(path, bad)  # back as it was
    assert torch.equal(sliced("on"), want[name][rows])
