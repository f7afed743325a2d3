"""Write a sample sharded checkpoint shaped like a decoder-only transformer (random weights).

``python -m weightstream.tools.sample OUT_DIR --size-gib 1`` writes ``OUT_DIR/model-0000i-of-0000n.safetensors``
and ``model.safetensors.index.json``: BF16 projection and embedding matrices, F32 norms, the way
Hugging Face checkpoints are laid out. Used by ``make demo`` and the benchmarks; written here (a
few lines of format) so the demo needs nothing beyond weightstream's own dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import torch

__all__ = ["transformer_layout", "write_checkpoint", "write_safetensors"]

_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def transformer_layout(
    total_bytes: int, *, hidden: int = 2048, vocab: int = 32000
) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """Tensor names, shapes and dtypes adding up to about ``total_bytes``."""
    inter = hidden * 11 // 4
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter) + 2 * 4 * hidden
    embed = 2 * vocab * hidden
    layers = max(1, (total_bytes - 2 * embed) // per_layer)
    yield "model.embed_tokens.weight", (vocab, hidden), torch.bfloat16
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,), torch.float32
        for proj in ("q", "k", "v", "o"):
            yield f"{p}self_attn.{proj}_proj.weight", (hidden, hidden), torch.bfloat16
        yield p + "post_attention_layernorm.weight", (hidden,), torch.float32
        yield p + "mlp.gate_proj.weight", (inter, hidden), torch.bfloat16
        yield p + "mlp.up_proj.weight", (inter, hidden), torch.bfloat16
        yield p + "mlp.down_proj.weight", (hidden, inter), torch.bfloat16
    yield "model.norm.weight", (hidden,), torch.float32
    yield "lm_head.weight", (vocab, hidden), torch.bfloat16


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` (contiguous CPU tensors) as one safetensors file, 8-byte aligned header."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for t in tensors.values():
            if t.numel():
                fh.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    os.replace(tmp, path)


def write_checkpoint(
    folder: str, *, total_bytes: int, shard_bytes: int = 512 << 20, seed: int = 0
) -> list[str]:
    """Write a sharded checkpoint of about ``total_bytes``; returns the shard paths."""
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape, dtype in transformer_layout(total_bytes):
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        # Random bytes, not random floats: as incompressible and 10x faster to make.
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        shards[-1][name] = data.view(dtype).view(shape)
        size += nbytes
    n = len(shards)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(os.path.join(folder, fname), shard, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        paths.append(os.path.join(folder, fname))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=2)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m weightstream.tools.sample", description=__doc__.splitlines()[0]
    )
    ap.add_argument("folder")
    ap.add_argument("--size-gib", type=float, default=1.0, help="approximate total size (default 1)")
    ap.add_argument("--shard-mib", type=int, default=512, help="largest shard (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths = write_checkpoint(
        args.folder,
        total_bytes=int(args.size_gib * (1 << 30)),
        shard_bytes=args.shard_mib << 20,
        seed=args.seed,
    )
    size = sum(os.path.getsize(p) for p in paths)
    print(f"wrote {len(paths)} shards, {size / 1e9:.2f} GB, to {args.folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
