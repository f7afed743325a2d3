"""Every error weightstream raises.

::

    WeightStreamError                 catch this to catch everything below
    ├── ConfigError (ValueError)      a setting is out of range or has the wrong type
    ├── FormatError (ValueError)      the checkpoint is malformed, truncated or inconsistent
    │   └── UnsupportedDtypeError     a valid dtype that torch cannot represent (F4, F6_*)
    ├── NotFoundError (FileNotFoundError)        a file, shard or tensor does not exist
    ├── PermissionDeniedError (PermissionError)  the storage refused access
    ├── ReadError (OSError)           the storage failed a read (EIO, short read, ...)
    ├── StorageTimeoutError (TimeoutError)       no progress within the configured timeout
    ├── MemoryBudgetError (MemoryError)          a destination buffer could not be allocated
    ├── DistributedError              another rank of a distributed load failed, or an exchange
    │                                 between ranks timed out
    └── StateDictError (RuntimeError) ``load_into``: the checkpoint does not fit the module
                                      (missing or unexpected keys, shapes that differ)

Each error carries ``uri`` (the file or object), ``tensor`` and ``byte_range`` (absolute
``(start, end)`` offsets in the file, end exclusive) where they apply, both as attributes and
in the message, so a log line alone says what failed and where.
"""

from __future__ import annotations

import re

__all__ = [
    "ConfigError",
    "DistributedError",
    "FormatError",
    "MemoryBudgetError",
    "NotFoundError",
    "PermissionDeniedError",
    "ReadError",
    "StateDictError",
    "StorageTimeoutError",
    "UnsupportedDtypeError",
    "WeightStreamError",
]

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/@:]*):(?P<password>[^\s/@]*)@")


def redact(text: str) -> str:
    """(Internal; not an error, so not in ``__all__``.) ``text`` with the password of every ``scheme://user:password@host`` URL in it replaced by
    ``***``: an endpoint given with credentials in it never shows them in a message, a
    representation or a JSON summary."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text) if "@" in text else text


class WeightStreamError(Exception):
    """Base of every error raised by weightstream.

    Attributes:
        uri: the file or object concerned, or ``None`` when the error is not about one.
        tensor: the tensor concerned, or ``None``.
        byte_range: ``(start, end)`` absolute byte offsets in ``uri`` (end exclusive), or ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        uri: str | None = None,
        tensor: str | None = None,
        byte_range: tuple[int, int] | None = None,
    ) -> None:
        message = redact(message)
        self.reason = message
        self.uri = uri
        self.tensor = tensor
        self.byte_range = byte_range
        where = []
        if uri is not None:
            where.append(f"file {uri}")
        if tensor is not None:
            tensor = tensor if isinstance(tensor, str) else repr(tensor)  # never fail building an error
            shown = tensor if len(tensor) <= _NAME_SHOWN else tensor[:_NAME_SHOWN] + "..."
            where.append(f"tensor {shown!r}")
        if byte_range is not None:
            where.append(f"bytes {byte_range[0]}-{byte_range[1]}")
        text = f"{message} [{', '.join(where)}]" if where else message
        # OSError subclasses interpret two positional args as (errno, strerror): pass one.
        super().__init__(text)

    # Pickling (errors cross process boundaries: multiprocessing, launchers, Ray) uses the
    # builtin exception protocol, ``(type, args, __dict__)``: every attribute travels, subclasses'
    # own included (``DistributedError.rank``, ``ConfigError.setting``). So every subclass's
    # ``__init__`` takes the message as its one positional argument.


_NAME_SHOWN = 200
"""Longest tensor name shown in a message (the attribute keeps it whole)."""


class ConfigError(WeightStreamError, ValueError):
    """A setting or an argument is invalid: out of range, wrong type or unparseable. The message
    names it (and the environment variable it came from); ``setting`` is the field's name where
    one applies."""

    def __init__(self, message: str, *, setting: str | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.setting = setting


class FormatError(WeightStreamError, ValueError):
    """The checkpoint is not a valid safetensors file / sharded checkpoint.

    Raised for a bad length prefix, oversized header, invalid UTF-8 or JSON, unknown dtype,
    bad shape, overlapping/gapped/out-of-bounds offsets, a file shorter than its header
    promises (truncated download) and an index that disagrees with its shards.
    """


class UnsupportedDtypeError(FormatError):
    """A dtype that the format allows but torch cannot hold (sub-byte F4, F6_E2M3, F6_E3M2)."""


class NotFoundError(WeightStreamError, FileNotFoundError):
    """A file, shard, object or requested tensor does not exist."""


class PermissionDeniedError(WeightStreamError, PermissionError):
    """The storage refused access (file mode, credentials)."""


class ReadError(WeightStreamError, OSError):
    """The storage failed a read: an I/O error, or fewer bytes than the file's size promised."""


class StorageTimeoutError(WeightStreamError, TimeoutError):
    """A read made no progress within ``StreamConfig.io_timeout`` seconds."""


class MemoryBudgetError(WeightStreamError, MemoryError):
    """A destination buffer could not be allocated."""


class DistributedError(WeightStreamError):
    """A distributed load failed elsewhere: another rank of the group failed (its error is in the
    message; ``rank`` says which, within the group), the ranks planned different loads, or an
    exchange timed out (``StreamConfig.exchange_timeout``). The failing rank itself raises its
    own error."""

    def __init__(self, message: str, *, rank: int | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.rank = rank


class StateDictError(WeightStreamError, RuntimeError):
    """:func:`weightstream.load_into` found that the checkpoint does not fit the module: keys
    missing or unexpected (with ``strict``) or shapes that differ. Raised before any tensor data
    is read; the message lists the keys."""
