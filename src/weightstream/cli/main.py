"""``weightstream`` command line: ``load``, ``inspect``, ``bench``, ``tune`` and ``recommend``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import weightstream
from weightstream import __version__
from weightstream.config import StreamConfig, parse_size
from weightstream.errors import ConfigError, WeightStreamError

if TYPE_CHECKING:
    from weightstream.checkpoint import Checkpoint
    from weightstream.pipeline import TensorStream


def open_checkpoint(uri: str, *, config: StreamConfig) -> Checkpoint:
    """``weightstream.open_checkpoint``, imported when a command first needs it (torch with it),
    so ``--help`` and ``recommend`` start at once."""
    return weightstream.open_checkpoint(uri, config=config)

__all__ = ["main"]


def _config(args: argparse.Namespace) -> StreamConfig:
    overrides: dict[str, Any] = {}
    if getattr(args, "no_autotune", False):
        overrides["autotune"] = False
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
    return StreamConfig.from_env(profile=getattr(args, "profile", None), **overrides)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def cmd_load(args: argparse.Namespace) -> int:
    config = _config(args)
    names = args.tensor or None
    rank = 0
    if args.distributed:
        rank, args.device = _init_distributed(args.device)
        stream = weightstream.stream(
            args.uri, device=args.device, tensors=names, config=config, distributed=True
        )
    else:
        stream = open_checkpoint(args.uri, config=config).stream(
            device=args.device, tensors=names, config=config
        )
    try:
        return _run_load(args, stream, show_progress=rank == 0)
    finally:
        if args.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def _init_distributed(device: str) -> tuple[int, str]:
    """Join the process group that ``torchrun`` (or any launcher setting RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT) describes: NCCL for a CUDA device (each rank on its
    LOCAL_RANK's GPU), gloo for CPU."""
    import torch.distributed as dist

    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ConfigError(
            f"--distributed needs a launcher's environment ({', '.join(missing)} unset): run it under "
            "torchrun, e.g. torchrun --nproc-per-node 4 --no-python weightstream load URI --distributed"
        )
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: this machine or torch build has no CUDA device")
        if device == "cuda":
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), device


def _run_load(args: argparse.Namespace, stream: TensorStream, *, show_progress: bool) -> int:
    bar = None
    if not args.json and not args.no_progress and show_progress:
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
            f"{r.get('throttled', 0)} throttled, {r.get('hedges', 0)} hedged "
            f"({r.get('hedge_wins', 0)} won); latency p50 {r.get('latency_p50_s')} s, "
            f"p99 {r.get('latency_p99_s')} s"
        )
    print(f"memory     peak RSS {_human(s.peak_rss_bytes)}; peak unconsumed {_human(s.peak_held_bytes)}")
    if s.rank is not None:
        print(
            f"ranks      rank {s.rank} of {s.world_size}: read {_human(s.bytes_read)} from storage, "
            f"received {_human(s.bytes_received)} from the other ranks"
        )
    c = stream.config
    print(
        f"settings   chunk_size={_human(c.chunk_size)} concurrency={c.concurrency} "
        f"memory_limit={_human(c.memory_limit)} direct_io={c.direct_io} device={args.device} "
        f"autotune={'on' if c.autotune else 'off'}"
    )
    if s.tuning:
        t = s.tuning
        print(
            f"tuner      depth {t['start_depth']} -> {t['final_depth']} (max {t['max_depth']}), "
            f"read size {_human(t['chunk_size'])}, {len(t['decisions'])} decisions"
            + (
                f", opening search ended at {t['settled_at_s']:.2f} s"
                if t.get("settled_at_s") is not None
                else ""
            )
        )
    return 0


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        desc=desc,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
    )


def _ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"{flag}: expected positive integers, got {text!r}")
    return out


def _sizes(text: str, flag: str) -> list[int]:
    out = [parse_size(x.strip(), name=flag) for x in text.split(",") if x.strip()]
    if not out or min(out) < 4096:
        raise ConfigError(f"{flag}: expected sizes of at least 4 KiB, got {text!r}")
    return out


def _refuse_inside(path: str, ckpt: Checkpoint) -> None:
    """bench and tune never write to the storage they measure."""
    target = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    from weightstream.location import LocalPath

    for shard in ckpt.shards:
        if not isinstance(shard.location, LocalPath):
            continue
        folder = os.path.realpath(os.path.dirname(os.path.abspath(shard.location.path)))
        if target == folder or target.startswith(folder + os.sep):
            raise ConfigError(
                f"{path}: refusing to write inside the checkpoint's folder {folder} (the storage under test)"
            )


