"""What the commands share: settings from the flags, the checkpoint opener, number parsing and
formatting, progress bars, and the rule that bench and tune never write to the storage they
measure."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

import weightstream
from weightstream.config import StreamConfig, parse_size
from weightstream.errors import ConfigError

if TYPE_CHECKING:
    from weightstream.checkpoint import Checkpoint

__all__ = [
    "config_from_args",
    "human",
    "ints",
    "open_checkpoint",
    "progress_bar",
    "refuse_inside",
    "run_limits",
    "settings_flags",
    "sizes",
]


def open_checkpoint(uri: str, *, config: StreamConfig) -> Checkpoint:
    """``weightstream.open_checkpoint``, imported when a command first needs it (torch with it),
    so ``--help`` and ``recommend`` start at once."""
    return weightstream.open_checkpoint(uri, config=config)


def config_from_args(args: argparse.Namespace) -> StreamConfig:
    settings = {
        k: getattr(args, k, None)
        for k in ("chunk_size", "memory_limit", "concurrency", "direct_io", "io_timeout")
    }
    if getattr(args, "no_autotune", False):
        settings["autotune"] = False
    return StreamConfig.from_mapping(
        {k: v for k, v in settings.items() if v is not None},
        profile=getattr(args, "profile", None),
        label=lambda key: "--" + key.replace("_", "-"),
    )


def settings_flags() -> argparse.ArgumentParser:
    """The parent parser of the settings a load takes (each a :class:`StreamConfig` field)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--chunk-size", help="bytes per read, e.g. 16MiB (env WEIGHTSTREAM_CHUNK_SIZE)")
    p.add_argument("--concurrency", type=int, help="reads in flight (env WEIGHTSTREAM_CONCURRENCY)")
    p.add_argument(
        "--memory-limit", help="bytes read but not yet consumed, e.g. 2GiB (env WEIGHTSTREAM_MEMORY_LIMIT)"
    )
    p.add_argument(
        "--direct-io", choices=["auto", "on", "off"], help="O_DIRECT policy (env WEIGHTSTREAM_DIRECT_IO)"
    )
    p.add_argument(
        "--io-timeout",
        type=float,
        help="seconds without progress before failing (env WEIGHTSTREAM_IO_TIMEOUT)",
    )
    p.add_argument("--no-autotune", action="store_true", help="keep concurrency and chunk size fixed")
    p.add_argument("--profile", help="a profile file from `weightstream tune` (env WEIGHTSTREAM_PROFILE)")
    return p


def run_limits(p: argparse.ArgumentParser, max_bytes: str, max_seconds: float) -> None:
    """The flags that bound a measuring command (bench, tune), and its output and profile."""
    p.add_argument(
        "--max-bytes", default=max_bytes, help=f"read at most this much per phase (default {max_bytes})"
    )
    p.add_argument(
        "--max-seconds", type=float, default=max_seconds, help=f"time bound (default {max_seconds:g} s)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", help="start from a profile file (env WEIGHTSTREAM_PROFILE)")


def human(n: float) -> str:
    """Bytes in binary units (``1.50 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def progress_bar(total: int, desc: str) -> Any:
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


def ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"{flag}: expected positive integers, got {text!r}")
    return out


def sizes(text: str, flag: str) -> list[int]:
    out = [parse_size(x.strip(), name=flag) for x in text.split(",") if x.strip()]
    if not out or min(out) < 4096:
        raise ConfigError(f"{flag}: expected sizes of at least 4 KiB, got {text!r}")
    return out


def refuse_inside(path: str, ckpt: Checkpoint) -> None:
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
