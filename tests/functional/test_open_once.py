"""A location is parsed once and each shard opened once per load (issue 15).

Counted on real loads of a 4-shard checkpoint, local and on an S3-compatible store: every URI
parse made by weightstream's own code (``urllib.parse.urlparse`` called from a weightstream
frame), every ``os.open`` by path and flags, and every request to the store by kind.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save, save_file

import weightstream as ws
from weightstream.errors import FormatError
from weightstream.location import parse_location

from ..conftest import assert_same, random_tensor
from .conftest import bucket, put_checkpoint


def four_shards() -> list[dict[str, torch.Tensor]]:
    return [{f"layer{i}.w": random_tensor((256, 64), torch.float16, seed=i)} for i in range(4)]


def write_local(folder: Path) -> dict[str, torch.Tensor]:
    import json

    folder.mkdir()
    weight_map, everything = {}, {}
    for i, shard in enumerate(four_shards(), 1):
        name = f"model-{i:05d}-of-00004.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update(dict.fromkeys(shard, name))
        everything.update(shard)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return everything


def count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """URIs parsed into locations (every call of ``parse_location``, the one parser, whoever
    imported it by name), and every ``urllib.parse`` call from weightstream's own code (a second
    parser would show up there)."""
    parsed: list[str] = []
    code = parse_location.__code__

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            parsed.append(os.fspath(frame.f_locals["uri"]))

    sys.setprofile(profile)  # removed after the test (_no_profile_left)
    for name in ("urlparse", "urlsplit", "unquote"):
        real = getattr(urllib.parse, name)

        def counting(url: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__", "").startswith("weightstream"):
                parsed.append(f"urllib:{url}")
            return _real(url, *args, **kwargs)

        monkeypatch.setattr(urllib.parse, name, counting)
    return parsed


@pytest.fixture(autouse=True)
def _no_profile_left() -> Any:
    yield
    sys.setprofile(None)


def test_a_local_four_shard_load_parses_once_and_opens_each_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = write_local(tmp_path / "m")
    ws.load(tmp_path / "m")  # the first use imports what it needs: not counted
    parsed = count_parses(monkeypatch)
    opens: collections.Counter[tuple[str, bool]] = collections.Counter()
    real_open = os.open

    def counting_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opens[(os.fspath(path), bool(flags & getattr(os, "O_DIRECT", 0)))] += 1
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting_open)
    got = ws.load(tmp_path / "m", config=ws.StreamConfig(direct_io="auto"))
    assert_same(got, want)
    assert parsed == [str(tmp_path / "m")]
    shards = sorted((tmp_path / "m").glob("*.safetensors"))
    assert len(shards) == 4
    index = str(tmp_path / "m" / "model.safetensors.index.json")
    mine = {k: n for k, n in opens.items() if k[0].startswith(str(tmp_path))}
    # the index once; each shard once buffered (header and buffered reads) and, where the file
    # system allows it, once with O_DIRECT; nothing else
    assert mine.pop((index, False)) == 1
    for shard in shards:
        assert mine.pop((str(shard), False)) == 1
        assert mine.pop((str(shard), True), 1) == 1
    assert mine == {}


def test_an_object_store_four_shard_load_lists_once_and_reads_each_header_once(
    s3: Any, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    import obstore

    from weightstream.sources.object_store.direct import DirectS3

    b = bucket(s3, "open-once")
    want = put_checkpoint(s3, b, "m", four_shards())
    config = ws.StreamConfig.from_env().replace_object_store(endpoint=os.environ["AWS_ENDPOINT_URL"])
    ws.load(f"s3://{b}/m", config=config)  # warms the imports and the client cache: not counted
    parsed = count_parses(monkeypatch)
    requests: collections.Counter[str] = collections.Counter()
    for name in ("head_async", "get_async", "list_with_delimiter_async"):
        real = getattr(obstore, name)

        def counting(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            requests[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(obstore, name, counting)
    real_get = DirectS3.get_into

    def counting_get(*args: Any, **kwargs: Any) -> Any:  # the one-copy transport's GETs
        requests["get_async"] += 1
        return real_get(*args, **kwargs)

    monkeypatch.setattr(DirectS3, "get_into", counting_get)
    from weightstream.sources.object_store import checksum

    real_head = checksum._head

    def counting_head(*args: Any, **kwargs: Any) -> Any:  # the HEAD asking for a store's checksum
        requests["checksum_head"] += 1
        return real_head(*args, **kwargs)

    monkeypatch.setattr(checksum, "_head", counting_head)
    ckpt = ws.open_checkpoint(f"s3://{b}/m", config=config)
    opened = dict(requests)
    got = ckpt.load()
    ckpt.close()
    assert_same(got, want)
    assert parsed == [f"s3://{b}/m"]
    # one listing (sizes of every shard, so no HEAD for them), the index, one GET per header,
    # and one HEAD per object asking for the checksum the store keeps (boto3 uploads with CRC32)
    assert opened == {"list_with_delimiter_async": 1, "get_async": 1 + 4, "checksum_head": 4}
    # the load: GETs of tensor data only, on the sources the headers were read through
    assert requests["head_async"] == 0 and requests["list_with_delimiter_async"] == 1
    assert requests["get_async"] - opened["get_async"] == ckpt.last_stats.requests["requests"]  # type: ignore[union-attr]


def count_resolutions(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Every resolution of a load's settings from the environment (``StreamConfig.from_env``)
    and of its process group (``resolve_group``), by name."""
    import weightstream.distributed as distributed

    counts: collections.Counter[str] = collections.Counter()
    real_env = ws.StreamConfig.from_env.__func__  # type: ignore[attr-defined]

    def from_env(cls: type, *args: Any, **kwargs: Any) -> Any:
        counts["from_env"] += 1
        return real_env(cls, *args, **kwargs)

    real_group = distributed.resolve_group

    def resolve_group(*args: Any, **kwargs: Any) -> Any:
        counts["group"] += 1
        return real_group(*args, **kwargs)

    monkeypatch.setattr(ws.StreamConfig, "from_env", classmethod(from_env))
    monkeypatch.setattr(distributed, "resolve_group", resolve_group)
    return counts


