"""The Flower App in a real deployment on 127.0.0.1: one SuperLink, two SuperNodes, `flwr run`.

One deployment serves the module: a plaintext run and a masked run are submitted to it
together, and each test checks one of them. Slow (about a minute and a half on 2 cores)
and process-heavy. Run it alone with

    .venv/bin/pytest tests/flower/test_deployment.py -q -m deployment -s

or leave it out of a run with ``-m "not deployment"``.

Every Flower process starts in its own process group and is stopped by its recorded PID
(SIGTERM to the group, SIGKILL after a grace period), whether the test passes or not.
See docs/deployment.md for the same steps done by hand.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deployment_helpers import (
    LOOPBACK,
    ProcessRegistry,
    SocketSampler,
    flower_bin,
    flower_env,
    flwr_ls,
    free_ports,
    http_ok,
    live,
    non_loopback,
    off_loopback,
    processes_in_groups,
    read_net_audit,
    skip_without_flower_clis,
    still_running,
    wait_until,
    write_cli_config,
)

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.provenance.verify import verify

pytestmark = pytest.mark.deployment

REPO = Path(__file__).resolve().parents[2]
CONNECTION = "lensemble-deploy"
NUM_NODES = 2
NUM_ROUNDS = 2
RUN_TIMEOUT = 240.0
STARTUP_TIMEOUT = 60.0

skip_without_flower_clis()


@dataclass
class Deployment:
    registry: ProcessRegistry
    tmp: Path
    port: int
    node_ports: list[int]
    cli_env: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Run:
    """One ``flwr run`` on the deployment, and what the test checks it by."""

    secagg: int
    rc: int
    output: str
    seconds: float
    listing: dict  # `flwr ls` after both runs ended


@dataclass
class Runs:
    by_secagg: dict[int, Run]
    sockets: SocketSampler


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A SuperLink and two SuperNodes, all registered, serving every run of the module;
    stopped by PID afterwards."""
    tmp_path = tmp_path_factory.mktemp("deployment")
    registry = ProcessRegistry()
    t0 = time.monotonic()
    try:
        port, *node_ports = free_ports(1 + NUM_NODES)
        superlink = registry.start(
            "superlink",
            [
                flower_bin("flower-superlink"),
                "--insecure",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
            ],
            env=flower_env(tmp_path / "home-superlink", net_audit=tmp_path / "net-audit"),
            log_path=tmp_path / "logs" / "superlink.log",
        )
        healthy = wait_until(
            lambda: http_ok(f"http://{LOOPBACK}:{port}/health"),
            STARTUP_TIMEOUT,
            "SuperLink /health",
            proc=superlink,
        )
        nodes = []
        for i, node_port in enumerate(node_ports):
            nodes.append(
                registry.start(
                    f"supernode-{i}",
                    [
                        flower_bin("flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"{LOOPBACK}:{port}",
                        "--host",
                        LOOPBACK,
                        "--port",
                        str(node_port),
                        "--node-config",
                        f"partition-id={i} num-partitions={NUM_NODES}",
                    ],
                    env=flower_env(
                        tmp_path / f"home-supernode-{i}", net_audit=tmp_path / "net-audit"
                    ),
                    log_path=tmp_path / "logs" / f"supernode-{i}.log",
                )
            )
        for node in nodes:
            wait_until(
                lambda node=node: "SuperNode ID" in node.log(),
                STARTUP_TIMEOUT,
                f"{node.name} to register",
                proc=node,
            )
        registered = time.monotonic() - t0
        cli_home = tmp_path / "home-cli"
        write_cli_config(cli_home, CONNECTION, port)
        dep = Deployment(
            registry,
            tmp_path,
            port,
            node_ports,
            flower_env(cli_home, net_audit=tmp_path / "net-audit"),
            {"superlink healthy": healthy, "supernodes registered (since start)": registered},
        )
    except BaseException:
        registry.dump_logs()
        registry.stop_all()
        raise
    try:
        yield dep
    finally:
        t_stop = time.monotonic()
        left = registry.stop_all()
        pgids = registry.pgids
        after = live(processes_in_groups(pgids)) + still_running(registry.known.values())
        zombies = registry.zombies()
        print(
            f"\nstopped {len(registry.known)} processes in groups {pgids} in "
            f"{time.monotonic() - t_stop:.1f} s; still alive: {[p.pid for p in after] or 'none'}"
            f"; unreaped: {[p.pid for p in zombies] or 'none'}"
        )
        assert not left and not after, f"processes survived their SIGKILL: {left or after}"
        assert not zombies, f"exited but never reaped: {zombies}"


SECAGG = {"plaintext": 0, "masked": NUM_NODES}


@pytest.fixture(scope="module")
def runs(locked_down_started: object, deployment: Deployment) -> Runs:
    """A plaintext run and a masked run, submitted together to the one deployment (a
    deployment spends most of a run waiting on Flower's polls, so two runs at once take
    little longer than one); both nodes serve both runs. The locked-down deployment of
    test_deployment_auth.py comes up and runs beside them (tests/flower/conftest.py)."""
    dep, registry = deployment, deployment.registry
    runs_dir = dep.tmp / "runs"
    clis = {}
    with SocketSampler(registry) as sampler:
        t0 = time.monotonic()
        for secagg in SECAGG.values():
            flwr_run = [flower_bin("flwr"), "run", ".", CONNECTION, "--stream"]
            run_config = (
                f"num-server-rounds={NUM_ROUNDS} lensemble.min-participants={NUM_NODES} "
                f"num-partitions={NUM_NODES} run-dir='{runs_dir}' "
                f"lensemble.secagg-threshold={secagg} warmup-timeout=60.0 "
                "lensemble.collect-timeout=60.0 lensemble.open-timeout=60.0"
            )
            clis[secagg] = registry.start(
                f"flwr run (secagg {secagg})",
                [*flwr_run, "--run-config", run_config],
                env=dep.cli_env,
                log_path=dep.tmp / "logs" / f"flwr-run-secagg-{secagg}.log",
                cwd=REPO,
            )
        seconds, codes = {}, {}
        for secagg, cli in clis.items():
            try:
                left = max(1.0, t0 + RUN_TIMEOUT - time.monotonic())
                codes[secagg] = cli.popen.wait(timeout=left)
            except subprocess.TimeoutExpired:
                registry.dump_logs()
                pytest.fail(f"`flwr run` (secagg {secagg}) did not end within {RUN_TIMEOUT:.0f} s")
            seconds[secagg] = time.monotonic() - t0
    listing = flwr_ls(CONNECTION, dep.cli_env, REPO)
    by_secagg = {}
    for secagg, cli in clis.items():
        cli.drain()
        by_secagg[secagg] = Run(secagg, codes[secagg], cli.log(), seconds[secagg], listing)
    return Runs(by_secagg, sampler)


def test_the_superlink_ran_exactly_the_two_runs_submitted(runs: Runs) -> None:
    """Every run `flwr ls` lists is one of ours (the SuperLink was fresh), and it has
    each run once."""
    listed = [run["run-id"] for run in next(iter(runs.by_secagg.values())).listing["runs"]]
    started = [_started_run_id(run.output) for run in runs.by_secagg.values()]
    assert sorted(listed) == sorted(started) and len(set(started)) == len(SECAGG), (listed, started)


def _started_run_id(output: str) -> str:
    match = re.search(r"Successfully started run (\d+)", output)
    assert match, f"`flwr run` did not say which run it started:\n{output}"
    return match.group(1)


@pytest.mark.parametrize("secagg", SECAGG.values(), ids=SECAGG.keys())
def test_flwr_run_on_superlink_and_two_supernodes(
    deployment: Deployment, runs: Runs, secagg: int
) -> None:
    """Plaintext rounds, and masked rounds (secure aggregation over both nodes)."""
    dep, run = deployment, runs.by_secagg[secagg]
    runs_dir = dep.tmp / "runs"
    output = run.output
    print(f"\n----- flwr run (rc={run.rc}) -----\n{output}")
    try:
        # (1) the SuperLink says the run completed (`flwr run` exits 0 even on failure)
        run_id = _started_run_id(output)
        (listed,) = [r for r in run.listing.get("runs", []) if r["run-id"] == run_id]
        assert listed["status"] == "finished:completed", run.listing
        print(
            f"flwr ls: {listed['status']}, elapsed {float(listed['elapsed']):.1f} s, "
            f"traffic {listed.get('network-traffic')}, compute {listed.get('compute-time')}"
        )

        # (2) the coordinator's ledger verifies: one record per round, both nodes in each
        run_dir = runs_dir / f"flwr-{run_id}"
        assert run_dir.is_dir(), f"no run directory {run_dir}: {list(runs_dir.glob('*'))}"
        records = verify(Store(run_dir))
        assert [r.round for r in records] == list(range(1, NUM_ROUNDS + 1))
        assert [r.count for r in records] == [NUM_NODES] * NUM_ROUNDS

        # (3) the ServerApp's per-round lines reached the streamed output; a steady-state
        # round is one exchange, or two when masked (the unmask exchange)
        for rnd in range(1, NUM_ROUNDS + 1):
            assert re.search(rf"round {rnd}: open→\S*→closed C_t={NUM_NODES}\b", output), (
                f"no line for round {rnd} in the streamed output"
            )
        steady = re.search(rf"round {NUM_ROUNDS}: .* exchanges=(\d+)", output)
        assert steady and int(steady.group(1)) == (2 if secagg else 1), output

        # (4) nothing but 127.0.0.1: every socket any of our processes held while running
        sampler = runs.sockets
        assert sampler.seen, "the socket sampler saw no sockets at all"
        listening = sorted({u.local for u in sampler.seen if u.state == "0A"})
        print(f"processes seen (ours and their descendants): {sampler.programs()}")
        print(f"listening sockets seen: {listening}")
        assert f"{LOOPBACK}:{dep.port}" in listening
        assert all(f"{LOOPBACK}:{p}" in listening for p in dep.node_ports)
        bad = non_loopback(sampler.seen)
        assert not bad, f"sockets off 127.0.0.1: {bad}"
        # ... and every socket call any of their Python processes made (a sitecustomize
        # audit hook), which also catches the short-lived ones the sampler can miss
        events = read_net_audit(dep.tmp / "net-audit")
        print(f"socket calls audited: {len(events)} in {len({e.pid for e in events})} processes")
        assert events, "the network audit hook recorded nothing"
        assert not off_loopback(events), f"socket calls off 127.0.0.1: {off_loopback(events)}"

        timings = {**dep.timings, "flwr run (both at once)": run.seconds}
        timings["total"] = timings["supernodes registered (since start)"] + run.seconds
        print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
        for line in output.splitlines():
            if re.search(r"round \d+: ", line):
                print("  " + line.strip())
    except BaseException:
        dep.registry.dump_logs()
        raise
