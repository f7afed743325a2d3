"""Kubernetes objects that apply as they are, rendered from one :class:`Recommendation`.

``weightstream recommend --format k8s`` prints (or ``--output DIR`` writes, one file per object)
a Deployment of vLLM with weightstream's load format, or a LeaderWorkerSet when the
tensor-parallel degree spans nodes, and a Service in front of it:

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
import shlex
from dataclasses import dataclass
from typing import Any

from weightstream.errors import ConfigError
from weightstream.tools.recommend import CONFIG_DIR as _ANY_FOLDER
from weightstream.tools.recommend import Recommendation, instances, vllm_arguments

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
PROGRESS_FILE = "/tmp/weightstream-progress.json"
"""Where each vLLM rank writes its load's progress (:mod:`weightstream.progress`):
``kubectl exec deploy/NAME -- weightstream load-status /tmp/weightstream-progress.json``."""
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


@dataclass(frozen=True)
class Deploy:
    """What every workload of a deployment shares, whatever its role: the model, the image, the
    names, how the pods get credentials, the node's GPUs."""

    model: str
    """An object-store URI (its config pulled by an init container), or a path the image holds."""
    image: str = DEFAULT_IMAGE
    name: str = "vllm"
    service_account: str | None = None
    credentials_secret: str | None = None
    gpus_per_node: int | None = None
    """GPUs a node has: the instance table's unless given."""

    def named(self, role: str | None) -> tuple[str, dict[str, str]]:
        """The name of a role's objects (``NAME-role``, or ``NAME``) and their labels."""
        full = f"{self.name}-{role}" if role else self.name
        labels = {"app.kubernetes.io/name": full, "app.kubernetes.io/component": "vllm"}
        if role:
            labels["weightstream.io/role"] = role
        return full, labels

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigError(
                "--name must be a Kubernetes name (lower-case letters, digits and '-', at most 52), "
                f"got {self.name!r}",
                setting="name",
            )


