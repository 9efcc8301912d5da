"""What a round is about: the global state it pins and the pseudo-gradient it consumes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from lensemble_flwr.canonical import digest_arrays
from lensemble_flwr.config import ParamGroupsConfig
from lensemble_flwr.errors import CheckpointIntegrityError, ResidencyViolation
from lensemble_flwr.params import NamedArrays, frozen, is_shared


@dataclasses.dataclass(frozen=True)
class GlobalState:
    """The pinned canonical state θ_``round``: exactly what RoundOpen broadcasts.

    ``round`` is the number of rounds closed before it (0: the initial state θ_0). Rounds
    are numbered as Flower numbers them, from 1: round r takes θ_{r-1} to θ_r, so this
    state is the one round :attr:`next_round` starts from.

    ``params`` are read-only snapshots of the shared groups; ``params_hash`` is their
    canonical digest and is verified by :meth:`verify`.
    """

    round: int
    params: NamedArrays
    params_hash: str
    sketch_seed: int
    h_steps: int
    probe_hash: str = ""
    landmark_hashes: tuple[str, ...] = ()

    @classmethod
    def create(
        cls,
        round: int,
        params: Mapping[str, np.ndarray],
        *,
        sketch_seed: int,
        h_steps: int,
        probe_hash: str = "",
        landmark_hashes: tuple[str, ...] = (),
        copy: bool = True,
    ) -> GlobalState:
        """Snapshot ``params`` and compute their hash.

        With ``copy=False`` the arrays are adopted (made read-only, not copied): for a
        caller that just created them and keeps no other reference.
        """
        if copy:
            snap = frozen(params)
        else:
            snap = {name: params[name] for name in sorted(params)}
            for array in snap.values():
                array.setflags(write=False)
        return cls(
            round=round,
            params=snap,
            params_hash=digest_arrays(snap, "params"),
            sketch_seed=sketch_seed,
            h_steps=h_steps,
            probe_hash=probe_hash,
            landmark_hashes=landmark_hashes,
        )

    @property
    def next_round(self) -> int:
        """The number of the round that starts from this state: ``round + 1``."""
        return self.round + 1

    def verify(self) -> GlobalState:
        """Recompute the params hash; raise CheckpointIntegrityError if it differs."""
        actual = digest_arrays(self.params, "params")
        if actual != self.params_hash:
            raise CheckpointIntegrityError(
                f"round {self.next_round} global params hash {actual[:12]}… "
                f"does not match the announced {self.params_hash[:12]}…"
            )
        return self


@dataclasses.dataclass(frozen=True)
class PseudoGradient:
    """One participant's released update for one round, bound to its dataset commitment.

    ``delta`` is local − global over the shared groups after the release transforms;
    ``l2_norm`` is the norm of exactly what is released; ``transforms`` names the
    release stages applied, in order.
    """

    participant_id: str
    round: int
    delta: NamedArrays
    l2_norm: float
    dataset_root: str | None
    num_examples: int
    transforms: tuple[str, ...] = ()
    epsilon: float | None = None
    scales: dict[str, float] | None = None
    sketch_fingerprint: str | None = None
    groups: ParamGroupsConfig | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        """With ``groups``: refuse a delta that carries anything but shared parameters
        (action heads and other local groups never leave the participant)."""
        if self.groups is None:
            return
        leaked = sorted(n for n in self.delta if not is_shared(n, self.groups))
        if leaked:
            raise ResidencyViolation(
                f"{self.participant_id}: a release may carry only shared parameters, not {leaked}"
            )
