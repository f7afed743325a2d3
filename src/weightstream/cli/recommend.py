"""``weightstream recommend``: the settings to deploy for an instance type and a model size."""

from __future__ import annotations

import argparse
import os
from typing import Any

from weightstream.cli.common import (
    open_checkpoint,
)
from weightstream.config import StreamConfig, parse_size
from weightstream.errors import ConfigError


def add(sub: Any, settings: argparse.ArgumentParser) -> None:
    """Add the ``recommend`` command to the parser's subcommands."""
    rec = sub.add_parser("recommend", help="settings to deploy for an instance type and model size")
    rec.add_argument("--instance", help="cloud instance type, e.g. p5.48xlarge")
    rec.add_argument("--model-size", required=True, help="checkpoint size, e.g. 700GB or 65GiB")
    rec.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    rec.add_argument("--concurrency", type=int, help="force the Run:ai streamer's concurrency")
    rec.add_argument("--format", choices=["env", "vllm", "k8s", "helm", "kserve", "json"], default="env")
    rec.add_argument("--model", help="model URI for the vllm and k8s formats")
    rec.add_argument(
        "--image", help="k8s: the vLLM image with weightstream in it (deploy/Dockerfile builds one)"
    )
    rec.add_argument(
        "--name", default="vllm", help="k8s: the name of the Deployment and Service (default vllm)"
    )
    rec.add_argument(
        "--service-account",
        help="k8s: the pod's service account (the cloud's workload identity: IRSA, GKE or Azure)",
    )
    rec.add_argument(
        "--credentials-secret",
        help="k8s: a Secret whose keys (AWS_ACCESS_KEY_ID, ...) become the pod's environment",
    )
    rec.add_argument(
        "--output", metavar="DIR", help="k8s: write one file per object into DIR (default: stdout)"
    )
    rec.add_argument(
        "--prefill-tp", type=int, help="disaggregated prefill and decode: the prefill engines' TP"
    )
    rec.add_argument("--decode-tp", type=int, help="disaggregated prefill and decode: the decode engines' TP")
    rec.add_argument(
        "--gpus-per-node", type=int, help="k8s: GPUs a node has (default: the instance table's; else --tp)"
    )
    rec.add_argument(
        "--probe", metavar="URI", help="measure this checkpoint's storage when the instance is unknown"
    )
    rec.add_argument("--probe-bytes", default="2GiB", help="bytes the probe may read (default 2GiB)")
    rec.set_defaults(
        func=cmd_recommend, chunk_size=None, memory_limit=None, direct_io=None, io_timeout=None, profile=None
    )


def cmd_recommend(args: argparse.Namespace) -> int:
    from weightstream.tools.recommend import parse_model_size, recommend, render

    probe_gbps = None
    if args.probe:
        from weightstream.tools.probe import probe

        config = StreamConfig.from_env()
        ckpt = open_checkpoint(args.probe, config=config)
        points = probe(
            ckpt, config=config, max_bytes=parse_size(args.probe_bytes, name="--probe-bytes"), max_seconds=20
        )
        probe_gbps = max(p.gb_per_s for p in points) * 8
    if (args.prefill_tp is None) != (args.decode_tp is None):
        raise ConfigError("--prefill-tp and --decode-tp go together (one TP degree per role)", setting="tp")

    def one(tp: int) -> Any:
        return recommend(
            model_bytes=parse_model_size(args.model_size),
            instance=args.instance,
            tp=tp,
            probe_gbps=probe_gbps,
            concurrency=args.concurrency,
        )

    # One recommendation, or one per role from the same shared values.
    roles = {"prefill": one(args.prefill_tp), "decode": one(args.decode_tp)} if args.prefill_tp else {}
    rec = roles["prefill"] if roles else one(args.tp)
    if args.format not in ("k8s", "helm", "kserve"):
        if args.output:
            raise ConfigError(
                "--output writes Kubernetes objects: use it with --format k8s, helm or kserve",
                setting="output",
            )
        for role, each in roles.items() or [(None, rec)]:
            if role:
                print(f"# {role} engines (TP {each.tp})")
            print(render(each, args.format, model=args.model or "MODEL_URI"))
        return 0
    from weightstream.tools.manifests import (
        DEFAULT_IMAGE,
        Deploy,
        disaggregated,
        helm_values,
        k8s_objects,
        kserve_objects,
        to_yaml,
    )

    if not args.model:
        raise ConfigError(
            f"--format {args.format} needs --model (the model's URI, e.g. s3://bucket/model/)",
            setting="model",
        )
    deploy = Deploy(
        model=args.model,
        image=args.image or DEFAULT_IMAGE,
        name=args.name,
        service_account=args.service_account,
        credentials_secret=args.credentials_secret,
        gpus_per_node=args.gpus_per_node,
    )
    if args.format == "helm":
        objects = [helm_values(roles or {"": rec}, deploy)]
    elif args.format == "kserve":
        objects = kserve_objects(roles or {"": rec}, deploy)
    else:
        objects = disaggregated(roles, deploy) if roles else k8s_objects(rec, deploy)
    notes = "".join(f"# {n}\n" for n in rec.notes)
    if not args.output:
        print(notes + to_yaml(objects), end="")
        return 0
    os.makedirs(args.output, exist_ok=True)
    for obj in objects:
        named = f"{obj['kind'].lower()}-{obj['metadata']['name']}" if "kind" in obj else "values-vllm-stack"
        path = os.path.join(args.output, f"{named}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(notes + to_yaml([obj]))
        print(path)
    return 0
