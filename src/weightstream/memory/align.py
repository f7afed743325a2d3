"""The alignment every read and buffer keeps (pure arithmetic, no imports)."""

from __future__ import annotations

__all__ = ["ALIGN", "align_down", "align_up"]

ALIGN = 4096
"""Alignment of every buffer and read (``O_DIRECT`` needs the logical block size; 4096 covers
512 too)."""


def align_down(x: int) -> int:
    return x - x % ALIGN


def align_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN
