"""LensembleStrategy in place of FedAvg with a Flower user's own app, unchanged (no Ray).

The apps here are written the way Flower's quickstarts write them — a CNN (with and
without BatchNorm) whose ``train`` loads ``arrays.to_torch_state_dict()`` strictly and
replies ``arrays`` + ``metrics{train_loss, num-examples}``; a NumPyClient whose setter is
``zip(state_dict().keys(), parameters)``; an app with Flower's ``fixedclipping_mod`` — and
the strategy is driven by its own ``start`` and by Flower's ``Strategy.start`` loop.
"""

from __future__ import annotations

import itertools
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from torch import nn

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.clients import wrap_numpy_client
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import ConfigError, ParameterMismatch
from lensemble_flwr.provenance.audit import audit_run
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.strategies import LensembleStrategy
from lensemble_flwr.strategies.grid_transport import GridTransport
from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
)

NODES = (21, 22, 23, 24)


class Net(nn.Module):
    """A small CNN on 8x8 images, optionally with BatchNorm (an integer buffer)."""

    def __init__(self, batch_norm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4) if batch_norm else nn.Identity()
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn1(self.conv1(x))).flatten(1))


def node_data(node: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(node)
    x = torch.randn(24, 1, 8, 8, generator=gen)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return x, y


def train_locally(model: Net, node: int, lr: float, steps: int = 3) -> float:
    x, y = node_data(node)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return float(loss)


def quickstart_app(batch_norm: bool, mods: list | None = None) -> ClientApp:
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net(batch_norm)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # strict
        loss = train_locally(model, context.node_id, float(msg.content["config"]["lr"]))
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"train_loss": loss, "num-examples": 24}),
            }
        )
        return Message(content=content, reply_to=msg)

    return app


def grid_of(app: ClientApp) -> FakeGrid:
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in NODES
    }
    return FakeGrid(FakeClock(), {n: (lambda m, n=n: app(m, contexts[n])) for n in NODES})


def fedavg_config(**federation: object) -> LensembleConfig:
    return LensembleConfig(
        federation={"min_participants": 4, "open_timeout": 10.0, "collect_timeout": 10.0,
                    "retry_wait": 0.0, **federation},
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
    )  # fmt: skip


@pytest.mark.parametrize("batch_norm", [False, True], ids=["cnn", "cnn+batchnorm"])
def test_a_stock_clientapp_runs_unchanged_and_gets_its_arrays_back_in_its_order(
    tmp_path: Path, batch_norm: bool
) -> None:
    initial = ArrayRecord(Net(batch_norm).state_dict())
    strategy = LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0)
    grid = grid_of(quickstart_app(batch_norm))
    result = strategy.start(
        grid=grid, initial_arrays=initial, num_rounds=2, train_config=ConfigRecord({"lr": 0.1})
    )
    assert list(result.arrays.keys()) == list(Net(batch_norm).state_dict().keys())
    assert [result.train_metrics_clientapp[r]["lensemble.C_t"] for r in (1, 2)] == [4.0, 4.0]
    # what the nodes were sent is the user's layout too (the quickstart loads it strictly)
    sent = grid.pushed()[0].content["arrays"]
    assert list(sent.keys()) == list(initial.keys())
    final = result.arrays.to_torch_state_dict()
    if batch_norm:
        # a count is carried as it was given: not averaged, not stepped, still an integer
        assert final["bn1.num_batches_tracked"].dtype == torch.int64
        assert int(final["bn1.num_batches_tracked"]) == 0
        # floating buffers (running statistics) are averaged, as FedAvg does
        assert not torch.equal(final["bn1.running_mean"], torch.zeros(4))
    model = Net(batch_norm)
    model.load_state_dict(final)  # strict: the user's model takes the result as it is


