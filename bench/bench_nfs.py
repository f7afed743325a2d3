#!/usr/bin/env python3
"""Network-file-system benchmark: weightstream against fio's seed job and the Run:ai streamer, on
an emulated network file system.

The file system is ``bench/nfsemu.c`` (FUSE, built here with gcc and libfuse3): every read
request waits a latency drawn from the profile's distribution, then its bytes cross one link of
a capped rate that all requests share. The kernel's FUSE client plays the NFS client: it splits
reads into requests of at most 1 MiB (an NFS mount's rsize), sends read-ahead and direct I/O
concurrently, and caches pages (read-ahead 128 KiB, as on an NFS mount of a current kernel). The
files behind it are in this machine's page cache (the server's cache), so the link and the
latency are what a load waits for. Each run gets a fresh mount: nothing of the checkpoint is in
the client's cache when a run starts (cold, as on a node that has not read the model).

Profiles (latency per request, link):
  f20:  20 ms, 1 GB/s         f80: 80 ms, 0.8 GB/s         f188: 188 ms, 1 GB/s
  tail: the seed's fio percentiles (p50 126 ms, p90 305 ms, p99 1.8 s; p0 60 ms and p100 2 s
        assumed), 1 GB/s

Methods, side by side, repetitions interleaved, medians:
  weightstream    weightstream.load(mount) with no settings
  fio_seed        fio, the seed's job: O_DIRECT, 4 MiB reads, 2,048 in flight (libaio, one job a file)
  runai_default   the Run:ai streamer, defaults
  runai_seed      the Run:ai streamer with the seed's settings (4 MiB chunks, concurrency 140)

Each run reports GB/s, CPU-seconds per GB (the loader's process; the emulator's own CPU apart),
peak RSS, and what the emulator saw: requests, their sizes, the mean bytes in flight against
the latency-bandwidth product. Needs root, /dev/fuse, gcc, libfuse3-dev and fio (Debian:
``apt-get install fuse3 libfuse3-dev fio``).

    python bench/bench_nfs.py --profiles f20,f80,f188,tail --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_local import BEFORE, DEFAULT_DIR, backed_memory, rep_order, run_worker, worker_env  # noqa: E402

EMULATOR_SRC = ROOT / "bench" / "nfsemu.c"
EMULATOR = ROOT / "bench" / "out" / "nfsemu"
SEED_IN_FLIGHT = 2048
"""The seed's fio job: 2,048 reads of 4 MiB in flight."""


@dataclass(frozen=True)
class Profile:
    name: str
    latency: str  # nfsemu's --latency
    rate: float  # bytes/s of the shared link
    what: str

    @property
    def mean_latency(self) -> float:
        """The mean of the latency distribution (log-linear between the points, as nfsemu draws)."""
        if self.latency.startswith("fixed:"):
            return float(self.latency[6:])
        pts = [tuple(map(float, t[1:].split(":"))) for t in self.latency.split(",")]
        total = 0.0
        for (p0, v0), (p1, v1) in itertools.pairwise(pts):
            w = (p1 - p0) / 100
            total += w * (v1 - v0) / math.log(v1 / v0) if v1 != v0 else w * v0
        return total


PROFILES = {
    "f20": Profile("f20", "fixed:0.020", 1e9, "20 ms, 1 GB/s"),
    "f80": Profile("f80", "fixed:0.080", 0.8e9, "80 ms, 0.8 GB/s"),
    "f188": Profile("f188", "fixed:0.188", 1e9, "188 ms, 1 GB/s"),
    "tail": Profile(
        "tail",
        "p0:0.060,p50:0.126,p90:0.305,p99:1.8,p100:2.0",
        1e9,
        "seed percentiles (p50 126 ms, p99 1.8 s), 1 GB/s",
    ),
}
METHODS = {
    "weightstream": {},
    "fio_seed": {},
    "runai_default": {},
    "runai_seed": {"RUNAI_STREAMER_CHUNK_BYTESIZE": str(4 << 20), "RUNAI_STREAMER_CONCURRENCY": "140"},
}


