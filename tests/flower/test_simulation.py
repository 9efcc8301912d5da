"""LensembleStrategy on Flower's simulation engine (Ray): a few end-to-end runs.

Every ``run_simulation`` of this module runs on one Ray session and one pool of
ClientApp actors (the ``one_engine_session`` fixture): starting Ray and its actors (each
imports Flower, torch and the package) costs more than most of these runs. An actor keeps
nothing of a run that another run could see: each message brings the ClientApp to run,
and the participants an actor keeps alive between messages are keyed by run and node.
The ServerApp runs in this process (a thread of ``run_simulation``); results are handed
back through the ``box`` dicts the apps close over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.clients import make_client_app, wrap_numpy_client
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.identity.endorsement import verify_run
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.privacy.ownership import BudgetOwner
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import RunManifest
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import ToyTrainer
from lensemble_flwr.simulations.toy import initial_params as toy_params
from lensemble_flwr.strategies import LensembleStrategy
from lensemble_flwr.strategies.records import arrays_to_record, record_to_arrays

pytestmark = pytest.mark.simulation

BACKEND = {"client_resources": {"num_cpus": 0.5}}  # several actors on 2 cores


@pytest.fixture(scope="module", autouse=True)
def one_engine_session() -> Iterator[None]:
    """Ray started once for the module, and its actor pool built once: Flower's Ray
    backend builds a pool of actors for every run and shuts Ray down after it; here the
    first run's pool is handed to every later run, and the module's end shuts it down.
    (A run ends only after every message it sent was answered: the pool is idle then.)"""
    import ray

    pools: list = []
    build, terminate = RayBackend.build, RayBackend.terminate

    def build_once(self: RayBackend, app_fn) -> None:  # type: ignore[no-untyped-def]
        if not pools:
            build(self, app_fn)
            pools.append(self.pool)
        self.pool, self.app_fn = pools[0], app_fn

    def keep_running(self: RayBackend) -> None:
        self.pool = None

    RayBackend.build, RayBackend.terminate = build_once, keep_running  # type: ignore[method-assign]
    try:
        yield
    finally:
        RayBackend.build, RayBackend.terminate = build, terminate  # type: ignore[method-assign]
        if pools:
            pools[0].terminate_all_actors()
        ray.shutdown()


def simulate(server: ServerApp, client: ClientApp, nodes: int) -> float:
    started = time.perf_counter()
    run_simulation(
        server_app=server, client_app=client, num_supernodes=nodes, backend_config=BACKEND
    )
    return time.perf_counter() - started


def lensemble_server(
    config: LensembleConfig,
    run_dir: Path,
    rounds: int,
    box: dict,
    initial: dict[str, np.ndarray],
    **strategy_args: Any,
) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = LensembleStrategy(
            config, run_dir=run_dir, fraction_evaluate=0.0, **strategy_args
        )
        box["strategy"] = strategy
        try:
            box["result"] = strategy.start(
                grid=grid, initial_arrays=arrays_to_record(initial), num_rounds=rounds
            )
        except Exception as exc:  # handed back to the test, which asserts on it
            box["error"] = exc

    return app


# -- a participant that answers past the deadline once -----------------------------------
def sleepy_client_app(marker: Path, slow_partition: int, release: Path) -> ClientApp:
    """The slow partition's second fit (its second round) waits until ``release`` exists:
    the server creates it once round 2 has closed, so the reply is late however loaded
    the machine is (no race between a sleep and the deadline)."""

    class SleepyToy(ToyTrainer):
        fit_generator = None  # each fit draws its batches from a generator of its own

        def sample_batch(self, generator, batch_size):  # type: ignore[no-untyped-def]
            # a new fit, whether the trainer is new (a process per message) or kept alive
            # with its participant between messages (make_client_app's keep_live_bytes)
            if generator is not self.fit_generator and self.pid == slow_partition:
                self.fit_generator = generator
                fits = marker.read_text().count("x") if marker.exists() else 0
                marker.write_text("x" * (fits + 1))
                if fits == 1:
                    waited = time.monotonic()
                    while not release.exists() and time.monotonic() - waited < 300:
                        time.sleep(0.05)
            return super().sample_batch(generator, batch_size)

    def trainer_fn(context: Context) -> ToyTrainer:
        trainer = SleepyToy(int(context.node_config["partition-id"]))
        trainer.pid = int(context.node_config["partition-id"])  # type: ignore[attr-defined]
        return trainer

    return make_client_app(trainer_fn)


def test_elastic_completion_with_a_participant_past_the_deadline(tmp_path: Path) -> None:
    """One node's second fit does not end before round 2 has closed; the collect deadline
    is 4 s. Round 2 closes at its deadline without it; its round-2 update arrives during
    a later round, is pulled, logged as late and dropped, and the node contributes again
    afterwards. (It once slept 6 s against the 4 s deadline, and failed on a busy
    machine: now the server releases it once round 2 closed.)"""
    config = LensembleConfig(
        federation={"min_participants": 2, "open_timeout": 60.0, "collect_timeout": 4.0},
        inner={"steps": 2, "batch_size": 8},
    )
    box: dict = {}
    release = tmp_path / "round-2-closed"

    def on_round(line: str) -> None:
        if box["strategy"].coordinator.global_state().round >= 2:
            release.touch()

    server = lensemble_server(config, tmp_path / "run", 5, box, toy_params(), on_round=on_round)
    simulate(server, sleepy_client_app(tmp_path / "fits", 1, release), nodes=3)
    assert "error" not in box, box.get("error")
    outcomes = box["result"].outcomes
    assert [o.state for o in outcomes] == [RoundState.CLOSED] * 5  # the cold start cost nothing
    r1, r2, *later = outcomes
    assert r1.count == 3 and r2.count == 2  # round 2 closed elastically, without the sleeper
    nodes = {f"partition-id-{p}" for p in range(3)}  # the names the nodes give themselves
    (slow,) = nodes - set(r2.contributors)
    assert any(slow in o.late for o in later)  # pulled, logged as late, dropped
    assert any(slow in o.contributors for o in later)  # and it contributes again
    records = verify(Store(tmp_path / "run"))
    assert slow not in records[1].contributors
    # the nodes hold no identity keys: nothing can be endorsed, and that is no finding
    assert [r.status for r in verify_run(Store(tmp_path / "run"))] == ["keyless"] * 5
    metrics = box["result"].train_metrics_clientapp
    assert metrics[2]["lensemble.C_t"] == 2.0 and metrics[2]["lensemble.exchanges"] == 1.0
    # it waited for the deadline (the sleeper was released only after the round closed)
    assert metrics[2]["lensemble.seconds"] >= 4.0


def test_a_quorum_the_simulated_nodes_cannot_reach_fails_before_round_1(tmp_path: Path) -> None:
    """Two simulated nodes, quorum 3: the simulation engine has every node from the start,
    so the strategy refuses before any attempt (it used to run every attempt of round 0
    to its open timeout), naming both numbers; nothing is committed or started, and the
    run it began is taken back (the same app runs once it is given enough nodes)."""
    config = LensembleConfig(
        federation={"min_participants": 3, "open_timeout": 2.0, "max_round_attempts": 2},
        inner={"steps": 1},
    )
    box: dict = {}
    server = lensemble_server(config, tmp_path / "run", 2, box, toy_params(), warmup_timeout=5.0)
    simulate(
        server, make_client_app(lambda c: ToyTrainer(int(c.node_config["partition-id"]))), nodes=2
    )
    error = box.get("error")
    assert isinstance(error, ConfigError) and "K = 3" in str(error) and "has 2" in str(error)
    assert box["strategy"].coordinator is None
    assert not (tmp_path / "run").exists()


# -- a stock Message-API ClientApp, exactly as in Flower's quickstarts -------------------
TARGETS = {p: np.array([p + 1.0, -2.0 * p, 0.5], np.float32) for p in range(4)}


def stock_client_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        w = msg.content["arrays"]["w"].numpy()
        local = w + np.float32(0.5) * (TARGETS[pid] - w)  # half-way to its own target
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(local)}),
                "metrics": MetricRecord({"num-examples": 10 * (pid + 1), "train_loss": 0.1}),
            }
        )
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return Message(
            content=RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg
        )

    return app


def fedavg_server(rounds: int, box: dict, initial: dict[str, np.ndarray]) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=4, min_train_nodes=4)
        result = strategy.start(
            grid=grid,
            initial_arrays=arrays_to_record(initial),
            num_rounds=rounds,
            train_config=ConfigRecord({"lr": 0.1}),
        )
        box["arrays"] = record_to_arrays(result.arrays)

    return app


def test_fedavg_equivalence_with_a_stock_clientapp_unchanged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """outer lr 1, momentum 0, example-count weighting: the same arrays as FedAvg.

    Tolerance: rtol 1e-6, atol 1e-7. FedAvg sums w_i/W * x_i in float32 in arrival order;
    lensemble adds the exact fixed-point mean of the deltas (grid 2**-32) to θ and rounds
    once to float32, so the two agree to a few float32 ulps per round.
    """
    initial = {"w": np.zeros(3, np.float32)}
    rounds = 3
    fedavg: dict = {}
    simulate(fedavg_server(rounds, fedavg, initial), stock_client_app(), nodes=4)

    config = LensembleConfig(
        federation={"min_participants": 4, "weighting": "num-examples", "collect_timeout": 30.0},
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
        groups={"shared": "*", "local": ""},
    )
    box: dict = {}
    with caplog.at_level(logging.INFO):
        simulate(
            lensemble_server(config, tmp_path / "run", rounds, box, initial),
            stock_client_app(),
            nodes=4,
        )
    assert "error" not in box, box.get("error")
    ours = record_to_arrays(box["result"].arrays)
    np.testing.assert_allclose(ours["w"], fedavg["arrays"]["w"], rtol=1e-6, atol=1e-7)
    # and both equal the closed form: w_{t+1} = w_t + 0.5 (Σ n_p target_p / Σ n_p − w_t)
    weights = np.array([10.0 * (p + 1) for p in range(4)])
    mean_target = sum(w * TARGETS[p] for p, w in enumerate(weights)) / weights.sum()
    expected = np.zeros(3)
    for _ in range(rounds):
        expected = expected + 0.5 * (mean_target - expected)
    np.testing.assert_allclose(ours["w"], expected, rtol=1e-5)
    # the stock contributions are recorded as unbound, and the log says so (once each)
    records = verify(Store(tmp_path / "run"))
    assert all(set(r.dataset_roots.values()) == {None} for r in records)
    unbound_logs = [r for r in caplog.records if "contributes UNBOUND" in r.getMessage()]
    assert len(unbound_logs) == 4
    closes = [r for r in caplog.records if "closed with UNBOUND" in r.getMessage()]
    assert len(closes) == rounds


# -- an unmodified NumPyClient -----------------------------------------------------------
class QuickstartClient(NumPyClient):
    """A NumPyClient as users write them: fit moves towards a local target."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def fit(self, parameters, config):  # type: ignore[no-untyped-def]
        w = parameters[0]
        return [w + np.float32(0.5) * (TARGETS[self.pid] - w)], 10 * (self.pid + 1), {}

    def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
        return float(np.abs(parameters[0] - TARGETS[self.pid]).sum()), 5, {"mae": 1.0}