def k8s_objects(
    rec: Recommendation,
    deploy: Deploy,
    *,
    role: str | None = None,
    vllm_args: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The objects that serve ``model`` (an object-store URI, or a path the image holds) with
    weightstream's load format and the recommendation's settings: a Deployment when the
    tensor-parallel degree fits one node, else a LeaderWorkerSet of ``tp / gpus_per_node`` pods
    (vLLM over Ray, as the LeaderWorkerSet project's vLLM example runs it), and a Service.
    ``gpus_per_node``: the instance table's, unless given. ``role``: a label and a name suffix
    (disaggregated prefill and decode: :func:`disaggregated`). ``vllm_args``: more arguments for
    ``vllm serve``."""
    gpus = deploy.gpus_per_node or _gpus_of(rec)
    if rec.tp > gpus and rec.tp % gpus:
        raise ConfigError(
            f"--tp {rec.tp} over nodes of {gpus} GPUs: the degree must be a multiple of the GPUs a node has",
            setting="tp",
        )
    nodes = max(1, rec.tp // gpus) if rec.tp > gpus else 1
    full, labels = deploy.named(role)
    pods = _Pods(rec, deploy, min(rec.tp, gpus))
    serve = ["vllm", "serve", pods.served, *pods.ws_args, *vllm_args, "--port", str(PORT)]
    annotations = {
        "weightstream.io/model-bytes": str(rec.model_bytes),
        "weightstream.io/network-gbps": f"{rec.network_gbps:g}",
        "weightstream.io/startup-budget-seconds": str(startup_budget_s(rec)),
    }
    if nodes == 1:
        workload: dict[str, Any] = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": full, "labels": labels, "annotations": annotations},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                # one GPU node per pod: a rolling update would need a second node's GPUs
                "strategy": {"type": "Recreate"},
                "template": {"metadata": {"labels": labels}, "spec": pods.pod(serve, probes=True)},
            },
        }
        selector = labels
    else:
        # The leader starts Ray's head and then vLLM over the group (the image's own script,
        # as in the LeaderWorkerSet project's vLLM example); each worker joins the head. Every
        # pod pulls the config: vLLM's workers read it on their own node.
        script = "/vllm-workspace/examples/online_serving/multi-node-serving.sh"
        leader = (
            f"bash {script} leader --ray_cluster_size=$(LWS_GROUP_SIZE) && "
            f"exec {shlex.join([*serve, '--distributed-executor-backend', 'ray'])}"
        )
        worker = f"exec bash {script} worker --ray_address=$(LWS_LEADER_ADDRESS)"
        leader_labels = {**labels, "weightstream.io/pod": "leader"}
        workload = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": full, "labels": labels, "annotations": annotations},
            "spec": {
                "replicas": 1,
                "leaderWorkerTemplate": {
                    "size": nodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": {
                        "metadata": {"labels": leader_labels},
                        "spec": pods.pod(["sh", "-c", leader], probes=True),
                    },
                    "workerTemplate": {
                        "metadata": {"labels": labels},
                        "spec": pods.pod(["sh", "-c", worker], probes=False),
                    },
                },
            },
        }
        selector = {"leaderworkerset.sigs.k8s.io/name": full, "weightstream.io/pod": "leader"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": full, "labels": labels},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": PORT, "targetPort": PORT}]},
    }
    return [workload, service]


KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
"""How the prefill and decode engines of a disaggregated deployment hand over the KV cache
(vLLM's NIXL connector, both roles ``kv_both`` as vLLM documents it)."""
_KV_ARGS = ("--kv-transfer-config", json.dumps(KV_TRANSFER, separators=(",", ":")))


def disaggregated(roles: dict[str, Recommendation], deploy: Deploy) -> list[dict[str, Any]]:
    """Disaggregated prefill and decode: one workload and Service per role (``{"prefill": rec,
    "decode": rec}``), each with its own recommendation (its tensor-parallel degree, so
    ``distributed`` only where that role's TP > 1, its concurrency and memory), all from the
    same shared values (``deploy``), so the roles cannot drift apart; every engine gets the
    KV-transfer connector (:data:`KV_TRANSFER`). The router that sends a request to a prefill
    engine and then to a decode engine (llm-d, the production stack's router) is not rendered."""
    return [
        obj for role, rec in roles.items() for obj in k8s_objects(rec, deploy, role=role, vllm_args=_KV_ARGS)
    ]


def helm_values(roles: dict[str, Recommendation], deploy: Deploy) -> dict[str, Any]:
    """Values for the vLLM production stack's Helm chart (``vllm-stack``): one
    ``servingEngineSpec.modelSpec`` entry per role (``{"": rec}`` for a single engine), with the
    same vLLM arguments, environment, config pull and credentials as :func:`k8s_objects`, and the
    chart's startup probe given the largest role's budget (the chart has one probe for all). A
    degree beyond one node is refused: the chart runs multi-node engines through KubeRay, which
    these values do not configure (use the LeaderWorkerSet of ``--format k8s``)."""
    specs = []
    for role, rec in roles.items():
        pods = _one_node(rec, deploy, "helm")
        ws_args = pods.ws_args
        tp_at = (
            ws_args.index("--tensor-parallel-size") if "--tensor-parallel-size" in ws_args else len(ws_args)
        )
        extra = ws_args[:tp_at]  # the chart writes --tensor-parallel-size from tensorParallelSize
        if role:
            extra += list(_KV_ARGS)
        image = deploy.image
        repository, _, tag = (
            image.rpartition(":") if ":" in image.rpartition("/")[2] else (image, "", "latest")
        )
        spec: dict[str, Any] = {
            "name": deploy.named(role)[0],
            "repository": repository,
            "tag": tag,
            "modelURL": pods.served,
            "replicaCount": 1,
            "requestGPU": rec.tp,
            "env": pods.env,
            "vllmConfig": {"extraArgs": extra, **({"tensorParallelSize": rec.tp} if rec.tp > 1 else {})},
        }
        if pods.remote:
            pull = pods.pull()
            pull["extraVolumeMounts"] = pull.pop("volumeMounts")  # the chart's name for them
            pull.pop("envFrom", None)  # the chart gives it envFromSecret's
            spec["initContainer"] = pull
            spec["extraVolumes"] = [{"name": "model-config", "emptyDir": {}}]
            spec["extraVolumeMounts"] = [_CONFIG_MOUNT]
        if deploy.service_account:
            spec["serviceAccountName"] = deploy.service_account
        if deploy.credentials_secret:
            spec["envFromSecret"] = {"name": deploy.credentials_secret}
        if rec.instance and rec.bandwidth_from == "table":
            spec["nodeSelectorTerms"] = [
                {
                    "matchExpressions": [
                        {
                            "key": "node.kubernetes.io/instance-type",
                            "operator": "In",
                            "values": [rec.instance],
                        }
                    ]
                }
            ]
        specs.append(spec)
    budget = max(startup_budget_s(rec) for rec in roles.values())
    probe = {
        "initialDelaySeconds": 0,
        "periodSeconds": _PROBE_PERIOD_S,
        "failureThreshold": math.ceil(budget / _PROBE_PERIOD_S),
        "httpGet": {"path": "/health", "port": PORT},
    }
    return {"servingEngineSpec": {"containerPort": PORT, "startupProbe": probe, "modelSpec": specs}}


def kserve_objects(roles: dict[str, Recommendation], deploy: Deploy) -> list[dict[str, Any]]:
    """KServe ``InferenceService`` objects (raw deployment mode), one per engine or role
    (``{"": rec}`` for one): the predictor is the same pod as :func:`k8s_objects`' (the config
    pull, the loader's settings, GPUs, ``/dev/shm``, credentials, the startup budget) with
    vLLM as KServe's custom container. A degree beyond one node is refused (use the
    LeaderWorkerSet of ``--format k8s``)."""
    out = []
    for role, rec in roles.items():
        pods = _one_node(rec, deploy, "kserve")
        more = _KV_ARGS if role else ()
        predictor = pods.pod(
            ["vllm", "serve", pods.served, *pods.ws_args, *more, "--port", str(PORT)], probes=True
        )
        (container,) = predictor["containers"]
        container["name"] = "kserve-container"  # KServe's name for a custom predictor's container
        container["ports"] = [{"name": "http1", "containerPort": PORT, "protocol": "TCP"}]
        full, labels = deploy.named(role)
        out.append(
            {
                "apiVersion": "serving.kserve.io/v1beta1",
                "kind": "InferenceService",
                "metadata": {
                    "name": full,
                    "labels": labels,
                    "annotations": {
                        "serving.kserve.io/deploymentMode": "RawDeployment",
                        "weightstream.io/startup-budget-seconds": str(startup_budget_s(rec)),
                    },
                },
                "spec": {"predictor": {"minReplicas": 1, "maxReplicas": 1, **predictor}},
            }
        )
    return out


def _one_node(rec: Recommendation, deploy: Deploy, fmt: str) -> _Pods:
    """The pods of an engine that must fit one node (the Helm values, KServe), or a
    :class:`ConfigError` pointing to the LeaderWorkerSet of ``--format k8s``."""
    gpus = deploy.gpus_per_node or _gpus_of(rec)
    if rec.tp > gpus:
        raise ConfigError(
            f"--format {fmt}: TP {rec.tp} spans nodes of {gpus} GPUs; use --format k8s (a LeaderWorkerSet)",
            setting="tp",
        )
    return _Pods(rec, deploy, rec.tp)


def _gpus_of(rec: Recommendation) -> int:
    """GPUs a node has: the instance table's, else enough for the whole degree on one node."""
    row = instances().get(rec.instance or "")
    return row.gpus if row is not None else rec.tp


_CONFIG_MOUNT = {"name": "model-config", "mountPath": CONFIG_DIR}


class _Pods:
    """What every pod of one workload shares: vLLM's arguments, the config pulled by an init
    container, the loader's settings, GPUs, ``/dev/shm``, credentials, the node selector."""

    def __init__(self, rec: Recommendation, deploy: Deploy, gpus: int) -> None:
        self.rec, self.deploy, self.gpus = rec, deploy, gpus
        served, self.ws_args, _ = vllm_arguments(rec, deploy.model)
        self.remote = served == _ANY_FOLDER
        self.served = CONFIG_DIR if self.remote else served
        self.env = [{"name": k, "value": v} for k, v in rec.weightstream_env.items()]
        self.env.append({"name": "WEIGHTSTREAM_PROGRESS_FILE", "value": PROGRESS_FILE})
        secret = deploy.credentials_secret
        self.env_from = [{"secretRef": {"name": secret}}] if secret else []

    def pull(self) -> dict[str, Any]:
        """The init container that pulls the model's config and tokenizer."""
        pull: dict[str, Any] = {
            "name": "pull-config",
            "image": self.deploy.image,
            "command": ["weightstream", "pull-config", self.deploy.model, CONFIG_DIR],
            "env": self.env,
            "volumeMounts": [_CONFIG_MOUNT],
        }
        if self.env_from:
            pull["envFrom"] = self.env_from
        return pull

    def pod(self, command: list[str], *, probes: bool) -> dict[str, Any]:
        mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
        volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        pod: dict[str, Any] = {}
        if self.remote:
            mounts.append(_CONFIG_MOUNT)
            volumes.append({"name": "model-config", "emptyDir": {}})
            pod["initContainers"] = [self.pull()]
        container: dict[str, Any] = {
            "name": "vllm",
            "image": self.deploy.image,
            "command": command,
            "env": self.env,
            "resources": {
                "limits": {"nvidia.com/gpu": self.gpus},
                "requests": {"nvidia.com/gpu": self.gpus},
            },
            "volumeMounts": mounts,
        }
        if probes:  # the pod that serves (a worker of a group runs Ray, no server)
            container["ports"] = [{"name": "http", "containerPort": PORT}]
            # vLLM answers /health once its engine is up, weights loaded: until then the
            # startup probe fails, and the pod is restarted only past the budget.
            health = {"httpGet": {"path": "/health", "port": PORT}}
            container["startupProbe"] = {
                **health,
                "periodSeconds": _PROBE_PERIOD_S,
                "failureThreshold": math.ceil(startup_budget_s(self.rec) / _PROBE_PERIOD_S),
            }
            container["readinessProbe"] = {**health, "periodSeconds": _PROBE_PERIOD_S}
            container["livenessProbe"] = {**health, "periodSeconds": 30, "failureThreshold": 3}
        if self.env_from:
            container["envFrom"] = self.env_from
        pod["containers"] = [container]
        pod["volumes"] = volumes
        if self.deploy.service_account:
            pod["serviceAccountName"] = self.deploy.service_account
        if self.rec.instance and self.rec.bandwidth_from == "table":
            pod["nodeSelector"] = {"node.kubernetes.io/instance-type": self.rec.instance}
        return pod


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
