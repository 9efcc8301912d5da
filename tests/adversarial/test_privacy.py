"""Privacy side channels (issue 12, §7): under DP nothing data-dependent and un-noised
leaves a participant unless the configuration opts in; the dataset commitment hides the
records; the budget belongs to the participant, not to its data. Each test reproduces
what worked before and shows it now fails."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from federation_helpers import dp_config, federation, small_config
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.clients.app import default_evaluate, handle_evaluate, stable_identity
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.provenance.commitment_secret import read_commitment_secret
from lensemble_flwr.provenance.inclusion import prove_inclusion
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.merkle import merkle_root
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.lensemble import LensembleStrategy
from tests.strategies.test_grid_transport import (  # noqa: F401  (_serverapp_identity: autouse)
    NODES,
    FakeClock,
    FakeGrid,
    _serverapp_identity,
    clientapp_node,
)


# -- the dataset commitment ------------------------------------------------------------
class NeighbourTrainer(ToyTrainer):
    """ToyTrainer(1)'s dataset with its first record replaced: a neighbouring dataset."""

    def dataset_records(self):  # type: ignore[override]
        rows = list(super().dataset_records())
        return [b"a different first record", *rows[1:]]


def test_the_published_root_does_not_tell_neighbouring_datasets_apart(tmp_path: Path) -> None:
    """An adversary that knows every record but one used to compute the root of each
    candidate dataset and compare it with the ledger's (the leaves were unsalted). Now the
    leaves are salted under a secret that stays with the participant: the published root
    is the root of neither candidate, and the same data under another secret (another
    participant, or a new one) commits to an unrelated root."""
    coordinator, _, _ = federation(tmp_path, config=dp_config(tmp_path / "state"))
    coordinator.run(1)
    (record,) = Ledger(Store(tmp_path / "run")).records()
    published = record.dataset_roots["p01"]
    ours = list(ToyTrainer(1).dataset_records())
    neighbour = list(NeighbourTrainer(1).dataset_records())
    assert published not in {merkle_root(ours), merkle_root(neighbour)}
    secret = read_commitment_secret(tmp_path / "state", "p01")
    assert published == merkle_root(ours, secret)  # what the participant committed to
    assert merkle_root(ours, bytes(32)) != published
    # a proof bundle shows one record and that leaf's salt, never the secret
    bundle = prove_inclusion(ours, 3, participant_id="p01", secret=secret).to_json()
    assert secret.hex() not in bundle and json.loads(bundle)["salt"]


# -- the budget --------------------------------------------------------------------------
def test_new_data_does_not_reset_the_privacy_budget(tmp_path: Path) -> None:
    """The budget was keyed by the dataset root: one changed record gave a fresh budget
    (14.64 spent on the old root, 0.0 on the new). Now it is keyed by the participant's
    stable identity: the same participant with a neighbouring dataset keeps spending the
    same budget."""
    state = tmp_path / "state"
    config = dp_config(state)
    coordinator, _, _ = federation(tmp_path, config=config, name="first")
    coordinator.run(2)
    budget = PrivacyBudget(state, "participant-p01", epsilon=200.0, delta=1e-5)
    spent = budget.spent()
    assert spent > 0 and sum(n for _, _, n in budget.history) == 2
    # the same participant, its data changed by one record, in a new run
    from lensemble_flwr.participant.participant import Participant
    from lensemble_flwr.transports.inprocess import InProcessNetwork

    network = InProcessNetwork()
    again = Participant(
        config,
        participant_id="p01",
        transport=network.transport_for("p01"),
        trainer=NeighbourTrainer(1),
    )
    assert again.dataset_root != coordinator.registry.commitments["p01"].dataset_root
    from lensemble_flwr.protocol.state import GlobalState

    again.local_round(GlobalState.create(0, initial_params(), sketch_seed=1, h_steps=1), 5)
    after = PrivacyBudget(state, "participant-p01", epsilon=200.0, delta=1e-5)
    assert sum(n for _, _, n in after.history) == 3 and after.spent() > spent
    assert sorted(p.name for p in state.glob("*.json")) == [
        f"participant-p0{i}.json" for i in range(4)
    ]  # one budget per participant, none per dataset


def context(node_config: dict) -> Context:
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})


def test_a_flower_nodes_budget_is_keyed_by_a_name_that_survives_the_run(tmp_path: Path) -> None:
    """An unbound NumPyClient's budget was keyed by Flower's node id, new every run. Now a
    node is named by its node config (lensemble-id, else partition-id) or its identity
    key; under DP a node with none of them refuses to release (ConfigError), since its
    budget would restart with every run."""
    config = dp_config(tmp_path)
    assert stable_identity(context({"partition-id": 3}), config, None) == "partition-id-3"
    named = context({"lensemble-id": "hospital-a", "partition-id": 3})
    assert stable_identity(named, config, None) == "lensemble-id-hospital-a"
    with pytest.raises(ConfigError, match="stable identity"):
        stable_identity(context({}), config, None)
    assert stable_identity(context({}), small_config(), None) is None  # no DP: no budget


