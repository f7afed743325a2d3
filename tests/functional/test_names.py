"""Names mean exactly what they say, on every backend: an object key with URL syntax in it is read
literally (never another object), an index's shard names are relative paths (sub-folders and
sub-prefixes included, escapes refused), and a NUL byte anywhere is refused as a WeightStreamError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

import weightstream as ws
from weightstream.errors import ConfigError, FormatError, NotFoundError, ReadError

from ..conftest import assert_same, random_tensor
from .conftest import bucket

LITERAL_KEYS = [
    "dir?x/model.safetensors",
    "m%41/model.safetensors",
    "a#b/model.safetensors",
    "sp ace/+model.safetensors",
    "uni\u00e9/model.safetensors",
    "x/..model.safetensors",
    "q%2Fslash/model.safetensors",
]
"""Each beside a decoy at the key a URL parser would make of it (the query, the fragment or the
escape dropped or decoded)."""


def _decoy(key: str) -> str | None:
    for cut in ("?", "#"):
        if cut in key:
            head = key.split(cut)[0]
            return head.rstrip("/") + "/model.safetensors"
    if "%41" in key:
        return key.replace("%41", "A")
    return None


@pytest.mark.parametrize("key", LITERAL_KEYS)
def test_an_object_key_is_read_literally_never_another(s3, key: str) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "names")
    want = {"w": random_tensor((300,), torch.float32, seed=len(key))}
    s3.put_object(Bucket=b, Key=key, Body=save(want))
    decoy = _decoy(key)
    if decoy is not None:
        s3.put_object(Bucket=b, Key=decoy, Body=save({"w": torch.zeros(300)}))
    assert_same(ws.load(f"s3://{b}/{key}"), want)
    folder = key.rpartition("/")[0]
    assert_same(ws.load(f"s3://{b}/{folder}/"), want)  # the prefix, listed literally too


def test_a_key_with_an_empty_segment_is_refused_before_any_request(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "names")
    s3.put_object(Bucket=b, Key="lead/model.safetensors", Body=save({"w": torch.ones(2)}))
    with pytest.raises(ConfigError, match="empty segment"):
        ws.load(f"s3://{b}//lead/model.safetensors")  # obstore would strip the '/' and read lead/...


def test_an_index_naming_shards_in_sub_prefixes_loads(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "names")
    shards = {
        "sub/model-1.safetensors": {"a": random_tensor((40, 3), torch.bfloat16, seed=1)},
        "sub/deeper/model-2.safetensors": {"b": random_tensor((7,), torch.int64, seed=2)},
        "model-3.safetensors": {"c": random_tensor((5,), torch.float16, seed=3)},
    }
    weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    want = {k: v for t in shards.values() for k, v in t.items()}
    for shard, tensors in shards.items():
        s3.put_object(Bucket=b, Key=f"m/{shard}", Body=save(tensors))
        (tmp_path / shard).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp_path / shard))
    s3.put_object(Bucket=b, Key="m/model.safetensors.index.json", Body=index)
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    assert_same(ws.load(tmp_path), want)
    assert_same(ws.load(f"s3://{b}/m/"), want)
    # a shard missing from its sub-prefix is named, not reported as some other failure
    s3.delete_object(Bucket=b, Key="m/sub/deeper/model-2.safetensors")
    with pytest.raises(NotFoundError, match=r"sub/deeper/model-2\.safetensors"):
        ws.load(f"s3://{b}/m/")


def test_a_file_named_with_leading_dots_is_inside_the_folder(tmp_path: Path) -> None:
    want = {"w": random_tensor((9,), torch.float32)}
    save_file(want, str(tmp_path / "..model.safetensors"))
    assert_same(ws.load(tmp_path), want)  # a folder without an index: its *.safetensors
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "..model.safetensors"}})
    )
    assert_same(ws.load(tmp_path), want)  # and an index naming it


@pytest.mark.parametrize(
    "shard", ["../model.safetensors", "sub/../../model.safetensors", "/etc/model.safetensors"]
)
def test_an_index_shard_escaping_its_folder_is_refused(tmp_path: Path, shard: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(FormatError, match="must be relative to the index's folder"):
        ws.load(tmp_path)


def test_nul_bytes_in_a_path_or_a_shard_name_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="NUL"):
        ws.load(str(tmp_path / "a\0b.safetensors"))
    with pytest.raises(ConfigError, match="NUL"):
        ws.open_checkpoint([str(tmp_path / "x.safetensors"), "b\0"])
    with pytest.raises(ConfigError, match="NUL"):
        ws.safe_open(f"{tmp_path}\0")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model\u0000.safetensors"}})
    )
    with pytest.raises(FormatError, match="NUL"):
        ws.load(tmp_path)


def test_a_file_uri_is_percent_decoded(tmp_path: Path) -> None:
    folder = tmp_path / "a b#c"
    folder.mkdir()
    want = {"w": torch.arange(5)}
    save_file(want, str(folder / "model.safetensors"))
    assert_same(ws.load(f"file://{tmp_path}/a%20b%23c/model.safetensors"), want)
    with pytest.raises(ConfigError, match="query or a fragment"):
        ws.load(f"file://{tmp_path}/a b#c/model.safetensors")


def test_a_listing_holding_a_key_the_client_cannot_address_fails_clearly(s3) -> None:  # type: ignore[no-untyped-def]
    b = bucket(s3, "names-odd")
    s3.put_object(Bucket=b, Key="m/model.safetensors", Body=save({"w": torch.ones(2)}))
    s3.put_object(Bucket=b, Key="m//stray.safetensors", Body=b"x")
    with pytest.raises(ReadError, match="cannot address") as info:
        ws.load(f"s3://{b}/m/")
    assert f"s3://{b}/m" in str(info.value)
