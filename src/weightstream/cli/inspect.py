"""``weightstream inspect``: tensors, dtypes, shapes, shards and size, from the headers alone."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from weightstream.cli.common import (
    human,
    open_checkpoint,
)
from weightstream.config import StreamConfig

if TYPE_CHECKING:
    from weightstream.checkpoint import Checkpoint


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    """Add the ``inspect`` command to the parser's subcommands."""
    ins = sub.add_parser(
        "inspect", help="list tensors, dtypes, shapes, shards and size without reading tensor data"
    )
    ins.add_argument("uri")
    ins.add_argument("--json", action="store_true", help="print everything as JSON")
    ins.add_argument("--summary", action="store_true", help="totals only, no per-tensor listing")
    ins.set_defaults(func=cmd_inspect)


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
    with open_checkpoint(args.uri, config=StreamConfig.from_env()) as ckpt:
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
            print(f"  shard    {f.uri}: {len(f.tensors)} tensors, {human(f.size)}")
        print(f"tensors    {len(ckpt.tensors)}")
        print(
            "dtypes     "
            + ", ".join(f"{k} {human(v)}" for k, v in sorted(dtypes.items(), key=lambda kv: -kv[1]))
        )
        print(f"total      {human(ckpt.total_bytes)} ({ckpt.total_bytes} bytes)")
        return 0
