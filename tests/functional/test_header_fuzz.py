"""Random checkpoints, valid and mutated, through the whole load: every outcome is the exact
tensors the safetensors library reads, or a WeightStreamError; never another exception, never a
wait past a small bound, never a thread left behind."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import weightstream as ws
from weightstream.errors import WeightStreamError
from weightstream.format.dtypes import DTYPES

from ..conftest import as_bytes

BOUND_S = 10.0
NAMES = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=12)


@st.composite
def checkpoints(draw: st.DrawFn) -> bytes:
    """A safetensors file as bytes: random names, dtypes (the sub-byte ones too), shapes and
    metadata, its data random bytes, its header padded as the format allows."""
    entries = draw(
        st.lists(
            st.tuples(NAMES, st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 9), max_size=3)),
            max_size=6,
            unique_by=lambda e: e[0],
        )
    )
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in entries:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = DTYPES[dtype].nbytes(numel)
        if nbytes is None:  # sub-byte values that do not fill whole bytes: make it one that does
            shape, nbytes = [8], DTYPES[dtype].nbytes(8)
            assert nbytes is not None
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(NAMES, st.text(max_size=8), max_size=3))
    raw = json.dumps(header, ensure_ascii=draw(st.booleans())).encode()
    raw += b" " * draw(st.integers(0, 7))
    data = draw(st.binary(min_size=offset, max_size=offset))
    return struct.pack("<Q", len(raw)) + raw + data


HUGE = [2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, -1, -77777]
"""-77777 stands for a 5000-digit integer, which Python's json would not even write."""


def _names(raw: bytearray) -> list[str]:
    """The tensor names of a header that still parses (none otherwise)."""
    try:
        header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    except (ValueError, struct.error, RecursionError):
        return []
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []


def _rewrite_header(raw: bytearray, change: object) -> bytearray:
    """Replace the header by ``change(header)`` (a JSON text), keeping the data section."""
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    text = change(header)  # type: ignore[operator]
    return bytearray(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid file, then none or several of: bytes flipped (header or data), cut short,
    lengthened, a new length prefix, a header region replaced by random bytes; or, in the
    header's JSON: a dimension or offset made huge (or longer than Python converts), a value
    nested deeper than the interpreter recurses."""
    raw = bytearray(draw(checkpoints()))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "append", "prefix", "splice", "huge", "nest"]))
        names = _names(raw) if kind in ("huge", "nest") else []
        if kind == "huge" and names:
            name, field, value = (
                draw(st.sampled_from(names)),
                draw(st.sampled_from(["shape", "data_offsets"])),
                draw(st.sampled_from(HUGE)),
            )

            def huge(h: dict, name: str = name, field: str = field, value: int = value) -> bytes:
                entry = h.get(name)
                if isinstance(entry, dict) and isinstance(entry.get(field), list):  # an earlier
                    # mutation ("nest") may have replaced the entry: then there is nothing to grow
                    entry[field] = [*entry[field][:1], value, 0][: max(2, len(entry[field]))]
                return json.dumps(h).encode().replace(b"-77777", b"9" * 5000)

            raw = _rewrite_header(raw, huge)
        elif kind == "nest" and names:
            depth = draw(st.sampled_from([10, 1000, 100_000]))
            name = draw(st.sampled_from(names))

            def nest(h: dict, name: str = name, depth: int = depth) -> bytes:
                h.pop(name)
                return (
                    json.dumps(h).encode()[:-1].rstrip(b"}")
                    + (b", " if h else b"")
                    + json.dumps(name).encode()
                    + b": "
                    + b"[" * depth
                    + b"]" * depth
                    + b"}"
                )

            raw = _rewrite_header(raw, nest)
        elif kind in ("huge", "nest"):
            continue
        elif kind == "flip" and raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del raw[draw(st.integers(0, len(raw))) :]
        elif kind == "append":
            raw += draw(st.binary(min_size=1, max_size=16))
        elif kind == "prefix":
            raw[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
        elif kind == "splice" and len(raw) > 8:
            i = draw(st.integers(8, len(raw) - 1))
            raw[i : i + 8] = draw(st.binary(min_size=8, max_size=8))
    return bytes(raw)


def ours_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("weightstream-") and t.is_alive()}


def check(path: Path, raw: bytes) -> None:
    path.write_bytes(raw)
    try:
        want = load_file(str(path))
    except Exception:
        want = None
    before = ours_threads()
    started = time.monotonic()
    try:
        got = ws.load(path, config=ws.StreamConfig(chunk_size=4096, memory_limit=8192, io_timeout=BOUND_S))
    except WeightStreamError as exc:
        got = None
        assert str(path) in str(exc)
    assert time.monotonic() - started < BOUND_S
    deadline = time.monotonic() + 5
    while ours_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ours_threads() - before, ours_threads()
    event(
        f"weightstream {'refused' if got is None else 'loaded'}, safetensors {'refused' if want is None else 'loaded'}"
    )
    if got is None:
        return
    # Accepted: then the safetensors library reads the same file, and the same tensors.
    assert want is not None, "weightstream accepted a file the safetensors library refuses"
    assert list(got) == sorted(got, key=lambda n: [*want].index(n)) or set(got) == set(want)
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert torch.equal(as_bytes(g), as_bytes(w)), name


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(raw=checkpoints())
def test_valid_random_checkpoints_load_exactly(tmp_path: Path, raw: bytes) -> None:
    check(tmp_path / "valid.safetensors", raw)


@FUZZ
@given(raw=mutated())
@example(  # found in CI: half a surrogate pair, which Python's json keeps and serde_json refuses
    raw=b'\xc0\x00\x00\x00\x00\x00\x00\x00{"0": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]}, '
    b'"__metadata__": {"0": "", "\\u007f\\u007f\\u007f\\u007f\\u007f\\u007f": '
    b'"\\u001f\\u001f\\ud800\\udc00\\ud800\\udc00\\ud800\\udc00\\ud800]udc00"}}\x00\x00'
)
def test_mutated_checkpoints_load_exactly_or_fail_clearly(tmp_path: Path, raw: bytes) -> None:
    check(tmp_path / "mutated.safetensors", raw)
