"""The decider's per-record work on threads (shared_folder/fanout.py): the same results,
in the same order, and the same first error as a loop; a loop where threads cannot pay."""

from __future__ import annotations

import threading
import time

import pytest

import lensemble_flwr.shared_folder.fanout as fanout
from lensemble_flwr.coordinator.batch import PREPARE_ON_THREADS_MIN_BYTES
from lensemble_flwr.errors import RoundError, StoreError
from lensemble_flwr.shared_folder.fanout import per_record


def _where(item: int) -> tuple[int, str]:
    time.sleep(0.01 * (5 - item))  # the first items finish last
    return item, threading.current_thread().name


def test_large_records_are_worked_on_threads_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "available_cores", lambda: 4)
    out = per_record(_where, [0, 1, 2, 3, 4], nbytes=PREPARE_ON_THREADS_MIN_BYTES)
    assert [item for item, _ in out] == [0, 1, 2, 3, 4]
    assert all(name.startswith("lensemble-folder") for _, name in out)


@pytest.mark.parametrize(
    ("cores", "items", "nbytes"),
    [
        (1, [0, 1, 2], None),  # one core
        (4, [0], None),  # one record
        (4, [0, 1, 2], PREPARE_ON_THREADS_MIN_BYTES - 1),  # too small to pay for threads
    ],
)
def test_small_batches_are_worked_in_turn(
    monkeypatch: pytest.MonkeyPatch, cores: int, items: list[int], nbytes: int | None
) -> None:
    monkeypatch.setattr(fanout, "available_cores", lambda: cores)
    me = threading.current_thread().name
    assert per_record(_where, items, nbytes=nbytes) == [(i, me) for i in items]


@pytest.mark.parametrize("cores", [1, 4])
def test_the_first_error_in_order_is_raised(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    monkeypatch.setattr(fanout, "available_cores", lambda: cores)

    def work(item: int) -> int:
        if item == 1:
            time.sleep(0.05)  # fails after item 2 did
            raise StoreError("item 1")
        if item == 2:
            raise RoundError("item 2")
        return item

    with pytest.raises(StoreError, match="item 1"):
        per_record(work, [0, 1, 2, 3], nbytes=PREPARE_ON_THREADS_MIN_BYTES)
