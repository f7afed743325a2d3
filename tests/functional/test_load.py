"""Loads compared bit for bit against the safetensors library's own reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import weightstream as ws
from weightstream.config import KiB, MiB
from weightstream.errors import ConfigError, NotFoundError

from ..conftest import (
    ALL_TORCH_DTYPES,
    as_bytes,
    assert_same,
    drop_from_page_cache,
    random_tensor,
    reference,
    write_raw,
    write_sharded,
)

SMALL = ws.StreamConfig(chunk_size=64 * KiB, concurrency=4, memory_limit=256 * KiB)


def o_direct_works(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """Every dtype, scalars, empty tensors, odd sizes, a tensor over the chunk size, metadata."""
    tensors = {}
    for i, dt in enumerate(ALL_TORCH_DTYPES):
        tensors[f"odd.{dt}"] = random_tensor((3, 7, 5), dt, seed=i)
        if dt != torch.float4_e2m1fn_x2:  # a scalar holds two F4 values: safetensors cannot write it
            tensors[f"scalar.{dt}"] = random_tensor((), dt, seed=100 + i)
        tensors[f"empty.{dt}"] = torch.empty((0, 4), dtype=dt)
    tensors["big"] = random_tensor((300_001,), torch.float32, seed=7)  # 1.2 MB > 64 KiB chunks
    tensors["bf16.matrix"] = random_tensor((513, 129), torch.bfloat16, seed=8)
    p = tmp_path / "mixed.safetensors"
    save_file(tensors, str(p), metadata={"format": "pt", "note": "ünïcode"})
    return p


@pytest.mark.parametrize(
    "config", [None, SMALL, ws.StreamConfig(chunk_size=4 * KiB, concurrency=1, memory_limit=4 * KiB)]
)
def test_every_dtype_bit_for_bit(mixed: Path, config: ws.StreamConfig | None) -> None:
    assert_same(ws.load(mixed, config=config), reference(mixed))


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_direct_io_modes_agree(mixed: Path, mode: str) -> None:
    config = SMALL.replace(direct_io=mode)
    if mode == "on" and not o_direct_works(mixed):
        with pytest.raises(ConfigError, match="O_DIRECT"):
            ws.load(mixed, config=config)
        return
    drop_from_page_cache(mixed)
    s = ws.stream(mixed, config=config)
    assert_same(dict(s), reference(mixed))
    if mode == "off":
        assert s.stats.direct_bytes == 0
    if mode == "on":
        assert s.stats.direct_bytes == s.stats.bytes_read


def test_auto_reads_cold_data_direct_and_hot_data_from_cache(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({f"w{i}": random_tensor((256 * KiB,), torch.uint8, seed=i) for i in range(8)}, str(p))
    if not o_direct_works(p):
        pytest.skip("this file system refuses O_DIRECT; the buffered path is covered elsewhere")
    want = reference(p)
    drop_from_page_cache(p)
    cold = ws.stream(p, config=SMALL)
    assert_same(dict(cold), want)
    assert cold.stats.direct_bytes > 0.9 * cold.stats.bytes_read  # not in cache: O_DIRECT
    with open(p, "rb") as fh:  # bring it into the page cache
        fh.read()
    hot = ws.stream(p, config=SMALL)
    assert_same(dict(hot), want)
    assert hot.stats.cached_bytes == hot.stats.bytes_read  # in cache: copied from it


def test_partly_cached_file(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({f"w{i}": random_tensor((100_003,), torch.float16, seed=i) for i in range(10)}, str(p))
    want = reference(p)
    size = p.stat().st_size
    drop_from_page_cache(p, size // 3, size // 3)
    s = ws.stream(p, config=SMALL)
    assert_same(dict(s), want)
    assert s.stats.complete


def test_sharded_folder_with_index(tmp_path: Path) -> None:
    shards = [
        {f"l{s}.w{i}": random_tensor((17, 33), torch.bfloat16, seed=s * 10 + i) for i in range(5)}
        for s in range(3)
    ]
    want = write_sharded(tmp_path / "ckpt", shards)
    assert_same(ws.load(tmp_path / "ckpt", config=SMALL), want)
    # the index file itself, and a file:// URI, name the same checkpoint
    assert_same(ws.load(tmp_path / "ckpt" / "model.safetensors.index.json"), want)
    assert_same(ws.load(f"file://{tmp_path / 'ckpt'}"), want)
    ckpt = ws.open_checkpoint(tmp_path / "ckpt")
    assert len(ckpt.files) == 3 and ckpt.total_bytes == sum(t.numel() * 2 for t in want.values())


def test_index_limits_the_tensors_loaded(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    want = write_sharded(folder, [{"a": torch.ones(3)}, {"b": torch.zeros(2)}])
    save_file({"stray": torch.ones(1)}, str(folder / "unrelated.safetensors"))
    assert_same(ws.load(folder), want)  # the index is the source of truth


def test_folder_without_index_and_list_of_files(tmp_path: Path) -> None:
    shards = [{"a": random_tensor((10,), torch.int32)}, {"b": random_tensor((4, 4), torch.float64)}]
    want = write_sharded(tmp_path / "ckpt", shards, index=False)
    assert_same(ws.load(tmp_path / "ckpt"), want)
    files = sorted(str(p) for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert_same(ws.load(files), want)


def test_many_small_tensors(tmp_path: Path) -> None:
    tensors = {f"t{i}": random_tensor((i % 7 + 1,), torch.float32, seed=i) for i in range(3000)}
    p = tmp_path / "many.safetensors"
    save_file(tensors, str(p))
    s = ws.stream(p)
    assert_same(dict(s), reference(p))
    assert s.stats.chunks <= 2  # coalesced into few reads, not one per tensor


def test_selecting_tensors(mixed: Path) -> None:
    names = ["big", "scalar.torch.bfloat16", "empty.torch.int8"]
    got = ws.load(mixed, tensors=names)
    want = reference(mixed)
    assert list(got) == names
    assert_same(got, {n: want[n] for n in names})
    with pytest.raises(NotFoundError, match="'nope'"):
        ws.load(mixed, tensors=["big", "nope"])


def test_misaligned_tensor_offsets(tmp_path: Path) -> None:
    """A writer that packs tensors without alignment: F32 data at an odd offset still loads."""
    a = bytes([1, 2, 3])
    b = torch.arange(5, dtype=torch.float32)
    c = torch.arange(3, dtype=torch.float64)
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [5], "data_offsets": [3, 23]},
        "c": {"dtype": "F64", "shape": [3], "data_offsets": [23, 47]},
    }
    p = write_raw(
        tmp_path / "packed.safetensors",
        header,
        a + as_bytes(b).numpy().tobytes() + as_bytes(c).numpy().tobytes(),
    )
    got = ws.load(p)
    assert got["a"].tolist() == [1, 2, 3]
    assert torch.equal(got["b"], b) and torch.equal(got["c"], c)


def test_streamed_tensors_belong_to_the_caller(tmp_path: Path) -> None:
    """Tensors kept from a stream are never overwritten by later reads (no clone() needed)."""
    tensors = {f"w{i}": random_tensor((64 * KiB,), torch.uint8, seed=i) for i in range(40)}
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p))
    kept = dict(
        ws.stream(p, config=ws.StreamConfig(chunk_size=64 * KiB, concurrency=3, memory_limit=128 * KiB))
    )
    assert_same(kept, tensors)


def test_memory_limit_bounds_unconsumed_bytes(tmp_path: Path) -> None:
    tensors = {f"w{i}": random_tensor((100 * KiB,), torch.uint8, seed=i) for i in range(50)}
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p))
    limit = 512 * KiB
    s = ws.stream(p, config=ws.StreamConfig(chunk_size=128 * KiB, concurrency=8, memory_limit=limit))
    for _name, t in s:
        del t
    assert s.stats.complete and s.stats.tensors == 50
    assert 0 < s.stats.peak_held_bytes <= limit


def test_tensor_larger_than_memory_limit_loads_alone(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"huge": random_tensor((3 * MiB,), torch.uint8), "small": torch.ones(3)}, str(p))
    s = ws.stream(p, config=ws.StreamConfig(chunk_size=64 * KiB, memory_limit=1 * MiB))
    assert_same(dict(s), reference(p))
    assert s.stats.peak_held_bytes >= 3 * MiB


def test_stream_is_lazy_and_closable(tmp_path: Path) -> None:
    tensors = {f"w{i}": random_tensor((64 * KiB,), torch.uint8, seed=i) for i in range(20)}
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p))
    with ws.stream(p, config=ws.StreamConfig(chunk_size=64 * KiB, memory_limit=64 * KiB)) as s:
        name, t = next(s)
        assert torch.equal(t, tensors[name])
    assert not s.stats.complete and s.stats.tensors == 1
    with pytest.raises(StopIteration):
        next(s)


def test_load_returns_checkpoint_order(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    tensors = {n: torch.ones(2) for n in ["z", "a", "m"]}
    save_file(tensors, str(p))
    assert list(ws.load(p)) == [t.name for t in ws.open_checkpoint(p).tensors.values()]


def test_device_argument(mixed: Path) -> None:
    got = ws.load(mixed, device=torch.device("cpu"), tensors=["big"])
    assert got["big"].device.type == "cpu"
    with pytest.raises(ConfigError, match="device"):
        ws.load(mixed, device="warp-drive")


@given(
    st.lists(
        st.tuples(st.sampled_from(ALL_TORCH_DTYPES), st.lists(st.integers(0, 40), max_size=3)),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([4 * KiB, 16 * KiB, 1 * MiB]),
    st.integers(1, 6),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_checkpoints_round_trip(tmp_path: Path, specs, chunk_size: int, concurrency: int) -> None:
    tensors = {
        f"t{i}": random_tensor(
            tuple(shape) or (1,) if dt == torch.float4_e2m1fn_x2 else tuple(shape), dt, seed=i
        )
        for i, (dt, shape) in enumerate(specs)
    }
    p = tmp_path / "r.safetensors"
    save_file(tensors, str(p))
    config = ws.StreamConfig(chunk_size=chunk_size, concurrency=concurrency, memory_limit=chunk_size)
    assert_same(ws.load(p, config=config), reference(p))


def test_hugging_face_cache_layout_with_symlinks(tmp_path: Path) -> None:
    """The hub cache keeps blobs under content hashes and links them from snapshots/<rev>/."""
    shards = [{"a": random_tensor((40,), torch.float16)}, {"b": random_tensor((3, 3), torch.int64)}]
    staging = tmp_path / "staging"
    want = write_sharded(staging, shards)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(staging.iterdir())):
        blob = blobs / f"{i:040x}"
        f.rename(blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    assert_same(ws.load(snap), want)


def test_dangling_shard_link_is_not_found(tmp_path: Path) -> None:
    want = write_sharded(tmp_path / "c", [{"a": torch.ones(2)}, {"b": torch.ones(2)}])
    assert want
    shard = sorted((tmp_path / "c").glob("*.safetensors"))[1]
    shard.unlink()
    shard.symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(NotFoundError, match=shard.name):
        ws.load(tmp_path / "c")


def _tmpfs_dir() -> Path | None:
    shm = Path("/dev/shm")
    try:
        with open("/proc/mounts") as fh:
            if any(line.split()[1] == "/dev/shm" and line.split()[2] == "tmpfs" for line in fh):
                return shm if os.access(shm, os.W_OK) else None
    except OSError:
        return None
    return None


def test_file_system_that_refuses_o_direct(tmp_path: Path) -> None:
    """tmpfs refuses O_DIRECT on some kernels and accepts it on others: auto must load either way,
    and 'on' must either read direct or say clearly that it cannot."""
    shm = _tmpfs_dir()
    if shm is None:
        pytest.skip("no writable tmpfs at /dev/shm on this machine")
    p = shm / f"ws-test-{os.getpid()}.safetensors"
    try:
        save_file({"w": random_tensor((100_000,), torch.bfloat16)}, str(p))
        want = reference(p)
        assert_same(ws.load(p), want)
        if o_direct_works(p):
            assert_same(ws.load(p, config=ws.StreamConfig(direct_io="on")), want)
        else:
            with pytest.raises(ConfigError, match="refuses O_DIRECT") as info:
                ws.load(p, config=ws.StreamConfig(direct_io="on"))
            assert str(p) in str(info.value)
    finally:
        p.unlink(missing_ok=True)


def test_many_shards_under_a_low_open_files_limit(tmp_path: Path) -> None:
    """80 shards need 160 descriptors; the soft limit is lowered to 64 (hard limit untouched)."""
    import subprocess
    import sys
    import textwrap

    shards = [{f"s{i}": torch.full((5,), i, dtype=torch.int32)} for i in range(80)]
    write_sharded(tmp_path / "c", shards)
    code = textwrap.dedent(
        f"""
        import resource, torch
        import weightstream as ws
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        got = ws.load({str(tmp_path / "c")!r})
        assert len(got) == 80 and all(int(got[f"s{{i}}"][0]) == i for i in range(80))
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_tensor_selection_from_a_one_shot_iterator(mixed: Path) -> None:
    """``tensors=`` may be a generator: it is consumed once, and load() still returns every tensor."""
    names = ["big", "scalar.torch.int8"]
    got = ws.load(mixed, tensors=(n for n in names))
    assert list(got) == names
    assert_same(got, {n: reference(mixed)[n] for n in names})


def test_info_logs_say_what_a_load_does_and_how_it_went(
    mixed: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At INFO (the CLI's ``-v``) a load says what it reads with which settings, and when it
    ends, how much it read, how, and how fast; a load stopped early says how far it got."""
    import logging

    caplog.set_level(logging.INFO, logger="weightstream")
    want = ws.load(mixed)
    lines = [r.getMessage() for r in caplog.records if r.name == "weightstream.pipeline"]
    assert len(lines) == 2, lines
    assert f"load() {len(want)} tensors" in lines[0] and "concurrency" in lines[0] and str(mixed) in lines[0]
    assert "complete after" in lines[1] and "GB/s" in lines[1] and " GB read (" in lines[1]
    caplog.clear()
    stream = ws.stream(mixed, config=SMALL)
    next(stream)
    stream.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "weightstream.pipeline"]
    assert "stream()" in lines[0] and f"1 of {len(want)} tensors" in lines[-1], lines
