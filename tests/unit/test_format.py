"""Strict validation: every way a checkpoint can be wrong gets its error class and a message
that names the file (and the tensor / byte range where one applies)."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file

import weightstream as ws
from weightstream.errors import FormatError, NotFoundError, UnsupportedDtypeError, WeightStreamError
from weightstream.format.dtypes import DTYPES
from weightstream.format.safetensors import parse_header

from ..conftest import random_tensor, write_raw


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def expect(path: Path, cls: type[WeightStreamError], *fragments: str) -> WeightStreamError:
    with pytest.raises(cls) as info:
        ws.load(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for frag in fragments:
        assert frag in msg, msg
    assert info.value.uri == str(path)
    return info.value


# -- length prefix and header bytes ------------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    expect(p, FormatError, "too short")


def test_file_shorter_than_prefix(tmp_path: Path) -> None:
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x05\x00\x00")
    expect(p, FormatError, "too short")


def test_header_length_over_maximum(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "huge.safetensors", {}, length=10**12)
    err = expect(p, FormatError, "maximum")
    assert err.byte_range == (0, 8)


def test_max_header_size_is_configurable(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4)}, str(p))
    with pytest.raises(FormatError, match="maximum"):
        ws.load(p, config=ws.StreamConfig(max_header_size=16))


def test_header_longer_than_file(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "trunc_header.safetensors", b'{"a":', length=500)
    expect(p, FormatError, "truncated", "500")


def test_header_not_utf8(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "latin1.safetensors", '{"caf\xe9": 1}'.encode("latin-1"))
    expect(p, FormatError, "UTF-8")


def test_header_not_json(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "notjson.safetensors", b"{this is not json}")
    expect(p, FormatError, "JSON")


def test_header_not_an_object(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "list.safetensors", [1, 2, 3])
    expect(p, FormatError, "JSON object")


def test_duplicate_keys(tmp_path: Path) -> None:
    raw = b'{"a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}, "a": {"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    p = write_raw(tmp_path / "dup.safetensors", raw, b"\x00")
    expect(p, FormatError, "duplicate key 'a'")


def test_bad_metadata(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "meta.safetensors", {"__metadata__": {"n": 1}})
    expect(p, FormatError, "__metadata__")


# -- JSON that Python's own parser cannot take -------------------------------------------------
# Every header is untrusted input: whatever it holds, the answer is a FormatError naming the file.


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        # More digits than int() converts (sys.int_info.default_max_str_digits): a ValueError inside json.
        (b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}', "usable JSON"),
        (b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, ' + b"1" * 4301 + b"]}}", "usable JSON"),
        (b'{"__metadata__": ' + b"7" * 9999 + b"}", "usable JSON"),
        # Nesting deeper than the interpreter's recursion limit: a RecursionError inside json.
        (b'{"w": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "too deeply"),
        (b"[" * 50_000 + b"]" * 50_000, "too deeply"),
        (b'{"__metadata__": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001, "too deeply"),
    ],
    ids=[
        "5000-digit-dim",
        "4301-digit-offset",
        "9999-digit-metadata",
        "nested-200k",
        "list-50k",
        "dict-100k",
    ],
)
def test_json_python_cannot_parse_is_a_format_error(tmp_path: Path, raw: bytes, fragment: str) -> None:
    p = write_raw(tmp_path / "bad.safetensors", raw, b"\x00")
    err = expect(p, FormatError, fragment)
    assert err.byte_range == (8, 8 + len(raw))


ESCAPES = [
    r"\ud800",
    r"\udbff",
    r"\udc00",
    r"\udfff",
    r"\uD834",
    r"\uDD1E",
    r"\u0041",
    r"\\",
    r"\"",
    "x",
    "é",
]
"""Pieces of a JSON string: both halves of UTF-16 surrogate pairs, escapes that are not, and text.
Also an escaped backslash, after which ``ud800`` is text."""


def _with_strings(name: str, value: str) -> bytes:
    """A one-tensor header whose tensor name and one metadata value are the JSON string bodies
    ``name`` and ``value`` (written as they are: their escapes are the test's)."""
    text = (
        f'{{"{name}": {{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, '
        f'"__metadata__": {{"k": "{value}"}}}}'
    )
    return text.encode()


def verdicts(header: bytes, data: bytes) -> tuple[bool, FormatError | None]:
    """Whether the safetensors library reads the file ``header`` + ``data``, and our parse's
    refusal of its header (``None``: read)."""
    from safetensors.torch import load

    try:
        load(struct.pack("<Q", len(header)) + header + data)
        theirs = True
    except Exception:  # the library's own error types
        theirs = False
    try:
        parse_header(header, uri="f.safetensors", file_size=8 + len(header) + len(data))
    except FormatError as exc:
        return theirs, exc
    return theirs, None


@given(st.lists(st.sampled_from(ESCAPES), max_size=5), st.lists(st.sampled_from(ESCAPES), max_size=5))
@settings(max_examples=400, deadline=None)
def test_strings_are_refused_as_the_safetensors_library_refuses_them(
    name: list[str], value: list[str]
) -> None:
    """Python's json keeps half a surrogate pair (``\\ud800`` alone) as a lone surrogate; the
    safetensors library (serde_json) refuses the header. A file the library refuses is refused
    here too, and one it reads is read."""
    raw = _with_strings("n" + "".join(name), "".join(value))
    theirs, ours = verdicts(raw, b"\x00")
    assert (ours is None) == theirs, raw
    if ours is not None:
        assert "surrogate" in str(ours) and "f.safetensors" in str(ours), ours


NUMBERS = ["0", "-0", "1", "2", "-1", "0.0", "-0.0", "1e0", "2E0", "1.0", "00", "+1", "2 ", " 0"]
"""Number tokens where a header's integers go: Python's json reads ``-0`` as the integer 0, the
safetensors library's as a float."""


def agree_on_numbers(shape: list[str], begin: str, end: str) -> None:
    """A BF16 tensor of 2 bytes whose shape and offsets are the tokens as written: refused here
    exactly where the safetensors library refuses it."""
    raw = f'{{"w": {{"dtype": "BF16", "shape": [{", ".join(shape)}], "data_offsets": [{begin}, {end}]}}}}'
    theirs, ours = verdicts(raw.encode(), b"\x00\x00")
    assert (ours is None) == theirs, raw


@pytest.mark.parametrize("token", NUMBERS)
@pytest.mark.parametrize("where", ["shape", "begin", "end"])
def test_each_number_token_is_refused_as_the_safetensors_library_refuses_it(where: str, token: str) -> None:
    """Each token in each place of an otherwise valid header (shape ``[1]``, offsets ``[0, 2]``)."""
    agree_on_numbers(
        [token] if where == "shape" else ["1"],
        token if where == "begin" else "0",
        token if where == "end" else "2",
    )


@given(st.lists(st.sampled_from(NUMBERS), max_size=2), st.sampled_from(NUMBERS), st.sampled_from(NUMBERS))
@settings(max_examples=300, deadline=None)
def test_numbers_are_refused_as_the_safetensors_library_refuses_them(
    shape: list[str], begin: str, end: str
) -> None:
    agree_on_numbers(shape, begin, end)


@pytest.mark.parametrize(("value", "at"), [(r"ab\ud800", 2), (r"\ud800\u0041", 0), (r"\udc00\ud800", 0)])
def test_half_a_surrogate_pair_is_refused_naming_its_byte(tmp_path: Path, value: str, at: int) -> None:
    raw = _with_strings("w", value)
    p = write_raw(tmp_path / "half.safetensors", raw, b"\x00")
    err = expect(p, FormatError, "surrogate", value[at : at + 6])
    assert f"at byte {8 + raw.index(value.encode()) + at} " in str(err)
    assert err.byte_range == (8, 8 + len(raw))


@pytest.mark.parametrize(
    "shape",
    [[0, 2**63], [2**40, 2**40, 0], [0, 2**40, 2**40], [2**64, 0], [2**63 - 1, 2, 0]],
)
def test_shapes_torch_cannot_hold_are_refused(tmp_path: Path, shape: list[int]) -> None:
    """Empty (a zero dimension) but too large for torch's int64 sizes and strides: refused
    before any read, instead of a TypeError / RuntimeError from torch.empty during the load."""
    p = write_raw(tmp_path / "huge.safetensors", {"w": entry("BF16", shape, 0, 0)})
    expect(p, FormatError, "too large for torch", "tensor 'w'")


@pytest.mark.parametrize("shape", [[0, 2**63 - 1], [2**62, 0], [0], [0, 0, 0], [2**31, 2**31, 0]])
def test_large_empty_shapes_torch_holds_load(tmp_path: Path, shape: list[int]) -> None:
    p = write_raw(tmp_path / "empty.safetensors", {"w": entry("BF16", shape, 0, 0)})
    got = ws.load(p)["w"]
    assert list(got.shape) == shape and got.dtype == torch.bfloat16 and got.numel() == 0


def test_messages_about_huge_values_stay_short(tmp_path: Path) -> None:
    """A header value of megabytes is named, not printed whole."""
    p = write_raw(tmp_path / "bad.safetensors", {"w": entry("X" * 1_000_000, [1], 0, 1)}, b"\x00")
    err = expect(p, FormatError, "unknown dtype")
    assert len(str(err)) < 2000


# -- entries -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("info", "fragment"),
    [
        ({"dtype": "F32", "shape": [1]}, "missing ['data_offsets']"),
        ({**entry("F32", [1], 0, 4), "extra": 1}, "unexpected ['extra']"),
        (entry("F31", [1], 0, 4), "unknown dtype 'F31'"),
        (entry("F32", [-1], 0, 4), "non-negative"),
        (entry("F32", [1.5], 0, 4), "non-negative"),
        (entry("F32", [True], 0, 4), "non-negative"),
        (entry("F32", "1", 0, 4), "non-negative"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}, "data_offsets"),
        (entry("F32", [1], 4, 0), "before begin"),
        (entry("F32", [2], 0, 4), "size mismatch"),
        (entry("F4", [3], 0, 2), "whole bytes"),
        ("not an object", "entry must be a JSON object"),
    ],
)
def test_bad_entry(tmp_path: Path, info: object, fragment: str) -> None:
    p = write_raw(tmp_path / "bad.safetensors", {"w": info}, b"\x00" * 4)
    err = expect(p, FormatError, fragment, "tensor 'w'")
    assert err.tensor == "w"


