"""What the kept checks' bookkeeping costs: writing a record, and asking a file's file system
whether its times follow every write (``weightstream.cache.passed``).

    .venv/bin/python bench/record_cost.py [--before /tmp/before/src] [--adds 2000]

Adds one new piece at a time to one record (each addition reads, merges and renames it, as a
load's end does when new pieces passed), then times the mount-table rule. ``--before`` runs
the same additions with the code of another tree, alternating, in one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import os, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
from weightstream.cache.passed import PassedChecks
from weightstream.format.manifest import FileDigest
from weightstream.sources.file import file_identity
n, where = int(sys.argv[2]), sys.argv[3]
d = tempfile.mkdtemp(dir=where)
f = os.path.join(d, "f")
with open(f, "wb") as fh:
    fh.write(bytes(4096))
digest = FileDigest("f", n, 0, 1, tuple(range(n)))
identity = file_identity(os.stat(f))
checks = PassedChecks(os.path.join(d, "checks"), settle_ns=0)
t0 = time.perf_counter()
for i in range(n):
    checks.add(f, identity, digest, [i], began_ns=time.time_ns())
print((time.perf_counter() - t0) / n)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="the src/ of a worktree of the code before")
    ap.add_argument("--adds", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out"), help="a folder on the disk to test")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    trees = [("after", str(ROOT / "src"))] + ([("before", args.before)] if args.before else [])
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        for _ in range(args.rounds):
            for name, src in trees:
                out = subprocess.run(
                    [sys.executable, "-c", _CHILD, src, str(args.adds), where], capture_output=True, text=True
                )
                if out.returncode != 0:
                    sys.exit(out.stderr)
                print(f"{name:6s} adding a piece to a record: {float(out.stdout) * 1e6:.0f} µs")
    sys.path.insert(0, str(ROOT / "src"))
    import timeit

    from weightstream.localfs import mount_table, times_miss_writes

    n = 2000
    t = timeit.timeit(lambda: times_miss_writes(args.dir), number=n) / n
    print(f"the file-system rule: {t * 1e6:.0f} µs a device and load ({len(mount_table())} mounts)")


if __name__ == "__main__":
    main()
