"""The command line, run as a user runs it (a real subprocess of the installed entry point)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightstream.tools.sample import write_checkpoint

from ..conftest import free_port, write_raw


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("weightstream", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "weightstream.cli.main"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sample") / "ckpt"
    write_checkpoint(str(folder), total_bytes=24 << 20, shard_bytes=8 << 20)
    return folder


def test_inspect_json_matches_headers(sample: Path) -> None:
    out = cli("inspect", str(sample), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert len(info["shards"]) >= 3
    assert info["total_bytes"] == sum(t["bytes"] for t in info["tensors"])
    assert info["total_bytes"] == info["metadata"]["total_size"]
    assert {t["dtype"] for t in info["tensors"]} == {"BF16", "F32"}


def test_inspect_table(sample: Path) -> None:
    out = cli("inspect", str(sample))
    assert out.returncode == 0, out.stderr
    assert "model.embed_tokens.weight" in out.stdout and "BF16" in out.stdout
    assert "total" in out.stdout


def test_load_json_summary(sample: Path) -> None:
    out = cli("load", str(sample), "--json", "--chunk-size", "1MiB", "--concurrency", "3")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    total = json.loads(cli("inspect", str(sample), "--json").stdout)["total_bytes"]
    assert stats["complete"] and stats["bytes"] == total
    assert stats["settings"]["chunk_size"] == 1 << 20 and stats["settings"]["concurrency"] == 3
    assert stats["gb_per_s"] > 0 and stats["peak_rss_bytes"] > 0


def test_load_human_summary_and_progress(sample: Path) -> None:
    out = cli("load", str(sample))
    assert out.returncode == 0, out.stderr
    for word in ("tensors", "throughput", "GB/s", "peak RSS", "settings", "concurrency="):
        assert word in out.stdout
    assert "100%" in out.stderr  # the progress bar reached its total


def test_load_selected_tensor(sample: Path) -> None:
    out = cli("load", str(sample), "--json", "--tensor", "model.norm.weight")
    stats = json.loads(out.stdout)
    assert stats["tensors"] == 1 and stats["bytes"] == 2048 * 4


def test_errors_exit_2_and_name_the_file(tmp_path: Path) -> None:
    bad = write_raw(tmp_path / "bad.safetensors", b"{oops")
    out = cli("load", str(bad))
    assert out.returncode == 2
    assert str(bad) in out.stderr and "JSON" in out.stderr
    assert "Traceback" not in out.stderr
    out = cli("load", str(tmp_path / "missing"))
    assert out.returncode == 2 and "missing" in out.stderr


@pytest.mark.parametrize(
    "case", ["5000-digit integer", "nested 200000 deep", "shape torch cannot hold", "FIFO", "io_timeout=inf"]
)
@pytest.mark.parametrize("command", ["load", "inspect"])
def test_inputs_that_crashed_the_cli_exit_2_without_a_traceback(
    tmp_path: Path, case: str, command: str
) -> None:
    env = None
    if case == "5000-digit integer":
        path = write_raw(
            tmp_path / "big.safetensors",
            b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}',
            b"\x00",
        )
    elif case == "nested 200000 deep":
        path = write_raw(tmp_path / "deep.safetensors", b'{"w": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    elif case == "shape torch cannot hold":
        path = write_raw(
            tmp_path / "huge.safetensors",
            {"w": {"dtype": "BF16", "shape": [0, 2**63], "data_offsets": [0, 0]}},
        )
    elif case == "FIFO":
        path = tmp_path / "pipe.safetensors"
        os.mkfifo(path)
    else:
        path = write_raw(
            tmp_path / "ok.safetensors", {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\x01"
        )
        env = {**os.environ, "WEIGHTSTREAM_IO_TIMEOUT": "inf"}
    out = cli(command, str(path), env=env)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("weightstream: error:")
    assert str(path) in out.stderr or "WEIGHTSTREAM_IO_TIMEOUT='inf'" in out.stderr


def test_bad_setting_is_reported(sample: Path) -> None:
    out = cli("load", str(sample), "--chunk-size", "tiny")
    assert out.returncode == 2 and "--chunk-size" in out.stderr


def test_sample_writer_makes_a_valid_checkpoint(sample: Path) -> None:
    from safetensors.torch import load_file

    import weightstream as ws

    got = ws.load(sample)
    want = {}
    for f in sorted(sample.glob("*.safetensors")):
        want.update({k: v.clone() for k, v in load_file(str(f)).items()})
    assert got.keys() == want.keys()
    assert all(
        torch.equal(got[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8)) for k in want
    )


def test_bench_probes_then_loads(sample: Path) -> None:
    out = cli("bench", str(sample), "--json", "--depths", "1,4", "--block", "1MiB", "--max-bytes", "16MiB")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert [p["depth"] for p in info["probe"]] == [1, 4]
    assert all(p["bytes"] > 0 and p["gb_per_s"] > 0 for p in info["probe"])
    assert info["raw_gb_per_s"] == max(p["gb_per_s"] for p in info["probe"])
    total = json.loads(cli("inspect", str(sample), "--json").stdout)["total_bytes"]
    assert info["load"]["complete"] and info["load"]["bytes"] < total  # bounded by --max-bytes
    assert sum(p["bytes"] for p in info["probe"]) <= 2 * (16 << 20)
    assert info["efficiency"] == pytest.approx(info["load"]["gb_per_s"] / info["raw_gb_per_s"], rel=0.01)


def test_tune_writes_a_profile_and_a_heat_map_that_load_accepts(sample: Path, tmp_path: Path) -> None:
    profile, png = tmp_path / "p.json", tmp_path / "p.png"
    out = cli(
        "tune", str(sample), "--depths", "1,2,4", "--chunk-sizes", "1MiB,4MiB",
        "--max-bytes", "8MiB", "-o", str(profile), "--heatmap", str(png), "--no-progress",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(profile.read_text())
    assert len(doc["sweep"]) == 6 and all(p["error"] is None for p in doc["sweep"])
    assert all(p["memory_limit"] >= 2 * p["depth"] * p["chunk_size"] for p in doc["sweep"])
    best = max(doc["sweep"], key=lambda p: p["gb_per_s"])
    assert doc["settings"] == {
        "autotune": False,
        "concurrency": best["depth"],
        "chunk_size": best["chunk_size"],
    }
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the profile is taken by --profile and by WEIGHTSTREAM_PROFILE
    out = cli("load", str(sample), "--json", "--profile", str(profile))
    assert out.returncode == 0, out.stderr
    settings = json.loads(out.stdout)["settings"]
    assert (settings["concurrency"], settings["chunk_size"], settings["autotune"]) == (
        best["depth"], best["chunk_size"], False,
    )  # fmt: skip
    env = {**__import__("os").environ, "WEIGHTSTREAM_PROFILE": str(profile), "WEIGHTSTREAM_CONCURRENCY": "3"}
    exe = shutil.which("weightstream", path=str(Path(sys.executable).parent))
    assert exe
    done = subprocess.run(
        [exe, "load", str(sample), "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    settings = json.loads(done.stdout)["settings"]
    assert settings["chunk_size"] == best["chunk_size"] and settings["concurrency"] == 3  # env beats profile


def test_tune_never_writes_into_the_storage_it_tests(sample: Path) -> None:
    out = cli("tune", str(sample), "--depths", "1", "--chunk-sizes", "1MiB", "-o", str(sample / "p.json"))
    assert out.returncode == 2
    assert "refusing to write inside the checkpoint's folder" in out.stderr
    assert not (sample / "p.json").exists()


def test_recommend_formats() -> None:
    out = cli(
        "recommend", "--instance", "p5.48xlarge", "--model-size", "700GB", "--tp", "8", "--format", "env"
    )
    assert out.returncode == 0, out.stderr
    assert "export RUNAI_STREAMER_CONCURRENCY=64" in out.stdout
    assert "export RUNAI_STREAMER_CHUNK_BYTESIZE=4294967296" in out.stdout
    out = cli("recommend", "--instance", "nope.large", "--model-size", "10GB", "--format", "json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["bandwidth_from"] == "standard" and info["runai_env"]["RUNAI_STREAMER_CONCURRENCY"] == "32"


def test_recommend_probes_an_unknown_instance(sample: Path) -> None:
    out = cli(
        "recommend", "--instance", "nope.large", "--model-size", "10GB", "--format", "json",
        "--probe", str(sample), "--probe-bytes", "8MiB",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["bandwidth_from"] == "probe" and info["network_gbps"] > 0


def test_load_reports_the_tuner(sample: Path) -> None:
    out = cli("load", str(sample), "--json")
    info = json.loads(out.stdout)
    assert info["tuning"]["start_depth"] == info["settings"]["concurrency"]
    assert info["tuning"]["final_depth"] >= 1
    out = cli("load", str(sample), "--json", "--no-autotune")
    assert json.loads(out.stdout)["tuning"] is None


def test_load_distributed_under_torchrun(sample: Path, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    exe = Path(sys.executable).parent / "weightstream"
    logs = tmp_path / "logs"
    out = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "--log-dir",
            str(logs),
            "--redirects",
            "1",
            "--no-python",
            str(exe),
            "load",
            str(sample),
            "--distributed",
            "--json",
            "--chunk-size",
            "1MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    stats = [json.loads(p.read_text()) for p in sorted(logs.rglob("stdout.log"))]
    assert sorted(s["rank"] for s in stats) == [0, 1] and all(s["world_size"] == 2 for s in stats)
    total = stats[0]["bytes"]
    assert len({s["split_stopped_after"] for s in stats}) == 1  # the ranks decided together
    for s in stats:
        assert s["complete"] and s["bytes"] == total
        # every byte read or received, none twice (reads are rounded to pages)
        assert total <= s["bytes_read"] + s["bytes_received"] <= total * 1.01
        if s["split_stopped_after"] is None:  # split to the end: each read about half
            assert abs(s["bytes_read"] - total / 2) <= 0.1 * total
        else:  # from the page cache, gloo's exchange is slower: given up after the first rounds
            assert s["split_stopped_after"] >= 2 and s["bytes_received"] > 0


def test_load_distributed_without_a_launcher_says_so(sample: Path) -> None:
    out = cli("load", str(sample), "--distributed")
    assert out.returncode == 2 and "torchrun" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_load_distributed_on_cuda_without_a_gpu_says_so(
    sample: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    out = cli("load", str(sample), "--distributed", "--device", "cuda")
    assert out.returncode == 2 and "no CUDA device" in out.stderr
