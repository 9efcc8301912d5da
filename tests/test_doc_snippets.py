"""Every Python snippet of docs/flower.md, docs/configuration.md and the README's "Using it"
runs as written: extracted from the pages and executed.

docs/flower.md's snippets make one Flower App (step 1's ServerApp and ``Net``, step 2's
Trainer ClientApp, step 3's NumPyClient): its ServerApp is driven over a fake SuperLink
(no Ray) with each ClientApp, twice in a row (a second run must not trip over the first),
and once on Flower's simulation engine (``tests/test_simulation.py``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from test_grid_transport import (  # noqa: F401  (the autouse fixture sets the ServerApp identity)
    FakeClock,
    FakeGrid,
    _serverapp_identity,
)

REPO = Path(__file__).resolve().parents[1]
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


def run_server(namespace: dict[str, Any], client_app: Any) -> None:
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
    server = Context(run_id=9, node_id=0, node_config={}, state=RecordDict(), run_config={})
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
    assert out.count("'lensemble.C_t': 2.0") == 2 * 3
    assert out.count("\n{}\n") == 2  # result.aborted: no attempt aborted


def test_the_readme_in_process_snippet_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = python_blocks(REPO / "README.md", "Using it")
    exec(compile(block, "README.md[Using it]", "exec"), {"__name__": "readme"})
    assert "3 rounds verified" in capsys.readouterr().out


def test_the_configuration_md_snippets_run_as_written() -> None:
    for i, block in enumerate(python_blocks(REPO / "docs" / "configuration.md")):
        exec(compile(block, f"docs/configuration.md[{i}]", "exec"), {"__name__": "configuration"})


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
