"""What the manifest's check costs a consumer that borrows the page cache (vLLM's hot loads):
``stream(borrow_cached=True)``, each tensor copied into memory of the consumer's own (allocated
and touched once, before the clock), the checkpoint hot, in one process, the methods alternating
in the memory state ``bench_local.py`` sets. The manifest is written first and removed after.

    .venv/bin/python bench/bench_lent_check.py --dir bench/out/checkpoint --reps 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from ab_inprocess import manifest_for  # noqa: E402
from bench_local import backed_memory, warm  # noqa: E402

METHODS = {  # (verify, borrow_cached, checks kept)
    "lent, not checked": ("off", True, False),
    "lent, checked": ("auto", True, False),
    "lent, checked before": ("auto", True, True),
    "read, not checked": ("off", False, False),
}
"""``checked before``: the same files' checks kept from an earlier load (``checks_dir``), not
made again; ``checked`` keeps none (``checks_dir="off"``)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out" / "checkpoint"))
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    import torch

    import weightstream as ws

    files = sorted(str(p) for p in Path(args.dir).glob("*.safetensors"))
    size = sum(Path(f).stat().st_size for f in files)
    params: dict[str, torch.Tensor] = {}

    kept = tempfile.mkdtemp(prefix="checks-")

    def run(verify: str, borrow: bool, keep: bool) -> tuple[float, float, int, int]:
        config = ws.StreamConfig(verify=verify, checks_dir=kept if keep else "off")
        c0, t0 = time.process_time(), time.perf_counter()
        with ws.stream(args.dir, config=config, borrow_cached=borrow) as s:
            for name, t in s:
                if name not in params:
                    params[name] = torch.empty_like(t)
                params[name].copy_(t)
        return time.perf_counter() - t0, time.process_time() - c0, s.stats.mapped_bytes, s.stats.checked_bytes

    with manifest_for(args.dir, True), backed_memory(int(size * 2.5)) as how:
        warm(files)
        print(f"memory: {how}; the checkpoint in the page cache; {size / 1e9:.2f} GB")
        run("off", False, False)  # the consumer's memory, allocated and touched once
        run("auto", False, True)  # the checks kept
        got: dict[str, list[tuple[float, float, int, int]]] = {m: [] for m in METHODS}
        for i in range(args.reps):
            order = list(METHODS) if i % 2 == 0 else list(reversed(METHODS))
            for m in order:
                got[m].append(run(*METHODS[m]))
    base = statistics.median(t for t, *_ in got["lent, not checked"])
    for m, runs in got.items():
        wall = statistics.median(t for t, *_ in runs)
        cpu = statistics.median(c for _, c, *_ in runs)
        print(
            f"{m:20s} median {wall:.3f} s ({wall / base:.2f}x), CPU {cpu / (size / 1e9):.3f} s/GB, "
            f"lent {runs[-1][2] / 1e9:.2f} GB, checked {runs[-1][3] / 1e9:.2f} GB"
        )


if __name__ == "__main__":
    main()
