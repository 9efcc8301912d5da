"""A locked-down deployment on 127.0.0.1: TLS everywhere and SuperNode authentication.

One SuperLink serves HTTPS only, with a certificate from a CA made for the test, and admits
only SuperNodes whose public keys were registered beforehand (``flwr supernode register``).
Two organisations' SuperNodes (one P-384 key, one P-256 key) are registered; a third
SuperNode, whose key nobody registered, tries to join. The test checks that:

* the port speaks TLS only, with the test CA's certificate (plain HTTP and the system's
  trust store both fail);
* the unregistered SuperNode is refused and exits, and never gets a node id;
* the run completes with exactly the two registered nodes: they, and only they, appear in
  the ledger (which verifies) and in every manifest entry;
* ``flwr supernode list`` shows the two registered nodes and nothing else.

The registering CLI holds nothing but the CA certificate: Flower's Control API, on the same
port, does not authenticate callers in this distribution, which is why docs/deployment.md
keeps it off the participants' network.

The locked-down deployment is brought up and run by :func:`lock_down` in a thread of its
own, started (by the ``locked_down`` fixture of tests/flower/conftest.py) beside the runs
of tests/flower/test_deployment.py: both mostly wait on Flower's polls. The thread only
gathers evidence; the test asserts on it.

Run it alone with

    .venv/bin/pytest tests/flower/test_deployment_auth.py -q -m deployment -s

Every process starts in its own process group and is stopped by its recorded PID.
docs/deployment.md ("Locking a deployment down") has the same steps for real hosts.
"""

from __future__ import annotations

import io
import re
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deployment_helpers import (
    LOOPBACK,
    NodeKey,
    ProcessRegistry,
    flower_bin,
    flower_env,
    flwr_json,
    flwr_ls,
    free_ports,
    http_ok,
    live,
    make_node_key,
    make_tls_files,
    processes_in_groups,
    skip_without_flower_clis,
    still_running,
    wait_until,
    write_cli_config,
)

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.provenance.audit import audit_run
from lensemble_flwr.provenance.ledger import RunManifest
from lensemble_flwr.provenance.verify import verify

pytestmark = pytest.mark.deployment

REPO = Path(__file__).resolve().parents[2]
CONNECTION = "lensemble-locked"
NUM_ROUNDS = 1
STARTUP_TIMEOUT = 60.0
RUN_TIMEOUT = 180.0  # it runs beside test_deployment.py's two runs
SUPERNODE_CONNECTION_ERROR = 305  # flwr.supercore.exit.ExitCode: activation refused

skip_without_flower_clis()


def _start_supernode(
    registry: ProcessRegistry,
    tmp: Path,
    name: str,
    *,
    port: int,
    node_port: int,
    ca: Path,
    key: NodeKey,
    partition: int,
):  # type: ignore[no-untyped-def]
    return registry.start(
        name,
        [
            flower_bin("flower-supernode"),
            "--root-certificates",
            str(ca),
            "--auth-supernode-private-key",
            str(key.private),
            "--superlink",
            f"{LOOPBACK}:{port}",
            "--host",
            LOOPBACK,
            "--port",
            str(node_port),
            "--node-config",
            f"partition-id={partition} num-partitions=2",
        ],
        env=flower_env(tmp / f"home-{name}"),
        log_path=tmp / "logs" / f"{name}.log",
    )


def _node_id(log: str) -> int | None:
    match = re.search(r"SuperNode ID:?\s*(\d+)", log)
    return int(match.group(1)) if match else None


@dataclass
class LockedDown:
    """What the locked-down deployment showed, gathered by :func:`lock_down`."""

    tmp: Path
    registered: dict[str, int] = field(default_factory=dict)  # org -> node id it was given
    register_answers: dict[str, dict] = field(default_factory=dict)
    registered_again: dict | None = None
    plain_http_ok: bool | None = None
    system_trust_error: BaseException | None = None
    node_ids: dict[str, int | None] = field(default_factory=dict)  # from the SuperNodes' logs
    intruder_rc: int | None = None
    intruder_log: str = ""
    runs: list[dict] = field(default_factory=list)  # `flwr ls` after the run
    run_timed_out: bool = False
    output: str = ""
    listed_nodes: dict = field(default_factory=dict)  # `flwr supernode list`
    survivors: list = field(default_factory=list)  # processes alive after the SIGKILLs
    zombies: list = field(default_factory=list)
    logs: str = ""  # every process's log, when something went wrong
    error: BaseException | None = None
    timings: dict[str, float] = field(default_factory=dict)


