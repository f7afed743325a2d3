"""Checking a shard's bytes while they stream (``StreamConfig.verify``), against its manifest's
CRC32C per piece or an object store's own CRC of the whole object
(:mod:`weightstream.sources.object_store.checksum`).

Each read is checked where it lands, by the worker thread that read it (:class:`Checked`, a
layer over the load's source): the CRC of the bytes it brought, cut at the piece boundaries, is
kept with its offset. When a piece's last bytes arrive its fragments are put together in offset
order (the CRC's combine, per read, never per byte: :mod:`weightstream.format.checksums`) and
compared with the expected one. A mismatch fails that read, so the load fails with a
:class:`~weightstream.errors.FormatError` naming the shard, the piece's byte range, where the
expected checksum came from and both values. The header's bytes, read when the shard was
opened, are checked with the first piece.

A local file's buffered read is checked step by step as the kernel copies it
(:class:`~weightstream.sources.base.Stepwise`, :class:`Landing`): each step's CRC is taken while
the step is still in the CPU's cache, where it costs an eighth of what it costs once the read
has gone back to memory.

A read claims its bytes before it starts, so bytes read twice (a page two neighbouring blocks
share) are counted once; a read that fails gives its claim back for its retry. A piece the load reads
only in part (some tensors of a shard) is not checked: :attr:`Verifier.unchecked` counts its
bytes, and the load's log says so. In a distributed load a piece's bytes are read by several
ranks: each rank's check takes the CRCs of the others' parts, which the ranks hand each other
(:attr:`Verifier.shared`, :mod:`weightstream.distributed`), so every rank checks every piece.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from weightstream.errors import FormatError
from weightstream.format.checksums import ALGORITHMS, Algorithm, algorithm
from weightstream.format.manifest import FileDigest
from weightstream.format.ranges import Ranges
from weightstream.sources.base import ReadHow, Source, Stepwise, Wrapped

__all__ = ["Checked", "InOrder", "Landing", "Verifier", "header_end", "verifier_for"]

log = logging.getLogger(__name__)


def header_end(head: bytes) -> int:
    """Where a safetensors file's header ends, from its first bytes (8 + the length they give)."""
    if len(head) < 8:
        return len(head)
    return min(len(head), 8 + int.from_bytes(head[:8], "little"))


def verifier_for(
    uri: str,
    digest: FileDigest,
    head: bytes,
    *,
    hold_max: int,
    known: frozenset[int] = frozenset(),
    shared: bool = False,
) -> Verifier | InOrder:
    """The check of one shard: by pieces, in any order, for a CRC; in order for a hash that
    does not combine (SHA-256, SHA-1). ``known``: pieces this version of the file passed in an
    earlier load (:mod:`weightstream.cache.passed`), taken as checked without a CRC.
    ``shared``: the load's reads are split among ranks (:attr:`Verifier.shared`)."""
    if digest.algorithm in ALGORITHMS:
        return Verifier(uri, digest, head, hold_max=hold_max, known=known, shared=shared)
    return InOrder(uri, digest, head, pending_max=hold_max, known=known, shared=shared)


