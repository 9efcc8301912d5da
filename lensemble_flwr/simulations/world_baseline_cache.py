"""A node's local-only baseline, computed once and kept in a cache folder.

The world App prints, next to each round's federated losses, what the node would have
had alone after the same number of AdamW steps (:func:`world_baselines.local_only`). A
node computes that curve on its own data the first time it is asked and keeps it in
``<cache>/world-local-only/<key>.json``, where the key is a digest of everything the
curve depends on (the node, its data settings, the seeds, the inner optimizer's config
and the number of rounds). The cache is a user-level folder (``$XDG_CACHE_HOME`` or
``~/.cache``, under ``lensemble-flwr``) unless the run names one; it is never part of a
run's committed artifacts.
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
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations.world_baselines import local_only
from lensemble_flwr.simulations.world_data import participant_data

CACHE_VERSION = 1
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
    rounds: int,
    data_seed: int,
    init_seed: int,
) -> str:
    """The digest naming one node's curve (hex): it changes with anything the curve
    depends on."""
    spec = {
        "version": CACHE_VERSION,
        "index": index,
        "data": dict(sorted(data.items())),
        "inner": config.inner.model_dump(mode="json"),
        "rounds": rounds,
        "data_seed": data_seed,
        "init_seed": init_seed,
    }
    return f"{derive_seed(0, 'world-local-only', json.dumps(spec, sort_keys=True)):016x}"


def local_only_curve(
    index: int,
    data: Mapping[str, Any],
    config: LensembleConfig,
    *,
    rounds: int,
    data_seed: int,
    init_seed: int,
    cache_dir: Path | None = None,
) -> dict[str, list[float]]:
    """Node ``index``'s local-only curves, ``{"validation": [...], "train": [...]}`` with
    one value per round (index 0: the initial model), from the cache or computed (and
    then cached). ``data`` holds :func:`participant_data`'s keyword arguments.

    Raises:
        ConfigError: ``rounds`` < 0 or data settings :func:`participant_data` refuses.
    """
    if rounds < 0:
        raise ConfigError("num-server-rounds", f"must be >= 0, got {rounds}")
    folder = (cache_dir if cache_dir is not None else default_cache_dir()) / SUBFOLDER
    key = cache_key(index, data, config, rounds=rounds, data_seed=data_seed, init_seed=init_seed)
    path = folder / f"{key}.json"
    try:
        cached = json.loads(path.read_text())
        if len(cached["validation"]) == rounds + 1 and len(cached["train"]) == rounds + 1:
            return {"validation": cached["validation"], "train": cached["train"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: compute it again
    own = participant_data(index, seed=data_seed, **data)
    curves = local_only([own], config, rounds=rounds, init_seed=init_seed)
    result = {"validation": curves.validation[0], "train": curves.train[0]}
    write_output(path, json.dumps(result).encode("utf-8"))
    return result
