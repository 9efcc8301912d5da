"""The main job's world and its baselines: full actuation, local-only and centralized
curves, and the tuned local-only cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.simulations import world_baseline_cache as cache
from lensemble_flwr.simulations.world_data import (
    CONTROL_DIM,
    FULL_ACTION_DIMS,
    make_embodiment,
    participant_data,
)
from lensemble_flwr.simulations.world_tuning import Stopping, lr_grid

CONFIG = LensembleConfig(inner={"steps": 2, "lr": 0.002, "batch_size": 8})
DATA = {"trajectories": 1, "steps": 6, "validation_trajectories": 1, "actuation": "full"}


def test_full_actuation_drives_the_whole_control_with_identity_covariance() -> None:
    for index in range(4):
        body = make_embodiment(index, actuation="full")
        assert body.action_dim == FULL_ACTION_DIMS[index]
        m = body.control_map
        assert np.allclose(m @ m.T, np.eye(CONTROL_DIM))
    # the default world (the gauge experiment's) is unchanged: a subspace actuation
    assert make_embodiment(0).action_dim == 2


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"actuation": "both"}, "actuation"),
        ({"trajectories": 0}, "trajectories"),
        ({"steps": 0}, "steps"),
        ({"validation_trajectories": 0}, "validation_trajectories"),
    ],
)
def test_bad_data_settings_are_refused(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}"):
        participant_data(0, **kwargs)  # type: ignore[arg-type]


def test_the_tuned_local_only_cache_computes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = {**DATA, "validation_trajectories": 2}
    quick = Stopping(every=2, patience=1, max_steps=4)
    args = {"data_seed": 0, "init_seed": 0, "cache_dir": tmp_path, "stopping": quick}
    first = cache.tuned_local_only_result(1, data, CONFIG, **args)
    assert set(first) == {"lr", "step", "tune", "score"}
    assert first["lr"] in lr_grid(CONFIG) or first["lr"] < min(lr_grid(CONFIG))
    assert len(list((tmp_path / cache.SUBFOLDER).iterdir())) == 1
    calls = []
    monkeypatch.setattr(cache, "tuned_local_only", lambda *a, **k: calls.append(a))
    assert cache.tuned_local_only_result(1, data, CONFIG, **args) == first  # from the file
    assert calls == []
    monkeypatch.undo()
    # a corrupt entry is recomputed; other settings get another entry
    (path,) = (tmp_path / cache.SUBFOLDER).iterdir()
    path.write_text("{not json")
    assert cache.tuned_local_only_result(1, data, CONFIG, **args) == first
    cache.tuned_local_only_result(
        1, data, CONFIG, **{**args, "stopping": Stopping(every=4, patience=1, max_steps=8)}
    )
    assert len(list((tmp_path / cache.SUBFOLDER).iterdir())) == 2
    # one validation trajectory: nothing to split, refused before any file is written
    with pytest.raises(ConfigError, match=r"^validation-trajectories"):
        cache.tuned_local_only_result(1, DATA, CONFIG, **args)
    assert len(list((tmp_path / cache.SUBFOLDER).iterdir())) == 2


def test_the_default_cache_is_user_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.default_cache_dir() == tmp_path / "lensemble-flwr"
