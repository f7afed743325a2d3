"""Where a file or object is: parsed once, at the edge, into a frozen typed value.

Every layer below the API takes a :data:`Location`, never a URI string: it is parsed here once
(:func:`parse_location`), shards of an index are derived from the index's location
(:meth:`LocalPath.sibling`, :meth:`ObjectLocation.sibling`), and the backend that reads it is
chosen by its type (:mod:`weightstream.sources.registry`). Pure: no I/O, no imports beyond the
errors.
"""

from __future__ import annotations

import os
import posixpath
import urllib.parse
from dataclasses import dataclass

from weightstream.errors import ConfigError

__all__ = ["OBJECT_SCHEMES", "LocalPath", "Location", "ObjectLocation", "object_location", "parse_location"]

OBJECT_SCHEMES = ("s3", "gs", "az", "abfs", "abfss")


@dataclass(frozen=True)
class LocalPath:
    """A path on a local or network file system (ext4, xfs, NFS, Lustre, FUSE, ...)."""

    path: str

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
    """An object (or a prefix) in an object store: ``scheme://bucket/key``."""

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


def parse_location(uri: str | os.PathLike[str]) -> Location:
    """A bare path, ``file://`` URI or object-store URI (``s3://``, ``gs://``, ``az://``) as a
    typed location; another scheme, or a ``file://`` URI with a remote host, is refused."""
    text = os.fspath(uri)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme in OBJECT_SCHEMES:
        if not parsed.netloc:
            raise ConfigError("object-store URI has no bucket", uri=text)
        return ObjectLocation(parsed.scheme, parsed.netloc, urllib.parse.unquote(parsed.path).strip("/"))
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file:// URI with a remote host {parsed.netloc!r} is not supported", uri=text)
        return LocalPath(urllib.parse.unquote(parsed.path))
    if len(parsed.scheme) > 1 and "://" in text:  # keep Windows drive letters and plain paths
        raise ConfigError(
            f"unsupported URI scheme {parsed.scheme!r}: weightstream reads paths, file://, s3://, "
            "gs:// and az:// URIs",
            uri=text,
        )
    return LocalPath(text)


def object_location(uri: str | os.PathLike[str]) -> ObjectLocation | None:
    """The object location an ``s3://`` / ``gs://`` / ``az://`` URI names; ``None`` for anything
    else (a path, a ``file://`` URI, another scheme), for front ends that take both."""
    text = os.fspath(uri)
    if urllib.parse.urlparse(text).scheme not in OBJECT_SCHEMES:
        return None
    loc = parse_location(text)
    assert isinstance(loc, ObjectLocation)
    return loc
