"""Reading a checkpoint's first bytes while its headers are read (issue 21: the round trip at
the start of a load on a network file system).

The rules tested: every byte served from what was read ahead equals the file's byte, wherever a
read starts or ends; a part that failed or was freed is never served (the load reads it itself
and says what is wrong in the ordinary words); memory read ahead is freed once copied out, and
all of it when the source closes; descriptors are not closed under a read in flight; the reads
ahead are sent only after the index and header reads; only a load of every tensor by one process
on a network file system reads ahead, and what it returns is bit-exact.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightstream as ws
from weightstream import checkpoint as checkpoint_module
from weightstream.errors import FormatError, ReadError
from weightstream.localfs import thread_in_read
from weightstream.location import LocalPath
from weightstream.memory.align import ALIGN
from weightstream.sources import file as file_module
from weightstream.sources import prefetch as prefetch_module
from weightstream.sources.base import Allowance
from weightstream.sources.file import FileBackend, FileSource
from weightstream.sources.prefetch import Prefetch, part_size

from ..conftest import assert_same, drop_from_page_cache, random_tensor, write_sharded

MiB = 1 << 20
DATA = torch.randint(
    0, 256, (40 * MiB + 1234,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
)
RAW = DATA.numpy().tobytes()


def file_read(view: memoryview, offset: int) -> int:
    """A read of ``RAW`` as a source reads: the bytes up to its end, the rest of ``view`` left."""
    n = max(0, min(len(view), len(RAW) - offset))
    view[:n] = RAW[offset : offset + n]
    return n


def started(length: int, read=file_read) -> Prefetch:  # type: ignore[no-untyped-def]
    ahead = Prefetch(read, length, uri="mem://raw")
    ahead.start()
    return ahead


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, len(RAW)),
    reads=st.lists(
        st.tuples(st.integers(0, 11 * MiB // ALIGN), st.integers(1, 9 * MiB)), min_size=1, max_size=6
    ),
)
def test_every_byte_served_is_the_files_byte(length: int, reads: list[tuple[int, int]]) -> None:
    """Against a model: a read is served from its start up to the first part whose every byte
    was copied out before (freed), or the end of what was read ahead."""
    ahead = started(length)
    chunk = part_size(length)
    copied = np.zeros(length, dtype=bool)
    freed: set[int] = set()
    try:
        for page, n in reads:
            offset = page * ALIGN
            want = min(n, max(0, len(RAW) - offset))
            pos = offset
            while pos < min(length, offset + want) and pos // chunk not in freed:
                part = pos // chunk
                end = min((part + 1) * chunk, length)
                stop = min(end, offset + want)
                copied[pos:stop] = True
                if copied[part * chunk : end].all():
                    freed.add(part)
                pos = stop
            buf = bytearray(n)
            done = ahead.serve(memoryview(buf), offset, want)
            assert done == max(0, pos - offset)
            assert bytes(buf[:done]) == RAW[offset : offset + done]
    finally:
        ahead.close()
    assert ahead.held == 0


def test_parts_are_freed_as_they_are_copied_out_and_a_second_read_reads_anew() -> None:
    length = 20 * MiB
    ahead = started(length)
    chunk = part_size(length)
    assert chunk == 4 * MiB  # the smallest part: five of them
    for part in ahead._parts:
        part.done.wait(10)
    assert ahead.held == length
    buf = bytearray(6 * MiB)
    assert ahead.serve(memoryview(buf), 0, len(buf)) == len(buf)
    assert bytes(buf) == RAW[: len(buf)]
    assert ahead.held == length - chunk  # the first part was copied to its end; the second not yet
    again = bytearray(ALIGN)
    assert ahead.serve(memoryview(again), 0, ALIGN) == 0  # freed: the caller reads it itself
    ahead.close()
    assert ahead.held == 0


@pytest.mark.parametrize("later_first", [True, False])
def test_a_part_two_reads_share_is_kept_until_both_have_copied_their_bytes(later_first: bool) -> None:
    """The engine's reads are cut at other offsets than the parts, so most parts serve two reads,
    which finish in any order. Freed when the read that copied its last byte was done, a part
    served the other read nothing: that read then sent its own request at the end of the load
    (the emulated NFS's last requests, a round trip after everything else)."""
    length = 20 * MiB
    ahead = started(length)
    chunk = part_size(length)
    cut = chunk + chunk // 2 + ALIGN  # inside the second part
    first, second = (0, cut), (cut, length - cut)
    order = [second, first] if later_first else [first, second]
    try:
        for offset, n in order:
            buf = bytearray(n)
            assert ahead.serve(memoryview(buf), offset, n) == n  # every byte from memory
            assert bytes(buf) == RAW[offset : offset + n]
        assert ahead.held == 0  # every byte of every part copied out: all freed
    finally:
        ahead.close()


def test_the_part_holding_the_header_is_freed_when_the_source_closes() -> None:
    ahead = started(8 * MiB)
    data_start = 3 * ALIGN  # the header's bytes: no read copies them
    buf = bytearray(8 * MiB - data_start)
    assert ahead.serve(memoryview(buf), data_start, len(buf)) == len(buf)
    assert ahead.held == part_size(8 * MiB)  # the first part: its first bytes never copied
    ahead.close()
    assert ahead.held == 0


def test_while_the_open_lasts_each_part_reads_one_more_past_the_end() -> None:
    """An open held up by a read in the latency tail would leave the link idle once the first
    guess has arrived: each part's thread reads the next part past the end while the open's
    allowance has room, and every byte served is still the file's."""
    allowance = Allowance(8 * MiB)
    ahead = Prefetch(file_read, 8 * MiB, uri="mem://raw", allowance=allowance, limit=len(RAW))
    ahead.start()
    try:
        deadline = time.monotonic() + 30
        while allowance.added < 8 * MiB and time.monotonic() < deadline:
            time.sleep(0.005)
        allowance.close()
        assert ahead.end == 16 * MiB  # two 4 MiB parts, then one more each
        buf = bytearray(16 * MiB)
        assert ahead.serve(memoryview(buf), 0, len(buf)) == len(buf)
        assert bytes(buf) == RAW[: len(buf)]
    finally:
        ahead.close()


def test_the_reads_ahead_stop_at_the_end_of_the_file_and_when_the_open_ends() -> None:
    allowance = Allowance(1 << 40)
    ahead = Prefetch(file_read, 8 * MiB, uri="mem://raw", allowance=allowance, limit=len(RAW))
    ahead.start()
    try:
        deadline = time.monotonic() + 30
        while ahead.end < len(RAW) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ahead.end == len(RAW)  # the last part ends with the file, unaligned
        buf = bytearray(len(RAW))
        assert ahead.serve(memoryview(buf), 0, len(buf)) == len(buf)
        assert bytes(buf) == RAW
    finally:
        ahead.close()
    closed = Allowance(1 << 40)
    closed.close()  # the open ended before the first parts were in: the range is the first guess
    ahead = Prefetch(file_read, 8 * MiB, uri="mem://raw", allowance=closed, limit=len(RAW))
    ahead.start()
    try:
        for part in ahead._parts:
            assert part.done.wait(30)
        assert ahead.end == 8 * MiB and closed.added == 0
    finally:
        ahead.close()


def test_a_part_that_failed_is_not_served() -> None:
    def failing(view: memoryview, offset: int) -> int:
        if offset == 4 * MiB:
            raise ReadError("injected", uri="mem://raw")
        return file_read(view, offset)

    ahead = started(12 * MiB, failing)
    buf = bytearray(12 * MiB)
    assert ahead.serve(memoryview(buf), 0, len(buf)) == 4 * MiB  # up to the failed part
    assert bytes(buf[: 4 * MiB]) == RAW[: 4 * MiB]
    after = bytearray(4 * MiB)
    assert ahead.serve(memoryview(after), 8 * MiB, 4 * MiB) == 4 * MiB  # the one after it is whole
    assert bytes(after) == RAW[8 * MiB : 12 * MiB]
    ahead.close()


def test_reads_not_sent_are_never_waited_for_and_close_frees_reads_still_running() -> None:
    release = threading.Event()

    def slow(view: memoryview, offset: int) -> int:
        release.wait(10)
        return file_read(view, offset)

    ahead = Prefetch(slow, 8 * MiB, uri="mem://raw")
    buf = bytearray(ALIGN)
    assert ahead.serve(memoryview(buf), 0, ALIGN) == 0  # not started: the caller reads
    ahead.close()
    release.set()
    for part in ahead._parts:
        assert part.done.wait(10)
    assert ahead.held == 0
    assert ahead.serve(memoryview(buf), 0, ALIGN) == 0


def cold_file(tmp_path: Path, data: bytes = RAW) -> Path:
    path = tmp_path / "raw.bin"
    path.write_bytes(data)
    drop_from_page_cache(path)
    return path


def test_a_file_source_serves_its_reads_from_what_it_read_ahead(tmp_path: Path) -> None:
    path = cold_file(tmp_path)
    with FileSource(str(path)) as src:
        if src._direct_fd is None:
            assert src.prefetch(8 * MiB) is None  # no O_DIRECT here: no guess
            return
        ahead = src.prefetch(9 * MiB + 5)
        assert ahead is not None
        assert src.prefetch(MiB) is None  # one per source
        ahead.start()
        for offset, n in [(0, 3 * MiB), (3 * MiB, 10 * MiB), (13 * MiB, 28 * MiB)]:
            buf = bytearray(n)
            got, _ = src.read_into(memoryview(buf), offset=offset)
            assert got == min(n, len(RAW) - offset)
            assert bytes(buf[:got]) == RAW[offset : offset + got]
        assert ahead.held == 0  # every part copied out to its end
    assert ahead.held == 0


def test_the_rest_of_a_read_past_what_is_read_ahead_is_sent_before_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that starts inside the read-ahead range and ends past it sends its own request
    for the rest at once: sent only once the parts arrived (late, on a latency tail), it would
    wait a tail of its own at the end of the load."""
    path = cold_file(tmp_path)
    release = threading.Event()
    sent: list[int] = []
    with FileSource(str(path)) as src:
        own = src._read_range_how

        def recorded(buf: memoryview, offset: int, expected: int, landed: object):  # type: ignore[no-untyped-def]
            sent.append(offset)
            return own(buf, offset, expected, landed)

        def slow_part(view: memoryview, offset: int) -> int:
            release.wait(30)
            return file_read(view, offset)

        monkeypatch.setattr(src, "_read_range_how", recorded)
        src._prefetch = Prefetch(slow_part, 8 * MiB, uri=src.uri)
        src._prefetch.start()
        buf = bytearray(12 * MiB)
        reader = threading.Thread(target=src.read_into, args=(memoryview(buf),), kwargs={"offset": 4 * MiB})
        reader.start()
        deadline = time.monotonic() + 30
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sent == [8 * MiB]  # the rest, while the part [4, 8) MiB is still being read
        release.set()
        reader.join(30)
        assert bytes(buf) == RAW[4 * MiB : 16 * MiB]


def test_a_range_already_in_the_page_cache_is_not_read_ahead(tmp_path: Path) -> None:
    path = tmp_path / "raw.bin"
    path.write_bytes(RAW)
    with open(path, "rb") as fh:
        fh.read()  # resident
    with FileSource(str(path)) as src:
        assert src.prefetch(8 * MiB) is None


def test_descriptors_stay_open_for_a_read_in_flight_when_the_source_closes(tmp_path: Path) -> None:
    path = cold_file(tmp_path, RAW[: 2 * MiB])
    src = FileSource(str(path))
    fd = src._fd
    with src._using():
        src.close()
        os.fstat(fd)  # still this file's descriptor: a read in flight may use it
        assert src._fd == fd
    assert src._fd == -1
    with pytest.raises(ReadError, match="closed"):
        src.read_into(memoryview(bytearray(ALIGN)), offset=0)


# -- the load --------------------------------------------------------------------------------


def shards(n: int, mib: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        out.append(
            {
                f"layer{i}.w": random_tensor((mib * MiB // 4 - 3,), torch.float32, seed=i),
                f"layer{i}.b": random_tensor((1001,), torch.bfloat16, seed=100 + i),
            }
        )
    return out


@pytest.fixture
def on_nfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path``, taken to be on NFS (the mount table's reading is tested in
    tests/unit/test_network_fs.py), whose header reads take a round trip: a local load would
    otherwise end before the reads ahead are sent (and rightly read nothing ahead)."""
    monkeypatch.setattr(
        file_module,
        "network_file_system",
        lambda p: "nfs4" if str(p).startswith(str(tmp_path)) else None,
    )
    read_prefix = FileSource.read_prefix

    def slow(self: FileSource, n: int) -> bytes:
        time.sleep(ROUND_TRIP)
        return read_prefix(self, n)

    monkeypatch.setattr(FileSource, "read_prefix", slow)
    return tmp_path


ROUND_TRIP = 0.3


def cold_checkpoint(folder: Path, n: int = 3, mib: int = 6) -> dict[str, torch.Tensor]:
    want = write_sharded(folder, shards(n, mib))
    for f in folder.iterdir():
        drop_from_page_cache(f)
    return want


def direct_io_works(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"\0" * ALIGN)
    try:
        with FileSource(str(probe)) as src:
            return src._direct_fd is not None
    finally:
        probe.unlink()


def load_at_64_mib(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``load()`` with a 64 MiB memory limit (the host's memory not asked: its reads ahead are an
    eighth of it), and what the open said at debug level."""
    monkeypatch.setattr(checkpoint_module, "loading_share", lambda host: (0, 1))
    with caplog.at_level(logging.DEBUG, logger="weightstream.checkpoint"):
        got = ws.load(folder, config=ws.StreamConfig(io_timeout=30, memory_limit=64 * MiB))
    return got, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("indexed", [True, False])
def test_a_load_on_a_network_file_system_reads_ahead_after_the_headers_and_is_exact(
    on_nfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, indexed: bool
) -> None:
    if not direct_io_works(on_nfs):
        pytest.skip("this file system refuses O_DIRECT: nothing is read ahead on it")
    want = cold_checkpoint(on_nfs)
    if not indexed:
        (on_nfs / "model.safetensors.index.json").unlink()
    events: list[str] = []
    lock = threading.Lock()
    read_prefix, read_all, fill = FileSource.read_prefix, FileBackend.read_all, Prefetch._fill

    def header(self: FileSource, n: int) -> bytes:
        with lock:
            events.append("header")
        return read_prefix(self, n)

    def index(self, *a, **k):  # type: ignore[no-untyped-def]
        with lock:
            events.append("index")
        return read_all(self, *a, **k)

    def ahead(self: Prefetch, part) -> None:  # type: ignore[no-untyped-def]
        self._go.wait()
        with lock:
            events.append("ahead")
        fill(self, part)

    monkeypatch.setattr(FileSource, "read_prefix", header)
    monkeypatch.setattr(FileBackend, "read_all", index)
    monkeypatch.setattr(Prefetch, "_fill", ahead)
    # an eighth of a 64 MiB limit: the first shard and part of the second
    got, said = load_at_64_mib(on_nfs, monkeypatch, caplog)
    assert_same(got, want)
    ahead_lines = [m for m in said if "bytes ahead" in m]
    assert len(ahead_lines) == 2 and "00001" in ahead_lines[0] and "00002" in ahead_lines[1], (
        ahead_lines,
        events,
    )
    assert "ahead" in events
    first = events.index("ahead")
    assert events[:first].count("header") == 3 and events[:first].count("index") == (1 if indexed else 0)
    assert not [t for t in threading.enumerate() if t.name == "weightstream-prefetch" and t.is_alive()]


def test_a_slow_open_reads_more_ahead_and_no_byte_is_read_twice(
    on_nfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The header reads take a round trip each: the reads ahead go on while they last, and stop
    before the load's own reads start, so every byte of the data is read once (by the reads
    ahead or by the load, never both) and the load is exact."""
    if not direct_io_works(on_nfs):
        pytest.skip("this file system refuses O_DIRECT: nothing is read ahead on it")
    want = cold_checkpoint(on_nfs, n=2, mib=12)
    reads: list[tuple[str, int, int]] = []
    lock = threading.Lock()
    read_range = FileSource._read_range_how

    def counted(self: FileSource, buf: memoryview, offset: int, expected: int, landed: object) -> object:
        with lock:
            reads.append((self.uri, offset, expected))
        return read_range(self, buf, offset, expected, landed)  # type: ignore[arg-type]

    monkeypatch.setattr(FileSource, "_read_range_how", counted)
    # an eighth of 64 MiB first (8 MiB), then up to three times that while the open lasts
    got, said = load_at_64_mib(on_nfs, monkeypatch, caplog)
    assert_same(got, want)
    assert [m for m in said if "more ahead while the open lasted" in m], said
    by_file: dict[str, list[tuple[int, int]]] = {}
    for uri, offset, n in reads:
        by_file.setdefault(uri, []).append((offset, offset + n))
    for uri, ranges in by_file.items():
        ranges.sort()
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert start >= end, f"{uri}: bytes from {start} read twice"
    first = by_file[str(on_nfs / "model-00001-of-00002.safetensors")]
    assert max(end for _, end in first) > 8 * MiB  # the first shard was read past the first guess


def test_only_a_whole_load_by_one_process_on_a_network_file_system_reads_ahead(
    on_nfs: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = cold_checkpoint(on_nfs, n=2, mib=5)
    made: list[int] = []
    init = Prefetch.__init__

    def counted(self, *a, **k):  # type: ignore[no-untyped-def]
        made.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(Prefetch, "__init__", counted)
    name = next(iter(want))
    assert_same(ws.load(on_nfs, tensors=[name]), {name: want[name]})
    with ws.stream(on_nfs) as s:
        assert_same(dict(s), want)
    with ws.open_checkpoint(on_nfs) as ckpt:  # inspecting reads no data
        assert_same(ckpt.load(), want)
    elsewhere = tmp_path_factory.mktemp("local")
    local = cold_checkpoint(elsewhere, n=2, mib=5)
    assert_same(ws.load(elsewhere), local)
    assert made == []
    if direct_io_works(on_nfs):
        for f in on_nfs.iterdir():
            drop_from_page_cache(f)
        assert_same(ws.load(on_nfs), want)
        assert made


def test_a_file_changed_after_its_bytes_were_read_ahead_is_refused(on_nfs: Path) -> None:
    if not direct_io_works(on_nfs):
        pytest.skip("this file system refuses O_DIRECT: nothing is read ahead on it")
    cold_checkpoint(on_nfs, n=2, mib=5)
    shard = on_nfs / "model-00001-of-00002.safetensors"
    with ws.open_checkpoint(on_nfs, prefetch=True) as ckpt:
        src = ckpt.shards[0].source
        ahead = src._prefetch  # type: ignore[attr-defined]
        assert ahead is not None
        for part in ahead._parts:
            assert part.done.wait(30)
        with open(shard, "r+b") as fh:  # rewritten in place, same size
            fh.seek(4 * MiB)
            fh.write(b"\xff" * 4096)
        with pytest.raises(FormatError, match="changed since its header was read"):
            ckpt.load()
    assert ahead.held == 0  # freed with the checkpoint


def test_the_parts_are_sized_for_about_32_reads() -> None:
    assert part_size(1) == prefetch_module._MIN_PART
    assert part_size(1 << 30) == 32 * MiB
    assert part_size(64 << 30) == prefetch_module._MAX_PART
    for n in (5 * MiB, 999 * MiB + 3, 2 << 30):
        assert part_size(n) % ALIGN == 0
        assert -(-n // part_size(n)) <= 32


# -- hedged header reads ------------------------------------------------------------------


def test_a_header_read_stuck_in_the_latency_tail_is_sent_again(
    on_nfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Shard 2's first header read never answers (a request in the tail): it is sent again
    after three times the fastest header read of the open, and the open is whole and exact."""
    want = cold_checkpoint(on_nfs, n=3, mib=1)
    if not direct_io_works(on_nfs):
        pytest.skip("this file system refuses O_DIRECT: a header read cannot be sent again on it")
    stuck = threading.Event()
    slow = FileSource.read_prefix  # the fixture's: a round trip each

    def tail(self: FileSource, n: int) -> bytes:
        if "model-00002" in self.uri:
            stuck.wait(60)
        return slow(self, n)

    monkeypatch.setattr(FileSource, "read_prefix", tail)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger="weightstream.checkpoint"):
            ckpt = ws.open_checkpoint(on_nfs, config=ws.StreamConfig(io_timeout=30))
        took = time.monotonic() - start
        with ckpt:
            assert_same(ckpt.load(), want)
    finally:
        stuck.set()
    again = [r.getMessage() for r in caplog.records if "sent again" in r.getMessage()]
    assert len(again) == 1 and "model-00002" in again[0], again
    assert took < 30  # not the stuck read's 60 s (no timing bar: the hedge answered)


def test_a_failed_header_read_says_so_in_the_ordinary_words(
    on_nfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold_checkpoint(on_nfs, n=2, mib=1)
    slow = FileSource.read_prefix

    def failing(self: FileSource, n: int) -> bytes:
        if "model-00002" in self.uri:
            raise ReadError("read failed: Input/output error", uri=self.uri, byte_range=(0, n))
        return slow(self, n)

    monkeypatch.setattr(FileSource, "read_prefix", failing)
    with pytest.raises(ReadError, match="Input/output error") as info:
        ws.load(on_nfs, config=ws.StreamConfig(io_timeout=30))
    assert info.value.uri is not None and "model-00002" in info.value.uri


def test_a_hedge_that_wins_is_kept_when_the_first_read_fails_after_it(
    on_nfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = cold_checkpoint(on_nfs, n=2, mib=1)
    if not direct_io_works(on_nfs):
        pytest.skip("this file system refuses O_DIRECT: a header read cannot be sent again on it")
    slow = FileSource.read_prefix

    def late_failure(self: FileSource, n: int) -> bytes:
        if "model-00002" in self.uri:
            time.sleep(3)  # the hedge, sent after ~0.9 s, answers first
            raise ReadError("read failed: connection reset", uri=self.uri, byte_range=(0, n))
        return slow(self, n)

    monkeypatch.setattr(FileSource, "read_prefix", late_failure)
    assert_same(ws.load(on_nfs, config=ws.StreamConfig(io_timeout=30)), want)


@pytest.mark.skipif(
    thread_in_read(threading.get_native_id()) is None, reason="thread states cannot be told here"
)
def test_the_reads_ahead_wait_until_the_header_reads_are_in_the_kernel_not_a_fixed_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header read still waiting for the GIL is not sent yet, and a read ahead sent before it
    would be answered first (a server answers in arrival order). The reads ahead wait for each
    header read's thread to be in a read system call, or for ``_SEND_GAP`` where that cannot be
    told: made an hour here, the wait can end only by seeing the read."""
    monkeypatch.setattr(checkpoint_module, "_SEND_GAP", 3600.0)
    net = checkpoint_module._NetworkOpen(0, None)
    where = LocalPath(str(tmp_path / "a.safetensors"))
    other = LocalPath(str(tmp_path / "b.safetensors"))
    r, w = os.pipe()
    entered = threading.Event()

    def header_read(loc: LocalPath) -> None:
        with net.sending(loc):
            entered.set()
            os.read(r, 1)  # blocked: the server has not answered

    try:
        net.reading(where, None)
        net.reading(other, None)
        with net.sending(other):
            pass  # answered already: not waited for
        t = threading.Thread(target=header_read, args=(where,), daemon=True)
        t.start()
        entered.wait(10)
        net._wait_sent({where, other})
        assert t.is_alive()  # still in its read: the wait ended on seeing it there
    finally:
        os.write(w, b"x")
        os.close(r)
        os.close(w)
