"""Settings of a load: frozen, keyword-only value objects, each setting described once.

Every setting is a dataclass field whose metadata (:func:`setting`) says everything about it:
its rule (the type, the range, how text becomes a value: :class:`Count`, :class:`Size`,
:class:`Seconds`, :class:`Choice`, :class:`Flag`, :class:`Text`), its environment variable and
the older names it answers to, and a one-line summary. From that one description come the
checks on construction (:func:`check_fields`), the conversion of the environment's and front
ends' strings, the command line's flags (``weightstream.cli.common``) and the messages. A new
setting is one field.

Automatic settings are ``None``: ``concurrency``, ``chunk_size`` and ``memory_limit`` of
:class:`StreamConfig`, and the object store's own ``concurrency`` and ``chunk_size``, are chosen
per storage when a load starts (:meth:`StreamConfig.resolved`), so a value the user set is
never mistaken for a default: ``StreamConfig(concurrency=64)`` reads 64 deep from a disk, a
network file system and an object store alike, unless ``object_store.concurrency`` says
otherwise for object stores.

Memory arithmetic, in one place:

* bytes being read at any moment  <= ``concurrency * chunk_size``
* bytes read but not yet handed to the caller  <= ``memory_limit``
  (one tensor larger than ``memory_limit`` is still loaded, alone, when nothing else is held)
* ``load()`` keeps every tensor, so its peak is the checkpoint size plus the header bytes;
  ``stream()`` peaks near ``memory_limit`` plus whatever the caller keeps.

The environment is read in exactly one place, :meth:`StreamConfig.from_env`, and only when it
is called. Explicit keyword arguments beat the environment. The Run:ai streamer's variables
(``RUNAI_STREAMER_CONCURRENCY``, ...: the table in :mod:`weightstream.compat.runai_env`) are
honoured when the matching ``WEIGHTSTREAM_*`` variable is unset, so a deployment tuned for the
Run:ai streamer keeps its settings.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from weightstream.errors import ConfigError

__all__ = [
    "DirectIO",
    "ObjectStoreConfig",
    "Setting",
    "Storage",
    "StreamConfig",
    "check_seconds",
    "parse_size",
    "profile_document",
    "read_profile",
    "settings_of",
]

DirectIO = Literal["auto", "on", "off"]
Addressing = Literal["auto", "path", "virtual"]
Transport = Literal["auto", "obstore", "direct"]
Storage = Literal["local", "network_fs", "object_store"]
"""What a load reads from, for the automatic settings: a local file system, a network file system
(NFS, Lustre, FUSE, ...: every read a round trip), or an object store."""
T = TypeVar("T")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
UNLIMITED = 1 << 62
"""``memory_limit`` without a limit (Run:ai's and the front ends' ``-1``)."""

DEFAULT_CONCURRENCY = 16
DEFAULT_CHUNK_SIZE = 64 * MiB
DEFAULT_MEMORY_LIMIT = 2 * GiB
OBJECT_STORE_CONCURRENCY = 128
OBJECT_STORE_CHUNK_SIZE = 8 * MiB
NETWORK_FS_CONCURRENCY = 128
"""The depth a load from a network file system starts at when ``concurrency`` is automatic."""
NETWORK_FS_MEMORY_LIMIT = 8 * GiB
"""The most an automatic ``memory_limit`` grows to on network storage."""

CAPPED_READ_MIN = 256 * KiB
"""The smallest read a bandwidth cap cuts reads to."""

MAX_SECONDS = 30 * 24 * 3600
"""The longest timeout or delay any setting accepts (30 days). Every wait is bounded: ``inf``,
``nan`` and values no clock or wait primitive can hold are refused with a :class:`ConfigError`
instead of failing inside a load."""


def check_seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` if it is a duration every setting would accept (finite, within
    ``(0, MAX_SECONDS]``; ``[0, ...]`` with ``zero``), else a :class:`ConfigError` naming
    ``name``: the one rule for durations, for front ends too (the CLI's flags)."""
    Seconds(zero=zero).check(name, value)
    return float(value)


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


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Rule:
    """How one setting's value is checked and read from text (the environment, a flag, a front
    end's string). ``metavar`` and ``choices`` describe it on the command line."""

    metavar = "VALUE"
    choices: tuple[str, ...] | None = None

    def check(self, name: str, value: Any) -> None:
        """Raise a :class:`ConfigError` naming ``name`` if ``value`` is not allowed."""
        raise NotImplementedError

    def parse(self, name: str, text: str) -> Any:
        """``text`` as a value (checked afterwards by :meth:`check`); a ``ValueError`` or a
        :class:`ConfigError` if it is not one."""
        raise NotImplementedError

    def given(self, value: Any) -> Any:
        """A front end's value that is not a string (JSON's), as the setting takes it."""
        return value


