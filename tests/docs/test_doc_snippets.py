"""Every Python snippet of docs/flower.md, docs/configuration.md, docs/user-guide.md,
docs/recovery.md and the README's "Using it" runs as written: extracted from the pages and
executed (recovery.md's given the names it says it needs); so does every documented run of
the run-config check, which must print what the page shows.

docs/flower.md's snippets make one Flower App (step 1's ServerApp and ``Net``, step 2's
Trainer ClientApp, step 3's NumPyClient): its ServerApp is driven over a fake SuperLink
(no Ray) with each ClientApp, twice in a row (a second run must not trip over the first),
and once on Flower's simulation engine (``tests/flower/test_simulation.py``).

docs/user-guide.md's snippets make one program, run in page order in one namespace
(in-process federations on a simulated clock); each section's outcome is checked.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import io
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from tests.strategies.test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
)

REPO = Path(__file__).resolve().parents[2]
NODES = 4


def python_blocks(page: Path, section: str | None = None) -> list[str]:
    """The ```python blocks of ``page`` (of its ``## section`` only, if given)."""
    text = page.read_text()
    if section is not None:
        start = text.index(f"## {section}")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end >= 0 else None]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def flower_md_apps() -> tuple[dict[str, Any], list[Any]]:
    """docs/flower.md's snippets executed in order in one namespace: the ServerApp's
    namespace and the ClientApps (the Trainer one, then the NumPyClient one)."""
    blocks = python_blocks(REPO / "docs" / "flower.md")
    assert len(blocks) == 3, "docs/flower.md: ServerApp, Trainer ClientApp, NumPyClient"
    namespace: dict[str, Any] = {"__name__": "flower_md"}
    clients = []
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/flower.md[{i}]", "exec"), namespace)
        if i > 0:
            clients.append(namespace["app"])
    return namespace, clients


def run_server(
    namespace: dict[str, Any], client_app: Any, run_config: dict[str, Any] | None = None
) -> None:
    contexts = {
        n: Context(
            run_id=1,
            node_id=n,
            node_config={"partition-id": i, "num-partitions": NODES},
            state=RecordDict(),
            run_config={},
        )
        for i, n in enumerate(range(31, 31 + NODES))
    }
    grid = FakeGrid(FakeClock(), {n: (lambda m, n=n: client_app(m, contexts[n])) for n in contexts})
    server = Context(
        run_id=9, node_id=0, node_config={}, state=RecordDict(), run_config=run_config or {}
    )
    namespace["main"](grid, server)


@pytest.mark.parametrize("client", ["trainer", "numpyclient"])
def test_the_flower_md_app_runs_as_written_twice(
    client: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lensemble_flwr.strategies import LensembleStrategy

    results: list[Any] = []
    start = LensembleStrategy.start

    def keep_result(self: LensembleStrategy, *args: Any, **kwargs: Any) -> Any:
        results.append(start(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(LensembleStrategy, "start", keep_result)
    namespace, (trainer_app, numpy_app) = flower_md_apps()
    app = trainer_app if client == "trainer" else numpy_app
    for _ in range(2):  # the page once said run_dir="runs/demo": the second run failed
        run_server(namespace, app)
    # the model learns: the BatchNorm statistics are averaged (a momentum step on them
    # once drove a running variance negative and the loss to NaN from round 2)
    for result in results:
        evaluation = result.evaluate_metrics_clientapp
        losses = [float(evaluation[r]["loss"]) for r in (1, 2, 3)]
        assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
        assert float(evaluation[3]["accuracy"]) > 0.5
        final = result.arrays.to_torch_state_dict()
        assert float(final["bn.running_var"].min()) >= 0.0
    if client == "numpyclient":  # its fit's own metrics are aggregated (train_loss)
        assert all("train_loss" in result.train_metrics_clientapp[3] for result in results)
    out = capsys.readouterr().out
    # fraction_train=0.5 of 4 nodes: 2 invited and 2 contributions in each of 3 rounds
    assert out.count("'lensemble.C_t': 2") == 2 * 3
    assert out.count("\n{}\n") == 2  # result.aborted: no attempt aborted


def test_the_readme_in_process_snippet_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = python_blocks(REPO / "README.md", "Using it")
    exec(compile(block, "README.md[Using it]", "exec"), {"__name__": "readme"})
    assert "3 rounds verified" in capsys.readouterr().out


def test_the_configuration_md_snippets_run_as_written() -> None:
    for i, block in enumerate(python_blocks(REPO / "docs" / "configuration.md")):
        exec(compile(block, f"docs/configuration.md[{i}]", "exec"), {"__name__": "configuration"})


def check_config_examples() -> list[tuple[str, str]]:
    """Every documented run of the run-config check: a ```bash block holding one
    ``python -m lensemble_flwr.simulations.check_config`` command, and the ```text block
    right after it (what it prints)."""
    command = r"python -m lensemble_flwr\.simulations\.check_config [^\n]*"
    pattern = rf"```bash\n({command})\n```\s*```text\n(.*?)```"
    found = []
    for page in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        found += re.findall(pattern, page.read_text(), re.S)
    return found


@pytest.mark.parametrize(("command", "printed"), check_config_examples())
def test_the_documented_run_config_checks_print_what_the_docs_say(
    command: str, printed: str
) -> None:
    import shlex
    import subprocess

    argv = shlex.split(command)
    assert argv[0] == "python"
    done = subprocess.run(
        [sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.stderr == printed
    assert done.returncode == (1 if "is refused" in printed else 0)


def test_the_run_config_check_is_documented() -> None:
    assert check_config_examples(), "docs/configuration.md shows the run-config check"


def flower_md_server_app() -> Any:
    """Step 1's ServerApp (the first snippet alone: ``app`` is later rebound to the
    ClientApps)."""
    namespace: dict[str, Any] = {"__name__": "flower_md_server"}
    exec(python_blocks(REPO / "docs" / "flower.md")[0], namespace)
    return namespace["app"]


def toml_run_configs() -> list[tuple[str, dict[str, Any]]]:
    """Every ```toml block of the docs that holds a ``[tool.flwr.app.config]`` (possibly
    just its lensemble table), as the flat run_config Flower would make of it."""
    from flwr.common.config import flatten_dict

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Flower depends on tomli there
        import tomli as tomllib

    found = []
    for page in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", page.read_text(), re.S)):
            app = tomllib.loads(block).get("tool", {}).get("flwr", {}).get("app", {})
            if "config" in app:
                found.append((f"{page.name}[{i}]", flatten_dict(app["config"])))
    return found


@pytest.mark.parametrize(("where", "run_config"), toml_run_configs(), ids=lambda v: str(v)[:30])
def test_every_run_config_in_the_docs_is_read_as_it_says(
    where: str, run_config: dict[str, Any]
) -> None:
    """A lensemble key written outside its table was silently ignored (a privacy page once
    set clip-norm at the top level: its runs had no DP). Every lensemble key of the docs'
    examples is in the namespace and is read."""
    from lensemble_flwr.config import NAMESPACE, LensembleConfig, run_config_keys

    config = LensembleConfig.from_run_config(run_config)
    flat = config.to_flat()
    for key, value in run_config.items():
        assert key not in run_config_keys(), f"{where}: {key} is outside the lensemble table"
        if key.startswith(NAMESPACE):
            assert flat[key[len(NAMESPACE) :]] == value, (where, key)


# -- docs/user-guide.md: one program, its snippets run in page order ----------------------
GUIDE = REPO / "docs" / "user-guide.md"


@dataclasses.dataclass
class Ran:
    """What one snippet of the guide left in the shared namespace, and printed."""

    namespace: dict[str, Any]
    out: str


def guide_sections() -> dict[str, list[str]]:
    """The ```python blocks of each ``## N. title`` section of the guide, by N, in order."""
    found = {}
    for part in re.split(r"^## ", GUIDE.read_text(), flags=re.M)[1:]:
        blocks = re.findall(r"```python\n(.*?)```", part, re.S)
        if blocks:
            found[part.split(".", 1)[0]] = blocks
    return found


def run_guide(namespace: dict[str, Any], sections: dict[str, list[str]]) -> dict[str, list[Ran]]:
    """Execute the sections' snippets in order in ``namespace``; after each snippet, a
    shallow copy of the namespace and what the snippet printed. (On one torch thread: the
    models are tiny, and a second thread on a shared machine made the run 4x slower.)"""
    import torch

    ran: dict[str, list[Ran]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for number, blocks in sections.items():
            for i, block in enumerate(blocks):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    where = f"docs/user-guide.md[section {number}, snippet {i}]"
                    exec(compile(block, where, "exec"), namespace)
                ran.setdefault(number, []).append(Ran(dict(namespace), out.getvalue()))
    finally:
        torch.set_num_threads(threads)
    return ran


@pytest.fixture(scope="module")
def guide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Ran]]:
    """The whole guide, run once (its run directories in a temporary directory)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("guide")))  # mkdtemp
        return run_guide({"__name__": "user_guide"}, guide_sections())


def test_every_user_guide_snippet_is_checked(guide: dict[str, list[Ran]]) -> None:
    """A snippet added to the guide needs a check below (section 1's trainer and section
    3's custom stage are checked through section 4's federation)."""
    assert {n: len(ran) for n, ran in guide.items()} == {
        "1": 1, "2": 1, "3": 2, "4": 1, "5": 2, "6": 1, "7": 1
    }  # fmt: skip


def guide_scores(ns: dict[str, Any], params: dict[str, Any]) -> tuple[float, float]:
    """Mean cross-entropy and accuracy, over section 4's participants, of the shared
    ``params`` with each participant's own head, on its own data."""
    import torch

    from lensemble_flwr.params import load_shared

    losses, accuracies = [], []
    for participant in ns["participants"].values():
        trainer = participant.trainer
        model = copy.deepcopy(trainer.model)
        load_shared(model, params, ns["config"].groups)
        with torch.no_grad():
            logits = model(trainer.data)
        losses.append(float(torch.nn.functional.cross_entropy(logits, trainer.labels)))
        accuracies.append(float((logits.argmax(dim=1) == trainer.labels).float().mean()))
    return float(np.mean(losses)), float(np.mean(accuracies))


def test_the_user_guide_shares_what_section_2_says(guide: dict[str, list[Ran]]) -> None:
    (ran,) = guide["2"]
    names = ["encoder.bias", "encoder.weight", "predictor.bias", "predictor.weight"]
    assert sorted(ran.namespace["initial"]) == names and ran.out == f"{names}\n"
    assert "action_head.weight" in ran.namespace["MyModel"]().state_dict()  # kept local


def test_the_user_guide_private_config_clips_noises_and_quantizes(
    guide: dict[str, list[Ran]], tmp_path: Path
) -> None:
    """Section 3's config: a round of three participants under it releases clipped,
    noised int8 updates, and each one's budget spent is in the ledger."""
    from lensemble_flwr.artifacts.store import Store
    from lensemble_flwr.errors import PrivacyBudgetExceeded
    from lensemble_flwr.privacy.budget import PrivacyBudget
    from lensemble_flwr.provenance.verify import verify
    from lensemble_flwr.simulations.inprocess import build
    from lensemble_flwr.testing import DeliveryLog
    from lensemble_flwr.transports.base import COORDINATOR

    ran = guide["3"][0]
    assert ran.out == "['clip-norm', 'noise-multiplier', 'quantize']\n"
    private = ran.namespace["private_config"]
    coordinator, network, _ = build(private, tmp_path / "run", participants=3)
    seen = DeliveryLog(network, dest=COORDINATOR)
    coordinator.run(num_rounds=1)
    updates = seen.payloads("update")
    assert len(updates) == 3
    for update in updates:
        assert list(update["transforms"]) == [
            "difference", "clip", "gaussian_noise", "int8_quantize", "bind"
        ]  # fmt: skip
    (record,) = verify(Store(tmp_path / "run"))
    assert record.count == 3 and len(record.epsilon) == 3
    # the page's figures: the first release costs about 2.2, the budget lasts 9 releases
    assert all(round(eps, 1) == 2.2 for eps in record.epsilon.values()), record.epsilon
    budget = PrivacyBudget(
        tmp_path / "budget",
        "guide",
        epsilon=private.privacy.dp_epsilon,
        delta=private.privacy.dp_delta,
        accountant=private.privacy.dp_accountant,
    )
    for _ in range(9):
        budget.charge(private.privacy.noise_multiplier)
    with pytest.raises(PrivacyBudgetExceeded):
        budget.charge(private.privacy.noise_multiplier)
    at_sigma_1 = PrivacyBudget(tmp_path / "one", "x", epsilon=100.0, delta=1e-5).charge(1.0)
    assert round(at_sigma_1, 1) == 10.7


def test_the_user_guide_federation_learns_and_keeps_the_custom_stage_state(
    guide: dict[str, list[Ran]],
) -> None:
    """Section 4 trains section 1's trainers, releasing through section 3's pipeline."""
    from lensemble_flwr.protocol.round import RoundState
    from lensemble_flwr.release.pipeline import ChainState

    (ran,) = guide["4"]
    ns = ran.namespace
    outcomes = ns["coordinator"].outcomes
    assert len(outcomes) == 10
    assert all(o.state is RoundState.CLOSED and o.count == 4 for o in outcomes)
    lines = ran.out.splitlines()
    assert lines[:-1] == [f"{o.round} 1 closed 4 () None" for o in outcomes]
    assert lines[-1] == "ChainState(states=(None, 10, None))"
    for participant in ns["participants"].values():  # count_rounds counted every round
        assert participant.pipeline_state == ChainState((None, 10, None))
        assert participant.dataset_root is not None  # MyTrainer's records: a commitment
    before = guide_scores(ns, ns["initial"])
    after = guide_scores(ns, ns["coordinator"].global_state().params)
    assert after[0] < 0.5 * before[0] and after[1] > 0.9, (before, after)


def test_the_user_guide_federation_is_the_same_run_twice(
    guide: dict[str, list[Ran]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Section 4 says so: the same seeds give the same run, bit for bit."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    again = run_guide(dict(guide["3"][-1].namespace), {"4": guide_sections()["4"]})
    (first,), (second,) = guide["4"], again["4"]
    assert second.namespace["run_dir"] != first.namespace["run_dir"]
    assert second.out == first.out
    hashes = [[o.global_hash for o in r.namespace["coordinator"].outcomes] for r in (first, second)]
    assert hashes[0] == hashes[1]


def test_the_user_guide_fault_plan_does_what_it_says(guide: dict[str, list[Ran]]) -> None:
    """Section 5's first snippet: every scripted fault happens, in the round it names."""
    from lensemble_flwr.errors import FaultToleranceExceeded
    from lensemble_flwr.protocol.round import RoundState

    ran = guide["5"][0]
    outcomes = ran.namespace["coordinator"].outcomes
    assert len(ran.out.splitlines()) == len(outcomes)
    fired = ran.namespace["faults"]  # a fault fires once: the run used the plan up
    assert not (fired.drops or fired.delays or fired.corruptions or fired.duplicates)
    assert not any(fired.rejoins.values())
    source = guide_sections()["5"][0]  # the plan as the page writes it
    written: dict[str, Any] = {}
    exec(compile(source[: source.index("\nfault_dir")], "docs/user-guide.md[5]", "exec"), written)
    plan = written["faults"]
    (drop,), (corrupt,), (duplicate,) = plan.drops, plan.corruptions, plan.duplicates
    ((delayed, delay_round),) = plan.delays
    (rejoin_round,) = plan.rejoins[drop.participant_id]
    attempts: dict[int, list[Any]] = {}
    for o in outcomes:
        attempts.setdefault(o.round, []).append(o)
    closed = {r: tries[-1] for r, tries in attempts.items()}
    assert len(closed) == 6 and all(o.state is RoundState.CLOSED for o in closed.values())
    assert delayed not in closed[delay_round].contributors  # it missed the deadline...
    assert any(delayed in o.late for o in outcomes if o.round > delay_round)  # ...and came
    for r in range(drop.round, rejoin_round):
        assert drop.participant_id not in closed[r].contributors
    assert drop.participant_id in closed[rejoin_round].contributors
    first, retry = attempts[corrupt.round]
    assert first.state is RoundState.ABORTED and isinstance(first.error, FaultToleranceExceeded)
    assert first.rejected == 1 and corrupt.participant_id in retry.contributors
    (dup,) = attempts[duplicate.round]
    assert dup.rejected == 1 and duplicate.participant_id in dup.contributors


def test_the_user_guide_network_snippet_holds(guide: dict[str, list[Ran]]) -> None:
    """Section 5's second snippet asserts its own outcome; its round closed."""
    from lensemble_flwr.protocol.round import RoundState

    last = guide["5"][1].namespace["coordinator"].outcomes[-1]
    assert last.state is RoundState.CLOSED and last.count == 3


def test_the_user_guide_reads_and_verifies_the_run_directory(
    guide: dict[str, list[Ran]],
) -> None:
    """Section 6 reads section 4's run directory; the shell commands it names agree."""
    from lensemble_flwr.cli import main

    (ran,) = guide["6"]
    ns, lines = ran.namespace, ran.out.splitlines()
    outcomes = guide["4"][0].namespace["coordinator"].outcomes
    assert [r.new_global_hash for r in ns["records"]] == [o.global_hash for o in outcomes]
    assert len(lines) == 2 * len(outcomes)  # a record and a manifest entry per round
    assert lines[len(outcomes) :] == [f"{o.round} 1 closed None" for o in outcomes]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["verify", ns["run_dir"]]) == 0
        assert main(["show", ns["run_dir"]]) == 0
    assert "verified" in out.getvalue()


def test_the_user_guide_aligned_federation_records_frame_drift(
    guide: dict[str, list[Ran]],
) -> None:
    """Section 7: every participant aligned on the probe (the coordinator admits only
    updates aligned on the round's sketch) and every round recorded its frame drift."""
    from lensemble_flwr.protocol.round import RoundState

    (ran,) = guide["7"]
    outcomes = ran.namespace["coordinator"].outcomes
    assert len(outcomes) == 2
    assert all(o.state is RoundState.CLOSED and o.count == 3 for o in outcomes)
    drifts = ast.literal_eval(ran.out)  # the list it printed
    assert len(drifts) == 2 and all(math.isfinite(d) and d >= 0 for d in drifts), drifts


def test_the_recovery_md_snippet_resumes_a_run_to_its_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/recovery.md's snippet, given what it names (``config``, ``transport``,
    ``num_rounds``, a run in ``runs/demo`` whose coordinator died after 2 of 4 rounds):
    the resumed coordinator closes exactly the rounds still to close."""
    from lensemble_flwr.artifacts.store import Store
    from lensemble_flwr.config import LensembleConfig
    from lensemble_flwr.provenance.verify import verify
    from lensemble_flwr.simulations.inprocess import build

    block, _flower = python_blocks(REPO / "docs" / "recovery.md")
    monkeypatch.chdir(tmp_path)
    config = LensembleConfig(federation={"min_participants": 3}, inner={"steps": 2})
    first, network, _ = build(config, Path("runs/demo"), participants=3)
    first.run(num_rounds=2)
    before = [r.record_hash for r in verify(Store("runs/demo"))]
    namespace = {"config": config, "transport": network.coordinator, "num_rounds": 4}
    exec(compile(block, "docs/recovery.md", "exec"), namespace)
    records = verify(Store("runs/demo"))
    assert len(records) == 4 and [r.record_hash for r in records[:2]] == before
    assert namespace["coordinator"].global_state().params_hash == records[-1].new_global_hash


def test_the_recovery_md_flower_app_resumes_a_run_to_its_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/recovery.md's ServerApp, with flower.md's ``Net`` and Trainer ClientApp and the
    run config its toml block declares: a first start runs 2 of its rounds; restarted
    with ``resume = true`` and 3 rounds it runs round 3 only, on the same run; restarted
    again it runs nothing; without ``resume`` the directory is refused."""
    import types

    from lensemble_flwr.artifacts.store import Store
    from lensemble_flwr.errors import StoreError
    from lensemble_flwr.provenance.verify import verify

    flower, (trainer_app, _numpy_app) = flower_md_apps()
    _first, block = python_blocks(REPO / "docs" / "recovery.md")
    task = types.ModuleType("my_app.task")  # the page's stand-in for the user's model
    task.Net = flower["Net"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_app", types.ModuleType("my_app"))
    monkeypatch.setitem(sys.modules, "my_app.task", task)
    namespace: dict[str, Any] = {"__name__": "recovery_md"}
    exec(compile(block, "docs/recovery.md[1]", "exec"), namespace)
    (declared,) = [c for w, c in toml_run_configs() if w.startswith("recovery.md")]
    run_dir = tmp_path / "runs" / "my-run"
    base = {**declared, "run-dir": str(run_dir)}
    run_server(namespace, trainer_app, {**base, "num-server-rounds": 2})
    first = [r.record_hash for r in verify(Store(run_dir))]
    run_server(namespace, trainer_app, {**base, "num-server-rounds": 3, "resume": True})
    records = verify(Store(run_dir))
    assert [r.round for r in records] == [1, 2, 3]
    assert [r.record_hash for r in records[:2]] == first
    run_server(namespace, trainer_app, {**base, "num-server-rounds": 3, "resume": True})
    assert len(verify(Store(run_dir))) == 3
    assert capsys.readouterr().out.splitlines() == [
        f"{run_dir} [1, 2]",
        f"{run_dir} [3]",
        f"{run_dir} []",
    ]
    with pytest.raises(StoreError, match="already holds a run"):
        run_server(namespace, trainer_app, {**base, "num-server-rounds": 4})


def private_run_configs() -> list[tuple[str, dict[str, Any]]]:
    """Those of :func:`toml_run_configs` that add noise (privacy.md's)."""
    from lensemble_flwr.config import LensembleConfig

    found = [
        (w, c) for w, c in toml_run_configs() if LensembleConfig.from_run_config(c).privacy.noised
    ]
    assert found, "no private run config in the docs"
    return found


@pytest.mark.parametrize(("where", "run_config"), private_run_configs(), ids=lambda v: str(v)[:30])
def test_every_private_run_config_in_the_docs_can_release(
    where: str, run_config: dict[str, Any], tmp_path: Path
) -> None:
    """A DP example whose budget cannot pay for one release makes every participant refuse
    its first round and the federation stop (privacy.md's once had sigma 1, epsilon 8: a
    release costs 10.7). Its noise (given or calibrated) must pay for its plan, and one
    release must fit the budget."""
    from lensemble_flwr.config import LensembleConfig
    from lensemble_flwr.privacy.budget import PrivacyBudget
    from lensemble_flwr.privacy.calibration import noise_multiplier_of

    config = LensembleConfig.from_run_config(run_config)
    privacy = config.privacy
    noise = noise_multiplier_of(config)  # a plan the budget cannot cover raises here
    budget = PrivacyBudget(
        tmp_path, where, epsilon=privacy.dp_epsilon, delta=privacy.dp_delta,
        accountant=privacy.dp_accountant,
    )  # fmt: skip
    assert 0 < budget.charge(noise) <= privacy.dp_epsilon
    # and a node that sets nothing itself (its default cap, delta, accountant) runs it,
    # given the example's adjacency, which is the node's to choose (privacy.md says so)
    from lensemble_flwr.privacy.ownership import BudgetOwner, owned_config

    owned_config(config, BudgetOwner(budget_dir=str(tmp_path), adjacency=privacy.dp_adjacency))


def test_the_privacy_md_node_config_runs_as_written(tmp_path: Path) -> None:
    """privacy.md's SuperNode node config, parsed as flower-supernode parses it: every
    private run config of the page fits it, a node with it releases, and the run that asks
    for more is refused with the message the page quotes."""
    from flwr.common.config import parse_config_args

    from lensemble_flwr.clients.app import build_participant
    from lensemble_flwr.clients.node_privacy import owner_from_node_config
    from lensemble_flwr.config import LensembleConfig
    from lensemble_flwr.errors import ConfigError
    from lensemble_flwr.participant.participant import Participant
    from lensemble_flwr.privacy.ownership import OWNER_KEYS, owned_config
    from lensemble_flwr.protocol.state import GlobalState
    from lensemble_flwr.simulations.toy import ToyTrainer, initial_params

    page = (REPO / "docs" / "privacy.md").read_text()
    (line,) = re.findall(r'--node-config "(.*?)"', page)
    node_config = parse_config_args([line]) | {"dp-budget-dir": str(tmp_path / "node")}
    assert set(OWNER_KEYS.values()) <= set(node_config)  # the page shows every key
    owner = owner_from_node_config(node_config)
    runs = [c for w, c in private_run_configs() if w.startswith("privacy.md")]
    assert runs
    zero_out = owner_from_node_config(node_config | {"dp-adjacency": "zero-out"})
    for run_config in runs:
        config = LensembleConfig.from_run_config(run_config)
        if config.privacy.dp_adjacency == "substitution":
            owned_config(config, owner)
            continue
        # the page's zero-out example runs on a node that chose zero-out, not on this one
        with pytest.raises(ConfigError, match="node config dp-adjacency"):
            owned_config(config, owner)
        owned_config(config, zero_out)

    def built(run_config: dict[str, Any]) -> Any:
        context = Context(
            run_id=1, node_id=5, node_config=node_config, state=RecordDict(),
            run_config=run_config,
        )  # fmt: skip
        config = LensembleConfig.from_run_config(run_config)
        return build_participant(context, ToyTrainer(0), config)

    # the page's first run with local noise (its own noise is added in a masked round's
    # release, which a lone participant's local round does not make)
    local = runs[0] | {"lensemble.dp-mode": "local", "lensemble.secagg-threshold": 0}
    participant = built(local)
    assert isinstance(participant, Participant)
    state = GlobalState.create(0, initial_params(), sketch_seed=1, h_steps=2)
    assert participant.local_round(state, round_seed=1).epsilon is not None
    assert [p.name for p in (tmp_path / "node").glob("*.json")] == [
        "participant-lensemble-id-hospital-a.json"
    ]
    refused = built(local | {"lensemble.dp-epsilon": 100.0})
    quoted = re.search(r"e\.g\. `(lensemble\.dp-epsilon: the run asks .*?)`", page, re.S)
    assert quoted is not None
    assert refused.reason == " ".join(quoted.group(1).split())


def test_the_cli_md_export_snippet_loads_the_exported_model_into_the_apps_net(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/cli.md's ``export`` snippet, on a run of docs/flower.md's app (its ``Net``,
    with a BatchNorm): the commands the page shows write both files, and the snippet
    loads them into a fresh ``Net`` whose state is then the run's final model, every
    array by name (the integer buffer, not exported, as the run carried it)."""
    from lensemble_flwr.cli import main
    from lensemble_flwr.strategies import LensembleStrategy

    results: list[Any] = []
    start = LensembleStrategy.start

    def keep_result(self: LensembleStrategy, *args: Any, **kwargs: Any) -> Any:
        results.append(start(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(LensembleStrategy, "start", keep_result)
    namespace, (trainer_app, _) = flower_md_apps()
    run_server(namespace, trainer_app, {"num-server-rounds": 2})
    (result,) = results
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(result.run_dir), "model.safetensors"]) == 0
    assert main(["export", str(result.run_dir), "round1.safetensors", "--round", "1"]) == 0
    (block,) = python_blocks(REPO / "docs" / "cli.md", "`export`")
    page = {"Net": namespace["Net"], "__name__": "cli_md"}
    exec(compile(block, "docs/cli.md[export]", "exec"), page)
    assert "not in the file, left as they were: []" in capsys.readouterr().out
    final = result.arrays.to_torch_state_dict()
    loaded = page["model"].state_dict()
    assert list(loaded) == list(final)
    for name, tensor in final.items():
        assert torch_equal(loaded[name], tensor), name


def torch_equal(left: Any, right: Any) -> bool:
    return left.dtype == right.dtype and bool((left == right).all())
