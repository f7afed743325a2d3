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
``RUNAI_STREAMER_S3_UNSIGNED``        ``1``: unsigned requests (public buckets)
``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING``  ``1``: virtual-hosted URLs, ``0``: path-style
``RUNAI_STREAMER_DIST``                with ``is_distributed``: ``auto`` (default) splits the reads
                                       across the default group only on a NCCL group and a
                                       non-CPU device, as Run:ai does; ``1`` on any group; ``0`` never
``RUNAI_STREAMER_DIST_TIMEOUT``        seconds a rank waits for the others (``exchange_timeout``)
``RUNAI_STREAMER_LOG_LEVEL``           level of weightstream's loggers
=====================================  =====================================================

``RUNAI_STREAMER_MEMORY_LIMIT`` takes any value Run:ai takes: ``-1`` is unlimited, and a limit
below one page (``0`` included: "the largest tensor") reads one tensor at a time, which is what
weightstream does with a limit smaller than a tensor. Given several files, a name that two of
them hold is yielded twice (the files are then streamed one after another), as Run:ai does;
with ``tensor_names`` that is an error, as in Run:ai. ``list_safetensors``, ``pull_files`` and
``ObjectStorageModel`` are here too (what vLLM imports from the Run:ai package for object-store
models), reading object stores through weightstream's client.

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
import fcntl
import fnmatch
import glob
import logging
import os
import shutil
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

import weightstream
from weightstream.checkpoint import DUPLICATE_NAME
from weightstream.config import StreamConfig
from weightstream.distributed import Distributed
from weightstream.errors import (
    ConfigError,
    DistributedError,
    FormatError,
    MemoryBudgetError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    StateDictError,
    StorageTimeoutError,
    WeightStreamError,
)
from weightstream.location import object_location
from weightstream.pipeline import TensorStream
from weightstream.sources.object_store import download, list_objects

log = logging.getLogger(__name__)

__all__ = [
    "ObjectStorageModel",
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
    "list_safetensors",
    "pull_files",
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
    """The :class:`StreamConfig` a Run:ai streamer configured by ``env`` would correspond to: the
    settings the table in :mod:`weightstream.compat.runai_env` reads (as every front end does),
    ``RUNAI_STREAMER_LOG_LEVEL``, and ``s3_credentials``' endpoint and region."""
    env = os.environ if env is None else env
    level = env.get("RUNAI_STREAMER_LOG_LEVEL", "").strip().upper()
    if level:
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"RUNAI_STREAMER_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}"
            )
        logging.getLogger("weightstream").setLevel(level)
    settings: dict[str, Any] = {}
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
            settings["object_store.endpoint"] = s3_credentials.endpoint
        if getattr(s3_credentials, "region_name", None):
            settings["object_store.region"] = s3_credentials.region_name
    return StreamConfig.from_mapping(
        settings, env=env, label=lambda key: f"S3Credentials {key.rpartition('.')[2]}"
    )


