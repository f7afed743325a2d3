#!/usr/bin/env python3
"""Local / network file system benchmark: weightstream against its peers and the raw limits.

Side by side in one run, repetitions interleaved (each method follows every other one equally
often), medians; ``--reps`` cold repetitions, ``--hot-reps`` hot ones:

* ``weightstream``        ``weightstream.load(folder)`` with no settings (every tensor kept)
* ``weightstream_stream`` ``weightstream.stream(folder, memory_limit=512MiB)``, tensors dropped
* ``runai_*``             the Run:ai streamer (``runai-model-streamer``): default, its buffered
                          strategies, concurrency 32. Its tensors are caller-owned by default
                          (``owned=True``), like ours, so no copies are added.
* ``safetensors``         ``safetensors.torch.load_file`` per shard, tensors materialised (cloned
                          out of its mmap, or they would be read lazily on first touch)
* ``raw_direct``          fio, sequential O_DIRECT, 16 MiB blocks, queue depth 32 (the device limit;
                          the best of the block sizes and depths we swept here)
* ``raw_cached``          fio, buffered reads of cached files by 2 jobs (the page-cache limit)
* ``memcpy``              torch copy bandwidth into faulted, fresh 4 KiB and fresh huge-page memory

Cold runs follow ``sync; echo 3 > /proc/sys/vm/drop_caches`` (needs root); hot runs follow a read
of every file. Each measurement is a fresh subprocess, so peak RSS is its own; the time excludes
interpreter start and imports. Nothing is written to the checkpoint (fio runs ``--readonly``).

    python bench/bench_local.py --size-gib 4 --reps 3 --hot-reps 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "bench" / "out" / "checkpoint"

METHODS = {
    "weightstream": {},
    "weightstream_stream": {},
    "runai_default": {},
    "runai_sync_buffered": {"RUNAI_STREAMER_FS_STRATEGY": "sync_buffered"},
    "runai_io_uring_buffered": {"RUNAI_STREAMER_FS_STRATEGY": "io_uring_buffered"},
    "runai_concurrency32": {"RUNAI_STREAMER_CONCURRENCY": "32"},
    "safetensors": {},
    "raw_direct": {},
    "raw_cached": {},
}
BEFORE = "weightstream_before"
"""With ``--before SRC``: ``load()`` from another source tree (a worktree of an earlier commit),
run as one more method, interleaved with the others: an A/B of a change, in one run."""
HOT_ONLY = {"raw_cached"}
COLD_ONLY = {"raw_direct"}


# ---------------------------------------------------------------------------------------------
# worker side: one measurement, printed as a RESULT line


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """Peak RSS (VmHWM) of this process."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


REPORTING = Path("/sys/module/page_reporting/parameters/page_reporting_order")


@contextlib.contextmanager
def backed_memory(nbytes: int) -> Iterator[str]:
    """Give every method the same start: free memory that the host already backs.

    This VM returns memory freed by the guest to the host (virtio-balloon free page reporting,
    about 2 s after the free), and the first touch of such memory costs a host fault: 0.5-3 GB/s
    here, slower than the disk. Left alone, a method's speed depends on whether the run before it
    freed memory seconds earlier (the Run:ai streamer's buffered mode measured 15.4 GB/s right
    after another run and 1.8 GB/s alone). Like drop_caches for the page cache, we set that state:
    reporting is paused for the benchmark (restored on exit, also on failure) and ``nbytes`` are
    touched once, so first touches cost what they cost on a bare-metal server.
    """
    if not REPORTING.exists() or os.geteuid() != 0:
        yield "as found (no page reporting control)"
        return
    old = REPORTING.read_text().strip()
    REPORTING.write_text("11\n")  # above the largest buddy order: nothing is ever reported
    try:
        mem = mmap.mmap(-1, nbytes)
        for off in range(0, nbytes, mmap.PAGESIZE):
            mem[off] = 1
        mem.close()
        yield f"host-backed (page reporting paused, {nbytes >> 30} GiB touched once)"
    finally:
        REPORTING.write_text(old + "\n")


