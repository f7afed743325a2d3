from __future__ import annotations

import os

import pytest

import weightstream as ws
from weightstream.config import MAX_SECONDS, GiB, MiB, ObjectStoreConfig, StreamConfig, parse_size
from weightstream.errors import ConfigError


def test_defaults_are_valid_and_documented() -> None:
    c = ws.StreamConfig()
    assert (c.chunk_size, c.concurrency, c.memory_limit) == (None, None, None)  # automatic
    assert c.direct_io == "auto" and not c.is_resolved
    local = c.resolved()
    assert local.chunk_size == 64 * MiB and local.concurrency == 16 and local.memory_limit == 2 * GiB
    assert local.is_resolved and local.resolved() is local  # resolving twice changes nothing
    store = c.resolved("object_store")
    assert (store.chunk_size, store.concurrency, store.memory_limit) == (8 * MiB, 128, 2 * GiB)
    assert c.resolved("network_fs").concurrency == 128


def test_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        ws.StreamConfig(1)  # type: ignore[misc]
    c = ws.StreamConfig()
    with pytest.raises(AttributeError):
        c.chunk_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"chunk_size": 0}, "chunk_size must be an int from 4096"),
        ({"chunk_size": 100}, "from 4096"),
        ({"chunk_size": "16M"}, "chunk_size must be an int"),
        ({"concurrency": 0}, "concurrency must be an int from 1 to 1024"),
        ({"concurrency": True}, "concurrency must be an int"),
        ({"concurrency": 5000}, "from 1 to 1024"),
        ({"memory_limit": 100}, "memory_limit must be an int from 4096"),
        ({"direct_io": "yes"}, "direct_io"),
        ({"io_timeout": 0}, "io_timeout must be a finite number of seconds"),
        ({"io_timeout": "1"}, "io_timeout"),
    ],
)
def test_validation(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ws.StreamConfig(**kwargs)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        ws.StreamConfig(concurrency=-1)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("16MiB", 16 * MiB),
        ("16Mi", 16 * MiB),
        ("16mib", 16 * MiB),
        ("16M", 16_000_000),
        ("16mb", 16_000_000),
        ("16MB", 16_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("1GB", 10**9),
        ("2g", 2 * 10**9),
        ("8 KiB", 8192),
        ("8kB", 8000),
        ("700GB", 700 * 10**9),
        ("1.5TB", 1_500_000_000_000),
        ("1TiB", 1 << 40),
        ("1PiB", 1 << 50),
        ("12345678901234567890", 12345678901234567890),
        ("100b", 100),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "16XB", "1e9", "16ib", "16 Mi B", "inf", "nan", "1,000"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot parse"):
        parse_size(text)


def test_from_env_reads_every_field(clean_env: None) -> None:
    env = {
        "WEIGHTSTREAM_CHUNK_SIZE": "8MiB",
        "WEIGHTSTREAM_CONCURRENCY": "7",
        "WEIGHTSTREAM_MEMORY_LIMIT": "1GiB",
        "WEIGHTSTREAM_DIRECT_IO": "OFF",
        "WEIGHTSTREAM_IO_TIMEOUT": "2.5",
        "WEIGHTSTREAM_MAX_HEADER_SIZE": "1MiB",
    }
    c = ws.StreamConfig.from_env(env)
    assert (c.chunk_size, c.concurrency, c.memory_limit, c.direct_io, c.io_timeout, c.max_header_size) == (
        8 * MiB,
        7,
        GiB,
        "off",
        2.5,
        MiB,
    )


def test_explicit_arguments_beat_environment(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    monkeypatch.setenv("WEIGHTSTREAM_CONCURRENCY", "3")
    monkeypatch.setenv("WEIGHTSTREAM_CHUNK_SIZE", "1MiB")
    c = ws.StreamConfig.from_env(concurrency=9)
    assert c.concurrency == 9 and c.chunk_size == MiB
    assert ws.StreamConfig().concurrency is None  # the constructor never reads the environment


def test_runai_variables_are_honoured_below_ours(clean_env: None) -> None:
    env = {
        "RUNAI_STREAMER_CONCURRENCY": "12",
        "RUNAI_STREAMER_CHUNK_BYTESIZE": "4194304",
        "RUNAI_STREAMER_MEMORY_LIMIT": "-1",
    }
    c = ws.StreamConfig.from_env(env)
    assert c.concurrency == 12 and c.chunk_size == 4 * MiB and c.memory_limit > 1 << 60
    assert ws.StreamConfig.from_env({**env, "WEIGHTSTREAM_CONCURRENCY": "5"}).concurrency == 5


def test_bad_environment_names_the_variable(clean_env: None) -> None:
    with pytest.raises(ConfigError, match="WEIGHTSTREAM_CONCURRENCY"):
        ws.StreamConfig.from_env({"WEIGHTSTREAM_CONCURRENCY": "many"})
    with pytest.raises(ConfigError, match="WEIGHTSTREAM_CHUNK_SIZE"):
        ws.StreamConfig.from_env({"WEIGHTSTREAM_CHUNK_SIZE": "big"})


def test_replace_revalidates() -> None:
    with pytest.raises(ConfigError):
        ws.StreamConfig().replace(concurrency=0)
    assert ws.StreamConfig().replace(concurrency=3).concurrency == 3


def test_object_stores_get_their_own_depth_and_chunk_size(clean_env: None) -> None:
    from weightstream.config import ObjectStoreConfig

    c = ws.StreamConfig(
        concurrency=8,
        chunk_size=MiB,
        memory_limit=4 * MiB,
        object_store=ObjectStoreConfig(concurrency=48, chunk_size=8 * MiB),
    )
    remote = c.for_remote()
    assert (remote.concurrency, remote.chunk_size) == (48, 8 * MiB)
    assert remote.read_size == 4 * MiB  # reads never exceed the memory limit
    assert ws.StreamConfig(memory_limit=256 * 1024).read_size == 256 * 1024
    env = {
        "WEIGHTSTREAM_S3_CONCURRENCY": "96",
        "WEIGHTSTREAM_S3_CHUNK_SIZE": "4MiB",
        "AWS_REGION": "eu-west-1",
    }
    oc = ws.StreamConfig.from_env(env).object_store
    assert (oc.concurrency, oc.chunk_size, oc.region) == (96, 4 * MiB, "eu-west-1")
    with pytest.raises(ConfigError, match=r"object_store\.concurrency"):
        ObjectStoreConfig(concurrency=0)


def test_profile_sits_between_defaults_and_the_environment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    p = tmp_path / "profile.json"
    p.write_text(
        json.dumps(
            {
                "settings": {
                    "concurrency": 7,
                    "chunk_size": 8 << 20,
                    "autotune": False,
                    "object_store": {"concurrency": 99},
                }
            }
        )
    )
    c = StreamConfig.from_env({"WEIGHTSTREAM_PROFILE": str(p)})
    assert (c.concurrency, c.chunk_size, c.autotune, c.object_store.concurrency) == (7, 8 << 20, False, 99)
    c = StreamConfig.from_env(
        {"WEIGHTSTREAM_PROFILE": str(p), "WEIGHTSTREAM_CONCURRENCY": "3"}, chunk_size=1 << 20
    )
    assert (c.concurrency, c.chunk_size) == (3, 1 << 20)  # env, then keywords, beat the profile
    c = StreamConfig.from_env({}, profile=str(p))
    assert c.concurrency == 7


def test_bad_profiles_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="cannot read the profile: No such file") as info:
        StreamConfig.from_env({"WEIGHTSTREAM_PROFILE": str(tmp_path / "missing.json")})
    assert info.value.uri == str(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"settings": {"concurency": 3}}')
    with pytest.raises(ConfigError, match="unknown settings concurency"):
        StreamConfig.from_env({}, profile=str(bad))
    bad.write_text("not json")
    with pytest.raises(ConfigError, match="cannot read profile"):
        StreamConfig.from_env({}, profile=str(bad))
    bad.write_text('{"settings": {"concurrency": -1}}')
    with pytest.raises(ConfigError, match="concurrency"):
        StreamConfig.from_env({}, profile=str(bad))
    bad.write_text('{"settings": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=r"cannot read profile .* RecursionError"):
        StreamConfig.from_env({}, profile=str(bad))
    bad.write_text('{"settings": {"concurrency": ' + "9" * 5000 + "}}")
    with pytest.raises(ConfigError, match="cannot read profile"):
        StreamConfig.from_env({}, profile=str(bad))


def test_a_profile_or_ca_bundle_that_is_a_fifo_fails_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="FIFO"):
        StreamConfig.from_env({}, profile=str(fifo))
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ConfigError, match="a directory, not a regular file"):
        StreamConfig.from_env({}, profile=str(tmp_path / "dir.json"))
    from weightstream.sources.object_store import ObjectLocation, make_store

    config = StreamConfig(
        object_store=ObjectStoreConfig(ca_bundle=str(fifo), endpoint="https://example.invalid")
    )
    with pytest.raises(ConfigError, match=r"CA bundle.*FIFO"):
        make_store(ObjectLocation("s3", "bucket", "key"), config)


def test_autotune_settings() -> None:
    assert StreamConfig.from_env({"WEIGHTSTREAM_AUTOTUNE": "0"}).autotune is False
    assert StreamConfig.from_env({"WEIGHTSTREAM_MAX_CONCURRENCY": "32"}).max_concurrency == 32
    with pytest.raises(ConfigError, match="max_concurrency"):
        StreamConfig(max_concurrency=-1)
    with pytest.raises(ConfigError, match="hedge_multiple"):
        ObjectStoreConfig(hedge_multiple=0.5)


def test_one_rule_for_sizes_everywhere() -> None:
    """ "1GB" is 10^9 bytes and "1GiB" 2^30 wherever a size is read: settings, the environment,
    the command line's --memory-limit and recommend's --model-size, vLLM's extra config."""
    from weightstream.tools.recommend import parse_model_size

    assert ws.StreamConfig.from_env({"WEIGHTSTREAM_MEMORY_LIMIT": "1GB"}).memory_limit == 10**9
    assert ws.StreamConfig.from_env({"WEIGHTSTREAM_MEMORY_LIMIT": "1GiB"}).memory_limit == GiB
    assert parse_model_size("1GB") == 10**9 and parse_model_size("1GiB") == GiB
    assert parse_model_size("1G") == parse_size("1G") == 10**9


TIMEOUTS = [
    ("io_timeout", "WEIGHTSTREAM_IO_TIMEOUT", False),
    ("exchange_timeout", "WEIGHTSTREAM_EXCHANGE_TIMEOUT", False),
    ("request_timeout", "WEIGHTSTREAM_S3_REQUEST_TIMEOUT", True),
    ("connect_timeout", "WEIGHTSTREAM_S3_CONNECT_TIMEOUT", True),
    ("metadata_timeout", "WEIGHTSTREAM_S3_METADATA_TIMEOUT", True),
    ("low_speed_window", "WEIGHTSTREAM_S3_LOW_SPEED_WINDOW", True),
    ("backoff_initial", "WEIGHTSTREAM_S3_BACKOFF_INITIAL", True),
    ("backoff_max", "WEIGHTSTREAM_S3_BACKOFF_MAX", True),
    ("hedge_min_delay", "WEIGHTSTREAM_S3_HEDGE_MIN_DELAY", True),
]


@pytest.mark.parametrize(("name", "var", "store"), TIMEOUTS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 1e300, 0, -1, MAX_SECONDS + 1])
def test_every_duration_is_finite_and_bounded(name: str, var: str, store: bool, bad: float) -> None:
    """``inf`` used to be accepted, then every load died in OverflowError inside a wait."""
    with pytest.raises(ConfigError, match=name) as info:
        if store:
            ObjectStoreConfig(**{name: bad})
        else:
            StreamConfig(**{name: bad})
    assert info.value.setting == name
    with pytest.raises(ConfigError, match=var) as info:
        StreamConfig.from_env({var: str(bad)})
    assert name in str(info.value)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.5, 1001, -1])
