"""``weightstream load``: stream a checkpoint and report throughput, memory and what the reads did."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import weightstream
from weightstream.cli.common import (
    config_from_args,
    human,
    open_checkpoint,
)
from weightstream.config import settled
from weightstream.errors import ConfigError

if TYPE_CHECKING:
    from weightstream.pipeline import TensorStream


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    """Add the ``load`` command to the parser's subcommands."""
    load = sub.add_parser(
        "load", parents=[settings], help="stream a checkpoint and report throughput and memory"
    )
    load.add_argument("uri", help="a .safetensors file, a checkpoint folder, an index file, or file:// URI")
    load.add_argument("--device", default="cpu", help="where tensors go (cpu, cuda, cuda:1, ...)")
    load.add_argument("--tensor", action="append", metavar="NAME", help="load only this tensor (repeatable)")
    load.add_argument("--keep", action="store_true", help="hold every tensor until the end, as load() does")
    load.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    load.add_argument(
        "--distributed",
        action="store_true",
        help="split the reads across the ranks of a launcher such as torchrun (gloo for cpu, nccl for cuda)",
    )
    load.set_defaults(func=cmd_load)


def cmd_load(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    names = args.tensor or None
    if not args.distributed:
        # The headers first: a file that is missing or malformed is refused before torch loads
        # (a rank of a group instead joins it first, so that the others hear of its failure).
        with open_checkpoint(args.uri, config=config) as ckpt:
            stream = ckpt.stream(device=args.device, tensors=names, config=config)
            return _run_load(args, stream, show_progress=True)
    rank, args.device = _init_distributed(args.device)
    stream = weightstream.stream(args.uri, device=args.device, tensors=names, config=config, distributed=True)
    try:
        return _run_load(args, stream, show_progress=rank == 0)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _init_distributed(device: str) -> tuple[int, str]:
    """Join the process group that ``torchrun`` (or any launcher setting RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT) describes: NCCL for a CUDA device (each rank on its
    LOCAL_RANK's GPU), gloo for CPU."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ConfigError(
            f"--distributed needs a launcher's environment ({', '.join(missing)} unset): run it under "
            "torchrun, e.g. torchrun --nproc-per-node 4 --no-python weightstream load URI --distributed"
        )
    import torch.distributed as dist  # torch, once the arguments hold

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
    print(f"bytes      {human(s.bytes)} ({s.bytes} bytes)")
    print(f"time       {s.seconds:.3f} s")
    print(f"throughput {s.gb_per_s:.3f} GB/s")
    print(
        f"reads      {s.chunks} chunks: {human(s.direct_bytes)} direct, {human(s.cached_bytes)} from page cache, "
        f"{human(s.buffered_bytes)} buffered, {human(s.network_bytes)} from object storage"
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
    if s.checked_bytes or s.unchecked_bytes:
        earlier = (
            f" ({human(s.recalled_bytes)} of it by an earlier load of the same files)"
            if s.recalled_bytes
            else ""
        )
        print(
            f"checked    {human(s.checked_bytes)}{earlier}; {human(s.unchecked_bytes)} read in part, not checked"
        )
    print(f"memory     peak RSS {human(s.peak_rss_bytes)}; peak unconsumed {human(s.peak_held_bytes)}")
    if s.rank is not None:
        print(
            f"ranks      rank {s.rank} of {s.world_size}: read {human(s.bytes_read)} from storage, "
            f"received {human(s.bytes_received)} from the other ranks"
        )
    c = stream.config
    print(
        f"settings   chunk_size={human(settled(c.chunk_size))} concurrency={c.concurrency} "
        f"memory_limit={human(settled(c.memory_limit))} direct_io={c.direct_io} device={args.device} "
        f"autotune={'on' if c.autotune else 'off'}"
    )
    if s.tuning:
        t = s.tuning
        print(
            f"tuner      depth {t['start_depth']} -> {t['final_depth']} (max {t['max_depth']}), "
            f"read size {human(t['chunk_size'])}, {len(t['decisions'])} decisions"
            + (
                f", opening search ended at {t['settled_at_s']:.2f} s"
                if t.get("settled_at_s") is not None
                else ""
            )
        )
    return 0
