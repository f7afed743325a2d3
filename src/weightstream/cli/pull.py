"""``weightstream pull-config``: a model's config and tokenizer files from an object store into a
local folder, so that vLLM can be given that folder and stream the weights from the store.

vLLM 0.32 takes object-store model URIs only with its own load formats; with ours it needs a
local folder with the model's small files (``config.json``, the tokenizer, the generation
config) and the weights' URI (``--model-loader-extra-config '{"weights": "s3://..."}'``). This
command makes that folder, through the loads' own GET path and credentials (retries, the
low-speed rule, a version pinned per object; each file written whole, then renamed into place):
the step an init container runs before ``vllm serve``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from weightstream.config import StreamConfig
from weightstream.errors import ConfigError, NotFoundError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
"""Files of weights, which the loader streams: never pulled."""
MAX_FILE_BYTES = 1 << 30
"""A config or tokenizer file larger than this is surely not one: refused, named."""


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "pull-config",
        help="download a model's config and tokenizer files (everything but its weights) from an "
        "object store to a local folder, for vllm serve FOLDER --load-format weightstream",
    )
    p.add_argument("uri", help="the model's prefix: s3://bucket/model/ (gs:// and az:// too)")
    p.add_argument("dir", help="the local folder to write (made if missing)")
    p.set_defaults(func=cmd_pull_config)


def pull_config(uri: str, folder: str, config: StreamConfig | None = None) -> list[str]:
    """Download every object directly under ``uri`` that is not a weights file (nor the
    safetensors index) into ``folder``; returns the file names written."""
    from weightstream.location import object_location
    from weightstream.sources.object_store.listing import download, list_objects

    loc = object_location(uri)
    if loc is None:
        raise ConfigError(f"pull-config reads an object-store prefix (s3://, gs://, az://), got {uri!r}")
    config = config if config is not None else StreamConfig.from_env()
    prefix = loc.key.rstrip("/")
    loc = loc.with_key(prefix)
    found = list_objects(loc, config)
    wanted: dict[str, tuple[str, int]] = {}
    for key, size in found.items():
        name = key[len(prefix) :].lstrip("/") if prefix else key
        if not name or "/" in name or name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                f"{name} is {size} bytes: too large for a config or tokenizer file (at most "
                f"{MAX_FILE_BYTES}); pull it by hand if it is one",
                uri=loc.with_key(key).uri,
            )
        wanted[name] = (key, size)
    if "config.json" not in wanted:
        raise NotFoundError(
            f"no config.json directly under this prefix (found {len(found)} objects: "
            f"{', '.join(sorted(found)[:5]) or 'none'}); give the model's own prefix",
            uri=loc.uri,
        )
    os.makedirs(folder, exist_ok=True)
    for name, (key, size) in sorted(wanted.items()):
        download(loc.with_key(key), os.path.join(folder, name), config, size=size)
    return sorted(wanted)


def cmd_pull_config(args: argparse.Namespace) -> int:
    for name in pull_config(args.uri, args.dir):
        print(os.path.join(args.dir, name))
    return 0
