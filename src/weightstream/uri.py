"""Where a checkpoint is: bare paths, ``file://`` URIs, folders, index files and lists of files."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from weightstream.errors import ConfigError, NotFoundError

__all__ = ["INDEX_NAME", "Layout", "UriLike", "resolve"]

INDEX_NAME = "model.safetensors.index.json"
UriLike = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


@dataclass(frozen=True)
class Layout:
    """The files of a checkpoint, before any is opened."""

    uri: str
    """What the user named, as a string (for messages)."""
    files: tuple[str, ...]
    """Shard paths; for an index, the shards it names in first-seen order."""
    index: str | None = None
    """Path of the index file, if the checkpoint has one."""


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
            f"unsupported URI scheme {parsed.scheme!r}: this version reads local and network file "
            "systems (paths and file:// URIs)",
            uri=text,
        )
    return text


def resolve(uri: UriLike) -> Layout:
    """Find the checkpoint's files.

    * a ``.safetensors`` file: that file;
    * a ``*.safetensors.index.json`` file, or a folder holding ``model.safetensors.index.json``
      (or exactly one other ``*.safetensors.index.json``): the shards it names;
    * a folder without an index: its ``*.safetensors`` files, sorted by name;
    * a list of paths: those files, in that order.
    """
    if isinstance(uri, Sequence) and not isinstance(uri, str | bytes):
        paths = tuple(to_path(u) for u in uri)
        if not paths:
            raise ConfigError("an empty list of files was given")
        for p in paths:
            _require_file(p)
        return Layout(uri=", ".join(paths), files=paths)
    path = to_path(uri)
    text = os.fspath(uri)
    if os.path.isdir(path):
        folder = Path(path)
        index = folder / INDEX_NAME
        if not index.is_file():
            candidates = sorted(folder.glob("*.safetensors.index.json"))
            index = candidates[0] if len(candidates) == 1 else index
        if index.is_file():
            return Layout(uri=text, files=(), index=str(index))
        files = tuple(str(p) for p in sorted(folder.glob("*.safetensors")) if p.is_file())
        if not files:
            raise NotFoundError(f"folder holds neither {INDEX_NAME} nor any *.safetensors file", uri=text)
        return Layout(uri=text, files=files)
    if path.endswith(".index.json"):
        _require_file(path)
        return Layout(uri=text, files=(), index=path)
    _require_file(path)
    return Layout(uri=text, files=(path,))


def _require_file(path: str) -> None:
    if not os.path.exists(path):
        raise NotFoundError("no such file or folder", uri=path)
    if os.path.isdir(path):
        raise NotFoundError("expected a file, found a folder", uri=path)
