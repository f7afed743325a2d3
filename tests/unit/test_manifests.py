"""`weightstream recommend --format k8s`: whole objects that apply as they are (issue 23).

Validated offline against the Kubernetes API's own schemas (``kubernetes-validate``, strict: an
unknown field fails), parsed back from the YAML we print, and checked for the rules that must
hold in every one: no placeholder left, the loader's settings those of ``--format env``,
``distributed`` only at TP > 1, the startup budget from the load time.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from weightstream.cli.main import main
from weightstream.errors import ConfigError
from weightstream.tools.manifests import (
    ENGINE_START_S,
    PROGRESS_FILE,
    Deploy,
    k8s_objects,
    startup_budget_s,
    to_yaml,
)
from weightstream.tools.recommend import parse_model_size, recommend

CASES = {
    "g6.2xlarge, TP 1, 16 GB": ("g6.2xlarge", "16GB", 1),
    "p5.48xlarge, TP 8, 700 GB": ("p5.48xlarge", "700GB", 8),
    "unknown instance, TP 2, 65 GiB": ("x9.huge", "65GiB", 2),
}


ROLE_CASES = pytest.mark.parametrize(
    "roles",
    [{"": 1}, {"": 8}, {"prefill": 4, "decode": 8}],
    ids=["TP 1", "TP 8", "prefill TP 4, decode TP 8"],
)
"""One engine at TP 1 or 8, and a disaggregated pair: p5.48xlarge, 700 GB."""


def on_p5(roles: dict[str, int]) -> dict[str, Any]:
    size = parse_model_size("700GB")
    return {role: recommend(instance="p5.48xlarge", model_bytes=size, tp=tp) for role, tp in roles.items()}


def validate_as_pod(pod_spec: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
    """Pod fields (a template's, a predictor's) against the core Pod schema, strict."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **(metadata or {})}, "spec": pod_spec}
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def objects_for(case: str, **kwargs: Any) -> tuple[Any, list[dict[str, Any]]]:
    instance, size, tp = CASES[case]
    rec = recommend(instance=instance, model_bytes=parse_model_size(size), tp=tp)
    return rec, k8s_objects(rec, Deploy(model="s3://models/m/", image="registry.example/vllm-ws:1", **kwargs))


def pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("credentials", ["none", "secret", "service account"])
def test_every_object_passes_the_kubernetes_schema_and_reads_back_from_its_yaml(
    case: str, credentials: str
) -> None:
    kwargs = {"secret": {"credentials_secret": "s3-keys"}, "service account": {"service_account": "loader"}}
    _, objects = objects_for(case, **kwargs.get(credentials, {}))
    assert [o["kind"] for o in objects] == ["Deployment", "Service"]
    version = kubernetes_validate.latest_version()
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any error
    assert list(yaml.safe_load_all(to_yaml(objects))) == objects


