"""How the ranks of a load share its reads: the seam between one pipeline and one or many ranks.

A plain load is a load across one rank: :class:`LocalExchange` agrees with itself, reports to
no one, and reads every block (the pattern of torch.distributed.checkpoint's ``_DistWrapper``
with no group). The group exchange (:mod:`weightstream.distributed`) meets the same protocol,
so the pipeline has one code path.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Protocol

import torch

from weightstream.engine.delivery import Delivery
from weightstream.engine.plan import Block, ReadPlan
from weightstream.engine.scheduler import Job, run_plan

__all__ = ["Exchange", "Job", "LocalExchange"]


class Exchange(Protocol):
    """The ranks of one load (see the module docstring)."""

    @property
    def rank(self) -> int | None:
        """This rank's number in the group (``None`` for a plain load)."""
        ...

    @property
    def world(self) -> int: ...

    @property
    def received(self) -> int:
        """Bytes this rank received from the others instead of reading them."""
        ...

    @property
    def stopped(self) -> int | None:
        """Rounds gathered before the ranks gave the split up and each read the rest itself;
        ``None`` if they never did (or there is nothing to split)."""
        ...

    def open(
        self,
        plan: ReadPlan,
        sizes: Sequence[int],
        *,
        memory_limit: int,
        copies: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Agree that every rank planned the same load and reads the same copy of each file, or
        raise (every rank at once). ``copies``: per file, its URI on this rank and what names
        its bytes (an object's version, the manifest's checksum; empty where nothing does)."""
        ...

    def report(self, exc: BaseException) -> None:
        """Tell the other ranks this one failed or stopped; never raises."""
        ...

    def blocks(self, job: Job, *, delivery: Delivery) -> Generator[tuple[Block, torch.Tensor], None, None]:
        """Every block of ``job.plan`` with its bytes, on this rank. The exchange makes the sink
        (``delivery.make_sink``) with the allocator it needs, and closes it."""
        ...


class LocalExchange:
    """One rank: nothing to agree on or exchange."""

    rank: int | None = None
    world = 1
    received = 0
    stopped: int | None = None

    def open(
        self,
        plan: ReadPlan,
        sizes: Sequence[int],
        *,
        memory_limit: int,
        copies: Sequence[tuple[str, str]] = (),
    ) -> None:
        pass

    def report(self, exc: BaseException) -> None:
        pass

    def blocks(self, job: Job, *, delivery: Delivery) -> Generator[tuple[Block, torch.Tensor], None, None]:
        sink = delivery.make_sink()
        try:
            yield from run_plan(
                job.plan,
                job.sources,
                job.config,
                counters=job.counters,
                on_bytes=job.on_bytes,
                tuning=job.tuning,
                sink=sink,
                keep_all=job.keep_all,
            )
        finally:
            sink.close()
