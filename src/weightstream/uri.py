"""Where a checkpoint is: bare paths, ``file://`` URIs, folders, index files and lists of files."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from weightstream.errors import ConfigError, FormatError, NotFoundError
from weightstream.sources.file import list_folder, regular_file

if TYPE_CHECKING:
    from weightstream.config import StreamConfig

__all__ = ["INDEX_NAME", "Layout", "UriLike", "check_uri", "resolve"]

INDEX_NAME = "model.safetensors.index.json"
UriLike = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class Layout:
    """The files of a checkpoint, before any is opened."""

    uri: str
    """What the user named, as a string (for messages)."""
    files: tuple[str, ...]
    """Shard paths or object URIs (empty when ``index`` names them)."""
    index: str | None = None
    """Path or URI of the index file, if the checkpoint has one."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Object sizes learnt from a listing (object stores only)."""
    listed: bool = False
    """True when ``sizes`` holds every object of the checkpoint's folder."""

    def exists(self, path: str) -> bool:
        """Whether a shard exists, from the listing for object stores. A local shard is checked
        as a regular file, and an error names what is wrong with it."""
        if self.listed:
            return path in self.sizes
        regular_file(path, what=f"index {self.index} names this shard, which cannot be opened")
        return True


def to_path(uri: str | os.PathLike[str]) -> str:
    """A local path from a bare path or a ``file://`` URI; other schemes are refused clearly."""
    text = os.fspath(uri)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file:// URI with a remote host {parsed.netloc!r} is not supported", uri=text)
        return urllib.parse.unquote(parsed.path)
    if len(parsed.scheme) > 1 and "://" in text:  # keep Windows drive letters and plain paths
        raise ConfigError(
            f"unsupported URI scheme {parsed.scheme!r}: weightstream reads paths, file://, s3://, "
            "gs:// and az:// URIs",
            uri=text,
        )
    return text


def check_uri(uri: object) -> None:
    """Refuse, at the edge, a ``uri`` of a type no layer below takes."""
    def one(u: object) -> bool:
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
        f"file://, s3://, gs:// or az:// URI, or a list of files or objects; got {got}",
        setting="uri",
    )


def resolve(uri: UriLike, config: StreamConfig | None = None) -> Layout:
    """Find the checkpoint's files.

    * a ``.safetensors`` file: that file;
    * a ``*.safetensors.index.json`` file, or a folder holding ``model.safetensors.index.json``
      (or exactly one other ``*.safetensors.index.json``): the shards it names;
    * a folder without an index: its ``*.safetensors`` files, sorted by name;
    * a list of paths or object URIs: those files, in that order;
    * ``s3://`` / ``gs://`` / ``az://``: the same rules, on the bucket's listing.
    """
    from weightstream.sources.object_store import parse_object_uri

    check_uri(uri)
    if isinstance(uri, str) and parse_object_uri(uri) is not None:
        return _resolve_object(uri, config)
    if isinstance(uri, Sequence) and not isinstance(uri, str | bytes):
        paths = []
        for u in uri:
            text = os.fspath(u)
            if parse_object_uri(text) is None:  # objects are checked when their headers are read
                text = to_path(text)
                _require_file(text)
            paths.append(text)
        if not paths:
            raise ConfigError("an empty list of files was given")
        return Layout(uri=", ".join(paths), files=tuple(paths))
    path = to_path(uri)
    text = os.fspath(uri)
    if os.path.isdir(path):
        return _resolve_folder(path, text)
    if path.endswith(".index.json"):
        _require_file(path)
        return Layout(uri=text, files=(), index=path)
    _require_file(path)
    return Layout(uri=text, files=(path,))


def _resolve_folder(path: str, text: str) -> Layout:
    """A folder: its index, or else every ``*.safetensors`` entry in it. Every entry that looks
    like part of the checkpoint is part of it: one that cannot be read as a regular file (a
    dangling link in a half-downloaded cache, a link loop, no permission, a directory) fails the
    load, naming it and why, instead of being left out of it."""
    names = list_folder(path)
    index = INDEX_NAME if INDEX_NAME in names else None
    if index is None:
        candidates = [n for n in names if n.endswith(".safetensors.index.json")]
        if len(candidates) > 1:
            raise FormatError(
                f"folder holds {len(candidates)} index files ({', '.join(candidates)}) and no "
                f"{INDEX_NAME}: name the one to load",
                uri=text,
            )
        index = candidates[0] if candidates else None
    if index is not None:
        found = os.path.join(path, index)
        _require_file(found)
        return Layout(uri=text, files=(), index=found)
    files = tuple(os.path.join(path, n) for n in names if n.endswith(".safetensors"))
    if not files:
        raise NotFoundError(f"folder holds neither {INDEX_NAME} nor any *.safetensors file", uri=text)
    for f in files:
        _require_file(f)
    return Layout(uri=text, files=files)


def _require_file(path: str) -> None:
    regular_file(path)


def _resolve_object(uri: str, config: StreamConfig | None) -> Layout:
    """The same rules as for folders, on an object store (one listing of the prefix)."""
    from weightstream.config import StreamConfig
    from weightstream.sources.object_store import list_objects, parse_object_uri

    config = config if config is not None else StreamConfig.from_env()
    loc = parse_object_uri(uri)
    assert loc is not None
    if loc.key.endswith((".safetensors", ".index.json")):
        parent = type(loc)(loc.scheme, loc.bucket, loc.key.rpartition("/")[0])
        sizes = {loc.uri(k): n for k, n in list_objects(parent, config).items()}
        if loc.uri() not in sizes:
            raise NotFoundError("no such object", uri=loc.uri())
        if loc.key.endswith(".index.json"):
            return Layout(uri=uri, files=(), index=loc.uri(), sizes=sizes, listed=True)
        return Layout(uri=uri, files=(loc.uri(),), sizes=sizes, listed=True)
    sizes = {loc.uri(k): n for k, n in list_objects(loc, config).items()}
    names = {k.rsplit("/", 1)[-1]: k for k in sizes}
    index = names.get(INDEX_NAME)
    if index is None:
        candidates = sorted(k for n, k in names.items() if n.endswith(".safetensors.index.json"))
        index = candidates[0] if len(candidates) == 1 else None
    if index is not None:
        return Layout(uri=uri, files=(), index=index, sizes=sizes, listed=True)
    files = tuple(sorted(k for n, k in names.items() if n.endswith(".safetensors")))
    if not files:
        raise NotFoundError(f"prefix holds neither {INDEX_NAME} nor any *.safetensors object", uri=loc.uri())
    return Layout(uri=uri, files=files, sizes=sizes, listed=True)