# -- un-noised metrics -------------------------------------------------------------------
def train_round(config: LensembleConfig, *, nodes_release_metrics: bool = False) -> list[Message]:
    """One round of the strategy's train instruction to four ClientApp nodes; their
    replies. ``nodes_release_metrics``: the nodes' own ``dp-release-metrics``."""
    clock = FakeClock()
    budget = {  # the nodes' own settings: a cap that covers the run's, their directory
        "dp-epsilon-cap": config.privacy.dp_epsilon,
        "dp-budget-dir": config.privacy.dp_state_dir,
        "dp-release-metrics": nodes_release_metrics,
    }
    contexts = {
        n: Context(
            run_id=1,
            node_id=n,
            node_config={"partition-id": i, **budget},
            state=RecordDict(),
            run_config={},
        )
        for i, n in enumerate(NODES)
    }
    grid = FakeGrid(clock, {n: clientapp_node(i, contexts[n], config) for i, n in enumerate(NODES)})
    strategy = LensembleStrategy(config, run_dir=Path(str(config.privacy.dp_state_dir)) / "run")
    arrays = records.arrays_to_record(initial_params())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    return list(grid.send_and_receive(messages, timeout=60))


@pytest.mark.parametrize(
    ("asked", "allowed"), [(False, False), (False, True), (True, True)],
    ids=["default", "node-allows-run-does-not-ask", "dp-release-metrics"],
)  # fmt: skip
def test_under_dp_no_train_loss_leaves_a_node_unless_opted_in(
    tmp_path: Path, asked: bool, allowed: bool
) -> None:
    """Each reply used to carry its node's un-noised train loss next to a DP release. Now
    it does only when the run asks and the node's own dp-release-metrics allows it."""
    config = dp_config(tmp_path, dp_release_metrics=asked)
    replies = train_round(config, nodes_release_metrics=allowed)
    assert replies and not any(r.has_error() for r in replies)
    metrics = [dict(r.content.metric_records[records.METRICS]) for r in replies]
    assert all("num-examples" in m for m in metrics)
    assert all(("last-batch-loss" in m) is asked for m in metrics)


def test_a_run_cannot_turn_on_a_nodes_metrics(tmp_path: Path) -> None:
    """A run's dp-release-metrics = true used to send every node's un-noised train loss
    under DP, whatever the node's operator wanted. Now a node that does not allow it
    refuses the run before it trains: every reply is an error naming both settings, and
    no budget is charged."""
    replies = train_round(dp_config(tmp_path, dp_release_metrics=True))
    assert replies and all(r.has_error() for r in replies)
    for reply in replies:
        assert "lensemble.dp-release-metrics" in reply.error.reason
        assert "node config dp-release-metrics is false" in reply.error.reason
    assert not list(tmp_path.glob("*.json"))  # nothing charged


def evaluate_message() -> Message:
    content = RecordDict({records.ARRAYS: records.arrays_to_record(initial_params())})
    message = Message(content, 7, MessageType.EVALUATE)
    message.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    return message


def test_under_dp_a_node_refuses_to_evaluate_and_the_strategy_does_not_ask(tmp_path: Path) -> None:
    """fraction_evaluate defaults to 1.0, so every node used to send its un-noised
    evaluation loss every round."""
    config = dp_config(tmp_path)
    own = {"dp-budget-dir": str(tmp_path), "dp-epsilon-cap": config.privacy.dp_epsilon}
    node = context(own)
    allowing = context(own | {"dp-release-metrics": True})

    class Evaluating(ToyTrainer):
        def evaluate(self, params):
            return 0.25, 0.5, 64

    for where in (node, allowing):  # the run does not ask
        reply = handle_evaluate(evaluate_message(), where, Evaluating(0), default_evaluate, config)
        assert reply.has_error() and "dp-release-metrics is off" in reply.error.reason
    opted = dp_config(tmp_path, dp_release_metrics=True)
    reply = handle_evaluate(evaluate_message(), node, Evaluating(0), default_evaluate, opted)
    assert reply.has_error()  # the run asks, the node does not allow it
    assert "node config dp-release-metrics is false" in reply.error.reason
    reply = handle_evaluate(evaluate_message(), allowing, Evaluating(0), default_evaluate, opted)
    assert not reply.has_error()
    grid = FakeGrid(FakeClock(), {n: lambda m: None for n in NODES})
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run")
    arrays = records.arrays_to_record(initial_params())
    assert list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid)) == []
    strategy = LensembleStrategy(opted, run_dir=tmp_path / "run2")
    assert len(list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))) == len(NODES)


def test_in_masked_rounds_no_per_node_metric_leaves_a_node_unless_opted_in() -> None:
    """The coordinator of a masked round is to learn only the sum; each node's train loss
    used to travel with its masked update."""
    from lensemble_flwr.config import metrics_released

    masked = LensembleConfig(federation={"secagg_threshold": 3, "min_participants": 3})
    assert not metrics_released(masked)
    opted = masked.model_copy(
        update={"privacy": masked.privacy.model_copy(update={"dp_release_metrics": True})}
    )
    assert metrics_released(opted) and metrics_released(small_config())


def test_a_budget_file_name_never_comes_raw_from_free_text(tmp_path: Path) -> None:
    from lensemble_flwr.participant.release_chain import budget_name
    from lensemble_flwr.provenance.commitment_secret import commitment_secret, secret_path

    assert budget_name("p01") == "participant-p01"
    for odd in ("../../etc/x", "a/b", "..", "lensemble-id-hospital a"):
        name = budget_name(odd)
        assert "/" not in name and name != "participant-.." and name.startswith("participant-")
    path = secret_path(tmp_path, "p01")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match="not a 32-byte secret"):
        commitment_secret(tmp_path, "p01")
    (tmp_path / "a-file").write_text("")  # a state dir that cannot be made
    with pytest.raises(ConfigError, match="cannot keep the commitment secret"):
        commitment_secret(tmp_path / "a-file" / "sub", "p02")
