"""Settings of a load: one frozen, keyword-only value object, validated on construction.

Memory arithmetic, in one place:

* bytes being read at any moment  <= ``concurrency * chunk_size``
* bytes read but not yet handed to the caller  <= ``memory_limit``
  (one tensor larger than ``memory_limit`` is still loaded, alone, when nothing else is held)
* ``load()`` keeps every tensor, so its peak is the checkpoint size plus the header bytes;
  ``stream()`` peaks near ``memory_limit`` plus whatever the caller keeps.

The environment is read in exactly one place, :meth:`StreamConfig.from_env`, and only when it
is called. Explicit keyword arguments beat the environment. ``RUNAI_STREAMER_CONCURRENCY``,
``RUNAI_STREAMER_CHUNK_BYTESIZE`` and ``RUNAI_STREAMER_MEMORY_LIMIT`` are honoured when the
matching ``WEIGHTSTREAM_*`` variable is unset, so a deployment tuned for the Run:ai streamer
keeps its settings.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from weightstream.errors import ConfigError

__all__ = [
    "DirectIO",
    "ObjectStoreConfig",
    "StreamConfig",
    "check_seconds",
    "parse_size",
    "profile_document",
    "read_profile",
]

DirectIO = Literal["auto", "on", "off"]
T = TypeVar("T")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
_DEFAULT_MEMORY_LIMIT = 2 * GiB

MAX_SECONDS = 30 * 24 * 3600
"""The longest timeout or delay any setting accepts (30 days). Every wait is bounded: ``inf``,
``nan`` and values no clock or wait primitive can hold are refused with a :class:`ConfigError`
instead of failing inside a load."""


def _int(name: str, value: Any, low: int, high: int, *, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an int from {low} to {high}{note}, got {value!r}", setting=name)


def check_seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` if it is a duration every setting would accept (finite, within
    ``(0, MAX_SECONDS]``; ``[0, ...]`` with ``zero``), else a :class:`ConfigError` naming
    ``name``: the one rule for durations, for front ends too (the CLI's flags)."""
    _seconds(name, value, zero=zero)
    return float(value)


def _seconds(name: str, value: Any, *, zero: bool = False) -> None:
    """Refuse a duration that is not a finite number of seconds within ``(0, MAX_SECONDS]``
    (``[0, ...]`` with ``zero``)."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value >= 0 if zero else value > 0)
        and value <= MAX_SECONDS
    )
    if not ok:
        low = "0" if zero else "more than 0"
        raise ConfigError(
            f"{name} must be a finite number of seconds, from {low} to {MAX_SECONDS} (30 days), "
            f"got {value!r}",
            setting=name,
        )


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?)b?|b)?\s*$", re.IGNORECASE)
_POWERS = "kmgtp"


def parse_size(value: str | int, *, name: str = "size") -> int:
    """A byte count from ``"4096"``, ``"16MiB"``, ``"1.5GiB"``, ``"700GB"`` or ``"2G"``.

    One rule for every size weightstream reads (settings, environment variables, the command
    line, vLLM's extra config, ``recommend --model-size``): the IEC units ``KiB`` / ``MiB`` /
    ``GiB`` / ``TiB`` / ``PiB`` (also ``Ki``, ``Mi``, ...) are powers of 2, and the SI units ``kB`` /
    ``MB`` / ``GB`` / ``TB`` / ``PB`` (also ``k``, ``M``, ``G``, ...) are powers of 10, as in
    Kubernetes resource quantities. Letters may be upper or lower case.

    >>> parse_size("16MiB"), parse_size("16MB")
    (16777216, 16000000)
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a byte count, got {value!r}", setting=name)
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value)) if isinstance(value, str) else None
    if not match:
        raise ConfigError(
            f"{name}: cannot parse {value!r} as a size (examples: 4096, 16MiB, 2GiB, 700GB)", setting=name
        )
    number, unit, binary = match.groups()
    scale = 1
    if unit:
        power = _POWERS.index(unit.lower()) + 1
        scale = 1 << (10 * power) if binary else 10 ** (3 * power)
    return int(float(number) * scale) if "." in number else int(number) * scale


