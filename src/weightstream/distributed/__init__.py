"""Loading across the ranks of a torch.distributed process group (internal).

Every rank of the group calls the same load. Each reads about ``1/N`` of the bytes from
storage and the ranks exchange the rest over the group, so every rank ends with every tensor.

Which rank calls what, in which order (all ranks of the group, none outside it)::

    open exchange      all_gather of a status record: OK + a digest of the read plan,
                       or this rank's error (its headers failed, a tensor is missing, ...)
    until every round is gathered:   (reads of this rank's parts run ahead in the background)
        status         all_gather of a status record: OK and a bitmap of the rounds whose part
                       this rank has, or the error that stopped this rank
        data           if some round is in every bitmap, the lowest: all_gather of that round,
                       rank r contributing bytes [r*P, (r+1)*P); else none (each rank waits up
                       to 50 ms for one more part and the status exchange is repeated)
    or, once the status records say the split does not pay (:func:`split_pays`): nothing more
    is exchanged, and every rank reads the rest of every round itself.

Rounds are gathered in the order every rank has its part, not in plan order, so a part late on
one rank (a read in a latency tail) holds only its own round.

Whether to split is decided per load, from what it measures: each status record carries what
its rank measured (the rate its reads ran at while memory did not hold them back, and the time
the exchanges took), so every rank reaches the same decision at the same exchange. Where the
exchange is slower than reading everything would be (a few cores shared by the reads, the
exchange's copies and a user-space file system; a page cache that holds the whole checkpoint),
the ranks stop exchanging and each reads the rest; its parts already read are kept.

A *round* is a run of whole blocks of the read plan (tensors never straddle rounds) of about a
third of ``memory_limit``, at most 256 MiB; a block larger than that is a round of its own. Its bytes are split
into N equal parts at 4 KiB boundaries, cutting inside tensors and files wherever that balances
the ranks, and rank r reads part r into a buffer of its own, then all ranks gather the parts into
the round's buffer. The round's tensors are views of that buffer. Memory: at most about
``memory_limit``: the parts read ahead (as many rounds ahead as ``rank_budget`` allows: the bytes
in flight from storage, which a long round trip needs) and two round buffers.

Checked loads (``verify``, a CRC per piece of each file): a piece's bytes are read by several
ranks, so no rank could check it from its own reads. Each rank checks the bytes it reads as they
land and, after a round is gathered, sends the CRCs of its part of it (a few per part: the CRCs
of a piece's bytes combine) in its next status record; every rank puts them together with its
own and checks every piece, so a mismatch fails every rank at the same exchange. A byte two
parts share (a page two neighbouring blocks share) is checked by the first part that holds it.
After the last round one more status exchange carries the last CRCs (more, while any rank has
more than a record holds). A stream hands a round's tensors over when it is gathered; a piece
whose check fails raises from the stream at the next exchange. ``load()`` returns nothing
either way.

A hash that does not combine (the Hub's SHA-256) is taken in file order, so no part can be
hashed alone. Once a round is gathered every rank has every byte of it, so one rank a file (the
files shared out by size) hashes the file's blocks of each round as it is gathered, and sends
its verdict in a status record once the file's last byte is in; a mismatch fails that rank
before the next status exchange, and every rank with it there. Where the ranks stop exchanging,
the rank that hashes a file goes on with the rest it reads itself (a mismatch then fails it
alone), and the others count the file as unchecked: its rest is their own copy's.

Failures: a rank that fails (or whose stream is closed early) joins the next status exchange
with its error, so every rank raises at the same point, promptly, instead of waiting at a
collective the failed rank will never join. Every collective waits at most
``StreamConfig.exchange_timeout`` seconds (a rank that died or hung); after such a timeout the
group is in an undefined state and should be destroyed.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import hashlib
import logging
import math
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from weightstream import _process
from weightstream.config import StreamConfig, settled
from weightstream.engine.delivery import Delivery
from weightstream.engine.exchange import Job
from weightstream.engine.plan import Block, ReadPlan, align_up
from weightstream.engine.scheduler import Budget, Polled, run_plan, run_plan_polled
from weightstream.errors import ConfigError, DistributedError, FormatError
from weightstream.format.ranges import Ranges
from weightstream.memory.buffers import ALIGN

if TYPE_CHECKING:
    from weightstream.engine.verify import InOrder, Verifier

__all__ = [
    "GroupExchange",
    "HandedOver",
    "Measured",
    "Round",
    "handed",
    "make_rounds",
    "plan_digest",
    "rank_budget",
    "resolve_group",
    "round_target",
    "run_distributed",
    "split_pays",
]

log = logging.getLogger(__name__)

Distributed = bool | Literal["auto"]

_RECORD = 4096
"""Bytes of one rank's status record: state, plan digest, error text (then its CRCs)."""
_CRCS = 8192
"""Bytes of a status record after :data:`_RECORD` that carry CRCs of the bytes this rank read
(a checked load: :class:`_Checks`): a count, a flag (more to come), and the CRCs."""
_CRC = struct.Struct("<IQQQ")
"""One CRC a rank sends: file index in the plan, offset, length, CRC."""
_VERDICT = 1 << 31
"""Set in a sent CRC's file index: not a CRC but the verdict of the rank that hashed that file
in order (:class:`_Checks`); its offset is 1 where every byte was hashed and found right."""
_OK, _FAILED, _CLOSED = 0, 1, 2
_ROUND_BYTES = 256 << 20
"""Largest round: smaller rounds start the exchange sooner, so reads and exchange overlap more;
each round costs two collectives (figures: bench/RESULTS.md, "The measurements behind the
code")."""
_DIGEST = 32
_WINDOW = 1024
"""Bytes of the bitmap in a status record that says which rounds a rank has its part of: the
8,192 rounds from the lowest one not yet gathered (one beyond it is told in a later exchange)."""
_POLL = 0.05
"""Seconds a rank waits for one more part after an exchange found no round every rank has,
before it asks again: a late read of its own never keeps it from the exchange for longer."""
_FIRST_ROUND = 32 << 20
"""The first round's size; each next one is twice the last, up to the round target. Small
first rounds start the exchange sooner and let :func:`split_pays` judge it early, so a load on
which the split does not pay has gathered little before it stops (bench/RESULTS.md, "The
per-load split decision")."""
_DECIDE_AFTER = 64 << 20
"""Bytes gathered (and at least two rounds) before the split is judged: enough for the rates to
mean something (the first two rounds); a load smaller than this is split throughout (it is over
before it matters)."""
_MARGIN = 0.9
"""The split is given up only when reading everything is predicted at least this much faster
(a tenth): measurements are noisy, and the rest's reads start anew (the depth climbs again)."""


