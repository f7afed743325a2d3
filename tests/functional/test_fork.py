"""Nothing outlives a fork: a child forked from a process that loaded (or is loading) works, or
says at once why it cannot; it never waits for threads that did not survive ``fork()``.

Frameworks fork (data-loader workers, pre-forking servers). Each child here runs under an alarm
(a hang kills it, and the test fails naming that), and reports what it saw through a pipe.
"""

from __future__ import annotations

import faulthandler
import io
import json
import logging
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save

import weightstream as ws
from weightstream.errors import ConfigError

from ..conftest import as_bytes, random_tensor, write_sharded
from .conftest import bucket

HANG_S = 20
"""A child still running after this long is hung (each does a few small loads)."""


def _quiet_inherited_log_files() -> None:
    """In a forked child, take off the root logger the handlers that write to a file (pytest's
    log file, ``/dev/null`` by default). CPython resets each handler's own lock at a fork, but
    not the lock inside a buffered file: a thread of the parent caught writing a log line at the
    fork leaves it held, and the child's first log line then waits forever (seen once in CI, in
    ``flush``). That is a hazard of any program that forks while its threads log to a file, not
    of the library; the test keeps its in-memory handlers (``caplog``, the report's)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h.stream, io.StringIO):
            root.removeHandler(h)


def in_child(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fn`` in a forked child; its result (or its error, named) as a dict."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: "multi-threaded, fork() may deadlock"
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler: a hang kills it
        signal.alarm(HANG_S)
        faulthandler.dump_traceback_later(HANG_S - 2)  # where it hangs, in the test's report
        _quiet_inherited_log_files()
        try:
            out = {"ok": True, **fn()}
        except BaseException as exc:
            out = {
                "ok": False,
                "error": type(exc).__name__,
                "message": str(exc),
                "trace": traceback.format_exc(),
            }
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + HANG_S + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.02)
    with os.fdopen(r, "rb") as fh:
        raw = fh.read()
    assert os.WIFEXITED(status), (
        f"the forked child died: {'SIGALRM (hung)' if os.WIFSIGNALED(status) else status}"
    )
    return json.loads(raw)  # type: ignore[no-any-return]


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """Bit-exact, compared with numpy: in a child forked after torch's OpenMP pool ran, torch's
    own parallel operations deadlock (GNU OpenMP does not survive fork; torch's DataLoader sets
    one thread in its workers for this reason). weightstream's load path issues none."""
    return set(got) == set(want) and all(
        np.array_equal(as_bytes(got[k]).numpy(), as_bytes(want[k]).numpy()) for k in want
    )


@pytest.fixture
def local(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    want = write_sharded(
        tmp_path / "m",
        [
            {"a": random_tensor((300, 301), torch.float32, seed=1)},
            {
                "b": random_tensor((5000,), torch.bfloat16, seed=2),
                "c": random_tensor((3,), torch.int8, seed=3),
            },
        ],
    )
    return tmp_path / "m", want


def test_a_child_of_a_process_that_loaded_loads_local_files(local) -> None:  # type: ignore[no-untyped-def]
    folder, want = local
    assert same(ws.load(folder), want)
    ckpt = ws.open_checkpoint(folder)  # opened in the parent, used in the child (its descriptors)
    try:

        def child() -> dict[str, Any]:
            return {
                "fresh": same(ws.load(folder), want),
                "inherited": same(ckpt.load(), want),
                "streamed": same(
                    dict(ws.stream(folder, config=ws.StreamConfig(memory_limit=64 << 10))), want
                ),
            }

        got = in_child(child)
        assert got == {"ok": True, "fresh": True, "inherited": True, "streamed": True}, got
        assert same(ckpt.load(), want)  # the parent's checkpoint is untouched
    finally:
        ckpt.close()


def test_forking_while_other_threads_load_leaves_the_child_a_working_library(local) -> None:  # type: ignore[no-untyped-def]
    """Locks and threads held by a load in another thread at the moment of the fork."""
    folder, want = local
    # Imports done first: a fork while another thread runs a module's first import leaves the
    # child waiting on that module's import lock forever, in any Python library (CPython does
    # not reset per-module import locks in the child). Run alone from a fresh clone (no .pyc),
    # the busy thread's first load was still importing at the first fork.
    assert same(ws.load(folder, config=ws.StreamConfig(chunk_size=16 << 10, concurrency=8)), want)
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            while not stop.is_set():
                ws.load(folder, config=ws.StreamConfig(chunk_size=16 << 10, concurrency=8))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        for _ in range(4):
            time.sleep(0.05)
            got = in_child(lambda: {"same": same(ws.load(folder), want)})
            assert got == {"ok": True, "same": True}, got
    finally:
        stop.set()
        t.join(30)
    assert not errors


def test_a_stream_started_before_the_fork_is_refused_in_the_child(local) -> None:  # type: ignore[no-untyped-def]
    folder, want = local
    s = ws.stream(folder, config=ws.StreamConfig(memory_limit=64 << 10, chunk_size=16 << 10))
    first = next(s)

    def child() -> dict[str, Any]:
        next(s)
        return {}

    got = in_child(child)
    assert got["ok"] is False and got["error"] == "ConfigError" and "forked" in got["message"], got
    rest = dict(s)  # the parent's stream goes on
    assert same({first[0]: first[1], **rest}, want)


def test_object_store_reads_in_a_child_forked_after_them_are_refused_at_once(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "fork")
    want = {"w": random_tensor((4000,), torch.float32, seed=5)}
    s3.put_object(Bucket=b, Key="m/model.safetensors", Body=save(want))
    uri = f"s3://{b}/m/"

    def child() -> dict[str, Any]:
        started = time.monotonic()
        try:
            ws.load(uri)
        except ConfigError as exc:
            return {"refused": str(exc), "seconds": time.monotonic() - started}
        return {"loaded": True}

    assert same(ws.load(uri), want)
    got = in_child(child)
    assert got["ok"] and "refused" in got, got
    assert "fork" in got["refused"] and "spawn" in got["refused"], got
    assert got["seconds"] < 5  # at once, not after a timeout
    assert same(ws.load(uri), want)  # the parent's client is untouched


def test_a_child_forked_before_any_request_reads_an_object_store(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Run in a fresh interpreter: this test process may already have made requests."""
    import subprocess
    import sys

    b = bucket(s3, "fork")
    s3.put_object(Bucket=b, Key="early/model.safetensors", Body=save({"w": torch.arange(1000)}))
    script = tmp_path / "early.py"
    script.write_text(
        "import os, signal, sys, torch\n"
        "import weightstream as ws\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(20)\n"
        f"    ok = torch.equal(ws.load('s3://{b}/early/')['w'], torch.arange(1000))\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        f"assert torch.equal(ws.load('s3://{b}/early/')['w'], torch.arange(1000))\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
