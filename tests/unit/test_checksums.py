"""CRCs put together in any order, and the check of a shard's pieces (a manifest's, or one
whole-object checksum of a store's), read whole or step by step."""

from __future__ import annotations

import dataclasses
import itertools
import random
import zlib

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.engine.verify import Verifier
from weightstream.errors import FormatError
from weightstream.format.checksums import ALGORITHMS
from weightstream.format.manifest import FileDigest, crc32c_combine, dump_manifest, parse_manifest
from weightstream.format.ranges import Ranges

ORACLES = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}
"""Other implementations, to check ours against (CRC64/NVME: its published check value below)."""


def test_each_crc_gives_its_standards_check_value() -> None:
    # the "check" of each CRC's catalogue entry: the CRC of b"123456789"
    want = {"crc32c": 0xE3069283, "crc32": 0xCBF43926, "crc64nvme": 0xAE8B14860A799888}
    assert {name: a.of(b"123456789") for name, a in ALGORITHMS.items()} == want


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@given(data=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=6))
@settings(max_examples=100, deadline=None)
def test_each_crc_combines_and_continues(name: str, data: bytes, cuts: list[int]) -> None:
    algo = ALGORITHMS[name]
    whole = algo.of(data)
    if name in ORACLES:
        assert whole == ORACLES[name](data)
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    combined, continued = 0, 0
    for a, b in itertools.pairwise(points):
        combined = algo.combine(combined, algo.of(data[a:b]), b - a)
        continued = algo.of(memoryview(data)[a:b], continued)
    assert combined == whole == continued


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@given(
    size=st.integers(1, 30_000), seed=st.integers(0, 2**32), bad=st.one_of(st.none(), st.integers(0, 30_000))
)
@settings(max_examples=50, deadline=None)
def test_a_whole_object_checksum_checks_reads_in_any_order(
    name: str, size: int, seed: int, bad: int | None
) -> None:
    """A store's checksum of the whole object: one piece, checked when its last byte arrives."""
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(size))
    algo = ALGORITHMS[name]
    digest = FileDigest(
        "f", size, algo.of(data), size, (algo.of(data),), algorithm=name, origin="the store (x)"
    )
    seen = bytearray(data)
    if bad is not None:
        bad %= size
        seen[bad] ^= 0x80
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(5))})
    reads = list(itertools.pairwise(cuts))
    rng.shuffle(reads)
    v = Verifier("s3://b/f", digest, b"", hold_max=size - 1)
    assert not v.holds  # larger than the hold: stream() hands its blocks over as read
    try:
        for a, b in reads:
            v.add(memoryview(seen)[a:b], a)
    except FormatError as exc:
        assert bad is not None and exc.byte_range == (0, size)
        assert f"the store (x) gives {name} {algo.text(digest.whole)}" in str(exc)
        assert (a, b) == reads[-1]  # at the last byte, not before
        return
    assert bad is None and v.checked_bytes == size


@given(st.binary(max_size=5000), st.lists(st.integers(0, 5000), max_size=6))
@settings(max_examples=200, deadline=None)
def test_combined_crcs_equal_the_crc_of_the_whole(data: bytes, cuts: list[int]) -> None:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    crc = 0
    for a, b in itertools.pairwise(points):
        crc = crc32c_combine(crc, crc32c.crc32c(data[a:b]), b - a)
    assert crc == crc32c.crc32c(data)


def digest_of(data: bytes, piece: int, rng: random.Random | None = None) -> tuple[FileDigest, list[int]]:
    """``data``'s digest in pieces of ``piece`` bytes, or (``rng``) of random sizes (an S3
    multipart upload's parts of other sizes: ``bounds``); and the pieces' first bytes."""
    size = len(data)
    if rng is None:
        starts = list(range(0, size, piece))
    else:
        starts = sorted({0, *(rng.randrange(size) for _ in range(rng.randint(0, 8)))})
    ends = [*starts[1:], size]
    pieces = tuple(crc32c.crc32c(data[a:b]) for a, b in zip(starts, ends, strict=True))
    if rng is None:
        return FileDigest("f", size, crc32c.crc32c(data), piece, pieces), starts
    largest = max(b - a for a, b in zip(starts, ends, strict=True))
    return FileDigest("f", size, crc32c.crc32c(data), largest, pieces, bounds=tuple(starts)), starts


