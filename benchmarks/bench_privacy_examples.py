"""docs/privacy.md's examples, run as written on the digits app with fresh noise: the
held-out accuracy after their rounds, which the page's table reports.

Every ```toml block of the page that holds a ``[tool.flwr.app.config]`` and adds noise is
laid over the digits app's run config (``apps/digits/pyproject.toml``), as Flower lays a
run config over an app's, and run in process (``run_digits``: the app's partitions, model
and ServerApp evaluation) ``--runs`` times per data seed, each run with a fresh budget
folder and, as in every real run, fresh noise. ``tests/docs/test_privacy_examples.py``
runs the same examples with the noise drawn from a seeded stream; this script measures
the spread the page states.

    python benchmarks/bench_privacy_examples.py        # every example, 2 runs x data seeds 0, 1
    python benchmarks/bench_privacy_examples.py --examples 0 --runs 1 --data-seeds 0
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.simulations.digits_data import model_class_of
from lensemble_flwr.simulations.digits_inprocess import run_digits, with_budget_dir

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "privacy.md"
APP = ROOT / "apps" / "digits" / "pyproject.toml"


def _toml(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Flower depends on tomli there
        import tomli as tomllib
    return tomllib.loads(text)


def _flat(app: dict[str, Any]) -> dict[str, Any]:
    from flwr.common.config import flatten_dict

    return dict(flatten_dict(app.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})))


def private_examples(page: Path = PAGE) -> list[dict[str, Any]]:
    """The page's run configs that add noise, in page order (the digits app's own config
    is not in them: :func:`run_config` lays each over it)."""
    found = []
    for block in re.findall(r"```toml\n(.*?)```", page.read_text(), re.S):
        config = _flat(_toml(block))
        if config and LensembleConfig.from_run_config(config).privacy.noised:
            found.append(config)
    return found


def run_config(example: dict[str, Any]) -> dict[str, Any]:
    """The digits app's run config with ``example``'s keys over it."""
    return {**_flat(_toml(APP.read_text())), **example}


def accuracy_after(example: dict[str, Any], data_seed: int) -> list[float]:
    """One run of ``example`` on the digits app at ``data_seed``: the held-out accuracy
    after each round."""
    config_of_run = run_config(example)
    with tempfile.TemporaryDirectory() as tmp:
        config = with_budget_dir(
            LensembleConfig.from_run_config(config_of_run), Path(tmp) / "budgets"
        )
        return run_digits(
            config,
            Path(tmp) / "run",
            rounds=int(config_of_run["num-server-rounds"]),
            num_partitions=int(config_of_run["num-partitions"]),
            data_seed=data_seed,
            model_class=model_class_of(config_of_run["model"]),
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, nargs="*", help="indexes (default: all)")
    parser.add_argument("--runs", type=int, default=2, help="runs per data seed")
    parser.add_argument("--data-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=None, help="a JSON of every run")
    args = parser.parse_args(argv)
    examples = private_examples()
    chosen = range(len(examples)) if args.examples is None else args.examples
    rows = []
    for index in chosen:
        example = examples[index]
        for data_seed in args.data_seeds:
            for run in range(args.runs):
                start = time.perf_counter()
                accuracy = accuracy_after(example, data_seed)
                seconds = time.perf_counter() - start
                rows.append({"example": index, "data_seed": data_seed, "run": run,
                             "accuracy": accuracy, "seconds": seconds})  # fmt: skip
                print(
                    f"example {index} data seed {data_seed} run {run}: held-out accuracy "
                    f"after each round {[round(a, 3) for a in accuracy]} ({seconds:.0f} s)",
                    flush=True,
                )
        finals = [r["accuracy"][-1] for r in rows if r["example"] == index]
        print(f"example {index}: final accuracy {min(finals):.3f} to {max(finals):.3f} "
              f"over {len(finals)} runs\n", flush=True)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"examples": examples, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
