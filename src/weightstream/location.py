"""Where a file or object is: parsed once, at the edge, into a frozen typed value.

Every layer below the API takes a :data:`Location`, never a URI string: it is parsed here once
(:func:`parse_location`), shards of an index are derived from the index's location
(:meth:`LocalPath.sibling`, :meth:`ObjectLocation.sibling`), and the backend that reads it is
chosen by its scheme (:mod:`weightstream.sources.registry`, which also tells this module which
schemes exist: :func:`register_scheme`). Pure: no I/O, no imports beyond the errors.
"""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse
from dataclasses import dataclass
from typing import ClassVar

from weightstream.errors import ConfigError

__all__ = [
    "LocalPath",
    "Location",
    "ObjectLocation",
    "object_location",
    "parse_location",
    "register_scheme",
    "schemes",
    "shown",
]

_SCHEMES: dict[str, None] = {}
"""The schemes of stores read as ``scheme://container/key`` (``s3``, ``gs``, ...), in the order
they were registered: filled by :func:`weightstream.sources.registry.register_backend`."""


def register_scheme(scheme: str) -> None:
    """Parse ``scheme://container/key`` as an :class:`ObjectLocation` from now on."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]+", scheme) or scheme == "file":
        raise ConfigError(f"{scheme!r} cannot name a store (lower-case letters, digits, '+', '.', '-')")
    _SCHEMES[scheme] = None


def schemes() -> tuple[str, ...]:
    """Every scheme a URI may have: ``file`` and the registered stores'."""
    return ("file", *_SCHEMES)


@dataclass(frozen=True)
class LocalPath:
    """A path on a local or network file system (ext4, xfs, NFS, Lustre, FUSE, ...)."""

    path: str

    scheme: ClassVar[str] = "file"

    @property
    def uri(self) -> str:
        """How messages name it: the path itself."""
        return self.path

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def sibling(self, name: str) -> LocalPath:
        """The file ``name`` (relative) beside this one: an index's shard."""
        return LocalPath(os.path.join(os.path.dirname(self.path), name))

    def child(self, name: str) -> LocalPath:
        """The entry ``name`` of this folder."""
        return LocalPath(os.path.join(self.path, name))

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True)
class ObjectLocation:
    """An object (or a prefix) in a store: ``scheme://bucket/key`` (an object store's bucket, or
    whatever container the scheme's backend names so: an in-memory store's name)."""

    scheme: str
    bucket: str
    key: str
    """Object key, or a prefix without a trailing slash ('' for the bucket root)."""

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    def with_key(self, key: str) -> ObjectLocation:
        return ObjectLocation(self.scheme, self.bucket, key)

    @property
    def parent(self) -> ObjectLocation:
        """The prefix this object lies under."""
        return self.with_key(self.key.rpartition("/")[0])

    def sibling(self, name: str) -> ObjectLocation:
        """The object ``name`` (relative, normalised) beside this one: an index's shard."""
        return self.with_key(posixpath.normpath(posixpath.join(posixpath.dirname(self.key), name)))

    def __str__(self) -> str:
        return self.uri


Location = LocalPath | ObjectLocation


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET = re.compile(r"[A-Za-z0-9._@-]+")
"""Bucket (S3, GCS) and container (Azure; ``container@account...`` for ``abfs://``) names."""


