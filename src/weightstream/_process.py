"""What a process inherits across ``fork()``, in one place (internal; standard library only).

A forked child has one thread: the caller of ``fork``. State tied to other threads of the
parent (an event loop marked running with no thread behind it, a lock another thread held, a
client runtime whose workers are gone) and state tied to the parent process (torch.distributed
groups, whose connections are the parent's) must not be used as it is. Rooms holding such state
register a reset here (:func:`at_fork`), and ask :func:`inherited_group` before using a process
group. Imported with the package, so a fork after ``import weightstream`` is always seen.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["at_fork", "forked", "inherited_group"]

_resets: list[Callable[[], None]] = []
_inherited: list[Any] = []
"""Process groups that existed when this process was forked (kept alive: they are the parent's)."""
_forked = False


def at_fork(reset: Callable[[], None]) -> None:
    """Call ``reset()`` in every child forked from now on, before it runs anything else."""
    _resets.append(reset)


def forked() -> bool:
    """Whether this process was forked from one that had imported weightstream."""
    return _forked


def inherited_group(group: Any) -> bool:
    """Whether ``group`` (a torch.distributed process group) was made before this process was
    forked: it is the parent's, and a collective on it would hang or mix with the parent's."""
    return any(g is group for g in _inherited)


def _groups() -> list[Any]:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return []
        world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
        groups = list(getattr(world, "pg_map", {}) or {})
        return groups or [dist.group.WORLD]
    except Exception:  # pragma: no cover - a torch whose internals moved: the default group only
        return [dist.group.WORLD] if dist is not None else []


def _in_child() -> None:
    global _forked
    _forked = True
    _inherited.extend(_groups())
    for reset in _resets:
        reset()


os.register_at_fork(after_in_child=_in_child)
