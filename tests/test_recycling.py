"""A round's accumulator reuses the previous round's buffers only when nobody else holds
them, and always starts from zero."""

from __future__ import annotations

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
