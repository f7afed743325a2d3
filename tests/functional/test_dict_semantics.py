"""A loaded dict works wherever a dict from ``safetensors.torch.load_file`` works.

Blocks pack neighbouring tensors into one buffer; each tensor still owns a storage of exactly
its bytes. These tests do what users do with a state dict (save it, pickle it, copy it, send it
to another process, write it back as safetensors) on checkpoints that mix dtypes in one block,
and compare every byte with the safetensors library's own reading.
"""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import weightstream as ws
from weightstream.config import KiB

from ..conftest import ALL_TORCH_DTYPES, as_bytes, assert_same, random_tensor, reference_folder, write_sharded


def mixed_model(folder: Path, seed: int = 0) -> Path:
    """A small model as real ones are laid out: bf16 weights with f32 norms and an int64 buffer
    between them, every other dtype in small tensors, two shards with an index."""
    layers = {}
    for i in range(3):
        layers[f"l{i}.attn.weight"] = random_tensor((64, 64), torch.bfloat16, seed=seed + i)
        layers[f"l{i}.norm.weight"] = random_tensor((64,), torch.float32, seed=seed + 10 + i)
        layers[f"l{i}.position_ids"] = random_tensor((1, 17), torch.int64, seed=seed + 20 + i)
    others = {
        f"t.{dt}".replace("torch.", ""): random_tensor((5, 6), dt, seed=seed + 30 + j)
        for j, dt in enumerate(ALL_TORCH_DTYPES)
    }
    others["scalar"] = random_tensor((), torch.float16, seed=seed + 99)
    others["empty"] = torch.empty((0, 3), dtype=torch.bfloat16)
    write_sharded(folder, [layers, others])
    return folder


def want_of(folder: Path) -> dict[str, torch.Tensor]:
    return reference_folder(folder)


LOADS = {
    "load": lambda p: ws.load(p),
    "stream": lambda p: dict(
        ws.stream(p, config=ws.StreamConfig(chunk_size=16 * KiB, memory_limit=64 * KiB))
    ),
}


@pytest.fixture(params=sorted(LOADS))
def loaded(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    folder = mixed_model(tmp_path / "m")
    return LOADS[request.param](folder), want_of(folder)


def test_blocks_still_pack_small_tensors(tmp_path: Path) -> None:
    """Tensors of one block sit side by side in one buffer (one read, one allocation), though
    each has a storage of its own bytes."""
    folder = mixed_model(tmp_path / "m")
    ckpt = ws.open_checkpoint(folder)
    got = ckpt.load()
    names = [n for n in got if n.startswith("l0.")]
    a, b = got[names[0]], got[names[1]]
    entry_a, entry_b = ckpt.tensors[names[0]], ckpt.tensors[names[1]]
    assert b.data_ptr() - a.data_ptr() == entry_b.start - entry_a.start  # the file's layout, in memory
    assert ckpt.last_stats is not None and ckpt.last_stats.chunks == 2  # one read per shard
    for name, t in got.items():
        assert t.untyped_storage().nbytes() == t.nbytes, name
        assert t.storage_offset() == 0, name


def test_torch_save_and_load(loaded) -> None:  # type: ignore[no-untyped-def]
    got, want = loaded
    buf = io.BytesIO()
    torch.save(got, buf)  # refused before: "view the same data as different types"
    assert buf.tell() < sum(t.nbytes for t in want.values()) + 64 * KiB  # each tensor's bytes, once
    buf.seek(0)
    assert_same(torch.load(buf), want)


def test_torch_save_of_one_tensor_writes_its_bytes_only(loaded) -> None:  # type: ignore[no-untyped-def]
    got, _ = loaded
    buf = io.BytesIO()
    torch.save(got["l1.norm.weight"], buf)
    assert buf.tell() < 64 * 4 + 2048


def _pickles(t: torch.Tensor) -> bool:
    try:
        pickle.loads(pickle.dumps(t))
        return True
    except AttributeError:  # torch 2.13 cannot unpickle uint16-64 and float8/4 tensors, whoever made them
        return False


def test_pickle(loaded) -> None:  # type: ignore[no-untyped-def]
    got, want = loaded
    usable = {k for k, v in want.items() if _pickles(v)}
    assert {"l0.attn.weight", "l0.norm.weight", "l0.position_ids", "scalar"} <= usable
    assert_same(pickle.loads(pickle.dumps({k: got[k] for k in usable})), {k: want[k] for k in usable})


def test_deepcopy_is_independent(loaded) -> None:  # type: ignore[no-untyped-def]
    got, want = loaded
    copied = copy.deepcopy(got)
    assert_same(copied, want)
    got["l0.attn.weight"].zero_()
    assert torch.equal(as_bytes(copied["l0.attn.weight"]), as_bytes(want["l0.attn.weight"]))


def test_safetensors_save_file_round_trip(loaded, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    got, want = loaded
    out = tmp_path / "again.safetensors"
    save_file(got, str(out))
    assert_same(load_file(str(out)), want)
    assert_same(ws.load(out), want)


def test_writing_one_tensor_leaves_its_neighbours_alone(loaded) -> None:  # type: ignore[no-untyped-def]
    got, want = loaded
    got["l0.norm.weight"].fill_(0)
    for name, t in got.items():
        if name != "l0.norm.weight":
            assert torch.equal(as_bytes(t), as_bytes(want[name])), name


def _child(queue, results) -> None:  # type: ignore[no-untyped-def]
    tensors = queue.get()
    results.put({k: bytes(as_bytes(v).numpy()) for k, v in tensors.items()})


def test_torch_multiprocessing_queue(loaded) -> None:  # type: ignore[no-untyped-def]
    got, want = loaded
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, results))
    proc.start()
    try:
        queue.put(got)
        seen = results.get(timeout=120)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert seen == {k: bytes(as_bytes(v).numpy()) for k, v in want.items()}
    assert_same(got, want)  # moving into shared memory kept the values