def client_fn(context: Context):  # type: ignore[no-untyped-def]
    return QuickstartClient(int(context.node_config["partition-id"])).to_client()


def test_numpyclient_drop_in(tmp_path: Path) -> None:
    config = LensembleConfig(
        federation={"min_participants": 3, "weighting": "num-examples", "collect_timeout": 30.0},
        outer={"lr": 1.0, "momentum": 0.0, "nesterov": False},
        groups={"shared": "*", "local": ""},
    )
    box: dict = {}
    initial = {"0": np.zeros(3, np.float32)}  # a NumPyClient's list of arrays, by position
    # run_simulation has no run config to share: the clients get the config explicitly
    simulate(
        lensemble_server(config, tmp_path / "run", 2, box, initial),
        wrap_numpy_client(client_fn, config_fn=lambda _: config),
        nodes=3,
    )
    assert "error" not in box, box.get("error")
    weights = np.array([10.0, 20.0, 30.0])
    mean_target = sum(w * TARGETS[p] for p, w in enumerate(weights)) / weights.sum()
    expected = np.zeros(3)
    for _ in range(2):
        expected = expected + 0.5 * (mean_target - expected)
    np.testing.assert_allclose(record_to_arrays(box["result"].arrays)["0"], expected, rtol=1e-5)
    records = verify(Store(tmp_path / "run"))
    assert [r.count for r in records] == [3, 3]
    assert all(set(r.dataset_roots.values()) == {None} for r in records)  # no records_fn


