"""The staging ring (the GPU path's host side), run with a CPU "device": every byte lands in
the right place through a fixed number of small staging buffers, and reads in flight never
exceed the ring. Host buffers mapped ahead of their reads stay within their window and are
dropped with the load; a caller that keeps every block gets them once all are in."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from weightstream import open_checkpoint
from weightstream.config import StreamConfig
from weightstream.engine.plan import make_plan
from weightstream.engine.scheduler import ReadCounters, run_plan
from weightstream.engine.sink import HostSink, StagedSink
from weightstream.errors import ReadError
from weightstream.sources.base import ReadHow
from weightstream.sources.file import FileSource

from ..conftest import as_bytes, assert_same, random_tensor, reference, write_sharded

KiB = 1024


class CountingSource:
    """A real file source that records how many reads run at once."""

    def __init__(self, inner: FileSource) -> None:
        self.inner, self.uri, self.size = inner, inner.uri, inner.size
        self.now = self.most = 0
        self.lock = threading.Lock()

    def read_prefix(self, length: int) -> bytes:
        return self.inner.read_prefix(length)

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return self.inner.read_into(buf, offset=offset)
        finally:
            with self.lock:
                self.now -= 1

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("slots", [1, 3])
def test_staged_reads_are_exact_and_bounded_by_the_ring(tmp_path: Path, slots: int) -> None:
    want = write_sharded(
        tmp_path,
        [{"big": random_tensor((300_001,), torch.float32), "b": random_tensor((77,), torch.int16, seed=2)}],
    )
    ck = open_checkpoint(tmp_path)
    entries = [ck.tensors[n] for n in want]
    plan = make_plan([entries], chunk_size=64 * KiB)
    src = CountingSource(FileSource(ck.files[0].uri, direct_io="auto"))
    # Chunks of 64 KiB through 16 KiB slots: four staged pieces per chunk.
    sink = StagedSink(torch.device("cpu"), slots=slots, slot_size=16 * KiB)
    config = StreamConfig(concurrency=8, autotune=False)
    file_bytes = np.fromfile(ck.files[0].uri, dtype=np.uint8)
    seen = 0
    for block, buf in run_plan(plan, [src], config, sink=sink):
        end = min(block.end, len(file_bytes))
        assert torch.equal(buf[: end - block.start], torch.from_numpy(file_bytes[block.start : end]))
        seen += 1
    src.close()
    assert seen == len(plan.blocks)
    assert 1 <= src.most <= slots and sink.created <= slots


def test_staging_buffers_are_made_only_as_reads_need_them(tmp_path: Path) -> None:
    write_sharded(tmp_path, [{"w": random_tensor((100_000,), torch.float32)}])
    ck = open_checkpoint(tmp_path)
    plan = make_plan([list(ck.tensors.values())], chunk_size=64 * KiB)
    src = FileSource(ck.files[0].uri, direct_io="off")
    sink = StagedSink(torch.device("cpu"), slots=8, slot_size=16 * KiB)
    for _ in run_plan(plan, [src], StreamConfig(concurrency=1, autotune=False), sink=sink):
        pass
    src.close()
    assert sink.created == 1  # one read at a time: one staging buffer, reused


def test_staged_tensors_match_the_reference(tmp_path: Path) -> None:
    write_sharded(
        tmp_path, [{"x": random_tensor((5000, 3), torch.bfloat16), "y": random_tensor((9,), torch.bool)}]
    )
    ck = open_checkpoint(tmp_path)
    plan = make_plan([list(ck.tensors.values())], chunk_size=8 * KiB)
    src = FileSource(ck.files[0].uri, direct_io="off")
    sink = StagedSink(torch.device("cpu"), slots=2, slot_size=4 * KiB)
    ref = reference(ck.files[0].uri)
    for block, buf in run_plan(plan, [src], StreamConfig(concurrency=4, autotune=False), sink=sink):
        for e in block.tensors:
            raw = buf[e.start - block.start : e.end - block.start]
            assert torch.equal(raw, as_bytes(ref[e.name]))
    src.close()


def test_a_bad_ring_is_refused() -> None:
    with pytest.raises(ValueError):
        StagedSink(torch.device("cpu"), slots=0, slot_size=4096)
    with pytest.raises(ValueError):
        StagedSink(torch.device("cpu"), slots=1, slot_size=5000)


class RecordingHostSink(HostSink):
    """The real host sink, recording which buffers were mapped ahead and how far ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.from_ahead: list[int] = []
        self.most_ahead = 0

    def allocate(self, block, uri):  # type: ignore[no-untyped-def]
        if block.index in self._ahead:
            self.from_ahead.append(block.index)
        return super().allocate(block, uri)

    def map_ahead(self, block, uri):  # type: ignore[no-untyped-def]
        done = super().map_ahead(block, uri)
        self.most_ahead = max(self.most_ahead, sum(b.numel() for b, _ in self._ahead.values()))
        return done


