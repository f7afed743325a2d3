"""`weightstream recommend`: one computation, every format rendered from it."""

from __future__ import annotations

import json

import pytest

from weightstream.config import GiB
from weightstream.errors import ConfigError
from weightstream.tools.recommend import FORMATS, instances, parse_model_size, recommend, render

FAMILIES = ("g5", "g6", "g6e", "g7e", "gr6", "p4d", "p4de", "p5", "p5e", "p5en", "p6")


def test_the_table_covers_the_families_and_names_a_source_per_row() -> None:
    table = instances()
    for family in FAMILIES:
        assert any(name.split(".")[0].split("-")[0] == family for name in table), family
    for row in table.values():
        assert row.network_gbps > 0 and row.gpus >= 1
        assert row.source.startswith("https://"), row


def test_high_bandwidth_class() -> None:
    rec = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), tp=8)
    assert rec.bandwidth_from == "table" and rec.network_gbps == 3200
    assert rec.runai_env["RUNAI_STREAMER_CHUNK_BYTESIZE"] == str(4 * GiB)
    assert rec.runai_env["RUNAI_STREAMER_CONCURRENCY"] == "64"  # ceil(700 / 4) = 175, capped
    assert rec.runai_env["RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS"] == "3000"
    assert rec.runai_env["RUNAI_STREAMER_S3_LOW_SPEED_LIMIT"] == "1048576"
    assert rec.runai_extra_config["distributed"] is True
    small = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("70GB"))
    assert small.runai_env["RUNAI_STREAMER_CONCURRENCY"] == "18"  # ceil(70 / 4)
    assert "distributed" not in small.runai_extra_config  # tp 1


def test_standard_class_and_explicit_concurrency() -> None:
    rec = recommend(instance="g6.2xlarge", model_bytes=parse_model_size("16GB"), tp=1)
    assert "RUNAI_STREAMER_CHUNK_BYTESIZE" not in rec.runai_env  # the streamer's default chunks
    assert rec.runai_env["RUNAI_STREAMER_CONCURRENCY"] == "32"
    assert any("up to" in n for n in rec.notes)
    forced = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), concurrency=12)
    assert forced.runai_env["RUNAI_STREAMER_CONCURRENCY"] == "12"
    assert forced.runai_extra_config["concurrency"] == 12


def test_unknown_instance_falls_back_and_says_so() -> None:
    rec = recommend(instance="x9.huge", model_bytes=10**11)
    assert rec.bandwidth_from == "standard"
    assert any("x9.huge is not in the instance table" in n for n in rec.notes)
    probed = recommend(instance="x9.huge", model_bytes=10**11, probe_gbps=120.0)
    assert probed.bandwidth_from == "probe" and probed.network_gbps == 120.0
    assert probed.runai_env["RUNAI_STREAMER_CHUNK_BYTESIZE"] == str(4 * GiB)  # >= 50 Gbit/s class


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_renders_the_same_settings(fmt: str) -> None:
    rec = recommend(instance="p4d.24xlarge", model_bytes=parse_model_size("140GB"), tp=4)
    text = render(rec, fmt, model="s3://models/llama")
    for key, value in {**rec.runai_env, **rec.weightstream_env}.items():
        if fmt == "vllm" and key.startswith("WEIGHTSTREAM_"):
            continue  # the vLLM line carries the Run:ai streamer's settings
        assert key in text and value in text, (fmt, key)
    if fmt == "json":
        assert json.loads(text)["runai_env"] == rec.runai_env
    if fmt == "vllm":
        flat = text.replace(" ", "").replace('\\"', '"')
        assert "runai_streamer" in text and '"distributed":true' in flat
        # weightstream's own load format, with its settings
        assert "--load-format weightstream" in text
        # vLLM 0.32 takes an object-store model only with its own formats: the weights' URI goes to ours
        assert extra_config_text({"weights": "s3://models/llama", **rec.weightstream_extra_config}) in flat
        # and the config folder it serves is made by our own command, the step before
        assert "weightstream pull-config s3://models/llama CONFIG_DIR" in text
        assert "vllm serve CONFIG_DIR --load-format weightstream" in text


def extra_config_text(config: dict[str, object]) -> str:
    return json.dumps(config, separators=(",", ":"))


def test_the_weightstream_load_format_gets_the_same_settings_as_the_environment(clean_env: None) -> None:
    from weightstream.config import StreamConfig
    from weightstream.integrations.vllm import config_from_extra

    rec = recommend(instance="p5.48xlarge", model_bytes=parse_model_size("700GB"), tp=8)
    from_extra, distributed = config_from_extra(rec.weightstream_extra_config, env={})
    from_env = StreamConfig.from_env(rec.weightstream_env)
    assert from_extra == from_env and distributed is True


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="model size"):
        parse_model_size("lots")
    with pytest.raises(ConfigError, match="tp"):
        recommend(instance="p5.48xlarge", model_bytes=1, tp=0)
    with pytest.raises(ConfigError, match="format"):
        render(recommend(model_bytes=1), "yaml")
    assert parse_model_size("65GiB") == 65 * GiB and parse_model_size("1.5TB") == 1_500_000_000_000
