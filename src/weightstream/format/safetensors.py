"""safetensors headers and ``model.safetensors.index.json``: parsing and strict validation.

Pure functions over bytes: the caller does the I/O, so every rule here is unit-testable and
shared by every storage backend. A file is::

    [8-byte little-endian header length N][N bytes of UTF-8 JSON][data section]

and the JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with
offsets relative to the data section. We accept a file only if its tensors tile the data
section exactly (sorted, starting at 0, no gaps, no overlaps), each tensor's byte size equals
``numel * itemsize``, and the file is exactly as long as the header says: a truncated download
fails here, before any tensor byte is read.
"""

from __future__ import annotations

import contextlib
import gc
import json
import posixpath
import re
import reprlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from weightstream.errors import FormatError
from weightstream.format.dtypes import DTYPES, DType

__all__ = [
    "PREFIX_SIZE",
    "CheckpointIndex",
    "FileIndex",
    "TensorEntry",
    "parse_header",
    "parse_index",
    "parse_prefix",
]

PREFIX_SIZE = 8
_MAX_OFFSET = 1 << 63
_MAX_ELEMENTS = (1 << 63) - 1
"""torch counts elements and strides in int64: the product of a shape's non-zero dimensions
must fit, or ``torch.empty`` fails on it even when a zero dimension makes it empty."""
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlist = 8
_repr.maxlevel = 3


def _show(value: Any) -> str:
    """A bounded repr for messages: a header is untrusted and may hold megabytes in one value."""
    return _repr.repr(value)


_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of one file. ``start``/``end`` are absolute file offsets (end exclusive)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    end: int
    uri: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_shape(self) -> tuple[int, ...] | None:
        """The shape of the torch tensor that holds this one (the header's shape, but for a
        packed dtype: F4 halves the last dimension); ``None`` where torch cannot hold it."""
        return self.dtype.torch_shape(self.shape)


@dataclass(frozen=True)
class FileIndex:
    """The validated header of one safetensors file."""

    uri: str
    size: int
    """Total file size in bytes."""
    data_start: int
    """Absolute offset of the data section (8 + header length)."""
    tensors: tuple[TensorEntry, ...]
    """In file order (ascending offsets)."""
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointIndex:
    """A parsed ``model.safetensors.index.json``."""

    uri: str
    weight_map: dict[str, str]
    """Tensor name -> shard file name, relative to the index's folder."""
    metadata: dict[str, Any]


def parse_prefix(prefix: bytes, *, uri: str, file_size: int, max_header_size: int) -> int:
    """Validate the 8-byte length prefix; return the header length N."""
    if file_size < PREFIX_SIZE or len(prefix) < PREFIX_SIZE:
        raise FormatError(
            f"file is {file_size} bytes, too short for the 8-byte header length prefix "
            "(empty or truncated file?)",
            uri=uri,
            byte_range=(0, PREFIX_SIZE),
        )
    n = int.from_bytes(prefix[:PREFIX_SIZE], "little")
    if n > max_header_size:
        raise FormatError(
            f"header length prefix says {n} bytes, more than the maximum of {max_header_size} "
            "(corrupt file, or not a safetensors file; raise max_header_size if it is genuine)",
            uri=uri,
            byte_range=(0, PREFIX_SIZE),
        )
    if n < 2:
        raise FormatError(f"header length {n} is too small for a JSON object", uri=uri, byte_range=(0, 8))
    if PREFIX_SIZE + n > file_size:
        raise FormatError(
            f"truncated file: the length prefix announces a {n}-byte header (up to byte "
            f"{PREFIX_SIZE + n}) but the file is {file_size} bytes",
            uri=uri,
            byte_range=(PREFIX_SIZE, PREFIX_SIZE + n),
        )
    return n


def _reject_duplicates(
    uri: str, header_range: tuple[int, int]
) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)  # C speed: one Python call per JSON object, none per key
        if len(out) != len(pairs):
            seen: set[str] = set()
            key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise FormatError(f"duplicate key {_show(key)} in JSON", uri=uri, byte_range=header_range)
        return out

    return hook


_SPACED_KEY = re.compile(r'"\s+:')