def test_hedge_multiple_is_finite(bad: float) -> None:
    with pytest.raises(ConfigError, match="hedge_multiple"):
        ObjectStoreConfig(hedge_multiple=bad)


def test_every_setting_reads_its_text_by_its_own_rule() -> None:
    """Each setting's rule reads a sample string into a value the same rule accepts, and a
    value of the wrong type is refused naming the setting: a new field needs nothing but its
    metadata."""
    import math

    from weightstream.config import Choice, Count, Flag, Multiple, Seconds, Size, Text, settings_of

    samples = {Size: "16MiB", Count: "7", Seconds: "2.5", Multiple: "3", Flag: "yes"}
    for cls in (StreamConfig, ObjectStoreConfig):
        for f, s in settings_of(cls):
            rule = s.rule
            if isinstance(rule, Choice):
                raw = rule.choices[-1].upper()
            else:
                raw = rule.example if isinstance(rule, Text) else samples[type(rule)]
            value = rule.parse(f.name, raw)
            rule.check(f.name, value)  # accepted as it was read
            bad = [] if isinstance(rule, Text) else [object()]
            bad += [math.nan] if isinstance(rule, Count | Size | Seconds | Multiple) else []
            for wrong in bad:
                with pytest.raises(ConfigError, match=f.name) as info:
                    cls(**{f.name: wrong})
                assert info.value.setting in (f.name, s.label)
            assert s.summary and (s.env is None or s.env.startswith("WEIGHTSTREAM_")), f.name


