"""CRC32C pieces put together in any order, and the check of a shard's pieces."""

from __future__ import annotations

import itertools
import random

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.engine.verify import Verifier
from weightstream.errors import FormatError
from weightstream.format.manifest import FileDigest, crc32c_combine, dump_manifest, parse_manifest


@given(st.binary(max_size=5000), st.lists(st.integers(0, 5000), max_size=6))
@settings(max_examples=200, deadline=None)
def test_combined_crcs_equal_the_crc_of_the_whole(data: bytes, cuts: list[int]) -> None:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    crc = 0
    for a, b in itertools.pairwise(points):
        crc = crc32c_combine(crc, crc32c.crc32c(data[a:b]), b - a)
    assert crc == crc32c.crc32c(data)


def digest_of(data: bytes, piece: int) -> FileDigest:
    pieces = tuple(crc32c.crc32c(data[i : i + piece]) for i in range(0, len(data), piece))
    return FileDigest("f", len(data), crc32c.crc32c(data), piece, pieces)


@given(st.integers(1, 40_000), st.integers(0, 2**32), st.booleans())
@settings(max_examples=100, deadline=None)
def test_reads_in_any_order_overlapping_or_not_check_every_piece(size: int, seed: int, corrupt: bool) -> None:
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(size))
    digest = digest_of(data, 4096)
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
        v = Verifier("f", digest, bytes(seen[:head]))  # the header, read at open
        for a, b in reads:
            v.add(memoryview(seen)[a:b], a)
    except FormatError as exc:
        assert corrupt and exc.byte_range is not None and exc.byte_range[0] <= bad < exc.byte_range[1]
        return
    assert not corrupt
    assert v.verified(0, size) and v.checked_bytes == size and v.unchecked == 0


def test_a_manifest_round_trips_and_refuses_what_it_is_not() -> None:
    d = digest_of(b"x" * 10_000, 4096)
    text = dump_manifest([d], piece_size=4096)
    assert parse_manifest(text.encode(), uri="m") == {"f": d}
    for bad in (
        '{"format": 1}',
        text.replace('"piece_size": 4096', '"piece_size": 100'),
        text.replace('"pieces": [', '"pieces": ["zz", '),
    ):
        with pytest.raises(FormatError, match="not a weightstream manifest"):
            parse_manifest(bad.encode(), uri="m")
