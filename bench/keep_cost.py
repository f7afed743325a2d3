"""What keeping a collective's tensors until the backend lets go costs a distributed load.

    python bench/keep_cost.py bench/out/bucket/model [--reps 3]

Two gloo ranks (forked) load the checkpoint with ``distributed=True``; each reports the load's
time, how many collectives handed tensors to ``weightstream.distributed.handed``, the time spent
in its ``keep()`` (the wait for the backend's thread to let go), and how many handles were
still held after the load.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch.distributed as dist

import weightstream as ws
from weightstream import distributed as wd


def rank(r: int, store: str, ckpt: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=2)
    spent, calls = 0.0, 0
    keep = wd.handed.keep

    def timed(*tensors: object) -> None:
        nonlocal spent, calls
        t0 = time.perf_counter()
        keep(*tensors)  # type: ignore[arg-type]
        spent += time.perf_counter() - t0
        calls += 1

    wd.handed.keep = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()  # after every import
    got = ws.load(ckpt, distributed=True, config=ws.StreamConfig(memory_limit=256 << 20))
    took = time.perf_counter() - t0
    print(
        f"rank {r}: load {took:.2f} s, {len(got)} tensors; keep() {calls} calls, "
        f"{spent * 1e3:.2f} ms in all ({spent / took:.3%} of the load); held after: {wd.handed.sweep()}",
        flush=True,
    )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for _ in range(args.reps):
        store = os.path.join(tempfile.mkdtemp(), "store")
        pids = []
        for r in range(2):
            pid = os.fork()
            if pid == 0:
                rank(r, store, args.ckpt)
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