def test_a_numpy_client_with_the_usual_state_dict_setter_gets_the_list_in_model_order(
    tmp_path: Path,
) -> None:
    seen: list[list[str]] = []

    class Client(NumPyClient):
        def __init__(self, node: int) -> None:
            self.node, self.model = node, Net(batch_norm=True)

        def set_parameters(self, parameters: list[np.ndarray]) -> None:
            keys = list(self.model.state_dict().keys())
            state = OrderedDict({k: torch.tensor(v) for k, v in zip(keys, parameters, strict=True)})
            self.model.load_state_dict(state, strict=True)

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            seen.append([p.shape for p in parameters])
            self.set_parameters(parameters)
            loss = train_locally(self.model, self.node, 0.1)
            params = [v.cpu().numpy() for v in self.model.state_dict().values()]
            return params, 24, {"train_loss": loss}

    config = fedavg_config()
    through_mod: list[str] = []

    def recording_mod(msg: Message, context: Context, call_next):  # type: ignore[no-untyped-def]
        through_mod.append(msg.metadata.message_type)  # a mod the user gives (e.g. DP's)
        return call_next(msg, context)

    app = wrap_numpy_client(
        lambda context: Client(context.node_id).to_client(),
        config_fn=lambda c: config,
        mods=[recording_mod],
    )
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0)
    initial = ArrayRecord(Net(batch_norm=True).state_dict())
    result = strategy.start(grid=grid_of(app), initial_arrays=initial, num_rounds=2)
    shapes = [tuple(v.shape) for v in Net(batch_norm=True).state_dict().values()]
    assert seen and all(list(map(tuple, s)) == shapes for s in seen)
    assert through_mod == ["train"] * 8  # every train message went through the mod
    assert result.train_metrics_clientapp[2]["lensemble.C_t"] == 4.0
    assert list(result.arrays.keys()) == list(initial.keys())


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_flowers_client_side_clipping_wrapper_and_its_mod(tmp_path: Path, noise: float) -> None:
    """fixedclipping_mod accepts every instruction and clips every update; the wrapper's
    central noise, added after lensemble committed each round, is what the next round
    trains from, recorded as that round's external step."""
    strategy = LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0)
    wrapped = DifferentialPrivacyClientSideFixedClipping(
        strategy, noise_multiplier=noise, clipping_norm=0.05, num_sampled_clients=4
    )
    initial = ArrayRecord(Net(batch_norm=True).state_dict())
    grid = grid_of(quickstart_app(batch_norm=True, mods=[fixedclipping_mod]))
    result = Strategy.start(
        wrapped, grid=grid, initial_arrays=initial, num_rounds=3,
        train_config=ConfigRecord({"lr": 0.1}),
    )  # fmt: skip
    assert not any(reply.has_error() for _, reply in grid.delivered)  # the mod accepted all
    assert [result.train_metrics_clientapp[r]["lensemble.C_t"] for r in (1, 2, 3)] == [4.0] * 3
    records = verify(Store(tmp_path / "run"))
    steps = [r.external_step for r in records]
    if noise == 0:
        assert steps == [None, None, None]
        # every update was clipped by the mod on the node: each step is at most the clip
        before = {k: v.numpy() for k, v in initial.items()}
        after = {k: v.numpy() for k, v in result.arrays.items()}
        floats = [k for k in before if after[k].dtype.kind == "f" and "running" not in k]
        step = np.sqrt(sum(float(np.sum((after[k] - before[k]) ** 2)) for k in floats))
        assert step <= 3 * 0.05 * (1 + 1e-5)
        return
    # rounds 2 and 3 trained from the noised models
    assert steps[0] is None and all(s is not None and s.change_norm > 0 for s in steps[1:])
    for before, after in itertools.pairwise(records):
        assert after.external_step.committed_hash == before.new_global_hash
        assert after.previous_global_hash == after.external_step.adopted_hash
    assert audit_run(tmp_path / "run").ok


