"""The checksums a load can check while it reads: those that *combine*.

A combinable checksum of ``A + B`` follows from the checksums of ``A`` and ``B`` and the length
of ``B``, so each read is checked where it lands, in any order, by the thread that read it, and
a file's or piece's checksum is put together from its reads' (per read, never per byte) with no
second pass and no ordering buffer. These are the CRCs:

- ``crc32c``: the manifest's (``weightstream manifest``), and one of S3's;
- ``crc64nvme``: what S3 computes for every object uploaded since December 2024 without a
  checksum of its own;
- ``crc32``: what the AWS SDKs send by default since 2025.

SHA-1 and SHA-256 (S3's other two; the Hugging Face Hub's) do not combine: they need the bytes
in order (see :mod:`weightstream.engine.verify`).

The arithmetic is ``awscrt``'s (AWS's common runtime, made for exactly this): measured here at
25 GB/s per core for CRC32C and CRC64/NVME, with the GIL released (45 GB/s on two threads),
against 15 GB/s for the ``crc32c`` package. CRC32 is ``zlib-ng``'s (27 GB/s, GIL released),
against 23 for ``isal``, 4.1 for the standard library's ``zlib`` and 3.0 for awscrt's; its
combine is awscrt's. None of this arithmetic is ours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from awscrt import checksums as _crt
from zlib_ng import zlib_ng

__all__ = ["ALGORITHMS", "Algorithm", "algorithm"]


@dataclass(frozen=True)
class Algorithm:
    """One combinable checksum: ``compute(data, previous)`` continues ``previous`` over ``data``
    (``0`` starts one); ``combine(a, b, len_b)`` is the checksum of ``A + B``."""

    name: str
    bits: int
    compute: Callable[[Any, int], int]
    combine: Callable[[int, int, int], int]

    def of(self, data: Any, previous: int = 0) -> int:
        return int(self.compute(data, previous))

    def composite(self, checksums: list[int] | tuple[int, ...]) -> int:
        """The checksum of ``checksums`` (their bytes, big-endian, in order): an S3 multipart
        upload's composite of its parts' checksums."""
        width = self.bits // 8
        return self.of(b"".join(c.to_bytes(width, "big") for c in checksums))

    def text(self, value: int) -> str:
        """``value`` as hex digits, as manifests and messages write it."""
        return f"{value:0{self.bits // 4}x}"


def _crc32(data: Any, previous: int) -> int:
    return zlib_ng.crc32(data, previous)


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("crc32c", 32, _crt.crc32c, _crt.combine_crc32c),
        Algorithm("crc64nvme", 64, _crt.crc64nvme, _crt.combine_crc64nvme),
        Algorithm("crc32", 32, _crc32, _crt.combine_crc32),
    )
}


def algorithm(name: str) -> Algorithm:
    return ALGORITHMS[name]
