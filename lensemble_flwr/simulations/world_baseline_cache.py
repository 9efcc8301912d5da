"""A node's tuned local-only baseline, computed once and kept in a cache folder.

The world App prints, next to each round's federated losses, what the node gets alone at
its best: its own model trained with the learning rate and stopping step chosen on the
tuning half of its validation data, scored on the other half
(:func:`world_tuning.tuned_local_only`). A node computes it on its own data the first
time it is asked and keeps it in ``<cache>/world-local-only/<key>.json``, where the key
is a digest of everything the result depends on (the node, its data settings, the
seeds, the inner optimizer's config, the learning-rate grid and the stopping rule). The
cache is a user-level folder (``$XDG_CACHE_HOME`` or ``~/.cache``, under
``lensemble-flwr``) unless the run names one; it is never part of a run's committed
artifacts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.cli.output import write_output
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.simulations.world_data import participant_data
from lensemble_flwr.simulations.world_tuning import (
    DEFAULT_STOPPING,
    Stopping,
    lr_grid,
    tuned_local_only,
)

CACHE_VERSION = 2  # 1: the untuned curve of rounds x inner-steps steps
FIELDS = ("lr", "step", "tune", "score")
SUBFOLDER = "world-local-only"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lensemble-flwr`` (default ``~/.cache/lensemble-flwr``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lensemble-flwr"


def cache_key(
    index: int,
    data: Mapping[str, Any],
    config: LensembleConfig,
    *,
    data_seed: int,
    init_seed: int,
    stopping: Stopping = DEFAULT_STOPPING,
) -> str:
    """The digest naming one node's result (hex): it changes with anything the result
    depends on."""
    spec = {
        "version": CACHE_VERSION,
        "index": index,
        "data": dict(sorted(data.items())),
        "inner": config.inner.model_dump(mode="json"),
        "grid": list(lr_grid(config)),
        "stopping": [stopping.every, stopping.patience, stopping.max_steps],
        "data_seed": data_seed,
        "init_seed": init_seed,
    }
    return f"{derive_seed(0, 'world-local-only', json.dumps(spec, sort_keys=True)):016x}"


def tuned_local_only_result(
    index: int,
    data: Mapping[str, Any],
    config: LensembleConfig,
    *,
    data_seed: int,
    init_seed: int,
    cache_dir: Path | None = None,
    stopping: Stopping = DEFAULT_STOPPING,
) -> dict[str, float]:
    """Node ``index``'s tuned local-only baseline, ``{"lr", "step", "tune", "score"}``
    (the chosen learning rate and stopping step, and the losses there on the tuning and
    scoring halves), from the cache or computed (and then cached). ``data`` holds
    :func:`participant_data`'s keyword arguments.

    Raises:
        ConfigError: data settings :func:`participant_data` refuses, or fewer than 2
            validation trajectories (nothing to split).
    """
    folder = (cache_dir if cache_dir is not None else default_cache_dir()) / SUBFOLDER
    key = cache_key(
        index, data, config, data_seed=data_seed, init_seed=init_seed, stopping=stopping
    )
    path = folder / f"{key}.json"
    try:
        cached = json.loads(path.read_text())
        return {name: float(cached[name]) for name in FIELDS}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: compute it again
    own = participant_data(index, seed=data_seed, **data)
    search = tuned_local_only(
        own, int(data["validation_trajectories"]), config, init_seed=init_seed, stopping=stopping
    )
    chosen = search.chosen
    values = (chosen.lr, chosen.best_step, chosen.best_tune, chosen.best_score[0])
    result = {name: float(v) for name, v in zip(FIELDS, values, strict=True)}
    write_output(path, json.dumps(result).encode("utf-8"))
    return result