def preload_weightstream(*, remote: bool = False) -> Any:
    """``import weightstream`` with everything a load uses, before the clock starts. The package
    resolves its engine (and torch, and the object-store client) on first use (PEP 562), so a
    bare ``import weightstream`` would put those imports inside the timed load; a serving process
    has them loaded already, and every peer's imports are made before the clock too."""
    import importlib

    import weightstream as ws

    _ = (ws.load, ws.stream, ws.open_checkpoint)
    if remote:
        importlib.import_module("obstore")
        importlib.import_module("weightstream.sources.object_store")
    return ws


def worker(method: str, folder: str) -> dict:
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    import torch

    n_bytes = 0
    if method.startswith("weightstream"):
        ws = preload_weightstream()
        base = _rss()
        t0, c0 = time.perf_counter(), time.process_time()
        if method in ("weightstream", BEFORE):
            tensors = ws.load(folder)
            n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        else:
            s = ws.stream(folder, config=ws.StreamConfig.from_env(memory_limit=512 << 20))
            for _name, t in s:
                n_bytes += t.numel() * t.element_size()
                del t
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    elif method.startswith("runai"):
        from runai_model_streamer import SafetensorsStreamer

        base = _rss()
        t0, c0 = time.perf_counter(), time.process_time()
        tensors = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for name, t in streamer.get_tensors():
                tensors[name] = t
        n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    elif method == "safetensors":
        from safetensors.torch import load_file

        base = _rss()
        t0, c0 = time.perf_counter(), time.process_time()
        tensors = {}
        for f in files:
            for name, t in load_file(f).items():
                tensors[name] = t.clone()
        n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    else:
        raise SystemExit(f"unknown method {method}")
    del torch
    return {
        "method": method,
        "seconds": dt,
        "cpu_s": cpu,  # every thread of the process, over the timed region
        "bytes": n_bytes,
        "peak_rss": _peak(),
        "base_rss": base,
    }


# ---------------------------------------------------------------------------------------------
# raw probes


