"""Benchmark: the quickstart app on a SuperLink with two SuperNodes, FedAvg vs LensembleStrategy.

Run ``.venv/bin/python benchmarks/bench_deployment.py`` (``--help`` for sizes; 2-4 minutes
with the defaults on 2 cores). Issue 13: "The same quickstart app on a SuperLink with two
SuperNodes: seconds per round for both strategies, reported."

It starts a real deployment on 127.0.0.1, insecure, on free ports: one
``flower-superlink`` and two ``flower-supernode`` (``partition-id=0/1``,
``num-partitions=2``), each in its own process group with its own ``FLWR_HOME``, runtime
dependency installation off, and this checkout first on ``PYTHONPATH``. Then it runs
``flwr run benchmarks/deployment_app <connection> --stream`` once per variant, one after
the other on the same SuperLink and SuperNodes:

* ``FedAvg``: ``FedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)``
  as shipped: in a deployment its ``send_and_receive`` pulls the replies every 3 s (a
  ``time.sleep(3)`` in Flower 1.42's ``HttpGrid``);
* ``FedAvg @ 0.05 s``: the same, with ``send_and_receive`` (push, then pull until every
  reply is in) pulling every 0.05 s, LensembleStrategy's ``poll_interval``: the
  comparison at equal polls;
* ``LensembleStrategy``: ``LensembleStrategy(config, fraction_evaluate=0.0, ...)`` with the
  same arguments, K = 2 (``lensemble.min-participants``), its default 0.05 s poll.

The app (``benchmarks/deployment_app/``) is Flower's quickstart shape: a stock Message-API
ClientApp (``quickstart_client.py``, which imports nothing of lensemble), unchanged
between strategies, training bench_dropin's ``stock-cnn`` (5,210 parameters) for two SGD
epochs on its node's shard of scikit-learn's digits. In a deployment every ClientApp
message is a fresh ``flwr-clientapp`` process (it installs the FAB, imports flwr, torch,
scikit-learn), so every round costs that process start-up on every node, whatever the
strategy.

How a round is timed (the same for every variant): inside the ServerApp process, a thin
Grid proxy records ``time.time()`` whenever a round's train instructions are pushed
(FedAvg through ``send_and_receive``, LensembleStrategy through ``push_messages``); a
round lasts from its push to the next round's push, the last one to ``strategy.start``
returning. So it includes building the instructions, the nodes' ClientApp processes, the
wait for the replies, aggregation and whatever the strategy does between rounds
(LensembleStrategy: exact sum, outer step, checkpoint, ledger, manifest). The start-up of
the run (FAB install, the ServerApp process, LensembleStrategy's wait for K nodes) is not
in it, and the first ``--discard`` rounds (default 1: the ClientApp processes' first
start on each node, LensembleStrategy's first contact with each node) are reported apart.
Each variant runs ``--rounds`` rounds (default 4); the script prints mean, median, min and
max seconds per round and the ratios of means, all from the same run.

A report, not a test: exit 0. It fails loudly (exit 1) if any run did not finish:
``flwr run`` exits 0 even when the run failed, so every run's status is read with
``flwr ls --format json`` and must be ``finished:completed``, and its ServerApp must
have written one push per round. Every process it started is stopped by PID in a
``finally`` (SIGTERM to its process group, SIGKILL after a grace period; the helpers of
``tests/helpers/deployment_helpers.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "benchmarks" / "deployment_app"
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from deployment_helpers import (  # noqa: E402  (tests/helpers/ is put on sys.path above)
    LOOPBACK,
    ProcessRegistry,
    flower_bin,
    flower_env,
    flwr_ls,
    free_ports,
    http_ok,
    wait_until,
    write_cli_config,
)

CONNECTION = "lensemble-bench"
NODES = 2
STARTUP_TIMEOUT = 90.0


@dataclass(frozen=True)
class Variant:
    name: str
    strategy: str  # the app's `strategy` run-config value
    poll: float  # FedAvg's send_and_receive poll (0: Flower's own, 3 s)


VARIANTS = {
    "fedavg": Variant("FedAvg (as shipped, 3 s poll)", "fedavg", 0.0),
    "fedavg-poll": Variant("FedAvg @ 0.05 s poll", "fedavg", 0.05),
    "lensemble": Variant("LensembleStrategy (0.05 s poll)", "lensemble", 0.0),
}


@dataclass
class Measured:
    variant: Variant
    run_id: str
    first: list[float]  # the discarded rounds
    rounds: list[float]  # the measured ones
    accuracy: float
    wall: float  # `flwr run --stream`, start to exit
    elapsed: float  # what `flwr ls` says the run took


class RunFailed(RuntimeError):
    pass


def start_deployment(registry: ProcessRegistry, tmp: Path, env_extra: dict[str, str]) -> dict:
    """A SuperLink and two SuperNodes on 127.0.0.1, registered; the CLI's environment."""
    port, *node_ports = free_ports(1 + NODES)
    superlink = registry.start(
        "superlink",
        [
            flower_bin("flower-superlink"), "--insecure", "--host", LOOPBACK, "--port", str(port),
            "--disable-runtime-dependency-installation",
        ],
        env=flower_env(tmp / "home-superlink", extra=env_extra),
        log_path=tmp / "logs" / "superlink.log",
    )  # fmt: skip
    wait_until(
        lambda: http_ok(f"http://{LOOPBACK}:{port}/health"),
        STARTUP_TIMEOUT,
        "SuperLink /health",
        proc=superlink,
    )
    for i, node_port in enumerate(node_ports):
        node = registry.start(
            f"supernode-{i}",
            [
                flower_bin("flower-supernode"), "--insecure", "--superlink", f"{LOOPBACK}:{port}",
                "--host", LOOPBACK, "--port", str(node_port),
                "--node-config", f"partition-id={i} num-partitions={NODES}",
            ],
            env=flower_env(tmp / f"home-supernode-{i}", extra=env_extra),
            log_path=tmp / "logs" / f"supernode-{i}.log",
        )  # fmt: skip
        wait_until(
            lambda node=node: "SuperNode ID" in node.log(),
            STARTUP_TIMEOUT,
            f"{node.name} to register",
            proc=node,
        )
    cli_home = tmp / "home-cli"
    write_cli_config(cli_home, CONNECTION, port)
    return flower_env(cli_home, extra=env_extra)


