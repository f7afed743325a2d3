"""``weightstream`` command line: ``load``, ``inspect``, ``bench``, ``tune``, ``recommend``,
``pull-config``, ``load-status``, ``cache`` and ``manifest``,
one module each (``weightstream.cli.<command>``), sharing the settings flags and helpers of
``weightstream.cli.common``. The engine (and torch) load inside the commands that read."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from weightstream import __version__
from weightstream.cli import bench, cache, common, inspect, load, manifest, pull, recommend, status, tune
from weightstream.errors import WeightStreamError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="weightstream", description="Stream safetensors checkpoints into tensors."
    )
    ap.add_argument("--version", action="version", version=f"weightstream {__version__}")
    ap.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: every decision)")
    sub = ap.add_subparsers(dest="command", required=True)
    settings = common.settings_flags()
    for command in (load, inspect, bench, tune, recommend, pull, status, cache, manifest):
        command.add(sub, settings)
    return ap


def main(argv: list[str] | None = None) -> int:
    _printable_streams()
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe is found here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (``weightstream inspect | head -1``): what it read is all it wanted.
        # Further writes (and the flush at exit) would fail again; send them nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a program killed by it
    except WeightStreamError as exc:
        print(f"weightstream: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("weightstream: interrupted", file=sys.stderr)
        return 130


def _printable_streams() -> None:
    """What the CLI prints cannot fail: a path holding bytes the terminal's encoding cannot show
    (an undecodable file name, kept by Python as surrogates) is printed escaped, never raised
    as UnicodeEncodeError after the work is done."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(Exception):
                reconfigure(errors="backslashreplace")