def _env_field(env: str, *aliases: str, size: bool = False) -> dict[str, Any]:
    """Field metadata: the environment variable (and older names it also answers to), and
    whether the value is a byte count (parsed by :func:`parse_size`)."""
    return {"env": env, "aliases": aliases, "size": size}


Addressing = Literal["auto", "path", "virtual"]
Transport = Literal["auto", "obstore", "direct"]


@dataclass(frozen=True, kw_only=True)
class ObjectStoreConfig:
    """How object stores (``s3://``, ``gs://``, ``az://``) are reached. Defaults need no settings.

    Credentials are not fields: the store client reads the standard chain itself
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, web identity,
    container and instance metadata; ``GOOGLE_*``; ``AZURE_*``).
    """

    concurrency: int = field(
        default=128, metadata=_env_field("WEIGHTSTREAM_S3_CONCURRENCY", "RUNAI_STREAMER_OBJ_CONCURRENCY")
    )
    """Requests in flight for object-store checkpoints at the start of a load (replaces
    ``StreamConfig.concurrency`` there; the tuner moves it). Default 128: stores cap each
    connection (tens of MB/s), so depth decides throughput. Measured on the emulated store:
    128 x 8 MiB is 1.6-1.7x the Run:ai streamer at 25 MB/s per connection and level with it on
    saturated 1-2 Gbit/s links (a stalled flow resumes where it stopped, so many flows cost
    little there). Env: ``WEIGHTSTREAM_S3_CONCURRENCY``."""

    chunk_size: int = field(default=8 * MiB, metadata=_env_field("WEIGHTSTREAM_S3_CHUNK_SIZE", size=True))
    """Bytes per ranged GET for object-store checkpoints (replaces ``StreamConfig.chunk_size``
    there). Default 8 MiB: with the default concurrency, 1 GiB in flight.
    Env: ``WEIGHTSTREAM_S3_CHUNK_SIZE``."""

    endpoint: str | None = field(
        default=None,
        metadata=_env_field("WEIGHTSTREAM_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    )
    """S3 endpoint URL, for S3-compatible stores (MinIO, Ceph, VAST, ...). An ``http://`` endpoint
    is allowed as given. Env: ``AWS_ENDPOINT_URL`` (or ``WEIGHTSTREAM_S3_ENDPOINT``)."""

    gcs_endpoint: str | None = field(
        default=None, metadata=_env_field("WEIGHTSTREAM_GCS_ENDPOINT", "STORAGE_EMULATOR_HOST")
    )
    """Where ``gs://`` requests go instead of Google's API: an emulator (fake-gcs-server) or a
    private endpoint. ``http://host:port``, ``https://...``, or ``host:port`` (HTTP, as Google's
    own clients read ``STORAGE_EMULATOR_HOST``). With a service-account key file in
    ``GOOGLE_APPLICATION_CREDENTIALS`` its credentials are used; without one (an emulator)
    requests go unsigned. Env: ``WEIGHTSTREAM_GCS_ENDPOINT`` or ``STORAGE_EMULATOR_HOST``."""

    region: str | None = field(
        default=None, metadata=_env_field("WEIGHTSTREAM_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
    )
    """S3 region. Env: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``."""

    addressing: Addressing = field(default="auto", metadata=_env_field("WEIGHTSTREAM_S3_ADDRESSING"))
    """``"path"`` (``endpoint/bucket/key``), ``"virtual"`` (``bucket.endpoint/key``) or ``"auto"``:
    path-style with a custom endpoint, virtual-hosted on AWS. Env: ``WEIGHTSTREAM_S3_ADDRESSING``."""

    transport: Transport = field(default="auto", metadata=_env_field("WEIGHTSTREAM_S3_TRANSPORT"))
    """How ranged GETs move bytes. ``"auto"``: to a plain ``http://`` S3-compatible endpoint
    (path-style, keys in the environment or anonymous), each body is received by the kernel
    straight into the tensors' memory (one copy per byte, Python per request); everywhere else
    (TLS, AWS, GCS, Azure, credentials fetched by the client) obstore. ``"obstore"``: always
    obstore. ``"direct"``: the one-copy path, or a :class:`ConfigError` saying why it cannot.
    Env: ``WEIGHTSTREAM_S3_TRANSPORT``."""

    anonymous: bool = field(default=False, metadata=_env_field("WEIGHTSTREAM_S3_ANONYMOUS"))
    """Send unsigned requests (public buckets). Env: ``WEIGHTSTREAM_S3_ANONYMOUS=1``."""

    ca_bundle: str | None = field(
        default=None, metadata=_env_field("WEIGHTSTREAM_CA_BUNDLE", "AWS_CA_BUNDLE")
    )
    """PEM file of extra trusted CAs. Env: ``AWS_CA_BUNDLE``."""

    request_timeout: float = field(default=60.0, metadata=_env_field("WEIGHTSTREAM_S3_REQUEST_TIMEOUT"))
    """Seconds one ranged GET may take in all before it is aborted and retried. Default 60."""

    low_speed_limit: int = field(
        default=1 << 20,
        metadata=_env_field(
            "WEIGHTSTREAM_S3_LOW_SPEED_LIMIT", "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT", size=True
        ),
    )
    """Bytes per second. A request that moves less than this over ``low_speed_window`` is aborted
    and its range read again (a stalled or trickling connection). Default 1 MiB/s."""

    low_speed_window: float = field(default=3.0, metadata=_env_field("WEIGHTSTREAM_S3_LOW_SPEED_WINDOW"))
    """Seconds over which ``low_speed_limit`` is judged. Default 3."""

    connect_timeout: float = field(default=5.0, metadata=_env_field("WEIGHTSTREAM_S3_CONNECT_TIMEOUT"))
    """Seconds to establish a connection. Default 5."""

    metadata_timeout: float = field(default=5.0, metadata=_env_field("WEIGHTSTREAM_S3_METADATA_TIMEOUT"))
    """Seconds a listing or HEAD request may take before it is aborted and retried. These are
    small answers a store sends at once; an endpoint that takes the connection and never
    answers fails the load as a :class:`~weightstream.errors.StorageTimeoutError` after
    ``max_silent_attempts`` such attempts (about 15 s by default), not after minutes. Data
    requests are bounded by the low-speed rule from the moment they are sent. Default 5.
    Env: ``WEIGHTSTREAM_S3_METADATA_TIMEOUT``."""

    max_attempts: int = field(default=5, metadata=_env_field("WEIGHTSTREAM_S3_MAX_ATTEMPTS"))
    """Attempts per request (first try included) for 5xx, resets and timeouts; not-found and
    access-denied answers are never retried. Default 5."""

    max_silent_attempts: int = field(default=3, metadata=_env_field("WEIGHTSTREAM_S3_MAX_SILENT_ATTEMPTS"))
    """Attempts of a request that end with not one byte of an answer (a timeout, or a stall
    before the first byte) after which the store is taken as unreachable, within
    ``max_attempts``. Default 3."""

    backoff_initial: float = field(default=0.1, metadata=_env_field("WEIGHTSTREAM_S3_BACKOFF_INITIAL"))
    """First retry delay in seconds; doubles per attempt, with jitter. Default 0.1."""

    backoff_max: float = field(default=10.0, metadata=_env_field("WEIGHTSTREAM_S3_BACKOFF_MAX"))
    """Longest retry delay in seconds. Default 10."""

    hedge_multiple: float = field(default=4.0, metadata=_env_field("WEIGHTSTREAM_S3_HEDGE_MULTIPLE"))
    """A request still running after this many times the p95 latency of the load's finished
    requests (and at least ``hedge_min_delay``) is re-issued for the same range; the first copy
    to finish wins and the other is cancelled. 0 turns hedging off. Default 4."""

    hedge_min_delay: float = field(default=2.0, metadata=_env_field("WEIGHTSTREAM_S3_HEDGE_MIN_DELAY"))
    """Seconds a request runs at least before it may be hedged. Default 2."""

    def __repr__(self) -> str:
        """The fields, an endpoint's password shown as ``***``."""
        from weightstream.errors import redact

        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return redact(f"ObjectStoreConfig({fields})")

    def __post_init__(self) -> None:
        _int("object_store.concurrency", self.concurrency, 1, 1024)
        _int("object_store.chunk_size", self.chunk_size, 4 * KiB, 1 << 40)
        _int("low_speed_limit", self.low_speed_limit, 0, 1 << 50)
        _int("max_attempts", self.max_attempts, 1, 100)
        _int("max_silent_attempts", self.max_silent_attempts, 1, 100)
        if self.transport not in ("auto", "obstore", "direct"):
            raise ConfigError(
                f"transport must be 'auto', 'obstore' or 'direct', got {self.transport!r}",
                setting="transport",
            )
        if self.addressing not in ("auto", "path", "virtual"):
            raise ConfigError(
                f"addressing must be 'auto', 'path' or 'virtual', got {self.addressing!r}",
                setting="addressing",
            )
        for name in (
            "request_timeout",
            "connect_timeout",
            "metadata_timeout",
            "backoff_initial",
            "backoff_max",
            "low_speed_window",
            "hedge_min_delay",
        ):
            _seconds(name, getattr(self, name))
        h = self.hedge_multiple
        if (
            isinstance(h, bool)
            or not isinstance(h, int | float)
            or not math.isfinite(h)
            or not (h == 0 or 1 <= h <= 1000)
        ):
            raise ConfigError(
                f"hedge_multiple must be 0 (off) or a number from 1 to 1000, got {h!r}",
                setting="hedge_multiple",
            )
        for name in ("endpoint", "gcs_endpoint", "region", "ca_bundle"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a string, got {value!r}", setting=name)
        if not isinstance(self.anonymous, bool):
            raise ConfigError(f"anonymous must be True or False, got {self.anonymous!r}", setting="anonymous")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"endpoint must be an http:// or https:// URL, got {self.endpoint!r}", setting="endpoint"
            )
        g = self.gcs_endpoint
        if g is not None and (
            not g.strip()
            or ("://" in g and not g.startswith(("http://", "https://")))
            or any(c.isspace() for c in g)
        ):
            raise ConfigError(
                f"gcs_endpoint must be an http:// or https:// URL or host:port, got {g!r}",
                setting="gcs_endpoint",
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ObjectStoreConfig:
        """Build from ``AWS_*`` / ``WEIGHTSTREAM_S3_*`` variables; keyword arguments win."""
        env = os.environ if env is None else env
        origin: dict[str, str] = {}
        return _built(cls, _values_from_env(cls, env, overrides, origin=origin), origin)


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """How a checkpoint is read. All fields are keyword-only; defaults need no tuning.

    Build one with ``StreamConfig(chunk_size=..., ...)`` (environment ignored) or
    ``StreamConfig.from_env(...)`` (environment read, keyword arguments win).
    """

    chunk_size: int = field(
        default=64 * MiB,
        metadata=_env_field("WEIGHTSTREAM_CHUNK_SIZE", "RUNAI_STREAMER_CHUNK_BYTESIZE", size=True),
    )
    """Bytes per read request. Default 64 MiB (faster than 16 MiB from the page cache, as fast
    from the device; figures in bench/RESULTS.md). Large tensors are cut into chunks of this size; small
    neighbouring tensors are read together up to this size. Env: ``WEIGHTSTREAM_CHUNK_SIZE``."""

    concurrency: int = field(
        default=16,
        metadata=_env_field("WEIGHTSTREAM_CONCURRENCY", "RUNAI_STREAMER_CONCURRENCY"),
    )
    """Reads in flight at once (worker threads; the io depth for files). Default 16; on a network
    file system (NFS, Lustre, SMB, FUSE, ...) the default 16 becomes 128 (each read waits a
    round trip there: see :meth:`for_network_fs`); any other value, or autotune off, is kept.
    Env: ``WEIGHTSTREAM_CONCURRENCY``."""

    memory_limit: int = field(
        default=_DEFAULT_MEMORY_LIMIT,
        metadata=_env_field("WEIGHTSTREAM_MEMORY_LIMIT", "RUNAI_STREAMER_MEMORY_LIMIT", size=True),
    )
    """Upper bound, in bytes, on tensor data read but not yet handed to the caller. Default
    2 GiB; on a network file system or an object store, for a load into host memory, the
    default becomes a sixteenth of the host's available memory a loading process, up to 8 GiB
    (see :meth:`with_host_memory`); any other value, or autotune off, is kept. Reads are never larger
    than this (a smaller limit means smaller reads). Env: ``WEIGHTSTREAM_MEMORY_LIMIT``."""

    autotune: bool = field(default=True, metadata=_env_field("WEIGHTSTREAM_AUTOTUNE"))
    """Let the online tuner set the reads in flight (starting from ``concurrency``, up to
    ``max_concurrency``) and shrink reads below ``chunk_size`` when more of them fit the memory
    limit better. ``False`` keeps ``concurrency`` and ``chunk_size`` fixed.
    Env: ``WEIGHTSTREAM_AUTOTUNE=0``."""

    max_concurrency: int = field(default=0, metadata=_env_field("WEIGHTSTREAM_MAX_CONCURRENCY"))
    """Most reads in flight the tuner may choose; 0 (default) means 4 x ``concurrency`` (64 for
    files, 256 for object stores), never more than half the memory limit allows in 4 MiB reads.
    Env: ``WEIGHTSTREAM_MAX_CONCURRENCY``."""

    direct_io: DirectIO = field(default="auto", metadata=_env_field("WEIGHTSTREAM_DIRECT_IO"))
    """``"auto"`` (default): per chunk, bytes already in the page cache are copied from it and
    the rest are read with ``O_DIRECT``; buffered where the file system refuses ``O_DIRECT``.
    ``"on"``: always ``O_DIRECT`` (an error where unsupported). ``"off"``: always buffered.
    Env: ``WEIGHTSTREAM_DIRECT_IO``."""

    io_timeout: float = field(default=120.0, metadata=_env_field("WEIGHTSTREAM_IO_TIMEOUT"))
    """Seconds a load may go without any read completing before it fails with
    :class:`~weightstream.errors.StorageTimeoutError` (a hung NFS server, a dead disk).
    Default 120. Env: ``WEIGHTSTREAM_IO_TIMEOUT``."""

    exchange_timeout: float = field(default=300.0, metadata=_env_field("WEIGHTSTREAM_EXCHANGE_TIMEOUT"))
    """Distributed loads: seconds a rank waits at an exchange for the other ranks of the group
    before failing with :class:`~weightstream.errors.DistributedError`. It covers a rank that
    died, hung, or never called the load; a rank that *fails* tells the others at once. It must
    exceed the time the slowest rank needs to read its part of one round (about
    ``memory_limit / 3 / ranks`` bytes). Default 300. Env: ``WEIGHTSTREAM_EXCHANGE_TIMEOUT``."""

    max_header_size: int = field(
        default=100_000_000, metadata=_env_field("WEIGHTSTREAM_MAX_HEADER_SIZE", size=True)
    )
    """Largest safetensors JSON header accepted, in bytes (default 100 MB, as the safetensors
    library). Guards against a corrupt length prefix. Env: ``WEIGHTSTREAM_MAX_HEADER_SIZE``."""

    object_store: ObjectStoreConfig = field(
        default_factory=ObjectStoreConfig, metadata={"env": None, "aliases": ()}
    )
    """Settings for ``s3://``, ``gs://`` and ``az://`` checkpoints; see :class:`ObjectStoreConfig`."""

    def __post_init__(self) -> None:
        if not isinstance(self.object_store, ObjectStoreConfig):
            raise ConfigError(
                f"object_store must be an ObjectStoreConfig, got {self.object_store!r}",
                setting="object_store",
            )
        _int("chunk_size", self.chunk_size, 4 * KiB, 1 << 40)
        _int("concurrency", self.concurrency, 1, 1024)
        _int("max_concurrency", self.max_concurrency, 0, 1024, note=" (0: automatic)")
        _int("memory_limit", self.memory_limit, 4 * KiB, 1 << 62)
        _int("max_header_size", self.max_header_size, 1, 1 << 40)
        if not isinstance(self.autotune, bool):
            raise ConfigError(f"autotune must be True or False, got {self.autotune!r}", setting="autotune")
        if self.direct_io not in ("auto", "on", "off"):
            raise ConfigError(
                f"direct_io must be 'auto', 'on' or 'off', got {self.direct_io!r}", setting="direct_io"
            )
        _seconds("io_timeout", self.io_timeout)
        _seconds("exchange_timeout", self.exchange_timeout)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, profile: str | None = None, **overrides: Any
    ) -> StreamConfig:
        """Build a config from ``WEIGHTSTREAM_*`` variables; keyword arguments win.

        ``env`` defaults to ``os.environ``. Sizes accept binary suffixes (``16MiB``, ``2G``).
        ``profile`` (or ``WEIGHTSTREAM_PROFILE``) names a profile file written by
        ``weightstream tune``; its settings replace the defaults, and the environment and keyword
        arguments still win over it.
        """
        env = os.environ if env is None else env
        path = profile or env.get("WEIGHTSTREAM_PROFILE", "").strip() or None
        base: dict[str, Any] = dict(read_profile(path)) if path else {}
        base_store = base.pop("object_store", {})
        origin: dict[str, str] = {}
        values = _values_from_env(cls, env, overrides, base=base, origin=origin)
        if "object_store" not in overrides:
            values["object_store"] = _built(
                ObjectStoreConfig,
                _values_from_env(ObjectStoreConfig, env, {}, base=base_store, origin=origin),
                origin,
            )
        return _built(cls, values, origin)

    @classmethod
    def from_mapping(
        cls,
        settings: Mapping[str, Any],
        *,
        env: Mapping[str, str] | None = None,
        profile: str | None = None,
        label: Callable[[str], str] = str,
        shared_depth: bool = False,
    ) -> StreamConfig:
        """The one way a front end's settings become a config (the command line, the vLLM
        extra-config, the Run:ai variables; the environment and the profile file underneath).

        Keys are field names: :class:`StreamConfig` fields, and :class:`ObjectStoreConfig`
        fields as ``object_store.NAME``, ``s3_NAME`` or nested under ``object_store``. Values are
        of the field's type, or strings converted by it (sizes take units, ``memory_limit`` -1
        means unlimited). An unknown key is a :class:`ConfigError` naming the known ones. The
        settings win over the environment (``env``, default ``os.environ``), which wins over the
        ``profile`` file. ``label(key)`` is how messages name a key (``--chunk-size``).

        ``shared_depth``: the front end has one concurrency and one read size for every backend
        (vLLM's and Run:ai's keys mean that), so a ``concurrency`` or ``chunk_size`` given
        without its object-store counterpart applies to object stores too.
        """
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "object_store"}
        store_fields = {f.name: f for f in dataclasses.fields(ObjectStoreConfig)}
        top: dict[str, Any] = {}
        store: dict[str, Any] = {}
        unknown: list[str] = []

        def put(
            into: dict[str, Any], known: dict[str, dataclasses.Field[Any]], name: str, key: str, value: Any
        ) -> None:
            f = known.get(name)
            if f is None:
                unknown.append(key)
            else:
                into[name] = _from_setting(f, label(key), value)

        for key, value in settings.items():
            if key == "object_store" and isinstance(value, Mapping):
                for name, v in value.items():
                    put(store, store_fields, name, f"object_store.{name}", v)
            elif key.startswith(("object_store.", "s3_")):
                put(store, store_fields, key.partition(".")[2] or key[3:], key, value)
            else:
                put(top, fields, key, key, value)
        if unknown:
            known = sorted(fields) + [f"object_store.{n}" for n in sorted(store_fields)]
            raise ConfigError(
                f"unknown settings {', '.join(label(k) for k in unknown)} (known: {', '.join(known)})"
            )
        if shared_depth:
            for name in ("concurrency", "chunk_size"):
                if name in top and name not in store:
                    store[name] = top[name]
        try:
            config = cls.from_env(env, profile=profile, **top)
            return config.replace_object_store(**store) if store else config
        except ConfigError as exc:
            name = exc.setting or ""
            if name.rpartition(".")[2] not in {*top, *store}:
                raise
            raise ConfigError(f"{label(name)}: {exc.reason}", setting=exc.setting) from exc

    def for_network_fs(self, *, available: int = 0, processes: int = 1) -> StreamConfig:
        """The settings a load from a network file system runs with. Every read there waits a
        round trip, often with a long tail (the seed's NFS: p50 126 ms, p99 1.8 s), so the bytes
        in flight, not the device, set the rate:

        * the default depth (16) is raised to :data:`NETWORK_FS_CONCURRENCY`: 16 reads of
          64 MiB reached half the link on such a tail, 128 nine tenths (bench/RESULTS.md,
          issue 21);
        * the default ``memory_limit`` (2 GiB) is raised to :func:`network_fs_memory_limit` of
          ``available`` host memory shared by ``processes`` loading processes on the machine
          (0: not known, kept). The bytes in flight are bounded by it, and by Little's law the
          seed's node needs about 9 GB in flight (bench/sim_scale.py: 3.7x the link's time at
          2 GiB a rank, 1.10x at 8 GiB).

        Kept as they are: a depth or memory limit other than the default, and any settings with
        ``autotune`` off (fixed on purpose)."""
        if not self.autotune:
            return self
        config = self.with_host_memory(available=available, processes=processes)
        if config.concurrency != _DEFAULT_CONCURRENCY:
            return config
        return dataclasses.replace(config, concurrency=NETWORK_FS_CONCURRENCY)

    def with_host_memory(self, *, available: int = 0, processes: int = 1) -> StreamConfig:
        """The default ``memory_limit`` (2 GiB) raised to :func:`network_fs_memory_limit` of
        ``available`` host memory shared by ``processes`` loading processes (0: not known,
        kept), for a load into host memory from storage whose rate is set by the bytes in
        flight: a network file system (:meth:`for_network_fs`) or an object store, where each
        connection carries a fraction of the link (the seed's 8 ranks from a 400 Gbit/s S3 path:
        1.21x the link's time at 2 GiB a rank, 1.04x at 8 GiB; bench/sim_scale.py). Kept: a
        limit other than the default, and any settings with ``autotune`` off."""
        if not self.autotune or self.memory_limit != _DEFAULT_MEMORY_LIMIT or not available:
            return self
        memory = network_fs_memory_limit(available, processes)
        if memory == self.memory_limit:
            return self
        return dataclasses.replace(self, memory_limit=memory)

    def for_remote(self) -> StreamConfig:
        """The settings a load from an object store runs with: the object store's depth and
        chunk size in place of the file-system ones."""
        oc = self.object_store
        return dataclasses.replace(self, concurrency=oc.concurrency, chunk_size=oc.chunk_size)

    @property
    def read_size(self) -> int:
        """Bytes per read request: ``chunk_size``, or less when ``memory_limit`` is smaller."""
        return min(self.chunk_size, self.memory_limit)

    def replace(self, **changes: Any) -> StreamConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def replace_object_store(self, **changes: Any) -> StreamConfig:
        """A copy with some :class:`ObjectStoreConfig` fields changed (validated again)."""
        return dataclasses.replace(self, object_store=dataclasses.replace(self.object_store, **changes))

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain values (an endpoint's password shown as ``***``: this is what load
        statistics and ``weightstream load --json`` report)."""
        from weightstream.errors import redact

        out = dataclasses.asdict(self)
        for key in ("endpoint", "gcs_endpoint"):
            value = out["object_store"].get(key)
            if isinstance(value, str):
                out["object_store"][key] = redact(value)
        return out


_DEFAULT_CONCURRENCY = 16
NETWORK_FS_CONCURRENCY = 128
"""The depth a load from a network file system starts at when ``concurrency`` is left at 16."""
NETWORK_FS_MEMORY_LIMIT = 8 * GiB
"""The most :meth:`StreamConfig.for_network_fs` raises ``memory_limit`` to."""


def network_fs_memory_limit(available: int, processes: int = 1) -> int:
    """The ``memory_limit`` a host load from a network file system runs with by default: a
    sixteenth of the ``available`` host memory for each of ``processes`` loading processes on
    the machine (the ranks of a node), at least the default 2 GiB and at most
    :data:`NETWORK_FS_MEMORY_LIMIT` (8 GiB a rank is 64 GiB of a 2 TB node of 8 GPUs; on a
    machine of 24 GiB one process keeps 2 GiB). Pure: the simulation at full scale
    (bench/sim_scale.py) drives this same rule."""
    share = available // (16 * max(1, processes)) // MiB * MiB
    return max(_DEFAULT_MEMORY_LIMIT, min(NETWORK_FS_MEMORY_LIMIT, share))


_MAX_PROFILE = 1 << 20
PROFILE_VERSION = 1
"""The profile file's format (its ``weightstream_profile`` key; absent means 1)."""


def profile_document(settings: dict[str, Any], **about: Any) -> dict[str, Any]:
    """A profile file's content (what ``weightstream tune`` writes and :func:`read_profile`
    reads): the ``settings`` (StreamConfig fields, ``object_store`` nested) and, before them,
    what the file says about how they were found (``about``)."""
    return {"weightstream_profile": PROFILE_VERSION, **about, "settings": settings}


def read_profile(path: str) -> dict[str, Any]:
    """The settings of a profile file (JSON, as ``weightstream tune`` writes it): a
    ``settings`` object of :class:`StreamConfig` fields, with ``object_store`` nested."""
    import json

    from weightstream.errors import WeightStreamError
    from weightstream.localfs import regular_file

    try:
        regular_file(path, what="cannot read the profile")  # a FIFO would block open() for ever
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read(_MAX_PROFILE + 1)[:_MAX_PROFILE])
    except WeightStreamError as exc:
        raise ConfigError(exc.reason, uri=path) from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"cannot read profile {path}: {type(exc).__name__}: {str(exc)[:200]}") from exc
    version = doc.get("weightstream_profile", PROFILE_VERSION) if isinstance(doc, dict) else None
    if version != PROFILE_VERSION:
        raise ConfigError(
            f"profile {path} is of version {version!r}; this weightstream reads version {PROFILE_VERSION}"
        )
    settings = doc.get("settings") if isinstance(doc, dict) else None
    if not isinstance(settings, dict):
        raise ConfigError(f"profile {path} has no 'settings' object")
    known = {f.name for f in dataclasses.fields(StreamConfig)}
    store_known = {f.name for f in dataclasses.fields(ObjectStoreConfig)}
    unknown = set(settings) - known
    store = settings.get("object_store", {})
    if not isinstance(store, dict):
        raise ConfigError(f"profile {path}: 'object_store' must be an object")
    unknown |= {f"object_store.{k}" for k in set(store) - store_known}
    if unknown:
        raise ConfigError(f"profile {path}: unknown settings {', '.join(sorted(unknown))}")
    return settings


