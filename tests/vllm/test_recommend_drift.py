"""Deploy and export cannot drift (issue 23): the vLLM command that ``weightstream recommend``
renders, for ``--format vllm`` and inside the Kubernetes Deployment, parsed by vLLM's own
``vllm serve`` argument parser, configures a loader with exactly the settings that
``--format env`` gives through the environment."""

from __future__ import annotations

import os
import shlex
import warnings
from typing import Any

import pytest

from weightstream.config import StreamConfig
from weightstream.integrations.vllm import use_distributed
from weightstream.tools.manifests import Deploy, k8s_objects
from weightstream.tools.recommend import parse_model_size, recommend, render

with warnings.catch_warnings():  # vLLM's imports warn about torch APIs it uses (not ours to fix)
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

CASES = [
    ("g6.2xlarge", "16GB", 1),
    ("p5.48xlarge", "700GB", 8),
    ("p4d.24xlarge", "140GB", 4),
    ("p5.48xlarge", "700GB", 16),  # two nodes: a LeaderWorkerSet, vLLM started by a shell line
]


def loader_of(argv: list[str]) -> Any:
    """The loader vLLM builds from ``vllm serve ARGV``, by its own parser and loader registry
    (our plugin registered as vLLM registers plugins)."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    args = parser.parse_args(["serve", *argv])
    engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    assert engine_args.load_format == "weightstream"
    loader = get_model_loader(engine_args.create_load_config())
    assert type(loader).__name__ == "WeightStreamModelLoader"
    return engine_args, loader


@pytest.mark.parametrize(("instance", "size", "tp"), CASES)
def test_the_rendered_commands_configure_the_loader_as_the_environment_does(
    instance: str, size: str, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = recommend(instance=instance, model_bytes=parse_model_size(size), tp=tp)
    for key in [k for k in os.environ if k.startswith("WEIGHTSTREAM_")]:
        monkeypatch.delenv(key)  # the machine's own (AWS_CA_BUNDLE, ...) count for both
    from_env = StreamConfig.from_env({**os.environ, **rec.weightstream_env})
    model = "s3://models/m/"
    text = render(rec, "vllm", model=model)
    serve = next(
        line for line in text.splitlines() if line.startswith("vllm serve") and "weightstream" in line
    )
    (workload, _) = k8s_objects(rec, Deploy(model=model))
    if workload["kind"] == "Deployment":
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        command = container["command"]
    else:
        (container,) = workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
        command = shlex.split(container["command"][2].partition("&& exec ")[2])
    assert command[:2] == ["vllm", "serve"]
    for argv in (shlex.split(serve)[2:], command[2:]):
        engine_args, loader = loader_of(argv)
        assert loader.config == from_env
        # the reads split across the TP group exactly when TP > 1 (the seed's rule)
        assert use_distributed(loader.distributed, tp, initialized=True) is (tp > 1)
        assert loader.weights == model
        assert engine_args.tensor_parallel_size == tp


def test_each_role_of_a_disaggregated_pair_configures_its_own_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill TP 4 and decode TP 8: each role's command, parsed by vLLM, gets its own
    recommendation's settings and vLLM's KV-transfer connector (checked by vLLM's own config)."""
    from weightstream.tools.manifests import disaggregated

    for key in [k for k in os.environ if k.startswith("WEIGHTSTREAM_")]:
        monkeypatch.delenv(key)
    size = parse_model_size("700GB")
    roles = {
        "prefill": recommend(instance="p5.48xlarge", model_bytes=size, tp=4),
        "decode": recommend(instance="p5.48xlarge", model_bytes=size, tp=8),
    }
    deployments = [
        o for o in disaggregated(roles, Deploy(model="s3://models/m/")) if o["kind"] == "Deployment"
    ]
    for deployment, rec in zip(deployments, roles.values(), strict=True):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        engine_args, loader = loader_of(container["command"][2:])
        assert loader.config == StreamConfig.from_env({**os.environ, **rec.weightstream_env})
        assert engine_args.tensor_parallel_size == rec.tp
        assert engine_args.kv_transfer_config.kv_connector == "NixlConnector"
        assert engine_args.kv_transfer_config.kv_role == "kv_both"


@pytest.mark.parametrize("tp", [1, 8])
def test_the_production_stack_values_configure_the_loader_as_the_environment_does(
    tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arguments the vllm-stack chart (0.1.12, templates/deployment-vllm-multi.yaml) writes
    from our values, in its order, parsed by vLLM."""
    from weightstream.tools.manifests import helm_values

    for key in [k for k in os.environ if k.startswith("WEIGHTSTREAM_")]:
        monkeypatch.delenv(key)
    rec = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), tp=tp)
    (spec,) = helm_values({"": rec}, Deploy(model="s3://models/m/"))["servingEngineSpec"]["modelSpec"]
    config = spec["vllmConfig"]
    argv = [spec["modelURL"], "--host", "0.0.0.0", "--port", "8000", "--no-enable-prefix-caching"]
    if "tensorParallelSize" in config:
        argv += ["--tensor-parallel-size", str(config["tensorParallelSize"])]
    engine_args, loader = loader_of([*argv, *config["extraArgs"]])
    assert loader.config == StreamConfig.from_env({**os.environ, **rec.weightstream_env})
    assert engine_args.tensor_parallel_size == tp and loader.weights == "s3://models/m/"
    assert use_distributed(loader.distributed, tp, initialized=True) is (tp > 1)


def test_the_kserve_predictor_configures_the_loader_as_the_environment_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weightstream.tools.manifests import kserve_objects

    for key in [k for k in os.environ if k.startswith("WEIGHTSTREAM_")]:
        monkeypatch.delenv(key)
    rec = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), tp=8)
    (isvc,) = kserve_objects({"": rec}, Deploy(model="s3://models/m/"))
    (container,) = isvc["spec"]["predictor"]["containers"]
    assert container["command"][:2] == ["vllm", "serve"]
    engine_args, loader = loader_of(container["command"][2:])
    assert loader.config == StreamConfig.from_env({**os.environ, **rec.weightstream_env})
    assert engine_args.tensor_parallel_size == 8 and use_distributed(loader.distributed, 8, initialized=True)
