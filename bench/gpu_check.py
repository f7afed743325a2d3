"""GPU delivery check: load a checkpoint onto a CUDA device from the page cache and from cold
files, verify every tensor bit for bit, and compare the speed with the pinned host-to-device
copy bandwidth measured in the same run.

    python bench/gpu_check.py                       # 6 GiB sample, 3 repetitions, cuda:0
    python bench/gpu_check.py --size-gib 4 --reps 2 --json-out gpu.json

Self-contained (generates its checkpoint), under 5 minutes on a GPU machine. Each load runs in a
fresh subprocess (its own CUDA context; peak host RSS is its own). Cold loads need root for
``drop_caches``; without it they are skipped and the report says so.
Bar (issue 5): page-cache load >= 80 % of the pinned host-to-device bandwidth.

``--device cpu`` runs the same steps without a GPU (no bandwidth bar): a check of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

GiB = 1 << 30


def child(args: argparse.Namespace) -> dict:
    import torch

    import weightstream as ws

    dev = torch.device(args.device)
    if args.what == "h2d":
        n = GiB
        host = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        host.fill_(7)
        out = torch.empty(n, dtype=torch.uint8, device=dev)
        out.copy_(host, non_blocking=True)  # warm-up
        _sync(dev)
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            out.copy_(host, non_blocking=True)
        _sync(dev)
        return {"gb_per_s": reps * n / (time.perf_counter() - t0) / 1e9}
    base_rss = _rss()
    config = ws.StreamConfig.from_env(memory_limit=args.memory_limit) if args.memory_limit else None
    t0 = time.perf_counter()
    if args.what == "stream":  # host memory bound: drop each tensor as it arrives
        s = ws.stream(args.dir, device=dev, config=config)
        nbytes = 0
        for _, t in s:
            nbytes += t.numel() * t.element_size()
            del t
        _sync(dev)
        seconds = time.perf_counter() - t0
        return {
            "gb_per_s": nbytes / seconds / 1e9,
            "seconds": seconds,
            "peak_rss_above_baseline_gib": (_peak() - base_rss) / GiB,
        }
    got = ws.load(args.dir, device=dev, config=config)
    _sync(dev)
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in got.values())
    out = {
        "gb_per_s": nbytes / seconds / 1e9,
        "seconds": seconds,
        "bytes": nbytes,
        "peak_rss_above_baseline_gib": (_peak() - base_rss) / GiB,
        "devices": sorted({str(t.device) for t in got.values()}),
    }
    if args.verify:
        from safetensors.torch import load_file

        bad, checked = [], 0
        for f in sorted(os.listdir(args.dir)):
            if f.endswith(".safetensors"):
                for name, want in load_file(os.path.join(args.dir, f)).items():
                    g = got[name]
                    same = g.dtype == want.dtype and g.shape == want.shape
                    same = same and torch.equal(_bytes(g.cpu()), _bytes(want))
                    checked += 1
                    if not same:
                        bad.append(name)
        out.update(verified=checked, mismatched=bad)
    return out


def _bytes(t):  # type: ignore[no-untyped-def]
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _sync(dev) -> None:  # type: ignore[no-untyped-def]
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(args: argparse.Namespace, what: str, *, verify: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", what, "--dir", args.dir, "--device", args.device]
    if verify:
        cmd.append("--verify")
    if what == "stream":
        cmd += ["--memory-limit", str(args.stream_memory_limit)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm(folder: str) -> None:
    for f in os.listdir(folder):
        with open(os.path.join(folder, f), "rb") as fh:
            while fh.read(64 << 20):
                pass


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/weightstream-gpu-check")
    ap.add_argument("--size-gib", type=float, default=6.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--stream-memory-limit", type=int, default=512 << 20)
    ap.add_argument("--json-out")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold loads (no drop_caches)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-limit", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.what = args.child
        print(json.dumps(child(args)))
        return 0

    from weightstream.tools.sample import write_checkpoint

    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        write_checkpoint(args.dir, total_bytes=int(args.size_gib * GiB))
    print(f"checkpoint: {args.dir} ({time.perf_counter() - t0:.0f} s to prepare)", flush=True)

    report: dict = {"device": args.device, "dir": args.dir, "runs": {}}
    report["runs"]["h2d"] = [run_child(args, "h2d")["gb_per_s"] for _ in range(2)]
    warm(args.dir)
    check = run_child(args, "load", verify=True)
    report["verify"] = {k: check[k] for k in ("verified", "mismatched", "devices")}
    print(
        f"verified {check['verified']} tensors on {check['devices']}: {len(check['mismatched'])} mismatched",
        flush=True,
    )
    hot, cold, stream = [], [], []
    can_drop = not args.no_cold
    for _ in range(args.reps):
        warm(args.dir)
        hot.append(run_child(args, "load"))
        warm(args.dir)
        stream.append(run_child(args, "stream"))
        if can_drop and drop_caches():
            cold.append(run_child(args, "load"))
        else:
            can_drop = False
    report["runs"].update(hot=hot, cold=cold, stream=stream)
    h2d = max(report["runs"]["h2d"])
    med = {
        k: statistics.median(r["gb_per_s"] for r in v)
        for k, v in (("hot", hot), ("cold", cold), ("stream", stream))
        if v
    }
    report["median_gb_per_s"] = med
    report["pinned_h2d_gb_per_s"] = h2d
    print(f"pinned host-to-device copy: {h2d:.2f} GB/s (best of {len(report['runs']['h2d'])})")
    for k, v in med.items():
        extra = ""
        if k == "stream":
            rss = max(r["peak_rss_above_baseline_gib"] for r in stream)
            extra = f", peak host RSS above baseline {rss:.2f} GiB (memory_limit {args.stream_memory_limit / GiB:.2f} GiB)"
        print(f"{k:6s}: {v:6.2f} GB/s = {v / h2d:.0%} of pinned H2D{extra}")
    if not cold:
        print("cold: skipped" + (" (--no-cold)" if args.no_cold else " (drop_caches needs root)"))
    ok = not check["mismatched"] and (args.device == "cpu" or med["hot"] >= 0.8 * h2d)
    report["bar_met"] = ok
    print("bar (hot >= 80 % of pinned H2D, every tensor bit-exact):", "MET" if ok else "NOT MET")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
