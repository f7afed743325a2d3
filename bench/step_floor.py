"""The floor of a check taken step by step in Python: a hot checkpoint copied out of the page
cache by one thread per CPU in tight loops (``preadv`` into memory touched once, no engine, no
tensors), with and without a CRC32C (``awscrt``) of each step right after it lands.

What it answers: how much a CRC per step can cost at best when Python drives the steps, against
the same copy in whole 64 MiB reads (what ``load()`` does unchecked). ``load()``'s own figure is
``ab_setting.py --set verify=auto --unset verify=off --manifest``.

    .venv/bin/python bench/step_floor.py --dir bench/out/vllm-model --reps 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from awscrt import checksums

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_local import warm  # noqa: E402

READ = 64 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out" / "vllm-model"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    files = sorted(str(p) for p in Path(args.dir).glob("*.safetensors"))
    jobs = [
        (f, off, min(READ, os.path.getsize(f) - off))
        for f in files
        for off in range(0, os.path.getsize(f), READ)
    ]
    total = sum(n for _, _, n in jobs)
    warm(files)  # hot

    def run(step: int, crc: bool) -> tuple[float, float]:
        it = iter(jobs)
        lock = threading.Lock()

        def worker() -> None:
            mem = mmap.mmap(-1, READ)
            buf = memoryview(mem)
            buf[::4096] = b"\1" * (READ // 4096)  # touched once, before the clock
            fds: dict[str, int] = {}
            while True:
                with lock:
                    job = next(it, None)
                if job is None:
                    break
                f, off, n = job
                fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
                done, c = 0, 0
                while done < n:
                    k = os.preadv(fd, [buf[done : min(n, done + step)]], off + done)
                    if crc:
                        c = checksums.crc32c(buf[done : done + k], c)
                    done += k
            for fd in fds.values():
                os.close(fd)

        threads = [threading.Thread(target=worker) for _ in range(args.threads)]
        t0, c0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, time.process_time() - c0

    ways = {
        "64 MiB reads": (READ, False),
        "1 MiB steps": (1 << 20, False),
        "1 MiB steps, CRC each": (1 << 20, True),
        "512 KiB steps, CRC each": (512 << 10, True),
        "64 MiB reads, CRC each": (READ, True),
    }
    got: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for i in range(args.reps + 1):
        for w in list(ways) if i % 2 == 0 else list(reversed(ways)):
            r = run(*ways[w])
            if i:  # the first round warms up
                got[w].append(r)
    base = statistics.median(t for t, _ in got["64 MiB reads"])
    print(f"{total / 1e9:.2f} GB hot, {args.threads} threads, medians of {args.reps}")
    print("| way | s | GB/s | / 64 MiB reads | CPU-s per GB |\n|---|---:|---:|---:|---:|")
    for w, rs in got.items():
        t = statistics.median(x for x, _ in rs)
        c = statistics.median(x for _, x in rs)
        print(f"| {w} | {t:.3f} | {total / t / 1e9:.2f} | {t / base:.3f} | {c / total * 1e9:.3f} |")


if __name__ == "__main__":
    main()
