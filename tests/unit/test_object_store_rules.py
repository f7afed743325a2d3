"""The object store's classifier and policies, as pure rules (issue 15: one classifier with an
enum of kinds, policy value objects, no secrets in long-lived keys)."""

from __future__ import annotations

import random

import pytest

from weightstream.config import ObjectStoreConfig, StreamConfig
from weightstream.errors import (
    FormatError,
    NotFoundError,
    PermissionDeniedError,
    ReadError,
    StorageTimeoutError,
)

obstore = pytest.importorskip("obstore")

from weightstream.location import ObjectLocation  # noqa: E402
from weightstream.sources.object_store import client  # noqa: E402
from weightstream.sources.object_store.failures import Failure, classify, to_error  # noqa: E402
from weightstream.sources.object_store.policy import HedgePolicy, RetryPolicy  # noqa: E402

ex = obstore.exceptions


@pytest.mark.parametrize(
    ("exc", "kind", "error"),
    [
        (ex.NotFoundError("Object at location m/x not found"), Failure.NOT_FOUND, NotFoundError),
        (
            ex.GenericError("Client error with status 404 Not Found: <Code>NoSuchKey</Code>"),
            Failure.NOT_FOUND,
            NotFoundError,
        ),
        (ex.GenericError("Error: <Code>NoSuchBucket</Code>"), Failure.NO_BUCKET, NotFoundError),
        (ex.PreconditionError("precondition"), Failure.CHANGED, FormatError),
        (ex.GenericError("status 412 Precondition Failed"), Failure.CHANGED, FormatError),
        (ex.PermissionDeniedError("denied"), Failure.DENIED, PermissionDeniedError),
        (
            ex.GenericError("status 403 Forbidden: SignatureDoesNotMatch"),
            Failure.DENIED,
            PermissionDeniedError,
        ),
        (
            ex.GenericError("error sending request for url (http://169.254.169.254/latest/api/token)"),
            Failure.NO_CREDENTIALS,
            PermissionDeniedError,
        ),
        (
            ex.GenericError("Server error with status 503 Service Unavailable: SlowDown"),
            Failure.THROTTLED,
            ReadError,
        ),
        (ex.GenericError("Client error with status 429 Too Many Requests"), Failure.THROTTLED, ReadError),
        (TimeoutError(), Failure.TIMEOUT, StorageTimeoutError),
        (ex.GenericError("connection reset by peer"), Failure.TRANSIENT, ReadError),
        (
            ex.GenericError("bytes 0-499 of 4096 received"),
            Failure.TRANSIENT,
            ReadError,
        ),  # a number is not a status
    ],
)
def test_each_failure_has_one_kind_and_one_error(exc: BaseException, kind: Failure, error: type) -> None:
    assert classify(exc) is kind
    mapped = to_error(exc, uri="s3://b/k", byte_range=(0, 10), what="GET failed")
    assert type(mapped) is error and mapped.uri == "s3://b/k" and mapped.byte_range == (0, 10)
    assert kind.permanent == (
        kind
        in {Failure.NOT_FOUND, Failure.NO_BUCKET, Failure.CHANGED, Failure.DENIED, Failure.NO_CREDENTIALS}
    )


def test_what_is_not_a_storage_failure_is_left_as_it_is() -> None:
    bug = KeyError("x")
    assert classify(bug) is Failure.UNKNOWN
    assert to_error(bug, uri="s3://b/k", byte_range=None, what="GET failed") is bug


def test_backoff_is_full_jitter_within_its_cap_and_slow_downs_start_higher() -> None:
    policy = RetryPolicy.from_config(ObjectStoreConfig(backoff_initial=0.1, backoff_max=1.0))
    rng = random.Random(0)
    plain = [policy.backoff(2, throttled=False, rng=rng) for _ in range(2000)]
    slow = [policy.backoff(2, throttled=True, rng=rng) for _ in range(2000)]
    assert min(plain) >= 0 and max(plain) <= 0.4 < max(slow) <= 1.0


def test_hedging_waits_for_samples_and_scales_with_request_size() -> None:
    hedge = HedgePolicy.from_config(ObjectStoreConfig(hedge_multiple=3.0, hedge_min_delay=0.5))
    assert hedge.after(1 << 20, [1e-8] * 15) is None  # not enough requests finished yet
    spb = [1e-8] * 16
    assert hedge.after(1 << 20, spb) == 0.5  # the floor
    assert hedge.after(1 << 30, spb) == pytest.approx(3 * 1e-8 * (1 << 30))


def test_the_store_cache_key_holds_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    config = StreamConfig(object_store=ObjectStoreConfig(endpoint="http://127.0.0.1:9", region="us-east-1"))
    loc = ObjectLocation("s3", "cache-key-test", "")
    store = client.make_store(loc, config)
    assert client.make_store(loc, config) is store  # shared while the credentials stay
    assert not any("very-secret-value" in repr(key) for key in client._STORES)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated")
    assert client.make_store(loc, config) is not store  # rotated keys: a new store


def test_a_process_keeps_a_bounded_number_of_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived process that loads from many buckets (or with many settings) keeps the most
    recently used stores and lets the others go, instead of a client and its connection pool
    for every bucket it ever read."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    config = StreamConfig(object_store=ObjectStoreConfig(endpoint="http://127.0.0.1:9", region="us-east-1"))
    first = client.make_store(ObjectLocation("s3", "bounded-0", ""), config)
    for i in range(1, 3 * client._MOST_STORES):
        client.make_store(ObjectLocation("s3", f"bounded-{i}", ""), config)
        assert client.make_store(ObjectLocation("s3", "bounded-0", ""), config) is first  # in use: kept
    assert len(client._STORES) <= client._MOST_STORES
    last = ObjectLocation("s3", f"bounded-{3 * client._MOST_STORES - 1}", "")
    assert client.make_store(last, config) is client.make_store(last, config)
    old = ObjectLocation("s3", "bounded-1", "")  # used once, long ago: let go, made again on use
    assert not any(key[1] == "bounded-1" for key in client._STORES)
    assert client.make_store(old, config) is not None


@pytest.mark.parametrize("request_timeout", [0.5, 60.0, 600.0, 30 * 24 * 3600.0])
def test_the_clients_own_timeout_never_fires_before_ours(request_timeout: float) -> None:
    """Our per-attempt timeout is the one that applies (with its message and cause); the client's
    default (30 s) would cut a legal request under ours, so the client gets a backstop past it."""
    oc = ObjectStoreConfig(request_timeout=request_timeout)
    assert client._backstop(oc.request_timeout, oc.metadata_timeout) > max(
        oc.request_timeout, oc.metadata_timeout
    )