class Verifier:
    """One shard's checks during one load. ``head``: the file's first bytes, read at open.

    ``hold_max``: the largest piece ``stream()`` holds a block back for until it is checked
    (:attr:`holds`). Held blocks stay in the load's memory, and the piece's other reads must
    fit beside them: a piece larger than that (a store's checksum of a whole object is one
    piece of the object's size) is not held, its blocks are handed over as read, and a mismatch
    raises from the stream when the piece's last byte arrives. ``load()`` returns nothing
    either way."""

    def __init__(
        self,
        uri: str,
        digest: FileDigest,
        head: bytes,
        *,
        hold_max: int,
        known: frozenset[int] = frozenset(),
        shared: bool = False,
    ) -> None:
        self.uri = uri
        self.digest = digest
        self.algorithm = algorithm(digest.algorithm)
        self.holds = digest.piece_size <= hold_max and not digest.composite
        """Whether ``stream()`` holds blocks back until their pieces are checked (a composite's
        pieces are checked together, at the file's last byte: never held)."""
        self.lock = threading.Lock()
        n = digest.count
        self._got: list[int | None] = [None] * n
        """A composite's pieces' checksums, as read."""
        self._claimed = [Ranges() for _ in range(n)]
        self._parts: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # (offset, length, crc)
        self._have = [0] * n
        self.checked = [False] * n
        self.failed = False
        """A piece's bytes did not match."""
        if digest.composite and len(known) < n:
            known = frozenset()  # a composite's pieces are checked together or not at all
        self.shared = shared
        """The load's reads are split among ranks (:mod:`weightstream.distributed`), so a piece's
        bytes are read by several: each rank keeps the CRCs of what it read (:meth:`take_own`)
        for the others, takes theirs (:meth:`foreign`), and leaves the bytes others read to
        them (:meth:`reserve`), so that every rank checks every piece. Earlier loads' records
        are not used (every rank must check the same pieces), and of ``head`` only the header
        is taken (every rank has it; the bytes after it are some rank's to read)."""
        self._cuts: list[int] = []
        """With :attr:`shared`: where the ranges this rank sends CRCs of begin and end (:meth:`cut`)."""
        self._own: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        """With :attr:`shared`: by piece, the ``(offset, length, crc)`` of the bytes this rank read."""
        if shared:
            known = frozenset()
            head = head[: header_end(head)]
        self.head_end = len(head)
        """Bytes of the file's start this rank checks from what it read at open."""
        self.known = known
        """Pieces an earlier load checked (claimed whole: no read of this load checks them)."""
        for i in known:
            self.checked[i] = True
            self._claimed[i].add(*digest.piece(i))
        if head:
            self.add(memoryview(head), 0)

    @property
    def pending(self) -> bool:
        """Whether any piece is left to check (else the shard's reads need not go through it)."""
        return len(self.known) < len(self.checked)

    def passed(self) -> list[int]:
        """The pieces this load checked and found right (to be recorded)."""
        if self.failed or self.shared:  # shared: other ranks read part of the bytes, maybe another copy
            return []
        return [i for i, ok in enumerate(self.checked) if ok and i not in self.known]

    def add(self, data: memoryview, offset: int) -> None:
        """The bytes at ``offset`` arrived: check every piece they complete (raises
        :class:`FormatError` on a mismatch)."""
        landing = self.landing(offset, offset + len(data))
        landing(data, offset)
        self.arrived(landing, data, offset)

    def landing(self, start: int, end: int) -> Landing:
        """A read of ``[start, end)`` begins: claim its bytes that no other read has (a page two
        neighbouring blocks share is checked once), to be checked by the :class:`Landing` as
        they land. A read that fails gives its claim back (:meth:`abandon`), so that its retry
        checks them."""
        segments: list[tuple[int, int, int]] = []  # (piece, start, end)
        cuts = self._cuts
        with self.lock:
            for i, lo, hi in self._segments(start, end):
                for a, b in self._claimed[i].gaps(lo, hi):
                    self._claimed[i].add(a, b)
                    k = bisect.bisect_right(cuts, a)
                    while k < len(cuts) and cuts[k] < b:  # (shared) never across a range's end
                        segments.append((i, a, cuts[k]))
                        a, k = cuts[k], k + 1
                    segments.append((i, a, b))
        return Landing(self.algorithm, segments)

    def abandon(self, landing: Landing) -> None:
        """The read failed: its bytes are unclaimed again."""
        with self.lock:
            for i, a, b in landing.segments:
                self._claimed[i].remove(a, b)

    def arrived(self, landing: Landing, data: memoryview, offset: int) -> None:
        """The read is whole (``data``, at ``offset``): check every piece it completes."""
        self._arrive([(i, a, b - a, crc) for i, a, b, crc in landing.fragments(data, offset)], own=True)

    def _arrive(self, fragments: list[tuple[int, int, int, int]], *, own: bool) -> None:
        """``(piece, offset, length, crc)`` of bytes read (``own``: by this rank): check every
        piece they complete (raises :class:`FormatError` on a mismatch)."""
        done = []
        with self.lock:
            for i, at, n, crc in fragments:
                self._parts[i].append((at, n, crc))
                self._have[i] += n
                if own and self.shared:
                    self._own[i].append((at, n, crc))
                start, piece_end = self.digest.piece(i)
                if self._have[i] == piece_end - start:
                    done.append((i, sorted(self._parts[i])))
        for i, parts in done:
            self._check(i, parts)

    def cut(self, points: Iterable[int]) -> None:
        """(:attr:`shared`) The ends of the ranges whose CRCs this rank sends as it is done with
        each (:meth:`take_own`): no CRC of its reads is taken across one, though a read may
        cross it (a page two blocks share, the first of which is in an earlier round)."""
        self._cuts = sorted(set(points))

    def reserve(self, start: int, end: int) -> None:
        """``[start, end)`` is another rank's to read (:attr:`shared`): no read of this rank
        checks it; its CRCs come from that rank (:meth:`foreign`)."""
        for i, a, b in self._segments(start, end):
            with self.lock:
                self._claimed[i].add(a, b)

    def release(self, start: int, end: int) -> None:
        """``[start, end)`` is this rank's to read after all (the ranks stopped exchanging)."""
        for i, a, b in self._segments(start, end):
            with self.lock:
                self._claimed[i].remove(a, b)

    def take_own(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The ``(offset, length, crc)`` of this rank's reads within ``[start, end)``, those of
        a piece that meet joined into one, for the other ranks (:attr:`shared`); given once."""
        out: list[tuple[int, int, int]] = []
        combine = self.algorithm.combine
        for i, a, b in self._segments(start, end):
            with self.lock:
                inside = sorted(f for f in self._own[i] if a <= f[0] and f[0] + f[1] <= b)
                self._own[i] = [f for f in self._own[i] if not (a <= f[0] and f[0] + f[1] <= b)]
            for at, n, crc in inside:
                if out and out[-1][0] + out[-1][1] == at and self.digest.index(out[-1][0]) == i:
                    first, m, c = out[-1]
                    out[-1] = (first, m + n, combine(c, crc, n))
                else:
                    out.append((at, n, crc))
        return out

    def foreign(self, fragments: Iterable[tuple[int, int, int]]) -> None:
        """Another rank read these bytes (``(offset, length, crc)``, each within one piece):
        check every piece they complete (raises :class:`FormatError` on a mismatch)."""
        items = []
        for at, n, crc in fragments:
            i = self.digest.index(at)
            if at + n > self.digest.piece(i)[1]:
                raise ValueError(f"{self.uri}: bytes {at}-{at + n} cross the end of piece {i}")
            items.append((i, at, n, crc))
        self._arrive(items, own=False)

    def _segments(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """``(piece, start, end)`` of the pieces ``[start, end)`` lies in (cut at the file's end)."""
        end = min(end, self.digest.size)
        pos = start
        while pos < end:
            i = self.digest.index(pos)
            stop = min(end, self.digest.piece(i)[1])
            yield i, pos, stop
            pos = stop

    def _check(self, i: int, parts: list[tuple[int, int, int]]) -> None:
        crc = 0  # the CRC of no bytes
        combine = self.algorithm.combine
        for _, n, c in parts:
            crc = combine(crc, c, n)
        if self.digest.composite:
            with self.lock:
                self._got[i] = crc
                self._parts[i] = []
                last = all(c is not None for c in self._got)
            if last:
                self._check_composite()
            return
        self._compare(i, crc, self.digest.pieces[i])
        with self.lock:
            self.checked[i] = True
            self._parts[i] = []

    def _compare(self, i: int, crc: int, want: int, *, what: str = "") -> None:
        if crc == want:
            return
        start, end = self.digest.piece(i)
        self.failed = True
        text, origin = self.algorithm.text, self.digest.origin
        raise FormatError(
            f"checksum mismatch: {origin} gives {self.algorithm.name} {text(want)} for bytes "
            f"{start}-{end}{what}, the bytes read give {text(crc)} (the file differs from the one "
            f"{origin} describes)",
            uri=self.uri,
            byte_range=(start, end),
        )

    def _check_composite(self) -> None:
        """Every piece of a composite is read: their checksums, in order, must give it. Where
        they do not, the store's own checksum of each piece (its parts, asked now) names the
        piece that differs; where the store's parts turn out not to be the pieces read (a
        multipart upload of parts of other sizes), the file is left unchecked, never failed."""
        got = [c for c in self._got if c is not None]
        if self.algorithm.composite(got) == self.digest.whole:
            with self.lock:
                self.checked = [True] * len(self.checked)
            return
        parts = self.digest.confirm() if self.digest.confirm is not None else "nothing to ask"
        if isinstance(parts, str) or len(parts) != len(got):
            log.warning(
                "%s: not checked against %s: its parts are not the pieces read (%s)",
                self.uri, self.digest.origin, parts if isinstance(parts, str) else f"{len(parts)} parts",
            )  # fmt: skip
            return
        for i, (crc, want) in enumerate(zip(got, parts, strict=True)):
            self._compare(i, crc, want, what=f" (part {i + 1})")
        log.warning(  # each part matches, the composite does not: the store's answer disagrees with itself
            "%s: not checked: the store's composite does not follow from its parts' checksums", self.uri
        )

    def verified(self, start: int, end: int) -> bool:
        """Whether every piece ``[start, end)`` lies in is checked."""
        end = min(end, self.digest.size)
        if end <= start:
            return True
        index = self.digest.index
        return all(self.checked[i] for i in range(index(start), index(end - 1) + 1))

    @property
    def unchecked(self) -> int:
        """Bytes of pieces the load read only in part (not checked)."""
        return sum(
            self.digest.piece(i)[1] - self.digest.piece(i)[0]
            for i, have in enumerate(self._have)
            if have and not self.checked[i]
        )

    @property
    def checked_bytes(self) -> int:
        """Bytes of the pieces checked: in this load, or in an earlier one (:attr:`recalled_bytes`)."""
        return sum(
            self.digest.piece(i)[1] - self.digest.piece(i)[0] for i, ok in enumerate(self.checked) if ok
        )

    @property
    def recalled_bytes(self) -> int:
        """Bytes of the pieces an earlier load of this version checked."""
        return sum(self.digest.piece(i)[1] - self.digest.piece(i)[0] for i in self.known)


class InOrder:
    """One shard's check against a hash of the whole file that does not combine (the SHA-256
    the Hugging Face Hub publishes; S3's SHA-256 or SHA-1): the bytes are hashed in file order.

    A read that lands at the hashed prefix's end is hashed at once, by its thread, from where it
    landed (``hashlib`` releases the GIL), and so are the reads that arrived ahead of it. A read
    that lands further on is kept until then: a copy, since the engine may reuse a read's
    memory once it is delivered. The copies are bounded by ``pending_max`` (a load reads each
    file about in order, so they are the reads in flight); past it, or where the load leaves a
    gap (some tensors of a shard), the shard is left unchecked and counted so. Never held in
    ``stream()`` (:attr:`holds`): the hash is known at the file's last byte, and a mismatch
    raises then; ``load()`` returns nothing.

    ``shared`` (a distributed load, whose ranks each read a part): the hash is fed with the
    rounds as they are gathered (every rank has every byte then), by one rank per file
    (:mod:`weightstream.distributed`), not with this rank's reads; the others are told its
    verdict (:meth:`told`). Earlier loads' records are neither used nor written."""

    holds = False

    def __init__(
        self,
        uri: str,
        digest: FileDigest,
        head: bytes,
        *,
        pending_max: int,
        known: frozenset[int] = frozenset(),
        shared: bool = False,
    ) -> None:
        self.uri = uri
        self.digest = digest
        self.shared = shared
        if shared:
            known = frozenset()
            head = head[: header_end(head)]
        self.lock = threading.Lock()
        self._hash: Any = None
        """The running hash, made at the first byte hashed."""
        self._at = 0
        """Bytes hashed: the file's first ``_at``."""
        self._ahead: dict[int, bytes | memoryview] = {}
        self._ahead_bytes = 0
        self.pending_max = pending_max
        """Bytes kept while they wait for the bytes before them, at most (past it, the file is
        left unchecked)."""
        self._seen = False
        self.gave_up = ""
        self.known = frozenset({0}) if 0 in known else frozenset()
        """``{0}``: an earlier load hashed this version whole."""
        self.checked_whole = bool(self.known)
        self.failed = False
        if head:
            self.add(memoryview(head), 0)

    @property
    def pending(self) -> bool:
        return not self.known

    def passed(self) -> list[int]:
        if self.shared:
            return []
        return [0] if self.checked_whole and not self.known and not self.failed else []

    def told(self, whole: bool) -> None:
        """With :attr:`shared`: the rank that hashed this file says it hashed every byte and
        found them right (``whole``), or could not hash them all. (A mismatch fails that rank,
        and every rank with it.)"""
        with self.lock:
            if whole:
                self.checked_whole = True
            elif not self.gave_up:
                self.gave_up = "the rank that hashed it could not hash every byte"

    def add(self, data: memoryview, offset: int, *, borrowed: bool = False) -> None:
        """Hash ``data`` (file bytes from ``offset``) once the bytes before it are. Bytes that
        must wait are copied, or, ``borrowed``, kept as they are (memory no one reuses or
        changes until the load ends: the tensors ``load()`` returns)."""
        end = min(offset + len(data), self.digest.size)
        if end <= offset:
            return
        with self.lock:
            self._seen = True
            if self.gave_up or self.checked_whole:
                return
            if offset > self._at:
                if self._ahead_bytes + (end - offset) > self.pending_max:
                    self._give_up(f"more than {self.pending_max} bytes arrived ahead of the hashed ones")
                    return
                kept = self._ahead.get(offset)
                if kept is None or len(kept) < end - offset:
                    self._ahead_bytes += end - offset - (len(kept) if kept else 0)
                    self._ahead[offset] = data[: end - offset] if borrowed else bytes(data[: end - offset])
                return
            self._take(data, offset, end)
            while self._ahead:
                ready = [o for o in self._ahead if o <= self._at]
                if not ready:
                    break
                for o in sorted(ready):
                    kept = self._ahead.pop(o)
                    self._ahead_bytes -= len(kept)
                    self._take(memoryview(kept), o, o + len(kept))
            if self._at >= self.digest.size:
                self._finish()

    def _hasher(self) -> Any:
        if self._hash is None:
            self._hash = hashlib.new(self.digest.algorithm)
        return self._hash

    def _take(self, data: memoryview, offset: int, end: int) -> None:
        if end > self._at:
            self._hasher().update(data[self._at - offset : end - offset])
            self._at = end

    def _give_up(self, why: str) -> None:
        self.gave_up = why
        self._ahead, self._ahead_bytes = {}, 0
        log.warning("%s: not checked against %s: %s", self.uri, self.digest.origin, why)

    def _finish(self) -> None:
        got = int.from_bytes(self._hasher().digest(), "big")
        want = self.digest.whole
        if got != want:
            self.failed = True
            bits = self._hash.digest_size * 8
            name, origin = self.digest.algorithm, self.digest.origin
            raise FormatError(
                f"checksum mismatch: {origin} gives {name} {want:0{bits // 4}x} for bytes 0-{self.digest.size}, "
                f"the bytes read give {got:0{bits // 4}x} (the file differs from the one {origin} describes)",
                uri=self.uri,
                byte_range=(0, self.digest.size),
            )
        self.checked_whole = True

    def verified(self, start: int, end: int) -> bool:
        return self.checked_whole

    @property
    def unchecked(self) -> int:
        return self.digest.size if self._seen and not self.checked_whole else 0

    @property
    def checked_bytes(self) -> int:
        return self.digest.size if self.checked_whole else 0

    @property
    def recalled_bytes(self) -> int:
        return self.digest.size if self.known else 0


class Landing:
    """One read's CRCs, kept as its bytes land (``landing(view, offset)``, in file order): one
    running CRC per claimed segment (a piece's bytes this read brings and no other read
    claimed), continued step by step while each step is in the CPU's cache. Python work per
    step, not per byte; a step out of order is left to :meth:`fragments`, which then reads the
    segment again from the read's buffer."""

    __slots__ = ("_algorithm", "_at", "_crc", "_ends", "segments")

    def __init__(self, algorithm: Algorithm, segments: list[tuple[int, int, int]]) -> None:
        self._algorithm = algorithm
        self.segments = segments
        """In file order."""
        self._crc = [0] * len(segments)
        self._at = [a for _, a, _ in segments]
        """Where each segment's running CRC has got to; -1 where a step came out of order."""
        self._ends = [b for _, _, b in segments]

    def __call__(self, data: memoryview, offset: int) -> None:
        end = offset + len(data)
        of = self._algorithm.of
        segments = self.segments
        for k in range(bisect.bisect_right(self._ends, offset), len(segments)):
            _, a, b = segments[k]
            if a >= end:
                break
            lo, hi = max(a, offset), min(b, end)
            if lo >= hi:
                continue
            if lo != self._at[k]:
                self._at[k] = -1
            elif self._at[k] >= 0:
                self._crc[k] = of(data[lo - offset : hi - offset], self._crc[k])
                self._at[k] = hi

    def fragments(self, data: memoryview, offset: int) -> Iterator[tuple[int, int, int, int]]:
        """``(piece, start, end, crc)`` of each segment, from the whole read (``data`` at
        ``offset``) where the steps did not cover it in order."""
        for k, (i, a, b) in enumerate(self.segments):
            crc = self._crc[k] if self._at[k] == b else self._algorithm.of(data[a - offset : b - offset])
            yield i, a, b, crc


class Checked(Wrapped):
    """A load's source whose reads are checked by ``verifier`` as they land: a CRC step by
    step where the source hands its bytes on while they are in the CPU's cache
    (:class:`~weightstream.sources.base.Stepwise`, local files), else each read once, whole."""

    def __init__(self, inner: Source, verifier: Verifier | InOrder) -> None:
        super().__init__(inner)
        self.verifier = verifier
        self._stepwise = isinstance(inner, Stepwise) and isinstance(verifier, Verifier)

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        v = self.verifier
        if not self._stepwise:
            n, how = self.inner.read_into(buf, offset=offset)
            v.add(buf[:n], offset)
            return n, how
        assert isinstance(v, Verifier) and isinstance(self.inner, Stepwise)
        landing = v.landing(offset, offset + max(0, min(len(buf), self.size - offset)))
        if not landing.segments:  # every byte is checked already (an earlier load, or a neighbour)
            return self.inner.read_into(buf, offset=offset)
        try:
            n, how = self.inner.read_stepwise(buf, offset=offset, landed=landing)
        except BaseException:
            v.abandon(landing)
            raise
        v.arrived(landing, buf[:n], offset)
        return n, how
