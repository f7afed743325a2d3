"""The suite's own structure: an optional peer or server package missing skips the tests that
need it, and only those."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent(
    """
    import sys
    import pytest

    class Block:
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("boto3", "moto", "runai_model_streamer", "obstore"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, Block())
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-W", "ignore", *sys.argv[1:]]))
    """
)


def test_local_functional_tests_run_without_the_object_store_packages() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER,
            "tests/functional/test_paths.py",
            "tests/functional/test_compat_runai.py",
            "-k",
            "not object_store and not runai_endpoint",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    passed = int(tail.split(" passed")[0].split()[-1])
    assert passed >= 20, tail  # the path tests and the drop-in's own tests ran
    assert "skipped" in tail  # the comparisons with the Run:ai streamer, alone
