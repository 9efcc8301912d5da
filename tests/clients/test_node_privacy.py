"""A Flower node's privacy budget is its owner's: the node config sets the cap, delta,
accountant and directory; a run's config only asks within them, and a new run on the same
node continues the same budget."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Error, RecordDict

from lensemble_flwr.clients.app import build_participant
from lensemble_flwr.clients.node_privacy import node_privacy, owner_from_node_config
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError, PrivacyBudgetExceeded, PrivacyBudgetRolledBack
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.privacy.ownership import DEFAULT_EPSILON_CAP, BudgetOwner, owned_config
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params

NOISE = 2.0  # one release spends epsilon 4.73 at delta 1e-5 (rdp, substitution), two 7.08


def run_config(**privacy: Any) -> dict[str, Any]:
    """A run's config asking for clipped, noised releases (``lensemble.`` keys)."""
    keys = {"clip-norm": 0.5, "noise-multiplier": NOISE, "dp-epsilon": 6.0, **privacy}
    return {f"lensemble.{k}": v for k, v in keys.items()} | {"lensemble.min-participants": 1}


def context(budgets: Path, run_id: int, run: dict[str, Any], **node: Any) -> Context:
    """A fresh Context of node 'hospital-a' in run ``run_id`` (Flower gives each run its own)."""
    node_config = {"lensemble-id": "hospital-a", "dp-budget-dir": str(budgets), **node}
    return Context(
        run_id=run_id, node_id=100 + run_id, node_config=node_config, state=RecordDict(),
        run_config=run,
    )  # fmt: skip


def build(ctx: Context) -> Participant | Error:
    config = LensembleConfig.from_run_config(ctx.run_config)
    return build_participant(ctx, ToyTrainer(0), config)


def release(participant: Participant) -> float:
    """One noised release from θ_0; the epsilon it reports."""
    state = GlobalState.create(0, initial_params(), sketch_seed=1, h_steps=2)
    epsilon = participant.local_round(state, round_seed=1).epsilon
    assert epsilon is not None
    return epsilon


def test_a_second_run_on_the_same_node_continues_its_budget(tmp_path: Path) -> None:
    """The issue's run: a first run spends, a second run (a fresh Context, another run id)
    on the same node finds that spent, and a run that raises dp-epsilon is refused."""
    budgets = tmp_path / "node-budgets"
    first = build(context(budgets, 1, run_config(), **{"dp-epsilon-cap": 6.0}))
    assert isinstance(first, Participant)
    assert release(first) == pytest.approx(4.729, abs=0.01)
    second = build(context(budgets, 2, run_config(), **{"dp-epsilon-cap": 6.0}))
    assert isinstance(second, Participant)
    with pytest.raises(PrivacyBudgetExceeded, match=r"7\.077 > budget 6"):
        release(second)  # a fresh budget would have allowed it
    asks_more = run_config(**{"dp-epsilon": 100.0})
    raised = build(context(budgets, 3, asks_more, **{"dp-epsilon-cap": 6.0}))
    assert isinstance(raised, Error)
    assert "epsilon 100" in raised.reason and "cap 6 (node config dp-epsilon-cap)" in raised.reason
    assert [p.name for p in budgets.glob("*.json")] == ["participant-lensemble-id-hospital-a.json"]


def test_a_run_asking_more_than_the_nodes_cap_is_refused_before_anything(tmp_path: Path) -> None:
    budgets = tmp_path / "node-budgets"
    built = build(context(budgets, 1, run_config(**{"dp-epsilon": 8.0}), **{"dp-epsilon-cap": 5}))
    assert isinstance(built, Error)
    assert "lensemble.dp-epsilon" in built.reason
    assert "asks for epsilon 8" in built.reason and "cap 5" in built.reason
    assert not budgets.exists()  # nothing charged, no commitment secret made


def test_a_node_without_settings_has_a_cap_of_its_own(tmp_path: Path) -> None:
    ctx = context(tmp_path, 1, run_config(**{"dp-epsilon": DEFAULT_EPSILON_CAP + 1}))
    built = build(ctx)
    assert isinstance(built, Error) and f"cap {DEFAULT_EPSILON_CAP:g}" in built.reason
    assert node_privacy(ctx) == BudgetOwner(budget_dir=str(tmp_path))


