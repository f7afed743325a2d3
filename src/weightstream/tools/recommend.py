"""What to deploy on an instance type: weightstream's settings and the Run:ai streamer's.

One function, :func:`recommend`, computes a :class:`Recommendation` from the instance's network
bandwidth (from the table in ``data/instances.csv``, or a measured probe), the model size and the
tensor-parallel degree. Every output format (``env``, ``vllm``, ``json`` here; ``k8s`` in
:mod:`weightstream.tools.manifests`) is rendered from that one value, so a deployment and an
exported manifest cannot drift apart.

Run:ai streamer settings follow the profiles cloud teams deploy today, by bandwidth class:

* >= 50 Gbit/s: 4 GiB chunks (``RUNAI_STREAMER_CHUNK_BYTESIZE``) and concurrency
  ``ceil(model_GB / 4)``, at most 64;
* below: the streamer's default chunk size and concurrency 32;
* an explicit concurrency wins; always ``RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS=3000`` and
  ``RUNAI_STREAMER_S3_LOW_SPEED_LIMIT=1048576``; vLLM's ``--model-loader-extra-config`` carries
  ``"distributed": true`` only when the tensor-parallel degree is above 1.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from weightstream.config import GiB, MiB, parse_size
from weightstream.errors import ConfigError

__all__ = ["FORMATS", "Instance", "Recommendation", "instances", "recommend", "render", "vllm_arguments"]

HIGH_BANDWIDTH_GBPS = 50.0
"""At or above this, the Run:ai profile uses 4 GiB chunks and concurrency by model size."""
STANDARD_GBPS = 25.0
"""Assumed for an instance that is neither in the table nor probed (the standard class)."""
PER_REQUEST_BYTES_S = 90e6
"""What one object-store connection typically delivers (S3: 80-100 MB/s per request)."""
FORMATS = ("env", "vllm", "json")
"""What :func:`render` writes (``k8s``: :func:`weightstream.tools.manifests.k8s_objects`)."""


@dataclass(frozen=True)
class Instance:
    """A cloud instance type from the table: its network and storage, and its GPUs."""

    name: str
    gpus: int
    gpu: str
    network_gbps: float
    up_to: bool
    source: str


@cache
def instances() -> dict[str, Instance]:
    """The instance table, by name."""
    text = resources.files("weightstream.tools").joinpath("data/instances.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if line and not line.startswith("#"))
    out = {}
    for r in rows:
        out[r["instance"]] = Instance(
            r["instance"], int(r["gpus"]), r["gpu"], float(r["network_gbps"]), r["up_to"] == "1", r["source"]
        )
    return out


@dataclass(frozen=True)
class Recommendation:
    """The settings to deploy, in each front end's spelling, and why."""

    instance: str | None
    network_gbps: float
    burst: bool
    """The bandwidth is an "up to" figure, a burst ceiling (the table says so)."""
    bandwidth_from: str
    """``table`` (with its source), ``probe`` (measured) or ``standard`` (assumed, said so)."""
    model_bytes: int
    tp: int
    weightstream_env: dict[str, str]
    runai_env: dict[str, str]
    runai_extra_config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    weightstream_extra_config: dict[str, Any] = field(default_factory=dict)
    """The same settings as ``weightstream_env``, as vLLM's ``--model-loader-extra-config`` for
    ``--load-format weightstream``."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_model_size(text: str) -> int:
    """``700GB`` (10^9 bytes each), ``65GiB`` (2^30), ``1.5TB`` or a byte count: the rule of
    :func:`weightstream.config.parse_size`, as for every size."""
    value = parse_size(text, name="model size")
    if value <= 0:
        raise ConfigError(f"model size must be positive, got {text!r}")
    return value


def recommend(
    *,
    model_bytes: int,
    instance: str | None = None,
    tp: int = 1,
    probe_gbps: float | None = None,
    concurrency: int | None = None,
) -> Recommendation:
    """Settings for loading a ``model_bytes`` checkpoint from object storage on ``instance``.

    Bandwidth comes from the instance table; an instance not in it uses ``probe_gbps`` (a
    measured figure, e.g. from ``weightstream bench``) or else the standard class, and the
    notes say which. ``concurrency``, if given, wins for the Run:ai streamer.
    """
    if tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {tp}")
    if concurrency is not None and concurrency < 1:
        raise ConfigError(f"--concurrency must be at least 1, got {concurrency}")
    notes: list[str] = []
    burst = False
    table = instances()
    if instance is not None and instance in table:
        row = table[instance]
        gbps, source, burst = row.network_gbps, "table", row.up_to
        notes.append(
            f"{instance}: {row.gpus} x {row.gpu}, {'up to ' if row.up_to else ''}{gbps:g} Gbit/s ({row.source})"
        )
        if row.up_to:
            notes.append("'up to' bandwidth is a burst ceiling; a long load may run at the lower baseline")
    elif probe_gbps is not None:
        gbps, source = probe_gbps, "probe"
        what = f"{instance} is not in the instance table; " if instance else ""
        notes.append(f"{what}using the measured probe: {gbps:.1f} Gbit/s")
    else:
        gbps, source = STANDARD_GBPS, "standard"
        what = f"{instance} is not in the instance table" if instance else "no instance given"
        notes.append(
            f"{what}: assuming the standard class ({STANDARD_GBPS:g} Gbit/s); "
            "pass --probe URI to measure the storage instead"
        )

    model_gb = model_bytes / 1e9
    # weightstream: start the tuner near the depth that fills the NIC at a typical per-request
    # rate (never below the default, at most 512), in requests of 8 MiB
    depth = max(128, min(512, math.ceil(gbps * 1e9 / 8 / PER_REQUEST_BYTES_S * 1.5)))
    chunk = 8 * MiB
    memory = max(2 * GiB, 2 * depth * chunk)
    ws_env = {
        "WEIGHTSTREAM_S3_CONCURRENCY": str(depth),
        "WEIGHTSTREAM_S3_CHUNK_SIZE": str(chunk),
        "WEIGHTSTREAM_MEMORY_LIMIT": str(memory),
        "WEIGHTSTREAM_AUTOTUNE": "1",
    }

    runai: dict[str, str] = {}
    if gbps >= HIGH_BANDWIDTH_GBPS:
        runai["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(4 * GiB)
        runai_conc = min(64, max(1, math.ceil(model_gb / 4)))
    else:
        runai_conc = 32
    if concurrency is not None:
        runai_conc = concurrency
        notes.append(f"concurrency {concurrency} given explicitly: used for the Run:ai streamer")
    runai["RUNAI_STREAMER_CONCURRENCY"] = str(runai_conc)
    runai["RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"] = "3000"
    runai["RUNAI_STREAMER_S3_LOW_SPEED_LIMIT"] = "1048576"
    extra: dict[str, Any] = {"concurrency": runai_conc}
    ws_extra: dict[str, Any] = {"s3_concurrency": depth, "s3_chunk_size": chunk, "memory_limit": memory}
    if tp > 1:
        extra["distributed"] = True
        ws_extra["distributed"] = True
    return Recommendation(
        instance=instance,
        network_gbps=gbps,
        burst=burst,
        bandwidth_from=source,
        model_bytes=model_bytes,
        tp=tp,
        weightstream_env=ws_env,
        runai_env=runai,
        runai_extra_config=extra,
        notes=notes,
        weightstream_extra_config=ws_extra,
    )


def extra_config(config: dict[str, Any]) -> str:
    """``--model-loader-extra-config``'s JSON, compact."""
    return json.dumps(config, separators=(",", ":"))


