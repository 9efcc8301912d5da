"""An exponentially weighted average of a run's committed global models.

Under DP every global model is post-processing of noised sums, so any function of the
committed models is as private as the run: averaging them costs no epsilon. What it buys:
the final model of a noised run carries its last round's noise in full, and an average of
the last rounds' models carries a fraction of it (the noise of different rounds is
independent; the models of neighbouring rounds mostly agree). Averaging the iterates of a
noisy optimizer is the usual remedy (Polyak and Juditsky 1992; De et al. 2022 use an
exponential moving average of the parameters for DP-SGD).

:func:`averaged_model` verifies the ledger chain, reads the models of the last ``last``
rounds and weights θ_r by ``decay ** (R - r)`` (normalised to sum to 1). θ_r is the model
round r+1 starts from: round r's own, or the one an external step adopted after it (what
Flower's central-DP wrapper hands back), which for the newest round is the pending step
the next round would train from. Every model's params hash is checked against the hash
the ledger (or the pending step) names for it; a checkpoint pruned by a retention policy
is refused by name rather than skipped.
The models are the coordinator's floating-point params (integer buffers such as
BatchNorm's ``num_batches_tracked`` travel beside them in the Flower layer and are not in
a checkpoint); each is averaged in float64 and cast back to its dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import ConfigError, LedgerError
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.provenance.ledger import is_pruned
from lensemble_flwr.provenance.retention import step_after
from lensemble_flwr.provenance.verify import verify


@dataclass(frozen=True)
class AveragedModel:
    """The average, and which committed models went into it with which weights."""

    params: NamedArrays
    rounds: tuple[int, ...]  # oldest first
    weights: tuple[float, ...]  # of those rounds' models, summing to 1


def averaged_model(store: Store, *, decay: float, last: int | None = None) -> AveragedModel:
    """The exponentially weighted average of the global models of the run in ``store``.

    Args:
        store: the run directory's store.
        decay: β in [0, 1): round r of R weighs β^(R-r); 0 is the newest model alone.
        last: how many of the newest rounds to average (default: every closed round).

    Raises:
        ConfigError: ``decay`` outside [0, 1) or ``last`` below 1.
        LedgerError: the run has no closed round, its ledger does not verify, or a
            checkpoint to be averaged was pruned (naming the round).
    """
    if not 0.0 <= decay < 1.0:  # NaN too
        raise ConfigError("decay", f"must be in [0, 1), got {decay!r}")
    if last is not None and last < 1:
        raise ConfigError("last", f"must be at least 1, got {last!r}")
    records = verify(store)
    if not records:
        raise LedgerError("the run has no closed round: nothing to average")
    newest = records[-1].round
    rounds = [r.round for r in records][-(last or len(records)) :]
    raw = [decay ** (newest - r) for r in rounds]
    total = math.fsum(raw)
    weights = [w / total for w in raw]
    models: list[NamedArrays] = []
    for record in records[-len(rounds) :]:
        r = record.round
        step = step_after(store, r, record.new_global_hash)  # θ_r: the model r+1 starts from
        digest, expected = (
            (step.checkpoint, step.adopted_hash)
            if step is not None
            else (record.checkpoint, record.new_global_hash)
        )
        if not store.has(digest):
            why = (
                f"was pruned (keep-last-checkpoints): average at most the {newest - r} "
                "newest rounds"
                if is_pruned(store, digest)
                else "is missing"
            )
            raise LedgerError(f"round {r}'s checkpoint {digest[:12]} {why}")
        checkpoint = decode_checkpoint(store.get(digest))
        if checkpoint.params_hash != expected:
            raise LedgerError(
                f"round {r}'s checkpoint {digest[:12]} holds {checkpoint.params_hash[:12]}, "
                f"not the model {expected[:12]} the ledger names"
            )
        models.append(checkpoint.params)
    layout = {n: a.shape for n, a in models[-1].items()}
    for r, model in zip(rounds, models, strict=True):
        if {n: a.shape for n, a in model.items()} != layout:
            raise LedgerError(f"round {r}'s model has other arrays than round {newest}'s")
    params: NamedArrays = {}
    for name, array in models[-1].items():
        acc = np.zeros(array.shape, np.float64)
        for weight, model in zip(weights, models, strict=True):
            acc += weight * model[name].astype(np.float64)
        params[name] = acc.astype(array.dtype)
    return AveragedModel(params=params, rounds=tuple(rounds), weights=tuple(weights))

