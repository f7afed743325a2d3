"""A drop-in for the Run:ai Model Streamer's ``SafetensorsStreamer``.

Switch a code base by changing one import::

    # from runai_model_streamer import SafetensorsStreamer
    from weightstream.compat.runai import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(paths, device="cpu")
        for name, tensor in streamer.get_tensors():
            ...

The ``RUNAI_STREAMER_*`` variables that mean something here are honoured (a ``WEIGHTSTREAM_*``
variable of the same setting wins):

=====================================  =====================================================
``RUNAI_STREAMER_CONCURRENCY``         reads in flight at the start (files and object stores)
``RUNAI_STREAMER_CHUNK_BYTESIZE``      bytes per read (files and object stores)
``RUNAI_STREAMER_MEMORY_LIMIT``        bytes read but not yet consumed (``-1``: unlimited)
``RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS``  per-request timeout of object-store reads
``RUNAI_STREAMER_S3_LOW_SPEED_LIMIT``  bytes/s under which a request counts as stalled
``RUNAI_STREAMER_S3_ENDPOINT``         the S3 endpoint (else ``AWS_ENDPOINT_URL``)
``RUNAI_STREAMER_DIST``                ``0`` turns ``is_distributed`` off; otherwise a distributed
                                       load uses the default torch.distributed group
=====================================  =====================================================

Errors: the Run:ai streamer raises ``ValueError`` for every failure its users meet (a missing
or unreadable file, a truncated or malformed header, an unknown name in ``tensor_names``), and
code written for it catches that. Every error the drop-in raises is a ``ValueError`` too, and
also the :class:`~weightstream.errors.WeightStreamError` subclass weightstream raises for the
same failure (so ``except FileNotFoundError`` and ``except ValueError`` both work), with the
file, tensor and byte range as attributes.

Differences that help: yielded tensors are always owned by the caller (``owned=False`` is
accepted and changes nothing), the online tuner still adjusts the depth, and a failure raises a
:class:`~weightstream.errors.WeightStreamError` naming the file and byte range. ``s3_credentials``
may carry an endpoint and a region; keys come from the environment or the standard credential
chain (explicit keys raise :class:`~weightstream.errors.ConfigError` rather than being ignored).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

import weightstream
from weightstream._checkpoint import TensorStream
from weightstream.config import StreamConfig
from weightstream.distributed import Distributed
from weightstream.errors import (
    ConfigError,
    DistributedError,
    MemoryBudgetError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    StateDictError,
    StorageTimeoutError,
    WeightStreamError,
)

__all__ = [
    "RunaiDistributedError",
    "RunaiError",
    "RunaiMemoryBudgetError",
    "RunaiNotFoundError",
    "RunaiPermissionDeniedError",
    "RunaiReadError",
    "RunaiStateDictError",
    "RunaiStorageTimeoutError",
    "SafetensorsStreamer",
    "config_from_runai_env",
    "distributed_from_runai",
]


class RunaiError(WeightStreamError, ValueError):
    """:class:`~weightstream.errors.WeightStreamError`, also a ``ValueError``."""


class RunaiNotFoundError(NotFoundError, ValueError):
    """:class:`~weightstream.errors.NotFoundError` that Run:ai code catches as ``ValueError``."""


class RunaiPermissionDeniedError(PermissionDeniedError, ValueError):
    """:class:`~weightstream.errors.PermissionDeniedError`, also a ``ValueError``."""


class RunaiReadError(ReadError, ValueError):
    """:class:`~weightstream.errors.ReadError`, also a ``ValueError``."""


class RunaiStorageTimeoutError(StorageTimeoutError, ValueError):
    """:class:`~weightstream.errors.StorageTimeoutError`, also a ``ValueError``."""


class RunaiMemoryBudgetError(MemoryBudgetError, ValueError):
    """:class:`~weightstream.errors.MemoryBudgetError`, also a ``ValueError``."""


class RunaiDistributedError(DistributedError, ValueError):
    """:class:`~weightstream.errors.DistributedError`, also a ``ValueError``."""


class RunaiStateDictError(StateDictError, ValueError):
    """:class:`~weightstream.errors.StateDictError`, also a ``ValueError``."""


_AS_RUNAI: dict[type[WeightStreamError], type[WeightStreamError]] = {
    NotFoundError: RunaiNotFoundError,
    PermissionDeniedError: RunaiPermissionDeniedError,
    ReadError: RunaiReadError,
    StorageTimeoutError: RunaiStorageTimeoutError,
    MemoryBudgetError: RunaiMemoryBudgetError,
    DistributedError: RunaiDistributedError,
    StateDictError: RunaiStateDictError,
    WeightStreamError: RunaiError,
}


def _as_runai(exc: WeightStreamError) -> WeightStreamError:
    """The same error as a class that is also a ``ValueError`` (``exc`` itself if it is one)."""
    if isinstance(exc, ValueError):
        return exc
    cls = next((_AS_RUNAI[c] for c in type(exc).__mro__ if c in _AS_RUNAI), None)
    if cls is None:  # pragma: no cover - every class of weightstream.errors is mapped (tested)
        return exc
    new = cls(exc.reason, uri=exc.uri, tensor=exc.tensor, byte_range=exc.byte_range)
    new.__dict__.update(exc.__dict__)
    return new


@contextlib.contextmanager
def _runai_errors() -> Iterator[None]:
    try:
        yield
    except WeightStreamError as exc:
        new = _as_runai(exc)
        if new is exc:
            raise
        raise new from exc


def config_from_runai_env(env: Mapping[str, str] | None = None, s3_credentials: Any = None) -> StreamConfig:
    """The :class:`StreamConfig` a Run:ai streamer configured by ``env`` would correspond to."""
    env = os.environ if env is None else env
    config = StreamConfig.from_env(env)
    store: dict[str, Any] = {}

    def unset(*names: str) -> bool:
        return not any(env.get(n, "").strip() for n in names)

    # Run:ai has one concurrency and one chunk size for every backend; ours has a pair per kind.
    if not unset("RUNAI_STREAMER_CONCURRENCY") and unset("WEIGHTSTREAM_S3_CONCURRENCY"):
        store["concurrency"] = config.concurrency
    if not unset("RUNAI_STREAMER_CHUNK_BYTESIZE") and unset("WEIGHTSTREAM_S3_CHUNK_SIZE"):
        store["chunk_size"] = config.chunk_size
    timeout = env.get("RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS", "").strip()
    if timeout and unset("WEIGHTSTREAM_S3_REQUEST_TIMEOUT"):
        try:
            store["request_timeout"] = int(timeout) / 1000
        except ValueError:
            raise ConfigError(
                f"RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS must be an integer (milliseconds), got {timeout!r}"
            ) from None
    endpoint = env.get("RUNAI_STREAMER_S3_ENDPOINT", "").strip()
    if endpoint and unset("WEIGHTSTREAM_S3_ENDPOINT"):
        store["endpoint"] = endpoint
    if s3_credentials is not None:
        if any(
            getattr(s3_credentials, k, None) for k in ("access_key_id", "secret_access_key", "session_token")
        ):
            raise ConfigError(
                "S3Credentials with explicit keys are not supported by weightstream's Run:ai drop-in: "
                "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN) in the environment, "
                "or use a profile or instance role"
            )
        if getattr(s3_credentials, "endpoint", None):
            store["endpoint"] = s3_credentials.endpoint
        if getattr(s3_credentials, "region_name", None):
            store["region"] = s3_credentials.region_name
    if store:
        config = config.replace_object_store(**store)
    return config


def distributed_from_runai(is_distributed: bool, env: Mapping[str, str] | None = None) -> Distributed:
    """``is_distributed`` and ``RUNAI_STREAMER_DIST`` as a ``distributed=`` argument."""
    env = os.environ if env is None else env
    mode = env.get("RUNAI_STREAMER_DIST", "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise ConfigError(f"RUNAI_STREAMER_DIST must be 0, 1 or auto, got {mode!r}")
    if not is_distributed or mode == "0":
        return False
    return "auto"


class SafetensorsStreamer:
    """``runai_model_streamer.SafetensorsStreamer``, backed by weightstream."""

    def __init__(self) -> None:
        self._stream: TensorStream | None = None

    def __enter__(self) -> SafetensorsStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    @property
    def stats(self) -> weightstream.LoadStats | None:
        """What the last stream did (weightstream's statistics; not in Run:ai's API)."""
        return self._stream.stats if self._stream is not None else None

    def stream_file(
        self,
        path: str,
        s3_credentials: Any = None,
        device: str | None = "cpu",
        is_distributed: bool = False,
        tensor_names: Collection[str] | None = None,
        owned: bool = True,
    ) -> None:
        self.stream_files(
            [path],
            s3_credentials=s3_credentials,
            device=device,
            is_distributed=is_distributed,
            tensor_names=tensor_names,
            owned=owned,
        )

    def stream_files(
        self,
        paths: list[str],
        s3_credentials: Any = None,
        device: str | None = "cpu",
        is_distributed: bool = False,
        tensor_names: Collection[str] | None = None,
        owned: bool = True,
    ) -> None:
        """Read the headers of ``paths`` now (errors surface here); tensors come from
        :meth:`get_tensors`. ``owned`` is accepted for compatibility: tensors are always owned."""
        if isinstance(tensor_names, str):
            raise ConfigError("tensor_names must be a collection of names, not a single str")
        if tensor_names is not None and len(tensor_names) == 0:
            raise ConfigError("tensor_names must not be empty; pass None to load every tensor")
        self.close()
        with _runai_errors():
            config = config_from_runai_env(s3_credentials=s3_credentials)
            self._stream = weightstream.stream(
                [str(p) for p in paths],
                device=device or "cpu",
                config=config,
                tensors=None if tensor_names is None else list(tensor_names),
                distributed=distributed_from_runai(is_distributed),
            )

    def get_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` as each tensor's bytes arrive."""
        if self._stream is None:
            raise ConfigError("get_tensors() before stream_file() / stream_files()")
        with _runai_errors():
            yield from self._stream
