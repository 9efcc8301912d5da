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

Run it alone with

    .venv/bin/pytest tests/flower/test_deployment_auth.py -q -m deployment -s

Every process starts in its own process group and is stopped by its recorded PID.
docs/deployment.md ("Locking a deployment down") has the same steps for real hosts.
"""

from __future__ import annotations

import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request
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
from lensemble_flwr.provenance.ledger import RunManifest, verify

pytestmark = pytest.mark.deployment

REPO = Path(__file__).resolve().parents[2]
CONNECTION = "lensemble-locked"
NUM_ROUNDS = 1
STARTUP_TIMEOUT = 45.0
RUN_TIMEOUT = 75.0
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


def test_only_registered_supernodes_join_a_tls_superlink(tmp_path: Path) -> None:
    registry = ProcessRegistry()
    timings: dict[str, float] = {}
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
        assert not http_ok(f"http://{LOOPBACK}:{port}/health")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(
                f"https://{LOOPBACK}:{port}/health",
                timeout=5,
                context=ssl.create_default_context(),
            )

        # -- the operator registers the two organisations' public keys ----------------------
        cli_home = tmp_path / "home-cli"
        write_cli_config(cli_home, CONNECTION, port, root_certificates=tls.ca)
        cli_env = flower_env(cli_home)
        registered: dict[str, int] = {}
        for org in ("org-a", "org-b"):
            answer = flwr_json(
                ["supernode", "register", str(keys[org].public), CONNECTION], cli_env, REPO
            )
            assert answer.get("success") is True, answer
            registered[org] = int(answer["node-id"])
        # registering the same key again is refused (and says so in the JSON)
        again = flwr_json(
            ["supernode", "register", str(keys["org-a"].public), CONNECTION], cli_env, REPO
        )
        assert again.get("success") is not True, again

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
            assert _node_id(node.log()) == registered[org]
        intruder = nodes["intruder"]
        try:
            rc = intruder.popen.wait(timeout=STARTUP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail("the unregistered SuperNode was not refused")
        intruder.drain()
        # Flower logs its exit code (305: connection error) and the process exits non-zero
        assert rc != 0 and f"Exit Code: {SUPERNODE_CONNECTION_ERROR}" in intruder.log()
        assert "Failed to activate SuperNode" in intruder.log()
        assert _node_id(intruder.log()) is None
        timings["supernodes settled (since start)"] = time.monotonic() - t0

        # -- the run: both registered organisations, nobody else ----------------------------
        runs_dir = tmp_path / "runs"
        run_config = (
            f"num-server-rounds={NUM_ROUNDS} lensemble.min-participants=2 num-partitions=2 "
            f"run-dir='{runs_dir}' warmup-timeout=40.0 lensemble.collect-timeout=40.0 "
            "lensemble.open-timeout=40.0 fraction-evaluate=0.0"
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
            pytest.fail(f"`flwr run` did not finish within {RUN_TIMEOUT:.0f} s")
        timings["flwr run"] = time.monotonic() - t_run
        cli.drain()
        output = cli.log()
        print(f"\n----- flwr run -----\n{output}")

        runs = flwr_ls(CONNECTION, cli_env, REPO).get("runs", [])
        assert len(runs) == 1 and runs[0]["status"] == "finished:completed", runs
        run_dir = runs_dir / f"flwr-{runs[0]['run-id']}"
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

        listed = flwr_json(["supernode", "list", CONNECTION], cli_env, REPO)
        ids = {int(n["node-id"]) for n in listed.get("nodes", [])}
        assert ids == set(registered.values()), listed

        timings["total"] = time.monotonic() - t0
        print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    except BaseException:
        registry.dump_logs()
        raise
    finally:
        left = registry.stop_all()
        after = live(processes_in_groups(registry.pgids)) + still_running(registry.known.values())
        assert not left and not after, f"processes survived their SIGKILL: {left or after}"
        assert not registry.zombies(), f"exited but never reaped: {registry.zombies()}"