def build_emulator() -> Path:
    if EMULATOR.exists() and EMULATOR.stat().st_mtime >= EMULATOR_SRC.stat().st_mtime:
        return EMULATOR
    if not shutil.which("gcc") or subprocess.run(["pkg-config", "--exists", "fuse3"]).returncode:
        raise SystemExit("needs gcc and libfuse3-dev (apt-get install gcc pkg-config fuse3 libfuse3-dev)")
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True, check=True
    ).stdout.split()
    EMULATOR.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-o", str(EMULATOR), str(EMULATOR_SRC), *flags, "-lpthread", "-lm"],
        check=True,
    )
    return EMULATOR


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def emulated_nfs(
    backing: Path, profile: Profile, *, seed: int, trace: Path | None = None
) -> Iterator[tuple[Path, dict]]:
    """A fresh mount of ``backing`` behind ``profile``; yields (mountpoint, stats), where stats is
    filled with the emulator's counters and CPU-seconds when the block ends. ``trace``: the
    emulator writes each request of the block there (nfsemu's ``--trace``)."""
    mnt = Path(tempfile.mkdtemp(prefix="wsnfs-"))
    stats_file = mnt.with_suffix(".stats")
    cmd = [str(EMULATOR), str(backing), str(mnt), "--latency", profile.latency, "--rate", str(profile.rate)]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    proc = subprocess.Popen([*cmd, "--seed", str(seed), "--stats", str(stats_file)])
    stats: dict = {}
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nfsemu did not mount {mnt} (exit {proc.poll()})")
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGUSR1)  # counters from here
        cpu0 = _cpu_of(proc.pid)
        if trace is not None:  # the mount's own requests are not the run's
            time.sleep(0.05)
            trace.unlink(missing_ok=True)
        yield mnt, stats
        os.kill(proc.pid, signal.SIGUSR1)
        stats["emulator_cpu_s"] = _cpu_of(proc.pid) - cpu0
        for _ in range(200):
            lines = stats_file.read_text().splitlines() if stats_file.exists() else []
            if len(lines) >= 2:
                stats.update(json.loads(lines[-1]))
                break
            time.sleep(0.01)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            mnt.rmdir()
        stats_file.unlink(missing_ok=True)


def fio_seed(files: list[str]) -> dict:
    depth = max(1, math.ceil(SEED_IN_FLIGHT / len(files)))
    cmd = ["fio", "--readonly", "--rw=read", "--bs=4M", "--direct=1", "--ioengine=libaio"]
    cmd += [f"--iodepth={depth}", "--group_reporting", "--output-format=json"]
    for i, f in enumerate(files):
        cmd += [f"--name=f{i}", f"--filename={f}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    seconds = job["read"]["runtime"] / 1000
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    return {"seconds": seconds, "bytes": job["read"]["io_bytes"], "cpu_s": cpu, "peak_rss": 0, "base_rss": 0}


def run_one(method: str, mount: Path) -> dict:
    files = sorted(str(p) for p in mount.glob("*.safetensors"))
    if method == "fio_seed":
        return {"method": method, **fio_seed(files)}
    env = worker_env(METHODS.get(method, {}), _before_src if method == BEFORE else str(ROOT / "src"))
    # bench_local's worker runs each loader (BEFORE is its name for the --before tree too)
    return run_worker(str(ROOT / "bench" / "bench_local.py"), [method, str(mount)], env=env, timeout=1800)


_before_src = ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="checkpoint folder (made if missing)")
    ap.add_argument("--size-gib", type=float, default=4.0, help="checkpoint size when it is made")
    ap.add_argument("--profiles", default="f20,f80,f188,tail")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before", metavar="SRC", help=f"also run weightstream from this tree as {BEFORE}")
    ap.add_argument("--json-out")
    ap.add_argument(
        "--trace",
        metavar="DIR",
        help="write each run's requests to DIR/PROFILE-REP-METHOD.txt (arrived, ready, answered "
        "in seconds since the mount was ready; inode, offset, size)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (FUSE mounts, the memory state)")
    if not shutil.which("fio"):
        raise SystemExit("fio is not installed (apt-get install fio)")
    build_emulator()
    data = Path(args.dir).resolve()
    if not (data / "model.safetensors.index.json").exists():
        sys.path.insert(0, str(ROOT / "src"))
        from weightstream.tools.sample import write_checkpoint

        print(f"writing a {args.size_gib} GiB checkpoint to {data} ...", file=sys.stderr)
        write_checkpoint(str(data), total_bytes=int(args.size_gib * (1 << 30)), shard_bytes=512 << 20)
    files = sorted(data.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    methods = args.methods.split(",")
    if args.before:
        global _before_src
        _before_src = str(Path(args.before).resolve())
        methods.append(BEFORE)
    results: list[dict] = []
    with backed_memory(int(size * 2.5)) as memory_state:
        print(f"memory: {memory_state}; checkpoint {size / 1e9:.2f} GB", file=sys.stderr)
        for f in files:  # the server's cache: the link and the latency are what a load waits for
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass
        for pname in args.profiles.split(","):
            p = PROFILES[pname]
            print(f"({pname}) {p.what}; mean latency {p.mean_latency * 1e3:.0f} ms", file=sys.stderr)
            with emulated_nfs(data, p, seed=999) as (mnt, _):
                run_one("weightstream", mnt)  # untimed: the first load after set-up runs slow
            for rep in range(args.reps):
                for m in rep_order(methods, rep):
                    trace = Path(args.trace) / f"{pname}-{rep}-{m}.txt" if args.trace else None
                    if trace is not None:
                        trace.parent.mkdir(parents=True, exist_ok=True)
                    with emulated_nfs(data, p, seed=rep, trace=trace) as (mnt, stats):
                        r = run_one(m, mnt)
                    r.update(profile=pname, rep=rep, gbps=r["bytes"] / r["seconds"] / 1e9, emulator=stats)
                    results.append(r)
                    print(
                        f"  rep {rep} {m:20} {r['gbps']:6.3f} GB/s  cpu {r['cpu_s'] / (r['bytes'] / 1e9):.2f} s/GB"
                        f"  in flight {stats.get('mean_bytes_in_flight', 0) / 1e6:7.1f} MB"
                        f" (mean of {stats.get('mean_in_flight', 0):.0f} requests)",
                        file=sys.stderr,
                    )
    print(summarize(results, size, methods, args.profiles.split(",")))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"size": size, "results": results}, indent=1))
    return 0