def test_private_int8_releases_over_flower(tmp_path: Path) -> None:
    """Clip, CSPRNG noise, the budget and int8 quantization on the simulation engine: the
    coordinator only ever sees int8 releases, and the ledger records what each spent."""
    config = LensembleConfig(
        federation={"min_participants": 3, "collect_timeout": 30.0},
        inner={"steps": 2, "batch_size": 8},
        privacy={
            "clip_norm": 1.0,
            "noise_multiplier": 0.5,
            "dp_epsilon": 1000.0,
        },
        release={"quantize": "int8"},
    )
    # the simulation engine gives a node no node config of its own: the nodes' budget
    # settings (a cap that covers the run's request, their directory) come from the app
    owner = BudgetOwner(epsilon_cap=1000.0, budget_dir=str(tmp_path / "budgets"))
    box: dict = {}
    simulate(
        lensemble_server(config, tmp_path / "run", 2, box, toy_params()),
        make_client_app(
            lambda c: ToyTrainer(int(c.node_config["partition-id"])),
            config_fn=lambda _: config,
            node_privacy_fn=lambda _: owner,
        ),
        nodes=3,
    )
    assert "error" not in box, box.get("error")
    records = verify(Store(tmp_path / "run"))
    assert [r.count for r in records] == [3, 3]
    assert all(e is not None and e > 0 for r in records for e in r.epsilon.values())
    assert all(records[1].epsilon[p] > records[0].epsilon[p] for p in records[0].contributors)
    # three budgets, one per node (its partition-id, stable across runs), each charged
    # once per release
    files = sorted((tmp_path / "budgets").glob("*.json"))
    assert [f.name for f in files] == [f"participant-partition-id-{i}.json" for i in range(3)]
    for path in files:
        history = PrivacyBudget(path.parent, path.stem, epsilon=1000.0, delta=1e-5).history
        assert sum(n for _, _, n in history) == 2


