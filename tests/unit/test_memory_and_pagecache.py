from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest
import torch

from weightstream.memory.buffers import ALIGN, HUGE_PAGE, allocate
from weightstream.sources import _pagecache

from ..conftest import drop_from_page_cache


@pytest.mark.parametrize(
    "nbytes", [1, 4095, 4096, 100_000, HUGE_PAGE, HUGE_PAGE + 4096, 23 * HUGE_PAGE + 12345]
)
def test_buffers_are_aligned_and_writable(nbytes: int) -> None:
    tensor, view = allocate(nbytes)
    assert tensor.numel() == nbytes == len(view) and tensor.dtype == torch.uint8
    assert tensor.data_ptr() % ALIGN == 0
    if nbytes >= HUGE_PAGE:  # huge-page aligned, so no huge page is lost at either end
        assert tensor.data_ptr() % HUGE_PAGE == 0
    view[-1:] = b"\x07"  # the view and the tensor are the same memory
    assert int(tensor[-1]) == 7


def test_a_view_keeps_its_buffer_alive() -> None:
    tensor, view = allocate(4 * HUGE_PAGE)
    tensor.fill_(3)
    part = tensor[HUGE_PAGE : HUGE_PAGE + 8].view(torch.int64)
    del tensor, view
    gc.collect()
    assert part.tolist() == [0x0303030303030303]


@pytest.fixture
def cached_file(tmp_path: Path) -> Path:
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(4 << 20))
    with open(p, "rb") as fh:
        fh.read()
    return p


def fractions(path: Path, offset: int, length: int) -> list[float | None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = [_pagecache._mincore(fd, offset, length), _pagecache.resident_fraction(fd, offset, length)]
        if _pagecache._have_cachestat:
            out.append(_pagecache._cachestat(fd, offset, length))
        return out
    finally:
        os.close(fd)


def test_residency_of_a_cached_file(cached_file: Path) -> None:
    assert fractions(cached_file, 0, 4 << 20) == pytest.approx(
        [1.0] * len(fractions(cached_file, 0, 4 << 20))
    )


def test_residency_after_eviction(cached_file: Path) -> None:
    drop_from_page_cache(cached_file)
    assert all(f == 0.0 for f in fractions(cached_file, 0, 4 << 20))


def test_residency_of_half_a_file(cached_file: Path) -> None:
    drop_from_page_cache(cached_file, 2 << 20, 2 << 20)
    exact = fractions(cached_file, 0, 4 << 20)
    assert exact[0] == pytest.approx(0.5)  # mincore, every page
    assert exact[1] == pytest.approx(0.5, abs=0.15)  # sampled estimate
    assert fractions(cached_file, 0, 1 << 20)[0] == 1.0
    assert fractions(cached_file, 3 << 20, 1 << 20)[0] == 0.0


def test_mincore_fallback_loads_the_same(
    cached_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import save_file

    import weightstream as ws

    p = tmp_path / "m.safetensors"
    t = torch.arange(300_000, dtype=torch.float32)
    save_file({"t": t}, str(p))
    monkeypatch.setattr(_pagecache, "_have_cachestat", False)
    s = ws.stream(p, config=ws.StreamConfig(chunk_size=64 << 10))
    got = dict(s)
    assert torch.equal(got["t"], t) and s.stats.cached_bytes == s.stats.bytes_read


def test_a_read_lease_never_signals_this_process(tmp_path: Path) -> None:
    """A lease's break would send SIGIO (its default ends the process) to the lease's owner:
    the lease is taken with the break's signal set to SIGURG (ignored by default) and its
    owner cleared, and a writer's open, waiting for the lease, leaves this process running."""
    import fcntl
    import signal
    import subprocess
    import sys

    from weightstream.localfs import open_for_writing, read_lease

    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    assert open_for_writing(str(path)) is False
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_lease(fd) is True
        assert fcntl.fcntl(fd, 11) == signal.SIGURG  # F_GETSIG
        assert fcntl.fcntl(fd, fcntl.F_GETOWN) == 0
        writer = subprocess.Popen([sys.executable, "-c", f"open({str(path)!r}, 'r+b')"])
        deadline = time.monotonic() + 10
        while fcntl.fcntl(fd, 1025) == fcntl.F_RDLCK and time.monotonic() < deadline:  # F_GETLEASE
            time.sleep(0.01)
        assert fcntl.fcntl(fd, 1025) == fcntl.F_UNLCK  # breaking: the writer waits, nothing signalled
    finally:
        os.close(fd)  # gives the lease back: the writer goes on
    assert writer.wait(10) == 0
    with open(path, "r+b"):
        assert open_for_writing(str(path)) is True
