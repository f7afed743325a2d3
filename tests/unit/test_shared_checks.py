"""A checked load split among ranks (pure; no process group): the bytes each rank checks, and
CRCs handed between the ranks' checks, as :mod:`weightstream.distributed` hands them in its
status records. ``tests/distributed/test_distributed_checks.py`` runs the same on a real group."""

from __future__ import annotations

import itertools
import random
from typing import Any

import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.distributed import _CRC, _Checks, _owned, make_rounds
from weightstream.engine.plan import Block, ReadPlan
from weightstream.engine.verify import Verifier
from weightstream.errors import FormatError
from weightstream.format.manifest import FileDigest
from weightstream.format.ranges import Ranges
from weightstream.memory.buffers import ALIGN


def layout(rng: random.Random, size: int, header: int) -> ReadPlan:
    """Blocks as a plan makes them: from tensor boundaries anywhere, widened to pages, so
    neighbouring blocks share a page wherever a boundary is not page-aligned."""
    cuts = sorted({header, size, *(rng.randrange(header, size) for _ in range(rng.randint(0, 12)))})
    blocks = []
    for a, b in itertools.pairwise(cuts):
        blocks.append(Block(len(blocks), 0, a - a % ALIGN, -(-b // ALIGN) * ALIGN, ()))
    return ReadPlan(tuple(blocks), 4 * ALIGN, size - header)


class Heard:
    """What a status exchange leaves on :class:`~weightstream.distributed.GroupExchange`."""

    def __init__(self, packets: list[tuple[bytes, bool, bool]]) -> None:
        self.heard = [([c for c in _CRC.iter_unpack(raw)], more, checking) for raw, more, checking in packets]


@given(
    st.integers(3 * ALIGN, 60 * ALIGN),
    st.integers(1, 5),
    st.integers(0, 2**32),
    st.sampled_from([ALIGN, 3 * ALIGN, 16 * ALIGN, 1 << 30]),
    st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_ranks_that_each_read_a_part_all_check_every_piece(
    size: int, world: int, seed: int, piece: int, corrupt: bool
) -> None:
    """Ranks read their parts (neighbouring blocks sharing pages, reads in any order), send the
    CRCs of each round once it is gathered (in any order, as many per status as a record holds)
    and may stop exchanging and read the rest themselves: every rank checks every piece, and a
    changed byte fails every rank, naming its piece."""
    rng = random.Random(seed)
    header = rng.randint(9, 2 * ALIGN)
    data = bytearray(rng.getrandbits(8) for _ in range(size))
    data[:8] = (header - 8).to_bytes(8, "little")
    pieces = tuple(crc32c.crc32c(bytes(data[a : a + piece])) for a in range(0, size, piece))
    digest = FileDigest("f", size, crc32c.crc32c(bytes(data)), min(piece, 1 << 30), pieces)
    bad = rng.randrange(header, size) if corrupt else -1
    if bad >= 0:
        data[bad] ^= 1
    plan = layout(rng, size, header)
    rounds = make_rounds(plan, world, target=rng.randint(1, 12) * ALIGN, first=rng.randint(1, 12) * ALIGN)

    # Each byte past the header is checked by exactly one rank: by the first part holding it.
    owned = _owned(rounds, world, {0: header})
    mine = Ranges()
    for per in owned:
        for ranges in per:
            for _, a, b in ranges:
                assert mine.gaps(a, b) == [(a, b)], "checked by two"
                mine.add(a, b)
    read = Ranges()
    for rd in rounds:
        for r in range(world):
            for _, a, b, _ in rd.extents(r):
                read.add(max(a, header), b)
    assert (mine.starts, mine.ends) == (read.starts, read.ends)

    # Ranks, each with the file's first bytes (more than its header) as read at open.
    prefix = bytes(data[: header + rng.randint(0, ALIGN)])
    verifiers = [Verifier("f", digest, prefix, hold_max=1 << 40, shared=True) for _ in range(world)]
    checks = [_Checks({0: v}, rounds, world, r) for r, v in enumerate(verifiers)]
    failed: list[list[tuple[int, int] | None]] = [[] for _ in range(world)]

    def run(r: int, step: Any) -> None:
        try:
            step()
        except FormatError as exc:
            failed[r].append(exc.byte_range)

    for r, v in enumerate(verifiers):  # each rank's reads, in any order
        reads = [(a, b) for rd in rounds for _, a, b, _ in rd.extents(r)]
        rng.shuffle(reads)
        for a, b in reads:
            run(r, lambda v=v, a=a, b=b: v.add(memoryview(data)[a : min(b, size)], a))
    order = list(range(len(rounds)))
    rng.shuffle(order)  # rounds are gathered in the order every rank has its part
    stop = rng.choice([len(order), rng.randint(0, len(order))])  # the ranks may stop exchanging
    for k in order[:stop]:
        for c in checks:
            c.gathered(k)
        while True:  # status exchanges until every rank has sent all it has
            heard = Heard([c.packet() for c in checks])
            more = [c.heard(heard) for c in checks]  # type: ignore[arg-type]
            for r, c in enumerate(checks):
                run(r, c.apply)
            assert len(set(more)) == 1
            if not more[0]:
                break
    todo = order[stop:]
    for r, (v, c) in enumerate(zip(verifiers, checks, strict=True)):
        run(r, lambda c=c: c.stop(todo))
        for k in todo:  # each rank reads the rest of every round not gathered itself
            for other in range(world):
                for _, a, b, _ in rounds[k].extents(other):
                    run(r, lambda v=v, a=a, b=b: v.add(memoryview(data)[a : min(b, size)], a))
    if corrupt:
        want = (bad - bad % piece, min(size, bad - bad % piece + piece))
        assert all(f == [want] for f in failed), failed
        return
    assert failed == [[] for _ in range(world)]
    for v in verifiers:
        covered = header + read.total
        if covered == size:  # the plan reads every byte: every piece checked, on every rank
            assert (v.checked_bytes, v.unchecked) == (size, 0)
        assert v.passed() == []  # other ranks read part of the bytes: nothing recorded


@given(sizes=st.lists(st.integers(1, 10**12), max_size=40), world=st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_each_file_hashed_in_order_has_one_rank_and_the_ranks_share_them_out(
    sizes: list[int], world: int
) -> None:
    """A distributed load's hashes in file order (the Hub's SHA-256): one rank a file, the
    same on every rank (a function of the sizes alone), and no rank given more than the least
    given plus one file."""
    from weightstream.distributed import _hashers

    given = _hashers(dict(enumerate(sizes)), world)
    assert sorted(given) == list(range(len(sizes))) and set(given.values()) <= set(range(world))
    assert _hashers(dict(reversed(list(enumerate(sizes)))), world) == given
    load = [sum(s for f, s in enumerate(sizes) if given[f] == r) for r in range(world)]
    assert max(load) <= min(load) + max(sizes, default=0)