def test_a_wrong_object_fails_the_same_validation() -> None:
    """The check above can fail: a misspelt field is refused."""
    _, objects = objects_for("g6.2xlarge, TP 1, 16 GB")
    pod(objects)["containers"][0]["startupProbes"] = pod(objects)["containers"][0].pop("startupProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(objects[0], kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("case", CASES)
def test_the_loader_gets_the_settings_of_the_environment_and_nothing_is_left_to_edit(case: str) -> None:
    from weightstream.config import StreamConfig
    from weightstream.integrations.vllm import config_from_extra

    rec, objects = objects_for(case)
    text = to_yaml(objects)
    for placeholder in ("MODEL_URI", "CONFIG_DIR", "<", "TODO", "CHANGEME"):
        assert placeholder not in text, placeholder
    (init,) = pod(objects)["initContainers"]
    (vllm,) = pod(objects)["containers"]
    assert init["command"] == ["weightstream", "pull-config", "s3://models/m/", "/model-config"]
    command = vllm["command"]
    assert command[:3] == ["vllm", "serve", "/model-config"]
    assert command[command.index("--load-format") + 1] == "weightstream"
    extra = json.loads(command[command.index("--model-loader-extra-config") + 1])
    assert extra.pop("weights") == "s3://models/m/"
    assert ("distributed" in extra) == (rec.tp > 1)  # the seed's rule: distributed only at TP > 1
    assert ("--tensor-parallel-size" in command) == (rec.tp > 1)
    from_extra, _ = config_from_extra(extra, env={})
    env = {e["name"]: e["value"] for e in vllm["env"]}
    assert env.pop("WEIGHTSTREAM_PROGRESS_FILE") == PROGRESS_FILE  # each rank's, for load-status
    assert env == rec.weightstream_env and from_extra == StreamConfig.from_env(env)
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == rec.tp
    volumes = {v["name"]: v for v in pod(objects)["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}  # tensor parallelism's shared memory
    assert {"name": "dshm", "mountPath": "/dev/shm"} in vllm["volumeMounts"]


def test_the_startup_probe_budget_follows_the_load_time() -> None:
    rec, objects = objects_for("p5.48xlarge, TP 8, 700 GB")
    probe = pod(objects)["containers"][0]["startupProbe"]
    budget = startup_budget_s(rec)
    assert probe["periodSeconds"] * probe["failureThreshold"] >= budget
    # a p5 gets about 400 Gbit/s from S3 (its 3,200 is the EFA fabric): 700 GB is 14 s, three times
    assert budget == ENGINE_START_S + 42
    bigger = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("1400GB"), tp=8)
    assert startup_budget_s(bigger) == ENGINE_START_S + 84
    # an "up to" (burst) figure counts a quarter: 16 GB at 10 Gbit/s is 12.8 s, x 4 x 3
    small = recommend(instance="g6.2xlarge", model_bytes=parse_model_size("16GB"), tp=1)
    assert startup_budget_s(small) == ENGINE_START_S + 154
    assert pod(objects)["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}


def test_credentials_are_referenced_never_written() -> None:
    _, with_secret = objects_for("g6.2xlarge, TP 1, 16 GB", credentials_secret="s3-keys")
    for container in [*pod(with_secret)["initContainers"], *pod(with_secret)["containers"]]:
        assert container["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]
        assert not [e for e in container["env"] if "SECRET" in e["name"] or "KEY" in e["name"]]
    _, with_account = objects_for("g6.2xlarge, TP 1, 16 GB", service_account="loader")
    assert pod(with_account)["serviceAccountName"] == "loader"
    assert "envFrom" not in pod(with_account)["containers"][0]


def test_the_command_writes_one_file_per_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "manifests"
    argv = ["recommend", "--instance", "p5.48xlarge", "--model-size", "700GB", "--tp", "8", "--format", "k8s"]
    assert main([*argv, "--model", "s3://models/kimi/", "--name", "kimi", "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["deployment-kimi.yaml", "service-kimi.yaml"]
    for path in out.iterdir():
        (obj,) = yaml.safe_load_all(path.read_text())
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert obj["metadata"]["name"] == "kimi"
    capsys.readouterr()
    assert main([*argv, "--model", "s3://models/kimi/"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [o["kind"] for o in printed] == ["Deployment", "Service"]


def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="name"):
        Deploy(model="s3://m/", name="Not_A_Name")
    argv = ["recommend", "--instance", "g6.2xlarge", "--model-size", "16GB", "--format", "k8s"]
    assert main(argv) != 0  # no --model
    assert main([*argv[:-1], "env", "--output", str(tmp_path / "x")]) != 0  # --output is for k8s
    assert not (tmp_path / "x").exists()


@functools.cache
def crd_schema(name: str) -> dict[str, Any]:
    """A custom resource's published schema (``tests/data/crds``: its source and licence inside)."""
    import gzip

    path = Path(__file__).resolve().parents[1] / "data" / "crds" / f"{name}.json.gz"
    return dict(json.loads(gzip.decompress(path.read_bytes()))["openAPIV3Schema"])


@functools.cache
def schema_validator(name: str) -> Any:
    """A validator of a schema in ``tests/data/crds``, the schema itself checked against its
    meta-schema once (what ``jsonschema.validate`` redoes at every call: 4-7 s for KServe's)."""
    import jsonschema

    schema = crd_schema(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the schema does not name: what the API server drops (or, with strict field
    validation, refuses) from a custom resource."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, list):
        return [
            f for i, v in enumerate(value) for f in unknown_fields(v, schema.get("items", {}), f"{path}[{i}]")
        ]
    if not isinstance(value, dict):
        return []
    props = schema.get("properties")
    if props is None:
        more = schema.get("additionalProperties")
        return (
            [f for k, v in value.items() for f in unknown_fields(v, more, f"{path}.{k}")]
            if isinstance(more, dict)
            else []
        )
    out = [f"{path}.{k}" for k in value if k not in props]
    return out + [
        f for k, v in value.items() if k in props for f in unknown_fields(v, props[k], f"{path}.{k}")
    ]


def validate_leaderworkerset(obj: dict[str, Any]) -> None:
    """The LeaderWorkerSet against its CRD's schema (jsonschema, and no field it does not know),
    and each pod template against the core Pod schema (strict)."""
    schema = crd_schema("leaderworkerset-v1")
    schema_validator("leaderworkerset-v1").validate(obj)
    assert unknown_fields(obj, schema) == []
    template = obj["spec"]["leaderWorkerTemplate"]
    for which in ("leaderTemplate", "workerTemplate"):
        validate_as_pod(template[which]["spec"], template[which]["metadata"])


def test_a_degree_beyond_one_node_is_a_leaderworkerset_that_passes_its_schema() -> None:
    rec = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), tp=16)
    objects = k8s_objects(rec, Deploy(model="s3://models/kimi/", image="registry.example/vllm-ws:1"))
    assert [o["kind"] for o in objects] == ["LeaderWorkerSet", "Service"]
    lws, service = objects
    validate_leaderworkerset(lws)
    kubernetes_validate.validate(service, kubernetes_validate.latest_version(), strict=True)
    assert list(yaml.safe_load_all(to_yaml(objects))) == objects
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2  # 16 GPUs over nodes of 8
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    for template in (leader, worker):
        (vllm,) = template["spec"]["containers"]
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 8
        (init,) = template["spec"]["initContainers"]  # every node's workers read the config
        assert init["command"] == ["weightstream", "pull-config", "s3://models/kimi/", "/model-config"]
    lead = leader["spec"]["containers"][0]
    assert "startupProbe" in lead and "startupProbe" not in worker["spec"]["containers"][0]
    script = lead["command"][2]
    serve = shlex.split(script.partition("&& exec ")[2])
    assert serve[:3] == ["vllm", "serve", "/model-config"]
    assert serve[serve.index("--tensor-parallel-size") + 1] == "16"
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    extra = json.loads(serve[serve.index("--model-loader-extra-config") + 1])
    assert extra["distributed"] is True and extra["weights"] == "s3://models/kimi/"
    # the Service reaches the leader, which serves (LWS labels each pod with the set's name)
    assert service["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": "vllm",
        "weightstream.io/pod": "leader",
    }
    assert leader["metadata"]["labels"]["weightstream.io/pod"] == "leader"


def test_the_schema_checks_can_fail() -> None:
    rec = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), tp=16)
    lws, _ = k8s_objects(rec, Deploy(model="s3://models/kimi/"))
    lws["spec"]["leaderWorkerTemplate"]["sizes"] = lws["spec"]["leaderWorkerTemplate"].pop("size")
    with pytest.raises(AssertionError):
        validate_leaderworkerset(lws)
    with pytest.raises(ConfigError, match="multiple"):
        k8s_objects(recommend(instance="p5.48xlarge", model_bytes=1, tp=12), Deploy(model="s3://m/"))


def test_the_gcp_rows_place_eight_gpus_a_node() -> None:
    """A GCP A3 Ultra at TP 16 is two nodes of eight, like a p5 (the table's rows drive it)."""
    rec = recommend(instance="a3-ultragpu-8g", model_bytes=parse_model_size("700GB"), tp=16)
    lws, _ = k8s_objects(rec, Deploy(model="gs://models/kimi/"))
    assert lws["kind"] == "LeaderWorkerSet" and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    validate_leaderworkerset(lws)


def test_disaggregated_prefill_and_decode_are_one_workload_each_from_shared_values() -> None:
    from weightstream.config import StreamConfig
    from weightstream.tools.manifests import KV_TRANSFER, disaggregated

    size = parse_model_size("700GB")
    roles = {
        "prefill": recommend(instance="p5.48xlarge", model_bytes=size, tp=1),
        "decode": recommend(instance="p5.48xlarge", model_bytes=size, tp=8),
    }
    objects = disaggregated(
        roles, Deploy(model="s3://models/kimi/", image="registry.example/vllm-ws:1", service_account="sa")
    )
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Deployment", "vllm-prefill"),
        ("Service", "vllm-prefill"),
        ("Deployment", "vllm-decode"),
        ("Service", "vllm-decode"),
    ]
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    services = [o for o in objects if o["kind"] == "Service"]
    assert services[0]["spec"]["selector"] != services[1]["spec"]["selector"]  # each reaches its role only
    for deployment, role in zip([o for o in objects if o["kind"] == "Deployment"], roles, strict=True):
        rec = roles[role]
        spec = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["template"]["metadata"]["labels"]["weightstream.io/role"] == role
        assert spec["serviceAccountName"] == "sa"  # shared values, alike in both
        (vllm,) = spec["containers"]
        command = vllm["command"]
        assert json.loads(command[command.index("--kv-transfer-config") + 1]) == KV_TRANSFER
        extra = json.loads(command[command.index("--model-loader-extra-config") + 1])
        assert ("distributed" in extra) == (rec.tp > 1)  # only where that role's TP > 1
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == rec.tp
        env = {e["name"]: e["value"] for e in vllm["env"]}
        assert env.pop("WEIGHTSTREAM_PROGRESS_FILE") == PROGRESS_FILE
        assert env == rec.weightstream_env and StreamConfig.from_env(env).memory_limit > 0


def test_the_command_renders_each_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["recommend", "--instance", "p5.48xlarge", "--model-size", "700GB"]
    roles = ["--prefill-tp", "4", "--decode-tp", "8"]
    assert main([*argv, *roles, "--format", "k8s", "--model", "s3://m/k/", "--output", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "deployment-vllm-decode.yaml",
        "deployment-vllm-prefill.yaml",
        "service-vllm-decode.yaml",
        "service-vllm-prefill.yaml",
    ]
    capsys.readouterr()
    assert main([*argv, *roles, "--format", "env"]) == 0
    out = capsys.readouterr().out
    assert "# prefill engines (TP 4)" in out and "# decode engines (TP 8)" in out
    assert main([*argv, "--prefill-tp", "4", "--format", "env"]) != 0  # a role alone is refused


def validate_stack_values(values: dict[str, Any]) -> None:
    """Values for the vLLM production stack's chart against the chart's own values schema (what
    ``helm template`` checks first; no field it does not name), and the Kubernetes structures in
    them (env, volumes, mounts, the init container) against the core Pod schema."""
    import gzip

    import jsonschema

    path = Path(__file__).resolve().parents[1] / "data" / "crds" / "vllm-stack-0.1.12-values.schema.json.gz"
    schema = json.loads(gzip.decompress(path.read_bytes()))["schema"]
    jsonschema.validate(values, schema)
    assert unknown_fields(values, schema) == []
    for spec in values["servingEngineSpec"]["modelSpec"]:
        vllm = {
            "name": "vllm",
            "image": "x",
            "env": spec["env"],
            "volumeMounts": spec.get("extraVolumeMounts", []),
        }
        pod_spec: dict[str, Any] = {"containers": [vllm], "volumes": spec.get("extraVolumes", [])}
        if "initContainer" in spec:
            init = dict(spec["initContainer"])
            init["volumeMounts"] = init.pop("extraVolumeMounts")
            pod_spec["initContainers"] = [init]
        if "nodeSelectorTerms" in spec:
            pod_spec["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": spec["nodeSelectorTerms"]
                    }
                }
            }
        validate_as_pod(pod_spec)


@ROLE_CASES
def test_production_stack_values_pass_the_charts_schema(roles: dict[str, int]) -> None:
    from weightstream.tools.manifests import helm_values

    recs = on_p5(roles)
    values = helm_values(
        recs, Deploy(model="s3://models/kimi/", image="reg.example/ws-vllm:0.32.0", credentials_secret="keys")
    )
    validate_stack_values(values)
    assert list(yaml.safe_load_all(to_yaml([values]))) == [values]
    specs = values["servingEngineSpec"]["modelSpec"]
    assert len(specs) == len(roles)
    for spec, rec in zip(specs, recs.values(), strict=True):
        assert (spec["repository"], spec["tag"], spec["modelURL"]) == (
            "reg.example/ws-vllm",
            "0.32.0",
            "/model-config",
        )
        assert spec["requestGPU"] == rec.tp and spec["envFromSecret"] == {"name": "keys"}
        assert spec["initContainer"]["command"] == [
            "weightstream",
            "pull-config",
            "s3://models/kimi/",
            "/model-config",
        ]
        args = spec["vllmConfig"]["extraArgs"]
        extra = json.loads(args[args.index("--model-loader-extra-config") + 1])
        assert ("distributed" in extra) == (rec.tp > 1) == ("tensorParallelSize" in spec["vllmConfig"])
        assert "--tensor-parallel-size" not in args  # the chart writes it from tensorParallelSize
    probe = values["servingEngineSpec"]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= max(
        startup_budget_s(r) for r in recs.values()
    )


def test_production_stack_values_refuse_a_degree_beyond_one_node() -> None:
    from weightstream.tools.manifests import helm_values

    rec = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), tp=16)
    with pytest.raises(ConfigError, match="LeaderWorkerSet"):
        helm_values({"": rec}, Deploy(model="s3://m/"))
    bad = helm_values({"": recommend(instance="g6.2xlarge", model_bytes=10**10)}, Deploy(model="s3://m/"))
    bad["servingEngineSpec"]["modelSpec"][0]["requestGPUs"] = 1  # a misspelt key: the check fails
    with pytest.raises(AssertionError):
        validate_stack_values(bad)


