"""The engine obeys the tuner: reads in flight follow its depth, read sizes follow its chunk size,
and every byte still lands where it belongs."""

from __future__ import annotations

import threading
import time

import numpy as np

from weightstream.config import StreamConfig
from weightstream.engine.plan import make_plan
from weightstream.engine.scheduler import run_plan
from weightstream.format.dtypes import DTYPES
from weightstream.format.safetensors import TensorEntry
from weightstream.tuning.controller import DepthController
from weightstream.tuning.online import Tuning

U8 = DTYPES["U8"]


class MemorySource:
    """An in-memory Source that records how many reads run at once and how large they are."""

    def __init__(self, data: bytes) -> None:
        self.uri = "memory://test"
        self.size = len(data)
        self._data = np.frombuffer(data, dtype=np.uint8)
        self._lock = threading.Lock()
        self.active = 0
        self.log: list[tuple[int, int]] = []  # (reads running, read length) at each read's start

    def read_prefix(self, length: int) -> bytes:
        return self._data[:length].tobytes()

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, str]:
        n = max(0, min(len(buf), self.size - offset))
        with self._lock:
            self.active += 1
            self.log.append((self.active, len(buf)))
        time.sleep(0.002)
        np.frombuffer(buf, dtype=np.uint8, count=n)[:] = self._data[offset : offset + n]
        with self._lock:
            self.active -= 1
        return n, "buffered"

    def close(self) -> None:
        pass


class Scripted(DepthController):
    """A controller that changes depth on a script, whatever it measures."""

    def __init__(self, depths: list[int]) -> None:
        super().__init__(initial=depths[0], maximum=max(depths))
        self.script, self.calls = depths, 0

    def tick(self, now: float, delivered: int, *, starved: bool = False) -> int:
        self.calls += 1
        self.depth = self.script[min(len(self.script) - 1, self.calls // 20)]
        return self.depth


def test_reads_in_flight_follow_the_tuner_and_bytes_are_exact() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    entries = [
        TensorEntry(f"t{i}", U8, (64 << 10,), i * (64 << 10), (i + 1) * (64 << 10), "m") for i in range(128)
    ]
    plan = make_plan([entries], chunk_size=64 << 10)
    src = MemorySource(data)
    controller = Scripted([2, 8, 3, 1])
    tuning = Tuning(controller, chunk_size=64 << 10, min_chunk=16 << 10, inflight=256 << 10)
    cfg = StreamConfig(memory_limit=1 << 20)
    got = {}
    for block, buf in run_plan(plan, [src], cfg, tuning=tuning):
        got[block.start] = buf.numpy().tobytes()
    assert b"".join(got[k] for k in sorted(got)) == data
    assert max(a for a, _ in src.log) <= 8  # never past the tuner's largest depth
    assert max(a for a, _ in src.log) > 2  # it did open up when told to
    # read sizes shrink as depth grows: 256 KiB in flight / depth, between 16 and 64 KiB
    sizes = {n for _, n in src.log}
    assert min(sizes) < 64 << 10 and min(sizes) >= 16 << 10
    last = src.log[-20:]
    assert max(a for a, _ in last) <= 3  # the final depths (3, then 1) held at the end
