"""``weightstream cache list|verify|prune``: the node cache's entries (``--cache-dir`` or
``WEIGHTSTREAM_CACHE_DIR``), whether they are still the store's bytes, and removing stale ones.
See :mod:`weightstream.cache`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

from weightstream.cli.common import config_from_args, human, open_checkpoint
from weightstream.config import StreamConfig
from weightstream.errors import ConfigError, NotFoundError, WeightStreamError


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    p = sub.add_parser("cache", help="list, check or prune this node's cache of remote checkpoints")
    verbs = p.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("list", parents=[settings], help="entries: URI, version, size, last use")
    ls.add_argument("--json", action="store_true", help="print the entries as JSON")
    ls.set_defaults(func=cmd_list)
    ver = verbs.add_parser(
        "verify",
        parents=[settings],
        help="check each whole entry: its size and header, and (one request each) that the store "
        "still holds its version; exit 1 if any is stale or damaged",
    )
    ver.add_argument("--offline", action="store_true", help="check the files only, ask the store nothing")
    ver.set_defaults(func=cmd_verify)
    pr = verbs.add_parser(
        "prune",
        parents=[settings],
        help="remove entries not in use: unfinished parts, entries the store no longer holds, and "
        "the least recently used beyond --max-bytes",
    )
    pr.add_argument("--max-bytes", help="keep at most this much (e.g. 500GB), least recently used out first")
    pr.add_argument("--unused-for", type=float, help="also remove entries not used for this many seconds")
    pr.add_argument("--offline", action="store_true", help="do not ask the store which entries are stale")
    pr.add_argument("--all", action="store_true", help="remove every entry not in use")
    pr.set_defaults(func=cmd_prune)


def _cache(args: argparse.Namespace) -> tuple[Any, StreamConfig]:
    from weightstream.cache import Cache

    config = config_from_args(args)
    if config.cache_dir is None:
        raise ConfigError(
            "no cache folder: give --cache-dir or set WEIGHTSTREAM_CACHE_DIR", setting="cache_dir"
        )
    return Cache(config.cache_dir, config.cache_max_bytes), config


def cmd_list(args: argparse.Namespace) -> int:
    cache, _ = _cache(args)
    entries = cache.entries()
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=2))
        return 0
    now = time.time()
    for e in entries:
        state = "whole" if e.whole else "part"
        use = " in use" if e.in_use else ""
        print(
            f"{e.uri or '?'}  {state}{use}  {human(e.size)}B  version {e.version or '?'}  "
            f"used {_ago(now - e.last_use)} ago  {e.path}"
        )
    print(f"{len(entries)} entries, {human(sum(e.size for e in entries))}B in {cache.root}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    cache, config = _cache(args)
    bad = 0
    for e in cache.entries():
        if not e.whole:
            continue
        problem = _check(e, config, offline=args.offline)
        print(f"{e.uri}: {problem or 'ok'}")
        bad += bool(problem)
    return 1 if bad else 0


def cmd_prune(args: argparse.Namespace) -> int:
    from weightstream.config import parse_size

    cache, config = _cache(args)
    keep = None if args.max_bytes is None else parse_size(args.max_bytes, name="--max-bytes")
    now = time.time()
    entries = cache.entries()
    gone = []
    for e in entries:
        why = ""
        if args.all:
            why = "asked"
        elif not e.whole and now - e.last_use > 3600:
            why = "an unfinished part not written for an hour"
        elif args.unused_for is not None and now - e.last_use > args.unused_for:
            why = f"not used for {_ago(now - e.last_use)}"
        elif e.whole and not args.offline and (p := _check(e, config, offline=False)):
            why = p
        if why and cache.remove(e):
            gone.append(e)
            print(f"removed {e.uri or e.path}: {why}")
    if keep is not None:
        left = [e for e in entries if e not in gone]
        used = sum(e.size for e in left)
        for e in left:  # least recently used first
            if used <= keep:
                break
            if cache.remove(e):
                used -= e.size
                print(f"removed {e.uri or e.path}: beyond --max-bytes")
    return 0


def _check(entry: Any, config: StreamConfig, *, offline: bool) -> str:
    """What is wrong with a whole entry ("" where nothing is)."""
    from weightstream.format.safetensors import PREFIX_SIZE, parse_header, parse_prefix

    try:
        with open(entry.path, "rb") as f:
            head = f.read(PREFIX_SIZE)
            n = parse_prefix(
                head, uri=entry.path, file_size=entry.size, max_header_size=config.max_header_size
            )
            parse_header(f.read(n), uri=entry.path, file_size=entry.size)
        if entry.crc32c is not None:
            from weightstream.cache.store import file_crc32c

            fd = os.open(entry.path, os.O_RDONLY)
            try:
                crc = f"{file_crc32c(fd, entry.size):08x}"
            finally:
                os.close(fd)
            if crc != entry.crc32c:
                return f"damaged: its bytes give crc32c {crc}, {entry.crc32c} when it was made whole"
    except (OSError, WeightStreamError) as exc:
        return f"damaged: {exc}"
    if offline or entry.uri is None:
        return ""
    try:
        with open_checkpoint(entry.uri, config=config.replace(cache_dir=None)) as ck:
            now = ck.shards[0].version
    except NotFoundError:
        return "stale: the store no longer holds it"
    except WeightStreamError as exc:
        return f"not checked: {exc}"
    if now != entry.version:
        return f"stale: the store holds version {now}, the entry {entry.version}"
    return ""


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
