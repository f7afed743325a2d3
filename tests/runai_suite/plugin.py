"""A pytest plugin that points the Run:ai streamer's own tests at weightstream's drop-in.

The tests run from the installed ``runai-model-streamer`` wheel, unchanged; the one thing this
plugin changes is where ``SafetensorsStreamer`` comes from: every module of the wheel that offers
it (the package, ``runai_model_streamer.safetensors_streamer`` and its ``safetensors_streamer``
module) hands out ``weightstream.compat.runai.SafetensorsStreamer`` instead, as a user's one
changed import would. The rest of the wheel (its file streamer, its helpers) stays Run:ai's.

Used by ``make test-runai``; the tests that cannot apply to a drop-in, and why, are listed in
``tests/runai_suite/not_applicable.txt`` and deselected by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import pytest

from weightstream.compat import runai as shim

MODULES = (
    "runai_model_streamer",
    "runai_model_streamer.safetensors_streamer",
    "runai_model_streamer.safetensors_streamer.safetensors_streamer",
)


def point_at_drop_in() -> Callable[[], None]:
    """Make every module of the wheel that offers ``SafetensorsStreamer`` offer the drop-in's;
    returns a function that undoes it."""
    before = {}
    for name in MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "SafetensorsStreamer"):
            before[name] = module.SafetensorsStreamer
            module.SafetensorsStreamer = shim.SafetensorsStreamer

    def restore() -> None:
        for name, cls in before.items():
            importlib.import_module(name).SafetensorsStreamer = cls

    return restore


def pytest_configure(config: pytest.Config) -> None:
    point_at_drop_in()  # for the whole run of Run:ai's tests: this plugin is loaded for nothing else


NOT_APPLICABLE = Path(__file__).with_name("not_applicable.txt")


def _not_applicable() -> dict[str, str]:
    out = {}
    for line in NOT_APPLICABLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            test, _, why = line.partition(" | ")
            out[test.strip()] = why.strip()
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = _not_applicable()
    kept, dropped = [], []
    for item in items:
        key = (
            f"{Path(item.fspath).name}::{item.name}"
            if item.cls is None
            else f"{Path(item.fspath).name}::{item.cls.__name__}::{item.name}"
        )
        (dropped if key in skip else kept).append(item)
    unknown = set(skip) - {
        f"{Path(i.fspath).name}::{i.name}"
        if i.cls is None
        else f"{Path(i.fspath).name}::{i.cls.__name__}::{i.name}"
        for i in items
    }
    if unknown:
        raise pytest.UsageError(f"not_applicable.txt names tests that do not exist: {sorted(unknown)}")
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)
