"""``weightstream bench``: the storage's raw bandwidth at a few depths, then a load, compared."""

from __future__ import annotations

import argparse
import json
from typing import Any

from weightstream.cli.common import (
    checked_limits,
    config_from_args,
    human,
    ints,
    open_checkpoint,
    progress_bar,
    run_limits,
)
from weightstream.config import parse_size
from weightstream.errors import ConfigError


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    """Add the ``bench`` command to the parser's subcommands."""
    bench = sub.add_parser("bench", help="probe the storage's raw bandwidth, then load, and compare")
    bench.add_argument("uri")
    bench.add_argument("--depths", default="1,4,16,64", help="raw-read depths to probe (default 1,4,16,64)")
    bench.add_argument("--block", default="16MiB", help="raw read size (default 16MiB)")
    run_limits(bench, "4GiB", 60.0)
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from weightstream.tools.probe import probe

    config = config_from_args(args)
    max_bytes, max_seconds = checked_limits(args)
    depths = ints(args.depths, "--depths")
    block = parse_size(args.block, name="--block")
    if block < 4096:
        raise ConfigError(f"--block must be at least 4 KiB, got {args.block!r}", setting="block")
    with open_checkpoint(args.uri, config=config) as ckpt:
        bar = (
            None
            if args.json or args.no_progress
            else progress_bar(min(max_bytes, ckpt.total_bytes * len(depths)), "probe")
        )
        points = probe(
            ckpt,
            config=config,
            depths=depths,
            block=block,
            max_bytes=max_bytes,
            max_seconds=max_seconds,
            on_bytes=bar.update if bar else None,
        )
        if bar:
            bar.close()
        raw = max(points, key=lambda p: p.gb_per_s)
        names = None
        if ckpt.total_bytes > max_bytes:
            from weightstream.tools.probe import select_bytes

            names = select_bytes(ckpt, max_bytes)
        stream = ckpt.stream(tensors=names, config=config)
        bar = None if args.json or args.no_progress else progress_bar(stream.bytes_to_read, "load")
        stream.on_bytes = bar.update if bar else None
        with stream:
            for _name, tensor in stream:
                del tensor
        if bar:
            bar.close()
        s = stream.stats
        out = {
            "uri": args.uri,
            "probe": [p.as_dict() for p in points],
            "raw_gb_per_s": round(raw.gb_per_s, 4),
            "raw_depth": raw.depth,
            "load": s.as_dict(),
            "efficiency": round(s.gb_per_s / raw.gb_per_s, 4) if raw.gb_per_s else None,
        }
        if args.json:
            print(json.dumps(out, indent=2))
            return 0
        print(f"storage    {args.uri}")
        for p in points:
            print(
                f"  raw      depth {p.depth:>4} x {human(p.block)}: {p.gb_per_s:7.3f} GB/s ({human(p.bytes)} in {p.seconds:.2f} s)"
            )
        print(f"raw        {raw.gb_per_s:.3f} GB/s (best, depth {raw.depth})")
        print(
            f"load       {s.gb_per_s:.3f} GB/s ({s.tensors} tensors, {human(s.bytes)} in {s.seconds:.2f} s)"
        )
        print(f"efficiency {out['efficiency']:.2f} x raw" if out["efficiency"] else "efficiency n/a")
        cached = s.cached_bytes / s.bytes_read if s.bytes_read else 0.0
        if raw.how == "buffered":
            print("note       this file system refuses O_DIRECT: the raw reads went through the page cache")
        elif cached > 0.5:
            print(
                f"note       {cached:.0%} of the load came from the page cache; the raw reads bypassed it (O_DIRECT)"
            )
        print(
            "           (raw reads reuse one buffer per thread; a load also pays for the memory its tensors fill)"
        )
        return 0
