"""The Run:ai drop-in: the same script against ``runai_model_streamer`` and
``weightstream.compat.runai`` gives the same tensors; its environment is honoured."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from weightstream.compat import runai as shim
from weightstream.errors import ConfigError, ReadError, WeightStreamError

from ..conftest import ALL_TORCH_DTYPES, as_bytes, random_tensor, reference, write_sharded
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
    for i, dt in enumerate(
        d for d in ALL_TORCH_DTYPES if d not in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    ):
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
    oc, store = c.object_store, c.for_remote()  # Run:ai's one depth and read size, object stores too
    assert (store.concurrency, store.chunk_size, oc.request_timeout, oc.low_speed_limit) == (
        3,
        1 << 20,
        2.5,
        2048,
    )
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


def test_distributed_switch_decides_as_runai_does() -> None:
    """Run:ai splits the reads by default only on a NCCL group for a non-CPU device; RUNAI_STREAMER_DIST=1
    allows any group; 0 never."""
    assert shim.distributed_from_runai(False, {}) is False
    assert shim.distributed_from_runai(True, {}) is False  # CPU: not by default
    assert shim.distributed_from_runai(True, {}, device="cpu") is False
    assert shim.distributed_from_runai(True, {"RUNAI_STREAMER_DIST": "0"}, device="cuda") is False
    assert shim.distributed_from_runai(True, {"RUNAI_STREAMER_DIST": "1"}) == "auto"
    assert shim.distributed_from_runai(True, {}, device="cuda") is False  # torch.distributed not initialised
    with pytest.raises(ConfigError, match="RUNAI_STREAMER_DIST"):
        shim.distributed_from_runai(True, {"RUNAI_STREAMER_DIST": "yes"})


def test_bad_calls_are_refused(checkpoint: list[str]) -> None:
    with shim.SafetensorsStreamer() as s:
        assert list(s.get_tensors()) == []  # before any stream_files: nothing, as Run:ai
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


# -- where Run:ai's own tests found the drop-in behaving differently -------------------------------


def test_a_name_two_files_hold_is_yielded_twice_unless_filtered(tmp_path: Path, runai: Any) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": torch.ones(3), "y": torch.zeros(2)}, str(a))
    save_file({"x": torch.full((3,), 2.0), "z": torch.ones(1)}, str(b))
    for module in (runai, shim):
        with module.SafetensorsStreamer() as s:
            s.stream_files([str(a), str(b)])
            got = [(n, t.clone()) for n, t in s.get_tensors()]
        assert sorted(n for n, _ in got) == ["x", "x", "y", "z"], module
        assert sorted(float(t[0]) for n, t in got if n == "x") == [1.0, 2.0]
        with pytest.raises(ValueError), module.SafetensorsStreamer() as s:
            s.stream_files([str(a), str(b)], tensor_names=["x"])


@pytest.mark.parametrize("limit", ["0", "1", "2048", "4095"])
def test_a_memory_limit_below_a_page_reads_one_tensor_at_a_time(
    checkpoint: list[str], monkeypatch: pytest.MonkeyPatch, limit: str, runai: Any
) -> None:
    """0 is Run:ai's "the largest tensor"; other limits below a tensor Run:ai refuses, and the
    drop-in loads one tensor at a time."""
    monkeypatch.setenv("RUNAI_STREAMER_MEMORY_LIMIT", limit)
    assert shim.config_from_runai_env().memory_limit == 4096
    want = {}
    for f in checkpoint:
        want.update(reference(f))
    ours = script(shim, checkpoint)
    same(ours, want)
    if limit == "0":
        same(ours, script(runai, checkpoint))


def test_more_runai_variables_are_honoured(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    import logging

    monkeypatch.setenv("RUNAI_STREAMER_S3_UNSIGNED", "1")
    monkeypatch.setenv("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
    monkeypatch.setenv("RUNAI_STREAMER_DIST_TIMEOUT", "45")
    monkeypatch.setenv("RUNAI_STREAMER_LOG_LEVEL", "debug")
    logger = logging.getLogger("weightstream")
    before = logger.level
    try:
        c = shim.config_from_runai_env()
        assert c.object_store.anonymous is True and c.object_store.addressing == "path"
        assert c.exchange_timeout == 45
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)
    monkeypatch.setenv("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "1")
    assert shim.config_from_runai_env().object_store.addressing == "virtual"
    monkeypatch.setenv("WEIGHTSTREAM_S3_ADDRESSING", "path")  # ours win
    assert shim.config_from_runai_env().object_store.addressing == "path"
    for var, bad in (
        ("RUNAI_STREAMER_S3_UNSIGNED", "maybe"),
        ("RUNAI_STREAMER_DIST_TIMEOUT", "soon"),
        ("RUNAI_STREAMER_LOG_LEVEL", "LOUD"),
    ):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ConfigError, match=var):
            shim.config_from_runai_env()
        monkeypatch.delenv(var)


def test_list_safetensors_pull_files_and_object_storage_model(s3: Any, tmp_path: Path) -> None:
    """What vLLM imports from the Run:ai package for object-store models."""
    b = bucket(s3, "runai-pull")
    want = put_checkpoint(
        s3, b, "m", [{"a": random_tensor((300, 7), torch.float16)}, {"b": random_tensor((5,), torch.int64)}]
    )
    s3.put_object(Bucket=b, Key="m/config.json", Body=b'{"model_type": "llama"}')
    s3.put_object(Bucket=b, Key="m/tok/tokenizer.json", Body=b"{}")
    listed = shim.list_safetensors(f"s3://{b}/m")
    assert listed == [f"s3://{b}/m/model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    local = tmp_path / "local"
    local.mkdir()
    (local / "x.safetensors").write_bytes(b"")
    assert shim.list_safetensors(str(local)) == [str(local / "x.safetensors")]

    dst = tmp_path / "pulled"
    shim.pull_files(f"s3://{b}/m/", str(dst), allow_pattern=["*.json"], ignore_pattern=["*.index.json"])
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == [
        "config.json",
        "tok/tokenizer.json",
    ]
    shim.pull_files(f"s3://{b}/m", str(dst / "all"))
    got = {}
    for f in sorted((dst / "all").glob("*.safetensors")):
        got.update(__import__("safetensors.torch", fromlist=["load_file"]).load_file(str(f)))
    same(got, want)
    with pytest.raises(NotImplementedError):
        shim.pull_files(str(local), str(dst / "x"))

    cache = tmp_path / "cache" / "m"
    with shim.ObjectStorageModel(model_path=f"s3://{b}/m", dst=str(cache)) as model:
        model.pull_files(allow_pattern=["*.json"])
    assert (cache / "config.json").read_bytes() == b'{"model_type": "llama"}'
    assert (cache / shim.ObjectStorageModel.SENTINEL_NAME).exists()
    (cache / "config.json").write_bytes(b"kept")  # a second user finds it complete and pulls nothing
    with shim.ObjectStorageModel(model_path=f"s3://{b}/m", dst=str(cache)) as model:
        model.pull_files(allow_pattern=["*.json"])
    assert (cache / "config.json").read_bytes() == b"kept"
    with (
        pytest.raises(RuntimeError, match="No files were downloaded"),
        shim.ObjectStorageModel(model_path=f"s3://{b}/m/nothing-here", dst=str(tmp_path / "empty")) as model,
    ):
        model.pull_files()  # no file: refused at the end, as Run:ai's


def test_runai_suite_plugin_points_only_the_streamer_at_the_drop_in(runai: Any) -> None:
    """make test-runai runs Run:ai's own tests with this plugin; the rest of the wheel stays Run:ai's."""
    import importlib

    from tests.runai_suite.plugin import point_at_drop_in

    module = importlib.import_module("runai_model_streamer.safetensors_streamer.safetensors_streamer")
    theirs = module.SafetensorsStreamer
    restore = point_at_drop_in()
    try:
        assert module.SafetensorsStreamer is shim.SafetensorsStreamer
        assert runai.SafetensorsStreamer is shim.SafetensorsStreamer
        assert module.list_safetensors.__module__.startswith("runai_model_streamer")  # the rest stays theirs
    finally:
        restore()
    assert module.SafetensorsStreamer is theirs and runai.SafetensorsStreamer is theirs


@pytest.fixture
def deletions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every deletion the drop-in attempts, intercepted: one outside ``tmp_path`` fails the test
    before it happens (a deletion of the root or the home folder is never tried for real). HOME
    and the current folder are moved into ``tmp_path``, so that refusing them is tested too."""
    import os
    import shutil

    root = os.path.realpath(tmp_path)
    seen: list[str] = []

    def guard(real: Any) -> Any:
        def deleting(path: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dir_fd") is not None:  # inside an rmtree already checked
                return real(path, *args, **kwargs)
            where = os.path.realpath(os.fspath(path))
            seen.append(where)
            assert where == root or where.startswith(root + os.sep), (
                f"deletion outside the test's tree: {where}"
            )
            return real(path, *args, **kwargs)

        return deleting

    for module, name in (
        (shutil, "rmtree"),
        (os, "unlink"),
        (os, "remove"),
        (os, "rmdir"),
        (os, "removedirs"),
    ):
        monkeypatch.setattr(module, name, guard(getattr(module, name)))
    (tmp_path / "home" / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "home" / "work")
    return seen


@pytest.mark.parametrize(
    "dst", ["", "   ", "/", "//", "/.", "~", "~/", ".", "..", "HOME", "CWD", "TMP_PARENT"]
)
def test_object_storage_model_never_deletes_what_it_did_not_create(
    deletions: list[str], tmp_path: Path, dst: str
) -> None:
    """Run:ai's class takes dst="" (an unset cache variable) or "/" as the root and deletes it."""
    named = {
        "HOME": str(tmp_path / "home"),
        "CWD": str(tmp_path / "home" / "work"),
        "TMP_PARENT": str(tmp_path),
    }
    with pytest.raises(ConfigError, match="dst") as info:
        shim.ObjectStorageModel(model_path="s3://bkt/m", dst=named.get(dst, dst))
    assert isinstance(info.value, ValueError)
    assert deletions == []
    assert (tmp_path / "home" / "work").is_dir()


def test_object_storage_model_refuses_a_folder_of_someone_elses(deletions: list[str], tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match="did not put there"):
        shim.ObjectStorageModel(model_path="s3://bkt/m", dst=str(theirs))
    assert (theirs / "notes.txt").read_text() == "precious" and deletions == []
    link = tmp_path / "link"
    link.symlink_to(theirs)
    with pytest.raises(ConfigError, match="symbolic link"):
        shim.ObjectStorageModel(model_path="s3://bkt/m", dst=str(link))
    assert (theirs / "notes.txt").exists() and deletions == []


def test_object_storage_model_empties_only_its_own_unfinished_folder(
    deletions: list[str], tmp_path: Path
) -> None:
    dst = tmp_path / "cache" / "model"
    model = shim.ObjectStorageModel(model_path="s3://bkt/m", dst=str(dst))  # new: made, marked
    model._release()
    assert (dst / shim.ObjectStorageModel.MARKER_NAME).exists() and deletions == []
    (dst / "half-downloaded.safetensors").write_bytes(b"partial")  # then a crash: no sentinel
    again = shim.ObjectStorageModel(model_path="s3://bkt/m", dst=str(dst) + "/")
    again._release()
    assert sorted(p.name for p in dst.iterdir()) == [shim.ObjectStorageModel.MARKER_NAME]
    assert set(deletions) == {str(dst.resolve())}
    empty = tmp_path / "empty"
    empty.mkdir()
    shim.ObjectStorageModel(model_path="s3://bkt/m", dst=str(empty))._release()  # empty: used as it is
    assert set(deletions) == {str(dst.resolve())}


@pytest.mark.parametrize(
    ("env", "check"),
    [
        (
            {"RUNAI_STREAMER_CONCURRENCY": "100000"},
            lambda c: c.concurrency == 1024 and c.for_remote().concurrency == 1024,
        ),
        (
            {"RUNAI_STREAMER_CHUNK_BYTESIZE": "1"},
            lambda c: c.chunk_size == 4096 and c.for_remote().chunk_size == 4096,
        ),
        ({"RUNAI_STREAMER_CHUNK_BYTESIZE": "100"}, lambda c: c.chunk_size == 4096),
        ({"RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "0"}, lambda c: c.object_store.request_timeout == 60.0),
        ({"RUNAI_STREAMER_S3_UNSIGNED": "2"}, lambda c: c.object_store.anonymous is True),
        ({"RUNAI_STREAMER_S3_UNSIGNED": "0"}, lambda c: c.object_store.anonymous is False),
        (
            {"RUNAI_STREAMER_S3_ENDPOINT": "minio.local:9000"},
            lambda c: c.object_store.endpoint == "https://minio.local:9000",
        ),
        (
            {"RUNAI_STREAMER_S3_ENDPOINT": "http://minio:9000"},
            lambda c: c.object_store.endpoint == "http://minio:9000",
        ),
    ],
)
def test_values_run_ai_takes_are_taken_and_made_safe(env: dict[str, str], check: Any) -> None:
    """Run:ai takes each of these (checked against its wheel: 1-byte chunks, 5,000 threads, a
    zero timeout, UNSIGNED=2); the drop-in takes them too, keeping its own bounds where a value
    would be unsafe (at most 1024 reads in flight, reads of whole 4 KiB, a request never without
    a timeout) and saying so in the log."""
    assert check(shim.config_from_runai_env(env))


def test_a_run_ai_value_still_refused_names_its_variable() -> None:
    for env in ({"RUNAI_STREAMER_CONCURRENCY": "many"}, {"RUNAI_STREAMER_S3_UNSIGNED": "perhaps"}):
        with pytest.raises(ConfigError, match=next(iter(env))):
            shim.config_from_runai_env(env)


def test_tiny_chunks_and_no_files_stream_as_run_ai_streams_them(
    checkpoint: list[str], runai: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNAI_STREAMER_CHUNK_BYTESIZE", "100")
    same(script(shim, checkpoint), script(runai, checkpoint))
    assert script(shim, []) == script(runai, []) == {}
