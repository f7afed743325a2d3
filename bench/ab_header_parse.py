"""A/B of the header parse (``parse_header``): this tree's and another tree's, interleaved in
one process, on a 2.8 MB header of 23,040 tensors (an MoE's: 60 layers x 128 experts x 3),
written two ways: UTF-8 as the safetensors library writes it, and with ``\\u`` escapes as
Python's ``json.dumps`` writes it (its metadata holds text beyond ASCII, astral characters too).

    .venv/bin/python bench/ab_header_parse.py --before /tmp/before3/src --reps 15
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def module(src: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(src) / "weightstream/format/safetensors.py")
    assert spec is not None and spec.loader is not None
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def header(escaped: bool) -> tuple[bytes, int]:
    entries: dict[str, object] = {}
    off = 0
    for i in range(60):
        for j in range(128):
            for k in range(3):
                entries[f"model.layers.{i}.mlp.experts.{j}.w{k}.weight"] = {
                    "dtype": "BF16",
                    "shape": [64, 64],
                    "data_offsets": [off, off + 8192],
                }
                off += 8192
    entries["__metadata__"] = {"note": "é 🙂 " * (1000 if escaped else 1)}
    raw = json.dumps(entries, ensure_ascii=escaped).encode()
    return raw, 8 + len(raw) + off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, metavar="SRC", help="the other tree's src folder")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    sides = {"now": module(str(ROOT / "src"), "parse_now"), "before": module(args.before, "parse_before")}
    for label, escaped in (("UTF-8 (the safetensors library)", False), ("escaped (json.dumps)", True)):
        raw, size = header(escaped)
        took: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.reps):
            for k in sorted(sides, reverse=bool(r % 2)):  # alternate which side goes first
                t0 = time.perf_counter()
                sides[k].parse_header(raw, uri="bench", file_size=size)
                took[k].append(time.perf_counter() - t0)
        now, before = statistics.median(took["now"]), statistics.median(took["before"])
        print(
            f"{label}: {len(raw) / 1e6:.1f} MB, median of {args.reps}: now {now * 1e3:.1f} ms, "
            f"before {before * 1e3:.1f} ms, now / before {now / before:.3f}"
        )


if __name__ == "__main__":
    main()
