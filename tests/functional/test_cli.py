"""The command line, run as a user runs it (a real subprocess of the installed entry point)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightstream.sample import write_checkpoint

from ..conftest import write_raw


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("weightstream", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "weightstream.cli.main"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


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
