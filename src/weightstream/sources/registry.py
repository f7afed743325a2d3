"""Which backend reads which scheme: the only place that knows which backends exist.

A backend answers what the layers above need of a storage system: whether it is remote (and so
which settings a load from it runs with), how to list a folder or prefix, whether a named file
exists, how to read a small file whole (an index), and how to open a :class:`Source` for a
file or object. The registry maps a location's scheme (``file`` for paths, ``s3``, ``gs``,
``memory``, ...) to its backend; the backend is then kept on the shard it opened
(:class:`weightstream.shard.Shard`), so nothing above asks again.

A new store is one module implementing :class:`Backend` and one call of
:func:`register_backend` (or one line in ``_BUILT_IN``): its URIs parse as
:class:`~weightstream.location.ObjectLocation` (``scheme://container/key``) and every layer
above the sources works unchanged (the in-memory store, :mod:`weightstream.sources.memory`, is
such a module). Built-in backends are imported when first used, so a user of local files never
imports an object-store client.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from weightstream.errors import ConfigError
from weightstream.location import Location, register_scheme

if TYPE_CHECKING:
    from weightstream.config import StreamConfig
    from weightstream.sources.base import Source

__all__ = ["Backend", "backend_for", "register_backend"]

L = TypeVar("L", bound=Location)


class Backend(Protocol[L]):
    """What every storage backend provides for its location type ``L`` (see the module
    docstring)."""

    remote: bool
    """Reads cross a network with a round trip per request (object stores): loads then run with
    the object store's settings (:meth:`StreamConfig.resolved`), headers are read in parallel
    from the start, and request statistics and the flow meter are kept."""

    def settings(self, config: StreamConfig) -> Hashable:
        """The part of ``config`` its open sources depend on: a source opened under other
        settings is opened again for a load that asks for these."""
        ...

    def network_fs(self, location: L) -> str | None:
        """The type of network file system ``location`` lies on (``"nfs4"``), or ``None``: a
        load there starts deeper (:meth:`StreamConfig.for_network_fs`)."""
        ...

    def is_folder(self, location: L, config: StreamConfig) -> bool:
        """Whether the location names a folder (or prefix) rather than one file."""
        ...

    def list(self, location: L, config: StreamConfig) -> dict[L, int | None]:
        """The entries directly under a folder or prefix, with their sizes where the listing
        gives them (``None`` where it does not). Sorted by name."""
        ...

    def check(
        self, location: L, config: StreamConfig, listed: dict[L, int | None] | None, *, what: str = ...
    ) -> None:
        """Raise a :class:`~weightstream.errors.WeightStreamError` naming the location and
        cause if it is not a readable file (``listed``: a listing of its folder, if made;
        ``what`` starts the message)."""
        ...

    def read_all(self, location: L, config: StreamConfig, *, size: int | None, limit: int) -> bytes:
        """A small file whole (an index), refused above ``limit`` bytes."""
        ...

    def open(
        self, location: L, config: StreamConfig, *, size: int | None = None, version: str | None = None
    ) -> Source:
        """A source for one file or object. ``size`` and ``version`` as a listing gave them
        (saves a request); the source may serve both the header and the tensor reads."""
        ...


_MEMBERS = (*Backend.__annotations__, *(n for n in vars(Backend) if not n.startswith("_")))
"""What a backend has: the protocol's attributes and methods (the ones a registration checks)."""

_BUILT_IN: dict[str, str] = {
    "file": "weightstream.sources.file",
    "s3": "weightstream.sources.object_store",
    "gs": "weightstream.sources.object_store",
    "az": "weightstream.sources.object_store",
    "abfs": "weightstream.sources.object_store",
    "abfss": "weightstream.sources.object_store",
    "memory": "weightstream.sources.memory",
}
"""Scheme -> the module whose ``BACKEND`` reads it (imported on first use)."""

_lock = threading.Lock()
_backends: dict[str, Backend[Any] | str] = {}


def register_backend(scheme: str, backend: Backend[Any] | str) -> None:
    """Read ``scheme://container/key`` URIs with ``backend`` (an object meeting
    :class:`Backend`, or the name of a module whose ``BACKEND`` does, imported when the first
    such URI is read). Registering a scheme again replaces its backend; ``file`` cannot be
    replaced."""
    if scheme == "file" and "file" in _backends:
        raise ConfigError("the file backend cannot be replaced")
    if not isinstance(backend, str):
        missing = [m for m in _MEMBERS if not hasattr(backend, m)]
        if missing:
            raise ConfigError(f"a backend for {scheme!r} must have {', '.join(missing)}")
    with _lock:
        if scheme != "file":
            register_scheme(scheme)
        _backends[scheme] = backend


def backend_for(location: Location) -> Backend[Any]:
    """The backend that reads ``location``."""
    entry = _backends[location.scheme]
    if isinstance(entry, str):
        loaded: Backend[Any] = importlib.import_module(entry).BACKEND
        with _lock:
            if _backends.get(location.scheme) == entry:
                _backends[location.scheme] = loaded
        return loaded
    return entry


for _scheme, _module in _BUILT_IN.items():
    register_backend(_scheme, _module)
