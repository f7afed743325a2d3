"""``make test-runai``: the Run:ai streamer's own tests against ``weightstream.compat.runai``.

The test modules of the installed ``runai-model-streamer`` wheel that use ``SafetensorsStreamer``
are copied, unchanged, into a temporary folder (the wheel does not ship the sample checkpoint some
of them read, ``test_files/test.safetensors``: one is written there, every dtype both streamers
know), and run with ``plugin.py``, which points ``SafetensorsStreamer`` at the drop-in. Nothing
of Run:ai's is kept in this project. ``--runai`` runs the same tests against Run:ai itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

TEST_MODULES = [
    "safetensors_streamer/tests/test_safetensors_streamer.py",
    "safetensors_streamer/tests/test_metadata_ordering.py",
    "safetensors_streamer/tests/test_alignment.py",
    "safetensors_streamer/tests/test_packed_f4.py",
    "safetensors_streamer/tests/test_mock.py",
    "distributed_streamer/tests/test_local_ranks.py",
]
"""Every module of the wheel's tests that imports SafetensorsStreamer (the dist_test_* ones need
a launcher of several processes and a GPU, as their own names say)."""


def sample_checkpoint(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {}
    floats = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]  # values, not random bits: the tests compare with ==, and NaN != NaN
    ints = [torch.int64, torch.int32, torch.int8, torch.uint8]
    for i, dtype in enumerate(floats):
        tensors[f"layer.{i}.{str(dtype).split('.')[1]}"] = torch.randn(7, i + 3, generator=g).to(dtype)
    for i, dtype in enumerate(ints, len(floats)):
        tensors[f"layer.{i}.{str(dtype).split('.')[1]}"] = torch.randint(0, 100, (7, i + 3), generator=g).to(
            dtype
        )
    tensors["mask"] = torch.randint(0, 2, (5, 5), generator=g).bool()
    tensors["big"] = torch.randn(1 << 18, generator=g)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runai", action="store_true", help="run against the Run:ai streamer itself")
    ap.add_argument("pytest_args", nargs="*")
    args, rest = ap.parse_known_args()
    args.pytest_args += rest
    spec = importlib.util.find_spec("runai_model_streamer")
    assert spec is not None and spec.submodule_search_locations, "runai-model-streamer is not installed"
    package = Path(next(iter(spec.submodule_search_locations)))
    with tempfile.TemporaryDirectory(prefix="runai-suite-") as tmp:
        copies = []
        for rel in TEST_MODULES:
            dest = Path(tmp) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(package / rel, dest)
            copies.append(str(dest))
        for folder in {Path(c).parent for c in copies}:
            sample_checkpoint(folder / "test_files" / "test.safetensors")
            sample_checkpoint(folder / "test_files" / "test2.safetensors")  # the listing tests expect two
        plugin = [] if args.runai else ["-p", "tests.runai_suite.plugin"]
        sys.path.insert(0, str(HERE.parent.parent))
        return pytest.main(
            ["-c", str(HERE / "pytest.ini"), "--rootdir", tmp, *plugin, *copies, *args.pytest_args]
        )


if __name__ == "__main__":
    raise SystemExit(main())