@dataclass(frozen=True)
class Count(Rule):
    """A whole number within ``[low, high]``; ``None`` too where ``automatic`` says what it means."""

    low: int
    high: int
    note: str = ""
    automatic: str = ""
    metavar = "N"

    def check(self, name: str, value: Any) -> None:
        if value is None and self.automatic:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not self.low <= value <= self.high:
            raise ConfigError(
                f"{name} must be an int from {self.low} to {self.high}{self.note}, got {value!r}",
                setting=name,
            )

    def parse(self, name: str, text: str) -> Any:
        return int(text)


@dataclass(frozen=True)
class Size(Count):
    """A byte count (text with units: :func:`parse_size`); with ``unlimited``, ``-1`` means
    no limit (Run:ai's and vLLM's spelling)."""

    unlimited: bool = False
    metavar = "SIZE"

    def parse(self, name: str, text: str) -> Any:
        return UNLIMITED if self.unlimited and text == "-1" else parse_size(text, name=name)

    def given(self, value: Any) -> Any:
        return UNLIMITED if self.unlimited and value == -1 and not isinstance(value, bool) else value


@dataclass(frozen=True)
class Seconds(Rule):
    """A finite duration within ``(0, MAX_SECONDS]`` (``[0, ...]`` with ``zero``)."""

    zero: bool = False
    metavar = "SECONDS"

    def check(self, name: str, value: Any) -> None:
        ok = (
            not isinstance(value, bool)
            and isinstance(value, int | float)
            and math.isfinite(value)
            and (value >= 0 if self.zero else value > 0)
            and value <= MAX_SECONDS
        )
        if not ok:
            low = "0" if self.zero else "more than 0"
            raise ConfigError(
                f"{name} must be a finite number of seconds, from {low} to {MAX_SECONDS} (30 days), "
                f"got {value!r}",
                setting=name,
            )

    def parse(self, name: str, text: str) -> Any:
        return float(text)


@dataclass(frozen=True)
class Multiple(Rule):
    """A finite factor within ``[low, high]``, or 0 (off)."""

    low: float
    high: float
    metavar = "X"

    def check(self, name: str, value: Any) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not (value == 0 or self.low <= value <= self.high)
        ):
            raise ConfigError(
                f"{name} must be 0 (off) or a number from {self.low:g} to {self.high:g}, got {value!r}",
                setting=name,
            )

    def parse(self, name: str, text: str) -> Any:
        return float(text)


class Choice(Rule):
    """One of a few words (read in any case)."""

    def __init__(self, *options: str) -> None:
        self.choices = options

    def check(self, name: str, value: Any) -> None:
        assert self.choices is not None
        if value not in self.choices:
            *head, last = (repr(o) for o in self.choices)
            raise ConfigError(f"{name} must be {', '.join(head)} or {last}, got {value!r}", setting=name)

    def parse(self, name: str, text: str) -> Any:
        return text.lower()


class Flag(Rule):
    """True or False (``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``)."""

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}", setting=name)

    def parse(self, name: str, text: str) -> Any:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("expected 1/0, true/false, yes/no or on/off")


@dataclass(frozen=True)
class Text(Rule):
    """A string, or ``None`` (not set); ``valid`` and ``what`` say which strings."""

    valid: Callable[[str], bool] | None = None
    what: str = "a string"
    example: str = "text"
    """A string it accepts (for the help and the tests)."""
    metavar = "TEXT"

    def check(self, name: str, value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, str) or (self.valid is not None and not self.valid(value)):
            raise ConfigError(f"{name} must be {self.what}, got {value!r}", setting=name)

    def parse(self, name: str, text: str) -> Any:
        return text


@dataclass(frozen=True)
class Setting:
    """Everything said about one setting (a field's metadata, from :func:`setting`)."""

    rule: Rule
    env: str | None
    """Its environment variable (``None``: not read from the environment)."""
    aliases: tuple[str, ...]
    """Other variables it answers to, below ``env`` and the Run:ai table."""
    summary: str
    """One line: what it is (the command line's help)."""
    label: str | None = None
    """How messages name it, where its field name alone is ambiguous."""


def setting(rule: Rule, summary: str, env: str | None = None, *aliases: str, label: str | None = None) -> Any:
    """A field's metadata describing its setting (see :class:`Setting`)."""
    return {"setting": Setting(rule, env, aliases, summary, label)}


