"""Shared helpers: checkpoint writers (the safetensors library's own writer, and raw bytes for
malformed files) and a bit-for-bit comparison."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ALL_TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
    torch.complex64,
]
"""Every dtype safetensors can store that torch can hold."""


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: every bit pattern, NaNs included, must survive a load."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def flip(path: Path, offset: int) -> None:
    """Flip one bit of byte ``offset`` of the file at ``path`` (a disk or a copy gone bad)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes, bit for bit."""
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert tuple(g.shape) == tuple(w.shape), name
        assert g.device.type == "cpu"
        assert torch.equal(as_bytes(g), as_bytes(w)), f"bytes differ in {name}"


def write_raw(path: Path, header: object | bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    """A file with an arbitrary header (a JSON-able object or raw bytes) and data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def hub_metadata(folder: Path) -> None:
    """What the Hub's client keeps beside a ``--local-dir`` download: each ``.safetensors``
    file's SHA-256 (which loads check), in ``.cache/huggingface/download/*.metadata``."""
    meta = folder / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.safetensors"):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        (meta / f"{f.name}.metadata").write_text(f"{'b' * 40}\n{sha}\n1764979200.0\n")


def write_sharded(
    folder: Path, shards: list[dict[str, torch.Tensor]], *, index: bool = True
) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, everything = {}, {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update(dict.fromkeys(shard, name))
        everything.update(shard)
    if index:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        )
    return everything


def drop_from_page_cache(path: Path | str, offset: int = 0, length: int = 0) -> None:
    """Evict a file's pages (no root needed), so the next read goes to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def reference(path: Path | str) -> dict[str, torch.Tensor]:
    """The safetensors library's reading, copied out of its mmap of the file (a mapping would
    pin the file's pages in the page cache and defeat drop_from_page_cache)."""
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def reference_folder(folder: Path) -> dict[str, torch.Tensor]:
    """:func:`reference` of every ``*.safetensors`` file of a folder, merged."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(reference(f))
    return out


@pytest.fixture(autouse=True)
def own_checks_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each test keeps the checks its loads passed (``checks_dir``) in a folder of its own, so
    that no test finds a record another left: through the environment (``from_env``, child
    processes) and through ``auto``'s ``$XDG_CACHE_HOME`` (a ``StreamConfig`` made in the test).
    vLLM's tests keep ``$XDG_CACHE_HOME``: vLLM caches its compiled graphs there."""
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("checks")
    mp.setenv("WEIGHTSTREAM_CHECKS_DIR", str(folder / "weightstream" / "checks"))
    if "tests/vllm/" not in str(request.node.path).replace(os.sep, "/"):
        mp.setenv("XDG_CACHE_HOME", str(folder))
    request.addfinalizer(mp.undo)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("WEIGHTSTREAM_", "RUNAI_STREAMER_")):
            monkeypatch.delenv(key)


def accepted(server: socket.socket) -> Iterator[socket.socket]:
    """Each connection a listening socket accepts, until the socket is closed (a test's server
    loop: ``for conn in accepted(server): ...``)."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        yield conn


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_listening(
    port: int, *, what: str, timeout: float = 30, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Return once something accepts connections on ``port``; fail after ``timeout`` seconds, or
    as soon as ``proc`` (the server's process, if any) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.05)