def run_variant(
    registry: ProcessRegistry,
    cli_env: dict,
    tmp: Path,
    key: str,
    *,
    rounds: int,
    discard: int,
    timeout: float,
    seen: set[str],
) -> Measured:
    variant = VARIANTS[key]
    timings = tmp / f"timings-{key}.json"
    run_config = (
        f"num-server-rounds={rounds} strategy='{variant.strategy}' poll={variant.poll} "
        f"timings-file='{timings}' run-dir='{tmp / 'runs' / key}'"
    )
    cli = registry.start(
        f"flwr run {key}",
        [flower_bin("flwr"), "run", str(APP), CONNECTION, "--stream", "--run-config", run_config],
        env=cli_env,
        log_path=tmp / "logs" / f"flwr-run-{key}.log",
        cwd=REPO,
    )
    t0 = time.monotonic()
    try:
        cli.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RunFailed(f"{variant.name}: `flwr run` did not finish in {timeout:.0f} s") from exc
    wall = time.monotonic() - t0
    cli.drain()
    listing = flwr_ls(CONNECTION, cli_env, REPO).get("runs", [])
    runs = [r for r in listing if r["run-id"] not in seen]
    if len(runs) != 1:
        raise RunFailed(f"{variant.name}: expected one new run in `flwr ls`, got {runs}")
    run = runs[0]
    seen.add(run["run-id"])
    if run["status"] != "finished:completed":
        raise RunFailed(
            f"{variant.name}: run {run['run-id']} is {run['status']!r}, not finished:completed\n"
            f"{cli.log()[-4000:]}"
        )
    if not timings.exists():
        raise RunFailed(f"{variant.name}: the ServerApp wrote no timings\n{cli.log()[-4000:]}")
    data = json.loads(timings.read_text())
    pushes = data["pushes"]
    if len(pushes) != rounds:
        raise RunFailed(f"{variant.name}: {len(pushes)} train pushes for {rounds} rounds")
    per_round = [b - a for a, b in zip(pushes, [*pushes[1:], data["ended"]], strict=True)]
    return Measured(
        variant, run["run-id"], per_round[:discard], per_round[discard:],
        float(data["accuracy"]), wall, float(run["elapsed"]),
    )  # fmt: skip


