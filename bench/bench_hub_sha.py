#!/usr/bin/env python3
"""What checking the Hugging Face Hub's SHA-256 costs a hot local load (``verify="on"``).

Lays a checkpoint folder out as a ``--local-dir`` download (hard links to its files, and the
``.cache/huggingface/download/*.metadata`` the Hub's client writes, with each file's SHA-256),
then loads it hot, ``verify="off"`` and ``"on"`` alternating in one process, and prints each
one's median and best time and CPU-seconds per GB. The clock starts after every import.

    python bench/bench_hub_sha.py --model bench/out/bucket/model --pairs 4
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time


def lay_out(src: str, dst: str) -> None:
    if os.path.exists(dst):
        return
    meta = os.path.join(dst, ".cache", "huggingface", "download")
    os.makedirs(meta)
    for name in sorted(os.listdir(src)):
        if not os.path.isfile(os.path.join(src, name)):
            continue
        os.link(os.path.join(src, name), os.path.join(dst, name))
        if name.endswith(".safetensors"):
            h = hashlib.sha256()
            with open(os.path.join(src, name), "rb") as f:
                while block := f.read(64 << 20):
                    h.update(block)
            with open(os.path.join(meta, name + ".metadata"), "w") as f:
                f.write(f"{'0' * 40}\n{h.hexdigest()}\n0\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench/out/bucket/model")
    ap.add_argument(
        "--out", default="bench/out/hub-local-dir", help="where the layout is made (same file system)"
    )
    ap.add_argument("--pairs", type=int, default=4)
    args = ap.parse_args()
    lay_out(args.model, args.out)
    import weightstream as ws

    size = sum(
        os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out) if n.endswith(".safetensors")
    )
    ws.load(args.out)  # hot: the page cache holds every file
    runs: dict[str, list[tuple[float, float, int]]] = {"off": [], "on": []}
    for _ in range(args.pairs):
        for mode in runs:
            cpu, start = time.process_time(), time.perf_counter()
            with ws.open_checkpoint(args.out, config=ws.StreamConfig(verify=mode)) as ck:
                state = ck.load()
                checked = ck.last_stats.checked_bytes if ck.last_stats else 0
            runs[mode].append((time.perf_counter() - start, time.process_time() - cpu, checked))
            del state
    print(f"{size / 1e9:.2f} GB, hot, {args.pairs} alternating pairs")
    print("| verify | median s | best s | CPU-s / GB | checked bytes |\n|---|---:|---:|---:|---:|")
    for mode, r in runs.items():
        print(
            f"| {mode} | {statistics.median(x[0] for x in r):.3f} | {min(x[0] for x in r):.3f} | "
            f"{statistics.median(x[1] for x in r) / (size / 1e9):.2f} | {r[0][2]} |"
        )


if __name__ == "__main__":
    main()
