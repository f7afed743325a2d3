"""Distributed loading benchmark: N ranks on this machine (gloo, CPU), cold cache, side by side.

    python bench/bench_distributed.py --dir /work/scratch/ck4 --world 2 --reps 3

Methods (each a fresh world of N processes, after ``drop_caches``):

* ``weightstream_each``   every rank loads the whole checkpoint itself (no distribution)
* ``weightstream_dist``   ``load(..., distributed=True)``: each rank reads 1/N, all-gather
* ``runai_dist``          the Run:ai streamer's distributed mode (``RUNAI_STREAMER_DIST=1``;
                          its default is NCCL only), ``owned=True``
* ``runai_each``          the Run:ai streamer per rank, default settings
* ``weightstream_dist_unchecked``  ``weightstream_dist`` with ``verify="off"``: what a
  check (``WEIGHTSTREAM_VERIFY``) costs
* ``weightstream_dist_before``  with ``--before SRC``: ``weightstream_dist`` from another source
                          tree, interleaved (an A/B of a change)

Per rank it records the seconds from a barrier to holding every tensor, the bytes the process
read from storage (``/proc/self/io`` ``read_bytes``: the block layer, not page-cache hits), its
CPU-seconds and peak RSS. The wall time of a method is its slowest rank. Ranks on one machine
share one disk and two cores, so this shows bytes per rank and the cost of the exchange.

Separate paths, the way a cluster has them (``--path-latency S --path-rate B/s``): each rank
reads through its own emulated network file system (``bench/nfsemu``, as in bench_nfs.py: a
fresh FUSE mount per rank and run, its own server, latency and capped link), so splitting the
reads halves what each link carries. The files behind the mounts stay in this machine's page
cache (the servers' cache); each run's mounts are fresh, so every rank starts cold. "read" is
then the bytes each rank's server sent.

    python bench/bench_distributed.py --dir bench/out/bucket/model --world 2 --reps 3 \
        --path-latency 0.020 --path-rate 300e6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_local import backed_memory

GiB = 1 << 30
METHODS = ["weightstream_each", "weightstream_dist", "runai_dist", "runai_each"]


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _cpu() -> float:
    """CPU-seconds of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _hwm() -> int:
    """Peak RSS of this process image (VmHWM; ``ru_maxrss`` would carry the parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_main(rank: int, world: int, method: str, folder: str, rdzv: str, out: str) -> None:
    if method.endswith("_before"):
        sys.path.insert(0, os.environ["WSBENCH_BEFORE_SRC"])
    if method.startswith("runai"):
        os.environ["RUNAI_STREAMER_DIST"] = "1" if method == "runai_dist" else "0"
    import torch
    import torch.distributed as dist

    if os.environ.get("WSBENCH_LOG"):  # the loaders' INFO lines (the split decision), timed
        logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(relativeCreated)6d ms %(message)s")
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    if method.startswith("weightstream"):
        import weightstream as ws

        _ = ws.load  # the engine and its imports before the clock (the package imports lazily)
    dist.barrier()
    io0 = _read_bytes()
    cpu0 = _cpu()
    if os.environ.get("WSBENCH_LOG"):
        logging.getLogger("bench").info("the clock starts")
    t0 = time.perf_counter()
    checked: dict[str, int] = {}
    if method.startswith("weightstream"):
        config = ws.StreamConfig.from_env()
        if method == "weightstream_dist_unchecked":
            config = config.replace(verify="off")
        ck = ws.open_checkpoint(folder, config=config)
        got = ck.load(distributed=method.startswith("weightstream_dist"))
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
        st = ck.last_stats  # what a manifest beside the index (verify="auto") had checked
        checked = {"checked_bytes": st.checked_bytes, "unchecked_bytes": st.unchecked_bytes}
    else:
        from runai_model_streamer import SafetensorsStreamer

        got = {}
        with SafetensorsStreamer() as s:
            s.stream_files(files, device="cpu", is_distributed=method == "runai_dist")
            for name, t in s.get_tensors():
                got[name] = t
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
    seconds = time.perf_counter() - t0
    cpu = _cpu() - cpu0
    read = _read_bytes() - io0
    dist.barrier()
    rec = {
        "rank": rank,
        "seconds": seconds,
        "bytes": nbytes,
        "storage_read_bytes": read,
        "cpu_s": cpu,
        "peak_rss_gib": _hwm() / GiB,
        "tensors": len(got),
        **checked,
    }
    del torch
    Path(out).write_text(json.dumps(rec))
    dist.destroy_process_group()


def run_method(
    method: str, folder: str, world: int, tmp: Path, path: Any = None, seed: int = 0
) -> list[dict]:
    """One world of ``world`` ranks; ``path``: a bench_nfs Profile each rank reads through, on
    its own fresh mount (else the local files, after ``drop_caches``)."""
    import torch.multiprocessing as mp

    for f in tmp.glob("*"):
        f.unlink()
    outs = [str(tmp / f"r{r}.json") for r in range(world)]
    with contextlib.ExitStack() as mounts:
        if path is None:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            folders, served = [folder] * world, []
        else:
            from bench_nfs import emulated_nfs

            got = [
                mounts.enter_context(emulated_nfs(Path(folder), path, seed=seed + r)) for r in range(world)
            ]
            folders, served = [str(m) for m, _ in got], [st for _, st in got]
        ctx = mp.start_processes(
            _entry,
            args=(world, method, folders, str(tmp / "rdzv"), outs),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 600
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise RuntimeError(f"{method}: world did not finish")
    ranks = [json.loads(Path(o).read_text()) for o in outs]
    for rec, st in zip(ranks, served, strict=False):  # what each rank's own server sent
        rec["storage_read_bytes"] = st["bytes"]
        rec["server_cpu_s"] = st["emulator_cpu_s"]
    return ranks


def _entry(rank: int, world: int, method: str, folders: list[str], rdzv: str, outs: list[str]) -> None:
    rank_main(rank, world, method, folders[rank], rdzv, outs[rank])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json-out")
    ap.add_argument("--before", metavar="SRC", help="also weightstream_dist from this source tree")
    ap.add_argument("--path-latency", type=float, help="each rank its own emulated path: seconds a request")
    ap.add_argument("--path-rate", type=float, default=300e6, help="... and its link's bytes/s")
    args = ap.parse_args()
    args.path = None
    if args.path_latency is not None:
        from bench_nfs import Profile, build_emulator

        build_emulator()
        args.path = Profile(
            "path", f"fixed:{args.path_latency}", args.path_rate,
            f"{args.path_latency * 1e3:.0f} ms, {args.path_rate / 1e6:.0f} MB/s a rank",
        )  # fmt: skip
        for f in Path(args.dir).glob("*"):  # the servers' cache: the files behind the mounts
            if f.is_file():
                f.read_bytes()
    methods = args.methods.split(",")
    if args.before:
        os.environ["WSBENCH_BEFORE_SRC"] = str(Path(args.before).resolve())
        methods.append("weightstream_dist_before")
    tmp = Path("/tmp/ws-bench-dist")
    tmp.mkdir(exist_ok=True)
    results: dict[str, list[list[dict]]] = {m: [] for m in methods}
    size = sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with backed_memory(min(int(size * args.world * 2.2), int(avail * 0.85))) as state:
        print(f"memory state: {state}", flush=True)
        run_all(args, methods, results, tmp)
    report(args, methods, results)
    return 0


def run_all(
    args: argparse.Namespace, methods: list[str], results: dict[str, list[list[dict]]], tmp: Path
) -> None:
    for rep in range(args.reps):
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for m in order:
            ranks = run_method(m, args.dir, args.world, tmp, args.path, seed=rep * args.world)
            results[m].append(ranks)
            wall = max(r["seconds"] for r in ranks)
            print(
                f"rep {rep} {m:18s} {wall:6.2f} s  {ranks[0]['bytes'] / wall / 1e9:5.2f} GB/s per rank  "
                f"storage read per rank GB: {[round(r['storage_read_bytes'] / 1e9, 2) for r in ranks]}"
                + (
                    f"  checked per rank GB: {[round(r['checked_bytes'] / 1e9, 2) for r in ranks]}"
                    if "checked_bytes" in ranks[0]
                    else ""
                ),
                flush=True,
            )


def report(args: argparse.Namespace, methods: list[str], results: dict[str, list[list[dict]]]) -> None:
    where = f"each rank its own path ({args.path.what})" if args.path else "cold cache"
    print(f"\nmedians over {args.reps} repetitions, world {args.world}, {where}")
    print(
        f"{'method':18s} {'wall s':>7s} {'GB/s/rank':>9s} {'read GB/rank':>13s} {'CPU s/rank':>10s} "
        f"{'peak RSS GiB':>12s}"
    )
    summary = {}
    for m in methods:
        walls = [max(r["seconds"] for r in ranks) for ranks in results[m]]
        med = statistics.median(walls)
        size = results[m][0][0]["bytes"]
        reads = [
            statistics.median(ranks[i]["storage_read_bytes"] for ranks in results[m])
            for i in range(args.world)
        ]
        rss = max(r["peak_rss_gib"] for ranks in results[m] for r in ranks)
        cpu = statistics.median(r["cpu_s"] for ranks in results[m] for r in ranks)
        summary[m] = {
            "wall_s": med,
            "gb_per_s_per_rank": size / med / 1e9,
            "read_gb_per_rank": [x / 1e9 for x in reads],
            "peak_rss_gib": rss,
            "cpu_s_per_rank": cpu,
            "walls": walls,
        }
        print(
            f"{m:18s} {med:7.2f} {size / med / 1e9:9.2f} {'/'.join(f'{x / 1e9:.2f}' for x in reads):>13s} "
            f"{cpu:10.2f} {rss:12.2f}"
        )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"world": args.world, "where": where, "summary": summary, "runs": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