def test_flowers_server_side_clipping_wrapper_with_and_without_noise(tmp_path: Path) -> None:
    initial = ArrayRecord(Net(batch_norm=False).state_dict())
    for noise, name in [(0.0, "a"), (1.0, "b")]:
        grid = grid_of(quickstart_app(False))
        wrapped = DifferentialPrivacyServerSideFixedClipping(
            LensembleStrategy(fedavg_config(), run_dir=tmp_path / name, fraction_evaluate=0),
            noise_multiplier=noise, clipping_norm=0.05, num_sampled_clients=4,
        )  # fmt: skip
        result = Strategy.start(
            wrapped, grid=grid, initial_arrays=initial, num_rounds=3,
            train_config=ConfigRecord({"lr": 0.1}),
        )  # fmt: skip
        assert [result.train_metrics_clientapp[r]["lensemble.C_t"] for r in (1, 2, 3)] == [4.0] * 3
        assert list(result.arrays.keys()) == list(initial.keys())
        records = verify(Store(tmp_path / name))
        assert [r.external_step is not None for r in records] == [False, noise > 0, noise > 0]
        if noise > 0:
            # what the nodes were sent in round 2 is the noised model the wrapper returned
            sent = [m for m in grid.pushed() if m.content["config"]["lensemble.round"] == 2]
            adopted = records[1].external_step.adopted_hash
            assert sent and {m.content["config"]["lensemble.global_hash"] for m in sent} == {
                adopted
            }
            assert records[1].previous_global_hash == adopted


def test_a_wrapper_that_breaks_the_model_is_refused_with_nothing_changed(tmp_path: Path) -> None:
    """A post-aggregation step that puts NaN into the model stops the run before any node
    is sent it; the committed rounds stay as they were."""

    class Breaking(DifferentialPrivacyServerSideFixedClipping):
        def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
            arrays, metrics = super().aggregate_train(server_round, replies)
            broken = {k: v.numpy().copy() for k, v in arrays.items()}
            broken["fc.bias"][0] = np.nan
            return ArrayRecord({k: Array(v) for k, v in broken.items()}), metrics

    wrapped = Breaking(
        LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0),
        noise_multiplier=0.0, clipping_norm=0.05, num_sampled_clients=4,
    )  # fmt: skip
    grid = grid_of(quickstart_app(False))
    with pytest.raises(ParameterMismatch, match=r"non-finite values in \['fc.bias'\]"):
        Strategy.start(
            wrapped, grid=grid, initial_arrays=ArrayRecord(Net(False).state_dict()),
            num_rounds=3, train_config=ConfigRecord({"lr": 0.1}),
        )  # fmt: skip
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1]
    assert {m.content["config"]["lensemble.round"] for m in grid.pushed()} == {1}


@pytest.mark.parametrize(
    ("shared", "complaint"),
    [
        # a pattern that matches nothing: the patterns and the model's names are named
        (("encoder", "conv1"), r"shared-groups: .*\['encoder'\].*conv1\.weight"),
        # names in no shared group are named
        (("conv1",), r"\['fc\.bias', 'fc\.weight'\].*none of the shared"),
    ],
    ids=["unmatched-pattern", "unshared-names"],
)
def test_groups_that_do_not_fit_the_model_are_refused_naming_them(
    tmp_path: Path, shared: tuple[str, ...], complaint: str
) -> None:
    strategy = LensembleStrategy(LensembleConfig(groups={"shared": shared}), run_dir=tmp_path)
    with pytest.raises(ConfigError, match=complaint):
        strategy.start(
            grid=grid_of(quickstart_app(False)),
            initial_arrays=ArrayRecord(Net(False).state_dict()),
            num_rounds=1,
        )


def test_the_clients_own_metrics_are_aggregated_as_fedavg_does_and_bookkeeping_is_prefixed(
    tmp_path: Path,
) -> None:
    strategy = LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0)
    grid = grid_of(quickstart_app(batch_norm=False))
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(Net(False).state_dict()), num_rounds=1,
        train_config=ConfigRecord({"lr": 0.1}),
    )  # fmt: skip
    metrics = result.train_metrics_clientapp[1]
    losses = [
        float(reply.content["metrics"]["train_loss"])
        for instruction, reply in grid.delivered
        if instruction.metadata.message_type == "train"
    ]
    assert metrics["train_loss"] == pytest.approx(sum(losses) / len(losses))  # equal weights
    assert "num-examples" not in metrics  # the weighting key is not averaged, as in FedAvg
    assert metrics["lensemble.C_t"] == 4.0 and metrics["lensemble.exchanges"] == 1.0