@pytest.mark.parametrize("entry", ["load", "stream", "load_into", "checkpoint_load"])
def test_a_load_resolves_its_settings_and_its_group_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    """Followed through a load: the settings read from the environment (a profile file would be
    read each time) and the group entered once, whichever entry point starts it."""
    want = write_local(tmp_path / "m")
    profile = tmp_path / "profile.json"  # as `weightstream tune` writes it
    profile.write_text('{"settings": {"concurrency": 6}}')
    monkeypatch.setenv("WEIGHTSTREAM_PROFILE", str(profile))
    counts = count_resolutions(monkeypatch)
    if entry == "load":
        got = ws.load(tmp_path / "m")
    elif entry == "stream":
        with ws.stream(tmp_path / "m") as s:
            got = dict(s)
        assert s.config.concurrency == 6
    elif entry == "load_into":
        module = torch.nn.Module()
        for name, t in want.items():
            module.register_buffer(name.replace(".", "_"), torch.empty_like(t))
        ws.load_into(module, tmp_path / "m", strict=False)  # names differ: counted, not compared
        got = want
    else:
        with ws.open_checkpoint(tmp_path / "m") as ckpt:
            got = ckpt.load()
    assert_same(got, want)
    assert counts == {"from_env": 1, "group": 1}


def test_a_stream_holds_what_it_reads_not_the_checkpoint(tmp_path: Path) -> None:
    """The stream takes the shards, the settings and the exchange: nothing in it leads back to
    the checkpoint it came from (a stream of :func:`weightstream.stream` holds only the
    callback that closes it)."""
    import gc

    want = write_local(tmp_path / "m")
    with ws.open_checkpoint(tmp_path / "m") as ckpt:
        s = ckpt.stream()
        seen, todo = set(), [s]
        while todo:  # everything the stream reaches, but the shared modules and classes
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, type | type(sys)):
                continue
            seen.add(id(obj))
            assert obj is not ckpt, "the stream reaches back to its checkpoint"
            todo.extend(gc.get_referents(obj))
        with s:
            assert_same(dict(s), want)


def test_typed_locations_are_taken_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that parsed its locations (the vLLM adapter) passes them: nothing is parsed again,
    as one location or as a list."""
    from weightstream.location import LocalPath

    want = write_local(tmp_path / "m")
    files = [LocalPath(str(p)) for p in sorted((tmp_path / "m").glob("*.safetensors"))]
    ws.load(files)  # the first use imports what it needs: not counted
    parsed = count_parses(monkeypatch)
    assert_same(ws.load(files), want)
    assert_same(ws.load(LocalPath(str(tmp_path / "m"))), want)
    with ws.open_checkpoint(files[0]) as ckpt:
        assert ckpt.uri == str(files[0])
    assert parsed == []


@pytest.mark.parametrize("settings", ["direct_io off", "direct_io on", "an object store's"])
def test_a_load_with_other_settings_reads_the_version_its_header_was_read_at(
    tmp_path: Path, s3: Any, settings: str
) -> None:
    """A load whose settings differ from the checkpoint's opens its own sources: those must read
    the file or object the headers were read from, or fail, never other bytes of the same size
    (a file rewritten in place was read without a word when the load asked another direct_io)."""
    if settings == "an object store's":
        b = bucket(s3, "otherset")
        put_checkpoint(s3, b, "m", [{"t": torch.zeros(4096)}], index=False)
        uri: str | Path = f"s3://{b}/m/model-00001-of-00001.safetensors"
        ck = ws.open_checkpoint(uri)
        body = save({"t": torch.ones(4096)})  # same header, same size, other bytes
        s3.put_object(Bucket=b, Key="m/model-00001-of-00001.safetensors", Body=body)
        size = len(body)
        base = ws.StreamConfig.from_env()
        other = base.replace(object_store=dataclasses.replace(base.object_store, concurrency=3))
    else:
        uri = tmp_path / "model.safetensors"
        save_file({"t": torch.zeros(4096)}, str(uri))
        ck = ws.open_checkpoint(uri)
        data = bytearray(uri.read_bytes())
        data[-4:] = torch.ones(1).numpy().tobytes()
        with open(uri, "r+b") as f:
            f.write(data)
        size = len(data)
        other = ws.StreamConfig(direct_io=settings.split()[1])
    with ck, pytest.raises(FormatError, match=r"changed since its header was read|version") as info:
        ck.load(config=other)
    assert info.value.uri is not None and "model" in info.value.uri
    assert info.value.byte_range == (0, size)  # the whole file: which bytes changed is not known
