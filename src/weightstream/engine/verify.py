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

Bytes read twice (a page two neighbouring blocks share) are counted once. A piece the load reads
only in part (some tensors of a shard; a distributed rank's share ending inside it) is not
checked: :attr:`Verifier.unchecked` counts its bytes.
"""

from __future__ import annotations

import hashlib
import logging
import threading

from weightstream.errors import FormatError
from weightstream.format.checksums import ALGORITHMS, algorithm
from weightstream.format.manifest import FileDigest
from weightstream.format.ranges import Ranges
from weightstream.sources.base import ReadHow, Source, Wrapped

__all__ = ["Checked", "InOrder", "Verifier", "verifier_for"]

log = logging.getLogger(__name__)


def verifier_for(uri: str, digest: FileDigest, head: bytes, *, hold_max: int) -> Verifier | InOrder:
    """The check of one shard: by pieces, in any order, for a CRC; in order for a hash that
    does not combine (SHA-256, SHA-1)."""
    if digest.algorithm in ALGORITHMS:
        return Verifier(uri, digest, head, hold_max=hold_max)
    return InOrder(uri, digest, head, pending_max=hold_max)


class Verifier:
    """One shard's checks during one load. ``head``: the file's first bytes, read at open.

    ``hold_max``: the largest piece ``stream()`` holds a block back for until it is checked
    (:attr:`holds`). Held blocks stay in the load's memory, and the piece's other reads must
    fit beside them: a piece larger than that (a store's checksum of a whole object is one
    piece of the object's size) is not held, its blocks are handed over as read, and a mismatch
    raises from the stream when the piece's last byte arrives. ``load()`` returns nothing
    either way."""

    def __init__(self, uri: str, digest: FileDigest, head: bytes, *, hold_max: int) -> None:
        self.uri = uri
        self.digest = digest
        self.algorithm = algorithm(digest.algorithm)
        self.holds = digest.piece_size <= hold_max
        """Whether ``stream()`` holds blocks back until their pieces are checked."""
        self.lock = threading.Lock()
        n = len(digest.pieces)
        self._claimed = [Ranges() for _ in range(n)]
        self._parts: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # (offset, length, crc)
        self._have = [0] * n
        self.checked = [False] * n
        self.failed = False
        """A piece's bytes did not match."""
        if head:
            self.add(memoryview(head), 0)

    def add(self, data: memoryview, offset: int) -> None:
        """The bytes at ``offset`` arrived: check every piece they complete (raises
        :class:`FormatError` on a mismatch)."""
        end = min(offset + len(data), self.digest.size)
        size = self.digest.piece_size
        pos = offset
        while pos < end:
            i = pos // size
            stop = min(end, (i + 1) * size)
            with self.lock:
                gaps = self._claimed[i].gaps(pos, stop)
                for a, b in gaps:
                    self._claimed[i].add(a, b)
            parts = [(a, b - a, self.algorithm.of(data[a - offset : b - offset])) for a, b in gaps]
            with self.lock:
                self._parts[i] += parts
                self._have[i] += sum(n for _, n, _ in parts)
                start, piece_end = self.digest.piece(i)
                done = parts and self._have[i] == piece_end - start
                pieces = sorted(self._parts[i]) if done else []
            if done:
                self._check(i, pieces)
            pos = stop

    def _check(self, i: int, parts: list[tuple[int, int, int]]) -> None:
        crc = 0  # the CRC of no bytes
        combine = self.algorithm.combine
        for _, n, c in parts:
            crc = combine(crc, c, n)
        want = self.digest.pieces[i]
        start, end = self.digest.piece(i)
        if crc != want:
            self.failed = True
            text, origin = self.algorithm.text, self.digest.origin
            raise FormatError(
                f"checksum mismatch: {origin} gives {self.algorithm.name} {text(want)} for bytes "
                f"{start}-{end}, the bytes read give {text(crc)} (the file differs from the one "
                f"{origin} describes)",
                uri=self.uri,
                byte_range=(start, end),
            )
        with self.lock:
            self.checked[i] = True
            self._parts[i] = []

    def verified(self, start: int, end: int) -> bool:
        """Whether every piece ``[start, end)`` lies in is checked."""
        size = self.digest.piece_size
        end = min(end, self.digest.size)
        if end <= start:
            return True
        return all(self.checked[i] for i in range(start // size, (end - 1) // size + 1))

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
        return sum(
            self.digest.piece(i)[1] - self.digest.piece(i)[0] for i, ok in enumerate(self.checked) if ok
        )


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
    raises then; ``load()`` returns nothing."""

    holds = False

    def __init__(self, uri: str, digest: FileDigest, head: bytes, *, pending_max: int) -> None:
        self.uri = uri
        self.digest = digest
        self.lock = threading.Lock()
        self._hash = hashlib.new(digest.algorithm)
        self._at = 0
        """Bytes hashed: the file's first ``_at``."""
        self._ahead: dict[int, bytes] = {}
        self._ahead_bytes = 0
        self._pending_max = pending_max
        self._seen = False
        self.gave_up = ""
        self.checked_whole = False
        self.failed = False
        if head:
            self.add(memoryview(head), 0)

    def add(self, data: memoryview, offset: int) -> None:
        end = min(offset + len(data), self.digest.size)
        if end <= offset:
            return
        with self.lock:
            self._seen = True
            if self.gave_up or self.checked_whole:
                return
            if offset > self._at:
                if self._ahead_bytes + (end - offset) > self._pending_max:
                    self._give_up(f"more than {self._pending_max} bytes arrived ahead of the hashed ones")
                    return
                kept = self._ahead.get(offset)
                if kept is None or len(kept) < end - offset:
                    self._ahead_bytes += end - offset - (len(kept) if kept else 0)
                    self._ahead[offset] = bytes(data[: end - offset])
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

    def _take(self, data: memoryview, offset: int, end: int) -> None:
        if end > self._at:
            self._hash.update(data[self._at - offset : end - offset])
            self._at = end

    def _give_up(self, why: str) -> None:
        self.gave_up = why
        self._ahead, self._ahead_bytes = {}, 0
        log.warning("%s: not checked against %s: %s", self.uri, self.digest.origin, why)

    def _finish(self) -> None:
        got = int.from_bytes(self._hash.digest(), "big")
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


class Checked(Wrapped):
    """A load's source whose reads are checked by ``verifier`` as they land."""

    def __init__(self, inner: Source, verifier: Verifier | InOrder) -> None:
        super().__init__(inner)
        self.verifier = verifier

    def read_into(self, buf: memoryview, *, offset: int) -> tuple[int, ReadHow]:
        n, how = self.inner.read_into(buf, offset=offset)
        self.verifier.add(buf[:n], offset)
        return n, how
