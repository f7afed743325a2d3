"""While the engine's coordinator runs, the heap that was there before is left out of the garbage
collector's passes (a full pass over a torch process's objects holds the GIL for tens of
milliseconds); everything else about the collector is as the application left it."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from weightstream.config import StreamConfig
from weightstream.engine import heap
from weightstream.engine.heap import frozen_heap
from weightstream.engine.plan import make_plan
from weightstream.engine.scheduler import run_plan
from weightstream.errors import ReadError
from weightstream.format.safetensors import TensorEntry
from weightstream.sources.memory import MemorySource

from .test_engine_tuning import U8, _close_stores, stored  # noqa: F401  (the fixture closes the stores)

CFG = StreamConfig(memory_limit=1 << 20, concurrency=4, autotune=False)


@pytest.fixture(autouse=True)
def collector_as_found(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    monkeypatch.setattr(heap, "_applications", False)  # (a process-long verdict, set per test)
    yield
    gc.unfreeze()
    gc.enable()


class Watching(MemorySource):
    """Records the number of frozen objects at every read; ``during`` runs in the first read."""

    frozen: list[int]
    during = None
    lock: threading.Lock

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, str]:
        with self.lock:
            self.frozen.append(gc.get_freeze_count())
            during, self.during = self.during, None
        if during is not None:
            during()
        return super().read_into(buf, offset=offset)


def watching(data: bytes, during=None) -> Watching:  # type: ignore[no-untyped-def]
    source = stored(data, kind=Watching)
    assert isinstance(source, Watching)
    source.frozen, source.during, source.lock = [], during, threading.Lock()
    return source


def plan_and_data(blocks: int = 8):  # type: ignore[no-untyped-def]
    size = 64 << 10
    data = np.random.default_rng(5).integers(0, 256, blocks * size, dtype=np.uint8).tobytes()
    entries = [TensorEntry(f"t{i}", U8, (size,), i * size, (i + 1) * size, "m") for i in range(blocks)]
    return make_plan([entries], chunk_size=16 << 10), data


def load(source: MemorySource, plan) -> bytes:  # type: ignore[no-untyped-def]
    got = {block.start: buf.numpy().tobytes() for block, buf in run_plan(plan, [source], CFG, keep_all=True)}
    return b"".join(got[k] for k in sorted(got))


def test_a_load_runs_with_the_heap_before_it_frozen_and_puts_it_back() -> None:
    plan, data = plan_and_data()
    source = watching(data)
    assert load(source, plan) == data
    assert len(source.frozen) == plan.num_chunks and min(source.frozen) > 1000  # torch's objects, and ours
    assert gc.get_freeze_count() == 0


def test_no_block_pays_a_walk_of_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The only way to ask what is frozen walks the permanent generation (10 ms in a torch
    process): it may be asked only while that is empty, or a stream would pay it per block."""
    counted: list[int] = []

    class Counting:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return getattr(gc, name)

        def get_freeze_count(self) -> int:
            counted.append(gc.get_freeze_count())
            return counted[-1]

    monkeypatch.setattr(heap, "gc", Counting())
    plan, data = plan_and_data()
    got = [buf.numpy().tobytes() for _, buf in run_plan(plan, [watching(data)], CFG)]  # a resume a block
    assert len(got) == len(plan.blocks) and counted and max(counted) == 0


def test_what_a_load_makes_is_still_collected() -> None:
    plan, data = plan_and_data()
    made: list[weakref.ref] = []

    def a_cycle() -> None:
        node: list = []
        node.append(node)
        made.append(weakref.ref(Cell(node)))  # a cycle of an object and a list, made during the load
        del node
        gc.collect()

    assert load(watching(data, during=a_cycle), plan) == data
    assert made and made[0]() is None


class Cell:
    def __init__(self, other: list) -> None:
        self.other = other
        other.append(self)


def test_a_stream_waiting_in_the_callers_hands_leaves_the_heap_alone() -> None:
    plan, data = plan_and_data()
    blocks = run_plan(plan, [watching(data)], CFG)
    next(blocks)
    assert gc.get_freeze_count() == 0  # the caller's time: its collections are its own
    blocks.close()
    assert gc.get_freeze_count() == 0


def test_a_stream_abandoned_in_a_reference_cycle_is_collected() -> None:
    plan, data = plan_and_data()
    source = watching(data)
    blocks = run_plan(plan, [source], CFG)
    next(blocks)
    holder: list = [blocks]
    holder.append(holder)
    gone = weakref.ref(blocks)
    del blocks, holder
    gc.collect()
    assert gone() is None  # collected, its workers stopped: never kept alive by a frozen heap
    assert gc.get_freeze_count() == 0


def test_a_failed_load_puts_the_heap_back() -> None:
    plan, data = plan_and_data()

    def fail() -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(ReadError, match="Input/output error"):
        load(watching(data, during=fail), plan)
    assert gc.get_freeze_count() == 0


def test_an_applications_own_freeze_is_left_as_it_is_then_and_after() -> None:
    plan, data = plan_and_data()
    gc.freeze()
    before = gc.get_freeze_count()
    assert load(watching(data), plan) == data
    assert gc.get_freeze_count() >= before - 100  # not unfrozen by the load (some objects died)
    gc.unfreeze()
    source = watching(data)  # the application freezes: later loads leave the collector to it
    assert load(source, plan) == data
    assert max(source.frozen) == 0


def test_a_collector_the_application_disabled_is_left_alone() -> None:
    gc.disable()
    plan, data = plan_and_data()
    source = watching(data)
    assert load(source, plan) == data
    assert source.frozen and max(source.frozen) == 0
    assert not gc.isenabled()


def test_loads_in_two_threads_put_the_heap_back_when_the_last_ends() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def first() -> None:
        with frozen_heap():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with frozen_heap():
            second_in.set()
            first_out.wait(5)
            seen["after the first ended"] = gc.get_freeze_count()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["after the first ended"] > 1000
    assert gc.get_freeze_count() == 0