def test_a_run_cannot_move_the_nodes_budget(tmp_path: Path) -> None:
    budgets = tmp_path / "node-budgets"
    elsewhere = tmp_path / "fresh"
    built = build(context(budgets, 1, run_config(**{"dp-state-dir": str(elsewhere)})))
    assert isinstance(built, Error)
    assert str(elsewhere) in built.reason and str(budgets) in built.reason
    assert "cannot move" in built.reason
    assert not elsewhere.exists() and not budgets.exists()
    # naming the node's own directory is no request to move it
    same = build(context(budgets, 1, run_config(**{"dp-state-dir": str(budgets) + "/."})))
    assert isinstance(same, Participant)


@pytest.mark.parametrize(
    ("run", "node", "named"),
    [
        ({"dp-delta": 1e-3}, {"dp-delta": 1e-5}, ["delta 0.001", "delta 1e-05", "dp-delta"]),
        ({"dp-accountant": "prv"}, {}, ["'prv'", "'rdp'", "dp-accountant"]),
        ({}, {"dp-accountant": "prv"}, ["'rdp'", "'prv'", "dp-accountant"]),
    ],
)
def test_a_run_asking_another_delta_or_accountant_is_refused(
    tmp_path: Path, run: dict[str, Any], node: dict[str, Any], named: list[str]
) -> None:
    built = build(context(tmp_path / "b", 1, run_config(**run), **node))
    assert isinstance(built, Error)
    assert all(text in built.reason for text in named), built.reason


