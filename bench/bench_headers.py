"""Opening a checkpoint with a very large header: ``weightstream.safe_open`` against safetensors'.

    python bench/bench_headers.py --entries 120000 --rounds 5

Mixture-of-experts checkpoints name a tensor per expert per layer; one file's header can reach
tens of MB (120,000 entries is about 13 MB). Each round opens the file and lists its names with
``safetensors.safe_open(path, "pt").keys()`` and with ``weightstream.safe_open(path).keys()`` (and
``weightstream.open_checkpoint``), interleaved, the file in the page cache (a header is read once
per open; what is measured is the parse and validation). Every import happens before the clock.
Reported: median seconds and CPU seconds per method, and ours / safetensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def write(path: Path, entries: int) -> int:
    import torch
    from safetensors.torch import save_file

    tensors = {
        f"model.layers.{i // 256}.mlp.experts.{i % 256}.down_proj.weight": torch.zeros(
            1, dtype=torch.bfloat16
        )
        for i in range(entries)
    }
    save_file(tensors, str(path))
    return int.from_bytes(path.read_bytes()[:8], "little")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=120_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from safetensors import safe_open as st_open

    import weightstream as ws
    import weightstream._safe_open

    def safetensors_keys(p: str) -> int:
        with st_open(p, framework="pt") as f:
            return len(f.keys())

    def ours_keys(p: str) -> int:
        with ws.safe_open(p) as f:
            return len(f.keys())

    def ours_checkpoint(p: str) -> int:
        with ws.open_checkpoint(p) as c:
            return len(c.tensors)

    methods = {
        "safetensors": safetensors_keys,
        "weightstream.safe_open": ours_keys,
        "open_checkpoint": ours_checkpoint,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "experts.safetensors"
        header = write(path, args.entries)
        wall: dict[str, list[float]] = {m: [] for m in methods}
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                t0, c0 = time.perf_counter(), time.process_time()
                n = fn(str(path))
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                assert n == args.entries, (name, n)
    base = statistics.median(wall["safetensors"])
    out = {
        "entries": args.entries,
        "header_bytes": header,
        "methods": {
            m: {
                "median_s": round(statistics.median(wall[m]), 4),
                "cpu_s": round(statistics.median(cpu[m]), 4),
                "ours_over_safetensors": round(statistics.median(wall[m]) / base, 2),
            }
            for m in methods
        },
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
