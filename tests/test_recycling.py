"""A round's accumulator reuses the previous round's buffers only when nobody else holds
them, and always starts from zero."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from lensemble_flwr.aggregation import recycling
from lensemble_flwr.aggregation.fixed_point import FixedPointAggregator
from lensemble_flwr.config import AggregationConfig
from lensemble_flwr.protocol.messages import Update

SIZE = recycling.RECYCLE_MIN_BYTES // 4  # float32 values: an int64 sum of 2 MiB


@pytest.fixture(autouse=True)
def _empty_bin() -> Iterator[None]:
    recycling.clear()
    yield
    recycling.clear()


def _update(pid: str, value: float) -> Update:
    delta = {"w": np.full(SIZE, value, np.float32), "b": np.full(3, value, np.float32)}
    return Update(
        run_id="r",
        round=1,
        sender=pid,
        participant_id=pid,
        dataset_root=None,
        delta=delta,
        l2_norm=float(np.sqrt(SIZE + 3) * abs(value)),
        num_examples=1,
    )


def _sum_of(values: list[float]) -> dict[str, np.ndarray]:
    template = {"w": np.zeros(SIZE, np.float32), "b": np.zeros(3, np.float32)}
    aggregator = FixedPointAggregator(template, AggregationConfig(), check_seed=1)
    for i, value in enumerate(values):
        aggregator.admit(_update(f"p{i}", value), weight=1)
    result = aggregator.reveal()
    aggregator.verify(result)
    assert result.digest  # as a commit does: the background hash is done ...
    for thread in threading.enumerate():
        if thread.name == "lensemble-sums-digest":
            thread.join()  # ... and its thread, which held the sum, gone
    return result.sums


def test_a_dropped_sum_gives_its_buffer_to_the_next_and_it_starts_from_zero() -> None:
    expected = _sum_of([0.5, 0.25])["w"].copy()
    first = _sum_of([0.5, 0.25])
    address = first["w"].ctypes.data
    del first
    second = _sum_of([0.5, 0.25])
    assert second["w"].ctypes.data == address  # the same memory, zeroed, then folded
    np.testing.assert_array_equal(second["w"], expected)
    assert not second["w"].flags.writeable  # a revealed sum stays read-only


def test_a_sum_somebody_still_holds_is_never_overwritten() -> None:
    first = _sum_of([0.5])
    kept = first["w"].copy()
    view = first["w"][:10]  # a view keeps its base alive: the base is held
    del first
    second = _sum_of([-0.25])
    assert second["w"].ctypes.data != view.base.ctypes.data  # type: ignore[union-attr]
    np.testing.assert_array_equal(view.base, kept)  # type: ignore[arg-type]


def test_small_arrays_are_not_kept() -> None:
    recycling.keep({"b": np.zeros(3, np.int64), "w": np.zeros(SIZE, np.int64)})
    assert list(recycling._kept) == [("w", (SIZE,))]
    assert recycling.zeroed("b", (3,)) is not None and not recycling._kept.get(("b", (3,)))


def test_recycling_is_calibrated_to_how_this_interpreter_counts_references() -> None:
    """One more holder must count as exactly one more (CPython 3.14 may not count the
    argument of getrefcount; a free-threaded build gives no reliable counts): otherwise
    recycling is off and every accumulator is fresh."""
    assert recycling._calibrate() == recycling._UNHELD
    if recycling._UNHELD is None:
        pytest.skip("recycling is off on this interpreter")
    held = np.zeros(8, np.int64)
    with recycling._lock:
        recycling._kept[("x", (8,))] = held
    _, refs = recycling._take(("x", (8,)))
    assert refs == recycling._UNHELD + 1  # `held` is one more holder


def test_recycling_off_never_reuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recycling, "_UNHELD", None)
    first = _sum_of([0.5])
    address = first["w"].ctypes.data
    del first
    assert _sum_of([0.5])["w"].ctypes.data != address or not recycling._kept


def test_a_coordinator_folds_round_after_round_into_the_same_buffer(tmp_path) -> None:
    """The previous attempt (its aggregator and sums) is let go as the next begins: the
    reach memos used to keep it alive, so the buffer was never free when it was wanted."""
    import logging
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_hash_once import feed_round, unbound_coordinator

    from lensemble_flwr.artifacts.store import Store

    logging.disable(logging.ERROR)
    try:
        coordinator = unbound_coordinator(Store(tmp_path), size=SIZE)
        rng = np.random.default_rng(0)
        addresses = []
        for _ in range(3):
            feed_round(coordinator, rng)
            with recycling._lock:
                addresses.append(recycling._kept[("w", (SIZE,))].ctypes.data)
    finally:
        logging.disable(logging.NOTSET)
    assert [o.state.value for o in coordinator.outcomes] == ["closed"] * 3
    assert len(set(addresses)) == 1, addresses


def _attempt(coordinator, attempt: int):
    """One attempt of three seeded plaintext updates through the batch feeder's steps."""
    peers = ["p0", "p1", "p2"]
    state = coordinator.global_state()
    rng = np.random.default_rng(attempt)
    updates = [
        Update(
            run_id=coordinator.run_id,
            round=state.next_round,
            attempt=attempt,
            sender=pid,
            participant_id=pid,
            dataset_root=None,
            delta={
                n: rng.standard_normal(a.shape).astype(np.float32) for n, a in state.params.items()
            },
            num_examples=1,
        )
        for pid in peers
    ]
    coordinator.begin_attempt()
    coordinator.invite(peers)
    return coordinator.conclude_collected(updates, peers)


def test_an_attempt_aborted_after_its_sum_gives_the_retry_its_buffer(
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An aborted outcome keeps its error, not the error's traceback: the traceback's
    frames held the attempt and its sum, so the retry could never reuse the buffer (and
    up to 16 kept outcomes pinned whole attempts)."""
    import logging
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_hash_once import unbound_coordinator

    from lensemble_flwr.artifacts.store import Store
    from lensemble_flwr.errors import StoreError

    coordinator = unbound_coordinator(Store(tmp_path), size=SIZE)
    put_parts = Store.put_parts

    def failing_once(self: Store, parts):
        monkeypatch.setattr(Store, "put_parts", put_parts)  # the next write succeeds
        raise StoreError("disk full")

    monkeypatch.setattr(Store, "put_parts", failing_once)
    logging.disable(logging.ERROR)
    try:
        aborted = _attempt(coordinator, 1)
        with recycling._lock:
            aborted_sum = recycling._kept[("w", (SIZE,))].ctypes.data
        retried = _attempt(coordinator, 2)
        with recycling._lock:
            retried_sum = recycling._kept[("w", (SIZE,))].ctypes.data
    finally:
        logging.disable(logging.NOTSET)
    assert aborted.state.value == "aborted" and isinstance(aborted.error, StoreError)
    assert aborted.error.__traceback__ is None
    assert retried.state.value == "closed"
    assert retried_sum == aborted_sum