def _keys_in_text(text: str) -> int:
    """Object keys in JSON text, counted exactly where that is cheap: with no backslash in the
    text (so every quote ends or starts a string) and no space before a colon, every key ends
    in ``":`` and every ``":`` ends a key. Otherwise -1, and the header is checked key by key
    (see ``_load_json``)."""
    if "\\" in text or _SPACED_KEY.search(text):
        return -1
    return text.count('":')


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _lone_surrogate(text: str) -> int | None:
    """Where (a character offset) ``text`` escapes half of a UTF-16 surrogate pair without the
    other half (``\\ud800`` not followed by ``\\udc00``-``\\udfff``, or the low half alone):
    not Unicode, so the safetensors library (serde_json) refuses it, while Python's ``json``
    keeps it as a lone surrogate. ``None`` where there is none. Python work per surrogate
    escape only (``text`` is valid JSON)."""
    paired = -1  # the offset of the low half of the last pair
    for m in _SURROGATE.finditer(text):
        at = m.start()
        if at == paired:
            continue
        run = at
        while run > 0 and text[run - 1] == "\\":
            run -= 1
        if (at - run) % 2:
            continue  # an escaped backslash, then text that reads "ud800"
        if text[at + 3] in "89abAB" and _LOW_SURROGATE.match(text, at + 6):
            paired = at + 6
            continue
        return at
    return None


_NEGATIVE_ZERO = re.compile(r"-0\s*[,\]}]")  # a number ends at one of these (or inside a string)


class _NegativeZero(Exception):
    pass


def _int_not_negative_zero(literal: str) -> int:
    if literal == "-0":
        raise _NegativeZero
    return int(literal)


def _negative_zero(text: str) -> bool:
    """Whether ``text`` (valid JSON) holds the number ``-0``: an integer 0 to Python's json, a
    float to the safetensors library's (serde_json), which refuses it as a shape or an offset.
    Looked for in the text first (where it seems to be, it may be inside a string: the text is
    then parsed again, with a hook per integer)."""
    if "-" not in text or _NEGATIVE_ZERO.search(text) is None:
        return False
    try:
        json.loads(text, parse_int=_int_not_negative_zero)
    except _NegativeZero:
        return True
    return False


def _keys_parsed(obj: Any) -> int:
    """Keys of the top-level object and of the objects directly in it (the entries, the
    metadata): every key a valid header has."""
    if type(obj) is not dict:
        return -1
    return len(obj) + sum(len(v) for v in obj.values() if type(v) is dict)


def _load_json(raw: bytes, *, uri: str, base: int, what: str) -> Any:
    span = (base, base + len(raw))
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(
            f"{what} is not valid UTF-8 ({exc.reason} at byte {base + exc.start})",
            uri=uri,
            byte_range=span,
        ) from None
    try:
        obj = json.loads(text)  # C speed; duplicate keys are found below, without a Python hook per object
        if _keys_in_text(text) != _keys_parsed(obj):
            # Fewer keys survived than the text holds: some key repeats. Parse again, slowly, to
            # name it (the file is refused either way).
            obj = json.loads(text, object_pairs_hook=_reject_duplicates(uri, span))
    except json.JSONDecodeError as exc:
        raise FormatError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            uri=uri,
            byte_range=span,
        ) from None
    except RecursionError:
        raise FormatError(
            f"{what} nests JSON values too deeply to be a safetensors {what}", uri=uri, byte_range=span
        ) from None
    except ValueError as exc:  # an integer of more digits than Python converts (int_max_str_digits)
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"{what} is not usable JSON: {exc}", uri=uri, byte_range=span) from None
    if what == "header":  # the safetensors library's rules (an index is read by Python's json everywhere)
        at = _lone_surrogate(text) if "\\" in text else None
        if at is not None:
            raise FormatError(
                f"{what} is not valid JSON text: {text[at : at + 6]} at byte "
                f"{base + len(text[:at].encode())} is half of a UTF-16 surrogate pair, without the "
                "other half (a string must be Unicode)",
                uri=uri,
                byte_range=span,
            )
        if _negative_zero(text):
            raise FormatError(
                f"{what} holds the number -0 where an integer goes (a shape or an offset): the "
                "safetensors library reads it as a float and refuses the file",
                uri=uri,
                byte_range=span,
            )
    return obj


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_UNTRUSTED = (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, AttributeError)
"""What Python raises on data it cannot handle: a header that slips past every rule below and
trips one of these is still a malformed file, reported as one (the cause stays chained)."""


_GC_LOCK = threading.Lock()
_GC_HOLDERS = 0
_GC_WAS_ON = False
_LARGE_HEADER = 1 << 20