def report(results: list[Measured], rounds: int, discard: int) -> None:
    print(
        f"\nseconds per round, SuperLink + {NODES} SuperNodes on {LOOPBACK} (insecure), "
        f"{rounds} rounds per run, first {discard} reported apart:"
    )
    head = f"{'variant':<34} {'mean':>6} {'median':>6} {'min':>6} {'max':>6} {'first':>6}"
    print(head + "  accuracy  run wall / flwr ls elapsed")
    for m in results:
        r = m.rounds
        first = f"{m.first[0]:6.2f}" if m.first else f"{'-':>6}"
        print(
            f"{m.variant.name:<34} {statistics.mean(r):6.2f} {statistics.median(r):6.2f} "
            f"{min(r):6.2f} {max(r):6.2f} {first}  {m.accuracy:8.3f}  "
            f"{m.wall:.1f} s / {m.elapsed:.1f} s"
        )
    by_key = {k: m for k in VARIANTS for m in results if m.variant == VARIANTS[k]}
    if "lensemble" in by_key:
        lens = statistics.mean(by_key["lensemble"].rounds)
        for key, label in (("fedavg-poll", "equal polls"), ("fedavg", "as shipped")):
            if key in by_key:
                ratio = lens / statistics.mean(by_key[key].rounds)
                print(f"ratio of means, LensembleStrategy / {VARIANTS[key].name} ({label}): "
                      f"{ratio:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run")
    parser.add_argument("--discard", type=int, default=1, help="first rounds reported apart")
    parser.add_argument(
        "--variants", default="fedavg,fedavg-poll,lensemble", help=f"of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args(argv)
    keys = args.variants.split(",")
    if unknown := [k for k in keys if k not in VARIANTS]:
        parser.error(f"unknown variants {unknown}")
    if not 0 <= args.discard < args.rounds:
        parser.error("--discard must leave at least one measured round")
    if not Path(flower_bin("flower-superlink")).exists():
        print(f"no Flower CLIs next to {sys.executable}", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-deployment-"))
    # every Flower process (SuperLink, SuperNodes, their ServerApp and ClientApp processes)
    # imports this checkout's lensemble_flwr
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env_extra = {"PYTHONPATH": path}
    registry = ProcessRegistry()
    results: list[Measured] = []
    failed: str | None = None
    try:
        t0 = time.monotonic()
        cli_env = start_deployment(registry, tmp, env_extra)
        print(f"deployment up in {time.monotonic() - t0:.1f} s (logs: {tmp / 'logs'})", flush=True)
        seen: set[str] = set()
        for key in keys:
            m = run_variant(
                registry, cli_env, tmp, key,
                rounds=args.rounds, discard=args.discard, timeout=args.timeout, seen=seen,
            )  # fmt: skip
            results.append(m)
            print(
                f"{m.variant.name}: run {m.run_id} finished:completed, "
                f"{statistics.mean(m.rounds):.2f} s per round",
                flush=True,
            )
    except (RunFailed, OSError, RuntimeError) as exc:
        failed = f"{type(exc).__name__}: {exc}"
    finally:
        left = registry.stop_all()
        print(f"stopped {len(registry.known)} processes by PID; still running: "
              f"{[p.pid for p in left] or 'none'}")  # fmt: skip
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        registry.dump_logs(out=sys.stderr)
        return 1
    report(results, args.rounds, args.discard)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
