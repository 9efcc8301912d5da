"""Before a run's first round: wait for the nodes every round needs, sending them nothing.

Connected is not started: Ray actors and SuperNode ClientApp processes start on their
first message. What the warm-up did not use of its budget becomes the first round's
grace on its deadlines (``LensembleStrategy.start`` grants it), so that round deadlines
do not pay for cold processes.
"""

from __future__ import annotations

from logging import INFO
from pathlib import Path

from flwr.common import log as say

from lensemble_flwr.config import FederationConfig
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.strategies.grid_transport import GridTransport

WARM_UP_SETTLE_S = 3.0
"""Seconds the simulation engine's node count must stay below what the warm-up waits for
before it stops waiting (the engine registers its nodes as it starts, not all at once)."""


def warm_up(
    transport: GridTransport,
    federation: FederationConfig,
    timeout: float,
    *,
    done: int,
    num_rounds: int,
    run_dir: Path | None,
) -> float:
    """Wait (at most ``timeout`` s) for the nodes every round needs; nothing to wait for
    when the run already holds its ``num_rounds`` (``done`` of them closed). Returns the
    seconds waited.

    Raises:
        ConfigError: fewer nodes connected than ``min_available_nodes``,
            ``min_train_nodes`` or the quorum K, naming the one that cannot be met and
            how to run the app.
    """
    if done >= num_rounds:
        if done > 0:
            say(
                INFO,
                "%s already holds round %d, and num_rounds = %d counts from round 1: "
                "no round left to run",
                run_dir,
                done,
                num_rounds,
            )
        else:
            say(INFO, "num_rounds = %d: no round to run", num_rounds)
        return 0.0
    started = transport.now()
    # FedAvg waits for max(min_available_nodes, its sample size >= min_train_nodes)
    floor = max(federation.min_available, federation.sample_min)
    warm = wait_for_nodes(transport, min_nodes=max(federation.quorum, floor), timeout_s=timeout)
    waited = transport.now() - started
    say(INFO, "warm-up: %d node(s) connected after %.1fs", len(warm), waited)
    _refuse_too_few(transport, federation, len(warm), timeout)
    return waited


def wait_for_nodes(transport: GridTransport, *, min_nodes: int, timeout_s: float) -> list[str]:
    """Wait (at most ``timeout_s``) until ``min_nodes`` nodes are connected, without
    sending them anything: a stock ClientApp has no handler for a query, and one would
    answer it with an error traceback. On the simulation engine, whose nodes are all
    registered as it starts, a count below ``min_nodes`` that has not changed for
    :data:`WARM_UP_SETTLE_S` seconds returns then (no more will come).

    Returns:
        The participants connected when it returned.
    """
    deadline = transport.now() + timeout_s
    settled: tuple[int, float] | None = None  # (the engine's node count, since when)
    while len(transport.peers(fresh=True)) < min_nodes and transport.now() < deadline:
        declared = transport.declared_size()
        if declared is not None and 0 < declared < min_nodes:
            if settled is None or settled[0] != declared:
                settled = (declared, transport.now())
            elif transport.now() - settled[1] >= WARM_UP_SETTLE_S:
                break  # the engine registered its nodes: no more will come
        else:
            settled = None
        transport.sleep(min(1.0, max(0.0, deadline - transport.now())))
    return list(transport.peers(fresh=True))


def _refuse_too_few(
    transport: GridTransport, federation: FederationConfig, connected: int, timeout: float
) -> None:
    """Raise the ConfigError that says which floor ``connected`` nodes cannot meet."""
    fed = federation
    declared = transport.declared_size()  # the simulation engine's fixed node count
    said = (
        f"the simulation engine runs {declared} node(s)"
        if declared is not None and connected >= declared
        else f"{connected} node(s) connected within the warm-up ({timeout:.0f} s)"
    )
    floor = max(fed.min_available, fed.sample_min)
    if fed.quorum <= connected < floor:
        argument, key = (
            ("min_available_nodes", "min-available")
            if fed.min_available >= fed.sample_min
            else ("min_train_nodes", "sample-min")
        )
        raise ConfigError(
            key,
            f"{said}, and no round starts before {argument} = {floor} "
            "are (FedAvg would wait for them for ever): start more SuperNodes (on "
            f'the simulation engine `--federation-config "num-supernodes={floor}"`), '
            f"raise the warm-up timeout, or lower {argument} (the strategy's argument; "
            f"lensemble.{key} when the argument is not given)",
        )
    if connected < fed.quorum:
        lower = " and ".join(f"lensemble.{key}" for key in fed.quorum_set_by)
        lower = f"; or lower {lower} to at most {connected}" if connected else ""
        raise ConfigError(
            fed.quorum_set_by[-1],
            f"{said}, and every round needs K = {fed.quorum} participants; "
            f"{fed.quorum_reason('lensemble.')}, as K = max(min-participants, "
            f"secagg-threshold). On Flower's simulation engine give the run at least "
            f"{fed.quorum} SuperNodes (`flwr run <app> --stream "
            f'--federation-config "num-supernodes={fed.quorum}"`; Flower\'s default local '
            f"federation has 2); on a deployment, start at least {fed.quorum} SuperNodes "
            f"(or raise the warm-up timeout){lower}",
        )
