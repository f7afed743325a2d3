"""The Run:ai drop-in: the same script against ``runai_model_streamer`` and
``weightstream.compat.runai`` gives the same tensors; its environment is honoured."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from weightstream.compat import runai as shim
from weightstream.errors import ConfigError, ReadError, WeightStreamError

from ..conftest import ALL_TORCH_DTYPES, as_bytes, random_tensor, write_sharded
from .conftest import bucket, put_checkpoint


@pytest.fixture
def runai() -> Any:
    """The Run:ai streamer itself, for the tests that compare with it (the others run without it)."""
    return pytest.importorskip("runai_model_streamer")


def script(module: Any, paths: list[str], **kwargs: Any) -> dict[str, torch.Tensor]:
    """What a user's code does with either streamer: only the import differs."""
    out = {}
    with module.SafetensorsStreamer() as streamer:
        streamer.stream_files(paths, device="cpu", **kwargs)
        for name, tensor in streamer.get_tensors():
            out[name] = tensor
    return out


@pytest.fixture
def checkpoint(tmp_path: Path, clean_env: None) -> list[str]:
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    # The Run:ai streamer has no F8_E4M3FNUZ / F8_E5M2FNUZ.
    for i, dt in enumerate(d for d in ALL_TORCH_DTYPES if d not in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)):
        shards[i % 2][f"t{i}"] = random_tensor((5, 7 + i), dt, seed=i)
    shards[0]["big"] = random_tensor((1 << 20,), torch.bfloat16, seed=99)
    shards[1]["scalar"] = random_tensor((), torch.float64, seed=98)
    write_sharded(tmp_path, shards)
    return sorted(str(p) for p in tmp_path.glob("*.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(as_bytes(a[k]), as_bytes(b[k])), k


def test_same_tensors_as_runai(checkpoint: list[str], runai: Any) -> None:
    same(script(shim, checkpoint), script(runai, checkpoint))


def test_same_subset_as_runai(checkpoint: list[str], runai: Any) -> None:
    names = ["big", "t3", "scalar"]
    ours = script(shim, checkpoint, tensor_names=names)
    assert set(ours) == set(names)
    same(ours, script(runai, checkpoint, tensor_names=names))


def test_stream_file_and_owned_flag(checkpoint: list[str], runai: Any) -> None:
    with shim.SafetensorsStreamer() as s:
        s.stream_file(checkpoint[0], owned=False)
        ours = dict(s.get_tensors())
    with runai.SafetensorsStreamer() as s:
        s.stream_file(checkpoint[0])
        theirs = dict(s.get_tensors())
    same(ours, theirs)


def test_runai_environment_is_honoured(
    checkpoint: list[str], monkeypatch: pytest.MonkeyPatch, runai: Any
) -> None:
    monkeypatch.setenv("RUNAI_STREAMER_CONCURRENCY", "3")
    monkeypatch.setenv("RUNAI_STREAMER_CHUNK_BYTESIZE", "1048576")
    monkeypatch.setenv("RUNAI_STREAMER_MEMORY_LIMIT", "-1")
    monkeypatch.setenv("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "2500")
    monkeypatch.setenv("RUNAI_STREAMER_S3_LOW_SPEED_LIMIT", "2048")
    c = shim.config_from_runai_env()
    assert (c.concurrency, c.chunk_size, c.memory_limit) == (3, 1 << 20, 1 << 62)
    oc = c.object_store
    assert (oc.concurrency, oc.chunk_size, oc.request_timeout, oc.low_speed_limit) == (3, 1 << 20, 2.5, 2048)
    with shim.SafetensorsStreamer() as s:
        s.stream_files(checkpoint)
        got = dict(s.get_tensors())
        assert s.stats is not None and s.stats.complete
        assert s.stats.settings["concurrency"] == 3 and s.stats.settings["chunk_size"] == 1 << 20
    same(got, script(runai, checkpoint))


def test_weightstream_variables_win(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    monkeypatch.setenv("RUNAI_STREAMER_CONCURRENCY", "3")
    monkeypatch.setenv("WEIGHTSTREAM_CONCURRENCY", "5")
    monkeypatch.setenv("WEIGHTSTREAM_S3_CONCURRENCY", "7")
    c = shim.config_from_runai_env()
    assert (c.concurrency, c.object_store.concurrency) == (5, 7)


def test_distributed_switch() -> None:
    assert shim.distributed_from_runai(False, {}) is False
    assert shim.distributed_from_runai(True, {}) == "auto"
    assert shim.distributed_from_runai(True, {"RUNAI_STREAMER_DIST": "0"}) is False
    assert shim.distributed_from_runai(True, {"RUNAI_STREAMER_DIST": "1"}) == "auto"
    with pytest.raises(ConfigError, match="RUNAI_STREAMER_DIST"):
        shim.distributed_from_runai(True, {"RUNAI_STREAMER_DIST": "yes"})


def test_bad_calls_are_refused(checkpoint: list[str]) -> None:
    with shim.SafetensorsStreamer() as s:
        with pytest.raises(ConfigError, match="before stream_file"):
            next(s.get_tensors())
        with pytest.raises(ConfigError, match="not a single str"):
            s.stream_files(checkpoint, tensor_names="big")
    keys = types.SimpleNamespace(
        access_key_id="AKIA", secret_access_key="x", session_token=None, endpoint=None
    )
    with pytest.raises(ConfigError, match="explicit keys"):
        shim.config_from_runai_env({}, keys)


def test_object_store_through_runai_endpoint_variable(
    s3: Any, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = put_checkpoint(s3, bucket(s3, "runai-shim"), "m", [{"a": random_tensor((300, 7), torch.float16)}])
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("RUNAI_STREAMER_S3_ENDPOINT", s3_endpoint)
    got = script(shim, ["s3://runai-shim/m/model-00001-of-00001.safetensors"])
    same(got, want)
    region = types.SimpleNamespace(
        access_key_id=None,
        secret_access_key=None,
        session_token=None,
        endpoint=s3_endpoint,
        region_name="us-east-1",
    )
    monkeypatch.delenv("RUNAI_STREAMER_S3_ENDPOINT")
    same(script(shim, ["s3://runai-shim/m/model-00001-of-00001.safetensors"], s3_credentials=region), want)


# -- errors: code written for the Run:ai streamer catches ValueError --------------------------------


def _broken(tmp_path: Path, case: str, good: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Inputs that make the Run:ai streamer raise ValueError."""
    if case == "missing file":
        return [str(tmp_path / "nope.safetensors")], {}
    if case == "unknown tensor name":
        return good, {"tensor_names": ["t0", "no.such.tensor"]}
    if case == "truncated file":
        p = tmp_path / "short.safetensors"
        p.write_bytes(Path(good[0]).read_bytes()[:-10])
        return [str(p)], {}
    if case == "malformed header":
        p = tmp_path / "bad.safetensors"
        p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}")
        return [str(p)], {}
    if case == "a directory":
        d = tmp_path / "dir.safetensors"
        d.mkdir()
        return [str(d)], {}
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case", ["missing file", "unknown tensor name", "truncated file", "malformed header", "a directory"]
)
def test_every_failure_is_the_value_error_runai_code_catches(
    checkpoint: list[str], tmp_path: Path, case: str, runai: Any
) -> None:
    paths, kwargs = _broken(tmp_path, case, checkpoint)
    with pytest.raises(ValueError):  # what Run:ai raises, and what code written for it catches
        script(runai, paths, **kwargs)
    with pytest.raises(ValueError) as info:
        script(shim, paths, **kwargs)
    err = info.value
    assert isinstance(err, WeightStreamError) and err.uri is not None
    if case in ("missing file", "unknown tensor name", "a directory"):
        assert isinstance(err, FileNotFoundError)  # and weightstream's own class still matches


def test_read_errors_during_the_stream_are_value_errors_too(
    checkpoint: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file truncated while it is read fails in get_tensors(), not stream_files()."""
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(Path(checkpoint[0]).read_bytes())
    monkeypatch.setenv("RUNAI_STREAMER_CHUNK_BYTESIZE", "65536")
    monkeypatch.setenv("RUNAI_STREAMER_MEMORY_LIMIT", "65536")
    monkeypatch.setenv("RUNAI_STREAMER_CONCURRENCY", "1")
    with shim.SafetensorsStreamer() as s:
        s.stream_files([str(victim)])
        tensors = s.get_tensors()
        next(tensors)
        with open(victim, "r+b") as fh:
            fh.truncate(victim.stat().st_size // 2)
        with pytest.raises(ValueError) as info:
            dict(tensors)
    assert isinstance(info.value, ReadError) and isinstance(info.value, OSError)
    assert info.value.__cause__ is not None


def test_every_weightstream_error_class_has_a_value_error_form() -> None:
    from weightstream import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        mapped = shim._as_runai(cls("why", uri="u", tensor="t", byte_range=(1, 2)))
        assert isinstance(mapped, ValueError) and isinstance(mapped, cls), name
        assert (mapped.uri, mapped.tensor, mapped.byte_range) == ("u", "t", (1, 2))
