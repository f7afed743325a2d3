"""Sets of byte ranges of a file. Pure."""

from __future__ import annotations

import bisect

__all__ = ["Ranges"]


class Ranges:
    """Disjoint byte ranges ``[start, end)``, merged as they are added."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self.ends, start)  # first range that ends at or after start
        j = bisect.bisect_right(self.starts, end)  # ranges from i to j touch [start, end)
        if i < j:
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def remove(self, start: int, end: int) -> None:
        """Take ``[start, end)`` out (what lay around it stays)."""
        if end <= start:
            return
        i = bisect.bisect_right(self.ends, start)  # first range that ends after start
        j = bisect.bisect_left(self.starts, end)  # ranges from i to j overlap [start, end)
        if i >= j:
            return
        starts, ends = [], []
        if self.starts[i] < start:
            starts.append(self.starts[i])
            ends.append(start)
        if self.ends[j - 1] > end:
            starts.append(end)
            ends.append(self.ends[j - 1])
        self.starts[i:j] = starts
        self.ends[i:j] = ends

    def covers(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.ends[i] >= end

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` not covered."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        pos = start
        while pos < end and i < len(self.starts):
            s, e = self.starts[i], self.ends[i]
            if e <= pos:
                i += 1
                continue
            if s >= end:
                break
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
            i += 1
        if pos < end:
            out.append((pos, end))
        return out

    @property
    def total(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))