def cmd_bench(args: argparse.Namespace) -> int:
    from weightstream.tuning.probe import probe

    config = _config(args)
    ckpt = open_checkpoint(args.uri, config=config)
    max_bytes = parse_size(args.max_bytes, name="--max-bytes")
    depths = _ints(args.depths, "--depths")
    block = parse_size(args.block, name="--block")
    bar = (
        None
        if args.json or args.no_progress
        else _bar(min(max_bytes, ckpt.total_bytes * len(depths)), "probe")
    )
    points = probe(
        ckpt,
        config=config,
        depths=depths,
        block=block,
        max_bytes=max_bytes,
        max_seconds=args.max_seconds,
        on_bytes=bar.update if bar else None,
    )
    if bar:
        bar.close()
    raw = max(points, key=lambda p: p.gb_per_s)
    names = None
    if ckpt.total_bytes > max_bytes:
        from weightstream.tuning.probe import select_bytes

        names = select_bytes(ckpt, max_bytes)
    stream = ckpt.stream(tensors=names, config=config)
    bar = None if args.json or args.no_progress else _bar(stream.bytes_to_read, "load")
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
            f"  raw      depth {p.depth:>4} x {_human(p.block)}: {p.gb_per_s:7.3f} GB/s ({_human(p.bytes)} in {p.seconds:.2f} s)"
        )
    print(f"raw        {raw.gb_per_s:.3f} GB/s (best, depth {raw.depth})")
    print(f"load       {s.gb_per_s:.3f} GB/s ({s.tensors} tensors, {_human(s.bytes)} in {s.seconds:.2f} s)")
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