def piece_holding(starts: list[int], size: int, offset: int) -> tuple[int, int]:
    """The byte range of the piece (first bytes ``starts``) that ``offset`` lies in."""
    i = max(k for k, a in enumerate(starts) if a <= offset)
    return starts[i], starts[i + 1] if i + 1 < len(starts) else size


@given(st.integers(1, 40_000), st.integers(0, 2**32), st.booleans(), st.booleans())
@settings(max_examples=100, deadline=None)
def test_reads_in_any_order_overlapping_or_not_check_every_piece(
    size: int, seed: int, corrupt: bool, uneven: bool
) -> None:
    """Reads in any order, some overlapping, check every piece, of one size or of other sizes
    (``uneven``); a changed byte is named by exactly its piece's range, and a range counts as
    checked (what ``stream()`` holds a tensor for) exactly once every piece it touches has
    arrived whole."""
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(size))
    digest, starts = digest_of(data, 4096, rng if uneven else None)
    head = rng.randint(0, min(size, 9000))
    # reads: cover everything, in random order, some overlapping (a page two blocks share)
    reads = []
    pos = head
    while pos < size:
        n = rng.randint(1, 7000)
        reads.append((max(0, pos - rng.choice([0, 0, 4096])), pos + n))
        pos += n
    rng.shuffle(reads)
    bad = rng.randrange(size) if corrupt else -1
    seen = bytearray(data)
    if bad >= 0:
        seen[bad] ^= 1
    try:
        v = Verifier("f", digest, bytes(seen[:head]), hold_max=1 << 30)  # the header, read at open
        arrived = bytearray(size)
        arrived[:head] = b"\1" * head
        for a, b in reads:
            v.add(memoryview(seen)[a:b], a)
            arrived[a:b] = b"\1" * (min(b, size) - a)
            x = rng.randrange(size)
            y = rng.randint(x + 1, size)
            touched = [r for r in (piece_holding(starts, size, o) for o in starts) if r[0] < y and x < r[1]]
            assert v.verified(x, y) == all(all(arrived[p:q]) for p, q in touched), (x, y)
    except FormatError as exc:
        assert corrupt and exc.byte_range == piece_holding(starts, size, bad)
        return
    assert not corrupt
    assert v.verified(0, size) and v.checked_bytes == size and v.unchecked == 0