class LockedDownThread:
    """:func:`lock_down` in a thread; ``result()`` waits for it."""

    def __init__(self, tmp: Path) -> None:
        self.evidence = LockedDown(tmp)
        self._thread = threading.Thread(target=lock_down, args=(self.evidence,), daemon=True)
        self._thread.start()

    def result(self) -> LockedDown:
        self._thread.join(timeout=2 * STARTUP_TIMEOUT + RUN_TIMEOUT + 120)
        assert not self._thread.is_alive(), "the locked-down deployment never finished"
        return self.evidence


def lock_down(ev: LockedDown) -> None:
    """Bring the locked-down deployment up, run once on it, stop it; record what it did in
    ``ev`` (an unexpected error too): it asserts nothing."""
    registry = ProcessRegistry()
    tmp_path, timings = ev.tmp, ev.timings
    t0 = time.monotonic()
    try:
        tls = make_tls_files(tmp_path / "pki")
        keys = {
            "org-a": make_node_key(tmp_path / "keys", "org-a", bits=384),
            "org-b": make_node_key(tmp_path / "keys", "org-b", bits=256),
            "intruder": make_node_key(tmp_path / "keys", "intruder", bits=384),
        }
        port, *node_ports = free_ports(4)

        # -- the SuperLink: TLS only, SuperNode authentication on ---------------------------
        superlink = registry.start(
            "superlink",
            [
                flower_bin("flower-superlink"),
                "--ssl-ca-certfile",
                str(tls.ca),
                "--ssl-certfile",
                str(tls.cert),
                "--ssl-keyfile",
                str(tls.key),
                "--enable-supernode-auth",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
            ],
            env=flower_env(tmp_path / "home-superlink"),
            log_path=tmp_path / "logs" / "superlink.log",
        )
        timings["superlink healthy"] = wait_until(
            lambda: http_ok(f"https://{LOOPBACK}:{port}/health", cafile=tls.ca),
            STARTUP_TIMEOUT,
            "SuperLink /health over TLS",
            proc=superlink,
        )
        # the port speaks TLS only, and only the test CA vouches for it
        ev.plain_http_ok = http_ok(f"http://{LOOPBACK}:{port}/health")
        try:
            urllib.request.urlopen(
                f"https://{LOOPBACK}:{port}/health",
                timeout=5,
                context=ssl.create_default_context(),
            )
        except Exception as exc:
            ev.system_trust_error = exc

        # -- the operator registers the two organisations' public keys ----------------------
        cli_home = tmp_path / "home-cli"
        write_cli_config(cli_home, CONNECTION, port, root_certificates=tls.ca)
        cli_env = flower_env(cli_home)
        for org in ("org-a", "org-b"):
            answer = flwr_json(
                ["supernode", "register", str(keys[org].public), CONNECTION], cli_env, REPO
            )
            ev.register_answers[org] = answer
            ev.registered[org] = int(answer["node-id"])
        # registering the same key again is refused (and says so in the JSON)
        ev.registered_again = flwr_json(
            ["supernode", "register", str(keys["org-a"].public), CONNECTION], cli_env, REPO
        )

        # -- three SuperNodes try to join; one key was never registered ---------------------
        nodes = {
            org: _start_supernode(
                registry,
                tmp_path,
                f"supernode-{org}",
                port=port,
                node_port=node_port,
                ca=tls.ca,
                key=keys[org],
                partition=i % 2,
            )
            for i, (org, node_port) in enumerate(zip(keys, node_ports, strict=True))
        }
        for org in ("org-a", "org-b"):
            node = nodes[org]
            wait_until(
                lambda node=node: _node_id(node.log()) is not None,
                STARTUP_TIMEOUT,
                f"{node.name} to activate",
                proc=node,
            )
            ev.node_ids[org] = _node_id(node.log())
        intruder = nodes["intruder"]
        try:
            ev.intruder_rc = intruder.popen.wait(timeout=STARTUP_TIMEOUT)
        except subprocess.TimeoutExpired:
            ev.intruder_rc = None  # not refused
        intruder.drain()
        ev.intruder_log = intruder.log()
        timings["supernodes settled (since start)"] = time.monotonic() - t0

        # -- the run: both registered organisations, nobody else ----------------------------
        run_config = (
            f"num-server-rounds={NUM_ROUNDS} lensemble.min-participants=2 num-partitions=2 "
            f"run-dir='{tmp_path / 'runs'}' warmup-timeout=60.0 lensemble.collect-timeout=60.0 "
            "lensemble.open-timeout=60.0 fraction-evaluate=0.0"
        )
        cli = registry.start(
            "flwr run",
            [flower_bin("flwr"), "run", ".", CONNECTION, "--stream", "--run-config", run_config],
            env=cli_env,
            log_path=tmp_path / "logs" / "flwr-run.log",
            cwd=REPO,
        )
        t_run = time.monotonic()
        try:
            cli.popen.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            ev.run_timed_out = True
        timings["flwr run"] = time.monotonic() - t_run
        cli.drain()
        ev.output = cli.log()
        ev.runs = flwr_ls(CONNECTION, cli_env, REPO).get("runs", [])
        ev.listed_nodes = flwr_json(["supernode", "list", CONNECTION], cli_env, REPO)
        timings["total"] = time.monotonic() - t0
    except BaseException as exc:
        ev.error = exc
    finally:
        if ev.error is not None or ev.run_timed_out:
            logs = io.StringIO()
            registry.dump_logs(logs)
            ev.logs = logs.getvalue()
        left = registry.stop_all()
        after = live(processes_in_groups(registry.pgids)) + still_running(registry.known.values())
        ev.survivors = left or after
        ev.zombies = registry.zombies()


