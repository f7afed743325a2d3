"""Differential tests against the safetensors library: whatever safetensors writes, weightstream
reads the same tensors; ``weightstream.safe_open`` answers as ``safetensors.safe_open`` does, and
its slices read only the rows they need."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open as st_open
from safetensors.torch import load_file, save_file, save_model

import weightstream as ws
from weightstream.errors import NotFoundError

from ..conftest import ALL_TORCH_DTYPES, as_bytes, random_tensor


def equal(g: torch.Tensor, w: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN payloads included; empty tensors by their shape)."""
    if (g.dtype, g.shape) != (w.dtype, w.shape):
        return False
    return g.numel() == 0 or torch.equal(as_bytes(_dense(g)), as_bytes(_dense(w)))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A copy with unit strides (a size-1 dimension may keep a stride that view() refuses)."""
    out = torch.empty(t.numel(), dtype=t.dtype)
    out.copy_(t.reshape(-1))
    return out


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert equal(got[name], w), name


def both(path: Path) -> None:
    """ws.load and ws.safe_open read exactly what safetensors reads."""
    want = load_file(str(path))
    same(ws.load(path), want)
    with ws.safe_open(path) as f, st_open(str(path), framework="pt") as g:
        assert f.keys() == g.keys()
        assert f.metadata() == g.metadata()
        for name in g.keys():  # noqa: SIM118 - safetensors' handle is not a dict
            same({name: f.get_tensor(name)}, {name: g.get_tensor(name)})
            assert f.get_slice(name).get_shape() == g.get_slice(name).get_shape()
            assert f.get_slice(name).get_dtype() == g.get_slice(name).get_dtype()
            try:
                theirs = g.get_slice(name)[...]
            except (
                RuntimeError
            ):  # safetensors 0.8 cannot slice F4 ("shape [3, 8] is invalid for input of size 12")
                assert g.get_slice(name).get_dtype() == "F4"
                theirs = g.get_tensor(name)
            same({name: f.get_slice(name)[...]}, {name: theirs})


CASES = {
    "every dtype": lambda: {
        f"t.{dt}".replace("torch.", ""): random_tensor((3, 4), dt, seed=i)
        for i, dt in enumerate(ALL_TORCH_DTYPES)
    },
    "scalars": lambda: {
        f"s.{dt}".replace("torch.", ""): random_tensor((), dt, seed=i)
        for i, dt in enumerate(ALL_TORCH_DTYPES)
        if dt != torch.float4_e2m1fn_x2
    },
    "empty and zero-sized": lambda: {
        "e0": torch.empty(0),
        "e1": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "e2": torch.empty(0, 5, dtype=torch.int64),
        "x": torch.ones(2),
    },
    "odd sizes": lambda: {
        "a": random_tensor((3,), torch.uint8),
        "b": random_tensor((5,), torch.float32, seed=1),
        "c": random_tensor((7, 3), torch.float16, seed=2),
    },
    "large": lambda: {
        "big": random_tensor((1 << 20,), torch.bfloat16),
        "small": random_tensor((9,), torch.int32),
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_safetensors_writes_reads_the_same(tmp_path: Path, case: str) -> None:
    path = tmp_path / "m.safetensors"
    save_file(CASES[case](), str(path))
    both(path)


def test_metadata_including_unicode(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(2)}, str(path), metadata={"format": "pt", "note": "ünïcødé ✓", "empty": ""})
    both(path)


def test_unaligned_offsets(tmp_path: Path) -> None:
    """A writer other than safetensors may place an f32 at an odd offset: still the same values."""
    header = {
        "u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "f": {"dtype": "F32", "shape": [2, 2], "data_offsets": [3, 19]},
        "d": {"dtype": "F64", "shape": [1], "data_offsets": [19, 27]},
    }
    raw = json.dumps(header).encode()
    data = bytes(range(3)) + struct.pack("<4f", 1.5, -2.0, 3.25, 4.0) + struct.pack("<d", 6.5)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    both(path)


def test_non_contiguous_tensors_saved_by_safetensors(tmp_path: Path) -> None:
    t = torch.arange(12.0).reshape(3, 4)
    path = tmp_path / "m.safetensors"
    save_file({"t": t.T.contiguous(), "sliced": t[:, 1:3].contiguous()}, str(path))
    both(path)
    with pytest.raises(ValueError, match="contiguous"):  # what safetensors refuses, nobody reads
        save_file({"t": t.T}, str(tmp_path / "x.safetensors"))


def test_shared_storage_saved_by_save_model(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

    path = tmp_path / "tied.safetensors"
    save_model(Tied(), str(path))
    both(path)


def test_an_unknown_name_is_not_found(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(2)}, str(path))
    with ws.safe_open(path) as f:
        with pytest.raises(NotFoundError, match="ghost"):
            f.get_tensor("ghost")
        with pytest.raises(NotFoundError, match="ghost"):
            f.get_slice("ghost")


# -- slices -----------------------------------------------------------------------------------------


def _index(draw: st.DrawFn, shape: tuple[int, ...]) -> Any:
    """Every kind of index torch (and so safetensors) takes: integers as ints, numpy integers and
    0-d tensors; slices; ``...`` (once or more); ``None``; booleans; lists, arrays and 1-d
    tensors of indices or masks."""
    items: list[Any] = []
    for size in shape:
        kind = draw(st.sampled_from(["int", "slice", "full", "np", "t0", "list", "mask", "tensor"]))
        if kind in ("int", "np", "t0"):
            k = draw(st.integers(-size - 2, size + 1))
            items.append(k if kind == "int" else np.int64(k) if kind == "np" else torch.tensor(k))
        elif kind == "slice":
            start = draw(st.one_of(st.none(), st.integers(-size - 3, size + 3)))
            stop = draw(st.one_of(st.none(), st.integers(-size - 3, size + 3)))
            step = draw(st.one_of(st.none(), st.integers(1, 3)))
            items.append(slice(start, stop, step))
        elif kind in ("list", "tensor"):
            picked = draw(st.lists(st.integers(-size - 1, size), min_size=0, max_size=4))
            items.append(picked if kind == "list" else torch.tensor(picked, dtype=torch.int64))
        elif kind == "mask":
            items.append(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
        else:
            items.append(slice(None))
    cut = draw(st.integers(0, len(items)))
    items = items[:cut]
    for _ in range(draw(st.integers(0, 2))):  # new axes and booleans anywhere
        items.insert(draw(st.integers(0, len(items))), draw(st.sampled_from([None, True, False])))
    for _ in range(draw(st.integers(0, 2))):  # one ellipsis, or two (torch takes both)
        items.insert(draw(st.integers(0, len(items))), Ellipsis)
    return tuple(items) if draw(st.booleans()) or len(items) != 1 or isinstance(items[0], list) else items[0]


@st.composite
def tensors_and_indices(draw: st.DrawFn) -> tuple[torch.Tensor, Any]:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]))
    return random_tensor(shape, dtype, seed=len(shape)), _index(draw, shape)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tensors_and_indices())
def test_slices_are_those_safetensors_gives(tmp_path: Path, case: tuple[torch.Tensor, Any]) -> None:
    tensor, index = case
    path = tmp_path / "s.safetensors"
    save_file({"t": tensor}, str(path))
    with st_open(str(path), framework="pt") as g:
        try:
            want = g.get_slice("t")[index]
        except Exception as exc:
            want = exc
    with ws.safe_open(path) as f:
        if isinstance(want, Exception):
            with pytest.raises((IndexError, ValueError, RuntimeError)):
                f.get_slice("t")[index]
            return
        got = f.get_slice("t")[index]
    assert equal(got, want), index
    assert got.numel() == 0 or got.untyped_storage().nbytes() == got.nbytes  # it owns exactly its bytes


def _bytes_read() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def test_a_slice_of_rows_reads_those_rows_only(tmp_path: Path) -> None:
    """What tensor-parallel loaders ask for: rank 3 of 8 of a 32 MiB weight reads its 4 MiB."""
    weight = random_tensor((4096, 4096), torch.bfloat16)
    path = tmp_path / "w.safetensors"
    save_file({"w": weight}, str(path))
    with ws.safe_open(path) as f:
        f.keys()
        before = _bytes_read()
        part = f.get_slice("w")[3 * 512 : 4 * 512]
        read = _bytes_read() - before
    assert equal(part, weight[1536:2048])
    assert 4 << 20 <= read < (4 << 20) + (64 << 10), read


def test_slices_from_an_object_store(s3: Any) -> None:
    from .conftest import bucket, put_checkpoint

    want = put_checkpoint(
        s3,
        bucket(s3, "slices"),
        "m",
        [{"w": random_tensor((64, 33), torch.float16)}, {"b": random_tensor((5,), torch.int64)}],
    )
    with ws.safe_open("s3://slices/m/") as f:
        assert f.keys() == ["b", "w"]
        assert equal(f.get_slice("w")[10:20, ::2], want["w"][10:20, ::2].contiguous())
        assert equal(f.get_tensor("b"), want["b"])
        assert f.metadata() is None


def _odd_file(path: Path, big: int) -> dict[str, torch.Tensor]:
    """A 3-byte tensor, then a large F64 at offset 3 (no 8-byte alignment), then a small F32 at
    an odd offset: the large one alone in its block (reads of 1 MiB), the small ones packed."""
    big_t = torch.arange(big, dtype=torch.float64) * 1.25
    small = torch.tensor([1.5, -2.0, 7.0], dtype=torch.float32)
    header = {
        "u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "big": {"dtype": "F64", "shape": [big], "data_offsets": [3, 3 + 8 * big]},
        "v": {"dtype": "U8", "shape": [1], "data_offsets": [3 + 8 * big, 4 + 8 * big]},
        "f": {"dtype": "F32", "shape": [3], "data_offsets": [4 + 8 * big, 16 + 8 * big]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-aligned: the offsets above decide the alignment
    data = bytes([1, 2, 3]) + big_t.numpy().tobytes() + bytes([9]) + small.numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return {
        "u": torch.tensor([1, 2, 3], dtype=torch.uint8),
        "big": big_t,
        "v": torch.tensor([9], dtype=torch.uint8),
        "f": small,
    }


@pytest.mark.parametrize("how", ["load", "stream", "direct-off"])
def test_an_unaligned_tensor_alone_in_its_block_is_not_held_twice(tmp_path: Path, how: str) -> None:
    """A tensor the file places off its dtype's alignment, alone in its block, is moved into
    alignment inside the block (never copied beside it: a 3 GiB tensor was 6.1 GiB resident);
    the packed small ones are copied out, and those copies count in the peak."""
    path = tmp_path / "odd.safetensors"
    want = _odd_file(path, big=2_000_000)  # 16 MB
    config = ws.StreamConfig(chunk_size=1 << 20, direct_io="off" if how == "direct-off" else "auto")
    with ws.open_checkpoint(path, config=config) as ck:
        if how == "stream":
            got = dict(ck.stream())
            stats = None
        else:
            got = ck.load()
            stats = ck.last_stats
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and torch.equal(g, w), name
        assert g.untyped_storage().nbytes() == g.nbytes, name  # a storage of exactly its bytes
        assert g.data_ptr() % g.element_size() == 0, name
    big_block = 8 * 2_000_000 + 8192
    if stats is not None:
        # every block of the load once (their allocations reach past the file's end to 4 KiB),
        # and the small copies: never the big one twice
        assert stats.bytes_read <= stats.peak_held_bytes <= stats.bytes_read + 3 * 4096 + 64
        assert stats.peak_held_bytes < 1.1 * big_block


def test_an_unaligned_large_tensor_is_resident_once(tmp_path: Path) -> None:
    """Measured in a fresh process (VmHWM: the peak of this process's own memory, reset by exec,
    unlike ru_maxrss): it grows by the tensor once, not twice."""
    import subprocess
    import sys

    path = tmp_path / "odd.safetensors"
    n = 32 << 20  # 256 MiB of F64
    _odd_file(path, big=n)
    code = (
        "import torch, weightstream as ws\n"
        "def hwm():\n"
        "    line = [x for x in open('/proc/self/status') if x.startswith('VmHWM')][0]\n"
        "    return int(line.split()[1]) * 1024\n"
        "before = hwm()\n"
        f"got = ws.load({str(path)!r})\n"
        f"assert got['big'][-1].item() == ({n} - 1) * 1.25\n"
        "print(hwm() - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grew = int(out.stdout.split()[-1])
    assert 8 * n * 0.9 < grew < 1.4 * 8 * n, grew  # the copy beside the block made it ~2x


def test_a_copy_made_while_handing_tensors_over_counts_in_the_peak(tmp_path: Path) -> None:
    """Packed with its neighbours in one block (reads of 64 MiB), the unaligned F64 cannot move
    without moving them: it is copied out, and peak_held_bytes says so (it did not)."""
    path = tmp_path / "odd.safetensors"
    want = _odd_file(path, big=2_000_000)
    with ws.open_checkpoint(path, config=ws.StreamConfig(chunk_size=64 << 20)) as ck:
        got = ck.load()
        stats = ck.last_stats
    assert stats is not None and all(torch.equal(got[k], w) for k, w in want.items())
    assert stats.peak_held_bytes >= stats.bytes_read + 8 * 2_000_000


def test_a_list_or_mask_of_rows_reads_the_rows_they_span(tmp_path: Path) -> None:
    weight = random_tensor((4096, 1024), torch.bfloat16)
    path = tmp_path / "w.safetensors"
    save_file({"w": weight}, str(path))
    rows = [1700, 1536, 2047, -2049]  # -2049 is row 2047
    mask = torch.zeros(4096, dtype=torch.bool)
    mask[1536:2048:7] = True
    with ws.safe_open(path) as f:
        f.keys()
        for index, want in (((rows,), weight[rows]), ((mask, None, ...), weight[mask, None, ...])):
            before = _bytes_read()
            got = f.get_slice("w")[index]
            read = _bytes_read() - before
            assert equal(got, want)
            assert 1 << 20 <= read < (1 << 20) + (64 << 10), read  # rows 1536-2047: 1 MiB