def test_gap_between_tensors(tmp_path: Path) -> None:
    p = write_raw(
        tmp_path / "gap.safetensors",
        {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 8, 12)},
        b"\x00" * 12,
    )
    err = expect(p, FormatError, "gap", "tensor 'b'")
    assert err.byte_range is not None


def test_first_tensor_not_at_zero(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "gap0.safetensors", {"a": entry("U8", [4], 4, 8)}, b"\x00" * 8)
    expect(p, FormatError, "gap")


def test_overlapping_tensors(tmp_path: Path) -> None:
    p = write_raw(
        tmp_path / "overlap.safetensors",
        {"a": entry("U8", [8], 0, 8), "b": entry("U8", [4], 4, 8)},
        b"\x00" * 8,
    )
    expect(p, FormatError, "overlap")


def test_truncated_data(tmp_path: Path) -> None:
    p = tmp_path / "trunc.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32)}, str(p))
    full = p.stat().st_size
    with open(p, "r+b") as fh:
        fh.truncate(full - 100)
    err = expect(p, FormatError, "truncated", "100 bytes missing")
    assert err.byte_range == (full - 100, full)


def test_trailing_bytes(tmp_path: Path) -> None:
    p = tmp_path / "trail.safetensors"
    p.write_bytes(save({"a": torch.zeros(2)}) + b"junk")
    expect(p, FormatError, "unexpected bytes after the last tensor")


