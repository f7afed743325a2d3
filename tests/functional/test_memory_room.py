"""load() of a checkpoint larger than the memory the process may use fails at once with a
MemoryBudgetError suggesting stream(), instead of being killed by the kernel part way.

Proved inside a memory-limited control group this test makes (cgroup v2 where its memory
controller is enabled, else v1's memory controller; root): a load too large for it, a load that
fits, and a stream of the large one, each in a process placed in the group before it starts.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightstream.memory.room import _mounts

from ..conftest import write_sharded

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 768 << 20


def _own_group(controller: str | None) -> str | None:
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            num, _, rest = line.strip().partition(":")
            controllers, _, path = rest.partition(":")
            if (controller is None and num == "0" and controllers == "") or (
                controller is not None and controller in controllers.split(",")
            ):
                return path
    return None


@contextlib.contextmanager
def memory_group(limit: int) -> Iterator[str]:
    """A new control group with a memory limit (and no swap to spill into); its cgroup.procs path."""
    if os.geteuid() != 0:
        pytest.skip("making a control group needs root")
    v2, v1 = _mounts()
    folder = None
    if v2 is not None:
        parent = os.path.join(v2, (_own_group(None) or "/").strip("/"))
        controllers = Path(parent, "cgroup.controllers")
        if controllers.exists() and "memory" in controllers.read_text().split():
            folder = os.path.join(parent, f"ws-test-{os.getpid()}")
            os.mkdir(folder)
            Path(folder, "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):
                Path(folder, "memory.swap.max").write_text("0")
    if folder is None and v1 is not None:
        parent = os.path.join(v1, (_own_group("memory") or "/").strip("/"))
        folder = os.path.join(parent, f"ws-test-{os.getpid()}")
        os.mkdir(folder)
        Path(folder, "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(OSError):
            Path(folder, "memory.memsw.limit_in_bytes").write_text(str(limit))
    if folder is None:
        pytest.skip("no cgroup memory controller to limit a process with")
    try:
        yield os.path.join(folder, "cgroup.procs")
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def run_inside(procs: str, code: str) -> subprocess.CompletedProcess[str]:
    def enter() -> None:  # in the child, before exec: the whole new process is limited
        with open(procs, "w") as fh:
            fh.write(str(os.getpid()))

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        preexec_fn=enter,
    )


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("room") / "big"
    write_sharded(
        folder, [{f"w{i}": torch.full((64 << 20,), i, dtype=torch.uint8)} for i in range(16)]
    )  # 1 GiB
    return folder


def test_a_load_larger_than_the_group_allows_is_refused_at_once(big: Path) -> None:
    with memory_group(LIMIT) as procs:
        out = run_inside(
            procs,
            f"""
            import sys, time, weightstream as ws
            t = time.monotonic()
            try:
                ws.load({str(big)!r})
            except ws.errors.MemoryBudgetError as exc:
                assert isinstance(exc, MemoryError)
                print(exc); print(time.monotonic() - t); sys.exit(3)
            sys.exit(0)
            """,
        )
    assert out.returncode == 3, f"status {out.returncode} (-9: killed by the kernel); {out.stderr[-2000:]}"
    message, seconds = out.stdout.strip().splitlines()
    assert "stream()" in message and "control group" in message and str(big) in message
    assert float(seconds) < 5  # before reading: no 1 GiB read first


def test_a_load_that_fits_and_a_stream_of_the_large_one_run_in_the_same_group(
    big: Path, tmp_path: Path
) -> None:
    small = tmp_path / "small"
    write_sharded(small, [{"w": torch.full((128 << 20,), 7, dtype=torch.uint8)}])
    with memory_group(LIMIT) as procs:
        out = run_inside(
            procs,
            f"""
            import torch, weightstream as ws
            got = ws.load({str(small)!r})
            assert got["w"].numel() == 128 << 20 and int(got["w"][-1]) == 7
            del got
            s = ws.stream({str(big)!r}, config=ws.StreamConfig(memory_limit=64 << 20))
            seen = {{}}
            for name, t in s:
                seen[name] = int(t[-1])
            assert seen == {{f"w{{i}}": i for i in range(16)}}, seen
            print("ok")
            """,
        )
    assert out.returncode == 0 and out.stdout.strip() == "ok", (
        f"status {out.returncode}; {out.stderr[-2000:]}"
    )