@dataclass
class Measured:
    """What one rank measured so far: the inputs of :func:`split_pays`, carried in its status
    record."""

    read_bytes: int = 0
    """Bytes of its reads that ended after its first (:attr:`ReadCounters.rate_bytes`)."""
    read_seconds: float = 0.0
    """The seconds from its first read's end in which at least one of its reads was in flight
    (:attr:`ReadCounters.rate_seconds`): time in which memory or the exchange held every read
    back is left out, so a slow exchange does not make the reads look slow."""
    gathered: int = 0
    """Bytes of the rounds gathered."""
    gather_seconds: float = 0.0
    """Time spent in the gathers."""
    gathers: int = 0

    _FORMAT = struct.Struct("<QdQdI")

    def pack(self) -> bytes:
        return self._FORMAT.pack(
            self.read_bytes, self.read_seconds, self.gathered, self.gather_seconds, self.gathers
        )

    @classmethod
    def unpack(cls, raw: bytes) -> Measured:
        return cls(*cls._FORMAT.unpack(raw[: cls._FORMAT.size]))


_MEASURED = 40
"""Bytes of a status record that carry its rank's :class:`Measured`."""


def split_pays(measured: Sequence[Measured], world: int) -> bool | None:
    """Whether splitting the reads is still worth it, from every rank's measurements (the same
    answer on every rank); ``None`` until enough is measured (:data:`_DECIDE_AFTER`, and a read
    rate on every rank).

    ``R`` is the slowest rank's read rate while its reads were driven, and ``X`` the exchange's
    rate (a round's bytes over the time in its gather, from the fastest rank, which waited least
    for the others). Both are measured while the split runs, so what the reads and the exchange
    take from each other (two cores shared by reads and gloo's copies, one disk) is already in
    them. Reading everything then delivers ``R`` a rank, and the split the slower of its reads
    (``world * R``) and its exchange (``X``), as the two overlap. With two ranks or more the split
    is slower only where ``X < R``: it is kept unless ``X`` is :data:`_MARGIN` of ``R`` or less.
    ``R`` during the split is at most what reading alone gets, so the rule leans towards the
    split (bench/RESULTS.md, "The per-load split decision": the model that adds the two costs
    instead gave up a split that was 1.18x faster)."""
    if min(m.gathers for m in measured) < 2 or min(m.gathered for m in measured) < _DECIDE_AFTER:
        return None
    if not min(m.read_bytes for m in measured):  # a rank with no rate yet (fewer than two reads)
        return None
    read, gather = _rates(measured)
    return not gather <= _MARGIN * read