def cmd_tune(args: argparse.Namespace) -> int:
    import datetime

    from weightstream.tuning.heatmap import draw_heatmap
    from weightstream.tuning.probe import sweep

    if args.heatmap:
        try:
            import matplotlib  # noqa: F401  (checked now, not after a long sweep)
        except ImportError:
            raise ConfigError(
                "drawing the heat map needs matplotlib: pip install 'weightstream[tune]' (or --heatmap '')"
            ) from None
    config = _config(args)
    ckpt = open_checkpoint(args.uri, config=config)
    _refuse_inside(args.output, ckpt)
    if args.heatmap:
        _refuse_inside(args.heatmap, ckpt)
    remote = ckpt.remote
    depths = _ints(args.depths or ("16,32,64,128,256" if remote else "2,4,8,16,32,64"), "--depths")
    chunks = _sizes(
        args.chunk_sizes or ("4MiB,8MiB,16MiB,32MiB" if remote else "4MiB,16MiB,64MiB"), "--chunk-sizes"
    )
    max_bytes = parse_size(args.max_bytes, name="--max-bytes")
    if args.drop_caches and os.geteuid() != 0:
        raise ConfigError("--drop-caches needs root")

    def drop() -> None:
        if args.drop_caches:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")

    total = len(depths) * len(chunks)
    progress = None if args.json or args.no_progress else _bar(total, "sweep")
    if progress:
        progress.unit, progress.unit_scale = "pt", False

    def seen(p: Any) -> None:
        if progress:
            progress.update(1)
            progress.set_postfix_str(f"{p.depth} x {_human(p.chunk_size)}: {p.gb_per_s:.3f} GB/s")

    points = sweep(
        ckpt,
        config=config,
        depths=depths,
        chunk_sizes=chunks,
        max_bytes=max_bytes,
        max_seconds=args.max_seconds,
        before_each=drop,
        on_point=seen,
    )
    if progress:
        progress.close()
    good = [p for p in points if not p.error]
    if not good:
        raise ConfigError("no sweep point completed: " + "; ".join(p.error or "" for p in points[:3]))
    best = max(good, key=lambda p: p.gb_per_s)
    if remote:
        settings: dict[str, Any] = {
            "autotune": False,
            "object_store": {"concurrency": best.depth, "chunk_size": best.chunk_size},
        }
    else:
        settings = {"autotune": False, "concurrency": best.depth, "chunk_size": best.chunk_size}
    if best.memory_limit > config.memory_limit:
        settings["memory_limit"] = best.memory_limit
    doc = {
        "weightstream_profile": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "uri": args.uri,
        "best_gb_per_s": round(best.gb_per_s, 4),
        "cache": "dropped before each point" if args.drop_caches else "as found",
        "settings": settings,
        "sweep": [p.as_dict() for p in points],
    }
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    if args.heatmap:
        draw_heatmap(points, args.heatmap, title=f"{args.uri}: GB/s over {_human(good[0].bytes)} per point")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    capped = False
    print(f"{'depth':>6} " + " ".join(f"{_human(c):>10}" for c in chunks))
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
    print(f"best       {best.depth} in flight x {_human(best.chunk_size)}: {best.gb_per_s:.3f} GB/s")
    print(f"profile    {args.output} (use: --profile {args.output} or WEIGHTSTREAM_PROFILE={args.output})")
    if args.heatmap:
        print(f"heat map   {args.heatmap}")
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    from weightstream.tuning.recommend import parse_model_size, recommend, render

    probe_gbps = None
    if args.probe:
        from weightstream.tuning.probe import probe

        config = StreamConfig.from_env()
        ckpt = open_checkpoint(args.probe, config=config)
        points = probe(
            ckpt, config=config, max_bytes=parse_size(args.probe_bytes, name="--probe-bytes"), max_seconds=20
        )
        probe_gbps = max(p.gb_per_s for p in points) * 8
    rec = recommend(
        model_bytes=parse_model_size(args.model_size),
        instance=args.instance,
        tp=args.tp,
        probe_gbps=probe_gbps,
        concurrency=args.concurrency,
    )
    print(render(rec, args.format, model=args.model or "MODEL_URI"))
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
    load.add_argument("--no-autotune", action="store_true", help="keep concurrency and chunk size fixed")
    load.add_argument(
        "--distributed",
        action="store_true",
        help="split the reads across the ranks of a launcher such as torchrun (gloo for cpu, nccl for cuda)",
    )
    load.add_argument("--profile", help="a profile file from `weightstream tune` (env WEIGHTSTREAM_PROFILE)")
    load.set_defaults(func=cmd_load)

    ins = sub.add_parser(
        "inspect", help="list tensors, dtypes, shapes, shards and size without reading tensor data"
    )
    ins.add_argument("uri")
    ins.add_argument("--json", action="store_true", help="print everything as JSON")
    ins.add_argument("--summary", action="store_true", help="totals only, no per-tensor listing")
    ins.set_defaults(func=cmd_inspect)

    def bounded(p: argparse.ArgumentParser, max_bytes: str, max_seconds: float) -> None:
        p.add_argument(
            "--max-bytes", default=max_bytes, help=f"read at most this much per phase (default {max_bytes})"
        )
        p.add_argument(
            "--max-seconds", type=float, default=max_seconds, help=f"time bound (default {max_seconds:g} s)"
        )
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--profile", help="start from a profile file (env WEIGHTSTREAM_PROFILE)")

    bench = sub.add_parser("bench", help="probe the storage's raw bandwidth, then load, and compare")
    bench.add_argument("uri")
    bench.add_argument("--depths", default="1,4,16,64", help="raw-read depths to probe (default 1,4,16,64)")
    bench.add_argument("--block", default="16MiB", help="raw read size (default 16MiB)")
    bounded(bench, "4GiB", 60.0)
    bench.set_defaults(
        func=cmd_bench, chunk_size=None, memory_limit=None, concurrency=None, direct_io=None, io_timeout=None
    )

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
    bounded(tune, "1GiB", 300.0)
    tune.set_defaults(
        func=cmd_tune, chunk_size=None, memory_limit=None, concurrency=None, direct_io=None, io_timeout=None
    )

    rec = sub.add_parser("recommend", help="settings to deploy for an instance type and model size")
    rec.add_argument("--instance", help="cloud instance type, e.g. p5.48xlarge")
    rec.add_argument("--model-size", required=True, help="checkpoint size, e.g. 700GB or 65GiB")
    rec.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    rec.add_argument("--concurrency", type=int, help="force the Run:ai streamer's concurrency")
    rec.add_argument("--format", choices=["env", "vllm", "k8s", "json"], default="env")
    rec.add_argument("--model", help="model URI for the vllm and k8s formats")
    rec.add_argument(
        "--probe", metavar="URI", help="measure this checkpoint's storage when the instance is unknown"
    )
    rec.add_argument("--probe-bytes", default="2GiB", help="bytes the probe may read (default 2GiB)")
    rec.set_defaults(
        func=cmd_recommend, chunk_size=None, memory_limit=None, direct_io=None, io_timeout=None, profile=None
    )
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
