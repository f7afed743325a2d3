"""Failures: one clear error naming the file and range, nothing half-loaded, no hang, no leaked threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream as ws
from weightstream.config import KiB
from weightstream.engine.plan import make_plan
from weightstream.engine.scheduler import run_plan
from weightstream.errors import (
    FormatError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    StorageTimeoutError,
    WeightStreamError,
)
from weightstream.sources.file import FileSource

from ..conftest import random_tensor


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weightstream-io")]


def wait_for_no_io_threads(deadline_s: float = 10.0) -> bool:
    end = time.monotonic() + deadline_s
    while io_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return not io_threads()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    p = tmp_path / "m.safetensors"
    save_file({f"w{i:02d}": random_tensor((64 * KiB,), torch.uint8, seed=i) for i in range(32)}, str(p))
    return p


def test_missing_path_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError) as info:
        ws.load(tmp_path / "nope.safetensors")
    assert isinstance(info.value, FileNotFoundError)
    assert "nope.safetensors" in str(info.value)


def test_folder_without_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="neither"):
        ws.load(tmp_path)


def test_unsupported_scheme_is_clear() -> None:
    with pytest.raises(WeightStreamError, match="scheme 'hdfs'"):
        ws.load("hdfs://cluster/model")


def test_file_truncated_during_load_fails_with_range(ckpt: Path) -> None:
    """The header was valid when read; the file shrinks mid-load: a ReadError, not garbage."""
    config = ws.StreamConfig(chunk_size=64 * KiB, concurrency=1, memory_limit=64 * KiB)
    s = ws.stream(ckpt, config=config)
    got = [next(s)]
    with open(ckpt, "r+b") as fh:
        fh.truncate(ckpt.stat().st_size // 2)
    with pytest.raises(ReadError) as info:
        got.extend(s)
    err = info.value
    assert str(ckpt) in str(err) and "short read" in str(err)
    assert err.byte_range is not None and err.byte_range[1] > ckpt.stat().st_size
    assert not s.stats.complete
    assert wait_for_no_io_threads()


def test_file_replaced_after_headers_were_read(ckpt: Path) -> None:
    checkpoint = ws.open_checkpoint(ckpt)
    with open(ckpt, "ab") as fh:
        fh.write(b"x" * 100)
    with pytest.raises(FormatError, match="changed since its header was read"):
        checkpoint.load()


def _rewrite_in_place_keeping_times(path: Path) -> None:
    """Same size, other bytes, and the modification time put back (``touch -d``, ``cp -p``)."""
    st = path.stat()
    time.sleep(0.01)  # a change time the clock can tell apart
    with open(path, "r+b") as fh:
        fh.seek(st.st_size - 4096)
        fh.write(b"\xff" * 4096)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_a_file_rewritten_in_place_with_its_time_put_back_is_noticed(ckpt: Path) -> None:
    checkpoint = ws.open_checkpoint(ckpt)
    _rewrite_in_place_keeping_times(ckpt)
    with pytest.raises(FormatError, match="changed since its header was read"):
        checkpoint.load()


def test_a_slice_checks_the_file_is_the_one_validated_as_get_tensor_does(ckpt: Path) -> None:
    with ws.safe_open(ckpt) as f:
        name = f.keys()[-1]
        assert f.get_slice(name)[:10].numel() == 10
        _rewrite_in_place_keeping_times(ckpt)
        with pytest.raises(FormatError, match="changed since its header was read"):
            f.get_slice(name)[:10]
        with pytest.raises(FormatError, match="changed since its header was read"):
            f.get_tensor(name)


def test_load_returns_nothing_when_a_shard_fails(tmp_path: Path) -> None:
    save_file({"a": torch.ones(10)}, str(tmp_path / "a.safetensors"))
    save_file({"b": torch.ones(10)}, str(tmp_path / "b.safetensors"))
    checkpoint = ws.open_checkpoint(tmp_path)
    os.remove(tmp_path / "b.safetensors")
    with pytest.raises(NotFoundError, match=r"b\.safetensors"):
        checkpoint.load()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_permission_denied(tmp_path: Path) -> None:
    """A real EACCES: a root-only file read by a process that has dropped to 'nobody'."""
    folder = Path("/tmp") / f"ws-perm-{os.getpid()}"
    folder.mkdir(mode=0o755, exist_ok=True)
    p = folder / "secret.safetensors"
    try:
        save_file({"a": torch.ones(4)}, str(p))
        os.chmod(p, 0o600)
        code = textwrap.dedent(
            f"""
            import os, sys
            import weightstream as ws  # import while still root: the interpreter lives under /root
            ws.load  # the package imports lazily: the engine (and torch) now, before the privileges go
            from weightstream.errors import PermissionDeniedError
            os.setgid(65534); os.setuid(65534)
            try:
                ws.load({str(p)!r})
            except PermissionDeniedError as e:
                assert isinstance(e, PermissionError)
                print("DENIED", e)
                sys.exit(0)
            sys.exit(1)
            """
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "DENIED" in out.stdout and str(p) in out.stdout
    finally:
        p.unlink(missing_ok=True)
        folder.rmdir()


class StallingSource:
    """A real Source whose reads stall after the first few, like a hung NFS server."""

    def __init__(self, inner: FileSource, good_reads: int, stall_s: float) -> None:
        self.inner, self.uri, self.size = inner, inner.uri, inner.size
        self.good, self.stall_s = good_reads, stall_s
        self.lock = threading.Lock()

    def read_prefix(self, length: int) -> bytes:
        return self.inner.read_prefix(length)

    def read_into(self, buf: memoryview, *, offset: int):  # type: ignore[no-untyped-def]
        with self.lock:
            self.good -= 1
            stall = self.good < 0
        if stall:
            time.sleep(self.stall_s)
        return self.inner.read_into(buf, offset=offset)

    def close(self) -> None:
        self.inner.close()


def test_stalled_reads_time_out_with_the_range(ckpt: Path) -> None:
    checkpoint = ws.open_checkpoint(ckpt)
    entries = list(checkpoint.tensors.values())
    config = ws.StreamConfig(chunk_size=64 * KiB, concurrency=2, io_timeout=0.3)
    plan = make_plan([entries], chunk_size=config.chunk_size)
    source = StallingSource(FileSource(str(ckpt)), good_reads=3, stall_s=2.0)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError) as info:
        for _ in run_plan(plan, [source], config):
            pass
    assert time.monotonic() - started < 1.9  # gave up at the timeout, not when the stall ended
    assert str(ckpt) in str(info.value) and info.value.byte_range is not None
    assert isinstance(info.value, TimeoutError)
    source.close()


def test_early_close_stops_workers(ckpt: Path) -> None:
    s = ws.stream(ckpt, config=ws.StreamConfig(chunk_size=64 * KiB, concurrency=4, memory_limit=128 * KiB))
    next(s)
    assert io_threads()
    s.close()
    assert wait_for_no_io_threads()


def test_errors_pickle_with_their_attributes() -> None:
    import pickle

    err = ReadError("boom", uri="/x", tensor="t", byte_range=(1, 2))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ReadError and str(back) == str(err) and back.byte_range == (1, 2)


def test_permission_error_class_is_also_builtin() -> None:
    assert issubclass(PermissionDeniedError, PermissionError)
    assert issubclass(NotFoundError, FileNotFoundError)
    assert issubclass(StorageTimeoutError, TimeoutError)


class SlowSource(StallingSource):
    """Every read takes ``delay`` seconds: slow storage that is still moving."""

    def read_into(self, buf: memoryview, *, offset: int):  # type: ignore[no-untyped-def]
        time.sleep(self.stall_s)
        return self.inner.read_into(buf, offset=offset)


def test_slow_but_moving_storage_does_not_time_out(tmp_path: Path) -> None:
    """One big block whose chunks each take 0.15 s, 1.2 s in all, under a 0.5 s io_timeout: the
    timeout is about progress, not about how long a block takes."""
    p = tmp_path / "big.safetensors"
    save_file({"big": random_tensor((8 * 64 * KiB,), torch.uint8)}, str(p))
    checkpoint = ws.open_checkpoint(p)
    config = ws.StreamConfig(chunk_size=64 * KiB, concurrency=1, io_timeout=0.5)
    plan = make_plan([list(checkpoint.tensors.values())], chunk_size=config.chunk_size)
    assert len(plan.blocks) == 1 and plan.num_chunks >= 8
    source = SlowSource(FileSource(str(p)), good_reads=0, stall_s=0.15)
    blocks = list(run_plan(plan, [source], config))
    assert len(blocks) == 1
    source.close()


def test_more_shards_than_the_open_files_limit_allows_load(tmp_path: Path) -> None:
    """1,200 shards under a hard limit of 1,024 descriptors (two per shard were held for the whole
    load): idle shards give theirs back and reopen by path, checked to be the same file."""
    import subprocess
    import sys
    import textwrap

    from ..conftest import write_sharded

    n = 1200
    write_sharded(
        tmp_path / "m", [{f"t{i}": random_tensor((300 + i,), torch.float32, seed=i)} for i in range(n)]
    )
    code = textwrap.dedent(
        f"""
        import os, resource, torch
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        import weightstream as ws
        from safetensors.torch import load_file
        from tests.conftest import drop_from_page_cache
        folder = {str(tmp_path / "m")!r}
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        want = {{}}
        for f in files:
            want.update(load_file(os.path.join(folder, f)))
        for f in files:
            drop_from_page_cache(os.path.join(folder, f))
        for how in ("cold", "hot"):
            got = ws.load(folder)
            same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN payloads too
            assert set(got) == set(want) and all(same(got[k], want[k]) for k in want), how
        ckpt = ws.open_checkpoint(folder)  # every shard opened; most of them gave their descriptors back
        victim = os.path.join(folder, files[0])
        os.replace(victim, victim + ".old")
        os.link(victim + ".old", victim + ".tmp")
        with open(victim + ".tmp", "rb") as src, open(victim, "wb") as dst:
            dst.write(src.read())  # the same bytes, another file
        try:
            ckpt.load()
        except ws.errors.FormatError as exc:
            assert "changed since its header was read" in str(exc), exc
        else:
            raise AssertionError("a shard replaced under the checkpoint was read")
        print("ok")
        """
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