def test_the_bytes_a_round_reports_are_its_own_not_the_runs_so_far(tmp_path: Path) -> None:
    strategy = LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0)
    result = strategy.start(
        grid=grid_of(quickstart_app(batch_norm=False)),
        initial_arrays=ArrayRecord(Net(False).state_dict()),
        num_rounds=3,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    for key, total in (("sent", "bytes_sent"), ("received", "bytes_received")):
        per_round = [result.train_metrics_clientapp[r][f"lensemble.bytes-{key}"] for r in (1, 2, 3)]
        # the same model to and from the same four nodes every round: about the same bytes
        assert min(per_round) > 0 and max(per_round) < 1.1 * min(per_round), (key, per_round)
        assert sum(per_round) == getattr(strategy.transport.traffic, total)  # the run's, exactly


def test_a_run_that_fails_leaves_no_prepared_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator makes its commit's temp files while it waits for replies; a run
    that stops with an error removes the ones no write took."""
    real = Coordinator.conclude

    def conclude(self: Coordinator, *args: object, **kwargs: object) -> object:
        if self.global_state().next_round == 2:
            raise RuntimeError("test: the coordinator fails in round 2")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Coordinator, "conclude", conclude)
    strategy = LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0)
    with pytest.raises(RuntimeError, match="fails in round 2"):
        strategy.start(
            grid=grid_of(quickstart_app(batch_norm=False)),
            initial_arrays=ArrayRecord(Net(False).state_dict()),
            num_rounds=3,
            train_config=ConfigRecord({"lr": 0.1}),
        )
    assert strategy.coordinator is not None and strategy.coordinator.global_state().round == 1
    assert list((tmp_path / "run" / "tmp").iterdir()) == []


def test_a_custom_metrics_aggregation_and_weighting_key_are_used(tmp_path: Path) -> None:
    calls: list[tuple[int, str]] = []

    def total(contents: list[RecordDict], key: str) -> MetricRecord:
        calls.append((len(contents), key))
        return MetricRecord({"nodes": len(contents)})

    strategy = LensembleStrategy(
        fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0,
        weighted_by_key="num-examples", train_metrics_aggr_fn=total,
    )  # fmt: skip
    result = strategy.start(
        grid=grid_of(quickstart_app(False)), initial_arrays=ArrayRecord(Net(False).state_dict()),
        num_rounds=1, train_config=ConfigRecord({"lr": 0.1}),
    )  # fmt: skip
    assert calls == [(4, "num-examples")]
    assert result.train_metrics_clientapp[1]["nodes"] == 4


def test_the_users_train_config_reaches_a_numpy_client_and_a_trainer(tmp_path: Path) -> None:
    seen: list[dict] = []

    class Client(NumPyClient):
        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            seen.append(dict(config))
            model = Net(False)
            keys = list(model.state_dict().keys())
            model.load_state_dict(
                {k: torch.tensor(v) for k, v in zip(keys, parameters, strict=True)}
            )
            train_locally(model, 1, float(config["lr"]))  # a KeyError here used to fail
            return [v.numpy() for v in model.state_dict().values()], 24, {}

    config = fedavg_config()
    app = wrap_numpy_client(lambda context: Client().to_client(), config_fn=lambda c: config)
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0)
    result = strategy.start(
        grid=grid_of(app), initial_arrays=ArrayRecord(Net(False).state_dict()), num_rounds=1,
        train_config=ConfigRecord({"lr": 0.05}),
    )  # fmt: skip
    assert result.train_metrics_clientapp[1]["lensemble.C_t"] == 4.0
    assert all(c["lr"] == 0.05 and c["server-round"] == 1 for c in seen)
    assert all(c["lensemble.local-steps"] == config.inner.steps for c in seen)
    assert all("lensemble.seed" in c for c in seen)


def test_a_trainer_with_configure_gets_the_users_train_config(tmp_path: Path) -> None:
    from lensemble_flwr.clients import make_client_app
    from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
    from lensemble_flwr.strategies.records import arrays_to_record

    seen: list[dict] = []

    class Configured(ToyTrainer):
        def configure(self, config: dict) -> None:
            seen.append(config)

    config = fedavg_config()
    app = make_client_app(lambda context: Configured(context.node_id), config_fn=lambda c: config)
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0)
    strategy.start(
        grid=grid_of(app), initial_arrays=arrays_to_record(initial_params()), num_rounds=1,
        train_config=ConfigRecord({"lr": 0.05}),
    )  # fmt: skip
    assert seen and all(c == {"lr": 0.05, "server-round": 1} for c in seen)


def test_progress_goes_through_flowers_logger_like_fedavgs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0)
    with caplog.at_level("INFO", logger="flwr"):
        result = strategy.start(
            grid=grid_of(quickstart_app(False)),
            initial_arrays=ArrayRecord(Net(False).state_dict()),
            num_rounds=2,
            train_config=ConfigRecord({"lr": 0.1}),
            evaluate_fn=lambda r, arrays: MetricRecord({"central_loss": 0.5 / (r + 1)}),
        )
    flower = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    assert "[ROUND 1/2]" in flower and "[ROUND 2/2]" in flower
    assert any("round 2: open→" in m and "C_t=4" in m for m in flower)  # lensemble's line
    assert sum("Aggregated MetricRecord" in m for m in flower) == 2
    assert any("update weighting uniform (FedAvg's: num-examples)" in m for m in flower)
    # the server-side evaluation and the closing summary, with FedAvg's lines
    assert any(m.startswith("Initial global evaluation results: ") for m in flower)
    assert flower.count("Global evaluation") == 2
    assert sum("MetricRecord: {'central_loss': " in m for m in flower) == 2
    final = flower[flower.index("Final results:") :]
    assert any("Aggregated ClientApp-side Train Metrics:" in m for m in final)
    assert any(
        f"Run directory (checkpoints, ledger, manifest): {tmp_path / 'run'}" in m for m in final
    )
    assert "Aggregated ClientApp-side Train Metrics:" in repr(result)  # Flower's summary
    assert "outcomes=" not in repr(result)  # not a dump of every round's outcome


def test_a_federation_smaller_than_the_quorum_fails_at_the_warm_up_saying_how_to_run_it(
    tmp_path: Path,
) -> None:
    grid = grid_of(quickstart_app(False))
    strategy = LensembleStrategy(
        fedavg_config(min_participants=6), run_dir=tmp_path / "run", warmup_timeout=0.2
    )
    with pytest.raises(ConfigError, match=r'4 node\(s\) connected.*"num-supernodes=6"'):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net(False).state_dict()))
    assert grid.pushes == []  # no round was tried
    # the run it had written is gone, so the same start runs once the cause is fixed
    assert not (tmp_path / "run").exists()
    fixed = LensembleStrategy(
        fedavg_config(min_participants=4),
        run_dir=tmp_path / "run",
        warmup_timeout=0.2,
        fraction_evaluate=0.0,
    )
    fixed.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net(False).state_dict()),
        num_rounds=1,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    assert [r.round for r in verify(Store(tmp_path / "run"))] == [1]


def test_a_start_that_fails_before_its_first_round_takes_back_the_run_it_began(
    tmp_path: Path,
) -> None:
    """Only what the start made goes: in a folder that was there (empty, or holding a
    file of the user's), the store's folders; the temporary folder of a strategy given
    none. The same folder then takes a run."""
    grid = grid_of(quickstart_app(False))
    initial = ArrayRecord(Net(False).state_dict())
    empty, kept = tmp_path / "empty", tmp_path / "kept"
    empty.mkdir()
    kept.mkdir()
    (kept / ".gitkeep").write_text("mine")
    for run_dir in (empty, kept, None):
        before = set(Path(tempfile.gettempdir()).iterdir())
        strategy = LensembleStrategy(
            fedavg_config(min_participants=6), run_dir=run_dir, warmup_timeout=0.2
        )
        with pytest.raises(ConfigError):
            strategy.start(grid=grid, initial_arrays=initial)
        assert set(Path(tempfile.gettempdir()).iterdir()) == before
        assert strategy.run_dir == run_dir and strategy.coordinator is None
    assert list(empty.iterdir()) == []
    assert [p.name for p in kept.iterdir()] == [".gitkeep"]
    LensembleStrategy(
        fedavg_config(min_participants=4), run_dir=kept, fraction_evaluate=0.0
    ).start(
        grid=grid, initial_arrays=initial, num_rounds=1, train_config=ConfigRecord({"lr": 0.1})
    )
    assert [r.round for r in verify(Store(kept))] == [1]


def test_on_the_simulation_engine_the_warm_up_error_says_how_many_nodes_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the transport declares the federation's size (the simulation engine, whose
    node count is fixed), the error names that count, not the warm-up's timeout: the
    warm-up gives up once the count has settled, long before the timeout. (Only the
    wording is checked here; the settling is
    ``test_warm_up_on_the_simulation_engine_does_not_wait_for_nodes_that_cannot_come``.)"""
    monkeypatch.setattr(GridTransport, "declared_size", lambda self: 4)
    grid = grid_of(quickstart_app(False))
    strategy = LensembleStrategy(
        fedavg_config(min_participants=6), run_dir=tmp_path / "run", warmup_timeout=0.2
    )
    with pytest.raises(ConfigError) as raised:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net(False).state_dict()))
    assert str(raised.value).startswith(
        "min-participants: the simulation engine runs 4 node(s), and every round needs K = 6"
    )
    assert "warm-up (" not in str(raised.value)