def fio(files: list[str], *, direct: bool, jobs: int) -> dict:
    if not shutil.which("fio"):
        raise SystemExit("fio is not installed (apt-get install fio)")
    total = sum(os.path.getsize(f) for f in files)
    cmd = [
        "fio",
        "--readonly",
        "--name=raw",
        "--rw=read",
        f"--direct={int(direct)}",
        "--bs=16M" if direct else "--bs=4M",
        "--ioengine=libaio" if direct else "--ioengine=psync",
        "--iodepth=32" if direct else "--iodepth=1",
        f"--numjobs={jobs}",
        "--group_reporting",
        "--output-format=json",
        "--filename=" + ":".join(files),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]["read"]
    block = (16 if direct else 4) << 20
    whole = sum(os.path.getsize(f) // block * block for f in files)  # fio skips partial last blocks
    if job["io_bytes"] < whole * jobs:
        raise RuntimeError(
            f"fio read {job['io_bytes']} of {whole * jobs} bytes (file size {total}):\n{out.stdout[-2000:]}"
        )
    return {"seconds": job["runtime"] / 1000, "bytes": job["io_bytes"], "peak_rss": 0, "base_rss": 0}


def memcpy_bandwidth(nbytes: int = 1 << 30) -> dict:
    """GB/s of a 1-thread torch copy of ``nbytes`` into faulted / fresh 4 KiB / fresh THP memory."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from weightstream.memory.buffers import allocate

    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    out = {}
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)
    for name, make in (
        ("faulted", lambda: dst),
        ("fresh_4k", lambda: torch.empty(nbytes, dtype=torch.uint8)),
        ("fresh_thp", lambda: allocate(nbytes)[0]),
    ):
        best = 0.0
        for _ in range(3):
            d = make()
            t0 = time.perf_counter()
            d.copy_(src)
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            del d
        out[name] = round(best, 2)
    return out


# ---------------------------------------------------------------------------------------------
# driver


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def warm(files: list[str]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(bytearray(16 << 20)):
                pass


def run_one(method: str, folder: str, files: list[str]) -> dict:
    if method == "raw_direct":
        return {"method": method, **fio(files, direct=True, jobs=1)}
    if method == "raw_cached":
        return {"method": method, **fio(files, direct=False, jobs=2)}
    env = worker_env(METHODS.get(method, {}), _before_src if method == BEFORE else str(ROOT / "src"))
    return run_worker(__file__, [method, folder], env=env, timeout=1800)


def worker_env(settings: dict[str, str], src: str) -> dict[str, str]:
    """This environment without any loader's settings, plus ``settings``, importing weightstream
    from ``src`` (this tree, or the tree of an A/B's ``--before``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTSTREAM_", "RUNAI_STREAMER_"))}
    env.update(settings)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


_before_src = ""


def run_worker(script: str, args: list[str], *, env: dict[str, str], timeout: float) -> dict:
    """Run ``script --worker ARGS`` in a fresh interpreter and return its RESULT line."""
    out = subprocess.run(
        [sys.executable, script, "--worker", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{args[0]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "FOLDER"), help=argparse.SUPPRESS)
    ap.add_argument(
        "--dir",
        default=os.environ.get("WEIGHTSTREAM_BENCH_DIR", str(DEFAULT_DIR)),
        help="checkpoint folder (made if missing)",
    )
    ap.add_argument(
        "--size-gib", type=float, default=4.0, help="checkpoint size when it is generated (default 4)"
    )
    ap.add_argument("--reps", type=int, default=3, help="cold repetitions (default 3)")
    ap.add_argument(
        "--hot-reps",
        type=int,
        default=15,
        help="hot repetitions (default 15: a hot load takes 0.3 s, and this machine's memory speed "
        "swings between runs by more than the methods differ)",
    )
    ap.add_argument("--warmup", type=int, default=1, help="repetitions run first and not counted")
    ap.add_argument("--modes", default="cold,hot")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    ap.add_argument("--json-out", help="write every measurement here")
    ap.add_argument(
        "--memory-as-found", action="store_true", help="leave page reporting alone (see backed_memory)"
    )
    ap.add_argument(
        "--before",
        metavar="SRC",
        help=f"also run load() from this source tree as the method {BEFORE} (e.g. the src/ of a "
        "git worktree of an earlier commit): an interleaved A/B of a change",
    )
    args = ap.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(*args.worker)), flush=True)
        return 0

    folder = args.dir
    if not (Path(folder) / "model.safetensors.index.json").exists():
        sys.path.insert(0, str(ROOT / "src"))
        from weightstream.tools.sample import write_checkpoint

        print(f"writing a {args.size_gib} GiB checkpoint to {folder} ...", file=sys.stderr)
        write_checkpoint(folder, total_bytes=int(args.size_gib * (1 << 30)), shard_bytes=512 << 20)
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    size = sum(os.path.getsize(f) for f in files)
    modes = args.modes.split(",")
    if "cold" in modes and os.geteuid() != 0:
        print("not root: cannot drop caches, skipping cold runs", file=sys.stderr)
        modes.remove("cold")
    methods = args.methods.split(",")
    if args.before:
        global _before_src
        _before_src = str(Path(args.before).resolve())
        methods.append(BEFORE)

    results: list[dict] = []
    state = contextlib.nullcontext("as found") if args.memory_as_found else backed_memory(int(size * 2.5))
    with state as memory_state:
        print(f"memory: {memory_state}", file=sys.stderr)
        run_all(args, folder, files, modes, methods, results)
        mem = memcpy_bandwidth()
    report = summarize(results, size, mem, modes, methods)
    print(f"memory state: {memory_state}")
    print(report)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"size": size, "memcpy": mem, "memory": memory_state, "results": results}, indent=1)
        )
    return 0


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` methods in which each method comes right after every other one equally
    often (a Williams design: n orders for even n, 2n for odd). A plain rotation keeps the same
    neighbours in every repetition, so one method always runs after the same other one and
    inherits the memory state it leaves (safetensors frees 4.5 GiB of 4 KiB pages)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def rep_order(methods: list[str], rep: int) -> list[str]:
    """The methods in the order of repetition ``rep`` of a balanced design (warm-up repetitions,
    ``rep < 0``, take the first order)."""
    orders = balanced_orders(len(methods))
    return [methods[i] for i in orders[max(rep, 0) % len(orders)]]


def run_all(
    args: argparse.Namespace,
    folder: str,
    files: list[str],
    modes: list[str],
    methods: list[str],
    results: list[dict],
) -> None:
    reps = {"cold": args.reps, "hot": args.hot_reps}
    for rep in range(-args.warmup, max(reps[m] for m in modes)):
        # Warm-up repetitions (rep < 0) are run and thrown away: the first loads after the
        # benchmark sets the memory state measured up to 20x slower than the rest.
        order = rep_order(methods, rep)
        for mode in modes:
            if rep >= reps[mode]:
                continue
            for method in order:
                if (mode == "hot" and method in COLD_ONLY) or (mode == "cold" and method in HOT_ONLY):
                    continue
                if mode == "cold":
                    drop_caches()
                else:
                    warm(files)
                r = run_one(method, folder, files)
                r.update(mode=mode, rep=rep, gbps=r["bytes"] / r["seconds"] / 1e9)
                if rep >= 0:
                    results.append(r)
                print(
                    f"rep {rep} {mode:4} {method:24} {r['gbps']:6.2f} GB/s  peak RSS {r['peak_rss'] / 2**30:5.2f} GiB"
                    + ("  (warm-up, not counted)" if rep < 0 else ""),
                    file=sys.stderr,
                )


def summarize(results: list[dict], size: int, mem: dict, modes: list[str], methods: list[str]) -> str:
    med: dict[tuple[str, str], dict] = {}
    for mode in modes:
        for m in methods:
            rs = [r for r in results if r["mode"] == mode and r["method"] == m]
            if rs:
                med[mode, m] = {
                    "gbps": statistics.median(r["gbps"] for r in rs),
                    "all": [round(r["gbps"], 2) for r in rs],
                    "peak": statistics.median(r["peak_rss"] for r in rs),
                    "above": statistics.median(r["peak_rss"] - r["base_rss"] for r in rs),
                }
    counts = ", ".join(f"{mode} {len({r['rep'] for r in results if r['mode'] == mode})}" for mode in modes)
    lines = [f"checkpoint {size / 1e9:.2f} GB, repetitions: {counts}; medians", ""]
    lines.append("| mode | method | GB/s (median) | runs | peak RSS GiB | RSS above baseline GiB |")
    lines.append("|---|---|---:|---|---:|---:|")
    for (mode, m), v in med.items():
        lines.append(
            f"| {mode} | {m} | {v['gbps']:.2f} | {v['all']} | {v['peak'] / 2**30:.2f} | {v['above'] / 2**30:.2f} |"
        )
    lines.append("")
    lines.append(
        f"memcpy (1 thread, GB/s): into faulted memory {mem['faulted']}, fresh 4 KiB pages {mem['fresh_4k']}, fresh huge pages {mem['fresh_thp']}"
    )
    lines.append("")

    def g(mode: str, m: str) -> float | None:
        v = med.get((mode, m))
        return v["gbps"] if v else None

    def ratio(label: str, a: float | None, b: float | None, bar: float | None = None) -> None:
        if a and b:
            verdict = "" if bar is None else (" PASS" if a / b >= bar else " MISS") + f" (bar {bar:g})"
            lines.append(f"- {label}: {a / b:.2f}{verdict}")

    runai = [m for m in methods if m.startswith("runai")]
    for mode in modes:
        ours = g(mode, "weightstream")
        best_runai = max((g(mode, m) or 0 for m in runai), default=0) or None
        if mode == "cold":
            ratio("cold: weightstream / raw O_DIRECT (fio)", ours, g(mode, "raw_direct"), 0.9)
            ratio("cold: weightstream / best Run:ai", ours, best_runai, 1.0)
            ratio("cold: weightstream / safetensors", ours, g(mode, "safetensors"))
        else:
            ratio("hot: weightstream / best Run:ai", ours, best_runai, 1.0)
            ratio("hot: weightstream / Run:ai default", ours, g(mode, "runai_default"), 3.0)
            ratio("hot: weightstream / safetensors", ours, g(mode, "safetensors"), 3.0)
            ratio("hot: weightstream / page-cache read (fio, 2 jobs)", ours, g(mode, "raw_cached"))
        ratio(f"{mode}: weightstream / weightstream_before (A/B of a change)", ours, g(mode, BEFORE))
        v = med.get((mode, "weightstream"))
        if v:
            lines.append(f"- {mode}: load() peak RSS / checkpoint size: {v['peak'] / size:.3f} (bar 1.10)")
        v = med.get((mode, "weightstream_stream"))
        if v:
            lines.append(
                f"- {mode}: stream(memory_limit=512MiB) RSS above baseline: {v['above'] / 2**30:.2f} GiB (bar 1.00)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
