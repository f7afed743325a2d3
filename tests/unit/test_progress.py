"""The load-progress file and ``weightstream load-status`` (issue 23, readiness)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from weightstream.cli.main import main
from weightstream.progress import ProgressFile, path_for_rank, status


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_load_is_written_as_it_goes_and_read_back_by_rank(tmp_path: Path) -> None:
    base = str(tmp_path / "progress.json")
    clock = Clock()
    ranks = [ProgressFile(path_for_rank(base, r), 4_000_000_000, rank=r, clock=clock) for r in (0, 1)]
    assert [s.phase for s in status(base)] == ["loading", "loading"]
    clock.now = 2.0
    for p in ranks:
        p.add(1_000_000_000)
    (first, second) = status(base)
    assert first.path == base and second.path == base + ".rank1"
    assert first.record["bytes_done"] == 1_000_000_000 and first.record["gb_per_s"] == 0.5
    assert first.record["eta_s"] == 6.0  # 3 GB left at 0.5 GB/s
    ranks[0].finish()
    ranks[1].finish(OSError("the disk went away"))
    phases = {s.path: (s.phase, s.ok) for s in status(base)}
    assert phases == {base: ("done", True), base + ".rank1": ("failed", False)}
    assert "OSError: the disk went away" in status(base)[1].describe()


def test_a_load_that_stops_advancing_is_stalled(tmp_path: Path) -> None:
    path = str(tmp_path / "p.json")
    p = ProgressFile(path, 100)
    p.add(10)
    (now,) = status(path, stalled_after=60)
    assert now.phase == "loading"
    (later,) = status(path, stalled_after=60, now=time.time() + 61)
    assert later.phase == "stalled" and not later.ok and "no progress for" in later.describe()
    p.finish()
    (done,) = status(path, stalled_after=60, now=time.time() + 3600)
    assert done.phase == "done"  # a finished load never goes stale


def test_a_reader_never_sees_half_a_file(tmp_path: Path) -> None:
    path = str(tmp_path / "p.json")
    clock = Clock()
    p = ProgressFile(path, 10**12, clock=clock)
    stop = threading.Event()
    seen: list[str] = []

    def read() -> None:
        while not stop.is_set():
            seen.extend(s.phase for s in status(path))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(2000):
        clock.now = float(i)  # a write each time
        p.add(1)
    stop.set()
    reader.join()
    assert seen and set(seen) == {"loading"}
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_an_unreadable_file_is_said_so(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"phase": "load')
    (s,) = status(str(path))
    assert s.phase == "unreadable" and not s.ok and "JSONDecodeError" in s.describe()


def test_the_command_exits_by_the_state_of_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = str(tmp_path / "progress.json")
    assert main(["load-status", base]) == 0  # nothing started yet: not a failure
    assert "no load has started" in capsys.readouterr().out
    ProgressFile(base, 100).add(50)
    other = ProgressFile(path_for_rank(base, 1), 100)
    assert main(["load-status", base]) == 0
    other.finish(RuntimeError("boom"))
    assert main(["load-status", base]) == 1
    out = capsys.readouterr().out
    assert "rank1: failed" in out and "boom" in out
    record = json.loads(Path(base).read_text())
    record["updated"] -= 1000
    Path(base).write_text(json.dumps(record))
    os.remove(path_for_rank(base, 1))
    assert main(["load-status", base, "--stalled-after", "60"]) == 1
    assert "stalled" in capsys.readouterr().out
