"""benchmarks/tuning.py: a pick at the edge of its grid extends the grid past it, on
made-up score functions (nothing is trained)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from tuning import extend_until_interior, grid_side

from lensemble_flwr.errors import ConfigError


def best_near(optimum: float):
    """A pick function over the values run so far: the one nearest ``optimum`` in log."""

    def pick(values: list[float]) -> float:
        return min(values, key=lambda v: abs(math.log(v / optimum)))

    return pick


def search(grid: list[float], optimum: float, **kwargs: Any) -> Any:
    ran: list[float] = []
    nearest = best_near(optimum)
    result = extend_until_interior(
        {"arm": list(grid)},
        lambda arm, value: ran.append(value),
        lambda: {"arm": nearest(grid + ran)},
        **kwargs,
    )
    return result, ran


def test_grid_side() -> None:
    assert grid_side([1, 2, 3], 1) == "low"
    assert grid_side([1, 2, 3], 3) == "high"
    assert grid_side([1, 2, 3], 2) is None
    assert grid_side([2], 2) == "low"  # one value has no neighbour on either side


def test_a_pick_at_the_top_edge_extends_the_grid_until_it_is_inside() -> None:
    # a grid ending at 7e-3 whose best value lies above it
    result, ran = search([1e-3, 3e-3, 7e-3], optimum=2.5e-2)
    assert ran == pytest.approx([1.4e-2, 2.8e-2, 5.6e-2])
    assert result["picks"]["arm"] == pytest.approx(2.8e-2)
    assert result["grids"]["arm"] == pytest.approx([1e-3, 3e-3, 7e-3, 1.4e-2, 2.8e-2, 5.6e-2])
    assert result["interior"] == {"arm": True}
    assert result["extensions"] == {"arm low": 0, "arm high": 3}


def test_a_pick_at_the_bottom_edge_extends_downwards() -> None:
    result, ran = search([3e-3, 7e-3, 1.5e-2], optimum=2.5e-3)
    assert ran == pytest.approx([1.5e-3])
    assert result["picks"]["arm"] == 3e-3
    assert result["interior"] == {"arm": True}


def test_an_inside_pick_runs_nothing() -> None:
    result, ran = search([1e-3, 3e-3, 7e-3], optimum=3e-3)
    assert ran == []
    assert result["interior"] == {"arm": True}


def test_the_bound_stops_the_search_and_says_the_pick_is_at_the_edge() -> None:
    result, ran = search([1e-3, 3e-3], optimum=10.0, max_steps=2, factor=3.0)
    assert ran == pytest.approx([9e-3, 2.7e-2])
    assert result["picks"]["arm"] == pytest.approx(2.7e-2)
    assert result["interior"] == {"arm": False}


def test_one_arms_new_pick_moves_the_other_arms_and_both_end_inside() -> None:
    # arm b's best value is twice arm a's pick: extending a's grid moves b's pick too
    ran: dict[str, list[float]] = {"a": [], "b": []}
    grids = {"a": [1.0, 2.0, 4.0], "b": [1.0, 2.0, 4.0]}

    def pick() -> dict[str, float]:
        a = best_near(6.0)(grids["a"] + ran["a"])
        return {"a": a, "b": best_near(2 * a)(grids["b"] + ran["b"])}

    result = extend_until_interior(grids, lambda arm, value: ran[arm].append(value), pick)
    assert result["picks"] == {"a": 8.0, "b": 16.0}
    assert ran == {"a": [8.0, 16.0], "b": [8.0, 16.0, 32.0]}
    assert result["interior"] == {"a": True, "b": True}


@pytest.mark.parametrize(
    ("grids", "kwargs", "field"),
    [
        ({}, {}, "grids"),
        ({"arm": []}, {}, "grids"),
        ({"arm": [0.0, 1e-3]}, {}, "grids"),
        ({"arm": [1e-3, math.nan]}, {}, "grids"),
        ({"arm": [1e-3, math.inf]}, {}, "grids"),
        ({"arm": [1e-3]}, {"factor": 1.0}, "factor"),
        ({"arm": [1e-3]}, {"factor": math.inf}, "factor"),
        ({"arm": [1e-3]}, {"max_steps": -1}, "max_steps"),
    ],
)
def test_bad_grids_and_settings_are_refused_before_anything_runs(
    grids: dict[str, list[float]], kwargs: dict[str, Any], field: str
) -> None:
    ran: list[float] = []
    with pytest.raises(ConfigError, match=field):
        extend_until_interior(
            grids, lambda arm, value: ran.append(value), lambda: {"arm": 1e-3}, **kwargs
        )
    assert ran == []