def test_only_registered_supernodes_join_a_tls_superlink(locked_down: LockedDown) -> None:
    ev = locked_down
    assert ev.error is None, f"{ev.error!r}\n{ev.logs}"
    # the port speaks TLS only, and only the test CA vouches for it
    assert ev.plain_http_ok is False
    assert isinstance(ev.system_trust_error, urllib.error.URLError)
    assert re.search("CERTIFICATE_VERIFY_FAILED", str(ev.system_trust_error))

    # the operator registered both organisations' keys; the same key again is refused
    assert all(answer.get("success") is True for answer in ev.register_answers.values())
    assert sorted(ev.register_answers) == ["org-a", "org-b"], ev.register_answers
    assert ev.registered_again is not None and ev.registered_again.get("success") is not True

    # each registered SuperNode got the node id its key was registered under
    assert ev.node_ids == ev.registered
    # the unregistered one was refused: Flower logs its exit code (305: connection error)
    # and the process exits non-zero, without a node id
    assert ev.intruder_rc is not None, "the unregistered SuperNode was not refused"
    assert ev.intruder_rc != 0 and f"Exit Code: {SUPERNODE_CONNECTION_ERROR}" in ev.intruder_log
    assert "Failed to activate SuperNode" in ev.intruder_log
    assert _node_id(ev.intruder_log) is None

    # -- the run: both registered organisations, nobody else --------------------------------
    assert not ev.run_timed_out, f"`flwr run` did not finish within {RUN_TIMEOUT:.0f} s\n{ev.logs}"
    print(f"\n----- flwr run -----\n{ev.output}")
    runs = ev.runs
    assert len(runs) == 1 and runs[0]["status"] == "finished:completed", runs
    run_dir = ev.tmp / "runs" / f"flwr-{runs[0]['run-id']}"
    # the registered organisations' nodes, by the partition-id each names itself by
    # (org-a is partition 0, org-b partition 1; the intruder never got a node id)
    expected = {"partition-id-0", "partition-id-1"}
    records = verify(Store(run_dir))
    assert [r.round for r in records] == list(range(1, NUM_ROUNDS + 1))
    assert all(set(r.contributors) == expected for r in records)
    assert audit_run(run_dir).ok
    seen: set[str] = set()
    for entry in RunManifest.load(Store(run_dir)).rounds:
        seen |= {*entry.contributors, *entry.late, *entry.refused, *entry.update_digests}
    assert seen == expected

    ids = {int(n["node-id"]) for n in ev.listed_nodes.get("nodes", [])}
    assert ids == set(ev.registered.values()), ev.listed_nodes
    print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in ev.timings.items()))

    # every process it started is gone, and reaped
    assert not ev.survivors, f"processes survived their SIGKILL: {ev.survivors}"
    assert not ev.zombies, f"exited but never reaped: {ev.zombies}"