def vllm_arguments(rec: Recommendation, model: str) -> tuple[str, list[str], list[str]]:
    """What vLLM serves and its arguments, for weightstream's load format and for the Run:ai
    streamer's: ``(served, weightstream_args, runai_args)``. vLLM (0.32) takes an object-store
    model only with its own formats (runai_streamer, modelexpress): weightstream's serves a local
    folder of the model's config and tokenizer (:data:`CONFIG_DIR` until one is named, made by
    ``weightstream pull-config``) with the weights' URI in its extra config."""
    tp_args = ["--tensor-parallel-size", str(rec.tp)] if rec.tp > 1 else []
    remote = model == "MODEL_URI" or "://" in model
    served = CONFIG_DIR if remote else model
    ws_extra = (
        {"weights": model, **rec.weightstream_extra_config} if remote else rec.weightstream_extra_config
    )
    ws_args = ["--load-format", "weightstream", "--model-loader-extra-config", extra_config(ws_extra)]
    runai_args = [
        "--load-format",
        "runai_streamer",
        "--model-loader-extra-config",
        extra_config(rec.runai_extra_config),
    ]
    return served, ws_args + tp_args, runai_args + tp_args


CONFIG_DIR = "CONFIG_DIR"
"""Where ``--format vllm`` says the model's config folder goes (``weightstream pull-config``
makes it; the Kubernetes manifests make it in an init container)."""


def render(rec: Recommendation, fmt: str, *, model: str = "MODEL_URI") -> str:
    """The recommendation as shell exports, vLLM command lines, or JSON (Kubernetes objects:
    :mod:`weightstream.tools.manifests`). vLLM gets weightstream's own load format, with the
    Run:ai streamer's equivalent beside it for teams that run that today."""
    served, ws_args, runai_args = vllm_arguments(rec, model)
    config_note = (
        f"weightstream pull-config {shlex.quote(model)} {CONFIG_DIR}   # the config and tokenizer, not the weights\n"
        if served == CONFIG_DIR
        else ""
    )
    notes = "".join(f"# {n}\n" for n in rec.notes)
    if fmt == "json":
        return json.dumps(rec.as_dict(), indent=2)
    if fmt == "env":
        lines = ["# weightstream"] + [f"export {k}={shlex.quote(v)}" for k, v in rec.weightstream_env.items()]
        lines += ["# Run:ai streamer (vLLM --load-format runai_streamer)"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in rec.runai_env.items()]
        return notes + "\n".join(lines)
    if fmt == "vllm":
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in rec.runai_env.items())
        return (
            notes
            + "# weightstream (pip install 'weightstream[vllm]')\n"
            + config_note
            + f"vllm serve {shlex.quote(served)} "
            + " ".join(shlex.quote(a) for a in ws_args)
            + "\n# or the Run:ai streamer, with the equivalent settings\n"
            + f"{env} \\\n  vllm serve {shlex.quote(model)} "
            + " ".join(shlex.quote(a) for a in runai_args)
        )
    raise ConfigError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
