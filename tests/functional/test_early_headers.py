"""The headers beside an index are read while the index is read, and that changes nothing a load
says or does: where every read is a round trip (NFS, an object store), the index's answer and the
headers' arrive together instead of one after the other.

The rule, tested here: the files the index names are opened early; every other file beside it
is closed again (or never opened, when it is not a regular file), whatever it holds; a shard
that fails early is opened again by the ordinary path, so its error is the ordinary one.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import weightstream as ws
from weightstream import checkpoint as checkpoint_module
from weightstream.errors import FormatError
from weightstream.memory import room as room_module
from weightstream.sources import file as file_module
from weightstream.sources.file import FileBackend

from ..conftest import assert_same, write_sharded

CONFIG = ws.StreamConfig(io_timeout=30)


def tensors(n: int) -> list[dict[str, torch.Tensor]]:
    return [{f"t{i}": torch.arange(16, dtype=torch.float32) + i} for i in range(n)]


def open_paths(folder: Path) -> list[str]:
    """Files under ``folder`` this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return out


def test_the_headers_are_read_while_the_index_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index's read waits (up to 10 s) for a shard's header to be read: with the headers read
    early it sees one at once; read after the index, none could come and the flag stays unset."""
    want = write_sharded(tmp_path, tensors(3))
    header_read = threading.Event()
    seen_during_index: list[bool] = []
    real_open_shard = checkpoint_module.open_shard
    real_read_all = FileBackend.read_all

    def open_shard(*args, **kwargs):  # type: ignore[no-untyped-def]
        shard = real_open_shard(*args, **kwargs)
        header_read.set()
        return shard

    def read_all(self, location, *args, **kwargs):  # type: ignore[no-untyped-def]
        if location.name.endswith(".index.json"):
            seen_during_index.append(header_read.wait(10))
        return real_read_all(self, location, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "open_shard", open_shard)
    monkeypatch.setattr(FileBackend, "read_all", read_all)
    assert_same(ws.load(tmp_path, config=CONFIG), want)
    assert seen_during_index == [True]


def test_files_beside_the_index_that_it_does_not_name_change_nothing(tmp_path: Path) -> None:
    want = write_sharded(tmp_path, tensors(2))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)  # no header at all
    (tmp_path / "short.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{")  # cut off
    (tmp_path / "dir.safetensors").mkdir()
    os.mkfifo(tmp_path / "pipe.safetensors")  # an open(2) of it would block
    (tmp_path / "dangling.safetensors").symlink_to(tmp_path / "gone")
    got = ws.load(tmp_path, config=CONFIG)
    assert_same(got, want)
    assert open_paths(tmp_path) == []
    with ws.open_checkpoint(tmp_path, config=CONFIG) as ckpt:
        # Only the index's shards are held open: one buffered and one O_DIRECT descriptor each
        # at most, none for the other files.
        held = open_paths(tmp_path)
        assert held and all(Path(p).name.startswith("model-") for p in held), held
        assert sorted(s.location.name for s in ckpt.shards) == sorted(
            p.name for p in tmp_path.glob("model-*.safetensors")
        )
    assert open_paths(tmp_path) == []


@pytest.mark.parametrize("damage", ["bad-prefix", "cut-header", "directory", "fifo"])
def test_an_indexed_shard_that_fails_early_fails_in_the_ordinary_words(tmp_path: Path, damage: str) -> None:
    """The error is the one the same shard gives when the index is read without a listing
    (the index file named directly: no early reads)."""
    write_sharded(tmp_path, tensors(3))
    shard = tmp_path / "model-00002-of-00003.safetensors"
    shard.unlink()
    if damage == "bad-prefix":
        shard.write_bytes(b"\xff" * 64)
    elif damage == "cut-header":
        shard.write_bytes((10**6).to_bytes(8, "little") + b'{"a":')
    elif damage == "directory":
        shard.mkdir()
    else:
        os.mkfifo(shard)
    with pytest.raises(ws.errors.WeightStreamError) as from_folder:
        ws.load(tmp_path, config=CONFIG)
    with pytest.raises(ws.errors.WeightStreamError) as from_index:
        ws.load(tmp_path / "model.safetensors.index.json", config=CONFIG)
    assert type(from_folder.value) is type(from_index.value)
    assert str(from_folder.value) == str(from_index.value)
    assert from_folder.value.uri == str(shard)
    if damage in ("bad-prefix", "cut-header"):
        assert isinstance(from_folder.value, FormatError)
    assert open_paths(tmp_path) == []


def test_an_index_that_fails_closes_every_shard_opened_early(tmp_path: Path) -> None:
    write_sharded(tmp_path, tensors(4))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": 1}}')
    with pytest.raises(FormatError):
        ws.load(tmp_path, config=CONFIG)
    assert open_paths(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name == "weightstream-early-headers" and t.is_alive()]


def test_a_checkpoint_on_a_network_file_system_loads_with_the_deeper_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mount table is read by ``network_file_system`` (tests/unit/test_network_fs.py); here
    the folder is taken to be on NFS and the load runs with the network depth, bit-exact."""
    want = write_sharded(tmp_path, tensors(3))
    monkeypatch.setattr(
        file_module,
        "network_file_system",
        lambda path: "nfs4" if str(path).startswith(str(tmp_path)) else None,
    )
    # a host of 1 TiB with 4 ranks of a launcher on it: 8 GiB in flight a rank
    monkeypatch.setattr(room_module, "available_bytes", lambda: (1 << 40, "test"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with ws.open_checkpoint(tmp_path) as ckpt:
        assert ckpt.network_fs == "nfs4"
        assert ckpt.defaults(ws.StreamConfig()).concurrency == 128
        assert ckpt.defaults(ws.StreamConfig(concurrency=8)).concurrency == 8
        assert_same(ckpt.load(), want)
        assert ckpt.last_stats is not None
        assert ckpt.last_stats.tuning is not None and ckpt.last_stats.tuning["start_depth"] == 128
        assert ckpt.last_stats.settings["memory_limit"] == 8 << 30
        with ckpt.stream(config=ws.StreamConfig(memory_limit=1 << 30)) as s:  # chosen: kept
            assert_same(dict(s), want)
        assert s.stats.settings["memory_limit"] == 1 << 30
    # a load into a device's memory keeps the default memory (no host memory offered: the
    # framework sizes its caches by it); the processes are still counted (a node's bandwidth cap)
    assert room_module.loading_share(False) == (0, 4)
    assert room_module.loading_share(True)[1] == 4
