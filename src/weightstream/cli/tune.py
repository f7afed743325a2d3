"""``weightstream tune``: sweep reads in flight x read size, write the best as a profile file and a heat map."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from weightstream.cli.common import (
    checked_limits,
    config_from_args,
    human,
    ints,
    open_checkpoint,
    progress_bar,
    refuse_inside,
    run_limits,
    sizes,
    writable_output,
    write_output,
)
from weightstream.config import profile_document, settled
from weightstream.errors import ConfigError


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    """Add the ``tune`` command to the parser's subcommands."""
    tune = sub.add_parser(
        "tune", help="sweep reads in flight x read size; write the best as a profile and a heat map"
    )
    tune.add_argument("uri")
    tune.add_argument(
        "--depths", help="reads in flight to try (default 2..64 for files, 16..256 for object stores)"
    )
    tune.add_argument(
        "--chunk-sizes", help="read sizes to try (default 4MiB,16MiB,64MiB; object stores 4..32MiB)"
    )
    tune.add_argument("-o", "--output", default="weightstream-profile.json", help="profile file to write")
    tune.add_argument(
        "--heatmap", default="weightstream-tune.png", help="PNG heat map to write ('' for none)"
    )
    tune.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before each point (root; cold-cache tuning)",
    )
    run_limits(tune, "1GiB", 300.0)
    tune.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    import datetime

    from weightstream.tools.heatmap import draw_heatmap

    if args.heatmap:
        try:
            import matplotlib  # noqa: F401  (checked now, not after a long sweep)
        except ImportError:
            raise ConfigError(
                "drawing the heat map needs matplotlib: pip install 'weightstream[tune]' (or --heatmap '')"
            ) from None
    config = config_from_args(args)
    # Every argument and output before any I/O: a sweep is minutes of work to lose at the end.
    writable_output(args.output, "--output")
    if args.heatmap:
        writable_output(args.heatmap, "--heatmap")
    max_bytes, max_seconds = checked_limits(args)
    if args.drop_caches and os.geteuid() != 0:
        raise ConfigError("--drop-caches needs root")
    given_depths = ints(args.depths, "--depths") if args.depths else None
    given_chunks = sizes(args.chunk_sizes, "--chunk-sizes") if args.chunk_sizes else None
    with open_checkpoint(args.uri, config=config) as ckpt:
        refuse_inside(args.output, ckpt)
        if args.heatmap:
            refuse_inside(args.heatmap, ckpt)
        remote = ckpt.remote
        depths = given_depths or ints("16,32,64,128,256" if remote else "2,4,8,16,32,64", "--depths")
        chunks = given_chunks or sizes(
            "4MiB,8MiB,16MiB,32MiB" if remote else "4MiB,16MiB,64MiB", "--chunk-sizes"
        )
        points = _sweep(args, ckpt, config, depths, chunks, max_bytes=max_bytes, max_seconds=max_seconds)
        memory_limit = settled(ckpt.defaults(config).memory_limit)
    good = [p for p in points if not p.error]
    if not good:
        raise ConfigError("no sweep point completed: " + "; ".join(p.error or "" for p in points[:3]))
    best = max(good, key=lambda p: p.gb_per_s)
    doc = profile_document(
        _settings(best, remote=remote, memory_limit=memory_limit),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        uri=args.uri,
        best_gb_per_s=round(best.gb_per_s, 4),
        cache="dropped before each point" if args.drop_caches else "as found",
    )
    doc["sweep"] = [p.as_dict() for p in points]
    write_output(args.output, json.dumps(doc, indent=2) + "\n")
    if args.heatmap:
        draw_heatmap(points, args.heatmap, title=f"{args.uri}: GB/s over {human(good[0].bytes)} per point")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    _print_table(points, depths, chunks)
    print(f"best       {best.depth} in flight x {human(best.chunk_size)}: {best.gb_per_s:.3f} GB/s")
    print(f"profile    {args.output} (use: --profile {args.output} or WEIGHTSTREAM_PROFILE={args.output})")
    if args.heatmap:
        print(f"heat map   {args.heatmap}")
    return 0


def _sweep(
    args: argparse.Namespace,
    ckpt: Any,
    config: Any,
    depths: list[int],
    chunks: list[int],
    *,
    max_bytes: int,
    max_seconds: float,
) -> list[Any]:
    """Every point of the sweep (a progress bar unless --json or --no-progress)."""
    from weightstream.tools.probe import sweep

    def drop() -> None:
        if args.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")

    progress = None if args.json or args.no_progress else progress_bar(len(depths) * len(chunks), "sweep")
    if progress:
        progress.unit, progress.unit_scale = "pt", False

    def seen(p: Any) -> None:
        if progress:
            progress.update(1)
            progress.set_postfix_str(f"{p.depth} x {human(p.chunk_size)}: {p.gb_per_s:.3f} GB/s")

    try:
        return sweep(
            ckpt,
            config=config,
            depths=depths,
            chunk_sizes=chunks,
            max_bytes=max_bytes,
            max_seconds=max_seconds,
            before_each=drop,
            on_point=seen,
        )
    finally:
        if progress:
            progress.close()


def _settings(best: Any, *, remote: bool, memory_limit: int) -> dict[str, Any]:
    """The profile's settings: the best point's depth and read size, for the backend measured."""
    settings: dict[str, Any] = {"autotune": False}
    pair = {"concurrency": best.depth, "chunk_size": best.chunk_size}
    if remote:
        settings["object_store"] = pair
    else:
        settings.update(pair)
    if best.memory_limit > memory_limit:
        settings["memory_limit"] = best.memory_limit
    return settings


def _print_table(points: list[Any], depths: list[int], chunks: list[int]) -> None:
    """GB/s by depth (rows) and read size (columns)."""
    capped = False
    print(f"{'depth':>6} " + " ".join(f"{human(c):>10}" for c in chunks))
    for d in depths:
        row = []
        for c in chunks:
            p = next((q for q in points if q.depth == d and q.chunk_size == c), None)
            cell = "         -" if p is None else "      fail" if p.error else f"{p.gb_per_s:10.3f}"
            if p is not None and not p.error and d * c > p.bytes:
                cell = cell[1:] + "*"
                capped = True
            row.append(cell)
        print(f"{d:>6} " + " ".join(row))
    if capped:
        print(
            "           * fewer reads than this depth fit in the bytes loaded per point (raise --max-bytes)"
        )