def summarize(results: list[dict], size: int, methods: list[str], profiles: list[str]) -> str:
    def med(pname: str, m: str, key: str = "gbps") -> float | None:
        rs = [r for r in results if r["profile"] == pname and r["method"] == m]
        if not rs:
            return None
        if key == "cpu_per_gb":
            return statistics.median(r["cpu_s"] / (r["bytes"] / 1e9) for r in rs)
        if key == "in_flight":
            return statistics.median(r["emulator"].get("mean_bytes_in_flight", 0) for r in rs)
        return statistics.median(r[key] for r in rs)

    reps = {p: len({r["rep"] for r in results if r["profile"] == p}) for p in profiles}
    out = [f"checkpoint {size / 1e9:.2f} GB; medians of {reps} repetitions; GB/s (ratio to the link)", ""]
    out.append(
        "| profile | "
        + " | ".join(methods)
        + " | ours / fio seed | ours / Run:ai default | ours / Run:ai seed |"
    )
    out.append("|---|" + "---:|" * (len(methods) + 3))
    for pname in profiles:
        p = PROFILES[pname]
        link = p.rate / 1e9
        cells = []
        for m in methods:
            v = med(pname, m)
            cells.append(f"{v:.3f} ({v / link:.2f})" if v else "–")
        ours = med(pname, "weightstream")

        def ratio(other: str, ours: float | None = ours, pname: str = pname) -> str:
            v = med(pname, other)
            return f"{ours / v:.2f}" if ours and v else "–"

        out.append(
            f"| {p.what} | "
            + " | ".join(cells)
            + f" | {ratio('fio_seed')} | {ratio('runai_default')} | {ratio('runai_seed')} |"
        )
    out += ["", "CPU-seconds per GB (the loader's process), and mean MB in flight at the emulator:", ""]
    out.append("| profile | " + " | ".join(methods) + " | latency x link (MB) |")
    out.append("|---|" + "---:|" * (len(methods) + 1))
    for pname in profiles:
        p = PROFILES[pname]
        cells = []
        for m in methods:
            c, f = med(pname, m, "cpu_per_gb"), med(pname, m, "in_flight")
            cells.append(f"{c:.2f} s/GB, {f / 1e6:.0f} MB" if c is not None and f is not None else "–")
        out.append(f"| {p.what} | " + " | ".join(cells) + f" | {p.mean_latency * p.rate / 1e6:.0f} |")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
