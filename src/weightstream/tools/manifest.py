"""``weightstream manifest``: read a checkpoint once and write its manifest, a CRC32C per piece
of each file (:mod:`weightstream.format.manifest`), which later loads check their bytes
against. Pieces are read in parallel, each into a buffer of its own, through the checkpoint's
own sources (any backend)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from weightstream.checkpoint import Checkpoint
from weightstream.errors import ReadError
from weightstream.format.manifest import CRC32C, PIECE_SIZE, FileDigest
from weightstream.memory.buffers import allocate

__all__ = ["digests"]


def digests(
    ckpt: Checkpoint,
    *,
    piece_size: int = PIECE_SIZE,
    workers: int = 8,
    on_bytes: Callable[[int], None] | None = None,
) -> list[FileDigest]:
    """Every shard's checksums, by reading each piece once (``workers`` at a time, each with a
    buffer of ``piece_size`` bytes)."""
    local = threading.local()

    def piece(job: tuple[int, int]) -> int:
        s, i = job
        shard = ckpt.shards[s]
        start = i * piece_size
        length = min(piece_size, shard.size - start)
        buf = getattr(local, "view", None)
        if buf is None:  # one buffer per worker thread, kept (the tensor keeps its memory)
            local.tensor, buf = allocate(piece_size)
            local.view = buf
        view = buf[: -(-length // 4096) * 4096]
        n, _ = shard.source.read_into(view, offset=start)
        if n != length:
            raise ReadError(
                f"read {n} bytes of {length}", uri=shard.location.uri, byte_range=(start, start + length)
            )
        if on_bytes is not None:
            on_bytes(n)
        return CRC32C.of(view[:n])

    jobs = [(s, i) for s, shard in enumerate(ckpt.shards) for i in range(-(-shard.size // piece_size))]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightstream-manifest") as pool:
        crcs = list(pool.map(piece, jobs))
    out, pos = [], 0
    for shard in ckpt.shards:
        n = -(-shard.size // piece_size)
        pieces = tuple(crcs[pos : pos + n])
        pos += n
        whole = 0
        for i, c in enumerate(pieces):
            whole = CRC32C.combine(whole, c, min(piece_size, shard.size - i * piece_size))
        out.append(FileDigest(shard.location.name, shard.size, whole, piece_size, pieces))
    return out
