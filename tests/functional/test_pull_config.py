"""``weightstream pull-config`` (issue 22): the folder an object-store model needs for vLLM.

On a real S3-compatible server (moto on loopback): the small files directly under the prefix are
written, byte for byte, and nothing else (no weights, no index, no subfolder); the command prints
what it wrote; a prefix without config.json, a missing bucket and a local path are refused with
the object named (the GET path's own faults are the loads' tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ..conftest import random_tensor
from .conftest import bucket, put_checkpoint

FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 8}',
    "tokenizer.json": os.urandom(3 << 20),  # several pieces of a GET: bytes must be exact
    "tokenizer_config.json": b"{}",
    "generation_config.json": b'{"do_sample": false}',
    "tokenizer.model": os.urandom(1000),
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightstream", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def model(s3: Any) -> str:
    b = bucket(s3, "pull-config")
    put_checkpoint(s3, b, "models/m", [{"w": random_tensor((64, 3), torch.float16)}, {"v": torch.ones(3)}])
    for name, body in FILES.items():
        s3.put_object(Bucket=b, Key=f"models/m/{name}", Body=body)
    s3.put_object(Bucket=b, Key="models/m/original/consolidated.json", Body=b"{}")
    s3.put_object(Bucket=b, Key="models/m/pytorch_model.bin", Body=b"weights")
    return f"s3://{b}/models/m"


@pytest.mark.parametrize("slash", ["", "/"])
def test_the_config_files_are_pulled_and_nothing_else(model: str, tmp_path: Path, slash: str) -> None:
    out = cli("pull-config", model + slash, str(tmp_path / "cfg"))
    assert out.returncode == 0, out.stderr
    written = {p.name: p.read_bytes() for p in (tmp_path / "cfg").iterdir()}
    assert written == FILES
    assert sorted(out.stdout.split()) == sorted(str(tmp_path / "cfg" / n) for n in FILES)


def test_a_prefix_without_a_config_is_refused_naming_it(model: str, tmp_path: Path) -> None:
    out = cli("pull-config", model + "/original", str(tmp_path / "cfg"))
    assert out.returncode == 2
    assert "no config.json directly under this prefix" in out.stderr and "models/m/original" in out.stderr
    assert not (tmp_path / "cfg").exists()


def test_a_missing_bucket_and_a_local_path_are_refused(model: str, tmp_path: Path) -> None:
    out = cli("pull-config", "s3://no-such-bucket-here/m", str(tmp_path / "a"))
    assert out.returncode == 2 and "no-such-bucket-here" in out.stderr
    out = cli("pull-config", str(tmp_path), str(tmp_path / "b"))
    assert out.returncode == 2 and "object-store prefix" in out.stderr


def test_a_failed_command_exits_with_its_code_every_time(s3: Any, tmp_path: Path) -> None:
    """A request the command no longer waits for (a hedge, a sibling attempt) must not reach into
    Python while the interpreter finalizes: that aborted the process (SIGABRT, exit -6) after
    it had printed its error, in about one run of four. Twenty runs: each exits 2."""
    codes = [
        cli("pull-config", "s3://no-such-bucket-here/m", str(tmp_path / "a")).returncode for _ in range(20)
    ]
    assert codes == [2] * 20
