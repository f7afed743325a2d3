"""The Run:ai Model Streamer's environment variables, as weightstream settings: the one table.

Every ``RUNAI_STREAMER_*`` variable that has a meaning here is a row: the setting it sets and
how its text is read (Run:ai's units and spellings). :meth:`weightstream.StreamConfig.from_env`
reads the table wherever the environment is read, so a deployment tuned for the Run:ai streamer
keeps its settings with any front end (the drop-in, vLLM, the CLI, a plain ``load``); a
``WEIGHTSTREAM_*`` variable of the same setting wins over it, and it wins over the other
aliases (``AWS_ENDPOINT_URL``). Values Run:ai takes that weightstream's ranges refuse are made
safe rather than refused, each said once in the log: more than 1,024 reads in flight, reads
smaller than a page, a memory limit below a page (Run:ai's ``0``: "the largest tensor"), a
request timeout of ``0`` (none: the default timeout stays).

Pure: it imports nothing of weightstream but the errors, so the settings module may read it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightstream.errors import ConfigError

__all__ = ["KEEP", "RUNAI_VARIABLES", "RunaiVariable"]

log = logging.getLogger("weightstream.compat")

PAGE = 4096
MOST_IN_FLIGHT = 1024
UNLIMITED = 1 << 62

KEEP = object()
"""What a conversion returns to leave the setting as it would be without the variable."""


@dataclass(frozen=True)
class RunaiVariable:
    """One Run:ai variable: the setting it sets (``object_store.NAME`` for an object-store
    field) and how its text becomes that setting's value."""

    var: str
    setting: str
    convert: Callable[[str, str], Any]
    """``convert(var, text)``: the value, or :data:`KEEP`; a :class:`ConfigError` naming ``var``
    where the text means nothing."""
    meaning: str


def _integer(var: str, raw: str, unit: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{var} must be an integer ({unit}), got {raw!r}") from None


def _said(var: str, number: int, fixed: int, what: str) -> int:
    if fixed != number:
        log.warning("%s=%d: weightstream uses %d (its %s)", var, number, fixed, what)
    return fixed


def _concurrency(var: str, raw: str) -> Any:
    n = _integer(var, raw, "reads in flight")
    return _said(var, n, min(n, MOST_IN_FLIGHT), "most reads in flight") if n >= 1 else n


def _chunk(var: str, raw: str) -> Any:
    n = _integer(var, raw, "bytes")
    return _said(var, n, max(n, PAGE), "smallest read") if n >= 1 else n


def _memory(var: str, raw: str) -> Any:
    n = _integer(var, raw, "bytes")
    if n == -1:
        return UNLIMITED
    return PAGE if 0 <= n < PAGE else n  # below a page: one tensor at a time, as 0 means in Run:ai


def _request_timeout(var: str, raw: str) -> Any:
    ms = _integer(var, raw, "milliseconds")
    if ms == 0:
        log.warning("%s=0: keeping weightstream's request timeout", var)
        return KEEP
    return ms / 1000


def flag(var: str, raw: str) -> bool:
    """Run:ai's switches: an integer (0 off, any other on, as Run:ai reads ``2``) or a word."""
    text = raw.strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off"):
        return False
    try:
        return int(text) != 0
    except ValueError:
        raise ConfigError(f"{var} must be 1 or 0, got {raw!r}") from None


RUNAI_VARIABLES: tuple[RunaiVariable, ...] = (
    RunaiVariable("RUNAI_STREAMER_CONCURRENCY", "concurrency", _concurrency, "reads in flight at the start"),
    RunaiVariable(
        "RUNAI_STREAMER_OBJ_CONCURRENCY",
        "object_store.concurrency",
        _concurrency,
        "reads in flight at the start, object stores only",
    ),
    RunaiVariable("RUNAI_STREAMER_CHUNK_BYTESIZE", "chunk_size", _chunk, "bytes per read"),
    RunaiVariable(
        "RUNAI_STREAMER_MEMORY_LIMIT",
        "memory_limit",
        _memory,
        "bytes read but not yet consumed (-1: unlimited)",
    ),
    RunaiVariable(
        "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS",
        "object_store.request_timeout",
        _request_timeout,
        "per-request timeout of object-store reads, in milliseconds",
    ),
    RunaiVariable(
        "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT",
        "object_store.low_speed_limit",
        lambda var, raw: _integer(var, raw, "bytes per second"),
        "bytes/s under which a request counts as stalled",
    ),
    RunaiVariable(
        "RUNAI_STREAMER_S3_ENDPOINT",
        "object_store.endpoint",
        lambda var, raw: raw if "://" in raw else f"https://{raw}",  # no scheme: HTTPS, as Run:ai's client
        "the S3 endpoint",
    ),
    RunaiVariable("RUNAI_STREAMER_S3_UNSIGNED", "object_store.anonymous", flag, "1: unsigned requests"),
    RunaiVariable(
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",
        "object_store.addressing",
        lambda var, raw: "virtual" if flag(var, raw) else "path",
        "1: virtual-hosted URLs, 0: path-style",
    ),
    RunaiVariable(
        "RUNAI_STREAMER_DIST_TIMEOUT",
        "exchange_timeout",
        lambda var, raw: float(_integer(var, raw, "seconds")),
        "seconds a rank waits for the others",
    ),
    RunaiVariable(
        "RUNAI_STREAMER_CACHE_DIR",
        "cache_dir",
        lambda var, raw: raw.strip() or KEEP,
        "a local folder filled while streaming from an object store (proposed in the streamer's "
        "pull request 153, not yet released: read here so a deployment that sets it gets the cache)",
    ),
)
"""Every Run:ai variable weightstream reads, by the setting it sets. (``RUNAI_STREAMER_DIST``
and ``RUNAI_STREAMER_LOG_LEVEL`` are not settings: the drop-in reads them itself.)"""
