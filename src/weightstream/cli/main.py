"""``weightstream`` command line: ``load`` and ``inspect``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from weightstream import __version__
from weightstream._checkpoint import Checkpoint, open_checkpoint
from weightstream.config import StreamConfig, parse_size
from weightstream.errors import WeightStreamError

__all__ = ["main"]


def _config(args: argparse.Namespace) -> StreamConfig:
    overrides: dict[str, Any] = {}
    if args.chunk_size is not None:
        overrides["chunk_size"] = parse_size(args.chunk_size, name="--chunk-size")
    if args.memory_limit is not None:
        overrides["memory_limit"] = parse_size(args.memory_limit, name="--memory-limit")
    if args.concurrency is not None:
        overrides["concurrency"] = args.concurrency
    if args.direct_io is not None:
        overrides["direct_io"] = args.direct_io
    if args.io_timeout is not None:
        overrides["io_timeout"] = args.io_timeout
    return StreamConfig.from_env(**overrides)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def cmd_load(args: argparse.Namespace) -> int:
    config = _config(args)
    ckpt = open_checkpoint(args.uri, config=config)
    names = args.tensor or None
    stream = ckpt.stream(device=args.device, tensors=names, config=config)
    bar = None
    if not args.json and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(
            total=stream.bytes_to_read,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            desc="loading",
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]",
        )
    kept = {}
    try:
        stream.on_bytes = bar.update if bar is not None else None
        with stream:
            for name, tensor in stream:
                if args.keep:
                    kept[name] = tensor
                del tensor
    finally:
        if bar is not None:
            bar.close()
    stats = stream.stats
    if args.json:
        print(json.dumps(stats.as_dict(), indent=2))
        return 0
    s = stats
    print(f"loaded     {s.tensors} tensors from {s.files} file(s): {args.uri}")
    print(f"bytes      {_human(s.bytes)} ({s.bytes} bytes)")
    print(f"time       {s.seconds:.3f} s")
    print(f"throughput {s.gb_per_s:.3f} GB/s")
    print(
        f"reads      {s.chunks} chunks: {_human(s.direct_bytes)} direct, {_human(s.cached_bytes)} from page cache, "
        f"{_human(s.buffered_bytes)} buffered, {_human(s.network_bytes)} from object storage"
    )
    if s.network_bytes or s.requests:
        r = s.requests or {}
        print(
            f"requests   {r.get('requests', 0)} GETs, {r.get('retries', 0)} retries, "
            f"{r.get('stalls_aborted', 0)} stalls aborted, {r.get('timeouts', 0)} timeouts, "
            f"{r.get('throttled', 0)} throttled; latency p50 {r.get('latency_p50_s')} s, "
            f"p99 {r.get('latency_p99_s')} s"
        )
    print(f"memory     peak RSS {_human(s.peak_rss_bytes)}; peak unconsumed {_human(s.peak_held_bytes)}")
    c = config
    print(
        f"settings   chunk_size={_human(c.chunk_size)} concurrency={c.concurrency} "
        f"memory_limit={_human(c.memory_limit)} direct_io={c.direct_io} device={args.device}"
    )
    return 0


def _inspect_dict(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "uri": ckpt.uri,
        "index": ckpt.index_uri,
        "total_bytes": ckpt.total_bytes,
        "metadata": ckpt.metadata,
        "shards": [
            {"file": f.uri, "size": f.size, "tensors": len(f.tensors), "header_bytes": f.data_start}
            for f in ckpt.files
        ],
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype.name,
                "shape": list(t.shape),
                "bytes": t.nbytes,
                "file": t.uri,
                "offsets": [t.start, t.end],
            }
            for t in ckpt.tensors.values()
        ],
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.uri, config=StreamConfig.from_env())
    if args.json:
        print(json.dumps(_inspect_dict(ckpt), indent=2))
        return 0
    if not args.summary:
        width = max((len(t.name) for t in ckpt.tensors.values()), default=4)
        print(f"{'name':<{width}}  {'dtype':<11} {'shape':<24} {'bytes':>14}  file")
        for t in ckpt.tensors.values():
            shape = "[" + ", ".join(map(str, t.shape)) + "]"
            print(
                f"{t.name:<{width}}  {t.dtype.name:<11} {shape:<24} {t.nbytes:>14}  {t.uri.rsplit('/', 1)[-1]}"
            )
        print()
    dtypes: dict[str, int] = {}
    for t in ckpt.tensors.values():
        dtypes[t.dtype.name] = dtypes.get(t.dtype.name, 0) + t.nbytes
    print(f"checkpoint {ckpt.uri}" + (f" (index {ckpt.index_uri})" if ckpt.index_uri else ""))
    for f in ckpt.files:
        print(f"  shard    {f.uri}: {len(f.tensors)} tensors, {_human(f.size)}")
    print(f"tensors    {len(ckpt.tensors)}")
    print(
        "dtypes     "
        + ", ".join(f"{k} {_human(v)}" for k, v in sorted(dtypes.items(), key=lambda kv: -kv[1]))
    )
    print(f"total      {_human(ckpt.total_bytes)} ({ckpt.total_bytes} bytes)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="weightstream", description="Stream safetensors checkpoints into tensors."
    )
    ap.add_argument("--version", action="version", version=f"weightstream {__version__}")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: every decision)")
    sub = ap.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="stream a checkpoint and report throughput and memory")
    load.add_argument("uri", help="a .safetensors file, a checkpoint folder, an index file, or file:// URI")
    load.add_argument("--device", default="cpu", help="where tensors go (cpu, cuda, cuda:1, ...)")
    load.add_argument("--tensor", action="append", metavar="NAME", help="load only this tensor (repeatable)")
    load.add_argument("--keep", action="store_true", help="hold every tensor until the end, as load() does")
    load.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    load.add_argument("--chunk-size", help="bytes per read, e.g. 16MiB (env WEIGHTSTREAM_CHUNK_SIZE)")
    load.add_argument("--concurrency", type=int, help="reads in flight (env WEIGHTSTREAM_CONCURRENCY)")
    load.add_argument(
        "--memory-limit", help="bytes read but not yet consumed, e.g. 2GiB (env WEIGHTSTREAM_MEMORY_LIMIT)"
    )
    load.add_argument(
        "--direct-io", choices=["auto", "on", "off"], help="O_DIRECT policy (env WEIGHTSTREAM_DIRECT_IO)"
    )
    load.add_argument(
        "--io-timeout",
        type=float,
        help="seconds without progress before failing (env WEIGHTSTREAM_IO_TIMEOUT)",
    )
    load.set_defaults(func=cmd_load)

    ins = sub.add_parser(
        "inspect", help="list tensors, dtypes, shapes, shards and size without reading tensor data"
    )
    ins.add_argument("uri")
    ins.add_argument("--json", action="store_true", help="print everything as JSON")
    ins.add_argument("--summary", action="store_true", help="totals only, no per-tensor listing")
    ins.set_defaults(func=cmd_inspect)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except WeightStreamError as exc:
        print(f"weightstream: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("weightstream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
