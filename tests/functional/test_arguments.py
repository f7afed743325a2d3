"""Every argument and output path is checked before any I/O, as a ConfigError naming it; nothing
raised escapes the error tree; and what the CLI prints cannot fail.

"Before any I/O" is tested by pointing each call at a checkpoint that does not exist: a check made
after the first read would report the missing file instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import weightstream as ws
from weightstream.errors import ConfigError, WeightStreamError

from ..conftest import random_tensor

NOWHERE = "/nonexistent/weightstream-test/model.safetensors"

BAD_DEVICES = ["meta", "mps", "xpu", "privateuseone", "bogus", "cuda:7", "cpu:x", 3.5]


@pytest.mark.parametrize("device", BAD_DEVICES)
@pytest.mark.parametrize("call", ["load", "stream", "safe_open"])
def test_a_device_that_cannot_hold_the_tensors_is_refused_before_any_read(call: str, device: Any) -> None:
    if device == "cuda:7" and torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    fn = getattr(ws, call)
    with pytest.raises(ConfigError) as info:
        fn(NOWHERE, device=device)
    assert info.value.setting == "device" and "device" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"tensors": [1]}, "tensors"),
        ({"tensors": 5}, "tensors"),
        ({"config": {"chunk_size": 1}}, "config"),
        ({"distributed": "yes"}, None),
    ],
)
@pytest.mark.parametrize("call", ["load", "stream"])
def test_other_arguments_are_refused_before_any_read(
    call: str, kwargs: dict[str, Any], setting: str | None
) -> None:
    with pytest.raises(ConfigError) as info:
        getattr(ws, call)(NOWHERE, **kwargs)
    assert info.value.setting == setting


def test_a_one_shot_iterator_of_names_is_read_once(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    want = {"a": torch.arange(4), "b": torch.ones(2)}
    save_file(want, str(path))
    got = ws.load(path, tensors=iter(["b", "a"]))
    assert list(got) == ["b", "a"] and torch.equal(got["a"], want["a"])


def test_safe_open_names_must_be_strings(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": random_tensor((4, 4), torch.float32)}, str(path))
    with ws.safe_open(path) as f:
        for name in (123, None, b"a", ("a",)):
            with pytest.raises(ConfigError, match="name must be a str"):
                f.get_tensor(name)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="name must be a str"):
                f.get_slice(name)  # type: ignore[arg-type]


def test_an_error_about_a_tensor_that_is_not_a_string_can_still_be_built() -> None:
    err = WeightStreamError("odd", tensor=123)  # type: ignore[arg-type]
    assert "tensor '123'" in str(err) and err.tensor == 123


# -- the command line ---------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("weightstream", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "weightstream.cli.main"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, env=env, **kw)


@pytest.mark.parametrize("where", ["missing-folder", "proc", "a-directory", "empty"])
def test_tune_refuses_an_output_it_could_not_write_before_the_sweep(tmp_path: Path, where: str) -> None:
    target = {
        "missing-folder": str(tmp_path / "no" / "such" / "profile.json"),
        "proc": "/proc/weightstream-profile.json",
        "a-directory": str(tmp_path),
        "empty": "",
    }[where]
    out = cli("tune", NOWHERE, "-o", target, "--heatmap", "")
    assert out.returncode == 2, out.stderr
    assert "--output" in out.stderr and "Traceback" not in out.stderr
    assert "does not exist: " not in out.stderr.split("--output")[0]  # not the checkpoint's error
    out = cli("tune", NOWHERE, "-o", str(tmp_path / "ok.json"), "--heatmap", target or "/proc/x.png")
    if where != "empty":
        assert out.returncode == 2 and "--heatmap" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("command", "value"),
    [("bench", "nan"), ("bench", "inf"), ("bench", "-inf"), ("tune", "0"), ("tune", "1e12")],
)
def test_the_cli_s_durations_follow_the_library_s_rule(command: str, value: str, tmp_path: Path) -> None:
    extra = ["-o", str(tmp_path / "p.json"), "--heatmap", ""] if command == "tune" else []
    out = cli(command, NOWHERE, f"--max-seconds={value}", *extra)
    assert out.returncode == 2 and "--max-seconds" in out.stderr and "finite" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("flag", "value"), [("--max-bytes", "12"), ("--max-bytes", "lots"), ("--depths", "0")]
)
def test_the_cli_s_sizes_and_counts_are_checked_first(flag: str, value: str) -> None:
    out = cli("bench", NOWHERE, flag, value)
    assert out.returncode == 2 and flag in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_path_the_terminal_cannot_encode_is_printed_escaped(tmp_path: Path) -> None:
    folder = os.fsencode(tmp_path) + b"/\xff\xfe-undecodable"
    os.mkdir(folder)
    save_file({"w": torch.arange(10)}, os.fsdecode(folder + b"/model.safetensors"))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    for command in (["load", "--no-progress"], ["inspect"], ["load", "--json"], ["inspect", "--json"]):
        out = cli(*command, os.fsdecode(folder), env=env)
        assert out.returncode == 0, out.stderr
        assert "undecodable" in out.stdout and "Traceback" not in out.stderr
    out = cli("load", os.fsdecode(folder + b"/missing.safetensors"), env=env)
    assert out.returncode == 2 and "missing.safetensors" in out.stderr and "Traceback" not in out.stderr


def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path: Path) -> None:
    """``weightstream inspect | head -1``: no BrokenPipeError."""
    path = tmp_path / "many.safetensors"
    save_file({f"tensor.{i:05d}": torch.zeros(1) for i in range(5000)}, str(path))
    exe = shutil.which("weightstream", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "weightstream.cli.main"]
    proc = subprocess.Popen([*cmd, "inspect", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as head does after one line
    err = proc.stderr.read().decode()
    proc.stderr.close()
    code = proc.wait(60)
    assert first.startswith(b"name")
    assert code == 141 and err == "", err


# A refusal a command makes itself (its arguments, its settings, its output, a file it cannot
# open or parse) comes before torch is imported: at a prompt or in a container's start-up it
# takes a fraction of a second, not the seconds torch's import costs. Only what torch itself
# must judge (a device's name) or a rank's joining of its group comes after.
REFUSED_BEFORE_TORCH = [
    ["bench", NOWHERE, "--max-seconds=nan"],
    ["bench", NOWHERE, "--depths", "0"],
    ["bench", NOWHERE, "--block", "1KiB"],
    ["bench", NOWHERE, "--max-bytes", "lots"],
    ["tune", NOWHERE, "-o", "/proc/weightstream-profile.json", "--heatmap", ""],
    ["tune", NOWHERE, "-o", "{tmp}/ok.json", "--heatmap", "/proc/x.png"],
    ["tune", NOWHERE, "-o", "{tmp}/ok.json", "--heatmap", "", "--max-seconds=0"],
    ["tune", NOWHERE, "-o", "{tmp}/ok.json", "--heatmap", "", "--chunk-sizes", "1KiB"],
    ["tune", NOWHERE, "-o", "{tmp}/ok.json", "--heatmap", ""],
    ["manifest", NOWHERE, "-o", "/proc/weightstream-manifest.json"],
    ["manifest", NOWHERE],
    ["load", NOWHERE],
    ["load", "{tmp}/bad.safetensors"],
    ["load", NOWHERE, "--concurrency", "0"],
    ["load", NOWHERE, "--s3-request-timeout", "nan"],
    ["load", NOWHERE, "--profile", "/nonexistent/profile.json"],
    ["load", "{tmp}", "--distributed"],
    ["inspect", NOWHERE],
]


def test_a_command_refuses_what_it_can_judge_before_torch_loads(tmp_path: Path) -> None:
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header!!}")
    cases = [[a.replace("{tmp}", str(tmp_path)) for a in argv] for argv in REFUSED_BEFORE_TORCH]
    # one interpreter for every case: a case that imported torch taints the ones after it, so the
    # first case reported is the one that did
    driver = (
        "import json, sys\n"
        "from weightstream.cli.main import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    code = main(argv)\n"
        "    print(json.dumps([argv, code, 'torch' in sys.modules]), flush=True)\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(
        [sys.executable, "-c", driver, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = [json.loads(line) for line in out.stdout.splitlines()]
    assert [argv for argv, _, _ in seen] == cases
    assert [argv for argv, code, _ in seen if code != 2] == []  # every one refused as bad input
    assert [argv for argv, _, torch_loaded in seen if torch_loaded][:1] == []
    # and what torch judges loads it: the driver does see the import
    save_file({"w": torch.arange(4)}, str(tmp_path / "good.safetensors"))
    bogus = ["load", str(tmp_path / "good.safetensors"), "--device", "bogus"]
    more = subprocess.run(
        [sys.executable, "-c", driver, json.dumps([bogus])],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert json.loads(more.stdout)[1:] == [2, True]
