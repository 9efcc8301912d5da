"""Building a coordinator's round core: for a new run, or to continue a stored one.

:func:`create_core` checks θ_0, refuses a run directory that already holds a run, and
writes the new run's first checkpoint (θ_0 and zero momentum) and its manifest.
:func:`resume_core` reads a stored run back (:mod:`.recovery`): its last committed
state, ledger head, registry and the attempts a crash interrupted. Both build the parts
every coordinator has — checked against the config once, here — from one
:class:`Wiring`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np

from lensemble_flwr.aggregation.fixed_point import Aggregator, FixedPointAggregator
from lensemble_flwr.artifacts.checkpoint import checkpoint_parts
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import AggregationConfig, LensembleConfig
from lensemble_flwr.coordinator.attempt import RoundOutcome
from lensemble_flwr.coordinator.commit import CommitContext, HeldRun, RunHead
from lensemble_flwr.coordinator.core import Observers, RoundCore
from lensemble_flwr.coordinator.inputs import RoundInputs
from lensemble_flwr.coordinator.modes import AggregatorFactory, mode_for
from lensemble_flwr.coordinator.outcomes import KEEP_OUTCOMES, RecentOutcomes
from lensemble_flwr.coordinator.outer_optimizer import zero_momentum
from lensemble_flwr.coordinator.recovery import record_interrupted, recover, recover_following
from lensemble_flwr.errors import ConfigError, ParameterMismatch, StoreError
from lensemble_flwr.gauge.runtime import GaugeSetup, check_warm_start_of, require_setup
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.params import check_initial_groups
from lensemble_flwr.privacy.calibration import (
    noise_multiplier_of,
    releases_of,
    with_ingress_bound,
)
from lensemble_flwr.privacy.guarantee import guarantee_of
from lensemble_flwr.protocol.messages import Update
from lensemble_flwr.protocol.round import RoundMachine
from lensemble_flwr.provenance.follow import LedgerFollower
from lensemble_flwr.provenance.ledger import (
    ENDORSED_BY_NEXT_ROUND,
    GENESIS,
    EndorsementPolicy,
    Ledger,
    RunManifest,
)

# the coordinator's log: one name for the facade and the parts it is made of
log = logging.getLogger("lensemble_flwr.coordinator.coordinator")


def fixed_point_aggregator(
    template: Mapping[str, np.ndarray], config: AggregationConfig, check_seed: int
) -> Aggregator:
    """The default aggregator: the exact plaintext fixed-point sum."""
    return FixedPointAggregator(template, config, check_seed=check_seed)


def holds_a_run(store: Store) -> bool:
    """Whether ``store`` already holds a run (a manifest, or ledger records): a new
    coordinator refuses it, and only a resume may continue it."""
    return store.bound("ledger/") or store.bound("manifest")


@dataclasses.dataclass(frozen=True)
class Wiring:
    """What every coordinator is built with, new or resumed (see ``Coordinator``)."""

    config: LensembleConfig
    store: Store
    aggregator_factory: AggregatorFactory = fixed_point_aggregator
    update_transform: Callable[[Update], Update] | None = None
    gauge: GaugeSetup | None = None
    identities: Mapping[str, str] | None = None
    on_round: Callable[[RoundOutcome], None] | None = None
    on_transition: Callable[[RoundMachine], None] | None = None
    endorsement: EndorsementPolicy = ENDORSED_BY_NEXT_ROUND  # recorded by a new run


def create_core(wiring: Wiring, run_id: str, initial_params: Mapping[str, np.ndarray]) -> RoundCore:
    """The core of a new run from θ_0 = ``initial_params``; its first checkpoint and its
    manifest are written to the store.

    Raises:
        ParameterMismatch: θ_0 is not floating-point, or does not fit the config's groups.
        StoreError: the store already holds a run.
        ConfigError: the config refuses the wiring (see :func:`_checked_inputs`).
        CheckpointIntegrityError: θ_0's checkpoint did not read back (it is removed; the
            run is not started).
    """
    config, store = wiring.config, wiring.store
    for name, array in initial_params.items():
        if not np.issubdtype(np.asarray(array).dtype, np.floating):
            raise ParameterMismatch(f"{name}: initial params must be floating-point")
    check_initial_groups(initial_params, config.groups)
    check_warm_start_of(wiring.gauge, config, initial_params)
    if holds_a_run(store):
        raise StoreError(
            f"{store.root} already holds a run; use a fresh run directory, or "
            "Coordinator.resume to continue it"
        )
    inputs = _checked_inputs(wiring, run_id)
    registry = ParticipantRegistry(config, store, wiring.identities)
    state = inputs.pin(0, {n: np.asarray(a) for n, a in initial_params.items()})
    momentum = zero_momentum(state.params)
    initial = store.put_parts(checkpoint_parts(0, state.params, momentum))
    store.read_back(initial)  # the manifest names it: as it lies on disk
    manifest = RunManifest(
        run_id=run_id,
        config=config.to_recorded(),
        root_seed=config.federation.root_seed,
        initial_params_hash=state.params_hash,
        initial_checkpoint=initial,
        endorsement=wiring.endorsement,
    )
    core = _core(wiring, inputs, registry, HeldRun(RunHead(state, momentum, GENESIS), manifest))
    manifest.start(store)
    return core


def resume_core(
    wiring: Wiring,
    *,
    check: Literal["full", "chain"] = "full",
    follower: LedgerFollower | None = None,
) -> RoundCore:
    """The core of the run held in the store, continued from its last CLOSED round.

    Raises:
        StoreError: the store holds no run.
        ConfigError: the config is not the one the run was started with.
        LedgerError: the stored ledger, manifest or registry is inconsistent.
    """
    store = wiring.store
    manifest = follower.manifest_header() if follower else RunManifest.load(store)
    wiring.config.check_recorded(manifest.config)
    inputs = _checked_inputs(wiring, manifest.run_id)
    registry = ParticipantRegistry(wiring.config, store, wiring.identities)
    if follower is not None:
        recovered = recover_following(store, follower, wiring.identities)
        ledger = Ledger(store, head=follower.head)
    else:
        recovered = recover(store, manifest, check, wiring.identities)
        ledger = Ledger(store)
    state = inputs.pin(recovered.round, recovered.params, copy=False)
    head = RunHead(state, recovered.momentum, recovered.head_hash)
    registry.restore()
    entries = record_interrupted(store, recovered.manifest, state, recovered.external_step)
    run = HeldRun(head, entries.since(state.next_round), recovered.external_step)
    core = _core(wiring, inputs, registry, run, ledger)
    log.info(
        "resumed run %s at round %d (%d participants registered)",
        manifest.run_id,
        state.next_round,
        len(registry.commitments),
    )
    return core


def _checked_inputs(wiring: Wiring, run_id: str) -> RoundInputs:
    """The run's inputs, once the config accepts the wiring.

    Raises:
        ConfigError: a research transform together with the coordinator harness, or with
            protected releases; a privacy plan that cannot be calibrated; a gauge setting
            without its setup.
    """
    config, update_transform = wiring.config, wiring.update_transform
    require_setup(config, wiring.gauge)
    if update_transform is not None and config.gauge.coordinator_harness:
        raise ConfigError(
            "update_transform", "gauge-coordinator-harness already transforms each update"
        )
    if update_transform is not None and config.protected_releases:
        raise ConfigError(
            "update_transform",
            f"a coordinator-side transform of individual updates cannot be combined "
            f"with {config.protected_releases}: it would see (or undo) what the "
            "participants protect; transform before release, on the participant",
        )
    noise_multiplier = noise_multiplier_of(config)  # refuses a bad plan
    if config.privacy.calibrated:
        log.info(
            "noise-multiplier %.4g, calibrated to spend epsilon %g (delta %g) over "
            "%d releases (dp-rounds %d)",
            noise_multiplier,
            config.privacy.dp_epsilon,
            config.privacy.dp_delta,
            releases_of(config, config.privacy.dp_rounds),
            config.privacy.dp_rounds,
        )
    return RoundInputs(config, run_id, wiring.gauge, update_transform, noise_multiplier)


def _core(
    wiring: Wiring,
    inputs: RoundInputs,
    registry: ParticipantRegistry,
    run: HeldRun,
    ledger: Ledger | None = None,
) -> RoundCore:
    """The core over the checked parts."""
    config, store = wiring.config, wiring.store
    mode = mode_for(
        with_ingress_bound(config),  # under local DP, the noise's reach is admitted
        registry,
        run_id=inputs.run_id,
        aggregator_factory=wiring.aggregator_factory,
    )
    privacy = (
        guarantee_of(
            config.privacy.dp_mode,
            inputs.noise_multiplier,
            config.federation.secagg_threshold,
            adjacency=config.privacy.dp_adjacency,
        )
        if inputs.noise_multiplier > 0
        else None
    )
    ledger = ledger if ledger is not None else Ledger(store)
    return RoundCore(
        inputs=inputs,
        store=store,
        registry=registry,
        mode=mode,
        commit=CommitContext(store, ledger, config, mode.secure_sum, privacy, inputs.pin),
        run=run,
        # every attempt's outcome by position, the latest few held (the manifest has all)
        outcomes=RecentOutcomes(max(KEEP_OUTCOMES, config.federation.max_round_attempts)),
        observers=Observers(wiring.on_round, wiring.on_transition),
    )
