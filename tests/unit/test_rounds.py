"""The split of a read plan into rounds and per-rank parts (pure; no process group)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.distributed import make_rounds
from weightstream.engine.plan import Block, ReadPlan
from weightstream.memory.buffers import ALIGN


def plan_of(sizes: list[int]) -> ReadPlan:
    blocks, start = [], 0
    for i, pages in enumerate(sizes):
        blocks.append(Block(i, i % 3, start, start + pages * ALIGN, ()))
        start += pages * ALIGN
    return ReadPlan(tuple(blocks), 16 * ALIGN, start)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), max_size=40),
    world=st.integers(1, 8),
    target_pages=st.integers(1, 200),
    first_pages=st.integers(1, 200),
)
def test_every_byte_is_read_by_exactly_one_rank_and_parts_balance(
    sizes: list[int], world: int, target_pages: int, first_pages: int
) -> None:
    plan = plan_of(sizes)
    target, first = target_pages * ALIGN, first_pages * ALIGN
    rounds = make_rounds(plan, world, target=target, first=first)
    # Rounds hold whole blocks, each block exactly once, each round's in plan order.
    assert sorted(b.index for r in rounds for b in r.blocks) == list(range(len(plan.blocks)))
    assert all(list(r.blocks) == sorted(r.blocks, key=lambda b: b.index) for r in rounds)
    for r in rounds:
        assert r.nbytes <= max(target, max(b.nbytes for b in r.blocks))
    # The point of the small first rounds: a large first block does not make a large first round.
    if any(b.nbytes <= first for b in plan.blocks) and first < target:
        assert rounds[0].nbytes <= first
    # After the ramp (at most one round per doubling of `first` up to `target`), the rounds take
    # the blocks left in plan order, each ending only where the next block would not fit.
    ramp = 0
    while first << ramp < target:
        ramp += 1
    tail = rounds[ramp:]
    blocks = [b for r in tail for b in r.blocks]
    assert blocks == sorted(blocks, key=lambda b: b.index)
    for r, after in itertools.pairwise(tail):
        assert r.nbytes + after.blocks[0].nbytes > target
    for r in rounds:
        assert r.part % ALIGN == 0 and world * r.part >= r.nbytes
        assert world * r.part - r.nbytes < world * ALIGN  # balanced to a page per rank
        covered: list[tuple[int, int]] = []
        for rank in range(world):
            got = 0
            for i, start, end, pos in r.extents(rank):
                block = r.blocks[i]
                assert block.start <= start < end <= block.end
                assert start % ALIGN == 0 and pos % ALIGN == 0
                # The buffer position of a file byte is where the gathered round expects it.
                assert pos == r.positions[i] + (start - block.start)
                assert rank * r.part <= pos and pos + (end - start) <= (rank + 1) * r.part
                covered.append((pos, pos + end - start))
                got += end - start
            assert got <= r.part
        covered.sort()
        # Together the ranks cover the round's bytes exactly once, with no gap.
        edge = 0
        for a, b in covered:
            assert a == edge
            edge = b
        assert edge == r.nbytes