def settings_of(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """Each field of a settings class with its :class:`Setting`."""
    for f in dataclasses.fields(cls):
        if "setting" in f.metadata:
            yield f, f.metadata["setting"]


def check_fields(obj: Any) -> None:
    """The one validator: every field of ``obj`` checked by its rule."""
    for f, s in settings_of(type(obj)):
        s.rule.check(s.label or f.name, getattr(obj, f.name))


def _url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def _location(text: str) -> bool:
    return bool(text.strip()) and "\0" not in text


def _folder(text: str) -> bool:
    return bool(text.strip()) and "\0" not in text and "://" not in text


def _gcs_endpoint(text: str) -> bool:
    return bool(text.strip()) and ("://" not in text or _url(text)) and not any(c.isspace() for c in text)


@dataclass(frozen=True, kw_only=True)
class ObjectStoreConfig:
    """How object stores (``s3://``, ``gs://``, ``az://``) are reached. Defaults need no settings.

    Credentials are not fields: the store client reads the standard chain itself
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, web identity,
    container and instance metadata; ``GOOGLE_*``; ``AZURE_*``).
    """

    concurrency: int | None = field(
        default=None,
        metadata=setting(
            Count(1, 1024, automatic="StreamConfig.concurrency, else 128"),
            "requests in flight at the start, object stores only",
            "WEIGHTSTREAM_S3_CONCURRENCY",
            label="object_store.concurrency",
        ),
    )
    """Requests in flight for object-store checkpoints at the start of a load (the tuner moves
    it). ``None`` (default): ``StreamConfig.concurrency`` where that is set, else 128: stores
    cap each connection (tens of MB/s), so depth decides throughput (bench/RESULTS.md).
    Env: ``WEIGHTSTREAM_S3_CONCURRENCY``."""

    chunk_size: int | None = field(
        default=None,
        metadata=setting(
            Size(4 * KiB, 1 << 40, automatic="StreamConfig.chunk_size, else 8 MiB"),
            "bytes per ranged GET, object stores only",
            "WEIGHTSTREAM_S3_CHUNK_SIZE",
            label="object_store.chunk_size",
        ),
    )
    """Bytes per ranged GET for object-store checkpoints. ``None`` (default):
    ``StreamConfig.chunk_size`` where that is set, else 8 MiB (with the default depth, 1 GiB in
    flight). Env: ``WEIGHTSTREAM_S3_CHUNK_SIZE``."""

    endpoint: str | None = field(
        default=None,
        metadata=setting(
            Text(_url, "an http:// or https:// URL", "http://host:9000"),
            "S3 endpoint URL (MinIO, Ceph, VAST, ...)",
            "WEIGHTSTREAM_S3_ENDPOINT",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL",
        ),
    )
    """S3 endpoint URL, for S3-compatible stores (MinIO, Ceph, VAST, ...). An ``http://`` endpoint
    is allowed as given. Env: ``AWS_ENDPOINT_URL`` (or ``WEIGHTSTREAM_S3_ENDPOINT``)."""

    gcs_endpoint: str | None = field(
        default=None,
        metadata=setting(
            Text(_gcs_endpoint, "an http:// or https:// URL or host:port", "host:4443"),
            "where gs:// requests go instead of Google's API (an emulator)",
            "WEIGHTSTREAM_GCS_ENDPOINT",
            "STORAGE_EMULATOR_HOST",
        ),
    )
    """Where ``gs://`` requests go instead of Google's API: an emulator (fake-gcs-server) or a
    private endpoint. ``http://host:port``, ``https://...``, or ``host:port`` (HTTP, as Google's
    own clients read ``STORAGE_EMULATOR_HOST``). With a service-account key file in
    ``GOOGLE_APPLICATION_CREDENTIALS`` its credentials are used; without one (an emulator)
    requests go unsigned. Env: ``WEIGHTSTREAM_GCS_ENDPOINT`` or ``STORAGE_EMULATOR_HOST``."""

    region: str | None = field(
        default=None,
        metadata=setting(Text(), "S3 region", "WEIGHTSTREAM_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"),
    )
    """S3 region. Env: ``AWS_REGION`` / ``AWS_DEFAULT_REGION``."""

    addressing: Addressing = field(
        default="auto",
        metadata=setting(
            Choice("auto", "path", "virtual"),
            "S3 URL style: path, virtual or auto",
            "WEIGHTSTREAM_S3_ADDRESSING",
        ),
    )
    """``"path"`` (``endpoint/bucket/key``), ``"virtual"`` (``bucket.endpoint/key``) or ``"auto"``:
    path-style with a custom endpoint, virtual-hosted on AWS. Env: ``WEIGHTSTREAM_S3_ADDRESSING``."""

    transport: Transport = field(
        default="auto",
        metadata=setting(
            Choice("auto", "obstore", "direct"), "how ranged GETs move bytes", "WEIGHTSTREAM_S3_TRANSPORT"
        ),
    )
    """How ranged GETs move bytes. ``"auto"``: to a plain ``http://`` S3-compatible endpoint
    (path-style, keys in the environment or anonymous), each body is received by the kernel
    straight into the tensors' memory (one copy per byte, Python per request); everywhere else
    (TLS, AWS, GCS, Azure, credentials fetched by the client) obstore. ``"obstore"``: always
    obstore. ``"direct"``: the one-copy path, or a :class:`ConfigError` saying why it cannot.
    Env: ``WEIGHTSTREAM_S3_TRANSPORT``."""

    anonymous: bool = field(
        default=False,
        metadata=setting(Flag(), "unsigned requests (public buckets)", "WEIGHTSTREAM_S3_ANONYMOUS"),
    )
    """Send unsigned requests (public buckets). Env: ``WEIGHTSTREAM_S3_ANONYMOUS=1``."""

    ca_bundle: str | None = field(
        default=None,
        metadata=setting(Text(), "PEM file of extra trusted CAs", "WEIGHTSTREAM_CA_BUNDLE", "AWS_CA_BUNDLE"),
    )
    """PEM file of extra trusted CAs. Env: ``AWS_CA_BUNDLE``."""

    request_timeout: float = field(
        default=60.0,
        metadata=setting(
            Seconds(), "seconds one ranged GET may take in all", "WEIGHTSTREAM_S3_REQUEST_TIMEOUT"
        ),
    )
    """Seconds one ranged GET may take in all before it is aborted and retried. Default 60."""

    low_speed_limit: int = field(
        default=1 << 20,
        metadata=setting(
            Size(0, 1 << 50),
            "bytes/s under which a request counts as stalled",
            "WEIGHTSTREAM_S3_LOW_SPEED_LIMIT",
        ),
    )
    """Bytes per second. A request that moves less than this over ``low_speed_window`` is aborted
    and its range read again (a stalled or trickling connection). Default 1 MiB/s."""

    low_speed_window: float = field(
        default=3.0,
        metadata=setting(
            Seconds(), "seconds over which low_speed_limit is judged", "WEIGHTSTREAM_S3_LOW_SPEED_WINDOW"
        ),
    )
    """Seconds over which ``low_speed_limit`` is judged. Default 3."""

    connect_timeout: float = field(
        default=5.0,
        metadata=setting(Seconds(), "seconds to establish a connection", "WEIGHTSTREAM_S3_CONNECT_TIMEOUT"),
    )
    """Seconds to establish a connection. Default 5."""

    metadata_timeout: float = field(
        default=5.0,
        metadata=setting(
            Seconds(), "seconds a listing or HEAD may take before a retry", "WEIGHTSTREAM_S3_METADATA_TIMEOUT"
        ),
    )
    """Seconds a listing or HEAD request may take before it is aborted and retried. These are
    small answers a store sends at once; an endpoint that takes the connection and never
    answers fails the load as a :class:`~weightstream.errors.StorageTimeoutError` after
    ``max_silent_attempts`` such attempts (about 15 s by default), not after minutes. Data
    requests are bounded by the low-speed rule from the moment they are sent. Default 5.
    Env: ``WEIGHTSTREAM_S3_METADATA_TIMEOUT``."""

    max_attempts: int = field(
        default=5, metadata=setting(Count(1, 100), "attempts per request", "WEIGHTSTREAM_S3_MAX_ATTEMPTS")
    )
    """Attempts per request (first try included) for 5xx, resets and timeouts; not-found and
    access-denied answers are never retried. Default 5."""

    max_silent_attempts: int = field(
        default=3,
        metadata=setting(
            Count(1, 100),
            "silent attempts before a store counts as unreachable",
            "WEIGHTSTREAM_S3_MAX_SILENT_ATTEMPTS",
        ),
    )
    """Attempts of a request that end with not one byte of an answer (a timeout, or a stall
    before the first byte) after which the store is taken as unreachable, within
    ``max_attempts``. Default 3."""

    backoff_initial: float = field(
        default=0.1, metadata=setting(Seconds(), "first retry delay", "WEIGHTSTREAM_S3_BACKOFF_INITIAL")
    )
    """First retry delay in seconds; doubles per attempt, with jitter. Default 0.1."""

    backoff_max: float = field(
        default=10.0, metadata=setting(Seconds(), "longest retry delay", "WEIGHTSTREAM_S3_BACKOFF_MAX")
    )
    """Longest retry delay in seconds. Default 10."""

    hedge_multiple: float = field(
        default=4.0,
        metadata=setting(
            Multiple(1, 1000),
            "re-issue a request after this many p95 latencies (0: off)",
            "WEIGHTSTREAM_S3_HEDGE_MULTIPLE",
        ),
    )
    """A request still running after this many times the p95 latency of the load's finished
    requests (and at least ``hedge_min_delay``) is re-issued for the same range; the first copy
    to finish wins and the other is cancelled. 0 turns hedging off. Default 4."""

    hedge_min_delay: float = field(
        default=2.0,
        metadata=setting(
            Seconds(),
            "seconds a request runs at least before it is hedged",
            "WEIGHTSTREAM_S3_HEDGE_MIN_DELAY",
        ),
    )
    """Seconds a request runs at least before it may be hedged. Default 2."""

    def __repr__(self) -> str:
        """The fields, an endpoint's password shown as ``***``."""
        from weightstream.errors import redact

        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return redact(f"ObjectStoreConfig({fields})")

    def __post_init__(self) -> None:
        check_fields(self)

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
    ``StreamConfig.from_env(...)`` (environment read, keyword arguments win). ``None`` is
    "automatic": chosen per storage when a load starts (:meth:`resolved`).
    """

    chunk_size: int | None = field(
        default=None,
        metadata=setting(
            Size(4 * KiB, 1 << 40, automatic="64 MiB; object_store.chunk_size on object stores"),
            "bytes per read, e.g. 16MiB",
            "WEIGHTSTREAM_CHUNK_SIZE",
        ),
    )
    """Bytes per read request. ``None`` (default): 64 MiB on file systems (faster than 16 MiB
    from the page cache, as fast from the device; bench/RESULTS.md), 8 MiB on object stores
    (``object_store.chunk_size`` wins there when set). Large tensors are cut into chunks of this
    size; small neighbouring tensors are read together up to this size.
    Env: ``WEIGHTSTREAM_CHUNK_SIZE``."""

    concurrency: int | None = field(
        default=None,
        metadata=setting(
            Count(1, 1024, automatic="16; 128 on network storage"),
            "reads in flight at the start",
            "WEIGHTSTREAM_CONCURRENCY",
        ),
    )
    """Reads in flight at the start of a load (worker threads; the io depth for files; the tuner
    moves it). ``None`` (default): 16 on a local file system, 128 on a network file system (NFS,
    Lustre, SMB, FUSE, ...: each read waits a round trip there) and on an object store
    (``object_store.concurrency`` wins there when set). A value set here is kept on every
    storage. Env: ``WEIGHTSTREAM_CONCURRENCY``."""

    memory_limit: int | None = field(
        default=None,
        metadata=setting(
            Size(4 * KiB, UNLIMITED, unlimited=True, automatic="2 GiB; more on network storage"),
            "bytes read but not yet consumed, e.g. 2GiB (-1: no limit)",
            "WEIGHTSTREAM_MEMORY_LIMIT",
        ),
    )
    """Upper bound, in bytes, on tensor data read but not yet handed to the caller. ``None``
    (default): 2 GiB; on a network file system or an object store, for a load into host memory,
    a sixteenth of the host's available memory a loading process, up to 8 GiB (see
    :func:`network_fs_memory_limit`; autotune off keeps 2 GiB). Reads are never larger than
    this (a smaller limit means smaller reads). Env: ``WEIGHTSTREAM_MEMORY_LIMIT``."""

    autotune: bool = field(
        default=True,
        metadata=setting(Flag(), "let the tuner move the depth and read size", "WEIGHTSTREAM_AUTOTUNE"),
    )
    """Let the online tuner set the reads in flight (starting from ``concurrency``, up to
    ``max_concurrency``) and shrink reads below ``chunk_size`` when more of them fit the memory
    limit better. ``False`` keeps ``concurrency`` and ``chunk_size`` fixed.
    Env: ``WEIGHTSTREAM_AUTOTUNE=0``."""

    max_concurrency: int = field(
        default=0,
        metadata=setting(
            Count(0, 1024, note=" (0: automatic)"),
            "most reads in flight the tuner may choose",
            "WEIGHTSTREAM_MAX_CONCURRENCY",
        ),
    )
    """Most reads in flight the tuner may choose; 0 (default) means 4 x the starting depth (64 on
    a local disk), never more than half the memory limit allows in 4 MiB reads.
    Env: ``WEIGHTSTREAM_MAX_CONCURRENCY``."""

    direct_io: DirectIO = field(
        default="auto",
        metadata=setting(Choice("auto", "on", "off"), "O_DIRECT policy", "WEIGHTSTREAM_DIRECT_IO"),
    )
    """``"auto"`` (default): per chunk, bytes already in the page cache are copied from it and
    the rest are read with ``O_DIRECT``; buffered where the file system refuses ``O_DIRECT``.
    ``"on"``: always ``O_DIRECT`` (an error where unsupported). ``"off"``: always buffered.
    Env: ``WEIGHTSTREAM_DIRECT_IO``."""

    io_timeout: float = field(
        default=120.0,
        metadata=setting(
            Seconds(), "seconds without progress before a load fails", "WEIGHTSTREAM_IO_TIMEOUT"
        ),
    )
    """Seconds a load may go without any read completing before it fails with
    :class:`~weightstream.errors.StorageTimeoutError` (a hung NFS server, a dead disk).
    Default 120. Env: ``WEIGHTSTREAM_IO_TIMEOUT``."""

    exchange_timeout: float = field(
        default=300.0,
        metadata=setting(
            Seconds(), "seconds a rank waits for the others (distributed)", "WEIGHTSTREAM_EXCHANGE_TIMEOUT"
        ),
    )
    """Distributed loads: seconds a rank waits at an exchange for the other ranks of the group
    before failing with :class:`~weightstream.errors.DistributedError`. It covers a rank that
    died, hung, or never called the load; a rank that *fails* tells the others at once. It must
    exceed the time the slowest rank needs to read its part of one round (about
    ``memory_limit / 3 / ranks`` bytes). Default 300. Env: ``WEIGHTSTREAM_EXCHANGE_TIMEOUT``."""

    max_header_size: int = field(
        default=100_000_000,
        metadata=setting(
            Size(1, 1 << 40), "largest safetensors header accepted", "WEIGHTSTREAM_MAX_HEADER_SIZE"
        ),
    )
    """Largest safetensors JSON header accepted, in bytes (default 100 MB, as the safetensors
    library). Guards against a corrupt length prefix. Env: ``WEIGHTSTREAM_MAX_HEADER_SIZE``."""

    max_bandwidth: int | None = field(
        default=None,
        metadata=setting(
            Size(4 * KiB, 1 << 50, automatic="no cap"),
            "bytes/s this process reads at most, e.g. 500MB",
            "WEIGHTSTREAM_MAX_BANDWIDTH",
        ),
    )
    """Bytes per second a load in this process reads at most (``None``: no cap), from any
    storage: the engine issues reads no faster (:mod:`weightstream.engine.throttle`), reads are
    cut to a quarter of a second at the cap, and the tuner takes the cap as the pipe's limit.
    Env: ``WEIGHTSTREAM_MAX_BANDWIDTH``."""

    max_node_bandwidth: int | None = field(
        default=None,
        metadata=setting(
            Size(4 * KiB, 1 << 50, automatic="no cap"),
            "bytes/s the loading processes of this machine read at most together",
            "WEIGHTSTREAM_MAX_NODE_BANDWIDTH",
        ),
    )
    """Bytes per second the loading processes of this machine read at most together (``None``:
    no cap): each takes an equal share, the cap over the launcher's ranks on the machine
    (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, else one), within its own ``max_bandwidth``. With
    ``distributed`` each rank reads its part of the checkpoint at its share, so the node's
    ranks together stay under the cap. Env: ``WEIGHTSTREAM_MAX_NODE_BANDWIDTH``."""

    cache_dir: str | None = field(
        default=None,
        metadata=setting(
            Text(_folder, "a folder path", "/mnt/nvme/weightstream"),
            "folder of this node's copy of remote checkpoints, filled while they load",
            "WEIGHTSTREAM_CACHE_DIR",
        ),
    )
    """A local folder (NVMe) where loads from an object store leave a copy of each file, written
    from the buffers the load fills, so the next load on this node reads it at local-disk speed
    after one request per file checks that the store still holds that version (``None``: off,
    the default). Shared safely by every loading process of the node; see
    :mod:`weightstream.cache`. Env: ``WEIGHTSTREAM_CACHE_DIR``."""

    cache_max_bytes: int | None = field(
        default=None,
        metadata=setting(
            Size(1, 1 << 60, automatic="until the disk is full"),
            "bytes the cache folder holds at most (least recently used entries go first)",
            "WEIGHTSTREAM_CACHE_MAX_BYTES",
        ),
    )
    """Bytes the cache's entries take at most together (``None``: until the disk is full). To
    make room for a new file the least recently used entries not in use are removed; a file
    that cannot fit is not cached. Env: ``WEIGHTSTREAM_CACHE_MAX_BYTES``."""

    cache_ttl: float = field(
        default=0.0,
        metadata=setting(
            Seconds(zero=True),
            "seconds a cached checkpoint is opened without asking the store (0: always ask)",
            "WEIGHTSTREAM_CACHE_TTL",
        ),
    )
    """Seconds after a load checked a cached checkpoint against the store during which the next
    open of the same URI asks the store nothing (no listing, index or header request): it opens
    the cache's files as they are, for starts with the store unreachable. 0 (the default): every
    open checks each file's version with the store (one header request per file). Env:
    ``WEIGHTSTREAM_CACHE_TTL``."""

    verify: str = field(
        default="auto",
        metadata=setting(
            Choice("auto", "on", "off"),
            "check the bytes read against the checkpoint's manifest (auto: where there is one)",
            "WEIGHTSTREAM_VERIFY",
        ),
    )
    """Check each shard's bytes as they are read against the CRC32C checksums of the checkpoint's
    manifest (``weightstream manifest URI -o weightstream.manifest.json``; see
    :mod:`weightstream.format.manifest`). ``auto`` (the default): where a manifest is given
    (``manifest``) or lies beside the index; ``on``: every shard must have a checksum;
    ``off``: no check. A mismatch fails the load with a
    :class:`~weightstream.errors.FormatError` naming the shard, the byte range and both
    checksums, and ``stream()`` hands a tensor over only once every piece it lies in is checked.
    Env: ``WEIGHTSTREAM_VERIFY``."""

    checks_dir: str = field(
        default="auto",
        metadata=setting(
            Text(_folder, "'auto', 'off' or a folder path", "/mnt/nvme/weightstream/checks"),
            "folder where a local file's passed checks are kept, so an unchanged file is not checked again",
            "WEIGHTSTREAM_CHECKS_DIR",
        ),
    )
    """Where the checks a local file passed (``verify``) are written down, with the file's
    identity (device, inode, size, modification and change time), so that a later load of the
    same, unchanged file against the same checksums does not check it again: a hot restart pays
    for no check (see :mod:`weightstream.cache.passed` for what counts as unchanged). ``auto``
    (the default): ``checks`` in ``cache_dir`` where that is set, else
    ``$XDG_CACHE_HOME/weightstream/checks`` (``~/.cache/weightstream/checks``); ``off``: every
    load checks every byte; or a folder. Env: ``WEIGHTSTREAM_CHECKS_DIR``."""

    manifest: str | None = field(
        default=None,
        metadata=setting(
            Text(_location, "a path or URI", "s3://models/llama/weightstream.manifest.json"),
            "the checkpoint's manifest, if not beside its index",
            "WEIGHTSTREAM_MANIFEST",
        ),
    )
    """A path or URI of the checkpoint's manifest, where it is not
    ``weightstream.manifest.json`` beside the index (``None``: look there). Env:
    ``WEIGHTSTREAM_MANIFEST``."""

    object_store: ObjectStoreConfig = field(default_factory=ObjectStoreConfig)
    """Settings for ``s3://``, ``gs://`` and ``az://`` checkpoints; see :class:`ObjectStoreConfig`."""

    def __post_init__(self) -> None:
        if not isinstance(self.object_store, ObjectStoreConfig):
            raise ConfigError(
                f"object_store must be an ObjectStoreConfig, got {self.object_store!r}",
                setting="object_store",
            )
        check_fields(self)

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
    ) -> StreamConfig:
        """The one way a front end's settings become a config (the command line, the vLLM
        extra-config, the Run:ai drop-in; the environment and the profile file underneath).

        Keys are field names: :class:`StreamConfig` fields, and :class:`ObjectStoreConfig`
        fields as ``object_store.NAME``, ``s3_NAME`` or nested under ``object_store``. Values are
        of the field's type, or strings read by the field's rule (sizes take units,
        ``memory_limit`` -1 means unlimited). An unknown key is a :class:`ConfigError` naming
        the known ones. The settings win over the environment (``env``, default
        ``os.environ``), which wins over the ``profile`` file. ``label(key)`` is how messages
        name a key (``--chunk-size``). A ``concurrency`` or ``chunk_size`` applies to object
        stores too, unless the object store's own is given (it is automatic otherwise)."""
        fields = {f.name: s for f, s in settings_of(cls)}
        store_fields = {f.name: s for f, s in settings_of(ObjectStoreConfig)}
        top: dict[str, Any] = {}
        store: dict[str, Any] = {}
        unknown: list[str] = []
        keys: dict[str, str] = {}  # the setting an error names -> the key it was given as

        def put(into: dict[str, Any], known: dict[str, Setting], name: str, key: str, value: Any) -> None:
            s = known.get(name)
            if s is None:
                unknown.append(key)
            else:
                keys[s.label or name] = key
                into[name] = (
                    _parsed(name, s, label(key), value) if isinstance(value, str) else s.rule.given(value)
                )

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
        try:
            config = cls.from_env(env, profile=profile, **top)
            return config.replace_object_store(**store) if store else config
        except ConfigError as exc:
            given = keys.get(exc.setting or "")
            if given is None:
                raise
            raise ConfigError(f"{label(given)}: {exc.reason}", setting=exc.setting) from exc

    def resolved(self, storage: Storage = "local", *, available: int = 0, processes: int = 1) -> StreamConfig:
        """These settings with every automatic one (``None``) chosen for a load from
        ``storage``: the one place the defaults are applied. A value set is kept.

        * ``concurrency``: 16 on a local file system; 128 on a network file system (every read
          waits a round trip there, often with a long tail: the seed's NFS p50 126 ms, p99
          1.8 s; 16 reads of 64 MiB reached half the link, 128 nine tenths, bench/RESULTS.md),
          16 there too with ``autotune`` off (fixed on purpose); on an object store
          ``object_store.concurrency``, else ``concurrency``, else 128.
        * ``chunk_size``: 64 MiB; on an object store ``object_store.chunk_size``, else
          ``chunk_size``, else 8 MiB.
        * ``memory_limit``: 2 GiB; on network storage, for a load into host memory whose
          machine has ``available`` bytes shared by ``processes`` loading processes (0: not
          known), :func:`network_fs_memory_limit` of them (autotune off: 2 GiB).
        * ``max_bandwidth``: this process's share of ``max_node_bandwidth`` (the node's cap over
          ``processes``) where that is set, within ``max_bandwidth``. The bytes in
          flight are bounded by it, and by Little's law the seed's node needs about 9 GB in
          flight (bench/sim_scale.py: 3.7x the link's time at 2 GiB a rank, 1.10x at 8 GiB).

        Resolving resolved settings changes nothing."""
        oc = self.object_store
        network = storage != "local"
        if storage == "object_store":
            concurrency = _first(oc.concurrency, self.concurrency, OBJECT_STORE_CONCURRENCY)
            chunk = _first(oc.chunk_size, self.chunk_size, OBJECT_STORE_CHUNK_SIZE)
        else:
            deep = network and self.autotune
            concurrency = _first(self.concurrency, NETWORK_FS_CONCURRENCY if deep else DEFAULT_CONCURRENCY)
            chunk = _first(self.chunk_size, DEFAULT_CHUNK_SIZE)
        memory = self.memory_limit
        if memory is None:
            more = network and self.autotune and available > 0
            memory = network_fs_memory_limit(available, processes) if more else DEFAULT_MEMORY_LIMIT
        cap = self.max_bandwidth
        if self.max_node_bandwidth is not None:
            share = max(4 * KiB, self.max_node_bandwidth // max(1, processes))
            cap = share if cap is None else min(cap, share)
        now = (concurrency, chunk, memory, cap)
        if now == (self.concurrency, self.chunk_size, self.memory_limit, self.max_bandwidth):
            return self
        return dataclasses.replace(
            self, concurrency=concurrency, chunk_size=chunk, memory_limit=memory, max_bandwidth=cap
        )

    def for_network_fs(self, *, available: int = 0, processes: int = 1) -> StreamConfig:
        """:meth:`resolved` for a network file system."""
        return self.resolved("network_fs", available=available, processes=processes)

    def for_remote(self, *, available: int = 0, processes: int = 1) -> StreamConfig:
        """:meth:`resolved` for an object store."""
        return self.resolved("object_store", available=available, processes=processes)

    @property
    def is_resolved(self) -> bool:
        """Whether no setting is left automatic (what a load runs with)."""
        return None not in (self.concurrency, self.chunk_size, self.memory_limit)

    @property
    def read_size(self) -> int:
        """Bytes per read request: ``chunk_size``, or less when ``memory_limit`` is smaller or a
        quarter of a second at ``max_bandwidth`` is (at least 256 KiB: a load under a low cap
        still completes reads several times a second, for its progress and the tuner);
        automatic ones as on a local file system."""
        r = self.resolved()
        size = min(settled(r.chunk_size), settled(r.memory_limit))
        if r.max_bandwidth:
            size = min(size, max(CAPPED_READ_MIN, r.max_bandwidth // 4 // 4096 * 4096))
        return size

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


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def settled(value: int | None) -> int:
    """A setting of resolved settings (:meth:`StreamConfig.resolved`), as the int it is: the
    engine reads only those."""
    if value is None:
        raise RuntimeError("a load's settings are resolved before it reads (StreamConfig.resolved)")
    return value


def network_fs_memory_limit(available: int, processes: int = 1) -> int:
    """The ``memory_limit`` a host load from network storage runs with by default: a sixteenth
    of the ``available`` host memory for each of ``processes`` loading processes on the machine
    (the ranks of a node), at least the default 2 GiB and at most
    :data:`NETWORK_FS_MEMORY_LIMIT` (8 GiB a rank is 64 GiB of a 2 TB node of 8 GPUs; on a
    machine of 24 GiB one process keeps 2 GiB). Pure: the simulation at full scale
    (bench/sim_scale.py) drives this same rule."""
    share = available // (16 * max(1, processes)) // MiB * MiB
    return max(DEFAULT_MEMORY_LIMIT, min(NETWORK_FS_MEMORY_LIMIT, share))


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
    """Field values from ``base``, then the environment, then ``overrides``. For each setting the
    environment is asked in order: its own variable, the Run:ai variable that sets it
    (:mod:`weightstream.compat.runai_env`), its other aliases. ``origin`` is filled with
    ``field -> "VARIABLE=value"`` for every value the environment set."""
    from weightstream.compat.runai_env import KEEP, RUNAI_VARIABLES

    prefix = "object_store." if cls is ObjectStoreConfig else ""
    runai = {
        r.setting[len(prefix) :]: r
        for r in RUNAI_VARIABLES
        if r.setting.startswith(prefix) and "." not in r.setting[len(prefix) :]
    }
    values: dict[str, Any] = dict(base or {})
    for f, s in settings_of(cls):
        if f.name in overrides or s.env is None:
            continue
        row = runai.get(f.name)
        order = [s.env, *([row.var] if row else []), *s.aliases]
        for var in order:
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                continue
            if row is not None and var == row.var:
                value = row.convert(var, raw.strip())
                if value is KEEP:
                    break
                values[f.name] = _parsed(f.name, s, var, value) if isinstance(value, str) else value
            else:
                values[f.name] = _parsed(f.name, s, var, raw)
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


def _parsed(name: str, s: Setting, var: str, raw: str) -> Any:
    """A string (the environment's, a flag's, a front end's) as the value of setting ``name``,
    by its rule; ``var`` is how messages name where the string came from."""
    try:
        return s.rule.parse(var, raw.strip())
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{var}={raw!r}: {exc}", setting=s.label or name) from None
