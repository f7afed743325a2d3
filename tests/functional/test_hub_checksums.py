"""The SHA-256 the Hugging Face Hub publishes for each LFS file, checked with ``verify="on"``
on folders laid out as the Hub's clients lay them out: the Hub's cache (a snapshot's files link
to ``blobs/<sha256>``) and a ``--local-dir`` download (``.cache/huggingface/download/*.metadata``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import weightstream as ws
from weightstream.errors import FormatError

from ..conftest import assert_same, flip, hub_metadata, random_tensor, write_sharded

ON = ws.StreamConfig(verify="on")


def shards() -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"s{s}.t{i}": random_tensor((700 + 13 * i, 32), torch.float32, seed=40 + 10 * s + i)
            for i in range(5)
        }
        for s in range(2)
    ]


def hub_cache(root: Path, parts: list[dict[str, torch.Tensor]]) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model in the Hub's cache layout: ``blobs/<sha256>``, and a snapshot linking to them."""
    repo = root / "models--org--model"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    weight_map, everything = {}, {}
    for i, shard in enumerate(parts, 1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        body = save(shard)
        blob = repo / "blobs" / hashlib.sha256(body).hexdigest()
        blob.write_bytes(body)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
        weight_map.update(dict.fromkeys(shard, name))
        everything.update(shard)
    index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    blob = repo / "blobs" / hashlib.sha1(index).hexdigest()  # a small file: git's SHA-1, not LFS
    blob.write_bytes(index)
    (snap / "model.safetensors.index.json").symlink_to(os.path.relpath(blob, snap))
    return snap, everything


def local_dir(folder: Path, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A ``--local-dir`` download: the files, and the metadata the Hub's client keeps beside them."""
    want = write_sharded(folder, parts)
    hub_metadata(folder)
    return want


def test_the_hub_cache_is_checked_against_its_blob_names(tmp_path: Path) -> None:
    snap, want = hub_cache(tmp_path, shards())
    with ws.open_checkpoint(snap, config=ON) as ck:
        for s in ck.shards:
            assert s.digest is not None and s.digest.algorithm == "sha256"
            assert "Hugging Face Hub" in s.digest.origin
        assert_same(ck.load(), want)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == sum(s.size for s in ck.shards)
    # the default asks nothing of it: SHA-256 costs 1.8 GB/s a file
    with ws.open_checkpoint(snap) as ck:
        assert all(s.digest is None for s in ck.shards)


def test_a_changed_blob_fails_naming_the_file_and_both_hashes(tmp_path: Path) -> None:
    snap, _ = hub_cache(tmp_path, shards())
    shard = snap / "model-00002-of-00002.safetensors"
    real = Path(os.path.realpath(shard))
    flip(real, real.stat().st_size - 7)  # the last tensor's last bytes
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        ws.load(snap, config=ON)
    text = str(info.value)
    assert str(shard) in text and real.name in text  # the file, and the hash the Hub published
    assert info.value.byte_range == (0, real.stat().st_size)
    # streamed: the error ends the stream, never a clean end
    with pytest.raises(FormatError, match="checksum mismatch"):
        for _ in ws.stream(snap, config=ON):
            pass


def test_a_local_dir_download_is_checked_against_its_metadata(tmp_path: Path) -> None:
    want = local_dir(tmp_path / "m", shards())
    with ws.open_checkpoint(tmp_path / "m", config=ON) as ck:
        assert all(s.digest is not None and ".metadata" in s.digest.origin for s in ck.shards)
        assert_same(ck.load(), want)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == sum(s.size for s in ck.shards)
    # streamed, each tensor as it comes: the same check
    s = ws.stream(tmp_path / "m", config=ON)
    assert_same({n: t.clone() for n, t in s}, want)
    assert s.stats.checked_bytes == sum(f.stat().st_size for f in (tmp_path / "m").glob("*.safetensors"))
    flip(tmp_path / "m" / "model-00001-of-00002.safetensors", 200)  # in the header's JSON
    with pytest.raises(FormatError) as info:
        ws.load(tmp_path / "m", config=ON)
    assert "model-00001-of-00002.safetensors" in str(info.value)


def test_a_file_in_a_subfolder_of_a_local_dir_finds_its_metadata(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    want = local_dir(root / "sub", shards())
    meta = root / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    for f in (root / "sub" / ".cache" / "huggingface" / "download").iterdir():
        (meta / "sub").mkdir(exist_ok=True)
        f.rename(meta / "sub" / f.name)  # the client keeps the repo's paths under the root's .cache
    with ws.open_checkpoint(root / "sub", config=ON) as ck:
        assert all(s.digest is not None for s in ck.shards)
        assert_same(ck.load(), want)


def test_metadata_without_a_sha256_is_no_checksum(tmp_path: Path) -> None:
    local_dir(tmp_path / "m", shards())
    meta = (
        tmp_path / "m" / ".cache" / "huggingface" / "download" / "model-00001-of-00002.safetensors.metadata"
    )
    meta.write_text(f"{'b' * 40}\n{'c' * 40}\n1764979200.0\n")  # a git blob's SHA-1: not an LFS file
    with pytest.raises(FormatError, match="names no SHA-256"):
        ws.open_checkpoint(tmp_path / "m", config=ON)


def test_a_folder_not_from_the_hub_has_no_checksum_with_verify_on(tmp_path: Path) -> None:
    write_sharded(tmp_path / "m", shards())
    with pytest.raises(FormatError, match="not downloaded from the Hugging Face Hub"):
        ws.open_checkpoint(tmp_path / "m", config=ON)


def test_a_manifest_is_used_before_the_hubs_hash(tmp_path: Path) -> None:
    from weightstream.cli.main import main as cli
    from weightstream.format.manifest import MANIFEST_NAME

    want = local_dir(tmp_path / "m", shards())
    assert cli(["manifest", str(tmp_path / "m"), "-o", str(tmp_path / "m" / MANIFEST_NAME)]) == 0
    with ws.open_checkpoint(tmp_path / "m", config=ON) as ck:
        assert all(s.digest is not None and s.digest.from_manifest for s in ck.shards)
        assert_same(ck.load(), want)