def test_a_depth_or_read_size_given_once_holds_on_every_storage() -> None:
    """ "inherit" is None, not a second default: a concurrency or chunk size given for the load
    is the object store's too, unless the object store's own is given; a value equal to a
    default is still the user's."""
    c = StreamConfig(concurrency=64, chunk_size=16 * MiB)
    for storage in ("local", "network_fs", "object_store"):
        r = c.resolved(storage)  # type: ignore[arg-type]
        assert (r.concurrency, r.chunk_size) == (64, 16 * MiB), storage
    own = c.replace_object_store(concurrency=256)
    assert own.resolved("object_store").concurrency == 256 and own.resolved().concurrency == 64
    assert (
        StreamConfig(memory_limit=2 * GiB).resolved("network_fs", available=1 << 42).memory_limit == 2 * GiB
    )
    assert StreamConfig().resolved("network_fs", available=1 << 42).memory_limit == 8 * GiB
    env = StreamConfig.from_env({"WEIGHTSTREAM_CONCURRENCY": "40"})
    assert env.for_remote().concurrency == 40
    both = StreamConfig.from_env({"WEIGHTSTREAM_CONCURRENCY": "40", "WEIGHTSTREAM_S3_CONCURRENCY": "96"})
    assert (both.for_remote().concurrency, both.resolved().concurrency) == (96, 40)
    front = StreamConfig.from_mapping({"concurrency": 48}, env={})
    assert front.for_remote().concurrency == 48