@pytest.mark.parametrize(
    ("node", "key", "match"),
    [
        ({"dp-epsilon": 100.0}, "dp-epsilon", "did you mean 'dp-epsilon-cap'"),
        ({"dp-epsilon-cap": "ten"}, "dp-epsilon-cap", "is not a number"),
        ({"dp-epsilon-cap": True}, "dp-epsilon-cap", "is not a number"),
        ({"dp-epsilon-cap": 0.0}, "dp-epsilon-cap", "positive finite"),
        ({"dp-epsilon-cap": float("inf")}, "dp-epsilon-cap", "positive finite"),
        ({"dp-delta": 1.0}, "dp-delta", r"not in \(0, 1\)"),
        ({"dp-accountant": "gdp"}, "dp-accountant", "unknown accountant"),
        ({"dp-budget-dir": 3}, "dp-budget-dir", "is not text"),
    ],
)
def test_a_bad_node_setting_is_refused_naming_its_key(
    node: dict[str, Any], key: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        owner_from_node_config(node)
    assert caught.value.field == f"node config {key}"


def test_the_node_config_sets_the_budget(tmp_path: Path) -> None:
    owner = owner_from_node_config(
        {"partition-id": 3, "dp-epsilon-cap": 4, "dp-delta": 1e-6, "dp-accountant": "prv",
         "dp-budget-dir": str(tmp_path)}
    )  # fmt: skip
    assert owner == BudgetOwner(4.0, 1e-6, "prv", str(tmp_path))
    config = LensembleConfig.from_run_config(
        run_config(**{"dp-epsilon": 3.0, "dp-delta": 1e-6, "dp-accountant": "prv"})
    )
    assert owned_config(config, owner).privacy.dp_state_dir == str(tmp_path)


def test_a_budget_file_rolled_back_between_releases_is_refused_locally(tmp_path: Path) -> None:
    """The node keeps its last charge (in its participant state, Context.state on Flower):
    a budget file that holds less at the next release is refused, and nothing is charged."""
    budgets = tmp_path / "node-budgets"
    ctx = context(budgets, 1, run_config(**{"dp-epsilon": 9.5}), **{"dp-epsilon-cap": 9.5})
    participant = build(ctx)
    assert isinstance(participant, Participant)
    path = budgets / "participant-lensemble-id-hospital-a.json"
    release(participant)
    kept = path.read_bytes()  # one release recorded
    release(participant)
    path.write_bytes(kept)  # rolled back by one release
    with pytest.raises(PrivacyBudgetRolledBack, match=r"records 1 releases .* charged 2"):
        release(participant)
    assert path.read_bytes() == kept
    path.unlink()  # deleted
    with pytest.raises(PrivacyBudgetRolledBack, match="records 0 releases"):
        release(participant)
    assert not path.exists()
    shutil.rmtree(budgets)  # the whole directory: the same
    with pytest.raises(PrivacyBudgetRolledBack):
        release(participant)


def test_an_apps_node_privacy_fn_cannot_raise_what_the_node_config_sets() -> None:
    from lensemble_flwr.clients.node_privacy import bounded_by_node_config

    generous = BudgetOwner(epsilon_cap=1000.0, delta=1e-6, accountant="prv", budget_dir="/a")
    node = {"dp-epsilon-cap": 8.0, "dp-budget-dir": "/b"}
    bounded = bounded_by_node_config(generous, node)
    assert bounded.epsilon_cap == 8.0 and bounded.budget_dir == "/b"
    assert (bounded.delta, bounded.accountant) == (1e-6, "prv")  # not set by the node
    assert bounded_by_node_config(generous, {"partition-id": 0}) == generous
    stricter = BudgetOwner(epsilon_cap=2.0)
    assert bounded_by_node_config(stricter, node).epsilon_cap == 2.0
    with pytest.raises(ConfigError, match="dp-epsilon-cap"):
        bounded_by_node_config(generous, {"dp-epsilon-cap": "lots"})


# -- the adjacency and per-node metrics are the node's too ------------------------------
def test_a_run_cannot_halve_the_noise_by_choosing_zero_out(tmp_path: Path) -> None:
    """A run's dp-adjacency = 'zero-out' used to be taken as asked: the first run on a
    node fixed its budget file's adjacency, so a run could halve the noise per epsilon of
    that node for good. Now the adjacency is the node's: a run asking another is refused
    before anything is charged, naming both; a node that chose zero-out keeps it."""
    budgets = tmp_path / "node-budgets"
    zero_out = run_config(**{"dp-adjacency": "zero-out"})
    refused = build(context(budgets, 1, zero_out))
    assert isinstance(refused, Error)
    for text in ("lensemble.dp-adjacency", "'zero-out'", "'substitution'",
                 "node config dp-adjacency"):  # fmt: skip
        assert text in refused.reason, refused.reason
    assert not budgets.exists()  # nothing charged, no file that fixes an adjacency
    chosen = build(context(budgets, 2, zero_out, **{"dp-adjacency": "zero-out"}))
    assert isinstance(chosen, Participant)
    release(chosen)
    path = budgets / "participant-lensemble-id-hospital-a.json"
    assert '"adjacency": "zero-out"' in path.read_text()
    back = build(context(budgets, 3, run_config(), **{"dp-adjacency": "zero-out"}))
    assert isinstance(back, Error) and "asks for 'substitution' adjacency" in back.reason


@pytest.mark.parametrize(
    ("federation", "privacy"),
    [({}, {"clip-norm": 0.5, "noise-multiplier": NOISE, "dp-epsilon": 6.0}),
     ({"secagg-threshold": 2, "min-participants": 2}, {})],
    ids=["noised", "masked"],
)  # fmt: skip
def test_a_run_cannot_turn_on_un_noised_metrics_the_node_does_not_release(
    tmp_path: Path, federation: dict[str, Any], privacy: dict[str, Any]
) -> None:
    """A run's dp-release-metrics = true used to turn on sending each node's un-noised
    train loss and evaluation metrics under DP (or in masked rounds). Now the node's own
    dp-release-metrics must allow it: a run that asks on a node that does not is refused,
    naming both; one that does not ask, or a node that allows it, goes on."""
    keys = {**federation, **privacy, "dp-release-metrics": True}
    asks = LensembleConfig.from_run_config({f"lensemble.{k}": v for k, v in keys.items()})
    node = owner_from_node_config({"dp-budget-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="node config dp-release-metrics is false") as caught:
        owned_config(asks, node)
    assert caught.value.field == "lensemble.dp-release-metrics"
    assert "dp-release-metrics = true" in str(caught.value)
    allowing = owner_from_node_config({"dp-budget-dir": str(tmp_path), "dp-release-metrics": True})
    assert owned_config(asks, allowing).privacy.dp_release_metrics
    quiet = asks.model_copy(update={"privacy": asks.privacy.model_copy(
        update={"dp_release_metrics": False})})  # fmt: skip
    owned_config(quiet, node)


def test_without_dp_or_masking_the_metrics_setting_asks_nothing_of_the_node(tmp_path: Path) -> None:
    """Per-node metrics are sent anyway in a plain run: the flag changes nothing there."""
    plain = LensembleConfig.from_run_config({"lensemble.dp-release-metrics": True})
    owned_config(plain, BudgetOwner(budget_dir=str(tmp_path)))


@pytest.mark.parametrize(
    ("node", "key", "match"),
    [
        ({"dp-adjacency": "add-remove"}, "dp-adjacency", "unknown adjacency 'add-remove'"),
        ({"dp-adjacency": 1}, "dp-adjacency", "is not text"),
        ({"dp-release-metrics": "yes"}, "dp-release-metrics", "is not true or false"),
        ({"dp-release-metrics": 1}, "dp-release-metrics", "is not true or false"),
        ({"dp-release-metric": True}, "dp-release-metric", "did you mean 'dp-release-metrics'"),
    ],
)
def test_a_bad_adjacency_or_metrics_setting_is_refused_naming_its_key(
    node: dict[str, Any], key: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        owner_from_node_config(node)
    assert caught.value.field == f"node config {key}"


def test_the_node_config_bounds_an_apps_adjacency_and_metrics() -> None:
    from lensemble_flwr.clients.node_privacy import bounded_by_node_config

    app = BudgetOwner(adjacency="zero-out", release_metrics=True)
    assert bounded_by_node_config(app, {"partition-id": 1}) == app  # nothing set: the app's
    bounded = bounded_by_node_config(
        app, {"dp-adjacency": "substitution", "dp-release-metrics": False}
    )
    assert (bounded.adjacency, bounded.release_metrics) == ("substitution", False)
    assert bounded.named("adjacency") == "node config dp-adjacency"
    assert bounded.named("release_metrics") == "node config dp-release-metrics"
    # a node that allows metrics cannot make an app that does not release them
    quiet = bounded_by_node_config(BudgetOwner(), {"dp-release-metrics": True})
    assert not quiet.release_metrics
    assert quiet.named("release_metrics") == "release_metrics from the app's node_privacy_fn"


def test_messages_name_where_each_setting_came_from(tmp_path: Path) -> None:
    """A value an app's node_privacy_fn set used to be called 'node config ...' in the
    refusal, sending the operator to a node config that set nothing. Now each value is
    named by where it was set: the node config's keys, or the app's function."""
    from lensemble_flwr.clients.app import node_owner
    from lensemble_flwr.clients.node_privacy import bounded_by_node_config

    app = BudgetOwner(epsilon_cap=5.0, budget_dir=str(tmp_path))
    asks = LensembleConfig.from_run_config(run_config(**{"dp-epsilon": 6.0, "dp-delta": 1e-6}))
    for node_config, named in [
        ({}, "cap 5 (epsilon_cap from the app's node_privacy_fn)"),
        ({"dp-epsilon-cap": 100.0}, "cap 5 (epsilon_cap from the app's node_privacy_fn)"),
        ({"dp-epsilon-cap": 4.0}, "cap 4 (node config dp-epsilon-cap)"),
    ]:
        with pytest.raises(ConfigError) as caught:
            owned_config(asks, bounded_by_node_config(app, node_config))
        assert named in str(caught.value), str(caught.value)
    wide = BudgetOwner(epsilon_cap=50.0, budget_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"delta 1e-05 \(delta from the app's node_privacy_fn\)"):
        owned_config(asks, bounded_by_node_config(wide, {}))
    with pytest.raises(ConfigError, match=r"delta 1e-05 \(node config dp-delta\)"):
        owned_config(asks, bounded_by_node_config(wide, {"dp-delta": 1e-5}))
    ctx = context(tmp_path, 1, {}, **{"dp-epsilon-cap": 4.0})
    through_app = node_owner(ctx, lambda _: app)  # what make_client_app's handlers use
    assert through_app.epsilon_cap == 4.0 and through_app.budget_dir == str(tmp_path)
    assert through_app.named("epsilon_cap") == "node config dp-epsilon-cap"
    with pytest.raises(ConfigError, match="epsilon_cap from the app's node_privacy_fn"):
        BudgetOwner(epsilon_cap=-1.0)
