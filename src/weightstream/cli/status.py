"""``weightstream load-status PATH``: is the load a progress file describes done, advancing, or
stuck? For a Kubernetes probe (``exec``) or a sidecar; see :mod:`weightstream.progress`."""

from __future__ import annotations

import argparse
from typing import Any

from weightstream.progress import status


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "load-status",
        help="read a vLLM load's progress file (progress_file): exit 0 while it is done or "
        "advancing, 1 when it failed or stalled",
    )
    p.add_argument("path", help="the progress file (each rank's: PATH, PATH.rank1, ...)")
    p.add_argument(
        "--stalled-after",
        type=float,
        default=120.0,
        help="seconds without progress after which a load counts as stuck (default 120)",
    )
    p.set_defaults(func=cmd_load_status)


def cmd_load_status(args: argparse.Namespace) -> int:
    found = status(args.path, stalled_after=args.stalled_after)
    if not found:
        print(f"{args.path}: no load has started")
        return 0
    for s in found:
        print(s.describe())
    return 0 if all(s.ok for s in found) else 1