def _blocks_checkpoint(tmp_path: Path, n: int):  # type: ignore[no-untyped-def]
    # n tensors of 64 KiB each: one block each at a 64 KiB read size.
    tensors = {f"t{i:02d}": random_tensor((16 * KiB,), torch.float32, seed=i) for i in range(n)}
    write_sharded(tmp_path, [tensors])
    ck = open_checkpoint(tmp_path)
    plan = make_plan([list(ck.tensors.values())], chunk_size=64 * KiB)
    assert len(plan.blocks) == n
    return ck, plan


def test_host_buffers_are_mapped_ahead_within_the_window(tmp_path: Path) -> None:
    ck, plan = _blocks_checkpoint(tmp_path, 12)
    block_bytes = plan.blocks[1].nbytes
    src = FileSource(ck.files[0].uri, direct_io="off")
    sink = RecordingHostSink()
    config = StreamConfig(concurrency=2, autotune=False, memory_limit=3 * block_bytes)
    file_bytes = np.fromfile(ck.files[0].uri, dtype=np.uint8)
    seen = []
    for block, buf in run_plan(plan, [src], config, sink=sink):
        end = min(block.end, len(file_bytes))
        assert torch.equal(buf[: end - block.start], torch.from_numpy(file_bytes[block.start : end]))
        seen.append(block.index)
    src.close()
    assert sorted(seen) == list(range(12))
    # The first blocks are admitted before anything is mapped ahead; every later one was mapped
    # ahead, never more than memory_limit bytes of them at once, and none is left over.
    assert sorted(sink.from_ahead) == list(range(3, 12))
    assert 0 < sink.most_ahead <= config.memory_limit
    assert not sink._ahead


def test_a_caller_keeping_every_block_gets_them_all_once_all_are_in(tmp_path: Path) -> None:
    ck, plan = _blocks_checkpoint(tmp_path, 10)
    src = FileSource(ck.files[0].uri, direct_io="off")
    counters = ReadCounters()
    progress: list[int] = []
    # A memory limit of one block: keep_all admits every block anyway (the caller keeps them all).
    config = StreamConfig(concurrency=2, autotune=False, memory_limit=plan.blocks[1].nbytes)
    file_bytes = np.fromfile(ck.files[0].uri, dtype=np.uint8)
    seen = []
    for block, buf in run_plan(
        plan, [src], config, sink=HostSink(), counters=counters, on_bytes=progress.append, keep_all=True
    ):
        assert counters.chunks == plan.num_chunks  # nothing is handed over before the end
        assert sum(progress) == plan.read_bytes
        end = min(block.end, len(file_bytes))
        assert torch.equal(buf[: end - block.start], torch.from_numpy(file_bytes[block.start : end]))
        seen.append(block.index)
    src.close()
    assert seen == list(range(10))  # in plan order
    assert counters.peak_held == plan.read_bytes


class FailingSource(CountingSource):
    """A real file source whose ``fail_at``-th read fails."""

    def __init__(self, inner: FileSource, fail_at: int) -> None:
        super().__init__(inner)
        self.reads, self.fail_at = 0, fail_at

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        with self.lock:
            self.reads += 1
            if self.reads == self.fail_at:
                raise OSError(5, "Input/output error")
        return super().read_into(buf, offset=offset)


def test_a_failure_ends_a_load_that_keeps_every_block_at_once(tmp_path: Path) -> None:
    ck, plan = _blocks_checkpoint(tmp_path, 10)
    src = FailingSource(FileSource(ck.files[0].uri, direct_io="off"), fail_at=4)
    # Had the coordinator waited for the end instead, it would raise StorageTimeoutError.
    config = StreamConfig(concurrency=2, autotune=False, io_timeout=5)
    with pytest.raises(ReadError, match="Input/output error") as info:
        for _ in run_plan(plan, [src], config, keep_all=True):
            pass
    src.close()
    assert info.value.uri == ck.files[0].uri and info.value.byte_range is not None


def test_buffers_mapped_ahead_go_with_a_load_closed_early(tmp_path: Path) -> None:
    ck, plan = _blocks_checkpoint(tmp_path, 8)
    src = FileSource(ck.files[0].uri, direct_io="off")
    sink = RecordingHostSink()
    config = StreamConfig(concurrency=1, autotune=False, memory_limit=plan.blocks[1].nbytes)
    reads = run_plan(plan, [src], config, sink=sink)
    next(reads)
    assert sink._ahead  # the next block is mapped
    reads.close()
    src.close()
    assert not sink._ahead


def test_load_keeps_every_block_and_stream_keeps_to_its_budget(tmp_path: Path) -> None:
    ck, plan = _blocks_checkpoint(tmp_path, 10)
    config = StreamConfig(concurrency=2, autotune=False, memory_limit=plan.blocks[1].nbytes)
    ref = reference(ck.files[0].uri)
    got = ck.load(config=config)
    assert_same(got, ref)
    assert ck.last_stats is not None and ck.last_stats.peak_held_bytes == plan.read_bytes
    with ck.stream(config=config) as s:
        for _ in s:
            pass
    assert s.stats.peak_held_bytes <= config.memory_limit