def test_masked_rounds_over_flower(tmp_path: Path) -> None:
    """Secure aggregation on the simulation engine: keys in each node's Context, the unmask
    exchange as a second train instruction, the revealed sums feeding the outer step. (That
    a revealed sum is bitwise the plaintext sum is shown in-process, where participant ids,
    and so the inner loops' seeds, are the same in both runs.)"""
    config = LensembleConfig(
        federation={
            "min_participants": 3,
            "secagg_threshold": 3,
            "collect_timeout": 30.0,
            "open_timeout": 30.0,
        },
        inner={"steps": 2, "batch_size": 8},
    )
    box: dict = {}
    simulate(
        lensemble_server(config, tmp_path / "run", 2, box, toy_params()),
        make_client_app(
            lambda c: ToyTrainer(int(c.node_config["partition-id"])), config_fn=lambda _: config
        ),
        nodes=3,
    )
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert [o.count for o in result.outcomes] == [3, 3]
    assert result.train_metrics_clientapp[2]["lensemble.exchanges"] == 2.0
    records = verify(Store(tmp_path / "run"))
    assert [r.count for r in records] == [3, 3]
    assert not np.array_equal(
        record_to_arrays(result.arrays)["encoder.weight"], toy_params()["encoder.weight"]
    )


@pytest.mark.simulation
def test_the_flower_md_app_runs_on_the_simulation_engine_as_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from flwr.simulation import run_simulation

    from tests.docs.test_doc_snippets import NODES, flower_md_apps, flower_md_server_app

    _, (trainer_app, _) = flower_md_apps()
    run_simulation(
        server_app=flower_md_server_app(),
        client_app=trainer_app,
        num_supernodes=NODES,
        backend_config=BACKEND,
    )
    out = capsys.readouterr().out
    assert out.count("'lensemble.C_t': 2") == 3, out[-2000:]  # 3 rounds of 2 sampled nodes


def test_two_identical_runs_on_the_simulation_engine_are_the_same_run(tmp_path: Path) -> None:
    """Flower draws new node ids every run; the participants name themselves by their
    partition-id, so the seeds, global hashes and manifest entries repeat. (With sampling,
    a first round samples nodes it has not heard from yet by their Flower ids: it repeats
    from the round after every node has named itself; docs/flower.md says so.)"""
    config = LensembleConfig(federation={"min_participants": 3, "collect_timeout": 30.0})

    def trainer_fn(context: Context) -> ToyTrainer:
        return ToyTrainer(int(context.node_config["partition-id"]))

    runs = []
    for name in ("first", "second"):
        box: dict = {}
        simulate(
            lensemble_server(config, tmp_path / name, 3, box, toy_params(), run_id="same"),
            make_client_app(trainer_fn, config_fn=lambda _: config),
            nodes=4,
        )
        assert "error" not in box, box.get("error")
        runs.append((verify(Store(tmp_path / name)), RunManifest.load(Store(tmp_path / name))))
    (first, first_manifest), (second, second_manifest) = runs
    assert [r.new_global_hash for r in first] == [r.new_global_hash for r in second]
    assert first_manifest.rounds == second_manifest.rounds
    assert all(p.startswith("partition-id-") for r in first for p in r.contributors)