@contextlib.contextmanager
def _without_cyclic_gc(large: bool) -> Iterator[None]:
    """A large header's JSON is hundreds of thousands of new acyclic objects; the cyclic garbage
    collector would walk them again and again while they are made (a third of the parse of a
    13 MB header). It is paused while any thread parses one, and resumed, if it was on, when the
    last of them is done."""
    global _GC_HOLDERS, _GC_WAS_ON
    if not large:
        yield
        return
    with _GC_LOCK:
        if _GC_HOLDERS == 0:
            _GC_WAS_ON = gc.isenabled()
            gc.disable()
        _GC_HOLDERS += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_HOLDERS -= 1
            if _GC_HOLDERS == 0 and _GC_WAS_ON:
                gc.enable()


def parse_header(raw: bytes, *, uri: str, file_size: int) -> FileIndex:
    """Validate a header (the N bytes after the prefix) against the file's size."""
    try:
        with _without_cyclic_gc(len(raw) >= _LARGE_HEADER):
            return _parse_header(raw, uri=uri, file_size=file_size)
    except FormatError:
        raise
    except _UNTRUSTED as exc:
        raise FormatError(
            f"header cannot be read: {type(exc).__name__}: {_show(str(exc))}",
            uri=uri,
            byte_range=(PREFIX_SIZE, PREFIX_SIZE + len(raw)),
        ) from exc


def _parse_header(raw: bytes, *, uri: str, file_size: int) -> FileIndex:
    data_start = PREFIX_SIZE + len(raw)
    header_range = (PREFIX_SIZE, data_start)
    obj = _load_json(raw, uri=uri, base=PREFIX_SIZE, what="header")
    if not isinstance(obj, dict):
        raise FormatError(
            f"header must be a JSON object, got {type(obj).__name__}", uri=uri, byte_range=header_range
        )

    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("__metadata__ must map strings to strings", uri=uri, byte_range=header_range)

    raw_entries = [_parse_entry(name, info, uri=uri, data_start=data_start) for name, info in obj.items()]
    tensors = _contiguous(raw_entries, uri=uri, data_start=data_start, file_size=file_size)
    return FileIndex(
        uri=uri, size=file_size, data_start=data_start, tensors=tuple(tensors), metadata=metadata
    )


_RawEntry = tuple[int, int, str, DType, tuple[int, ...]]
"""``(begin, end, name, dtype, shape)``: one entry as the header gives it, offsets relative to
the data."""


def _parse_entry(name: str, info: Any, *, uri: str, data_start: int) -> _RawEntry:
    """One header entry, each of its fields checked. (The hot loop of opening a checkpoint: a
    header of 100,000 entries is 100,000 calls, so the common case does as little as it can and
    every failure is described in :func:`_bad_entry`.)"""
    if type(info) is dict and len(info) == 3:
        named = info.get("dtype")
        dtype = DTYPES.get(named) if type(named) is str else None
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if dtype is not None and type(shape) is list and type(offsets) is list and len(offsets) == 2:
            begin, end = offsets
            numel = extent = 1
            ok = type(begin) is int and type(end) is int and 0 <= begin <= end < _MAX_OFFSET
            for d in shape:
                if type(d) is not int or d < 0:
                    ok = False
                    break
                numel *= d
                extent *= d or 1
                if extent > _MAX_ELEMENTS:  # before a hostile shape makes the product huge
                    ok = False
                    break
            if ok and dtype.nbytes(numel) == end - begin:
                return begin, end, name, dtype, tuple(shape)
    raise _bad_entry(name, info, uri=uri, data_start=data_start)