def test_every_setting_has_a_flag_read_by_the_same_rule(clean_env: None) -> None:
    """The command line's flags are made from the settings' descriptions: one per setting,
    named after its variable, read by its rule, and a bad value names the flag."""
    from weightstream.cli.common import config_from_args, setting_flags
    from weightstream.cli.main import build_parser
    from weightstream.config import settings_of

    flags = setting_flags()
    names = {key for _, key, _ in flags.values()}
    assert names == {f.name for f, _ in settings_of(StreamConfig)} | {
        f"object_store.{f.name}" for f, _ in settings_of(ObjectStoreConfig)
    }
    parser = build_parser()
    args = parser.parse_args(
        [
            *("load", "x", "--chunk-size", "16MiB", "--s3-request-timeout", "7.5", "--no-autotune"),
            *("--s3-addressing", "path", "--memory-limit", "-1", "--s3-anonymous"),
        ]
    )
    c = config_from_args(args)
    assert (c.chunk_size, c.object_store.request_timeout, c.autotune) == (16 * MiB, 7.5, False)
    assert c.object_store.addressing == "path" and c.memory_limit == 1 << 62 and c.object_store.anonymous
    assert c.concurrency is None  # a flag left out leaves the setting automatic
    for argv, flag in (
        (["--concurrency", "many"], "--concurrency"),
        (["--s3-max-attempts", "0"], "--s3-max-attempts"),
    ):
        with pytest.raises(ConfigError, match=flag):
            config_from_args(parser.parse_args(["load", "x", *argv]))


def test_the_cache_settings_read_from_every_front_end(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("WEIGHTSTREAM_", "RUNAI_STREAMER_")):
            monkeypatch.delenv(key)
    assert StreamConfig.from_env().cache_dir is None  # off unless asked
    monkeypatch.setenv("RUNAI_STREAMER_CACHE_DIR", "/mnt/runai")  # Run:ai's proposed name
    assert StreamConfig.from_env().cache_dir == "/mnt/runai"
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_DIR", "/mnt/ws")
    monkeypatch.setenv("WEIGHTSTREAM_CACHE_MAX_BYTES", "800GB")
    c = StreamConfig.from_env()
    assert (c.cache_dir, c.cache_max_bytes) == ("/mnt/ws", 800 * 10**9)
    assert StreamConfig.from_mapping({"cache_dir": "/x", "cache_max_bytes": "1GiB"}).cache_max_bytes == GiB
    for bad in ("", "s3://bucket/cache"):
        with pytest.raises(ConfigError, match="cache_dir"):
            StreamConfig(cache_dir=bad)
