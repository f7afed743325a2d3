"""While a load's coordinator runs, the garbage collector leaves out the objects made before.

Why: a full collection walks every object the collector tracks, with the GIL held. A process
that has imported torch holds about 170,000 of them (a serving framework, many more), and a
pass over them took 60-70 ms here. A load's requests make objects that live as long as a
request (tasks, timers, transfers, views), long enough to be promoted toward the oldest
generation, and it is those promotions that trigger full passes: one in every 2 GB loaded from
an object store on this machine, a stop of the whole process's Python each time. At 50 GB/s
that is several a second; it was the largest single holder of the GIL in a load (py-spy
``--gil``: bench/RESULTS.md, "the GIL held").

How: :func:`gc.freeze` moves every tracked object into the permanent generation, which no pass
visits, when a coordinator resumes; :func:`gc.unfreeze` puts them back in the oldest generation
when the last coordinator running returns (to its caller with a block, or at the end). Both are
a list splice, O(1). Objects made during the load are collected as usual, so a cycle of ours
is still freed; a cycle made before the load is freed after it.

Left alone where the application manages the collector itself: once it is seen to have frozen
objects of its own (a server that freezes before ``fork()``), nothing is frozen again in this
process, and nothing while the collector is disabled. (An application thread that calls
:func:`gc.freeze` while a coordinator runs has it undone when the coordinator returns: the
API cannot tell whose objects the permanent generation holds without walking it, which costs
10 ms a call in a torch process and would be paid at every block.)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["frozen_heap"]

_lock = threading.Lock()
_loads = 0
"""Coordinators running in this process (threads may run several loads)."""
_ours = False
"""The objects in the permanent generation were put there by us."""
_applications = False
"""The application was seen to freeze objects of its own: never freeze again."""


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside: the collector leaves out what existed when the first of the running loads began."""
    global _loads, _ours, _applications
    with _lock:
        if _loads == 0 and not _applications and gc.isenabled():
            # (counts by walking the permanent generation: at once while it is empty, as it is
            # whenever nobody but us freezes, since we unfreeze before anyone can see it)
            if gc.get_freeze_count():
                _applications = True
            else:
                gc.freeze()
                _ours = True
        _loads += 1
    try:
        yield
    finally:
        with _lock:
            _loads -= 1
            if _loads == 0 and _ours:
                gc.unfreeze()
                _ours = False
