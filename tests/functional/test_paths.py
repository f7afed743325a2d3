"""Every entry that names part of a checkpoint is part of it, and odd file types fail at once.

A folder without an index is every ``*.safetensors`` entry in it; a folder with one is the
shards the index names. Each must open as a regular file. One that cannot (a dangling link in a
half-downloaded cache, a link loop, no permission, a directory, a FIFO, a socket, a device) fails
the load with an error naming it and the real cause, instead of being left out of a load that
then looks complete, or blocking in ``open(2)``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream as ws
from weightstream.errors import (
    FormatError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    WeightStreamError,
)

from ..conftest import write_sharded

CONFIG = ws.StreamConfig(io_timeout=60)


def two_shards(folder: Path, *, index: bool = False) -> list[Path]:
    write_sharded(folder, [{"a": torch.ones(4)}, {"b": torch.zeros(3)}], index=index)
    return sorted(folder.glob("*.safetensors"))


def meta_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weightstream-") and t.is_alive()]


def fails(uri: object, cls: type[WeightStreamError], *fragments: str) -> WeightStreamError:
    with pytest.raises(cls) as info:
        ws.load(uri, config=CONFIG)  # type: ignore[arg-type]
    for frag in fragments:
        assert frag in str(info.value), str(info.value)
    return info.value


# -- symbolic links ---------------------------------------------------------------------------------


def test_a_dangling_second_shard_fails_the_load(tmp_path: Path) -> None:
    """As a model cache does mid-download: the link is there, its blob is not yet."""
    shards = two_shards(tmp_path)
    shards[1].unlink()
    shards[1].symlink_to(tmp_path / "blobs" / "0123abcd")
    err = fails(tmp_path, NotFoundError, "dangling symbolic link", "0123abcd")
    assert err.uri == str(shards[1])


def test_a_symbolic_link_loop_fails_the_load(tmp_path: Path) -> None:
    two_shards(tmp_path)
    (tmp_path / "c.safetensors").symlink_to(tmp_path / "d.safetensors")
    (tmp_path / "d.safetensors").symlink_to(tmp_path / "c.safetensors")
    err = fails(tmp_path, ReadError, "symbolic link loop")
    assert err.uri in (str(tmp_path / "c.safetensors"), str(tmp_path / "d.safetensors"))


def test_a_dangling_index_is_not_replaced_by_a_listing(tmp_path: Path) -> None:
    two_shards(tmp_path, index=True)
    index = tmp_path / "model.safetensors.index.json"
    index.unlink()
    index.symlink_to(tmp_path / "nowhere.json")
    err = fails(tmp_path, NotFoundError, "dangling symbolic link")
    assert err.uri == str(index)


def test_a_dangling_index_shard_is_named(tmp_path: Path) -> None:
    shards = two_shards(tmp_path, index=True)
    shards[0].unlink()
    shards[0].symlink_to(tmp_path / "gone")
    err = fails(tmp_path, NotFoundError, "dangling symbolic link", "model.safetensors.index.json")
    assert err.uri == str(shards[0])


def test_links_to_regular_files_still_load(tmp_path: Path) -> None:
    shards = two_shards(tmp_path / "real")
    linked = tmp_path / "linked"
    linked.mkdir()
    for s in shards:
        (linked / s.name).symlink_to(s)
    assert set(ws.load(linked)) == {"a", "b"}


# -- not a regular file ---------------------------------------------------------------------------


def test_a_directory_named_like_a_shard_fails_the_load(tmp_path: Path) -> None:
    two_shards(tmp_path)
    (tmp_path / "extra.safetensors").mkdir()
    err = fails(tmp_path, NotFoundError, "a directory, not a regular file")
    assert err.uri == str(tmp_path / "extra.safetensors")


def test_an_index_shard_that_is_a_directory_says_so(tmp_path: Path) -> None:
    shards = two_shards(tmp_path, index=True)
    shards[1].unlink()
    shards[1].mkdir()
    err = fails(tmp_path, NotFoundError, "a directory, not a regular file", "index")
    assert "does not exist" not in str(err) and err.uri == str(shards[1])


@pytest.mark.parametrize("where", ["given", "in-folder", "index", "index-shard", "in-list"])
def test_a_fifo_fails_at_once_and_leaves_no_thread_behind(tmp_path: Path, where: str) -> None:
    """``open(2)`` of a FIFO blocks until a writer comes: it must not be called on one."""
    before = set(meta_threads())
    shards = two_shards(tmp_path, index=where.startswith("index"))
    fifo = {
        "given": tmp_path / "pipe.safetensors",
        "in-folder": tmp_path / "pipe.safetensors",
        "index": tmp_path / "model.safetensors.index.json",
        "index-shard": shards[1],
        "in-list": tmp_path / "pipe.safetensors",
    }[where]
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    uri: object = {"given": fifo, "in-list": [shards[0], fifo]}.get(where, tmp_path)
    err = fails(uri, NotFoundError, "FIFO", "not a regular file")
    assert err.uri == str(fifo)
    assert set(meta_threads()) <= before


def test_a_socket_and_a_device_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "sock.safetensors"
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(str(path))
        fails(path, NotFoundError, "a socket, not a regular file")
    fails("/dev/zero", NotFoundError, "a character device, not a regular file")
    fails("/dev/null", NotFoundError, "a character device, not a regular file")


# -- ambiguity --------------------------------------------------------------------------------------


def test_two_index_files_and_no_standard_one_are_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    for name in ("x.safetensors.index.json", "y.safetensors.index.json"):
        (tmp_path / name).write_text('{"weight_map": {"a": "a.safetensors"}}')
    fails(tmp_path, FormatError, "2 index files", "x.safetensors.index.json", "y.safetensors.index.json")


# -- permissions (a real EACCES needs an unprivileged process) ---------------------------------------


def _as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def shared_dir() -> object:
    """A folder any user can reach (pytest's tmp_path is root's alone)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="ws-perm-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


PROLOGUE = """
import os, sys
import weightstream as ws  # imported while still privileged: the interpreter may live under /root
ws.load  # the package imports lazily: the engine (and torch) now, before the privileges go
from weightstream.errors import WeightStreamError
if os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)
try:
    ws.load({uri!r})
except WeightStreamError as e:
    print(type(e).__name__, "|", e.uri, "|", e)
    sys.exit(0)
sys.exit(1)
"""


@pytest.mark.parametrize("what", ["folder", "shard"])
def test_permission_denied_on_a_folder_or_a_shard_is_reported_as_such(shared_dir: Path, what: str) -> None:
    folder = shared_dir / "model"
    shards = two_shards(folder)
    os.chmod(folder, 0o755)
    for s in shards:
        os.chmod(s, 0o644)
    target = folder if what == "folder" else shards[1]
    os.chmod(target, 0o700 if what == "folder" else 0o600)
    out = _as_nobody(PROLOGUE.format(uri=str(folder)))
    assert out.returncode == 0, out.stdout + out.stderr
    kind, uri, message = (x.strip() for x in out.stdout.split("|", 2))
    assert kind == PermissionDeniedError.__name__, out.stdout
    assert uri == str(target)
    assert "holds neither" not in message
