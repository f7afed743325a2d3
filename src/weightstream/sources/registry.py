"""One backend per kind of location, chosen by the location's type: the only place that knows
which backends exist.

A backend answers what the layers above need of a storage system: whether it is remote (and so
which defaults a load from it runs with), how to list a folder or prefix, whether a named file
exists, how to read a small file whole (an index), and how to open a :class:`Source` for a
file or object. Adding a backend means a location type in :mod:`weightstream.location`, a
module implementing :class:`Backend`, and one line in ``_BACKENDS`` here; nothing above the
sources changes. Remote backends are imported when first used, so a user of local files never
imports an object-store client; the file backend (standard library only) is imported with the
registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol

import weightstream.sources.file  # noqa: F401  (the default backend, imported with the registry)
from weightstream.location import LocalPath, Location, ObjectLocation

if TYPE_CHECKING:
    from weightstream.config import StreamConfig
    from weightstream.sources.base import Source

__all__ = ["Backend", "backend_for"]


class Backend(Protocol):
    """What every storage backend provides (see the module docstring)."""

    remote: bool
    """Reads cross a network with a round trip per request (object stores): loads then run with
    :meth:`defaults`, headers are read in parallel from the start, and request statistics and
    the flow meter are kept."""

    def defaults(self, config: StreamConfig) -> StreamConfig:
        """The settings a load from this backend runs with (its own depth and chunk size)."""
        ...

    def settings(self, config: StreamConfig) -> Hashable:
        """The part of ``config`` its open sources depend on: a source opened under other
        settings is opened again for a load that asks for these."""
        ...

    def is_folder(self, location: Any, config: StreamConfig) -> bool:
        """Whether the location names a folder (or prefix) rather than one file."""
        ...

    def list(self, location: Any, config: StreamConfig) -> dict[Any, int | None]:
        """The entries directly under a folder or prefix, with their sizes where the listing
        gives them (``None`` where it does not). Sorted by name."""
        ...

    def check(
        self, location: Any, config: StreamConfig, listed: dict[Any, int | None] | None, *, what: str = ...
    ) -> None:
        """Raise a :class:`~weightstream.errors.WeightStreamError` naming the location and
        cause if it is not a readable file (``listed``: a listing of its folder, if made;
        ``what`` starts the message)."""
        ...

    def read_all(self, location: Any, config: StreamConfig, *, size: int | None, limit: int) -> bytes:
        """A small file whole (an index), refused above ``limit`` bytes."""
        ...

    def open(
        self, location: Any, config: StreamConfig, *, size: int | None = None, version: str | None = None
    ) -> Source:
        """A source for one file or object. ``size`` and ``version`` as a listing gave them
        (saves a request); the source may serve both the header and the tensor reads."""
        ...


_BACKENDS: dict[type, str] = {
    LocalPath: "weightstream.sources.file",
    ObjectLocation: "weightstream.sources.object_store",
}
"""Location type -> the module whose ``BACKEND`` reads it."""


def backend_for(location: Location) -> Backend:
    """The backend that reads ``location``."""
    backend: Backend = importlib.import_module(_BACKENDS[type(location)]).BACKEND
    return backend