def test_sub_byte_dtype_torch_cannot_hold_is_validated_then_refused_clearly(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "f6.safetensors", {"w": entry("F6_E2M3", [4], 0, 3)}, b"\x12\x34\x56")
    ckpt = ws.open_checkpoint(p)  # inspect works
    assert ckpt.tensors["w"].dtype.name == "F6_E2M3"
    with pytest.raises(UnsupportedDtypeError, match="F6_E2M3") as info:
        ckpt.load()
    assert str(p) in str(info.value)


@pytest.mark.parametrize("shape", [[4, 16], [3, 2], [2], [1, 1, 2], [0, 4], [4, 0], [2, 3, 64]])
def test_f4_loads_as_safetensors_loads_it(tmp_path: Path, shape: list[int]) -> None:
    """F4 holds two 4-bit values a byte; torch's float4_e2m1fn_x2 halves the last dimension."""
    numel = 1
    for d in shape:
        numel *= d
    data = bytes(random_tensor((numel // 2,), torch.uint8, seed=numel).numpy())
    p = write_raw(tmp_path / "f4.safetensors", {"w": entry("F4", shape, 0, numel // 2)}, data)
    want = load_file(str(p))
    got = ws.load(p)
    assert got["w"].dtype == want["w"].dtype == torch.float4_e2m1fn_x2
    assert got["w"].shape == want["w"].shape
    assert bytes(got["w"].view(torch.uint8).numpy()) == data


def test_f4_with_an_odd_last_dimension_is_refused_as_safetensors_refuses_it(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "f4.safetensors", {"w": entry("F4", [2, 3], 0, 3)}, b"abc")
    with pytest.raises(Exception, match="divisible by 2"):
        load_file(str(p))
    with pytest.raises(UnsupportedDtypeError, match=r"shape \[2, 3\] of F4") as info:
        ws.load(p)
    assert info.value.tensor == "w" and str(p) in str(info.value)


def test_empty_header_is_a_valid_empty_checkpoint(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "none.safetensors", {})
    assert ws.load(p) == {}


def test_dtype_table_matches_torch() -> None:
    for d in DTYPES.values():
        if d.torch is not None:
            assert torch.empty((), dtype=d.torch).element_size() * 8 == d.bits * d.packed, d.name


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_header_bytes_never_crash(raw: bytes) -> None:
    """Any header either parses or raises FormatError: never another exception."""
    with contextlib.suppress(FormatError):
        parse_header(raw, uri="fuzz", file_size=8 + len(raw) + 64)


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from([*DTYPES, "X"]),
                "shape": st.lists(st.integers(-2, 6), max_size=3),
                "data_offsets": st.lists(st.integers(-2, 200), min_size=2, max_size=2),
            }
        ),
        max_size=4,
    ),
    st.integers(0, 300),
)
@settings(max_examples=300, deadline=None)
def test_structured_headers_never_crash(header: dict, data_len: int) -> None:
    raw = json.dumps(header).encode()
    try:
        index = parse_header(raw, uri="fuzz", file_size=8 + len(raw) + data_len)
    except FormatError:
        return
    # Accepted: the tensors tile the data section exactly.
    assert sum(t.nbytes for t in index.tensors) == data_len


# -- sharded checkpoints ------------------------------------------------------------------------


def _index(folder: Path, weight_map: dict) -> Path:
    p = folder / "model.safetensors.index.json"
    p.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return p


def test_index_names_missing_shard(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "s1.safetensors"))
    _index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(NotFoundError, match=r"s2\.safetensors") as info:
        ws.load(tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    assert "model.safetensors.index.json" in str(info.value)


def test_index_names_tensor_the_shard_lacks(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "s1.safetensors"))
    _index(tmp_path, {"a": "s1.safetensors", "ghost": "s1.safetensors"})
    with pytest.raises(FormatError, match="ghost") as info:
        ws.load(tmp_path)
    assert str(tmp_path / "s1.safetensors") in str(info.value)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "JSON"),
        ('{"metadata": {}}', "weight_map"),
        ('{"weight_map": {"a": 3}}', "shard file name"),
        ('{"weight_map": {"a": "/etc/passwd"}}', "relative"),
        ('{"weight_map": {"a": "../x.safetensors"}}', "relative"),
    ],
)
def test_bad_index(tmp_path: Path, content: str, fragment: str) -> None:
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(content)
    with pytest.raises(FormatError, match=fragment) as info:
        ws.load(tmp_path)
    assert str(p) in str(info.value)