def test_a_stock_app_that_weights_by_another_key_is_read_by_weighted_by_key(
    tmp_path: Path,
) -> None:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net(False)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        train_locally(model, context.node_id, 0.1)
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "m": MetricRecord({"n": 24, "acc": 0.5})}
        )
        return Message(content=content, reply_to=msg)

    config = fedavg_config(weighting="num-examples")
    strategy = LensembleStrategy(
        config, run_dir=tmp_path / "run", fraction_evaluate=0, weighted_by_key="n"
    )
    result = strategy.start(grid=grid_of(app), initial_arrays=ArrayRecord(Net(False).state_dict()))
    assert result.train_metrics_clientapp[1]["lensemble.C_t"] == 4.0
    assert result.train_metrics_clientapp[1]["acc"] == pytest.approx(0.5)


def test_the_first_rounds_instructions_live_as_long_as_its_grace(tmp_path: Path) -> None:
    """A cold ClientApp (a Ray actor starting on a loaded machine) may pick up its first
    instruction late: round 1's instructions keep the grace in their TTL, later rounds'
    only the deadlines."""
    strategy = LensembleStrategy(
        fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0, warmup_timeout=50.0
    )
    grid = grid_of(quickstart_app(False))
    strategy.start(
        grid=grid, initial_arrays=ArrayRecord(Net(False).state_dict()), num_rounds=2,
        train_config=ConfigRecord({"lr": 0.1}),
    )  # fmt: skip
    ttl = {m.content["config"]["lensemble.round"]: m.metadata.ttl for m in grid.pushed()}
    assert ttl[2] == pytest.approx(20.0)  # open + collect timeouts
    assert 20.0 + 49.0 <= ttl[1] <= 20.0 + 50.0  # ... plus what the warm-up left


