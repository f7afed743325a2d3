"""What one setting costs a hot local load, timed in one process: loads with the setting and
without it alternate (the order flipped every pair), so both see the same memory state. The
checkpoint is read once with each first (hot).

    .venv/bin/python bench/ab_setting.py --set verify=auto --unset verify=off --manifest

``--manifest`` writes the checkpoint's manifest first (and removes it after), for the check.
``--set`` may be given more than once (and may hold several settings, ``A=1,B=2``): each is
timed against ``--unset``, all of them in every round, in an order that turns each round.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from ab_inprocess import manifest_for  # noqa: E402  (shared with the A/B of two trees)
from bench_local import backed_memory, warm  # noqa: E402  (the states every local figure uses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out" / "checkpoint"))
    ap.add_argument(
        "--set", required=True, action="append", metavar="NAME=VALUE[,NAME=VALUE]", help="the setting, on"
    )
    ap.add_argument("--unset", required=True, metavar="NAME=VALUE[,NAME=VALUE]", help="the same setting, off")
    ap.add_argument("--pairs", type=int, default=14)
    ap.add_argument("--manifest", action="store_true", help="write the checkpoint's manifest first")
    ap.add_argument(
        "--memory-as-found",
        action="store_true",
        help="leave page reporting as it is (default: paused, and the loads' memory touched once)",
    )
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))
    state = contextlib.nullcontext("as found") if args.memory_as_found else backed_memory(int(size * 2.5))
    with manifest_for(args.dir, args.manifest), state as how:
        warm(sorted(str(p) for p in Path(args.dir).glob("*.safetensors")))  # hot: every page cached
        print(f"memory: {how}; the checkpoint in the page cache")
        _run(args)


def _settings(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(","))


def _run(args: argparse.Namespace) -> None:
    import weightstream as ws

    variants = [("off", args.unset)] + [
        (f"on{k}" if len(args.set) > 1 else "on", t) for k, t in enumerate(args.set)
    ]
    configs = {name: ws.StreamConfig.from_mapping(_settings(text)) for name, text in variants}
    for config in configs.values():
        ws.load(args.dir, config=config)
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for i in range(args.pairs):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            tensors = ws.load(args.dir, config=configs[name])
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            del tensors
    size = sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))
    for name, text in variants:
        t = times[name]
        print(
            f"{name:3s} ({text}): median {statistics.median(t):.3f} s, "
            f"best {min(t):.3f} s, {size / 1e9 / statistics.median(t):.2f} GB/s, "
            f"CPU {statistics.median(cpu[name]) / (size / 1e9):.3f} s/GB"
        )
    for name, _ in variants[1:]:
        ratios = sorted(a / b for a, b in zip(times[name], times["off"], strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(
            f"{name} / off, round by round: median {q[1]:.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}, n={len(ratios)}"
        )
        print(
            f"{name} / off, time: median {statistics.median(times[name]) / statistics.median(times['off']):.3f}, "
            f"best {min(times[name]) / min(times['off']):.3f}; CPU (medians) "
            f"{statistics.median(cpu[name]) / statistics.median(cpu['off']):.3f}"
        )


if __name__ == "__main__":
    main()
