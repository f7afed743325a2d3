"""A load's request statistics stay the same size however many requests it makes (issue 24):
percentiles from a histogram 2 % wide, stragglers judged by the last 256 requests, and the
tuner handed each first-byte delay once."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.sources.flow import Histogram, RequestStats


@given(st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=2000), st.sampled_from([0.5, 0.9, 0.99]))
@settings(max_examples=60, deadline=None)
def test_a_histogram_quantile_is_within_two_percent_of_the_exact_one(values: list[float], q: float) -> None:
    h = Histogram()
    for v in values:
        h.add(v)
    exact = sorted(values)[min(len(values) - 1, int(q * len(values)))]
    got = h.quantile(q)
    assert got is not None and exact * 0.98 <= got <= exact * 1.0201
    assert h.largest == max(values) and len(h) == len(values)


def test_a_load_of_many_requests_keeps_a_fixed_amount_of_state() -> None:
    stats = RequestStats()
    rng = np.random.default_rng(0)
    for took in rng.uniform(0.01, 0.5, 100_000):
        stats.succeeded(float(took), 8 << 20)
        stats.answered(float(took) / 10)
    assert len(stats.seconds_per_byte) == 256 and len(stats.first_byte) == 256
    assert len(stats.latencies.counts) == Histogram._BUCKETS and len(stats.latencies) == 100_000
    report = stats.as_dict()
    assert 0.25 <= report["latency_p50_s"] <= 0.27 and 0.025 <= report["first_byte_p50_s"] <= 0.027


def test_the_tuner_is_handed_each_first_byte_delay_once() -> None:
    stats = RequestStats()
    seen = 0
    handed: list[float] = []
    for i in range(1000):
        stats.answered(float(i))
        if i % 7 == 0:
            new, seen = stats.first_bytes_since(seen)
            handed += new
    new, seen = stats.first_bytes_since(seen)
    handed += new
    assert handed == [float(i) for i in range(1000)] and seen == 1000
    assert stats.first_bytes_since(seen) == ([], 1000)
