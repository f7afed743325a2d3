"""parallel_map: order, errors, the deadline (also for a single item), and serial-first mode."""

from __future__ import annotations

import threading
import time

import pytest

from weightstream.engine.parallel import parallel_map
from weightstream.errors import StorageTimeoutError


def test_results_in_input_order_and_first_error_raised() -> None:
    assert parallel_map(lambda x: x * 2, list(range(50)), workers=8, timeout=5, what="t") == list(
        range(0, 100, 2)
    )

    def boom(x: int) -> int:
        if x == 7:
            raise ValueError("seven")
        return x

    with pytest.raises(ValueError, match="seven"):
        parallel_map(boom, list(range(20)), workers=4, timeout=5, what="t")


@pytest.mark.parametrize("items", [["only"], ["a", "b", "c"]])
@pytest.mark.parametrize("serial", [0.0, 0.001])
def test_a_hung_item_times_out(items: list[str], serial: float) -> None:
    release = threading.Event()

    def hang(x: str) -> str:
        if x == items[-1]:
            release.wait(30)
        return x

    try:
        with pytest.raises(
            StorageTimeoutError, match=f"reading headers: no answer within 0.2 s for '{items[-1]}'"
        ):
            parallel_map(hang, items, workers=4, timeout=0.2, what="reading headers", serial_seconds=serial)
    finally:
        release.set()


def test_serial_first_stays_on_one_thread_while_items_are_fast_and_spreads_when_one_is_slow() -> None:
    names: list[str] = []
    fast = parallel_map(
        lambda x: names.append(threading.current_thread().name) or x,
        list(range(30)),
        workers=8,
        timeout=5,
        what="t",
        serial_seconds=5.0,
    )
    assert fast == list(range(30)) and set(names) == {"weightstream-meta-0"}

    names.clear()
    gate = threading.Event()

    def first_is_slow(x: int) -> int:
        names.append(threading.current_thread().name)
        if x == 0:
            gate.wait(5)  # held until the others have run on other threads
        elif len(names) >= 5:
            gate.set()
        return x

    assert parallel_map(
        first_is_slow, list(range(6)), workers=4, timeout=10, what="t", serial_seconds=0.01
    ) == list(range(6))
    assert len(set(names)) > 1


def test_an_error_is_raised_only_once_the_items_already_running_have_ended() -> None:
    """A fast failure while other items are mid-way (opening files): the caller's clean-up runs
    after them, so nothing they made is left behind. Items not yet started are dropped."""
    ended: list[int] = []
    started = threading.Barrier(3)

    def fn(x: int) -> int:
        if x == 0:
            started.wait(5)
            raise ValueError("boom")
        if x in (1, 2):
            started.wait(5)
            time.sleep(0.3)
            ended.append(x)
            return x
        ended.append(x)  # never reached: started after the failure
        return x

    with pytest.raises(ValueError, match="boom"):
        parallel_map(fn, [0, 1, 2, 3, 4, 5], workers=3, timeout=5, what="t")
    assert sorted(ended) == [1, 2]