def test_the_transports_per_round_bookkeeping_does_not_grow_with_the_run(
    tmp_path: Path,
) -> None:
    """Client metrics and instruction counts are kept only until their round is reported."""
    strategy = LensembleStrategy(fedavg_config(), run_dir=tmp_path / "run", fraction_evaluate=0)
    result = strategy.start(
        grid=grid_of(quickstart_app(False)), initial_arrays=ArrayRecord(Net(False).state_dict()),
        num_rounds=3, train_config=ConfigRecord({"lr": 0.1}),
    )  # fmt: skip
    assert [result.train_metrics_clientapp[r]["lensemble.exchanges"] for r in (1, 2, 3)] == [
        1.0
    ] * 3
    assert "train_loss" in result.train_metrics_clientapp[3]  # read before it was dropped
    transport = strategy.transport
    assert transport is not None
    assert transport.traffic.client_metrics == {} and transport.traffic.sent_per_round == {}


_BAD_REPLIES = {
    "a wrong shape": lambda state: {**state, "fc.weight": torch.zeros(5, 5)},
    "NaN": lambda state: {**state, "fc.bias": torch.full_like(state["fc.bias"], float("nan"))},
    "no example count": None,  # the metrics lack num-examples
}


@pytest.mark.parametrize("fault", sorted(_BAD_REPLIES))
def test_a_malformed_reply_does_not_hold_the_round_to_its_deadline(
    tmp_path: Path, fault: str
) -> None:
    """FedAvg stops at once on a reply it cannot aggregate; lensemble drops it, counts it
    as that node's refusal, and closes the round with the others without waiting out its
    collect timeout (120 s here)."""
    app, bad_node = ClientApp(), NODES[0]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net(False)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        train_locally(model, context.node_id, 0.1)
        state, metrics = model.state_dict(), {"train_loss": 0.5, "num-examples": 24}
        if context.node_id == bad_node:
            if _BAD_REPLIES[fault] is None:
                metrics = {"train_loss": 0.5}
            else:
                state = _BAD_REPLIES[fault](state)
        content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    config = fedavg_config(min_participants=3, open_timeout=120.0, collect_timeout=120.0)
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0)
    result = strategy.start(
        grid=grid_of(app), initial_arrays=ArrayRecord(Net(False).state_dict()), num_rounds=2
    )
    for r in (1, 2):
        metrics = result.train_metrics_clientapp[r]
        assert metrics["lensemble.C_t"] == 3.0 and metrics["lensemble.aborted-attempts"] == 0
        assert metrics["lensemble.seconds"] < 60  # not the 120 s collect timeout
    for outcome in result.outcomes:
        assert len(outcome.contributors) == 3 and f"node-{bad_node}" not in outcome.contributors