class HandedOver:
    """Tensors given to a collective, kept by Python until the backend lets go of them.

    A backend's thread (gloo's worker, NCCL's watchdog) drops its references to a collective's
    tensors after the collective completes, so possibly after ``wait()`` returned. If Python let
    go first, that thread drops the last reference, and freeing a tensor Python made needs the
    GIL. While the interpreter runs, the thread waits for the GIL. Once the interpreter is
    finalizing, the thread is ended instead, inside a C++ destructor, and the process aborts
    ("terminate called without an active exception", SIGABRT) after a load that succeeded: 1 in
    30 to 60 ``weightstream load --distributed`` runs under torchrun did this.

    The rule: the backend never holds the last reference. Each collective gets tensors of its
    own (``detach()``: the same memory, a handle no one else holds) and gives them to
    :meth:`keep` after its wait. A handle is let go here once its use count says only Python
    holds it: at once as a rule (gloo lets go microseconds after completing), else at a later
    :meth:`keep` or :meth:`sweep`. At exit, the handles a backend still holds are left for the
    process's end (never freed by a thread that cannot take the GIL).
    """

    _SETTLE = 0.005
    """Seconds :meth:`keep` waits for the backend to let go of a collective's tensors before
    it keeps them for later (their memory is held that long)."""

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []
        self._lock = threading.Lock()
        atexit.register(self.leave_at_exit)

    def keep(self, *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` (handles made for one collective, after its wait) until the
        backend lets go of them."""
        deadline = time.monotonic() + self._SETTLE
        left = [t for t in tensors if _held_elsewhere(t)]
        while left and time.monotonic() < deadline:
            time.sleep(0.0001)  # the GIL is let go: the backend's thread may need it
            left = [t for t in left if _held_elsewhere(t)]
        with self._lock:
            self._held.extend(left)
        self.sweep()

    def sweep(self) -> int:
        """Let go of the handles no backend holds any more; returns how many are still held."""
        with self._lock:
            self._held = [t for t in self._held if _held_elsewhere(t)]
            return len(self._held)

    def leave_at_exit(self) -> None:
        """At exit, a handle a backend still holds is left to the process's end: its Python
        object gets one reference more, so the backend's thread never frees it."""
        with self._lock:
            held, self._held = [t for t in self._held if _held_elsewhere(t)], []
        for t in held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))

    def after_fork(self) -> None:
        """In a forked child: a lock of its own (another thread of the parent may have held
        it). The handles stay: the parent's backend threads are gone, so they stay held."""
        self._lock = threading.Lock()


def _held_elsewhere(tensor: torch.Tensor) -> bool:
    """Whether anything but its Python object holds ``tensor`` (a handle made for a
    collective, which only the backend's views and work hold besides)."""
    count: int = tensor._use_count()  # type: ignore[attr-defined]  # (not in torch's stubs)
    return count > 1


handed = HandedOver()
"""The tensors this process gave to collectives that a backend may still hold."""
_process.at_fork(handed.after_fork)


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("distributed loading needs torch.distributed, which this torch build lacks")
    return dist


def resolve_group(process_group: Any, distributed: Distributed) -> Any:
    """The group to load across, or ``None`` for a plain load.

    ``process_group`` given: that group (this rank must belong to it). Otherwise
    ``distributed=True``: the default group (torch.distributed must be initialised);
    ``"auto"``: the default group when torch.distributed is initialised with more than one rank;
    ``False``: none. A group of one rank is a plain load.
    """
    if distributed not in (True, False, "auto"):
        raise ConfigError(f"distributed must be True, False or 'auto', got {distributed!r}")
    if process_group is None and distributed is False:
        return None
    dist = _dist()
    explicit = process_group
    if process_group is None:
        if not dist.is_initialized():
            if distributed == "auto":
                return None
            raise ConfigError("distributed=True, but torch.distributed is not initialised")
        process_group = dist.group.WORLD
    elif not dist.is_initialized():
        raise ConfigError("a process_group was given, but torch.distributed is not initialised")
    if _process.inherited_group(process_group):
        if distributed == "auto" and explicit is None:
            log.warning(
                "torch.distributed's default group was made by the process this one was forked from; "
                "loading without it (distributed='auto')"
            )
            return None
        raise ConfigError(
            "this process was forked from the one that made the process group: its connections are "
            "that process's, and a collective on it would hang or mix with the parent's. Make a "
            "process group in this process (or start it with the 'spawn' start method)"
        )
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(process_group) < 0:
        raise ConfigError("this rank is not a member of the process_group it was asked to load across")
    return process_group if dist.get_world_size(process_group) > 1 else None


class GroupExchange:
    """The collectives of one distributed load, over one group, each bounded by ``timeout``
    (meets :class:`weightstream.engine.exchange.Exchange`)."""

    def __init__(self, group: Any, *, device: torch.device, timeout: float) -> None:
        dist = _dist()
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world: int = dist.get_world_size(group)
        self.device = device if device.type == "cuda" else torch.device("cpu")
        """Where collective buffers live: the load's CUDA device (NCCL), else host (gloo)."""
        self.timeout = timeout
        self.exchanges = 0
        """Status exchanges done so far (the open exchange is the first)."""
        self.pending = True
        """A status exchange is still to come: a failing rank must join it."""
        self.received = 0
        """Bytes this rank received from the others."""
        self.stopped: int | None = None
        """Rounds gathered before the ranks stopped exchanging and each read the rest itself
        (:func:`split_pays`); ``None``: split to the end."""
        self.heard: list[tuple[list[tuple[int, int, int, int]], bool, bool]] = []
        """By rank, from the last status exchange: the CRCs it sent, whether it has more, and
        whether it checks any file."""

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            self.pending = False  # the group is unusable now; nothing more is exchanged
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} failed (waited at most "
                f"exchange_timeout={self.timeout:g} s; another rank died, hung, or did not make "
                f"the same load call): {exc}"
            ) from None

    def status(
        self,
        state: int,
        message: str = "",
        digest: bytes = b"",
        window: tuple[int, bytes] = (0, b""),
        measured: Measured | None = None,
        crcs: tuple[bytes, bool, bool] = (b"", False, False),
    ) -> list[tuple[int, str, bytes, bytes, Measured]]:
        """All-gather one status record per rank: ``(state, message, digest, bitmap, measured)``
        by rank. ``window``: (first round, bitmap of the rounds from it whose part this rank
        has); ``measured``: what this rank measured so far; ``crcs``: CRCs of bytes this rank
        read (:data:`_CRC` each), whether it has more, and whether it checks any file. What the
        ranks sent of those is :attr:`heard`."""
        base, bits = window
        record = bytearray(_RECORD + _CRCS)
        packed, more, checking = crcs
        count = min(len(packed) // _CRC.size, (_CRCS - 3) // _CRC.size)
        record[_RECORD : _RECORD + 2] = count.to_bytes(2, "little")
        record[_RECORD + 2] = int(more) | int(checking) << 1
        record[_RECORD + 3 : _RECORD + 3 + count * _CRC.size] = packed[: count * _CRC.size]
        record[0] = state
        record[1 : 1 + len(digest)] = digest[:_DIGEST]
        text = message.encode("utf-8")[: _RECORD - 3 - _DIGEST - _MEASURED - 8 - _WINDOW]
        record[1 + _DIGEST : 3 + _DIGEST] = len(text).to_bytes(2, "little")
        record[3 + _DIGEST : 3 + _DIGEST + len(text)] = text
        at = _RECORD - _WINDOW - 8 - _MEASURED
        record[at : at + _MEASURED] = (measured or Measured()).pack().ljust(_MEASURED, b"\0")
        record[_RECORD - _WINDOW - 8 : _RECORD - _WINDOW] = base.to_bytes(8, "little")
        record[_RECORD - _WINDOW : _RECORD - _WINDOW + len(bits)] = bits[:_WINDOW]
        mine = torch.frombuffer(record, dtype=torch.uint8).to(self.device)
        size = _RECORD + _CRCS
        out = torch.empty(self.world * size, dtype=torch.uint8, device=self.device)
        what = "the opening exchange" if self.exchanges == 0 else f"status exchange {self.exchanges}"
        self.exchanges += 1
        self._run(out, mine, what)
        raw = bytes(out.cpu().numpy())
        records = []
        self.heard = []
        for r in range(self.world):
            tail = raw[r * size + _RECORD : (r + 1) * size]
            n = int.from_bytes(tail[:2], "little")
            crcs_r = [_CRC.unpack_from(tail, 3 + j * _CRC.size) for j in range(n)]
            self.heard.append((crcs_r, bool(tail[2] & 1), bool(tail[2] & 2)))
            rec = raw[r * size : r * size + _RECORD]
            n = int.from_bytes(rec[1 + _DIGEST : 3 + _DIGEST], "little")
            text_r = rec[3 + _DIGEST : 3 + _DIGEST + n].decode("utf-8", errors="replace")
            same_base = int.from_bytes(rec[-_WINDOW - 8 : -_WINDOW], "little") == base
            bitmap = rec[_RECORD - _WINDOW :] if same_base else bytes(_WINDOW)
            got = Measured.unpack(rec[_RECORD - _WINDOW - 8 - _MEASURED :])
            records.append((rec[0], text_r, rec[1 : 1 + _DIGEST], bitmap, got))
        return records

    def _raise_unhealthy(self, records: list[tuple[int, str, bytes, bytes, Measured]]) -> None:
        """Raise if any rank's record says it failed or stopped."""
        bad = [(r, state, text) for r, (state, text, *_) in enumerate(records) if state != _OK]
        if bad:
            self.pending = False
            r, state, text = bad[0]
            others = f" (and {len(bad) - 1} more ranks)" if len(bad) > 1 else ""
            verb = "failed" if state == _FAILED else "stopped"
            raise DistributedError(f"rank {r} of {self.world} {verb}{others}: {text}", rank=r)

    def check(
        self,
        digest: bytes = b"",
        window: tuple[int, bytes] = (0, b""),
        measured: Measured | None = None,
        crcs: tuple[bytes, bool, bool] = (b"", False, False),
    ) -> tuple[bytes, list[Measured]]:
        """Join a status exchange as healthy; raise if any rank is not (or, with ``digest``,
        if the ranks planned different loads). Returns the bitmap of ``window`` every rank
        shares (the bitwise and of theirs) and what each rank measured, by rank."""
        records = self.status(_OK, digest=digest, window=window, measured=measured, crcs=crcs)
        self._raise_unhealthy(records)
        if digest and len({d for _, _, d, *_ in records}) > 1:
            self.pending = False
            differ = [r for r, (_, _, d, *_) in enumerate(records) if d != records[0][2]]
            raise DistributedError(
                f"ranks planned different loads (rank {differ[0]} differs from rank 0 in tensors, "
                "dtypes, shapes, offsets, or the chunk_size / memory_limit settings): every rank must "
                "load the same checkpoint and selection with the same settings"
            )
        shared = int.from_bytes(window[1], "little")
        for *_, bits, _ in records:
            shared &= int.from_bytes(bits[: len(window[1])], "little")
        return shared.to_bytes(len(window[1]), "little"), [m for *_, m in records]

    def open(
        self,
        plan: ReadPlan,
        sizes: Sequence[int],
        *,
        memory_limit: int,
        copies: Sequence[tuple[str, str]] = (),
    ) -> None:
        """The opening exchange: every rank healthy and with the same plan, or all raise. Where
        a file's bytes are named (``copies``: an object's version, the manifest's checksum), a
        second exchange: every rank reads the same copy of each, or all raise naming the first
        that differs (ranks reading other bytes of the same layout would return a mix)."""
        self.check(plan_digest(plan, sizes, round_bytes=_round_bytes(memory_limit)))
        if not any(name for _, name in copies):
            return
        tags = [hashlib.sha256(name.encode()).hexdigest()[:8] for _, name in copies]
        records = self.status(_OK, ",".join(tags), digest=hashlib.sha256("".join(tags).encode()).digest())
        self._raise_unhealthy(records)
        if len({d for _, _, d, *_ in records}) == 1:
            return
        self.pending = False
        r = next(r for r, rec in enumerate(records) if rec[2] != records[0][2])
        theirs, first = records[r][1].split(","), records[0][1].split(",")
        k = next((i for i, (a, b) in enumerate(zip(theirs, first, strict=False)) if a != b), None)
        which = f"{copies[k][0]}" if k is not None and k < len(copies) else "a file of the checkpoint"
        raise DistributedError(
            f"rank {r} of {self.world} reads another copy of {which} than rank 0 (another object "
            "version, or other bytes than the manifest's): every rank must read the same bytes",
            rank=r,
        )

    def blocks(self, job: Job, *, delivery: Delivery) -> Generator[tuple[Block, torch.Tensor], None, None]:
        """Every block, round by round: this rank reads its part, the group gathers the rest.
        ``job.keep_all`` (a ``load()`` into host memory) holds while the split runs only for
        what it can (the parts read ahead are memory of their own until gathered), and for the
        rest read after a stop (:func:`_read_rest`)."""
        return run_distributed(job, self, delivery=delivery)

    def report(self, exc: BaseException) -> None:
        """Join the next status exchange with this rank's failure (or early close), so the
        other ranks raise it too. Never raises: the caller re-raises its own error."""
        if not self.pending:
            return
        self.pending = False
        closed = isinstance(exc, GeneratorExit)
        message = "its stream was closed before the end" if closed else f"{type(exc).__name__}: {exc}"
        try:
            self.status(_CLOSED if closed else _FAILED, message)
        except BaseException as err:
            log.warning("rank %d could not tell the other ranks it failed: %s", self.rank, err)

    def gather(self, flat: torch.Tensor, mine: torch.Tensor, what: str) -> None:
        """All-gather: rank r's ``mine`` into ``flat[r*len(mine):(r+1)*len(mine)]`` of every rank."""
        self._run(flat, mine, what)

    def _run(self, out: torch.Tensor, mine: torch.Tensor, what: str) -> None:
        # The backend gets tensors of its own (same memory): Python keeps them until the
        # backend lets go of them (:data:`handed`).
        out, mine = out.detach(), mine.detach()
        try:
            work = _all_gather(out, mine, self.group)
        except (RuntimeError, ValueError) as exc:
            # Refused before anything was sent (the same on every rank): e.g. an NCCL-only group
            # asked to exchange host tensors.
            self.pending = False
            backend = _dist().get_backend(self.group)
            raise DistributedError(
                f"rank {self.rank} of {self.world}: the process group (backend {backend!r}) cannot "
                f"exchange {self.device.type} tensors: {exc}. Load to device='cuda' with an NCCL "
                "group, or pass a gloo group (dist.new_group(backend='gloo')) for CPU tensors"
            ) from None
        self._wait(work, what)
        del work  # its future holds the collective's output
        handed.keep(out, mine)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    dist = _dist()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


@dataclass(frozen=True)
class Round:
    """Whole blocks of the read plan, gathered together. Block ``blocks[i]`` lies at
    ``positions[i]`` of the round's buffer; rank r reads ``[r*part, (r+1)*part)`` of it."""

    index: int
    blocks: tuple[Block, ...]
    positions: tuple[int, ...]
    nbytes: int
    part: int

    def extents(self, rank: int) -> Iterator[tuple[int, int, int, int]]:
        """``(block index in the round, file start, file end, buffer position)`` of the pieces
        of blocks in ``rank``'s part."""
        lo, hi = rank * self.part, min((rank + 1) * self.part, self.nbytes)
        for i, (block, pos) in enumerate(zip(self.blocks, self.positions, strict=True)):
            a, b = max(lo, pos), min(hi, pos + block.nbytes)
            if a < b:
                yield i, block.start + (a - pos), block.start + (b - pos), a


def make_rounds(plan: ReadPlan, world: int, *, target: int, first: int | None = None) -> list[Round]:
    """Cut the plan's blocks, in order, into rounds of about ``target`` bytes, the first ones
    smaller: round ``k`` holds about ``first * 2**k`` bytes while that is less (``first``:
    :data:`_FIRST_ROUND`). A round holds at least one block."""
    size_of = min(target, first if first is not None else _FIRST_ROUND)
    rounds: list[Round] = []
    group: list[Block] = []
    size = 0

    def close() -> None:
        positions = []
        pos = 0
        for b in group:
            positions.append(pos)
            pos += b.nbytes
        part = align_up(-(-pos // world))
        rounds.append(Round(len(rounds), tuple(group), tuple(positions), pos, part))

    for block in plan.blocks:
        if group and size + block.nbytes > size_of:
            close()
            group, size = [], 0
            size_of = min(target, 2 * size_of)
        group.append(block)
        size += block.nbytes
    if group:
        close()
    return rounds


def plan_digest(plan: ReadPlan, sizes: Sequence[int], *, round_bytes: int) -> bytes:
    """What every rank must agree on: the blocks (file index, range, tensor names, dtypes,
    shapes, offsets), the file sizes, and the settings that shape the rounds (the read size
    groups small tensors into blocks, ``round_bytes`` sizes the rounds: :func:`round_target`).
    Paths may differ between ranks (mounts), and so may ``memory_limit`` beyond what sizes the
    rounds (a rank's own budget: on a network file system its default follows the memory its
    host has available)."""
    h = hashlib.sha256()
    h.update(repr((list(sizes), plan.chunk_size, round_bytes)).encode())
    for b in plan.blocks:
        h.update(repr((b.source, b.start, b.end)).encode())
        for t in b.tensors:
            h.update(repr((t.name, t.dtype.name, t.shape, t.start, t.end)).encode())
    return h.digest()


def _my_parts(rounds: Sequence[Round], rank: int) -> tuple[list[Block], list[tuple[int, int]], Counter[int]]:
    """The blocks this rank reads (pieces of the plan's blocks in its parts), where each goes
    (round, position in this rank's part), and the bytes of its part of each round."""
    mine: list[Block] = []
    where: list[tuple[int, int]] = []
    part_bytes: Counter[int] = Counter()
    for rd in rounds:
        for i, start, end, pos in rd.extents(rank):
            mine.append(Block(len(mine), rd.blocks[i].source, start, end, ()))
            where.append((rd.index, pos - rank * rd.part))
            part_bytes[rd.index] += end - start
    return mine, where, part_bytes


class _Arrivals:
    """This rank's parts as their reads finish: which rounds it has its whole part of, and
    which pieces are in."""

    def __init__(
        self, reads: Polled, where: Sequence[tuple[int, int]], left: Counter[int], rounds: int
    ) -> None:
        self.reads, self.where, self.left = reads, where, left
        self.unread = len(where)
        self.have = {k for k in range(rounds) if not left[k]}
        """Rounds not gathered yet whose part this rank has (or has none of)."""
        self.got: set[int] = set()
        """This rank's pieces (indices of its blocks) whose reads are done."""
        next(reads)  # primed: the reads start

    def settle(self, stale: bool) -> None:
        """Take every part finished so far; then, with nothing to offer, wait for one (no round
        can be agreed without this rank's next), or after an exchange that agreed on none
        (``stale``), wait a moment for one more."""
        while self.take(0.0):
            pass
        while not self.have:
            self.take(None)
        if stale:
            self.take(_POLL)
            while self.take(0.0):
                pass

    def take(self, wait: float | None) -> bool:
        """Take one finished block within ``wait`` seconds (``None``: until one finishes);
        ``False`` if none did, or none is left."""
        if not self.unread:
            return False
        item = self.reads.send(wait)
        if item is None:
            return False
        block, _ = item
        self.unread -= 1
        self.got.add(block.index)
        k = self.where[block.index][0]
        self.left[k] -= 1
        if not self.left[k]:
            self.have.add(k)
        return True


def _bitmap(have: set[int], base: int) -> bytes:
    """The status record's window: bit ``k - base`` for each round ``k`` of ``have`` within it."""
    bits = sum(1 << (k - base) for k in have if k - base < 8 * _WINDOW)
    return bits.to_bytes(_WINDOW, "little")


def _first(shared: bytes, base: int) -> int | None:
    """The lowest round every rank has, from the bitmap they share; ``None`` if none."""
    bits = int.from_bytes(shared, "little")
    return base + (bits & -bits).bit_length() - 1 if bits else None


def _round_buffer(rd: Round, exchange: GroupExchange, delivery: Delivery) -> torch.Tensor:
    """The round's whole buffer, gathered into (empty for an empty round)."""
    if not rd.nbytes:
        return torch.empty(0, dtype=torch.uint8, device=exchange.device)
    return delivery.allocate_round(exchange.world * rd.part)[0]


class _Parts:
    """This rank's part of each round, made when the part's first read is admitted.

    On the host the part lies in its place in the round's whole buffer: mapped memory that costs
    only the pages written, so a part read ahead costs its own bytes, the all-gather fills the
    rest of the round in place, and a split that stops keeps what it read where it is (no copy,
    no second first touch; bench/RESULTS.md, the split decision). Device memory is not touched
    lazily: there a part has a buffer of its own until its round is gathered."""

    def __init__(self, rounds: Sequence[Round], exchange: GroupExchange, delivery: Delivery) -> None:
        self._rounds, self._exchange, self._delivery = rounds, exchange, delivery
        self._in_place = exchange.device.type != "cuda"
        self.parts: dict[int, tuple[torch.Tensor, Any]] = {}
        self._whole: dict[int, tuple[torch.Tensor, Any]] = {}
        """By round, on the host: the round's buffer that this rank's part lies in."""

    def part(self, k: int) -> tuple[torch.Tensor, Any]:
        if k not in self.parts:
            rd, ex = self._rounds[k], self._exchange
            if self._in_place:
                self._whole[k] = buf, handle = self._delivery.allocate_round(ex.world * rd.part)
                lo = ex.rank * rd.part
                self.parts[k] = buf[lo : lo + rd.part], handle[lo : lo + rd.part]
            else:
                self.parts[k] = self._delivery.allocate_round(rd.part)
        return self.parts[k]

    def placed_in(self, k: int) -> bool:
        """Whether round ``k``'s buffer already holds this rank's part."""
        return k in self._whole

    def buffer(self, k: int) -> torch.Tensor:
        """Round ``k``'s whole buffer: the one its part lies in, else a new one."""
        if k in self._whole:
            return self._whole[k][0]
        return _round_buffer(self._rounds[k], self._exchange, self._delivery)

    def placed(self, rounds: Iterable[int]) -> dict[int, tuple[torch.Tensor, Any]]:
        """The round buffers of ``rounds`` that hold parts read so far."""
        return {k: self._whole[k] for k in sorted(rounds) if k in self._whole}

    def drop(self, k: int) -> None:
        self.parts.pop(k, None)
        self._whole.pop(k, None)

    def clear(self) -> None:
        self.parts.clear()
        self._whole.clear()


class _Checks:
    """A checked load's CRCs across the ranks (see the module docstring): which bytes of each
    round each rank checks, the CRCs this rank sends, and those it got from the others. With no
    ``checks`` (nothing checked, or only by hashes that do not combine), nothing is sent."""

    def __init__(
        self,
        checks: Mapping[int, Verifier],
        rounds: Sequence[Round],
        world: int,
        rank: int,
        hashes: Mapping[int, InOrder] | None = None,
        ahead: int = 0,
        borrow: bool = False,
    ) -> None:
        self.checks = checks
        self.rank = rank
        self.hashes = hashes or {}
        """Hashes in file order (by file index), of which this rank feeds those it is given
        (:attr:`hashing`) with the gathered rounds; the others get their verdicts."""
        given = _hashers({f: v.digest.size for f, v in self.hashes.items()}, world)
        self.hashing = {f: v for f, v in self.hashes.items() if given[f] == rank}
        self.borrow = borrow
        """The gathered rounds are the tensors ``load()`` returns (host memory, never reused):
        bytes that wait for those before them are kept as they are, not copied."""
        for v in self.hashing.values():
            # The blocks of rounds gathered ahead of one that waits for a late part wait for
            # it: at most what the ranks read ahead (``ahead``). Kept as they are, that costs no
            # memory, and the hash never gives up for it; copied (a stream, whose tensors are
            # the caller's), it costs at most ``memory_limit`` more before the file is left
            # unchecked (and the log says so).
            v.pending_max = max(v.pending_max, ahead)
        self.error: BaseException | None = None
        """A hash that did not match, raised before the next status exchange (:meth:`apply`)."""
        self._told: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._queued: list[Future[None]] = []
        self.owned = _owned(rounds, world, {f: v.head_end for f, v in checks.items()})
        cuts: dict[int, list[int]] = {f: [] for f in checks}
        for per in self.owned:
            for r, ranges in enumerate(per):
                for f, a, b in ranges:
                    if r != rank:
                        checks[f].reserve(a, b)
                    else:
                        cuts[f] += (a, b)
        for f, points in cuts.items():
            checks[f].cut(points)
        self.outbox: deque[tuple[int, int, int, int]] = deque()
        self.inbox: list[tuple[int, int, int, int]] = []
        self.anyone = False
        """Whether some rank checks a file (from the last status exchange): the ranks then
        exchange the last CRCs after the last round, every one of them, checking or not
        (whether a rank checks a file can differ: a store's checksum one rank's HEAD did not
        get, a node cache's entry on one node)."""

    def gathered(self, k: int) -> None:
        """Round ``k`` was gathered: the CRCs of this rank's part of it are to be sent."""
        for f, a, b in self.owned[k][self.rank]:
            self.outbox.extend((f, at, n, crc) for at, n, crc in self.checks[f].take_own(a, b))

    def hash(self, block: Block, data: torch.Tensor, *, wait: bool = False) -> None:
        """``data``, the bytes of ``block`` every rank has (gathered, or read by this rank after
        a stop): hashed where this rank hashes its file. A verdict reached is to be sent; a
        mismatch is kept for :meth:`apply` (this rank is between exchanges). The rounds of a
        ``load()`` (:attr:`borrow`: memory no one changes) are hashed by a thread of their own,
        beside the next gathers; a stream's (the caller's once handed over), and ``wait``,
        before this returns."""
        v = self.hashing.get(block.source)
        if v is None or self.error is not None or block.source in self._told:
            return
        host = data if data.device.type == "cpu" else data.cpu()
        if not self.borrow or wait:
            self._add(v, block, host)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightstream-hash")
        self._queued = [f for f in self._queued if not f.done()]
        self._queued.append(self._pool.submit(self._add, v, block, host))

    def _add(self, v: InOrder, block: Block, host: torch.Tensor) -> None:
        if self.error is not None or block.source in self._told:
            return
        try:
            v.add(host.numpy().data, block.start, borrowed=self.borrow)
        except FormatError as exc:
            self.error = exc
            return
        if v.checked_whole or v.gave_up:
            self._told.add(block.source)
            self.outbox.append((block.source | _VERDICT, int(v.checked_whole), 0, 0))

    def settle(self) -> None:
        """Wait for the blocks given to the hashing thread (their verdicts then wait to be sent)."""
        queued, self._queued = self._queued, []
        for f in queued:
            f.result()

    def close(self) -> None:
        """End the hashing thread (a load that failed or was closed leaves its queue)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def packet(self) -> tuple[bytes, bool, bool]:
        """What the next status record carries: as many CRCs as it holds, whether more wait,
        and whether this rank checks any file."""
        room = (_CRCS - 3) // _CRC.size
        out = b"".join(_CRC.pack(*self.outbox.popleft()) for _ in range(min(room, len(self.outbox))))
        return out, bool(self.outbox), bool(self.checks or self.hashing)

    def heard(self, exchange: GroupExchange) -> bool:
        """Keep the other ranks' CRCs of the last status exchange, and take their verdicts;
        whether any rank has more."""
        for r, (crcs, _, _) in enumerate(exchange.heard):
            if r == self.rank:
                continue
            for f, at, n, crc in crcs:
                if f & _VERDICT:
                    if f & ~_VERDICT in self.hashes:
                        self.hashes[f & ~_VERDICT].told(bool(at))
                else:
                    self.inbox.append((f, at, n, crc))
        self.anyone = any(checking for _, _, checking in exchange.heard)
        return any(more for _, more, _ in exchange.heard)

    def apply(self) -> None:
        """Check the pieces the CRCs heard complete (raises :class:`FormatError` on a mismatch,
        as for a hash this rank found wrong). Called before a status exchange, so that a rank
        whose check fails joins it as failed."""
        if self.error is not None:
            raise self.error
        inbox, self.inbox = self.inbox, []
        by_file: dict[int, list[tuple[int, int, int]]] = {}
        for f, at, n, crc in inbox:
            by_file.setdefault(f, []).append((at, n, crc))
        for f, fragments in by_file.items():
            if f in self.checks:  # (a file another rank checks and this one does not: left)
                self.checks[f].foreign(fragments)

    def stop(self, todo: Iterable[int]) -> None:
        """The ranks stopped exchanging: the bytes of the rounds not gathered are this rank's to
        check (it reads them all), and nothing more is sent."""
        self.settle()
        self.apply()
        for k in todo:
            for r, ranges in enumerate(self.owned[k]):
                if r != self.rank:
                    for f, a, b in ranges:
                        self.checks[f].release(a, b)
        self.outbox.clear()


def _hashers(sizes: Mapping[int, int], world: int) -> dict[int, int]:
    """The rank that hashes each file (by file index; ``sizes``: its bytes): the largest first,
    each to the rank with the fewest bytes so far. Every rank computes the same."""
    load = [0] * world
    out = {}
    for f in sorted(sizes, key=lambda f: (-sizes[f], f)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[f] = r
        load[r] += sizes[f]
    return out


def _owned(
    rounds: Sequence[Round], world: int, heads: Mapping[int, int]
) -> list[list[list[tuple[int, int, int]]]]:
    """By round, by rank: ``(file, start, end)`` of the bytes of the files in ``heads`` that
    rank checks: those of its part that no part before it (in round, then rank order) holds and
    that lie past the file's header (``heads``: where it ends; every rank has it)."""
    covered: dict[int, Ranges] = {}
    out = []
    for rd in rounds:
        per = []
        for r in range(world):
            ranges: list[tuple[int, int, int]] = []
            for i, start, end, _ in rd.extents(r):
                f = rd.blocks[i].source
                if f not in heads:
                    continue
                seen = covered.get(f)
                if seen is None:
                    seen = covered[f] = Ranges()
                    seen.add(0, heads[f])
                for a, b in seen.gaps(start, end):
                    if ranges and ranges[-1][0] == f and ranges[-1][2] == a:  # one run of the file
                        a = ranges.pop()[1]
                    ranges.append((f, a, b))
                seen.add(start, end)
            per.append(ranges)
        out.append(per)
    return out


def round_target(config: StreamConfig) -> int:
    """Bytes of a round: a third of ``memory_limit``, at most :data:`_ROUND_BYTES`."""
    return _round_bytes(settled(config.resolved().memory_limit))


def _round_bytes(memory_limit: int) -> int:
    return max(ALIGN, min(memory_limit // 3, _ROUND_BYTES) // ALIGN * ALIGN)


def rank_budget(config: StreamConfig, world: int) -> int:
    """The memory budget of this rank's reads (its ``run_plan``): what ``memory_limit`` leaves
    beside two round buffers (the one being gathered and the next), at least two rounds' parts.

    The parts read ahead are the bytes in flight from storage, and with a long round trip they set
    the rate (the bytes in flight over the latency): two rounds' parts, as this was before, are
    ``2 x 256 MiB / world`` a rank, 512 MiB across a node at any world size, at most 2.7 GB/s at
    188 ms (bench/sim_scale.py: the seed's 8 ranks took 16 x the link's time)."""
    target = round_target(config)
    parts = 2 * target // world
    return max(ALIGN, parts, (settled(config.resolved().memory_limit) - 2 * target) // ALIGN * ALIGN)


def run_distributed(
    job: Job, exchange: GroupExchange, *, delivery: Delivery
) -> Generator[tuple[Block, torch.Tensor], None, None]:
    """Yield ``(block, buffer)`` for every block of ``job.plan``, round by round, on every rank.

    This rank reads only its part of each round, through a sink ``delivery`` makes (closed
    here), into a buffer of its part that ``delivery`` allocates when the part's first read is
    admitted; the round's whole buffer is allocated when its part is in, and gathered into. So the
    parts read ahead cost only their own bytes (``rank_budget``), not a whole round each. Once
    :func:`split_pays` says no, the rest is read here (:func:`_read_rest`). Call after the open
    exchange.
    """
    plan, sources, config, counters, tuning = job.plan, job.sources, job.config, job.counters, job.tuning
    target = round_target(config)
    rounds = make_rounds(plan, exchange.world, target=target)
    mine, where, part_bytes = _my_parts(rounds, exchange.rank)
    parts = _Parts(rounds, exchange, delivery)

    def allocator(block: Block, uri: str) -> tuple[torch.Tensor, Any]:
        k, pos = where[block.index]
        tensor, handle = parts.part(k)
        return tensor[pos : pos + block.nbytes], handle[pos : pos + block.nbytes]

    left = Counter(k for k, _ in where)
    my_plan = ReadPlan(tuple(mine), plan.chunk_size, sum(b.nbytes for b in mine))
    inner_config = config.replace(memory_limit=rank_budget(config, exchange.world))
    # A rank's parts are held against its budget until their round is gathered, not only until
    # this loop takes them: a round that waits for another rank's part keeps its memory.
    budget = Budget(settled(inner_config.memory_limit), counters)
    # Before any read: the bytes other ranks check are left to them.
    checks = _Checks(
        job.checks,
        rounds,
        exchange.world,
        exchange.rank,
        job.hashes,
        ahead=(settled(inner_config.memory_limit) + target) * exchange.world
        if job.keep_all
        else job.memory_limit,
        borrow=job.keep_all,
    )
    sink = delivery.make_sink(allocator)
    reads = run_plan_polled(
        my_plan, sources, inner_config, counters=counters, tuning=tuning, sink=sink, budget=budget
    )
    if not rounds:  # nothing to read: the open exchange was the last
        exchange.pending = False
    measured = Measured()
    arrivals = _Arrivals(reads, where, left, len(rounds))
    todo = set(range(len(rounds)))
    """Rounds not gathered yet."""
    have = arrivals.have
    stale = False
    """The last status exchange found no round every rank has."""
    try:
        while todo:
            # Rounds are gathered in the order every rank has its part of them, not in plan
            # order: a round whose part is late on one rank (a read in a latency tail) holds
            # only itself, not every round after it (bench/sim_scale.py). Each rank tells what
            # it has after taking every part finished so far; after an exchange that found
            # nothing shared, it waits a moment for one more part before it asks again.
            checks.apply()  # before the status exchange: a mismatch fails this rank there
            arrivals.settle(stale)
            base = min(todo)
            # Everything that can fail on this rank alone happens before the status exchange
            # (here: the round's buffers), so that no rank fails between the status and the data
            # exchange, where the others could not hear of it. They are made for the first round
            # this rank has, which is the one agreed unless another rank lacks it.
            flat = parts.buffer(min(have))
            measured.read_bytes, measured.read_seconds = counters.rate_bytes, counters.rate_seconds
            shared, heard = exchange.check(
                window=(base, _bitmap(have, base)),
                measured=measured,
                crcs=checks.packet(),
            )
            # CRCs still to send keep the ranks exchanging (no collective follows a stop).
            more = checks.heard(exchange)
            if split_pays(heard, exchange.world) is False and not more:
                # Every rank heard the same records, so every rank stops here: no collective
                # follows, and each reads the rest of every round not gathered.
                del flat
                exchange.pending = False
                exchange.stopped = len(rounds) - len(todo)
                read, gather = _rates(heard)
                log.info(
                    "rank %d of %d: the exchange (%.2f GB/s) is slower than reading everything "
                    "(%.2f GB/s a rank); reading the rest of the %d rounds left", exchange.rank,
                    exchange.world, gather / 1e9, read / 1e9, len(todo),
                )  # fmt: skip
                # The reads in flight are bytes this rank needs: they finish and are kept;
                # none starts after them (the rest is read by one plan, below).
                budget.close()
                while arrivals.take(None):
                    pass
                reads.close()
                checks.stop(todo)
                kept = _kept(rounds, todo, exchange.rank, mine, arrivals.got, where, parts.parts)
                placed = parts.placed(todo)
                parts.clear()  # the pieces kept hold their own part's memory, until copied
                for block, buf in _read_rest(
                    [rounds[k] for k in sorted(todo)],
                    rank=exchange.rank,
                    world=exchange.world,
                    kept=kept,
                    placed=placed,
                    job=job,
                    delivery=delivery,
                ):
                    checks.hash(block, buf, wait=True)
                    checks.apply()  # no exchange follows: a hash found wrong fails this rank now
                    yield block, buf
                return
            index = _first(shared, base)
            stale = index is None
            if index is None:
                del flat
                continue
            rd = rounds[index]
            todo.discard(index)
            have.discard(index)
            if not todo and not checks.anyone:
                # Nothing is exchanged after the last round's data: a rank that stops while
                # handing over these tensors must not wait for a status exchange no one joins.
                exchange.pending = False
            if flat.numel() != exchange.world * rd.part or not rd.nbytes or parts.placed_in(index):
                del flat
                flat = parts.buffer(index)
            # this rank's part of the agreed round (read into before; made now, empty of
            # meaning, only where this rank has no bytes in it)
            mine_part = parts.part(index)[0] if rd.nbytes else flat
            if rd.nbytes:
                started = time.monotonic()
                exchange.gather(flat, mine_part, f"the exchange of round {index} ({rd.nbytes} bytes)")
                measured.gather_seconds += time.monotonic() - started
                measured.gathered += rd.nbytes
                measured.gathers += 1
                lo, hi = exchange.rank * rd.part, min((exchange.rank + 1) * rd.part, rd.nbytes)
                exchange.received += rd.nbytes - max(0, hi - lo)
                if job.on_bytes is not None:
                    job.on_bytes(rd.nbytes)
            parts.drop(index)
            del mine_part
            budget.give(part_bytes[index])
            checks.gathered(index)
            for block, pos in zip(rd.blocks, rd.positions, strict=True):
                checks.hash(block, flat[pos : pos + block.nbytes])
            if not todo and checks.anyone:  # the last CRCs, before the last tensors go out (see above)
                _last_crcs(checks, exchange)
            for block, pos in zip(rd.blocks, rd.positions, strict=True):
                yield block, flat[pos : pos + block.nbytes]
            del flat
    finally:
        checks.close()
        reads.close()
        sink.close()
        parts.clear()
        handed.sweep()


def _last_crcs(checks: _Checks, exchange: GroupExchange) -> None:
    """After the last round: status exchanges until every rank has sent every CRC, then every
    piece checked (the same CRCs on every rank, so a mismatch fails them all here)."""
    checks.settle()  # the last verdicts, sent below
    more = True
    while more:
        checks.apply()
        exchange.check(crcs=checks.packet())
        more = checks.heard(exchange)
    exchange.pending = False
    checks.apply()


def _rates(measured: Sequence[Measured]) -> tuple[float, float]:
    """Bytes per second of the slowest rank's reads and of the exchange (from the fastest
    rank's time in the gathers): what :func:`split_pays` weighs."""
    read = min(m.read_bytes / m.read_seconds if m.read_seconds > 0 else math.inf for m in measured)
    fastest = min(m.gather_seconds for m in measured)
    return read, measured[0].gathered / fastest if fastest > 0 else math.inf


_Kept = dict[int, list[tuple[torch.Tensor, int, int]]]
"""By round: this rank's pieces already read, ``(bytes, position in the round)``."""


def _kept(
    rounds: Sequence[Round],
    todo: set[int],
    rank: int,
    mine: Sequence[Block],
    got: set[int],
    where: Sequence[tuple[int, int]],
    parts: dict[int, tuple[torch.Tensor, Any]],
) -> _Kept:
    """This rank's pieces of the rounds not gathered whose reads are done: kept, not read again."""
    kept: _Kept = {}
    for j in sorted(got):
        k, pos = where[j]
        if k in todo:
            n = mine[j].nbytes
            kept.setdefault(k, []).append((parts[k][0][pos : pos + n], rank * rounds[k].part + pos, n))
    return kept


def _rest_pieces(
    rounds: Sequence[Round], rank: int, world: int, kept: _Kept
) -> tuple[list[Block], list[tuple[int, int]], Counter[int]]:
    """What :func:`_read_rest` reads: every piece of ``rounds`` but those ``kept``, in round
    order; where each goes (index in ``rounds``, position in the round); the pieces per round."""
    pieces: list[Block] = []
    dest: list[tuple[int, int]] = []
    owed: Counter[int] = Counter()
    for n, rd in enumerate(rounds):
        here = {pos for _, pos, _ in kept.get(rd.index, ())}
        for r in range(world):
            for i, start, end, pos in rd.extents(r):
                if r == rank and pos in here:
                    continue
                pieces.append(Block(len(pieces), rd.blocks[i].source, start, end, ()))
                dest.append((n, pos))
                owed[n] += 1
    return pieces, dest, owed


def _read_rest(
    rounds: Sequence[Round],
    *,
    rank: int,
    world: int,
    kept: _Kept,
    placed: dict[int, tuple[torch.Tensor, Any]],
    job: Job,
    delivery: Delivery,
) -> Generator[tuple[Block, torch.Tensor], None, None]:
    """Every block of ``rounds``, read by this rank alone: the pieces it has (``kept``) are
    copied into the round's buffer, unless that buffer is the one they were read into
    (``placed``, by round index: host loads), and every other piece of the round is read into it.

    Memory: the pieces kept and the pieces read are held to ``memory_limit`` until their round
    is handed over; the pieces are read in round order, so at most one round's buffer (the one
    whose reads are being admitted) holds more than that. ``keep_all`` (the caller keeps every
    tensor, whose memory the round buffers are): every piece is admitted at once, as a plain
    ``load()`` reads (see ``run_plan``)."""
    config, counters, on_bytes, keep_all = job.config, job.counters, job.on_bytes, job.keep_all
    pieces, dest, owed = _rest_pieces(rounds, rank, world, kept)
    budget = Budget(job.memory_limit, counters, keep_all=keep_all)
    budget.take(sum(size for piece in kept.values() for _, _, size in piece))
    buffers: dict[int, tuple[torch.Tensor, Any]] = {}
    admitted: Counter[int] = Counter()  # bytes of each round's pieces admitted (held)

    def flat(n: int) -> tuple[torch.Tensor, Any]:
        if n not in buffers:
            index = rounds[n].index
            if index in placed:
                buffers[n] = placed.pop(index)
            else:
                buffers[n] = delivery.allocate_round(max(ALIGN, align_up(rounds[n].nbytes)))
        return buffers[n]

    def allocator(block: Block, uri: str) -> tuple[torch.Tensor, Any]:
        n, pos = dest[block.index]
        tensor, handle = flat(n)
        admitted[n] += block.nbytes
        return tensor[pos : pos + block.nbytes], handle[pos : pos + block.nbytes]

    def done(n: int) -> Iterator[tuple[Block, torch.Tensor]]:
        rd = rounds[n]
        buf = flat(n)[0]
        back = admitted.pop(n, 0)
        for piece, pos, size in kept.pop(rd.index, ()):
            place = buf[pos : pos + size]
            if piece.data_ptr() != place.data_ptr():
                place.copy_(piece)
            back += size
        budget.give(back)
        if on_bytes is not None:
            on_bytes(rd.nbytes)
        for block, pos in zip(rd.blocks, rd.positions, strict=True):
            yield block, buf[pos : pos + block.nbytes]
        del buffers[n], buf

    for n in range(len(rounds)):
        if not owed[n]:
            yield from done(n)
    rest = ReadPlan(tuple(pieces), config.read_size, sum(b.nbytes for b in pieces))
    sink = delivery.make_sink(allocator)
    try:
        for block, _ in run_plan(
            rest,
            job.sources,
            config,
            counters=counters,
            tuning=job.tuning,
            sink=sink,
            budget=budget,
            keep_all=keep_all,
        ):
            n = dest[block.index][0]
            owed[n] -= 1
            if not owed[n]:
                yield from done(n)
    finally:
        sink.close()
