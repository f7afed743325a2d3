"""bench/gpu_check.py is run on a GPU machine only when one is lent, with minutes to spare: its
CPU dry run keeps the script itself working (arguments, children, verification, report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def test_gpu_check_dry_run_on_cpu(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--size-gib",
            "0.05",
            "--reps",
            "1",
            "--no-cold",
            "--dir",
            str(tmp_path / "ck"),
            "--json-out",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verify"]["verified"] > 0 and report["verify"]["mismatched"] == []
    assert report["median_gb_per_s"]["hot"] > 0 and report["median_gb_per_s"]["stream"] > 0
    assert "cold: skipped (--no-cold)" in out.stdout