@given(st.integers(1, 40_000), st.integers(0, 2**32), st.booleans(), st.booleans())
@settings(max_examples=100, deadline=None)
def test_reads_checked_step_by_step_as_they_land_with_failed_reads_retried(
    size: int, seed: int, corrupt: bool, uneven: bool
) -> None:
    """The stepwise check (a local file's buffered read): each read claims its bytes, hands them
    over in steps, sometimes out of order (the whole read is then checked again from its
    buffer), and sometimes fails part-way (its claim is given back and the read retried, by
    then perhaps after a neighbour that overlaps it). Every piece, of one size or of other
    sizes, is still checked once, whole, and a changed byte is named by its piece's range."""
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(size))
    digest, starts = digest_of(data, 4096, rng if uneven else None)
    bad = rng.randrange(size) if corrupt else -1
    seen = bytearray(data)
    if bad >= 0:
        seen[bad] ^= 1
    view = memoryview(seen)
    reads, pos = [], 0
    while pos < size:
        n = rng.randint(1, 9000)
        reads.append((max(0, pos - rng.choice([0, 0, 4096])), min(size, pos + n)))
        pos += n
    rng.shuffle(reads)
    queue = [(a, b, rng.random() < 0.3) for a, b in reads]  # (start, end, fails this time)
    try:
        v = Verifier("f", digest, b"", hold_max=1 << 30)
        while queue:
            a, b, fails = queue.pop(0)
            landing = v.landing(a, b)
            cuts = sorted({a, b, *(rng.randint(a, b) for _ in range(rng.randint(0, 4)))})
            steps = list(itertools.pairwise(cuts))
            if rng.random() < 0.2:
                rng.shuffle(steps)  # out of order: the steps' CRCs are not used
            if fails:
                for x, y in steps[: len(steps) // 2]:
                    landing(view[x:y], x)
                v.abandon(landing)
                queue.insert(rng.randint(0, len(queue)), (a, b, False))
                continue
            for x, y in steps:
                landing(view[x:y], x)
            v.arrived(landing, view[a:b], a)
    except FormatError as exc:
        assert corrupt and exc.byte_range == piece_holding(starts, size, bad)
        return
    assert not corrupt
    assert v.verified(0, size) and v.checked_bytes == size and v.unchecked == 0


@given(st.integers(1, 40_000), st.integers(0, 2**32), st.booleans(), st.booleans())
@settings(max_examples=100, deadline=None)
def test_a_composite_is_checked_at_the_last_byte_and_a_bad_piece_named_by_the_stores_parts(
    size: int, seed: int, corrupt: bool, parts_differ: bool
) -> None:
    """A store's composite (the CRC of its parts' CRCs) whose parts' own CRCs are asked only
    where it does not match: a changed byte is named by its piece's range where the parts are
    the pieces read; where they are not, nothing is failed (and nothing counted as checked)."""
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(size))
    crcs = [crc32c.crc32c(data[i : i + 4096]) for i in range(0, size, 4096)]
    composite = crc32c.crc32c(b"".join(c.to_bytes(4, "big") for c in crcs))
    asked: list[bool] = []

    def confirm() -> tuple[int, ...] | str:
        asked.append(True)
        return "its parts are not all of one size" if parts_differ else tuple(crcs)

    digest = FileDigest("f", size, composite, 4096, (), composite=True, confirm=confirm)
    bad = rng.randrange(size) if corrupt else -1
    seen = bytearray(data)
    if bad >= 0:
        seen[bad] ^= 1
    reads = [(a, min(size, a + 4096 * rng.randint(1, 2))) for a in range(0, size, 4096)]  # some overlap
    rng.shuffle(reads)
    v = Verifier("f", digest, b"", hold_max=1 << 30)
    assert not v.holds  # checked only at the last byte: a stream never waits for it
    try:
        for a, b in reads:
            v.add(memoryview(seen)[a:b], a)
    except FormatError as exc:
        assert corrupt and not parts_differ
        assert exc.byte_range is not None and exc.byte_range[0] <= bad < exc.byte_range[1]
        assert exc.byte_range == (bad // 4096 * 4096, min(size, bad // 4096 * 4096 + 4096))
        return
    assert asked == ([True] if corrupt else [])
    if corrupt:
        assert parts_differ and v.checked_bytes == 0 and v.unchecked == size
    else:
        assert v.verified(0, size) and v.checked_bytes == size and v.unchecked == 0


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 80), st.integers(0, 20)), max_size=30))
@settings(max_examples=300, deadline=None)
def test_ranges_added_and_removed_equal_the_set_of_their_bytes(ops: list[tuple[bool, int, int]]) -> None:
    ranges, want = Ranges(), set()
    for add, start, n in ops:
        if add:
            ranges.add(start, start + n)
            want |= set(range(start, start + n))
        else:
            ranges.remove(start, start + n)
            want -= set(range(start, start + n))
        pairs = list(zip(ranges.starts, ranges.ends, strict=True))
        assert {x for a, b in pairs for x in range(a, b)} == want
        assert all(a < b for a, b in pairs)  # no empty ranges
        assert all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(pairs))  # disjoint, merged
        assert ranges.gaps(0, 120) == [(a, b) for a, b in _runs(set(range(120)) - want)]


