"""Listing a prefix, and downloading an object whole to a file (the Run:ai drop-in's
``pull_files``), through the same GET path as tensor reads."""

from __future__ import annotations

import contextlib
import os

from weightstream.config import StreamConfig
from weightstream.location import ObjectLocation
from weightstream.sources.object_store.client import make_store, metadata_call, obstore_module, track_request
from weightstream.sources.object_store.source import ObjectSource

__all__ = ["download", "list_objects"]


def list_objects(loc: ObjectLocation, config: StreamConfig, *, recursive: bool = False) -> dict[str, int]:
    """Keys under ``loc.key`` (a prefix) -> size: those directly under it, or every one below it
    with ``recursive``."""
    obstore = obstore_module()
    store = make_store(loc, config)
    prefix = loc.key + "/" if loc.key else ""

    async def run() -> dict[str, int]:
        if recursive:
            out: dict[str, int] = {}
            async for batch in obstore.list(store, prefix or None):
                out.update({o["path"]: int(o["size"]) for o in batch})
            return out
        found = await track_request(obstore.list_with_delimiter_async(store, prefix or None))
        return {o["path"]: int(o["size"]) for o in found["objects"]}

    return metadata_call(run, uri=loc.uri, what="cannot list", config=config)


_DOWNLOAD_PIECE = 64 << 20


def download(loc: ObjectLocation, target: str, config: StreamConfig, *, size: int | None = None) -> None:
    """One object to a local file, through the same GET path as tensor reads (retries, resumption,
    the low-speed rule, a version pinned for the whole object); written whole, then renamed into
    place, so a failed download never leaves a file that looks complete."""
    import mmap

    source = ObjectSource(loc, config, size=size)
    partial = f"{target}.part-{os.getpid()}"
    try:
        with open(partial, "w+b") as fh:
            fh.truncate(source.size)
            if source.size:
                with mmap.mmap(fh.fileno(), source.size) as view:
                    for offset in range(0, source.size, _DOWNLOAD_PIECE):
                        length = min(_DOWNLOAD_PIECE, source.size - offset)
                        source.read_into(memoryview(view)[offset : offset + length], offset=offset)
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
