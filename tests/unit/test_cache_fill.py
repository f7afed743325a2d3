"""The cache fill's rules on their own: the range set, and whose reads are waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.cache.fill import _RECORD, CLAIM, Fill, FillingSource, drain
from weightstream.cache.store import Cache
from weightstream.errors import NotFoundError
from weightstream.format.ranges import Ranges
from weightstream.sources.memory import MemoryStore

SIZE = 1 << 20


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), max_size=30),
    st.integers(0, 260),
    st.integers(0, 60),
)
@settings(max_examples=300, deadline=None)
def test_ranges_agree_with_a_set_of_bytes(adds: list[tuple[int, int]], start: int, length: int) -> None:
    r, model = Ranges(), set()
    for s, n in adds:
        r.add(s, s + n)
        model |= set(range(s, s + n))
    end = start + length
    if length:
        assert r.covers(start, end) == (set(range(start, end)) <= model)
    gaps = r.gaps(start, end)
    assert set().union(*(set(range(a, b)) for a, b in gaps)) == set(range(start, end)) - model
    assert all(a < b for a, b in gaps)
    assert r.total == len(model)
    assert all(e < s2 for e, s2 in zip(r.ends, r.starts[1:], strict=False))  # disjoint, not touching, sorted


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    with MemoryStore("fill") as s:
        s.put("f", bytes(range(256)) * (SIZE // 256))
        yield s


def fill_of(tmp_path: Path, store: MemoryStore, *, stall: float = 3600.0) -> Fill:
    cache = Cache(str(tmp_path))
    src = store.source("f")
    assert src.version is not None
    return Fill(cache, store.uri("f"), src.version, SIZE, use=cache.use("k" * 32), stall=stall)


def test_a_claim_by_a_dead_process_is_not_waited_for(tmp_path: Path, store: MemoryStore) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    fill = fill_of(tmp_path, store)  # a stall of an hour: only the dead claimer's rule can end the wait
    with open(fill.journal, "ab") as f:
        f.write(_RECORD.pack(CLAIM, pid, 0, SIZE))
    buf = bytearray(64 << 10)
    reading = FillingSource(store.source("f"), fill)
    assert reading.read_into(memoryview(buf), offset=0) == (len(buf), "buffered")
    assert bytes(buf) == store.get("f").data[: len(buf)]
    assert [e[1:] for e in store.reads.entries] == [(0, len(buf))]  # read from the store
    fill.close()


def test_a_read_another_thread_is_making_is_waited_for_and_read_back(
    tmp_path: Path, store: MemoryStore
) -> None:
    store.delay = 0.3
    fill = fill_of(tmp_path, store)
    first, second = bytearray(SIZE), bytearray(SIZE)
    a = threading.Thread(
        target=FillingSource(store.source("f"), fill).read_into,
        args=(memoryview(first),),
        kwargs={"offset": 0},
    )
    a.start()
    while not fill.claims:  # the first read has claimed the range
        with fill.lock:
            fill._refresh()
    b = FillingSource(store.source("f"), fill).read_into(memoryview(second), offset=0)
    a.join()
    assert b == (SIZE, "buffered") and bytes(second) == bytes(first) == store.get("f").data
    assert len(store.reads.entries) == 1  # one read of the store, not two
    assert fill.whole
    fill.close()


def test_a_failed_read_gives_its_claim_up(tmp_path: Path, store: MemoryStore) -> None:
    fill = fill_of(tmp_path, store)
    with pytest.raises(NotFoundError, match="no such object"):
        FillingSource(_Gone(), fill).read_into(memoryview(bytearray(4096)), offset=0)
    with fill.lock:
        fill._refresh()
    assert fill.claims == {}  # a later read does not wait for it
    fill.close()


class _Gone:
    """A source whose reads fail (the object went away mid-load)."""

    uri = "memory://fill/f"
    size = SIZE

    def read_prefix(self, length: int) -> bytes:
        raise OSError("gone")

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, str]:
        raise NotFoundError("no such object", uri=self.uri)

    def close(self) -> None:
        pass


def test_a_written_range_is_never_read_from_the_store_again(tmp_path: Path, store: MemoryStore) -> None:
    fill = fill_of(tmp_path, store)
    reading = FillingSource(store.source("f"), fill)
    quarter = SIZE // 4
    for offset in range(0, 3 * quarter, quarter):  # three quarters: the part is not whole yet
        reading.read_into(memoryview(bytearray(quarter)), offset=offset)
    store.reads.clear()
    again = fill_of(tmp_path, store)  # another load (as another process would) resumes the part
    assert again.written.total == 3 * quarter
    out = bytearray(SIZE)
    FillingSource(store.source("f"), again).read_into(memoryview(out), offset=0)
    assert bytes(out) == store.get("f").data
    assert [e[1:] for e in store.reads.entries] == [(0, SIZE)]  # not whole: one read of it all
    fill.close()
    again.close()


def test_a_part_made_whole_meanwhile_is_never_resumed(tmp_path: Path, store: MemoryStore) -> None:
    """A fill opened after another made the entry whole (its part renamed away) starts a new
    part: it never trusts a journal whose part is gone."""
    fill = fill_of(tmp_path, store)
    FillingSource(store.source("f"), fill).read_into(memoryview(bytearray(SIZE)), offset=0)
    drain()
    assert not os.path.exists(fill.part) and not os.path.exists(fill.journal)
    again = fill_of(tmp_path, store)
    assert again.written.total == 0
    out = bytearray(SIZE)
    FillingSource(store.source("f"), again).read_into(memoryview(out), offset=0)
    assert bytes(out) == store.get("f").data
    fill.close()
    again.close()


def test_a_disk_slower_than_the_store_drops_the_fill_not_the_read(
    tmp_path: Path, store: MemoryStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The rule, from the first byte (its threshold set to 0): where writing a read's bytes takes
    more than a quarter of reading them, the fill is dropped with a log line and the reads go on
    from the store; where the store is slow, it is kept."""
    import logging

    from weightstream.cache import fill as fill_module

    monkeypatch.setattr(fill_module, "_SLOW_AFTER", 0)
    quarter = SIZE // 4
    store.delay = 0.2  # a slow store: the disk keeps up
    slow = fill_of(tmp_path / "slow", store)
    FillingSource(store.source("f"), slow).read_into(memoryview(bytearray(quarter)), offset=0)
    assert not slow.dropped
    slow.close()
    store.delay = 0.0  # a store read is a memcpy: writing to disk is slower than that
    fast = fill_of(tmp_path / "fast", store)
    out = bytearray(SIZE)
    with caplog.at_level(logging.WARNING, logger="weightstream.cache"):
        for offset in range(0, SIZE, quarter):
            FillingSource(store.source("f"), fast).read_into(
                memoryview(out)[offset : offset + quarter], offset=offset
            )
    assert fast.dropped and "slower than the store" in caplog.text
    assert bytes(out) == store.get("f").data  # every read still exact
    fast.close()


def test_a_node_that_finishes_second_removes_its_own_part(tmp_path: Path) -> None:
    """Two nodes fill one file in a folder they share, each in its own part: the first to make
    it whole publishes it, and the second's part and journal go at once (else they would stay
    until pruned), the published bytes untouched."""
    from weightstream.cache.store import key_of

    cache, uri = Cache(str(tmp_path)), "s3://b/model.safetensors"
    data = {node: bytes([n]) * SIZE for n, node in enumerate(("first", "second"))}
    fds = {}
    for node, body in data.items():
        part, journal = cache.fill_paths(key_of(uri), "v1", node=node)
        Path(part).write_bytes(body)
        Path(journal).write_bytes(b"{}\n")
        fds[node] = (part, journal, os.open(part, os.O_RDONLY))
    try:
        assert cache.publish(uri, "v1", SIZE, *fds["first"])
        assert not cache.publish(uri, "v1", SIZE, *fds["second"])
    finally:
        for _, _, fd in fds.values():
            os.close(fd)
    path = cache.whole(uri, "v1", SIZE)
    assert path is not None and Path(path).read_bytes() == data["first"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"{key_of(uri)}{s}" for s in (".safetensors", ".json", ".lock")
    )