def _values_from_env(
    cls: type,
    env: Mapping[str, str],
    overrides: dict[str, Any],
    *,
    base: Mapping[str, Any] | None = None,
    origin: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Field values from ``base``, then the environment, then ``overrides``. ``origin`` is
    filled with ``field -> "VARIABLE=value"`` for every value the environment set."""
    values: dict[str, Any] = dict(base or {})
    for f in dataclasses.fields(cls):
        if f.name in overrides or not f.metadata.get("env"):
            continue
        for var in (f.metadata["env"], *f.metadata["aliases"]):
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                values[f.name] = _convert(f, var, raw)
                if origin is not None:
                    origin[f.name] = f"{var}={raw!r}"
                break
    values.update(overrides)
    return values


def _built(cls: type[T], values: dict[str, Any], origin: dict[str, str]) -> T:
    """``cls(**values)``; a bad value that came from the environment is reported with its variable."""
    try:
        return cls(**values)
    except ConfigError as exc:
        where = origin.get((exc.setting or "").rpartition(".")[2])
        if where is None:
            raise
        raise ConfigError(f"{where}: {exc.reason}", setting=exc.setting) from exc


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _from_setting(f: dataclasses.Field[Any], key: str, value: Any) -> Any:
    """A front end's value for field ``f``: a string converted by the field's type (as the
    environment's are), Run:ai's -1 for an unlimited ``memory_limit``, anything else as given
    (checked by the config itself)."""
    if isinstance(value, str):
        return _convert(f, key, value)
    if f.name == "memory_limit" and value == -1 and not isinstance(value, bool):
        return 1 << 62
    return value


def _convert(f: dataclasses.Field[Any], var: str, raw: str) -> Any:
    """An environment string as the field's type (the annotation decides, so a new field of a
    known type needs nothing here, and one of a new type fails loudly)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    text = raw.strip()
    try:
        if f.metadata.get("size"):
            if f.name == "memory_limit" and text == "-1":  # Run:ai's spelling of "unlimited"
                return 1 << 62
            return parse_size(text, name=var)
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        if kind in ("DirectIO", "Addressing", "Transport"):
            return text.lower()
        if kind == "str | None":
            return text
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{var}={raw!r}: {exc}", setting=f.name) from None
    raise TypeError(f"no conversion from the environment for {f.name}: {kind}")  # a bug, found by the tests
