"""An S3 object's own checksum (``x-amz-checksum-*``), checked while the load reads, where no
manifest gives one: a real S3-compatible server (moto) on loopback, both transports, a proxy
that flips a bit on the way, and a server that enforces signatures."""

from __future__ import annotations

import socket
import time
from typing import Any

import crc32c
import pytest
import torch
from safetensors.torch import save

import weightstream as ws
from weightstream.config import ObjectStoreConfig
from weightstream.errors import FormatError
from weightstream.location import ObjectLocation
from weightstream.sources.object_store.checksum import store_checksum

from ..conftest import accepted, assert_same, random_tensor
from ..faultproxy import FaultProxy
from .conftest import bucket

BUCKET = "store-checksum-tests"


def parts(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"s{s}.t{i}": random_tensor((900 + 31 * i, 24), torch.float32, seed=seed + 10 * s + i)
            for i in range(5)
        }
        for s in range(2)
    ]


def put(client, prefix: str, shards: list[dict[str, torch.Tensor]], **kw: str) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The shards as one object each (``kw``: put_object's checksum arguments), and an index."""
    import json

    b = bucket(client, BUCKET)
    weight_map, everything = {}, {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        client.put_object(Bucket=b, Key=f"{prefix}/{name}", Body=save(shard), **kw)
        weight_map.update(dict.fromkeys(shard, name))
        everything.update(shard)
    body = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    client.put_object(Bucket=b, Key=f"{prefix}/model.safetensors.index.json", Body=body)
    return everything


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "CRC32"])
def test_the_stores_checksum_checks_every_byte(s3, transport: str, algorithm: str) -> None:  # type: ignore[no-untyped-def]
    want = put(s3, f"all-{algorithm}", parts(), ChecksumAlgorithm=algorithm)
    with ws.open_checkpoint(f"s3://{BUCKET}/all-{algorithm}") as ck:
        for shard in ck.shards:
            assert shard.digest is not None
            assert shard.digest.algorithm == algorithm.lower()
            assert shard.digest.origin == f"the store (x-amz-checksum-{algorithm.lower()})"
        assert_same(ck.load(), want)
        stats = ck.last_stats
        assert stats is not None
        assert stats.checked_bytes == sum(s.size for s in ck.shards)
        assert stats.unchecked_bytes == 0


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32"])
def test_a_bit_flipped_on_the_way_fails_the_load_naming_the_object(  # type: ignore[no-untyped-def]
    s3, proxy: FaultProxy, transport: str, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    tensors = {"w": random_tensor((3000, 40), torch.float32, seed=7)}
    b = bucket(s3, BUCKET)
    s3.put_object(
        Bucket=b, Key=f"flip-{algorithm}/model.safetensors", Body=save(tensors), ChecksumAlgorithm=algorithm
    )
    uri = f"s3://{b}/flip-{algorithm}/model.safetensors"
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    size = ws.open_checkpoint(uri).shards[0].size

    # the same fault, unchecked: the load "succeeds" with a wrong tensor (the fault is real)
    proxy.fail_next("flip", 1, after=1, at=-1000)  # after the header's read, in the body's data
    got = ws.load(uri, config=ws.StreamConfig.from_env(verify="off"))
    assert proxy.injected.get("flip") == 1
    assert not torch.equal(got["w"], tensors["w"])

    proxy.fail_next("flip", 1, after=1, at=-1000)
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        ws.load(uri)
    assert proxy.injected.get("flip") == 2
    text = str(info.value)
    assert uri in text
    assert f"x-amz-checksum-{algorithm.lower()}" in text
    assert info.value.byte_range == (0, size)


def test_stream_hands_blocks_over_without_holding_the_whole_object(s3, transport: str) -> None:  # type: ignore[no-untyped-def]
    """A whole-object checksum is known at the object's last byte: holding its blocks till then
    would hold the whole shard, past memory_limit. They are handed over as read; the check is
    still made (and a mismatch raises from the stream, tested above through load())."""
    big = [
        {f"s{s}.t{i}": random_tensor((1 << 18,), torch.float32, seed=s * 8 + i) for i in range(8)}
        for s in range(2)
    ]
    want = put(s3, "stream", big, ChecksumAlgorithm="CRC64NVME")  # two 8 MiB objects
    config = ws.StreamConfig.from_env(memory_limit=3 << 20, autotune=False)
    config = config.replace_object_store(chunk_size=1 << 20, concurrency=2)
    with ws.open_checkpoint(f"s3://{BUCKET}/stream", config=config) as ck:
        stream = ck.stream()
        got = {name: t.clone() for name, t in stream}
        stats = stream.stats
    assert_same(got, want)
    assert stats is not None and stats.checked_bytes == sum(s.size for s in ck.shards)


def test_a_flipped_bit_ends_a_stream_with_the_error(  # type: ignore[no-untyped-def]
    s3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = {f"t{i}": random_tensor((1 << 18,), torch.float32, seed=i) for i in range(8)}
    b = bucket(s3, BUCKET)
    s3.put_object(Bucket=b, Key="sflip/model.safetensors", Body=save(big), ChecksumAlgorithm="CRC32C")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    config = ws.StreamConfig.from_env(autotune=False).replace_object_store(chunk_size=1 << 20, concurrency=2)
    proxy.fail_next("flip", 1, after=3, at=100)
    seen = []
    with pytest.raises(FormatError, match="x-amz-checksum-crc32c"):
        for name, _ in ws.stream(f"s3://{b}/sflip/model.safetensors", config=config):
            seen.append(name)
    assert len(seen) < len(big)  # never the whole object as if it were good


def test_a_manifest_is_used_before_the_stores_checksum(s3, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from weightstream.format.manifest import MANIFEST_NAME, dump_manifest
    from weightstream.tools.manifest import digests

    want = put(s3, "both", parts(), ChecksumAlgorithm="CRC32")
    with ws.open_checkpoint(f"s3://{BUCKET}/both", config=ws.StreamConfig.from_env(verify="off")) as ck:
        text = dump_manifest(digests(ck, piece_size=64 << 10), piece_size=64 << 10)
    s3.put_object(Bucket=BUCKET, Key=f"both/{MANIFEST_NAME}", Body=text.encode())
    with ws.open_checkpoint(f"s3://{BUCKET}/both") as ck:
        assert all(
            s.digest is not None and s.digest.from_manifest and s.digest.piece_size == 64 << 10
            for s in ck.shards
        )
        assert_same(ck.load(), want)


def test_a_sha256_the_store_keeps_is_checked_with_verify_on_only(s3, transport: str) -> None:  # type: ignore[no-untyped-def]
    """SHA-256 does not combine: hashing it in order costs 1.8 GB/s a file, so only where asked."""
    want = put(s3, "sha", parts(), ChecksumAlgorithm="SHA256")
    with ws.open_checkpoint(f"s3://{BUCKET}/sha") as ck:
        assert all(s.digest is None for s in ck.shards)
        assert_same(ck.load(), want)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == 0
    with ws.open_checkpoint(f"s3://{BUCKET}/sha", config=ws.StreamConfig.from_env(verify="on")) as ck:
        assert all(s.digest is not None and s.digest.algorithm == "sha256" for s in ck.shards)
        assert_same(ck.load(), want)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == sum(s.size for s in ck.shards)


def test_a_bit_flipped_under_a_sha256_fails_with_verify_on(  # type: ignore[no-untyped-def]
    s3, proxy: FaultProxy, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {"w": random_tensor((3000, 40), torch.float32, seed=8)}
    b = bucket(s3, BUCKET)
    s3.put_object(Bucket=b, Key="flip-sha/model.safetensors", Body=save(tensors), ChecksumAlgorithm="SHA256")
    uri = f"s3://{b}/flip-sha/model.safetensors"
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    proxy.fail_next("flip", 1, after=1, at=-1000)
    with pytest.raises(FormatError, match="x-amz-checksum-sha256") as info:
        ws.load(uri, config=ws.StreamConfig.from_env(verify="on"))
    assert proxy.injected.get("flip") == 1 and uri in str(info.value)


def multipart(client, key: str, body: bytes, parts: list[int], **kw: str) -> str:  # type: ignore[no-untyped-def]
    """``body`` uploaded in parts of the sizes given (the last: the rest), with ``kw``'s checksum."""
    b = bucket(client, BUCKET)
    up = client.create_multipart_upload(Bucket=b, Key=key, **kw)
    done, start = [], 0
    for n, size in enumerate([*parts, len(body) - sum(parts)], 1):
        r = client.upload_part(
            Bucket=b, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=body[start : start + size],
            ChecksumAlgorithm=kw["ChecksumAlgorithm"],
        )  # fmt: skip
        field = f"Checksum{kw['ChecksumAlgorithm']}"
        done.append({"PartNumber": n, "ETag": r["ETag"], field: r[field]})
        start += size
    client.complete_multipart_upload(
        Bucket=b, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": done}
    )
    return f"s3://{b}/{key}"


def heads_asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The checksum HEADs sent from now on, as they are sent: ``0`` the object's, ``N`` part N's."""
    from weightstream.sources.object_store import checksum

    heads: list[int] = []
    real_head = checksum._head

    def head(*args: Any, part: int = 0, **kw: Any) -> Any:
        heads.append(part)
        return real_head(*args, part=part, **kw)

    monkeypatch.setattr(checksum, "_head", head)
    return heads


def twelve_mib() -> tuple[dict[str, torch.Tensor], bytes]:
    tensors = {f"w{i}": random_tensor((3 << 20,), torch.uint8, seed=30 + i) for i in range(4)}
    return tensors, save(tensors)


@pytest.mark.parametrize("algorithm", ["CRC32C", "CRC32"])
@pytest.mark.parametrize("sizes", [[5 << 20, 5 << 20], []], ids=["3-parts", "1-part"])
def test_a_composite_of_parts_of_one_size_is_checked_asking_two_parts(  # type: ignore[no-untyped-def]
    s3, transport: str, monkeypatch: pytest.MonkeyPatch, algorithm: str, sizes: list[int]
) -> None:
    """Part 1 and the last are asked for their ranges (not each part: a HEAD each costs a
    round trip and CPU), each piece's CRC is computed as read, and their composite is checked
    at the last byte."""
    tensors, body = twelve_mib()
    n = len(sizes) + 1
    uri = multipart(s3, f"multi-{algorithm}-{n}/model.safetensors", body, sizes,
                    ChecksumAlgorithm=algorithm, ChecksumType="COMPOSITE")  # fmt: skip
    heads = heads_asked(monkeypatch)
    with ws.open_checkpoint(uri) as ck:
        digest = ck.shards[0].digest
        assert digest is not None and digest.algorithm == algorithm.lower() and digest.composite
        assert digest.piece_size == (sizes[0] if sizes else len(body)) and digest.count == n
        assert f"the composite of {n} parts" in digest.origin
        assert_same(ck.load(), tensors)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == len(body)
    assert sorted(heads) == sorted([0, *{1, n}])  # the object, part 1 and the last


@pytest.mark.parametrize(
    ("sizes", "after", "bad", "named"),
    [
        ([5 << 20, 5 << 20], 7, (5 << 20, 10 << 20), ["(part 2)", "the composite of 3 parts"]),
        ([5 << 20, 6 << 20], 8, (5 << 20, 11 << 20), ["each of 3 parts"]),
    ],
    ids=["parts-of-one-size", "parts-of-other-sizes"],
)
def test_a_bit_flipped_in_a_part_names_that_parts_range(  # type: ignore[no-untyped-def]
    s3,
    proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    after: int,
    bad: tuple[int, int],
    named: list[str],
) -> None:
    """Parts of one size: the composite fails at the last byte and the parts, asked then, name
    the one; of other sizes: the part is checked, and fails, as it is read."""
    tensors, body = twelve_mib()
    uri = multipart(s3, f"multi-flip-{len(named)}/model.safetensors", body, sizes,
                    ChecksumAlgorithm="CRC32C", ChecksumType="COMPOSITE")  # fmt: skip
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    config = ws.StreamConfig.from_env(autotune=False).replace_object_store(chunk_size=1 << 20, concurrency=2)
    proxy.fail_next("flip", 1, after=after, at=10)  # the header's read, then 1 MiB reads: into part 2
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        ws.load(uri, config=config)
    assert proxy.injected.get("flip") == 1
    assert info.value.byte_range == bad
    assert all(text in str(info.value) for text in named) and uri in str(info.value)
    assert_same(ws.load(uri, config=config), tensors)  # the fault was one: the object itself is whole


@pytest.mark.parametrize(
    "sizes",
    [[5 << 20, 6 << 20], [6 << 20, 5 << 20], [5 << 20]],
    ids=["a-larger-part-between", "a-smaller-part-between", "the-last-part-larger"],
)
def test_parts_of_different_sizes_are_checked_part_by_part(s3, transport: str, sizes: list[int]) -> None:  # type: ignore[no-untyped-def]
    """An uploader that sends parts as its writes come (fsspec's, smart_open's) makes parts of
    other sizes: each part is a piece of its own range, every byte checked."""
    tensors, body = twelve_mib()
    key = "multi-uneven-" + "-".join(str(x >> 20) for x in sizes)
    uri = multipart(s3, f"{key}/model.safetensors", body, sizes,
                    ChecksumAlgorithm="CRC32C", ChecksumType="COMPOSITE")  # fmt: skip
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    with ws.open_checkpoint(uri) as ck:
        digest = ck.shards[0].digest
        assert digest is not None and not digest.composite
        assert digest.bounds == tuple(starts) and digest.count == len(starts)
        ends = [*starts[1:], len(body)]
        assert digest.pieces == tuple(crc32c.crc32c(body[a:b]) for a, b in zip(starts, ends, strict=True))
        assert_same(ck.load(), tensors)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == len(body)
        assert ck.last_stats.unchecked_bytes == 0


def test_an_object_without_a_checksum_loads_unchecked_and_verify_on_refuses_it(s3_endpoint: str, s3) -> None:  # type: ignore[no-untyped-def]
    import boto3
    from botocore.config import Config

    plain = boto3.client(
        "s3", endpoint_url=s3_endpoint, region_name="us-east-1",
        config=Config(request_checksum_calculation="when_required"),
    )  # fmt: skip
    want = put(plain, "none", parts())
    with ws.open_checkpoint(f"s3://{BUCKET}/none") as ck:
        assert all(s.digest is None for s in ck.shards)
        assert_same(ck.load(), want)
    with pytest.raises(FormatError, match="keeps no checksum for it"):
        ws.open_checkpoint(f"s3://{BUCKET}/none", config=ws.StreamConfig.from_env(verify="on"))


def test_a_store_that_does_not_answer_the_head_leaves_the_object_unchecked_within_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, never answers
        oc = ObjectStoreConfig(endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}", metadata_timeout=0.5)
        start = time.monotonic()
        answer = store_checksum(ObjectLocation("s3", "b", "m.safetensors"), oc, etag='"e"')
        assert time.monotonic() - start < 5
    assert answer.algorithm is None and "its HEAD failed" in answer.why and "timed out" in answer.why


def test_a_store_that_refuses_connections_leaves_the_object_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        answer = store_checksum(
            ObjectLocation("s3", "b", "m.safetensors"),
            ObjectStoreConfig(endpoint=f"http://127.0.0.1:{port}"),
            etag=None,
        )
    assert answer.algorithm is None and "Connection" in answer.why


def test_the_head_is_signed_as_a_store_that_checks_signatures_accepts(  # type: ignore[no-untyped-def]
    s3_auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {
        "AWS_ENDPOINT_URL": s3_auth["endpoint"],
        "AWS_ACCESS_KEY_ID": s3_auth["key_id"],
        "AWS_SECRET_ACCESS_KEY": s3_auth["secret"],
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    oc = ws.StreamConfig.from_env().object_store
    loc = ObjectLocation("s3", "private", "m/model.safetensors")
    answer = store_checksum(loc, oc, etag=None)
    assert answer.algorithm == "crc32", answer.why  # boto3 sends CRC32 by default
    with ws.open_checkpoint("s3://private/m/model.safetensors") as ck:
        ck.load()
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == ck.shards[0].size


def test_the_checksums_are_asked_while_the_index_is_read(s3, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The HEADs go out with the index's read, not a round trip after the headers: each is sent
    before the index's read returns (held back here, to make the order plain), and none is sent
    twice."""
    from weightstream.sources.object_store import backend as backend_module
    from weightstream.sources.object_store import checksum

    want = put(s3, "early", parts(), ChecksumAlgorithm="CRC64NVME")
    events: list[str] = []
    real_head, real_read_all = checksum._head, backend_module.ObjectBackend.read_all

    def head(*args: Any, **kwargs: Any) -> Any:
        events.append("HEAD")
        return real_head(*args, **kwargs)

    def read_all(self: Any, location: Any, *args: Any, **kwargs: Any) -> bytes:
        raw = real_read_all(self, location, *args, **kwargs)
        if location.name.endswith(".index.json"):
            time.sleep(0.3)  # a slow index: whatever the open sends after it comes after this
            events.append("index read")
        return raw

    monkeypatch.setattr(checksum, "_head", head)
    monkeypatch.setattr(backend_module.ObjectBackend, "read_all", read_all)
    with ws.open_checkpoint(f"s3://{BUCKET}/early") as ck:
        assert all(s.digest is not None and s.digest.algorithm == "crc64nvme" for s in ck.shards)
        assert_same(ck.load(), want)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == sum(s.size for s in ck.shards)
    assert events == ["HEAD", "HEAD", "index read"]


def test_an_answer_asked_early_is_used_only_for_the_version_the_open_reads(s3) -> None:  # type: ignore[no-untyped-def]
    """An object replaced between the early HEAD and its header's read: the early answer (of
    the old bytes) is not used; the object is asked again for the version read."""
    from weightstream.checkpoint import _EarlyChecksums, _own_checksums
    from weightstream.uri import resolve

    config = ws.StreamConfig.from_env()
    put(s3, "replaced", parts(0), ChecksumAlgorithm="CRC32C")
    early = _EarlyChecksums.start(resolve(f"s3://{BUCKET}/replaced", config), config)
    assert early is not None
    put(s3, "replaced", parts(1), ChecksumAlgorithm="CRC32C")  # new bytes, same sizes
    with ws.open_checkpoint(f"s3://{BUCKET}/replaced", config=ws.StreamConfig.from_env(verify="off")) as ck:
        for shard in ck.shards:
            stale = early.answer(shard.location, shard.published)
            assert stale is None  # asked before the object was replaced: another version
        answers = _own_checksums(list(ck.shards), config, early)
        for shard in ck.shards:
            body = s3.get_object(Bucket=BUCKET, Key=shard.location.key)["Body"].read()
            got = answers[shard.location]
            assert got.algorithm == "crc32c" and got.value == crc32c.crc32c(body)
            assert got.version is not None and got.version.strip('"') == shard.published.strip('"')  # type: ignore[union-attr]


def seventeen_mib() -> tuple[dict[str, torch.Tensor], bytes]:
    tensors = {f"w{i}": random_tensor((17 << 18,), torch.uint8, seed=40 + i) for i in range(4)}
    return tensors, save(tensors)


def test_a_bit_flipped_in_a_later_part_of_a_composite_names_its_part(  # type: ignore[no-untyped-def]
    s3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors, body = seventeen_mib()
    uri = multipart(s3, "many-flip/model.safetensors", body, [5 << 20, 5 << 20, 5 << 20],
                    ChecksumAlgorithm="CRC32", ChecksumType="COMPOSITE")  # fmt: skip
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    config = ws.StreamConfig.from_env(autotune=False).replace_object_store(chunk_size=1 << 20, concurrency=2)
    proxy.fail_next("flip", 1, after=13, at=10)  # the header's read, then twelve 1 MiB reads: part 3
    with pytest.raises(FormatError, match="checksum mismatch") as info:
        ws.load(uri, config=config)
    assert proxy.injected.get("flip") == 1
    assert info.value.byte_range == (10 << 20, 15 << 20)
    assert "(part 3)" in str(info.value) and uri in str(info.value)
    assert_same(ws.load(uri, config=config), tensors)  # the fault was one: the object itself is whole


def test_a_composite_whose_last_part_shows_other_sizes_is_checked_part_by_part(  # type: ignore[no-untyped-def]
    s3, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part 1 and the last are asked first: parts of 5, 6 and 5 MiB put the last part where
    parts of 5 MiB would not, so every part is asked for its range and checksum, a piece each."""
    tensors, body = seventeen_mib()
    sizes = [5 << 20, 6 << 20, 5 << 20]
    uri = multipart(s3, "many-uneven/model.safetensors", body, sizes,
                    ChecksumAlgorithm="CRC32C", ChecksumType="COMPOSITE")  # fmt: skip
    heads = heads_asked(monkeypatch)
    with ws.open_checkpoint(uri) as ck:
        digest = ck.shards[0].digest
        assert digest is not None and not digest.composite
        assert digest.bounds == (0, 5 << 20, 11 << 20, 16 << 20) and "each of 4 parts" in digest.origin
        assert_same(ck.load(), tensors)
        assert ck.last_stats is not None and ck.last_stats.checked_bytes == len(body)
    assert sorted(heads) == [0, 1, 1, 2, 3, 4, 4]  # the object; parts 1 and 4; then each part


def test_more_parts_of_other_sizes_than_are_asked_are_left_unchecked_saying_why(  # type: ignore[no-untyped-def]
    s3, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightstream.sources.object_store import checksum

    monkeypatch.setattr(checksum, "_MAX_UNEVEN_PARTS", 3)
    tensors, body = seventeen_mib()
    uri = multipart(s3, "many-uneven-cap/model.safetensors", body, [5 << 20, 6 << 20, 5 << 20],
                    ChecksumAlgorithm="CRC32C", ChecksumType="COMPOSITE")  # fmt: skip
    with ws.open_checkpoint(uri) as ck:
        assert ck.shards[0].digest is None
        assert_same(ck.load(), tensors)
    with pytest.raises(FormatError, match="not all of part 1's size") as info:
        ws.open_checkpoint(uri, config=ws.StreamConfig.from_env(verify="on"))
    assert uri in str(info.value) and "up to 3 such parts" in str(info.value)


def test_a_composite_of_parts_of_other_sizes_is_left_unchecked_never_failed(  # type: ignore[no-untyped-def]
    s3, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Parts of 6, 5 and 7 MiB and a last one: part 1 and the last (at 18 MiB) allow parts of 6
    MiB, so the load checks 6 MiB pieces; their composite cannot match, the parts are asked
    for theirs, and the object is left unchecked with the reason, its load whole."""

    tensors = {f"w{i}": random_tensor((5 << 20,), torch.uint8, seed=50 + i) for i in range(4)}
    body = save(tensors)
    uri = multipart(s3, "many-uneven-between/model.safetensors", body, [6 << 20, 5 << 20, 7 << 20],
                    ChecksumAlgorithm="CRC32C", ChecksumType="COMPOSITE")  # fmt: skip
    with caplog.at_level("WARNING"), ws.open_checkpoint(uri) as ck:
        assert ck.shards[0].digest is not None and ck.shards[0].digest.composite
        assert_same(ck.load(), tensors)
        assert ck.last_stats is not None
        assert ck.last_stats.checked_bytes == 0 and ck.last_stats.unchecked_bytes == len(body)
    assert any("not all of part 1's size" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("closes", [False, True], ids=["keeps-connections", "closes-each-silently"])
def test_part_heads_keep_a_connection_and_survive_one_closed_under_them(
    monkeypatch: pytest.MonkeyPatch, closes: bool
) -> None:
    """The HEADs of one part ask go on one connection a thread (no connect per part); a store
    that closes a connection after each answer without saying so (no ``Connection: close``)
    costs the next HEAD one new connection, never the ask."""
    import threading

    from weightstream.location import object_location
    from weightstream.sources.object_store import checksum

    monkeypatch.setattr(checksum, "_HEAD_THREADS", (1, 1, 1))  # one thread: its HEADs in turn
    server = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []
    requests: list[bytes] = []

    def serve() -> None:
        for conn in accepted(server):
            connections.append(1)
            with conn:
                buf = b""
                while True:
                    while b"\r\n\r\n" not in buf and (data := conn.recv(65536)):
                        buf += data
                    if b"\r\n\r\n" not in buf:
                        break
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    requests.append(head.split(b"\r\n")[0])
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nx-amz-checksum-crc32c: AAAAAA==\r\n\r\n"
                    )
                    if closes:
                        break

    threading.Thread(target=serve, daemon=True).start()
    try:
        oc = ObjectStoreConfig(endpoint=f"http://127.0.0.1:{server.getsockname()[1]}", anonymous=True)
        loc = object_location("s3://b/model.safetensors")
        assert isinstance(loc, ObjectLocation)
        answers = checksum._part_heads(loc, oc, None, [1, 2, 3, 4])
    finally:
        server.close()
    assert [(status, h["x-amz-checksum-crc32c"]) for status, h in answers] == [(200, "AAAAAA==")] * 4
    assert requests == [b"HEAD /b/model.safetensors?partNumber=%d HTTP/1.1" % i for i in range(1, 5)]
    assert len(connections) == (4 if closes else 1)
