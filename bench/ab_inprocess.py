"""An A/B of a change on hot local loads, timed inside each process.

``bench_local.py --before`` alternates the two methods in separate processes, each in the memory
state the harness sets up; this one times ``weightstream.load`` ``--loads`` times in one process
per method (the first ``--skip`` dropped: the process's first touches of fresh memory), and
alternates the processes ``--pairs`` times. Hot: the checkpoint is read once before.

    .venv/bin/python bench/ab_inprocess.py --before /tmp/before/src --dir bench/out/checkpoint

A setting's cost: the same tree on both sides, the setting off on one (``--before-env``), e.g.
the manifest check (``--manifest`` writes the checkpoint's manifest first, and removes it after)::

    .venv/bin/python bench/ab_inprocess.py --before src --before-env WEIGHTSTREAM_VERIFY=off --manifest
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import weightstream as ws
times = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter()
    tensors = ws.load(sys.argv[2])
    times.append(time.perf_counter() - t0)
    del tensors
print(json.dumps(times[int(sys.argv[4]):]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the src/ of a worktree of the code before")
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out" / "checkpoint"))
    ap.add_argument("--loads", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument(
        "--before-env", action="append", default=[], metavar="KEY=VALUE", help="set for the before side"
    )
    ap.add_argument(
        "--manifest", action="store_true", help="write the checkpoint's manifest first (removed after)"
    )
    ap.add_argument(
        "--memory-as-found",
        action="store_true",
        help="leave page reporting as it is (default: paused, and the loads' memory touched once)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_local import backed_memory, warm  # the states every local figure uses

    size = sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))
    state = contextlib.nullcontext("as found") if args.memory_as_found else backed_memory(int(size * 2.5))
    with manifest_for(args.dir, args.manifest), state as how:
        warm(sorted(str(p) for p in Path(args.dir).glob("*.safetensors")))  # hot: every page cached
        print(f"memory: {how}; the checkpoint in the page cache")
        _pairs(args)


@contextlib.contextmanager
def manifest_for(folder: str, wanted: bool) -> Iterator[None]:
    """The checkpoint's manifest beside its files while the block runs (``wanted``), then gone."""
    manifest = Path(folder) / "weightstream.manifest.json"
    if wanted:
        subprocess.run(
            [sys.executable, "-m", "weightstream", "manifest", folder, "-o", str(manifest)], check=True
        )
    try:
        yield
    finally:
        if wanted:
            manifest.unlink(missing_ok=True)


def _pairs(args: argparse.Namespace) -> None:
    runs: dict[str, list[float]] = {"after": [], "before": []}
    for _ in range(args.pairs):
        for name, src in (("before", args.before), ("after", str(ROOT / "src"))):
            env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSTREAM_")}
            if name == "before":
                env.update(kv.split("=", 1) for kv in args.before_env)
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, src, args.dir, str(args.loads), str(args.skip)],
                check=True,
                capture_output=True,
                text=True,
                env=env,
            )
            times = json.loads(out.stdout)
            runs[name] += times
            print(
                f"{name:6s} median {sorted(times)[len(times) // 2] * 1e3:6.1f} ms  best {min(times) * 1e3:6.1f} ms"
            )
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    print(
        f"after / before (time, medians of {len(runs['after'])} loads each): {med['after'] / med['before']:.3f}"
    )
    print(f"after / before (best): {min(runs['after']) / min(runs['before']):.3f}")


if __name__ == "__main__":
    main()
