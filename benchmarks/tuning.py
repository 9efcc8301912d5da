"""Tuning on a grid that extends past its pick, shared by the benchmarks that tune.

A value picked at the edge of the grid it was picked from says only that the best value
may lie beyond: nothing was tried there. :func:`extend_until_interior` runs the next value
past such an edge and picks again, until every pick has grid values on both sides or a
bound stops it, and says which picks ended inside. It knows nothing of what a value
means: the caller runs a value and picks from everything run so far."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lensemble_flwr.errors import ConfigError


def grid_side(grid: Sequence[float], pick: float) -> str | None:
    """Which edge of ``grid`` ``pick`` sits at: "low" or "high" when it is the smallest or
    largest value (none was tried beyond it on that side), None when it has values on both."""
    if pick == min(grid):
        return "low"
    if pick == max(grid):
        return "high"
    return None


def extend_until_interior(
    grids: dict[str, list[float]],
    run: Callable[[str, float], None],
    pick: Callable[[], dict[str, float]],
    *,
    factor: float = 2.0,
    max_steps: int = 3,
) -> dict[str, Any]:
    """Tune every arm on a grid that extends past its pick. ``grids`` (arm -> values
    already run) must have been run; ``pick()`` picks each arm's value from all the runs
    so far. While an arm's pick is at an edge of its grid, ``run(arm, value)`` runs the
    next value past that edge (edge x ``factor``, or edge / ``factor``) and every arm is
    picked again (one arm's pick can move another's target), at most ``max_steps`` times
    per arm and side. Returns the final picks, the grids (sorted) and, per arm, whether
    its pick has grid values on both sides; False means the bound stopped the search."""
    if not grids or any(not g for g in grids.values()):
        raise ConfigError("grids", "every arm needs at least one value")
    if any(v <= 0 or not math.isfinite(v) for g in grids.values() for v in g):
        raise ConfigError("grids", f"values must be positive and finite, got {grids}")
    if not factor > 1 or not math.isfinite(factor):
        raise ConfigError("factor", f"must be finite and above 1, got {factor}")
    if max_steps < 0:
        raise ConfigError("max_steps", f"must be >= 0, got {max_steps}")
    grids = {arm: sorted(g) for arm, g in grids.items()}
    steps = {(arm, side): 0 for arm in grids for side in ("low", "high")}
    while True:
        picks = pick()
        extended = False
        for arm, grid in grids.items():
            side = grid_side(grid, picks[arm])
            if side is None or steps[arm, side] >= max_steps:
                continue
            value = grid[-1] * factor if side == "high" else grid[0] / factor
            run(arm, value)
            grid.append(value)
            grid.sort()
            steps[arm, side] += 1
            extended = True
        if not extended:
            break
    return {
        "picks": picks,
        "grids": grids,
        "interior": {arm: grid_side(grid, picks[arm]) is None for arm, grid in grids.items()},
        "extensions": {f"{arm} {side}": n for (arm, side), n in steps.items()},
    }
