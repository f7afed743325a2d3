"""What the commands share: settings from the flags, the checkpoint opener, number parsing and
formatting, progress bars, and the rule that bench and tune never write to the storage they
measure."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

import weightstream
from weightstream.config import (
    Flag,
    ObjectStoreConfig,
    Setting,
    StreamConfig,
    check_seconds,
    parse_size,
    settings_of,
)
from weightstream.errors import ConfigError

if TYPE_CHECKING:
    from weightstream.checkpoint import Checkpoint

__all__ = [
    "checked_limits",
    "config_from_args",
    "human",
    "ints",
    "open_checkpoint",
    "progress_bar",
    "refuse_inside",
    "run_limits",
    "settings_flags",
    "sizes",
    "writable_output",
    "write_output",
]


def open_checkpoint(uri: str, *, config: StreamConfig) -> Checkpoint:
    """``weightstream.open_checkpoint``, imported when a command first needs it (torch with it),
    so ``--help`` and ``recommend`` start at once."""
    return weightstream.open_checkpoint(uri, config=config)


def setting_flags() -> dict[str, tuple[str, str, Setting]]:
    """Every setting's flag, from its description (:func:`weightstream.config.setting`): the flag
    is its environment variable without ``WEIGHTSTREAM_``, in lower case with dashes
    (``WEIGHTSTREAM_S3_REQUEST_TIMEOUT``: ``--s3-request-timeout``). Flag -> (argparse dest,
    setting key as :meth:`StreamConfig.from_mapping` takes it, the setting)."""
    flags = {}
    for cls, prefix in ((StreamConfig, ""), (ObjectStoreConfig, "object_store.")):
        for f, s in settings_of(cls):
            assert s.env is not None and s.env.startswith(_ENV)
            flag = "--" + s.env[len(_ENV) :].lower().replace("_", "-")
            flags[flag] = (flag[2:].replace("-", "_"), prefix + f.name, s)
    return flags


_ENV = "WEIGHTSTREAM_"


def config_from_args(args: argparse.Namespace) -> StreamConfig:
    """The settings the command line gives (each flag left out: the environment's, the
    profile's, or automatic)."""
    flags = setting_flags()
    given = {key: v for flag, (dest, key, _) in flags.items() if (v := getattr(args, dest, None)) is not None}
    named = {key: flag for flag, (_, key, _) in flags.items()}
    return StreamConfig.from_mapping(
        given, profile=getattr(args, "profile", None), label=lambda key: named.get(key, key)
    )


def settings_flags() -> argparse.ArgumentParser:
    """The parent parser of the settings a load takes: a flag for every :class:`StreamConfig` and
    :class:`ObjectStoreConfig` setting, generated from the settings' own descriptions; values
    are read by the same rules as the environment's."""
    p = argparse.ArgumentParser(add_help=False)
    for flag, (dest, _, s) in setting_flags().items():
        rule = s.rule
        automatic = getattr(rule, "automatic", "")
        text = f"{s.summary} (env {s.env}{'; automatic: ' + automatic if automatic else ''})"
        if isinstance(rule, Flag):
            p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            metavar = None if rule.choices else rule.metavar  # (argparse shows the choices)
            p.add_argument(flag, dest=dest, metavar=metavar, choices=rule.choices, help=text)
    p.add_argument("--profile", help="a profile file from `weightstream tune` (env WEIGHTSTREAM_PROFILE)")
    return p


def run_limits(p: argparse.ArgumentParser, max_bytes: str, max_seconds: float) -> None:
    """The flags that bound a measuring command (bench, tune), and its output and profile."""
    p.add_argument(
        "--max-bytes", default=max_bytes, help=f"read at most this much per phase (default {max_bytes})"
    )
    p.add_argument(
        "--max-seconds", type=float, default=max_seconds, help=f"time bound (default {max_seconds:g} s)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", help="start from a profile file (env WEIGHTSTREAM_PROFILE)")


def checked_limits(args: argparse.Namespace) -> tuple[int, float]:
    """``--max-bytes`` and ``--max-seconds``, checked by the library's own rules before any I/O
    (a size that parses; a finite duration within the bound every setting has)."""
    max_bytes = parse_size(args.max_bytes, name="--max-bytes")
    if max_bytes < 4096:
        raise ConfigError(f"--max-bytes must be at least 4 KiB, got {args.max_bytes!r}", setting="max_bytes")
    return max_bytes, check_seconds("--max-seconds", args.max_seconds)


def writable_output(path: str, flag: str) -> str:
    """Refuse, before any work, an output path the command could not write at its end: a
    folder, a file that cannot be replaced, a folder that does not exist or takes no new file
    (``/proc``, a read-only mount). Checked by making (and removing) a file beside it, as the
    result will be written: to a temporary name, then renamed into place."""
    import tempfile

    if not path or "\0" in path:
        raise ConfigError(f"{flag}: not a file name: {path!r}", setting=flag)
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise ConfigError(f"{flag} {path}: is a folder; name a file", setting=flag)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: folder {folder} does not exist", setting=flag)
    try:
        fd, probe = tempfile.mkstemp(prefix=".weightstream-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot write in {folder}: {exc.strerror or exc}", setting=flag
        ) from None
    if os.path.exists(target) and not os.access(target, os.W_OK) and os.geteuid() != 0:
        raise ConfigError(f"{flag} {path}: the file exists and cannot be replaced", setting=flag)
    return path


def write_output(path: str, text: str) -> None:
    """``text`` into ``path``: a temporary file beside it, then renamed into place (a failure
    leaves no half-written file), with a new file's usual permissions."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".weightstream-", dir=folder)
    try:
        # mkstemp makes the file 0600; the result gets what any new file gets (0666 less the
        # umask), so a profile or manifest written for a service is readable by it
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def human(n: float) -> str:
    """Bytes in binary units (``1.50 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        desc=desc,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
    )


def ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"{flag}: expected positive integers, got {text!r}")
    return out


def sizes(text: str, flag: str) -> list[int]:
    out = [parse_size(x.strip(), name=flag) for x in text.split(",") if x.strip()]
    if not out or min(out) < 4096:
        raise ConfigError(f"{flag}: expected sizes of at least 4 KiB, got {text!r}")
    return out


def refuse_inside(path: str, ckpt: Checkpoint) -> None:
    """bench and tune never write to the storage they measure."""
    target = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    from weightstream.location import LocalPath

    for shard in ckpt.shards:
        if not isinstance(shard.location, LocalPath):
            continue
        folder = os.path.realpath(os.path.dirname(os.path.abspath(shard.location.path)))
        if target == folder or target.startswith(folder + os.sep):
            raise ConfigError(
                f"{path}: refusing to write inside the checkpoint's folder {folder} (the storage under test)"
            )
