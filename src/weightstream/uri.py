"""Where a checkpoint is: the files of a bare path, ``file://`` or object-store URI, folder,
index file or list of files, found once by the same rules on every backend."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightstream.errors import ConfigError, FormatError, NotFoundError
from weightstream.location import LocalPath, Location, ObjectLocation, parse_location, schemes
from weightstream.sources.registry import backend_for

if TYPE_CHECKING:
    from weightstream.config import StreamConfig

__all__ = ["INDEX_NAME", "Layout", "UriLike", "check_uri", "resolve"]

INDEX_NAME = "model.safetensors.index.json"
UriLike = str | os.PathLike[str] | Location | Sequence[str | os.PathLike[str] | Location]
"""What a load names: a path or URI, or a location parsed already (``LocalPath``,
``ObjectLocation``: taken as it is, not parsed again), or a list of them."""


@dataclass(frozen=True)
class Layout:
    """The files of a checkpoint, before any is opened."""

    uri: str
    """What the user named, as a string (for messages)."""
    files: tuple[Location, ...]
    """The shards (empty when ``index`` names them)."""
    index: Location | None = None
    """The index file, if the checkpoint has one."""
    listed: dict[Location, int | None] | None = field(default=None, compare=False)
    """The listing of the checkpoint's folder or prefix, where one was made: entries with their
    sizes where the listing gives them (object stores)."""

    def size(self, location: Location) -> int | None:
        """The size a listing gave for ``location`` (``None``: not known without opening it)."""
        return None if self.listed is None else self.listed.get(location)

    def covering(self, locations: Sequence[Location], config: StreamConfig) -> Layout:
        """This layout with a listing of every folder or prefix ``locations`` lie in that was
        not listed yet (an index naming shards in a sub-prefix, ``sub/model-1.safetensors``):
        one listing per prefix, never a request per shard. Local folders need none."""
        if self.listed is None or self.index is None:
            return self
        backend = backend_for(self.index)
        if not backend.remote:
            return self
        known = {loc.parent for loc in self.listed if isinstance(loc, ObjectLocation)}
        known.add(self.index.parent)  # type: ignore[union-attr]
        missing = sorted(
            {loc.parent for loc in locations if isinstance(loc, ObjectLocation)} - known, key=str
        )
        if not missing:
            return self
        listed = dict(self.listed)
        for prefix in missing:
            listed.update(backend.list(prefix, config))
        return Layout(uri=self.uri, files=self.files, index=self.index, listed=listed)

    def check_shard(self, location: Location, name: str, config: StreamConfig) -> None:
        """Raise, naming it, if the index's shard ``name`` is not a readable file or object."""
        backend_for(location).check(
            location,
            config,
            self.listed,
            what=f"index {self.index} names shard {name!r}, which cannot be opened",
        )


def check_uri(uri: object) -> None:
    """Refuse, at the edge, a ``uri`` of a type no layer below takes."""

    def one(u: object) -> bool:
        if isinstance(u, LocalPath | ObjectLocation):
            return True
        return isinstance(u, str) or (isinstance(u, os.PathLike) and isinstance(os.fspath(u), str))

    if one(uri):
        return
    if isinstance(uri, Sequence) and not isinstance(uri, str | bytes | bytearray):
        bad = [u for u in uri if not one(u)]
        if not bad:
            return
        got = f"a list holding {type(bad[0]).__name__} {bad[0]!r:.80}"
    else:
        got = f"{type(uri).__name__} {uri!r:.80}"
    raise ConfigError(
        "uri must be a path (str or os.PathLike: a .safetensors file, a folder, an index file), a "
        f"{', '.join(s + '://' for s in schemes())} URI, or a list of files or objects; got {got}",
        setting="uri",
    )


def resolve(uri: UriLike, config: StreamConfig | None = None) -> Layout:
    """Find the checkpoint's files; each location given is parsed once, here.

    * a ``.safetensors`` file: that file;
    * a ``*.safetensors.index.json`` file, or a folder holding ``model.safetensors.index.json``
      (or exactly one other ``*.safetensors.index.json``): the shards it names;
    * a folder without an index: its ``*.safetensors`` files, sorted by name;
    * a list of paths or object URIs: those files, in that order;
    * ``s3://`` / ``gs://`` / ``az://``: the same rules, on one listing of the prefix.
    """
    from weightstream.config import StreamConfig

    check_uri(uri)
    config = config if config is not None else StreamConfig.from_env()
    if isinstance(uri, Sequence) and not isinstance(uri, str | bytes):
        locations = tuple(_located(u) for u in uri)
        if not locations:
            raise ConfigError("an empty list of files was given")
        for loc in locations:
            backend = backend_for(loc)
            if not backend.remote:  # objects are checked when their headers are read
                backend.check(loc, config, None)
        return Layout(uri=", ".join(loc.uri for loc in locations), files=locations)
    loc = _located(uri)
    text = loc.uri if isinstance(uri, LocalPath | ObjectLocation) else os.fspath(uri)
    backend = backend_for(loc)
    if backend.is_folder(loc, config):
        return _resolve_folder(loc, text, config)
    listed = None
    if backend.remote:
        # One listing of the object's prefix: it proves the object exists and gives the sizes
        # of the index's shards (no HEAD per shard).
        listed = backend.list(loc.parent, config)  # type: ignore[union-attr]
    backend.check(loc, config, listed)
    if loc.name.endswith(".index.json"):
        return Layout(uri=text, files=(), index=loc, listed=listed)
    return Layout(uri=text, files=(loc,), listed=listed)


def _located(uri: str | os.PathLike[str] | Location) -> Location:
    """``uri`` as a location: parsed (the one parse of a load), or as given when it is one."""
    return uri if isinstance(uri, LocalPath | ObjectLocation) else parse_location(uri)


def _resolve_folder(folder: Location, text: str, config: StreamConfig) -> Layout:
    """A folder or prefix: its index, or else every ``*.safetensors`` entry in it. Every local
    entry that looks like part of the checkpoint is part of it: one that cannot be read as a
    regular file (a dangling link in a half-downloaded cache, a link loop, no permission, a
    directory) fails the load, naming it and why, instead of being left out of it."""
    backend = backend_for(folder)
    listed = backend.list(folder, config)
    by_name = {loc.name: loc for loc in listed}
    index = by_name.get(INDEX_NAME)
    if index is None:
        candidates = sorted(n for n in by_name if n.endswith(".safetensors.index.json"))
        if len(candidates) > 1:
            raise FormatError(
                f"{_kind(backend.remote)} holds {len(candidates)} index files ({', '.join(candidates)}) and no "
                f"{INDEX_NAME}: name the one to load",
                uri=text,
            )
        index = by_name[candidates[0]] if len(candidates) == 1 else None
    if index is not None:
        backend.check(index, config, listed)
        return Layout(uri=text, files=(), index=index, listed=listed)
    files = tuple(loc for n, loc in sorted(by_name.items()) if n.endswith(".safetensors"))
    if not files:
        entry = "object" if backend.remote else "file"
        raise NotFoundError(
            f"{_kind(backend.remote)} holds neither {INDEX_NAME} nor any *.safetensors {entry}", uri=text
        )
    for f in files:
        backend.check(f, config, listed)
    return Layout(uri=text, files=files, listed=listed)


def _kind(remote: bool) -> str:
    return "prefix" if remote else "folder"
