"""S3 and S3-compatible stores, GCS and Azure, through obstore (Rust object_store), by job:

* ``client``: the store per bucket and settings (credentials from the standard chain; the cache
  key holds a digest, never a secret), the event loop, bounded and retried metadata requests;
* ``failures``: one classifier, an enum of failure kinds, and the error each becomes;
* ``policy``: ``RetryPolicy``, ``LowSpeedRule``, ``HedgePolicy``, value objects from the settings;
* ``listing``: a prefix's objects, and whole-object downloads;
* ``source``: :class:`ObjectSource`, one object read with ranged GETs;
* ``backend``: what the registry asks of this backend.

The flow meter the tuner reads is :class:`weightstream.sources.flow.RequestStats`.
"""

from __future__ import annotations

from weightstream.location import ObjectLocation, object_location
from weightstream.sources.flow import RequestStats
from weightstream.sources.object_store.backend import BACKEND, ObjectBackend
from weightstream.sources.object_store.client import make_store
from weightstream.sources.object_store.listing import download, list_objects
from weightstream.sources.object_store.source import ObjectSource

__all__ = [
    "BACKEND",
    "ObjectBackend",
    "ObjectLocation",
    "ObjectSource",
    "RequestStats",
    "download",
    "list_objects",
    "make_store",
    "parse_object_uri",
]

parse_object_uri = object_location
"""``s3://bucket/key`` -> location; ``None`` for anything that is not an object-store URI."""
