"""Loads onto a CUDA device, compared bit for bit on the host. Runs where a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream as ws

from ..conftest import ALL_TORCH_DTYPES, as_bytes, random_tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


def test_every_dtype_lands_on_the_gpu_bit_for_bit(tmp_path: Path) -> None:
    tensors = {f"t.{dt}": random_tensor((33, 17), dt, seed=i) for i, dt in enumerate(ALL_TORCH_DTYPES)}
    tensors["big"] = random_tensor((3_000_001,), torch.bfloat16)
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p))
    got = ws.load(p, device="cuda", config=ws.StreamConfig(chunk_size=1 << 20))
    for name, want in tensors.items():
        g = got[name]
        assert g.device.type == "cuda" and g.dtype == want.dtype and g.shape == want.shape
        assert torch.equal(as_bytes(g.cpu()), as_bytes(want)), name


def test_streamed_tensors_are_ready_on_the_current_stream(tmp_path: Path) -> None:
    """Copies run on a side stream; a tensor handed over must be usable on the caller's stream
    at once (no synchronize), and a small memory limit (a ring of few staging buffers) must not
    change a byte."""
    tensors = {f"w{i}": random_tensor((1000 + i, 257), torch.float32, seed=i) for i in range(12)}
    p = tmp_path / "m.safetensors"
    save_file(tensors, str(p))
    config = ws.StreamConfig(chunk_size=64 << 10, memory_limit=256 << 10)
    sums = {}
    for name, t in ws.stream(p, device="cuda", config=config):
        sums[name] = as_bytes(t).to(torch.int64).sum()  # queued on the current stream
    for name, want in tensors.items():
        assert int(sums[name]) == int(as_bytes(want).to(torch.int64).sum()), name
