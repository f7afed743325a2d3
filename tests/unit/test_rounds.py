"""The split of a read plan into rounds and per-rank parts (pure; no process group)."""

from __future__ import annotations

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
    rounds = make_rounds(plan, world, target=target_pages * ALIGN, first=first_pages * ALIGN)
    # Rounds hold whole blocks, in order, each block exactly once.
    assert [b for r in rounds for b in r.blocks] == list(plan.blocks)
    for k, r in enumerate(rounds):
        # the first rounds small, each twice the last, up to the target
        cap = min(target_pages, first_pages << min(k, 20)) * ALIGN
        assert r.nbytes <= max(cap, max(b.nbytes for b in r.blocks))
        if k + 1 < len(rounds):  # a round ends only where the next block would not fit
            assert r.nbytes + rounds[k + 1].blocks[0].nbytes > cap
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
