"""The backend seam (issue 24): a store is one module and one registration.

The in-memory store (:mod:`weightstream.sources.memory`) is read through every front door
unchanged (load, stream, open_checkpoint, a folder, an index, a list), refuses what is missing
or changed in the same words as the other stores, and a scheme registered at run time reaches
it with no other change. The layers above the sources never ask for a backend again once a
shard is open: they hold it on the shard.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import weightstream as ws
from weightstream.errors import ConfigError, FormatError, NotFoundError
from weightstream.location import ObjectLocation, parse_location
from weightstream.sources.memory import BACKEND, MemoryStore
from weightstream.sources.registry import register_backend

from ..conftest import assert_same, random_tensor

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "weightstream"


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    with MemoryStore("seam") as s:
        yield s


def tensors(n: int = 6) -> dict[str, torch.Tensor]:
    kinds = (torch.float32, torch.bfloat16, torch.int8, torch.float16)
    return {f"layer.{i}.w": random_tensor((1000 + 37 * i,), kinds[i % 4], seed=i) for i in range(n)}


def sharded(store: MemoryStore, prefix: str, want: dict[str, torch.Tensor], shards: int = 3) -> None:
    names = sorted(want)
    weight_map = {}
    for k in range(shards):
        part = {n: want[n] for n in names[k::shards]}
        store.put(f"{prefix}/model-{k}.safetensors", save(part))
        weight_map.update({n: f"model-{k}.safetensors" for n in part})
    store.put(f"{prefix}/model.safetensors.index.json", json.dumps({"weight_map": weight_map}).encode())


def test_every_front_door_reads_an_in_memory_store_bit_exact(store: MemoryStore) -> None:
    want = tensors()
    store.put("one/model.safetensors", save(want))
    sharded(store, "many", want)
    assert_same(ws.load("memory://seam/one/model.safetensors"), want)
    assert_same(ws.load("memory://seam/one"), want)  # a folder of one file
    assert_same(ws.load("memory://seam/many/"), want)  # a folder with an index
    assert_same(ws.load("memory://seam/many/model.safetensors.index.json"), want)
    listed = [f"memory://seam/many/model-{k}.safetensors" for k in range(3)]
    assert_same(ws.load(listed), want)
    assert_same(dict(ws.stream("memory://seam/many", config=ws.StreamConfig(memory_limit=8192))), want)
    with ws.open_checkpoint("memory://seam/many") as ckpt:
        assert not ckpt.remote and ckpt.network_fs is None
        assert all(s.backend is BACKEND for s in ckpt.shards)
        assert_same(
            ckpt.load(tensors=["layer.1.w", "layer.4.w"]), {k: want[k] for k in ("layer.1.w", "layer.4.w")}
        )
    assert store.reads.entries  # the tensors came through the store's reads


def test_missing_and_changed_objects_are_refused_by_name(store: MemoryStore) -> None:
    with pytest.raises(NotFoundError, match=r"memory://seam/absent\.safetensors"):
        ws.load("memory://seam/absent.safetensors")
    with pytest.raises(NotFoundError, match="no memory store named 'closed'"):
        ws.load("memory://closed/model.safetensors")
    sharded(store, "m", tensors(4), shards=2)
    store.delete("m/model-1.safetensors")
    with pytest.raises(NotFoundError, match=r"names shard 'model-1\.safetensors'.*memory://seam/m/model-1"):
        ws.load("memory://seam/m")
    store.put("x/model.safetensors", save(tensors(2)))
    with ws.open_checkpoint("memory://seam/x/model.safetensors") as ckpt:
        store.put("x/model.safetensors", save(tensors(3)))  # a new version under the open checkpoint
        with pytest.raises(FormatError, match="changed since its header was read"):
            ckpt.load()
    store.put("bad/model.safetensors", b"\xff" * 7)
    with pytest.raises(FormatError, match=r"memory://seam/bad/model\.safetensors"):
        ws.load("memory://seam/bad/model.safetensors")


def test_a_scheme_registered_at_run_time_loads_with_no_other_change(store: MemoryStore) -> None:
    """The registry is public: a user's scheme reaches a backend as the built-in ones do (here
    the in-memory backend under a second name), and messages list it among the known ones."""
    with pytest.raises(ConfigError, match="unsupported URI scheme 'mirror'"):
        parse_location("mirror://seam/model.safetensors")
    register_backend("mirror", BACKEND)
    want = tensors(3)
    store.put("model.safetensors", save(want))
    assert parse_location("mirror://seam/model.safetensors") == ObjectLocation(
        "mirror", "seam", "model.safetensors"
    )
    assert_same(ws.load("mirror://seam/model.safetensors"), want)
    with pytest.raises(ConfigError, match=r"reads paths and file://, .*memory://, mirror://"):
        parse_location("other://x/y")


@pytest.mark.parametrize("scheme", ["file", "", "S3", "x/y", "1a"])
def test_a_scheme_that_cannot_name_a_store_is_refused(scheme: str) -> None:
    with pytest.raises(ConfigError):
        register_backend(scheme, BACKEND)


def test_a_backend_missing_a_method_is_refused() -> None:
    class Half:
        remote = False

        def open(self) -> None: ...

    with pytest.raises(ConfigError, match="must have settings, network_fs"):
        register_backend("half", Half())  # type: ignore[arg-type]


def _names_used(path: Path) -> set[str]:
    return set(re.findall(r"\b\w+\b", path.read_text()))


def test_only_resolution_and_opening_ask_which_backend_reads_a_location() -> None:
    """Where a checkpoint is found (uri) and its shards opened (checkpoint) a location's backend
    is looked up; everything after holds it on the shard. And the in-memory store is named by
    the registry alone: no layer above the sources knows it exists."""
    asking = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "backend_for" in _names_used(p) and p.name != "registry.py"
    }
    assert asking == {"uri.py", "checkpoint.py"}
    naming_memory = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "weightstream.sources.memory" in p.read_text() and p.name != "memory.py"
    }
    assert naming_memory == {"sources/registry.py"}
