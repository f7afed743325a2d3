"""Kubernetes objects that apply as they are, rendered from one :class:`Recommendation`.

``weightstream recommend --format k8s`` prints (or ``--output DIR`` writes, one file per object)
a Deployment of vLLM with weightstream's load format and a Service in front of it:

* an init container runs ``weightstream pull-config MODEL_URI /model-config`` (the model's
  config and tokenizer, through the loads' own GET path and credentials; vLLM 0.32 takes an
  object-store model only with its own load formats), and vLLM serves that folder with the
  weights streamed from the URI (``"weights"`` in ``--model-loader-extra-config``);
* the loader's settings are the recommendation's, in the same spelling as ``--format vllm``
  (one source, so a deployment and an export cannot drift);
* GPUs from the tensor-parallel degree, a memory-backed ``/dev/shm`` (tensor parallelism's
  shared memory), the instance type as a node selector when it is known;
* credentials the cluster's way: the pod's service account (IRSA, GKE Workload Identity, Azure
  Workload Identity annotate it) or a Secret's keys as environment variables; never a secret in
  the manifest;
* a ``startupProbe`` whose budget comes from the expected load time at the instance's bandwidth
  (:func:`startup_budget_s`), so a large model is not killed while it loads and a stuck one is.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from weightstream.errors import ConfigError
from weightstream.tools.recommend import CONFIG_DIR as _ANY_FOLDER
from weightstream.tools.recommend import Recommendation, vllm_arguments

__all__ = [
    "DEFAULT_IMAGE",
    "ENGINE_START_S",
    "STORAGE_CEILING_GBPS",
    "k8s_objects",
    "startup_budget_s",
    "to_yaml",
]

DEFAULT_IMAGE = "weightstream-vllm:0.32.0"
"""The image ``deploy/Dockerfile`` builds: vLLM's own serving image with weightstream added
(``docker build -t weightstream-vllm:0.32.0 deploy/``, then push it where the cluster pulls)."""
ENGINE_START_S = 600
"""What a vLLM engine takes to start besides its weights (CUDA context, compilation, CUDA graphs,
the KV cache): the fixed part of the startup budget."""
PORT = 8000
CONFIG_DIR = "/model-config"
_PROBE_PERIOD_S = 10
_LOAD_MARGIN = 3.0
"""The expected load time times this: the link is shared, and the rate is a ceiling."""
STORAGE_CEILING_GBPS = 400.0
"""The most one instance receives from an object store (S3 to a p5: about 400 Gbit/s)."""
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?")


def startup_budget_s(rec: Recommendation) -> int:
    """Seconds a pod may take to start: the engine's fixed start (:data:`ENGINE_START_S`) plus
    three times the time to read the model at the rate storage can give the instance: its network
    bandwidth, at most :data:`STORAGE_CEILING_GBPS` (a p5's 3,200 Gbit/s is its EFA fabric, not
    what S3 sends it), a quarter of it for an "up to" (burst) figure."""
    gbps = min(rec.network_gbps, STORAGE_CEILING_GBPS)
    if rec.burst:
        gbps /= 4
    load_s = rec.model_bytes / (gbps * 1e9 / 8)
    return int(ENGINE_START_S + math.ceil(_LOAD_MARGIN * load_s))


def k8s_objects(
    rec: Recommendation,
    *,
    model: str,
    image: str = DEFAULT_IMAGE,
    name: str = "vllm",
    service_account: str | None = None,
    credentials_secret: str | None = None,
) -> list[dict[str, Any]]:
    """The Deployment and the Service of vLLM serving ``model`` (an object-store URI, or a path
    the image holds) with weightstream's load format and the recommendation's settings."""
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"--name must be a Kubernetes name (lower-case letters, digits and '-', at most 52), got {name!r}",
            setting="name",
        )
    served, ws_args, _ = vllm_arguments(rec, model)
    remote = served == _ANY_FOLDER
    if remote:
        served = CONFIG_DIR
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "vllm"}
    env = [{"name": k, "value": v} for k, v in rec.weightstream_env.items()]
    env_from = [{"secretRef": {"name": credentials_secret}}] if credentials_secret else []
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    init: list[dict[str, Any]] = []
    if remote:
        config_mount = {"name": "model-config", "mountPath": CONFIG_DIR}
        mounts.append(config_mount)
        volumes.append({"name": "model-config", "emptyDir": {}})
        pull: dict[str, Any] = {
            "name": "pull-config",
            "image": image,
            "command": ["weightstream", "pull-config", model, CONFIG_DIR],
            "env": env,
            "volumeMounts": [config_mount],
        }
        if env_from:
            pull["envFrom"] = env_from
        init.append(pull)
    health = {"httpGet": {"path": "/health", "port": PORT}}
    budget = startup_budget_s(rec)
    container: dict[str, Any] = {
        "name": "vllm",
        "image": image,
        "command": ["vllm", "serve", served, *ws_args, "--port", str(PORT)],
        "env": env,
        "ports": [{"name": "http", "containerPort": PORT}],
        "resources": {"limits": {"nvidia.com/gpu": rec.tp}, "requests": {"nvidia.com/gpu": rec.tp}},
        "volumeMounts": mounts,
        # vLLM answers /health once its engine is up, weights loaded: until then the startup
        # probe fails, and the pod is restarted only past the budget.
        "startupProbe": {
            **health,
            "periodSeconds": _PROBE_PERIOD_S,
            "failureThreshold": math.ceil(budget / _PROBE_PERIOD_S),
        },
        "readinessProbe": {**health, "periodSeconds": _PROBE_PERIOD_S},
        "livenessProbe": {**health, "periodSeconds": 30, "failureThreshold": 3},
    }
    if env_from:
        container["envFrom"] = env_from
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if init:
        pod["initContainers"] = init
    if service_account:
        pod["serviceAccountName"] = service_account
    if rec.instance and rec.bandwidth_from == "table":
        pod["nodeSelector"] = {"node.kubernetes.io/instance-type": rec.instance}
    annotations = {
        "weightstream.io/model-bytes": str(rec.model_bytes),
        "weightstream.io/network-gbps": f"{rec.network_gbps:g}",
        "weightstream.io/startup-budget-seconds": str(budget),
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            # one GPU node per pod: a rolling update would need a second node's GPUs
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": PORT, "targetPort": "http"}]},
    }
    return [deployment, service]


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as YAML documents. Every string is written double-quoted (JSON's escaping is
    YAML's), so no value can be read back as another type."""
    return "\n".join("---\n" + _yaml(obj, 0) for obj in objects)


def _yaml(value: Any, indent: int) -> str:
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return pad + "{}\n"
        out = []
        for k, v in value.items():
            if isinstance(v, dict | list) and v:
                out.append(f"{pad}{_key(k)}:\n{_yaml(v, indent + 1)}")
            else:
                out.append(f"{pad}{_key(k)}: {_scalar(v)}\n")
        return "".join(out)
    if isinstance(value, list):
        if not value:
            return pad + "[]\n"
        out = []
        for item in value:
            if isinstance(item, dict | list) and item:
                first, _, rest = _yaml(item, indent + 1).partition("\n")
                out.append(f"{pad}- {first.lstrip()}\n{rest}")
            else:
                out.append(f"{pad}- {_scalar(item)}\n")
        return "".join(out)
    return pad + _scalar(value) + "\n"


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _key(key: str) -> str:
    """A mapping key plain where YAML reads it back as that string, else quoted."""
    return key if _PLAIN_KEY.fullmatch(key) and key.lower() not in _YAML_WORDS else json.dumps(key)


def _scalar(value: Any) -> str:
    if isinstance(value, dict | list):
        return "{}" if isinstance(value, dict) else "[]"
    return json.dumps(value)