def test_an_azure_nd_h100_v5_budgets_for_its_ethernet_not_its_infiniband() -> None:
    """80 Gbit/s of Ethernet carries its storage traffic: 700 GB is 70 s of reading, three times."""
    rec = recommend(instance="Standard_ND96isr_H100_v5", model_bytes=parse_model_size("700GB"), tp=8)
    assert startup_budget_s(rec) == ENGINE_START_S + 210
    deployment, _ = k8s_objects(rec, Deploy(model="az://models/kimi/"))
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {
        "node.kubernetes.io/instance-type": "Standard_ND96isr_H100_v5"
    }


def validate_inferenceservice(obj: dict[str, Any]) -> None:
    """An InferenceService against KServe's published CRD schema (v0.20.0; no field it does not
    know), and its predictor's pod fields against the core Pod schema (strict)."""
    schema = crd_schema("inferenceservice-v1beta1")
    schema_validator("inferenceservice-v1beta1").validate(obj)
    assert unknown_fields(obj, schema) == []
    validate_as_pod(
        {k: v for k, v in obj["spec"]["predictor"].items() if k not in ("minReplicas", "maxReplicas")}
    )


@ROLE_CASES
def test_kserve_inference_services_pass_the_crd_schema(roles: dict[str, int]) -> None:
    from weightstream.tools.manifests import KV_TRANSFER, kserve_objects

    recs = on_p5(roles)
    objects = kserve_objects(recs, Deploy(model="s3://models/kimi/", service_account="sa"))
    assert len(objects) == len(roles)
    for obj, (role, rec) in zip(objects, recs.items(), strict=True):
        validate_inferenceservice(obj)
        predictor = obj["spec"]["predictor"]
        (container,) = predictor["containers"]
        assert container["name"] == "kserve-container" and predictor["serviceAccountName"] == "sa"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == rec.tp
        command = container["command"]
        extra = json.loads(command[command.index("--model-loader-extra-config") + 1])
        assert ("distributed" in extra) == (rec.tp > 1)
        assert ("--kv-transfer-config" in command) == bool(role)
        if role:
            assert json.loads(command[command.index("--kv-transfer-config") + 1]) == KV_TRANSFER
        (init,) = predictor["initContainers"]
        assert init["command"] == ["weightstream", "pull-config", "s3://models/kimi/", "/model-config"]
    assert list(yaml.safe_load_all(to_yaml(objects))) == objects
    broken = json.loads(json.dumps(objects[0]))
    broken["spec"]["predictor"]["minReplica"] = broken["spec"]["predictor"].pop("minReplicas")
    with pytest.raises(AssertionError):
        validate_inferenceservice(broken)
