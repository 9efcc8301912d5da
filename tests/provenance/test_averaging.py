"""``averaged_model``: an exponentially weighted average of a run's committed models
(post-processing: free under DP), read from the checkpoints the ledger commits to."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError, LedgerError
from lensemble_flwr.provenance.averaging import averaged_model
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.retention import checkpoints_of


def run(tmp: Path, rounds: int = 4, **retention: int) -> Ledger:
    base = small_config()
    config = LensembleConfig(
        federation=base.federation.model_dump(), inner=base.inner.model_dump(),
        retention=retention,
    )  # fmt: skip
    coordinator, network, _ = federation(tmp, config=config)
    coordinator.run(rounds)
    network.flush()
    return Ledger(coordinator.store)


def models(ledger: Ledger) -> list[dict[str, np.ndarray]]:
    store = ledger.store
    return [
        decode_checkpoint(store.get(checkpoints_of(store, r.round)[-1])).params
        for r in ledger.records()
    ]


def test_the_average_weighs_each_round_by_decay_to_its_age(tmp_path: Path) -> None:
    ledger = run(tmp_path)
    thetas = models(ledger)
    averaged = averaged_model(ledger.store, decay=0.5, last=3)
    assert averaged.rounds == (2, 3, 4)
    assert averaged.weights == pytest.approx((1 / 7, 2 / 7, 4 / 7))
    assert math.fsum(averaged.weights) == pytest.approx(1.0, abs=1e-15)
    for name, value in averaged.params.items():
        expected = sum(
            w * t[name].astype(np.float64)
            for w, t in zip(averaged.weights, thetas[-3:], strict=True)
        )
        assert value.dtype == thetas[-1][name].dtype
        np.testing.assert_allclose(value, expected, rtol=1e-6)
    newest = averaged_model(ledger.store, decay=0.0)  # the final model itself
    assert all(np.array_equal(newest.params[n], thetas[-1][n]) for n in thetas[-1])
    every = averaged_model(ledger.store, decay=0.9)
    assert every.rounds == (1, 2, 3, 4)


def test_bad_arguments_and_pruned_checkpoints_are_refused(tmp_path: Path) -> None:
    ledger = run(tmp_path, rounds=4, keep_last_checkpoints=2)
    for decay in (-0.1, 1.0, float("nan")):
        with pytest.raises(ConfigError, match="decay"):
            averaged_model(ledger.store, decay=decay)
    with pytest.raises(ConfigError, match="last"):
        averaged_model(ledger.store, decay=0.5, last=0)
    assert averaged_model(ledger.store, decay=0.5, last=2).rounds == (3, 4)
    with pytest.raises(LedgerError, match=r"round 2's checkpoint .* was pruned"):
        averaged_model(ledger.store, decay=0.5, last=3)


def test_a_run_without_a_closed_round_has_nothing_to_average(tmp_path: Path) -> None:
    ledger = run(tmp_path, rounds=0)
    with pytest.raises(LedgerError, match="no closed round"):
        averaged_model(ledger.store, decay=0.5)


def test_distributed_noise_refuses_the_prv_accountant() -> None:
    with pytest.raises(ConfigError, match="needs dp-accountant 'rdp'"):
        LensembleConfig(privacy={"dp_mode": "distributed", "dp_accountant": "prv"})
    LensembleConfig(privacy={"dp_mode": "local", "dp_accountant": "prv"})


def test_the_cli_writes_the_average_as_safetensors_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.numpy import load_file

    from lensemble_flwr.cli import main

    ledger = run(tmp_path)
    out = tmp_path / "published.safetensors"
    assert main(["average", str(ledger.store.root), "--out", str(out), "--last", "2"]) == 0
    assert "rounds 3-4" in capsys.readouterr().out
    expected = averaged_model(ledger.store, decay=0.8, last=2).params
    written = load_file(str(out))
    assert sorted(written) == sorted(expected)
    assert all(np.array_equal(written[n], expected[n]) for n in expected)
    assert out.stat().st_mode & 0o044  # readable by others, as an ordinary new file
    before = out.read_bytes()
    root = str(ledger.store.root)
    for bad in (["--decay", "1"], ["--decay", "nan"], ["--decay", "-0.5"], ["--last", "0"]):
        assert main(["average", root, "--out", str(out), *bad]) == 2, bad
    assert main(["average", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert main(["average", root, "--out", str(tmp_path / "no" / "x")]) == 2
    assert main(["average", root, "--out", str(tmp_path)]) == 2  # a directory
    pruned = run(tmp_path / "pruned", rounds=4, keep_last_checkpoints=2)
    assert main(["average", str(pruned.store.root), "--out", str(out), "--last", "3"]) == 1
    assert out.read_bytes() == before  # a refused command changed nothing
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_privacy_pages_averaging_snippet_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    section = page[page.index("### Publishing an average of the last models") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S)
    assert snippet is not None
    ledger = run(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "my-run").symlink_to(ledger.store.root)
    namespace: dict[str, object] = {}
    exec(compile(snippet.group(1), "privacy.md", "exec"), namespace)
    assert namespace["published"].rounds == (1, 2, 3, 4)  # type: ignore[attr-defined]


def test_a_round_whose_model_was_replaced_by_an_external_step_averages_the_adopted_model(
    tmp_path: Path,
) -> None:
    """Flower's central-DP wrapper hands back a noised model, adopted as an external step:
    that model, not the round's own, is what the next round trains from and what is
    averaged (also for the newest round, whose step is still pending)."""
    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    network.flush()
    adopted = {n: (a + 1.0).astype(a.dtype) for n, a in coordinator.global_state().params.items()}
    coordinator.adopt(adopted)
    newest = averaged_model(coordinator.store, decay=0.0)
    assert newest.rounds == (1, 2)
    assert all(np.array_equal(newest.params[n], adopted[n]) for n in adopted)
    coordinator.run(1)
    network.flush()
    both = averaged_model(coordinator.store, decay=0.5, last=2)
    thetas = models(Ledger(coordinator.store))
    for name, value in both.params.items():
        expected = (1 / 3) * adopted[name].astype(np.float64) + (2 / 3) * thetas[-1][name]
        np.testing.assert_allclose(value, expected, rtol=1e-6)


def test_a_pending_external_step_pointing_at_another_model_is_refused(tmp_path: Path) -> None:
    from lensemble_flwr.provenance.ledger import load_external_step, save_external_step

    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    network.flush()
    coordinator.adopt({n: a + 1.0 for n, a in coordinator.global_state().params.items()})
    step = load_external_step(coordinator.store)
    assert step is not None
    first = Ledger(coordinator.store).records()[0].checkpoint  # round 1's model instead
    save_external_step(coordinator.store, step.model_copy(update={"checkpoint": first}))
    # verify(), which averaged_model runs first, names the kept step
    with pytest.raises(LedgerError, match=r"external-step: round 2: checkpoint does not hold"):
        averaged_model(coordinator.store, decay=0.5)


def test_a_missing_pending_model_and_models_of_other_arrays_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lensemble_flwr.provenance import averaging
    from lensemble_flwr.provenance.ledger import load_external_step

    coordinator, network, _ = federation(tmp_path)
    coordinator.run(2)
    network.flush()
    store = coordinator.store
    coordinator.adopt({n: a + 1.0 for n, a in coordinator.global_state().params.items()})
    step = load_external_step(store)
    assert step is not None
    blob = store.root / "blobs" / step.checkpoint[:2] / step.checkpoint
    kept = blob.read_bytes()
    blob.unlink()  # gone without a prune marker: missing, not pruned
    with pytest.raises(LedgerError, match=r"external-step: round 2: checkpoint: unknown digest"):
        averaged_model(store, decay=0.5)
    blob.write_bytes(kept)
    decode = averaging.decode_checkpoint

    def one_array_more(data: bytes):  # type: ignore[no-untyped-def]
        checkpoint = decode(data)
        if checkpoint.params_hash == step.adopted_hash:
            return checkpoint
        params = {**checkpoint.params, "extra": np.zeros(1, np.float32)}
        return dataclasses.replace(checkpoint, params=params)

    monkeypatch.setattr(averaging, "decode_checkpoint", one_array_more)
    with pytest.raises(LedgerError, match="round 1's model has other arrays than round 2's"):
        averaged_model(store, decay=0.5)
