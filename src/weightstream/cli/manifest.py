"""``weightstream manifest URI -o weightstream.manifest.json``: a checkpoint's checksums, which
loads check their bytes against (see :mod:`weightstream.format.manifest`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from weightstream.cli.common import (
    config_from_args,
    open_checkpoint,
    progress_bar,
    writable_output,
    write_output,
)
from weightstream.format.manifest import MANIFEST_NAME, PIECE_SIZE


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "manifest",
        parents=[settings],
        help="read a checkpoint once and write its checksums (CRC32C per 64 MiB piece), which "
        f"loads then check; put it beside the index as {MANIFEST_NAME}",
    )
    p.add_argument("uri")
    p.add_argument("-o", "--output", help="the file to write (default: standard output)")
    p.add_argument("--workers", type=int, default=8, help="pieces read at once (default 8)")
    p.set_defaults(func=cmd_manifest)


def cmd_manifest(args: argparse.Namespace) -> int:
    from weightstream.format.manifest import dump_manifest

    if args.output:
        writable_output(args.output, "--output")
    config = config_from_args(args).replace(verify="off", cache_dir=None)
    with open_checkpoint(args.uri, config=config) as ckpt:
        from weightstream.tools.manifest import digests  # torch, once there is a checkpoint to read

        bar = progress_bar(sum(s.size for s in ckpt.shards), "checksums")
        try:
            found = digests(ckpt, workers=max(1, args.workers), on_bytes=bar.update)
        finally:
            bar.close()
    text = dump_manifest(found, piece_size=PIECE_SIZE) + "\n"
    if args.output:
        write_output(args.output, text)
        print(f"{len(found)} files, {sum(d.size for d in found)} bytes: {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
