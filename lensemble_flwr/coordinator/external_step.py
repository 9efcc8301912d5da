"""Training the next round from a model changed after the commit: the external step.

Flower's central-DP wrappers (``DifferentialPrivacyServerSideFixedClipping``,
``DifferentialPrivacyClientSideFixedClipping``) add Gaussian noise to what the wrapped
strategy's ``aggregate_train`` returned and hand the noised model to the next
``configure_train``. By then lensemble has committed the un-noised model θ_{t+1} to its
ledger. Training from the committed model would drop the noise (and void the wrapper's
guarantee); training from the noised one without saying so would break the chain of
global hashes. The external step does neither:

1. the adopted model θ̃ is checked against the committed one (same names, shapes and
   dtypes, finite values) — anything else is refused and nothing changes;
2. the outer optimizer's momentum is re-derived from the released models only
   (:func:`~.outer_optimizer.momentum_after_external_step`), so no un-noised mean
   survives in the optimizer state to leak through later steps;
3. θ̃ and that momentum are stored as a checkpoint (read back from disk, as a commit
   reads back its own), and the step (committed hash,
   adopted hash, checkpoint, change norm) is kept in the store (:mod:`.durable`) before
   anything is sent: a coordinator that restarts trains from θ̃, never from θ_{t+1};
4. every manifest entry of the next round and its ledger record carry the step, and the
   verifier (``verify``, the audit, a joining participant) follows the chain through it.

What the step changes is recorded, not reproduced: the noise is the wrapper's, drawn from
its own generator, so a replay of the run must take θ̃ from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from lensemble_flwr.artifacts.checkpoint import checkpoint_parts
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import OuterOptimizerConfig
from lensemble_flwr.coordinator.durable import save_external_step
from lensemble_flwr.coordinator.outer_optimizer import momentum_after_external_step
from lensemble_flwr.errors import ParameterMismatch
from lensemble_flwr.norms import change_norm
from lensemble_flwr.params import NamedArrays, check_same_layout
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import ExternalStep


@dataclasses.dataclass(frozen=True)
class SteppedFrom:
    """The released state the last committed outer step started from (θ_t and m_t)."""

    params: NamedArrays
    momentum: NamedArrays
    averaged: frozenset[str]


def check_adoptable(committed: Mapping[str, np.ndarray], adopted: Mapping[str, np.ndarray]) -> None:
    """``adopted`` must be ``committed``'s layout: names, shapes, dtypes, finite values.

    Raises:
        ParameterMismatch: naming the first arrays that differ.
    """
    check_same_layout(committed, adopted, "adopted params")
    dtypes = [n for n in sorted(committed) if adopted[n].dtype != committed[n].dtype]
    if dtypes:
        raise ParameterMismatch(
            f"adopted params: dtypes differ from the committed model's for {dtypes[:5]}"
        )
    non_finite = [n for n in sorted(adopted) if not np.isfinite(adopted[n]).all()]
    if non_finite:
        raise ParameterMismatch(f"adopted params: non-finite values in {non_finite[:5]}")


def take_external_step(
    store: Store,
    committed: GlobalState,
    stepped_from: SteppedFrom,
    state: GlobalState,
    config: OuterOptimizerConfig,
) -> tuple[NamedArrays, ExternalStep]:
    """Steps 2–3 of the module's order for ``state``, the adopted model already checked
    (:func:`check_adoptable`) and pinned: its momentum and the step, durable in ``store``
    when this returns.

    Raises:
        StoreError: the store refused a write.
        CheckpointIntegrityError: the adopted model's checkpoint did not read back
            (removed; nothing was adopted).
    """
    momentum = momentum_after_external_step(
        stepped_from.params,
        stepped_from.momentum,
        state.params,
        config,
        averaged=stepped_from.averaged,
    )
    digest = store.put_parts(  # hashed as it is written
        checkpoint_parts(state.round, state.params, momentum, params_hash=state.params_hash)
    )
    store.read_back(digest)  # the next round trains from it: as it lies on disk
    step = ExternalStep(
        committed_hash=committed.params_hash,
        adopted_hash=state.params_hash,
        checkpoint=digest,
        change_norm=change_norm(committed.params, state.params),
    )
    save_external_step(store, step)
    return momentum, step

