"""The online tuner against the best static setting, on three platforms (issue 4's bar).

For each platform, first ``weightstream tune`` sweeps reads in flight x read size and finds the
best static setting (writing a profile and a heat map under bench/out/). Then, interleaved over
repetitions, in fresh processes:

* ``weightstream``          no settings: the online tuner on (what a user gets)
* ``weightstream_best``     the profile ``tune`` wrote (static, tuner off)
* ``runai_default``         the Run:ai streamer 0.17.1 with its defaults
* ``runai_profile``         the Run:ai streamer with the settings ``weightstream recommend``
                            prints for a standard-class instance (the hand-written profiles
                            cloud teams deploy: concurrency 32, S3 timeouts)

Platforms:

* ``local``  the local disk, cold (page cache dropped before every run and every sweep point)
* ``d``      the emulated object store's profile (d): 30 ms first byte, 25 MB/s per connection
* ``c_bg``   profile (c): 50 ms first byte, 50 MB/s per connection, 1 Gbit/s link, and a
             competing download on the same link (4 curl connections) starting a third of the way
             into each load (and running through the whole ``tune`` sweep)

Needs root (drop_caches, network namespace), nginx with its Lua module, curl, and the bench extra.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_local  # noqa: E402
import bench_objstore  # noqa: E402
from bench_local import backed_memory, drop_caches, rep_order, run_worker  # noqa: E402
from bench_objstore import BUCKET, NS_IP, PREFIX, PROFILES, emulated_store  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
from weightstream.tools.recommend import recommend  # noqa: E402

OUT = ROOT / "bench" / "out"
METHODS = ["weightstream", "weightstream_best", "runai_default", "runai_profile"]
BEFORE = "weightstream_before"
"""With ``--before SRC``: the tuner on, no settings, from another source tree (an A/B of a change)."""
_before_src = ""


def runai_profile_env() -> dict[str, str]:
    """What `weightstream recommend` prints for a standard-class instance (no table entry)."""
    return dict(recommend(model_bytes=10**10).runai_env)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTSTREAM_", "RUNAI_STREAMER_"))}


def method_env(method: str, base: dict[str, str], profile: Path) -> dict[str, str]:
    env = dict(base)
    if method == "weightstream_best":
        env["WEIGHTSTREAM_PROFILE"] = str(profile)
    if method == "runai_profile":
        env.update(runai_profile_env())
    src = _before_src if method == BEFORE else str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def tune(uri: str, env: dict[str, str], name: str, extra: list[str], *, reuse: bool = False) -> dict:
    profile, png = OUT / f"tune-{name}.json", OUT / f"tune-{name}.png"
    if reuse and profile.exists():
        print(f"{name}: reusing the profile {profile} (no sweep)", file=sys.stderr)
        return json.loads(profile.read_text())
    cmd = [
        sys.executable,
        "-m",
        "weightstream.cli.main",
        "tune",
        uri,
        "-o",
        str(profile),
        "--heatmap",
        str(png),
    ]
    cmd += ["--no-progress", *extra]
    env = {**env, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"tune failed:\n{out.stdout}\n{out.stderr}")
    print(out.stdout, file=sys.stderr)
    return json.loads(profile.read_text())


@contextlib.contextmanager
def background(url: str, *, connections: int, after: float) -> Iterator[None]:
    """``connections`` curl downloads of ``url``, looping, starting ``after`` seconds from now."""
    stop = threading.Event()
    procs: list[subprocess.Popen[bytes]] = []

    def run() -> None:
        if stop.wait(after):
            return
        while not stop.is_set():
            procs[:] = [subprocess.Popen(["curl", "-s", "-o", "/dev/null", url]) for _ in range(connections)]
            for p in procs:
                while p.poll() is None and not stop.is_set():
                    time.sleep(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()
                p.wait(5)
        t.join(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local-dir", default=str(ROOT / "bench" / "out" / "ckpt"))
    ap.add_argument("--bucket", default=str(ROOT / "bench" / "out" / "bucket"))
    ap.add_argument("--platforms", default="local,d,c_bg")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json-out")
    ap.add_argument(
        "--reuse-profiles",
        action="store_true",
        help="use the profile an earlier `tune` wrote to bench/out/tune-PLATFORM.json, if there is one",
    )
    ap.add_argument(
        "--before",
        metavar="SRC",
        help=f"also run weightstream from this source tree as the method {BEFORE} (an A/B of a change)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (drop_caches, network namespace, tc)")
    OUT.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")
    if args.before:
        global _before_src
        _before_src = str(Path(args.before).resolve())
        methods.append(BEFORE)
    sweep = "weightstream_best" in methods  # tune's best static setting is only needed to run it
    results: list[dict] = []
    tuned: dict[str, dict] = {}
    platforms = args.platforms.split(",")
    bucket = Path(args.bucket)
    keys = sorted(f"{PREFIX}/{p.name}" for p in (bucket / PREFIX).glob("*.safetensors"))
    size = sum((bucket / k).stat().st_size for k in keys)
    local_files = sorted(str(p) for p in Path(args.local_dir).glob("*.safetensors"))
    local_size = sum(os.path.getsize(f) for f in local_files)

    with backed_memory(int(max(size, local_size) * 2.5)) as memory_state:
        print(f"memory: {memory_state}", file=sys.stderr)
        if "local" in platforms:
            env = clean_env()
            if sweep:
                tuned["local"] = tune(
                    args.local_dir,
                    env,
                    "local",
                    ["--drop-caches", "--max-bytes", "2GiB"],
                    reuse=args.reuse_profiles,
                )
            # One untimed load first (see bench_objstore): the first load that allocates the
            # checkpoint's memory after the memory state is set up runs slowly, whoever runs it.
            drop_caches()
            run_worker(bench_local.__file__, ["weightstream", args.local_dir], env=env, timeout=1800)
            for rep in range(args.reps):
                for m in rep_order(methods, rep):
                    drop_caches()
                    wm = "weightstream" if m.startswith("weightstream") else "runai_default"
                    r = run_worker(
                        bench_local.__file__,
                        [wm, args.local_dir],
                        env=method_env(m, env, OUT / "tune-local.json"),
                        timeout=1800,
                    )
                    r.update(method=m, platform="local", rep=rep, gbps=r["bytes"] / r["seconds"] / 1e9)
                    results.append(r)
                    print(f"  local rep {rep} {m:20} {r['gbps']:6.3f} GB/s", file=sys.stderr)
        remote = [p for p in platforms if p != "local"]
        if remote:
            with emulated_store(bucket) as store:
                for pname in remote:
                    prof = PROFILES[pname.split("_")[0]]
                    store.apply(prof)
                    for k in keys:  # the store's files in the page cache
                        with open(bucket / k, "rb") as f:
                            while f.read(64 << 20):
                                pass
                    s3env = bench_objstore._env_for("weightstream")
                    s3env = {k: v for k, v in s3env.items() if k != "PYTHONPATH"}
                    bg_url = f"http://{NS_IP}/{BUCKET}/{keys[0]}"
                    with (
                        background(bg_url, connections=4, after=0)
                        if pname.endswith("_bg") and sweep
                        else contextlib.nullcontext()
                    ):
                        sweep_args = ["--max-bytes", "512MiB" if prof.link_bits else "1GiB"]
                        if prof.link_bits:
                            sweep_args += ["--depths", "16,32,64,128", "--chunk-sizes", "8MiB,16MiB,32MiB"]
                        if sweep:
                            tuned[pname] = tune(
                                f"s3://{BUCKET}/{PREFIX}/",
                                s3env,
                                pname,
                                sweep_args,
                                reuse=args.reuse_profiles,
                            )
                    expected = size / (prof.link_bits / 8 if prof.link_bits else 1e9)
                    # untimed, as above
                    run_worker(bench_objstore.__file__, ["weightstream", *keys], env=s3env, timeout=1800)
                    for rep in range(args.reps):
                        for m in rep_order(methods, rep):
                            wm = "weightstream" if m.startswith("weightstream") else "runai_default"
                            env = method_env(m, s3env, OUT / f"tune-{pname}.json")
                            ctx = (
                                background(bg_url, connections=4, after=expected / 3)
                                if pname.endswith("_bg")
                                else contextlib.nullcontext()
                            )
                            with ctx:
                                try:
                                    r = run_worker(
                                        bench_objstore.__file__, [wm, *keys], env=env, timeout=1800
                                    )
                                    r["gbps"] = r["bytes"] / r["seconds"] / 1e9
                                except RuntimeError as exc:  # a failed load counts as 0 GB/s
                                    last = [ln for ln in str(exc).splitlines() if ln.strip()][-1:]
                                    r = {"method": m, "gbps": 0.0, "error": last[0] if last else str(exc)}
                            r.update(method=m, platform=pname, rep=rep)
                            results.append(r)
                            t = r.get("tuning") or {}
                            extra = f" depth {t.get('start_depth')}->{t.get('final_depth')}" if t else ""
                            if t.get("settled_at_s") is not None and r.get("seconds"):
                                extra += f", search ended at {t['settled_at_s']:.2f} s of {r['seconds']:.2f}"
                            extra += f" FAILED: {r['error']}" if r.get("error") else ""
                            print(f"  {pname} rep {rep} {m:20} {r['gbps']:6.3f} GB/s{extra}", file=sys.stderr)
    print(summarize(results, tuned, methods, platforms))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"tuned": tuned, "results": results}, indent=1))
    return 0


def _ratio(med: dict[str, float | None], other: str) -> str:
    ours, o = med.get("weightstream"), med.get(other)
    return f"{ours / o:.2f}" if ours and o else "–"


def summarize(results: list[dict], tuned: dict[str, dict], methods: list[str], platforms: list[str]) -> str:
    failures = [r for r in results if r.get("error")]
    lines = [
        "| platform | "
        + " | ".join(methods)
        + " | tune's best (sweep) | ours / best static | ours / Run:ai default | ours / Run:ai profile |",
        "|---|" + "---:|" * (len(methods) + 4),
    ]
    settled_lines = []
    for p in platforms:
        med = {}
        for m in methods:
            xs = [r["gbps"] for r in results if r["platform"] == p and r["method"] == m]
            med[m] = statistics.median(xs) if xs else None
        t = tuned.get(p, {})
        best = t.get("settings", {})
        best_s = best.get("object_store", best)
        sweep_best = f"{best_s.get('concurrency')} x {best_s.get('chunk_size', 0) >> 20} MiB ({t.get('best_gb_per_s', 0):.3f})"

        cells = " | ".join(f"{med[m]:.3f}" if med[m] else "–" for m in methods)
        lines.append(
            f"| {p} | {cells} | {sweep_best} | {_ratio(med, 'weightstream_best')} | {_ratio(med, 'runai_default')} | {_ratio(med, 'runai_profile')} |"
        )
        if BEFORE in methods:
            settled_lines.append(f"- {p}: weightstream / {BEFORE} (A/B of a change) = {_ratio(med, BEFORE)}")
        ends = [
            (r["tuning"]["settled_at_s"], r["seconds"])
            for r in results
            if r["platform"] == p
            and r["method"] == "weightstream"
            and (r.get("tuning") or {}).get("settled_at_s")
        ]
        if ends:
            settled_lines.append(
                f"- {p}: the tuner's opening search ended at "
                + ", ".join(f"{a:.2f} s of {b:.2f} ({a / b:.0%})" for a, b in ends)
            )
    lines += settled_lines
    for r in failures:
        lines.append(f"- {r['platform']} rep {r['rep']} {r['method']} failed: {r['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