@pytest.mark.parametrize("argument", ["min_available_nodes", "min_train_nodes"])
def test_a_node_floor_above_the_federation_fails_at_the_warm_up_naming_it(
    tmp_path: Path, argument: str
) -> None:
    """FedAvg waits for ever for max(min_available_nodes, its sample size, which is at
    least min_train_nodes); lensemble waits its warm-up, then says which argument cannot
    be met and how to run it, before any round (it used to train on the 4 there are)."""
    grid = grid_of(quickstart_app(False))
    strategy = LensembleStrategy(
        fedavg_config(min_participants=2),
        run_dir=tmp_path / "run",
        warmup_timeout=0.2,
        **{argument: 6},
    )
    with pytest.raises(ConfigError, match=rf"4 node\(s\) connected.*{argument} = 6"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net(False).state_dict()))
    assert grid.pushes == []  # no round was tried


def test_min_available_nodes_the_federation_meets_runs(tmp_path: Path) -> None:
    strategy = LensembleStrategy(
        fedavg_config(min_participants=2),
        run_dir=tmp_path / "run-4",
        min_available_nodes=4,
        fraction_evaluate=0,
    )
    result = strategy.start(
        grid=grid_of(quickstart_app(False)),
        initial_arrays=ArrayRecord(Net(False).state_dict()),
        train_config=ConfigRecord({"lr": 0.1}),
    )
    assert result.train_metrics_clientapp[1]["lensemble.C_t"] == 4.0