def shown(text: str) -> str:
    """``text`` as messages show it: NUL bytes and undecodable bytes escaped, so a message can
    always be printed."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\0")


def parse_location(uri: str | os.PathLike[str]) -> Location:
    """A bare path, ``file://`` URI or store URI (``s3://``, ``gs://``, ``az://``, any scheme a
    backend was registered for) as a typed location, meaning exactly what it says:

    * an object key is the text after ``scheme://bucket/``, byte for byte, as the AWS CLI and
      boto3 take it: ``?``, ``#`` and ``%41`` are characters of the key (one trailing ``/``
      marks a prefix). A key the client cannot address literally (an empty segment, as in
      ``a//b`` or a leading ``/``; a ``.`` or ``..`` segment) is refused rather than read as
      another key;
    * a ``file://`` URI is percent-decoded, as RFC 8089 says (``%20`` is a space); one with a
      query or a fragment is refused (a literal ``?`` or ``#`` is written ``%3F``, ``%23``);
    * a bare path is the path, as the operating system takes it.

    A NUL byte, another scheme, or a ``file://`` URI with a remote host is refused (a
    :class:`ConfigError`)."""
    text = os.fspath(uri)
    if not isinstance(text, str):
        raise ConfigError(f"a path must be a str, got {type(text).__name__}", setting="uri")
    if "\0" in text:
        raise ConfigError("a path or URI cannot hold a NUL byte", uri=shown(text), setting="uri")
    m = _SCHEME.match(text)
    scheme = m.group(1).lower() if m else ""
    if m and scheme in _SCHEMES:
        bucket, _, key = text[m.end() :].partition("/")
        return _object(scheme, bucket, key, text)
    if m and scheme == "file":
        return _file(text)
    if m and len(scheme) > 1:  # keep Windows drive letters and plain paths
        raise ConfigError(
            f"unsupported URI scheme {scheme!r}: weightstream reads paths and "
            f"{', '.join(s + '://' for s in schemes())} URIs",
            uri=shown(text),
            setting="uri",
        )
    return LocalPath(text)


def _object(scheme: str, bucket: str, key: str, text: str) -> ObjectLocation:
    if not bucket:
        raise ConfigError("object-store URI has no bucket", uri=shown(text), setting="uri")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(
            f"{bucket!r} is not a bucket name (letters, digits, '.', '-', '_' only)",
            uri=shown(text),
            setting="uri",
        )
    if key.endswith("/"):
        key = key[:-1]  # a prefix
    if key:
        segments = key.split("/")
        if "" in segments:
            raise ConfigError(
                f"object key {key!r} has an empty segment (a leading '/' or '//'): the object-store "
                "client cannot address such a key as it is, and weightstream will not read another in "
                "its place",
                uri=shown(text),
                setting="uri",
            )
        odd = next((s for s in segments if s in (".", "..")), None)
        if odd is not None:
            raise ConfigError(
                f"object key {key!r} has a {odd!r} segment: the object-store client cannot address "
                "such a key as it is, and weightstream will not read another in its place",
                uri=shown(text),
                setting="uri",
            )
    return ObjectLocation(scheme, bucket, key)


def _file(text: str) -> LocalPath:
    parsed = urllib.parse.urlsplit(text)
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError(
            f"file:// URI with a remote host {parsed.netloc!r} is not supported",
            uri=shown(text),
            setting="uri",
        )
    if parsed.query or parsed.fragment or text.endswith(("?", "#")):
        raise ConfigError(
            "a file:// URI is percent-decoded (RFC 8089) and cannot hold a query or a fragment: write a "
            "'?' in a file name as %3F and a '#' as %23, or give the path itself",
            uri=shown(text),
            setting="uri",
        )
    path = urllib.parse.unquote(parsed.path, errors="surrogateescape")
    if "\0" in path:
        raise ConfigError("a path or URI cannot hold a NUL byte", uri=shown(text), setting="uri")
    if not path:
        raise ConfigError("file:// URI has no path", uri=shown(text), setting="uri")
    return LocalPath(path)


def object_location(uri: str | os.PathLike[str]) -> ObjectLocation | None:
    """The location an ``s3://`` / ``gs://`` / ``az://`` URI (a registered store's) names;
    ``None`` for anything else (a path, a ``file://`` URI, another scheme), for front ends that
    take both."""
    text = os.fspath(uri)
    m = _SCHEME.match(text) if isinstance(text, str) else None
    if m is None or m.group(1).lower() not in _SCHEMES:
        return None
    loc = parse_location(text)
    assert isinstance(loc, ObjectLocation)
    return loc
