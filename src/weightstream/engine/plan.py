"""From selected tensors to a read plan: blocks of destination memory, cut into chunks.

A *block* is one destination allocation: either one tensor larger than a chunk, or a run of
neighbouring small tensors (no unselected bytes between them) up to one chunk in total (or a
larger ``block_size``), so a checkpoint of many tiny tensors costs few reads and few allocations. Tensors of a block are views
into it; the block's memory is freed when the caller has dropped all of them.

Block edges are widened to 4096-byte boundaries of the file, so every read is aligned for
``O_DIRECT`` and the buffer offset of every byte equals its file offset modulo 4096. The widening
reads at most 8 KiB more per block; the end may lie past the end of the file (sources stop there).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from weightstream.format.safetensors import TensorEntry
from weightstream.memory.align import align_down, align_up

__all__ = ["Block", "Chunk", "ReadPlan", "align_down", "align_up", "make_plan"]


@dataclass(frozen=True)
class Chunk:
    """One read request: ``length`` bytes at ``offset`` of the block's file, into ``[pos, pos+length)``
    of the block's buffer."""

    block: int
    offset: int
    length: int
    pos: int


@dataclass(frozen=True)
class Block:
    """One destination allocation: a tensor larger than a read, or a run of neighbouring small
    tensors. ``[start, end)`` is widened to 4096-byte boundaries of the file, so its reads are
    aligned for ``O_DIRECT``; its tensors are placed at their file offset minus ``start``."""

    index: int
    source: int
    """Index of the file in the plan's file list."""
    start: int
    """Aligned absolute file offset of the buffer's first byte."""
    end: int
    """Aligned end (exclusive); may exceed the file size."""
    tensors: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def chunks(self, chunk_size: int) -> Iterator[Chunk]:
        for pos in range(0, self.nbytes, chunk_size):
            yield Chunk(self.index, self.start + pos, min(chunk_size, self.nbytes - pos), pos)


@dataclass(frozen=True)
class ReadPlan:
    """The reads of a load: its blocks in file and offset order, each cut into reads of at most
    ``chunk_size`` (a multiple of 4096) when it is admitted."""

    blocks: tuple[Block, ...]
    chunk_size: int
    tensor_bytes: int
    """Bytes of tensor data selected."""

    @property
    def read_bytes(self) -> int:
        """Bytes of buffer the plan reads into (tensor bytes plus alignment widening)."""
        return sum(b.nbytes for b in self.blocks)

    @property
    def num_chunks(self) -> int:
        return sum(-(-b.nbytes // self.chunk_size) for b in self.blocks)


def make_plan(
    files: Sequence[Sequence[TensorEntry]], *, chunk_size: int, block_size: int | None = None
) -> ReadPlan:
    """Plan the reads for the selected tensors of each file (``files[i]`` lists file i's).

    ``block_size``: the most bytes of neighbouring small tensors joined into one block
    (default: ``chunk_size``). Larger blocks than reads let the engine join a block's reads when
    it issues them (an object store's requests grow with its rate: see
    :meth:`weightstream.tuning.online.Tuning.issue_size`)."""
    chunk_size = align_up(chunk_size)
    run = max(chunk_size, align_up(block_size)) if block_size else chunk_size
    blocks: list[Block] = []
    total = 0

    def close(source: int, group: list[TensorEntry]) -> None:
        start = align_down(group[0].start)
        end = align_up(group[-1].end) if group[-1].end > group[0].start else start
        blocks.append(Block(len(blocks), source, start, end, tuple(group)))

    for source, entries in enumerate(files):
        group: list[TensorEntry] = []
        group_bytes = 0
        for entry in sorted(entries, key=lambda e: (e.start, e.end)):
            total += entry.nbytes
            joins = group and entry.start == group[-1].end and group_bytes + entry.nbytes <= run
            if group and not joins:
                close(source, group)
                group, group_bytes = [], 0
            group.append(entry)
            group_bytes += entry.nbytes
        if group:
            close(source, group)
    return ReadPlan(tuple(blocks), chunk_size, total)