def _runs(points: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x in sorted(points):
        if out and out[-1][1] == x:
            out[-1] = (out[-1][0], x + 1)
        else:
            out.append((x, x + 1))
    return out


def test_a_manifest_round_trips_and_refuses_what_it_is_not() -> None:
    d, _ = digest_of(b"x" * 10_000, 4096)
    text = dump_manifest([d], piece_size=4096)
    assert parse_manifest(text.encode(), uri="m") == {"f": dataclasses.replace(d, origin="the manifest m")}
    for bad in (
        '{"format": 1}',
        text.replace('"piece_size": 4096', '"piece_size": 100'),
        text.replace('"pieces": [', '"pieces": ["zz", '),
    ):
        with pytest.raises(FormatError, match="not a weightstream manifest"):
            parse_manifest(bad.encode(), uri="m")


def _b64(value: int, bits: int) -> str:
    import base64

    return base64.b64encode(value.to_bytes(bits // 8, "big")).decode()


@pytest.mark.parametrize(
    ("headers", "etag", "want"),
    [
        # a single-part object: its checksum is of the whole object
        ({"x-amz-checksum-crc32c": _b64(0x1234, 32)}, '"abc"', ("crc32c", 0x1234)),
        # several: CRC64/NVME first (S3's own), then CRC32C, then CRC32
        (
            {"x-amz-checksum-crc32": _b64(1, 32), "x-amz-checksum-crc64nvme": _b64(2, 64)},
            '"abc"',
            ("crc64nvme", 2),
        ),
        # a multipart upload with a full-object checksum, said so
        (
            {"x-amz-checksum-crc32": _b64(7, 32), "x-amz-checksum-type": "FULL_OBJECT"},
            '"abc-3"',
            ("crc32", 7),
        ),
        # composite: by its suffix, by its type, or a multipart object that does not say
        ({"x-amz-checksum-crc32c": _b64(7, 32) + "-3"}, '"abc"', "composite"),
        ({"x-amz-checksum-crc32c": _b64(7, 32), "x-amz-checksum-type": "COMPOSITE"}, '"abc"', "composite"),
        ({"x-amz-checksum-crc32c": _b64(7, 32)}, '"abc-3"', "composite"),
        # SHA-256 is taken (a load uses it with verify="on" only)
        ({"x-amz-checksum-sha256": _b64(5, 256)}, '"abc"', ("sha256", 5)),
        ({"x-amz-checksum-sha256": _b64(5, 256) + "-2"}, '"abc"', "composite"),
        # not a checksum at all
        ({"x-amz-checksum-sha1": _b64(1, 32)}, '"abc"', "not 160 bits"),
        ({"x-amz-checksum-crc32c": "!!"}, '"abc"', "not base64"),
        ({"x-amz-checksum-crc64nvme": _b64(1, 32)}, '"abc"', "not 64 bits"),
        ({}, '"abc"', "keeps no checksum"),
    ],
)
def test_what_a_stores_answer_is_taken_for(headers: dict[str, str], etag: str, want: object) -> None:
    from weightstream.sources.object_store.checksum import _parse

    answer = _parse(headers, etag=etag)
    if isinstance(want, tuple):
        assert (answer.algorithm, answer.value) == want
    else:
        assert answer.algorithm is None and isinstance(want, str) and want in answer.why


@given(
    size=st.integers(1, 30_000),
    seed=st.integers(0, 2**32),
    bad=st.one_of(st.none(), st.integers(0, 30_000)),
    ahead=st.sampled_from([1 << 20, 3000]),
    borrowed=st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_a_hash_that_does_not_combine_is_taken_in_order_from_reads_in_any_order(
    size: int, seed: int, bad: int | None, ahead: int, borrowed: bool
) -> None:
    """SHA-256: reads that land ahead of the hashed bytes are kept (a copy, ``pending_max`` at
    most) until the bytes before them arrive; past that bound the file is left unchecked, never
    passed as checked and never failed for it. ``borrowed`` (a distributed ``load()``'s rounds,
    memory no one reuses): kept as they are, with the same outcome."""
    import hashlib

    from weightstream.engine.verify import InOrder

    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(size))
    want = int.from_bytes(hashlib.sha256(data).digest(), "big")
    digest = FileDigest.whole_object("f", size, "sha256", want, "the Hub (x)")
    seen = bytearray(data)
    if bad is not None:
        bad %= size
        seen[bad] ^= 0x04
    head = rng.randint(0, min(size, 500))
    cuts = sorted({head, size, *(rng.randrange(head, size + 1) for _ in range(6))})
    reads = [(max(0, a - rng.choice([0, 0, 100])), b) for a, b in itertools.pairwise(cuts)]  # some overlap
    rng.shuffle(reads)
    scratch = bytearray(size)
    v = None
    try:
        v = InOrder("/m/f", digest, bytes(seen[:head]), pending_max=ahead)  # the header, read at open
        for a, b in reads:
            if borrowed:
                v.add(memoryview(bytearray(seen[a:b])), a, borrowed=True)
                continue
            scratch[a:b] = seen[a:b]
            v.add(memoryview(scratch)[a:b], a)
            scratch[a:b] = bytes(b - a)  # the engine may reuse a read's memory once delivered
    except FormatError as exc:
        assert bad is not None and exc.byte_range == (0, size) and f"{want:064x}" in str(exc)
        assert v is None or not v.gave_up
        return
    assert v is not None
    if v.gave_up:
        assert v.checked_bytes == 0 and v.unchecked == size
    else:
        assert bad is None and v.checked_bytes == size and v.unchecked == 0


def test_part_heads_take_threads_from_one_budget_for_the_process() -> None:
    """Up to 32 objects are asked at once, each for up to 64 parts: the threads asking parts
    are at most 64 an object and 256 in all, at least 4 an object, and given back."""
    import contextlib

    from weightstream.sources.object_store import checksum

    with checksum._head_threads(10) as k:
        assert k == 10  # no more threads than parts
    with contextlib.ExitStack() as held:
        got = [held.enter_context(checksum._head_threads(100)) for _ in range(6)]
        assert got == [64, 64, 64, 64, 4, 4]
    with checksum._head_threads(100) as k:
        assert k == 64  # all given back


@given(st.integers(1, 40_000), st.integers(0, 2**32), st.booleans(), st.booleans())
@settings(max_examples=100, deadline=None)
def test_pieces_checked_by_an_earlier_load_are_not_checked_again(
    size: int, seed: int, corrupt: bool, uneven: bool
) -> None:
    """Pieces an earlier load passed (``known``) count as checked from the start and are never
    read through the check (a byte changed in one goes unseen: that is what a record of the
    file's unchanged version is trusted for); every other piece is checked as before, and only
    those are reported as newly passed."""
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(size))
    digest, _ = digest_of(data, 4096, rng if uneven else None)
    known = frozenset(i for i in range(digest.count) if rng.random() < 0.5)
    bad = rng.randrange(size) if corrupt else -1
    seen = bytearray(data)
    if bad >= 0:
        seen[bad] ^= 1
    bad_piece = digest.index(bad) if bad >= 0 else -1
    v = Verifier("f", digest, b"", hold_max=1 << 30, known=known)
    assert v.pending == (len(known) < digest.count)
    for i in known:
        assert v.verified(*digest.piece(i))
    reads = [(a, min(size, a + rng.randint(4000, 9000))) for a in range(0, size, 4000)]  # overlapping
    rng.shuffle(reads)
    try:
        for a, b in reads:
            v.add(memoryview(seen)[a:b], a)
    except FormatError as exc:
        assert bad_piece not in known and exc.byte_range == digest.piece(bad_piece)
        assert v.passed() == []
        return
    assert bad_piece < 0 or bad_piece in known
    assert v.verified(0, size) and v.checked_bytes == size
    assert v.recalled_bytes == sum(digest.piece(i)[1] - digest.piece(i)[0] for i in known)
    assert v.passed() == sorted(set(range(digest.count)) - known)
