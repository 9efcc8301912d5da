"""Whom a round's privacy guarantee is against, and what it assumes: the ledger's label.

Every round with noised releases records one :class:`PrivacyGuarantee` in its ledger
record, next to each contributor's cumulative epsilon, so a reader of the ledger knows
which party an epsilon figure bounds and under which trust assumption. The two
mechanisms, in the terms of docs/privacy.md:

* ``local-gaussian``: each participant adds N(0, σ²C²) to its own release before it
  leaves. Nothing is assumed about anyone else: the guarantee holds against the
  coordinator, the other participants and whoever receives the models.
* ``distributed-discrete-gaussian``: each member of a masked round adds a discrete
  Gaussian share; only the sum is revealed. The guarantee holds against the same three
  parties provided the sum carries at least ``threshold`` honest members' shares (members
  who do not remove their own share, which a coordinator colluding with them could
  otherwise subtract) and the coordinator is honest-but-curious (it follows the masking
  protocol).

Each figure is under one adjacency, recorded with it: ``substitution`` (the default; any
change to a participant's whole dataset) or ``zero-out`` (the participant's update against
none, sensitivity C: a weaker promise that needs half the noise for the same epsilon). A
record of the default leaves the field out, so ledgers written before the choice existed
keep their hashes.

No amplification by sampling is claimed against any party: the coordinator chooses and
knows the sample, and the ledger records every round's invited set, so whoever reads the
ledger knows it too. The epsilon figures are therefore the same for every party listed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lensemble_flwr.config import Adjacency

PARTIES = ("coordinator", "other participants", "model recipients")
"""The parties an epsilon figure of the ledger can be against."""


class PrivacyGuarantee(BaseModel):
    """What one round's epsilon figures mean."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mechanism: Literal["local-gaussian", "distributed-discrete-gaussian"]
    noise_multiplier: float = Field(gt=0, description="σ: noise std on the release (or sum) / C.")
    threshold: int = Field(
        0, ge=0, description="Distributed: the fewest shares the revealed sum carries."
    )
    against: tuple[str, ...] = Field(
        PARTIES, description="The parties the contributors' epsilon figures hold against."
    )
    assumption: str = Field(description="What the guarantee assumes of the other parties.")
    sampling_amplification: bool = Field(
        False, description="Whether the epsilon figures claim amplification by sampling."
    )
    adjacency: Adjacency = Field(
        "substitution",
        description="The neighbouring datasets the epsilon figures are for.",
        exclude_if=lambda value: value == "substitution",
    )

    def describe(self) -> str:
        """One sentence: the mechanism, whom it holds against, and what it assumes."""
        share = f" over at least {self.threshold} shares" if self.threshold else ""
        return (
            f"{self.mechanism} (noise multiplier {self.noise_multiplier:.4g}{share}); epsilon "
            f"under {self.adjacency} adjacency holds against: {', '.join(self.against)}; "
            f"assumes {self.assumption}; "
            f"amplification by sampling: {'claimed' if self.sampling_amplification else 'none'}"
        )


def guarantee_of(
    dp_mode: Literal["local", "distributed"],
    noise_multiplier: float,
    threshold: int,
    *,
    adjacency: Adjacency = "substitution",
) -> PrivacyGuarantee:
    """The guarantee of a round released with ``dp_mode`` at ``noise_multiplier``."""
    if dp_mode == "distributed":
        return PrivacyGuarantee(
            mechanism="distributed-discrete-gaussian",
            noise_multiplier=noise_multiplier,
            threshold=threshold,
            adjacency=adjacency,
            assumption=f"at least {threshold} honest members' shares in every revealed sum, "
            "and an honest-but-curious coordinator",
        )
    return PrivacyGuarantee(
        mechanism="local-gaussian",
        noise_multiplier=noise_multiplier,
        adjacency=adjacency,
        assumption="nothing of the others (each release is noised before it leaves)",
    )