def test_bad_shard_header_names_the_shard(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "s1.safetensors"))
    write_raw(tmp_path / "s2.safetensors", b"garbage!")
    _index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(FormatError) as info:
        ws.load(tmp_path)
    assert str(tmp_path / "s2.safetensors") in str(info.value)


def test_a_name_in_two_shards_is_read_from_the_shard_the_index_names(tmp_path: Path) -> None:
    """Shard b also holds an ``x`` (with other values); the index places ``x`` in shard a."""
    save_file({"x": torch.full((4,), 1.0), "y": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.full((4,), 2.0), "z": torch.ones(3)}, str(tmp_path / "b.safetensors"))
    _index(tmp_path, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    got = ws.load(tmp_path)
    assert list(got) == ["x", "y", "z"]
    assert torch.equal(got["x"], torch.full((4,), 1.0))
    ckpt = ws.open_checkpoint(tmp_path)
    assert ckpt.tensors["x"].uri == str(tmp_path / "a.safetensors")
    # The other way round: the index places x in b, which comes later in file order.
    _index(tmp_path, {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    got = ws.load(tmp_path, tensors=["x"])
    assert torch.equal(got["x"], torch.full((4,), 2.0))


def test_an_index_that_lists_no_tensor_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "s1.safetensors"))
    p = _index(tmp_path, {})
    with pytest.raises(FormatError, match="lists no tensor") as info:
        ws.load(tmp_path)
    assert str(p) in str(info.value)


def test_same_tensor_in_two_unindexed_files(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(FormatError, match="two files"):
        ws.load(tmp_path)


def test_prefix_is_little_endian_u64(tmp_path: Path) -> None:
    p = tmp_path / "be.safetensors"
    raw = b"{}"
    p.write_bytes(struct.pack(">Q", len(raw)) + raw)
    expect(p, FormatError)


def test_a_large_header_parse_leaves_the_garbage_collector_as_it_found_it() -> None:
    """The cyclic GC is paused while a large header is parsed (a third of its time), and only then."""
    import gc
    import json

    from weightstream.format.safetensors import parse_header

    entries = {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(40_000)}
    raw = json.dumps(entries).encode()
    assert len(raw) > 1 << 20
    for was_on in (True, False):
        (gc.enable if was_on else gc.disable)()
        try:
            assert len(parse_header(raw, uri="big", file_size=8 + len(raw) + 40_000).tensors) == 40_000
            assert gc.isenabled() is was_on
            with pytest.raises(FormatError, match="truncated"):
                parse_header(raw, uri="big", file_size=8 + len(raw))
            assert gc.isenabled() is was_on
        finally:
            gc.enable()


def test_a_repeated_key_is_found_however_the_header_is_spaced() -> None:
    """Keys are counted in the text to skip a slow duplicate check: any way of writing JSON that
    the count misreads falls back to the check, never past it."""
    from weightstream.format.safetensors import parse_header

    base = '"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    for text in (
        "{" + base + ", " + base + "}",  # a repeated tensor
        '{"a" : {"dtype":"U8","shape":[1],"data_offsets":[0,1],"data_offsets":[0,1]}}',  # spaced, in an entry
        '{"__metadata__": {"k\\":": "v", "k\\":": "w"}, ' + base + "}",  # escaped quotes before colons
    ):
        with pytest.raises(FormatError, match="duplicate key"):
            parse_header(text.encode(), uri="dup", file_size=8 + len(text) + 1)
    ok = '{"__metadata__": {"x\\":": "y\\":"}, ' + base + "}"
    assert parse_header(ok.encode(), uri="ok", file_size=8 + len(ok) + 1).metadata == {'x":': 'y":'}
