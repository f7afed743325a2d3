"""A location means exactly what it says: object keys literal, file:// URIs decoded by their RFC,
nothing dropped or read in another's place."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightstream.errors import ConfigError
from weightstream.location import LocalPath, ObjectLocation, object_location, parse_location, shown

# Characters a URL parser would treat as syntax, and some that need no escaping at all.
_KEY_CHARS = st.sampled_from(list("abcXYZ019-_.~!$&'()*+,;=:@?#%[] é✓\"<>^`{|}\\"))


@pytest.mark.parametrize(
    ("uri", "key"),
    [
        ("s3://bkt/dir?x/model.safetensors", "dir?x/model.safetensors"),
        ("s3://bkt/m%41/model.safetensors", "m%41/model.safetensors"),
        ("s3://bkt/a#b/c", "a#b/c"),
        ("s3://bkt/sp ace/+plus", "sp ace/+plus"),
        ("s3://bkt/x/..model.safetensors", "x/..model.safetensors"),
        ("s3://bkt/%2F", "%2F"),
        ("gs://bkt/a?b#c%20d/", "a?b#c%20d"),
        ("az://container/k?", "k?"),
        ("S3://bkt/k", "k"),
        ("s3://bkt", ""),
        ("s3://bkt/", ""),
    ],
)
def test_an_object_key_is_the_text_after_the_bucket(uri: str, key: str) -> None:
    loc = parse_location(uri)
    assert isinstance(loc, ObjectLocation)
    assert loc.bucket in ("bkt", "container") and loc.key == key
    assert object_location(uri) == loc


@given(st.lists(st.text(_KEY_CHARS, min_size=1, max_size=6), min_size=1, max_size=4))
def test_any_key_of_non_empty_segments_round_trips(segments: list[str]) -> None:
    if any(s in (".", "..") for s in segments):
        return
    key = "/".join(segments)
    loc = parse_location(f"s3://bkt/{key}")
    assert isinstance(loc, ObjectLocation) and loc.key == key
    assert parse_location(loc.uri) == loc  # what messages print names the same object


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("s3://bkt//model.safetensors", "empty segment"),
        ("s3://bkt/a//b", "empty segment"),
        ("s3://bkt/a//", "empty segment"),
        ("s3://bkt/a/./b", "'.' segment"),
        ("s3://bkt/../b", "'..' segment"),
        ("s3:///key", "no bucket"),
        ("s3://bkt?x/key", "not a bucket name"),
        ("s3://bk%41/key", "not a bucket name"),
        ("s3://user:pw@bkt/key", "not a bucket name"),
        ("s3://bkt/a\0b", "NUL"),
    ],
)
def test_a_key_the_client_cannot_address_literally_is_refused(uri: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        parse_location(uri)
    assert info.value.setting == "uri"
    str(info.value).encode("utf-8")  # printable


@pytest.mark.parametrize(
    ("uri", "path"),
    [
        ("file:///tmp/a%20b/model.safetensors", "/tmp/a b/model.safetensors"),
        ("file://localhost/tmp/x%3Fy", "/tmp/x?y"),
        ("file:///tmp/%23hash", "/tmp/#hash"),
        ("/tmp/dir?x/model.safetensors", "/tmp/dir?x/model.safetensors"),  # a bare path: as it is
        ("relative/m%41.safetensors", "relative/m%41.safetensors"),
    ],
)
def test_file_uris_are_percent_decoded_and_paths_are_not(uri: str, path: str) -> None:
    assert parse_location(uri) == LocalPath(path)
    assert object_location(uri) is None


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("file:///tmp/dir?x/model.safetensors", "query or a fragment"),
        ("file:///tmp/a#b", "query or a fragment"),
        ("file:///tmp/a?", "query or a fragment"),
        ("file://host/tmp/a", "remote host"),
        ("file:///tmp/a%00b", "NUL"),
        ("/tmp/a\0b", "NUL"),
        ("http://example.com/m.safetensors", "unsupported URI scheme"),
    ],
)
def test_what_a_file_uri_or_path_cannot_mean_is_refused(uri: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_location(uri)


def test_messages_show_odd_bytes_escaped() -> None:
    undecodable = b"/tmp/\xff\xfe.safetensors".decode("utf-8", "surrogateescape")
    text = shown(undecodable + "\0")
    text.encode("utf-8")  # no lone surrogate left: printable on a strict UTF-8 stream
    assert "\\udcff" in text and "\\0" in text
