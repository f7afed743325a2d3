from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.engine.plan import make_plan
from weightstream.format.dtypes import DTYPES
from weightstream.format.safetensors import TensorEntry

U8 = DTYPES["U8"]


def layout(sizes: list[int], base: int = 100) -> list[TensorEntry]:
    out, pos = [], base
    for i, n in enumerate(sizes):
        out.append(TensorEntry(f"t{i}", U8, (n,), pos, pos + n, "f"))
        pos += n
    return out


def test_small_neighbours_share_one_block_and_one_read() -> None:
    plan = make_plan([layout([10] * 100)], chunk_size=1 << 20)
    assert len(plan.blocks) == 1 and plan.num_chunks == 1
    assert len(plan.blocks[0].tensors) == 100


def test_a_block_may_join_more_small_tensors_than_one_read_holds() -> None:
    """Blocks larger than reads (an object store's, so a read can grow when it is issued): the
    neighbours fill the block size, and each block is still cut into reads of the chunk size."""
    plan = make_plan([layout([300 << 10] * 20)], chunk_size=1 << 20, block_size=4 << 20)
    assert [len(b.tensors) for b in plan.blocks] == [13, 7]  # 13 x 300 KiB <= 4 MiB < 14 x
    assert plan.chunk_size == 1 << 20
    assert all(0 < c.length <= 1 << 20 for b in plan.blocks for c in b.chunks(plan.chunk_size))
    assert make_plan([layout([300 << 10] * 20)], chunk_size=1 << 20).blocks[0].tensors == tuple(
        layout([300 << 10] * 20)[:3]
    )  # by default a block holds one read's worth


def test_large_tensor_is_its_own_block_cut_in_chunks() -> None:
    plan = make_plan([layout([10, 5 << 20, 10])], chunk_size=1 << 20)
    assert [len(b.tensors) for b in plan.blocks] == [1, 1, 1]
    assert plan.num_chunks == 1 + 6 + 1  # 5 MiB, widened to 4 KiB edges, spans 6 chunks


def test_unselected_gap_splits_blocks() -> None:
    t = layout([100, 100, 100])
    plan = make_plan([[t[0], t[2]]], chunk_size=1 << 20)
    assert [b.tensors for b in plan.blocks] == [(t[0],), (t[2],)]


def test_empty_tensors_need_no_read() -> None:
    plan = make_plan([layout([0, 0])], chunk_size=1 << 20)
    assert plan.num_chunks == 0 and plan.tensor_bytes == 0
    assert sum(len(b.tensors) for b in plan.blocks) == 2


@given(
    st.lists(st.lists(st.integers(0, 300_000), max_size=30), min_size=1, max_size=3),
    st.integers(0, 10_000),
    st.sampled_from([4096, 8192, 65536, 1 << 20, 10_000]),
    st.sampled_from([None, 0, 4096, 100_000, 1 << 20, 4 << 20]),
    st.data(),
)
@settings(max_examples=200, deadline=None)
def test_plan_covers_every_selected_byte_with_aligned_reads(
    files, base, chunk_size, block_size, data
) -> None:
    selected = []
    for sizes in files:
        entries = layout(sizes, base)
        keep = data.draw(st.lists(st.booleans(), min_size=len(entries), max_size=len(entries)))
        selected.append([e for e, k in zip(entries, keep, strict=True) if k])
    plan = make_plan(selected, chunk_size=chunk_size, block_size=block_size)
    run = max(plan.chunk_size, -(-(block_size or 0) // 4096) * 4096)  # a block may join more than one read
    assert plan.tensor_bytes == sum(e.nbytes for f in selected for e in f)
    seen = [t.name for b in plan.blocks for t in b.tensors]
    assert sorted(seen) == sorted(e.name for f in selected for e in f)  # every tensor, once
    for b in plan.blocks:
        assert b.start % 4096 == 0 and b.end % 4096 == 0
        covered = 0
        for c in b.chunks(plan.chunk_size):
            assert c.offset % 4096 == 0 and c.length % 4096 == 0
            assert 0 < c.length <= plan.chunk_size
            assert c.pos == covered and c.offset == b.start + c.pos
            covered += c.length
        assert covered == b.nbytes
        for t in b.tensors:
            if t.nbytes:  # an empty tensor needs no bytes and may sit in an empty block
                assert b.start <= t.start and t.end <= b.end
        if len(b.tensors) > 1:  # grouped tensors are contiguous and fit one chunk (or block)
            assert all(x.end == y.start for x, y in zip(b.tensors, b.tensors[1:], strict=False))
            assert sum(t.nbytes for t in b.tensors) <= run
