"""The guards of the drop-in surface, each tripped: array layouts, broadcasts, node names,
protective run_config keys, averaged statistics, metric weights, sampling floors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from federation_helpers import federation, small_config
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from lensemble_flwr.config import LensembleConfig, OuterOptimizerConfig, ParamGroupsConfig
from lensemble_flwr.coordinator.outer_optimizer import outer_step, zero_momentum
from lensemble_flwr.errors import ConfigError, ParameterMismatch, ResidencyViolation
from lensemble_flwr.params import load_broadcast
from lensemble_flwr.participant.local_training import TorchTraining
from lensemble_flwr.simulations.toy import ToyTrainer
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.layout import ArrayLayout
from lensemble_flwr.strategies.node_names import NodeNames
from lensemble_flwr.strategies.reporting import weighted as _weighted
from tests.strategies.test_grid_transport import _serverapp_identity  # noqa: F401  (autouse: Message identity)


# -- ArrayLayout ---------------------------------------------------------------------------
def test_a_layout_keeps_the_order_and_refuses_a_model_with_nothing_to_federate() -> None:
    record = ArrayRecord(
        {"b": Array(np.ones(2, np.float32)), "count": Array(np.array(3)), "a": Array(np.ones(1))}
    )
    layout, federated = ArrayLayout.split(record)
    assert layout.order == ("b", "count", "a") and list(federated) == ["b", "a"]
    assert list(layout.to_record(federated).keys()) == ["b", "count", "a"]
    with pytest.raises(ParameterMismatch, match=r"missing \['a'\], unexpected \['z'\]"):
        layout.to_record({"b": np.ones(2, np.float32), "z": np.ones(1)})
    with pytest.raises(ParameterMismatch, match="no floating-point array"):
        ArrayLayout.split(ArrayRecord({"count": Array(np.array(3))}))


# -- a participant loads only a broadcast it may --------------------------------------------
class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(2, 2)
        self.head = nn.Linear(2, 1)
        self.register_buffer("steps", torch.tensor(0))


@pytest.mark.parametrize(
    ("arrays", "error", "match"),
    [
        ({"head.weight": np.zeros((1, 2), np.float32)}, ResidencyViolation, "local groups"),
        ({"nope": np.zeros(1, np.float32)}, ParameterMismatch, "no tensor named"),
        ({"steps": np.zeros((), np.float32)}, ParameterMismatch, "not shared floating-point"),
        ({"enc.bias": np.zeros(3, np.float32)}, ParameterMismatch, "shape"),
        ({"enc.bias": np.zeros(2, np.int64)}, ParameterMismatch, "floating-point array"),
    ],
)
def test_a_broadcast_the_model_cannot_take_is_refused_and_nothing_is_written(
    arrays: dict, error: type, match: str
) -> None:
    model, groups = Model(), ParamGroupsConfig(shared=("*",), local=("head",))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        load_broadcast(model, {"enc.weight": np.ones((2, 2), np.float32), **arrays}, groups)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_participant_whose_group_pattern_matches_nothing_is_refused_at_construction() -> None:
    config = LensembleConfig(groups={"shared": ("*",), "local": ("actionhead",)})
    with pytest.raises(ConfigError, match=r"local-groups: .*\['actionhead'\].*action_head"):
        TorchTraining(ToyTrainer(0), config)


def test_the_federated_names_survive_a_process_that_lives_for_one_message() -> None:
    config = LensembleConfig()
    training = TorchTraining(ToyTrainer(0), config)
    broadcast = {"encoder.weight": training.trainer.model.state_dict()["encoder.weight"].numpy()}
    training.fit(broadcast, steps=1, seed=0)
    state = training.export_state()
    assert "model/encoder.weight" not in state.arrays  # it is the coordinator's
    assert "model/action_head.weight" in state.arrays  # not broadcast: the node's own
    fresh = TorchTraining(ToyTrainer(0), config)
    fresh.import_state(state)
    assert fresh.federated == ["encoder.weight"]


# -- node names ----------------------------------------------------------------------------
def test_a_node_names_itself_once_and_a_connected_nodes_name_is_refused() -> None:
    names = NodeNames()
    assert names.learn(5, "partition-id-0") == "node-5"
    assert names.learn(5, "partition-id-0") is None  # the same name again: nothing new
    with pytest.raises(ValueError, match="is 'partition-id-0', not"):
        names.learn(5, "partition-id-1")
    with pytest.raises(ValueError, match="node 5's name"):
        names.learn(6, "partition-id-0", connected={5, 6})
    with pytest.raises(ValueError, match="not allow-listed"):
        names.learn(6, "partition-id-9", allowed={"partition-id-1"})
    with pytest.raises(ValueError, match="a name no node may take"):
        names.learn(6, "coordinator")
    # a restarted SuperNode has a new Flower id: the name of a node that left moves
    assert names.learn(7, "partition-id-0", connected={6, 7}) == "node-7"
    assert names.node_of("partition-id-0") == 7 and names.name_of(5) == "node-5"
    names.forget(7)
    assert names.name_of(7) == "node-7"


def test_a_node_that_answered_under_its_address_cannot_take_a_name_in_that_attempt(
    tmp_path: Path,
) -> None:
    coordinator, _, nodes = federation(tmp_path)
    attempt = coordinator.begin_attempt()
    coordinator.invite([n.participant_id for n in nodes])
    attempt.refused["p00"] = "ClientAppError: x"
    assert not coordinator.rename("p00", "partition-id-0")
    assert "p00" in attempt.invited and "partition-id-0" not in attempt.invited
    assert coordinator.rename("p01", "partition-id-1")
    assert "partition-id-1" in attempt.invited and "p01" not in attempt.invited


# -- run config ----------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["clip-norm", "secagg-threshold", "shared-groups", "quantize"])
def test_an_app_key_named_as_a_protective_lensemble_key_is_the_apps(key: str) -> None:
    """Only ``lensemble.`` keys are lensemble's (an app such as fl-dp-sa declares its own
    noise-multiplier): the app's key is not read, and lensemble's own key keeps its value.
    (``check_config`` notes such a key before a run: tests/simulations/test_check_config.py.)"""
    value = {"clip-norm": 1.0, "secagg-threshold": 3, "shared-groups": "enc", "quantize": "int8"}
    assert LensembleConfig.from_run_config({key: value[key]}) == LensembleConfig()


# -- averaged statistics -------------------------------------------------------------------
def test_running_statistics_take_plain_averaging_not_the_momentum_step() -> None:
    params = {"bn.running_var": np.ones(3, np.float32), "fc.weight": np.ones(3, np.float32)}
    delta = {name: np.full(3, -0.9, np.float32) for name in params}
    momentum = zero_momentum(params)
    config = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)
    groups = ParamGroupsConfig()
    averaged = {n for n in params if groups.is_averaged(n)}
    assert averaged == {"bn.running_var"}
    for _ in range(3):  # the mean of the local variances stays the mean: never below 0
        params, momentum = outer_step(params, momentum, delta, config, averaged=averaged)
        delta = {n: np.full(3, -0.9, np.float32) * params[n] for n in params}
    assert float(params["bn.running_var"].min()) >= 0.0
    assert not np.any(momentum["bn.running_var"])
    np.testing.assert_allclose(params["bn.running_var"], 0.1**3, rtol=1e-5)


# -- metrics -------------------------------------------------------------------------------
@pytest.mark.parametrize("weight", [0, -3, float("nan"), float("inf"), "many"])
def test_a_reply_with_an_unusable_weight_is_left_out_of_the_metrics(weight: object) -> None:
    content = RecordDict({"metrics": MetricRecord({"num-examples": 10})})
    assert _weighted(content, "num-examples")
    bad = RecordDict({"metrics": MetricRecord({"loss": 1.0})})
    if isinstance(weight, (int, float)):
        bad = RecordDict({"metrics": MetricRecord({"num-examples": weight, "loss": 1.0})})
    assert not _weighted(bad, "num-examples")


# -- named records -------------------------------------------------------------------------
def test_instruction_records_are_found_under_the_names_fedavg_uses_or_alone() -> None:
    arrays = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    content = RecordDict({"model": arrays, "hyper": ConfigRecord({"lr": 0.1})})
    assert records.named_or_only(content.array_records, "arrays") is arrays
    assert records.instruction_user_config(content) == {"lr": 0.1}
    two = RecordDict({"a": arrays, "b": arrays})
    assert records.named_or_only(two.array_records, "arrays") is None


# -- sampling floors -------------------------------------------------------------------------
def test_a_sample_is_not_drawn_before_k_participants_are_reachable(tmp_path: Path) -> None:
    config = small_config(min_participants=3, sample_fraction=0.5)
    coordinator, _, nodes = federation(tmp_path, participants=6, config=config)
    attempt = coordinator.begin_attempt()
    assert coordinator.invite([n.participant_id for n in nodes[:2]]) == []  # 2 < K = 3
    assert attempt.sample is None
    invited = coordinator.invite([n.participant_id for n in nodes])
    assert attempt.sample is not None and len(invited) == 3


def test_an_unmask_request_does_not_call_the_trainers_configure() -> None:
    """configure used to get {} from an unmask request: one reading config["lr"] raised,
    and a masked round could never unmask."""
    from flwr.app import Context, Message

    from lensemble_flwr.clients.app import handle_train

    class Configured(ToyTrainer):
        def configure(self, config: dict) -> None:
            raise AssertionError(f"configure called with {config}")

    content = records.encode_exchange(
        {"kind": "unmask_request", "run_id": "r", "round": 1, "attempt": 1,
         "sender": "coordinator", "survivors": ["a"], "dropped": [], "sealed": {}}
    )  # fmt: skip
    message = Message(content=content, dst_node_id=1, message_type="train")
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    reply = handle_train(message, context, Configured(0), LensembleConfig())
    assert reply.has_error()  # nothing to disclose; but no configure({}) crash