def _bad_entry(name: str, info: Any, *, uri: str, data_start: int) -> FormatError:
    """What is wrong with an entry that :func:`_parse_entry` refused."""
    header_range = (PREFIX_SIZE, data_start)

    def bad(why: str) -> FormatError:
        return FormatError(why, uri=uri, tensor=name, byte_range=header_range)

    if not isinstance(info, dict):
        return bad(f"entry must be a JSON object, got {type(info).__name__}")
    keys = set(info)
    if keys != _ENTRY_KEYS:
        missing = sorted(_ENTRY_KEYS - keys)
        extra = sorted(keys - _ENTRY_KEYS)
        return bad(f"entry keys must be dtype, shape, data_offsets (missing {missing}, unexpected {extra})")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        return bad(f"unknown dtype {_show(info['dtype'])} (known: {', '.join(DTYPES)})")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        return bad(f"shape must be a list of non-negative integers, got {_show(shape)}")
    numel, extent = 1, 1
    for d in shape:
        numel *= d
        extent *= max(d, 1)
        if extent > _MAX_ELEMENTS:
            return bad(
                f"shape {_show(shape)} is too large for torch: the product of its non-zero "
                f"dimensions exceeds 2^63-1"
            )
    offsets = info["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and 0 <= o < _MAX_OFFSET for o in offsets)
    ):
        return bad(f"data_offsets must be [begin, end] with integers from 0 to 2^63-1, got {_show(offsets)}")
    begin, end = offsets
    if end < begin:
        return bad(f"data_offsets end {end} is before begin {begin}")
    nbytes = dtype.nbytes(numel)
    if nbytes is None:
        return bad(f"{numel} elements of {dtype.name} ({dtype.bits} bits) do not fill whole bytes")
    return FormatError(
        f"size mismatch: shape {shape} of {dtype.name} needs {nbytes} bytes but data_offsets "
        f"span {end - begin}",
        uri=uri,
        tensor=name,
        byte_range=(data_start + begin, data_start + end),
    )


def _by_offsets(e: _RawEntry) -> tuple[int, int]:
    return e[0], e[1]


def _contiguous(entries: list[_RawEntry], *, uri: str, data_start: int, file_size: int) -> list[TensorEntry]:
    """The entries in offset order, which must tile the data exactly: no gap, no overlap, and
    the file ending where the last tensor does."""
    entries.sort(key=_by_offsets)
    cursor = 0
    tensors = []
    make = TensorEntry
    for begin, end, name, dtype, shape in entries:
        if begin != cursor:
            kind = "gap" if begin > cursor else "overlap"
            raise FormatError(
                f"offsets leave {'an overlap' if kind == 'overlap' else 'a gap'}: tensor starts at data offset {begin}, expected {cursor}",
                uri=uri,
                tensor=name,
                byte_range=(data_start + min(begin, cursor), data_start + max(begin, cursor)),
            )
        cursor = end
        tensors.append(make(name, dtype, shape, data_start + begin, data_start + end, uri))
    data_end = data_start + cursor
    if file_size < data_end:
        raise FormatError(
            f"truncated file: tensor data ends at byte {data_end} but the file is {file_size} bytes "
            f"({data_end - file_size} bytes missing; incomplete download?)",
            uri=uri,
            byte_range=(file_size, data_end),
        )
    if file_size > data_end:
        raise FormatError(
            f"{file_size - data_end} unexpected bytes after the last tensor (data ends at {data_end})",
            uri=uri,
            byte_range=(data_end, file_size),
        )
    return tensors


def parse_index(raw: bytes, *, uri: str) -> CheckpointIndex:
    """Validate a ``model.safetensors.index.json``."""
    try:
        return _parse_index(raw, uri=uri)
    except FormatError:
        raise
    except _UNTRUSTED as exc:
        raise FormatError(f"index cannot be read: {type(exc).__name__}: {_show(str(exc))}", uri=uri) from exc


def _parse_index(raw: bytes, *, uri: str) -> CheckpointIndex:
    obj = _load_json(raw, uri=uri, base=0, what="index")
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise FormatError('index must be a JSON object with a "weight_map" object', uri=uri)
    weight_map = obj["weight_map"]
    if not weight_map:
        raise FormatError("index lists no tensor (its weight_map is empty)", uri=uri)
    checked: set[str] = set()  # thousands of tensors name a few shards: check each shard once
    for name, shard in weight_map.items():
        if isinstance(shard, str) and shard in checked:
            continue
        if not isinstance(shard, str) or not shard:
            raise FormatError(
                f"weight_map value must be a shard file name, got {_show(shard)}", uri=uri, tensor=name
            )
        if "\0" in shard:
            raise FormatError(f"shard name {_show(shard)} holds a NUL byte", uri=uri, tensor=name)
        norm = posixpath.normpath(shard)
        if posixpath.isabs(shard) or norm == ".." or norm.startswith("../") or "\\" in shard:
            raise FormatError(
                f"shard path {_show(shard)} must be relative to the index's folder", uri=uri, tensor=name
            )
        checked.add(shard)
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise FormatError('"metadata" must be a JSON object', uri=uri)
    return CheckpointIndex(uri=uri, weight_map=dict(weight_map), metadata=metadata)