def distributed_from_runai(
    is_distributed: bool, env: Mapping[str, str] | None = None, *, device: str | torch.device | None = "cpu"
) -> Distributed:
    """``is_distributed`` and ``RUNAI_STREAMER_DIST`` as a ``distributed=`` argument, as Run:ai
    decides: ``0`` never; ``1`` the default group when torch.distributed is initialised with more
    than one rank; ``auto`` (default) the same, but only for a non-CPU device on a NCCL group."""
    env = os.environ if env is None else env
    mode = env.get("RUNAI_STREAMER_DIST", "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise ConfigError(f"RUNAI_STREAMER_DIST must be 0, 1 or auto, got {mode!r}")
    if not is_distributed or mode == "0":
        return False
    if mode == "auto":
        if torch.device(device or "cpu").type == "cpu":
            return False
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
            return False
    return "auto"


def list_safetensors(path: str, s3_credentials: Any = None) -> list[str]:
    """The ``*.safetensors`` files directly in ``path`` (a folder or an object-store prefix), as
    full paths or URIs, sorted; not recursive, as Run:ai's."""
    loc = object_location(path)
    if loc is None:
        return sorted(glob.glob(os.path.join(path, "*.safetensors")))
    with _runai_errors():
        config = config_from_runai_env(s3_credentials=s3_credentials)
        found = list_objects(loc, config)
    return sorted(loc.with_key(k).uri for k in found if k.endswith(".safetensors"))


def pull_files(
    model_path: str,
    dst: str,
    allow_pattern: list[str] | None = None,
    ignore_pattern: list[str] | None = None,
    s3_credentials: Any = None,
) -> None:
    """Download every object under the prefix ``model_path`` (recursively) to the folder ``dst``,
    keeping the layout below the prefix; ``allow_pattern`` / ``ignore_pattern`` are shell patterns
    matched against that relative path. Object stores only, as Run:ai's. Each file is written
    whole, then renamed into place."""
    loc = object_location(model_path)
    if loc is None:
        raise NotImplementedError("pull files is not implemented for file system paths")
    with _runai_errors():
        config = config_from_runai_env(s3_credentials=s3_credentials)
        prefix = loc.key.rstrip("/")
        for key, size in list_objects(loc, config, recursive=True).items():
            rel = key[len(prefix) :].lstrip("/") if prefix else key
            if not rel or rel.endswith("/"):
                continue
            if allow_pattern and not any(fnmatch.fnmatch(rel, p) for p in allow_pattern):
                continue
            if ignore_pattern and any(fnmatch.fnmatch(rel, p) for p in ignore_pattern):
                continue
            target = os.path.join(dst, rel)
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            download(loc.with_key(key), target, config, size=size)


class ObjectStorageModel:
    """A model's files under an object-store prefix, mirrored once into a local folder, safely
    across processes (Run:ai's class of the same name): ``with ObjectStorageModel(model_path=url,
    dst=folder) as m: m.pull_files(allow_pattern=[...])``. The first process downloads (under an
    exclusive ``flock`` on ``dst + ".lock"``) and marks the folder complete on a clean exit; the
    others wait, then find it complete and download nothing."""

    SENTINEL_NAME = ".runai_complete"
    MARKER_NAME = ".weightstream-mirror"
    """Written into every folder this class creates: a folder it may empty again (an unfinished
    download of its own). Nothing else is ever deleted."""

    def __init__(self, model_path: str, dst: str, s3_credentials: Any = None) -> None:
        if object_location(model_path) is None:
            raise ValueError(f"model_path {model_path!r} is not an s3://, gs:// or az:// path")
        self.dir = _own_folder(dst)
        self._model_path = model_path.rstrip("/") + "/"
        self._s3_credentials = s3_credentials
        self._sentinel = os.path.join(self.dir, self.SENTINEL_NAME)
        os.makedirs(os.path.dirname(self.dir), exist_ok=True)
        self._lock = open(self.dir + ".lock", "a")  # noqa: SIM115 - held until __exit__
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            self._skip = os.path.exists(self._sentinel)
            if not self._skip:
                self._start_afresh()
        except BaseException:
            self._release()
            raise

    def _start_afresh(self) -> None:
        """Empty the folder for a new download, if it is ours to empty: absent, empty, or made
        by this class (its marker inside). Anything else is refused, untouched."""
        marker = os.path.join(self.dir, self.MARKER_NAME)
        if os.path.lexists(self.dir):
            if os.path.islink(self.dir) or not os.path.isdir(self.dir):
                raise ConfigError(
                    "dst exists and is not a folder (or is a symbolic link): it will not be replaced",
                    uri=self.dir,
                    setting="dst",
                )
            entries = os.listdir(self.dir)
            if entries and self.MARKER_NAME not in entries:
                raise ConfigError(
                    "dst is a folder holding files this code did not put there (no "
                    f"{self.MARKER_NAME} marker): it will not be emptied for a download. Name an empty "
                    "or new folder, or remove this one yourself",
                    uri=self.dir,
                    setting="dst",
                )
            if entries:
                shutil.rmtree(self.dir)
        os.makedirs(self.dir, exist_ok=True)
        with open(marker, "w"):
            pass

    def pull_files(
        self, allow_pattern: list[str] | None = None, ignore_pattern: list[str] | None = None
    ) -> None:
        if not self._skip:
            pull_files(self._model_path, self.dir, allow_pattern, ignore_pattern, self._s3_credentials)

    def __enter__(self) -> ObjectStorageModel:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None and not self._skip:
                ours = (self.SENTINEL_NAME, self.MARKER_NAME)
                if not [f for f in os.listdir(self.dir) if f not in ours]:
                    raise RuntimeError(f"No files were downloaded to {self.dir!r}: verify the model path")
                with open(self._sentinel, "w"):
                    pass
        finally:
            self._release()

    def _release(self) -> None:
        if not self._lock.closed:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()


def _own_folder(dst: object) -> str:
    """``dst`` as an absolute path that is safe to make and, later, to empty: never the root,
    the home folder, the current folder or one above any of them, and never an empty path (an
    unset variable). Run:ai's class takes ``dst=""`` and ``dst="/"`` as the root and deletes it."""
    if not isinstance(dst, str | os.PathLike) or not str(os.fspath(dst)).strip():
        raise ConfigError(f"dst must name a folder, got {dst!r}", setting="dst")
    text = os.fspath(dst)
    if "\0" in str(text):
        raise ConfigError("dst cannot hold a NUL byte", setting="dst")
    path = os.path.abspath(os.path.expanduser(str(text)))
    real = os.path.realpath(path)
    guarded = {os.path.realpath(p) for p in ("/", os.path.expanduser("~"), os.getcwd())}
    for g in guarded:
        if real == g or g.startswith(real.rstrip("/") + "/"):
            raise ConfigError(
                f"dst {text!r} is {real} (the root, the home folder, the current folder or a folder "
                "above one of them): a model mirror must be a folder of its own",
                setting="dst",
            )
    return path


class SafetensorsStreamer:
    """``runai_model_streamer.SafetensorsStreamer``, backed by weightstream."""

    def __init__(self) -> None:
        self._stream: TensorStream | None = None
        self._later: list[Any] = []
        """Streams still to run after ``_stream``: files that repeat a name are read one by one."""
        self.files_to_tensors_metadata: dict[int, list[Any]] = {}
        """File index -> the tensors to be read from it (weightstream's entries: ``name``,
        ``dtype``, ``shape``, offsets): the attribute Run:ai keeps under this name, which code
        such as Run:ai's own ``StreamerPatcher`` reads."""

    def __enter__(self) -> SafetensorsStreamer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._later = []

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
        if isinstance(paths, list | tuple) and not paths:
            self.files_to_tensors_metadata = {}
            return  # as Run:ai: no file, nothing to stream
        with _runai_errors():
            config = config_from_runai_env(s3_credentials=s3_credentials)
            dev = device or "cpu"

            def start(files: list[str]) -> TensorStream:
                return weightstream.stream(
                    files,
                    device=dev,
                    config=config,
                    tensors=None if tensor_names is None else list(tensor_names),
                    distributed=distributed_from_runai(is_distributed, device=dev),
                )

            files = [str(p) for p in paths]
            wanted = None if tensor_names is None else set(tensor_names)
            try:
                self._stream = start(files)
            except FormatError as exc:
                if tensor_names is not None or DUPLICATE_NAME not in exc.reason:
                    if DUPLICATE_NAME in exc.reason:
                        raise FormatError(
                            f"tensor_names requested a tensor that {exc.reason}",
                            uri=exc.uri,
                            tensor=exc.tensor,
                        ) from exc
                    raise
                # Run:ai streams the files one after another and yields a repeated name twice.
                self._stream = start(files[:1])
                self._later = [lambda f=f: start([f]) for f in files[1:]]
            self.files_to_tensors_metadata = {
                i: [t for t in ckpt.tensors if wanted is None or t.name in wanted]
                for i, ckpt in enumerate(_file_indexes(files, self._stream))
            }

    def get_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` as each tensor's bytes arrive (nothing before a ``stream_files``)."""
        with _runai_errors():
            while self._stream is not None:
                yield from self._stream
                if not self._later:
                    return
                self._stream = self._later.pop(0)()


def _file_indexes(files: list[str], stream: TensorStream) -> list[Any]:
    """The validated headers of ``files``, in their order (those the stream has read; the
    others, read now)."""
    known = {f.uri: f for f in stream.files}
    out = []
    for f in files:
        if f not in known:
            with weightstream.open_checkpoint(f, config=stream.config) as more:
                known.update({x.uri: x for x in more.files})
        out.append(known[f])
    return out
