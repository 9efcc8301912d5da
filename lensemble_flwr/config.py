"""One frozen configuration for a federation, loadable from Python or a Flower run_config.

Python::

    cfg = LensembleConfig(federation={"min_participants": 3}, outer={"lr": 0.5})

Flower (a ``[tool.flwr.app.config.lensemble]`` table in ``pyproject.toml``, which Flower
flattens to ``lensemble.<key>`` run_config keys; the app's other keys are left alone)::

    cfg = LensembleConfig.from_run_config(context.run_config)

Every key is ``<section prefix><field name with '-' for '_'>``; the full list is
:func:`run_config_keys` and ``docs/configuration.md``. A bad value or an unknown key in
the ``lensemble.`` namespace raises :class:`~lensemble_flwr.errors.ConfigError` naming it.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lensemble_flwr.errors import ConfigError

log = logging.getLogger(__name__)

NAMESPACE = "lensemble."
"""The prefix of lensemble's keys in a Flower run_config: the ``[tool.flwr.app.config.
lensemble]`` table of an app's ``pyproject.toml`` flattens to ``lensemble.<key>``."""


def default_state_dir() -> Path:
    """A participant's private state directory (privacy budgets, commitment secrets)
    unless ``dp-state-dir`` says otherwise: ``$LENSEMBLE_PRIVACY_DIR``, else
    ``$XDG_DATA_HOME/lensemble-flwr/privacy`` (``~/.local/share`` without XDG)."""
    base = os.environ.get("LENSEMBLE_PRIVACY_DIR")
    if base:
        return Path(base)
    return (
        Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share"))
        / "lensemble-flwr/privacy"
    )


Adjacency = Literal["substitution", "zero-out"]
"""What a privacy epsilon protects (``dp-adjacency``; see lensemble_flwr.privacy.budget)."""


class _Section(BaseModel):
    # finite numbers only (an infinite timeout waits forever, an infinite budget is none)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _exact_scalar_types(cls, value: Any, info: ValidationInfo) -> Any:
        """A number is a number and a flag is a flag: ``True`` is not a participant count
        and ``"yes"`` is not a boolean (pydantic would convert both)."""
        kind = cls.model_fields[info.field_name].annotation if info.field_name else None
        # the value itself is quoted by the error (_error_from): say only what was wanted
        text = " (text: write it unquoted)" if isinstance(value, str) else ""
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"expected true or false{text}")
        if kind in (int, float) and (
            isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
        ):
            raise ValueError(f"expected a number{text}")
        if (
            kind is int
            and not isinstance(value, numbers.Integral)
            and not float(value).is_integer()
        ):
            raise ValueError("expected a whole number")
        return value

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _error_from(exc, type(self).__name__) from None


class FederationConfig(_Section):
    """Who must be present, for how long the coordinator waits, and how rounds are seeded."""

    min_participants: int = Field(2, ge=1, description="Floor on the quorum K.")
    secagg_threshold: int = Field(
        0, ge=0, description="Dropout threshold of secure aggregation (0: no masking)."
    )
    secagg_neighbours: int = Field(
        0,
        ge=0,
        description="Masked rounds: pairwise masks with this many neighbours, an even "
        "number (SecAgg+ graph); 0: with every other member.",
    )
    open_timeout: float = Field(
        60.0, gt=0, description="Seconds the round stays OPEN waiting for K commitments."
    )
    collect_timeout: float = Field(
        300.0, gt=0, description="Seconds COLLECTING waits for updates before completing."
    )
    deadline_mode: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="fixed: every attempt waits open-timeout in OPEN and collect-timeout in "
        "COLLECTING; adaptive: each phase waits deadline-margin x the longest of the last 5 "
        "round times (start of the wait to the last admitted update), within deadline-floor "
        "and deadline-cap (deadline-cap until a round closed, and in a retry).",
    )
    deadline_floor: float = Field(
        10.0, gt=0, description="Adaptive deadlines: the shortest a phase waits (seconds)."
    )
    deadline_cap: float = Field(
        600.0,
        gt=0,
        description="Adaptive deadlines: the longest a phase waits, and what it waits before "
        "any round closed (seconds; at least deadline-floor).",
    )
    deadline_margin: float = Field(
        3.0, ge=1, le=100, description="Adaptive deadlines: the multiple of the round time."
    )
    root_seed: int = Field(0, ge=0, description="Root of every reproducible seed (s_t).")
    sample_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of the reachable participants each round attempt invites, drawn "
        "from a seed of the round (1: every reachable one, late joiners too).",
    )
    sample_mode: Literal["fixed", "poisson"] = Field(
        "fixed",
        description="fixed: a sample of max(int(N * sample-fraction), sample-min, K); "
        "poisson: each reachable participant independently with probability "
        "sample-fraction (a draw below K is redrawn before anyone is invited; sample-min "
        "does not apply).",
    )
    sample_min: int = Field(
        0, ge=0, description="Fewest participants a sampled attempt invites (and at least K)."
    )
    min_available: int = Field(
        0,
        ge=0,
        description="Reachable participants a sampled attempt waits for before it draws "
        "(FedAvg's min_available_nodes; LensembleStrategy.start's warm-up waits for them too).",
    )
    max_round_attempts: int = Field(
        3, ge=1, description="Attempts of one round before the federation stops."
    )
    retry_wait: float = Field(
        5.0, ge=0, description="Seconds to wait for (re)joins before retrying an aborted round."
    )
    require_binding: bool = Field(
        False,
        description="Refuse updates not bound to a dataset commitment (e.g. stock ClientApps).",
    )
    require_signatures: bool = Field(
        False,
        description="Refuse participant messages not signed by a registered identity key.",
    )
    weighting: Literal["uniform", "num-examples"] = Field(
        "uniform", description="Per-update weight in the mean: 1, or the update's example count."
    )

    @field_validator("deadline_cap")
    @classmethod
    def _cap_above_floor(cls, value: float, info: ValidationInfo) -> float:
        floor = info.data.get("deadline_floor")
        if floor is not None and value < floor:
            raise ValueError(f"deadline-cap must be at least deadline-floor ({floor})")
        return value

    @field_validator("secagg_neighbours")
    @classmethod
    def _even_degree(cls, value: int) -> int:
        if value % 2:
            raise ValueError("the neighbour graph is a ring: the degree must be even (or 0)")
        return value

    def weight_of(self, num_examples: int) -> int:
        """An update's integer weight in the mean: 1, or its example count. The masked
        participant and the coordinator must agree on it, so both ask here."""
        return 1 if self.weighting == "uniform" else num_examples

    @property
    def quorum(self) -> int:
        """K = max(min_participants, secagg_threshold)."""
        return max(self.min_participants, self.secagg_threshold)

    @property
    def quorum_set_by(self) -> tuple[str, ...]:
        """The run_config keys that set K: the larger of ``min-participants`` and
        ``secagg-threshold``, or both when they are equal (lowering the other one alone
        does not lower K)."""
        keys = (
            ("min-participants", self.min_participants),
            ("secagg-threshold", self.secagg_threshold),
        )
        return tuple(key for key, value in keys if value == self.quorum)

    def quorum_reason(self, namespace: str = "") -> str:
        """Which key sets K, in words: ``K = 3 is set by lensemble.secagg-threshold
        (min-participants is 2)`` (each key written with ``namespace`` in front)."""
        named = [namespace + key for key in self.quorum_set_by]
        if len(named) == 2:
            return f"K = {self.quorum} is set by both {named[0]} and {named[1]}"
        other = (
            f"secagg-threshold is {self.secagg_threshold}"
            if self.quorum_set_by == ("min-participants",)
            else f"min-participants is {self.min_participants}"
        )
        return f"K = {self.quorum} is set by {named[0]} ({other})"

    @property
    def masked(self) -> bool:
        """Rounds are masked (secure aggregation, ``secagg-threshold`` > 0): the one test
        of it everywhere outside the coordinator's round mode."""
        return self.secagg_threshold > 0

    @property
    def sampled(self) -> bool:
        """Whether each attempt invites a sample rather than every reachable participant."""
        return self.sample_fraction < 1

    def sample_size(self, available: int) -> int:
        """How many of ``available`` participants an attempt invites: FedAvg's
        ``max(int(available * fraction), min)``, at least the quorum, at most all."""
        if not self.sampled:
            return available
        wanted = max(int(available * self.sample_fraction), self.sample_min, self.quorum)
        return min(available, wanted)


GUARDED_MAX_ABS_UPDATE = 64.0
"""``max-abs-update`` when unset (0), for protected releases (clipped, noised or masked),
unless the clip norm is larger."""


class AggregationConfig(_Section):
    """The exact fixed-point accumulator that sums released updates."""

    fraction_bits: int = Field(
        32, ge=8, le=40, description="Fixed-point grid 2**-fraction_bits of the exact sum."
    )
    max_abs_update: float = Field(
        0.0,
        ge=0,
        le=2.0**20,
        description="Largest |value| an update may carry (ingress check). 0: unset, which "
        "is max(64, clip-norm) when releases are clipped, noised or masked, and otherwise "
        "(stock ClientApps, as FedAvg) as large as the exact sum allows one update: half of "
        "2**62 / (largest weight * 2**fraction-bits), at most 2**20; at the defaults 8192 "
        'under weighting = "num-examples", 2**20 under uniform weighting.',
    )
    max_weight: int = Field(
        2**16, ge=1, le=2**30, description="Largest per-update weight (example count)."
    )
    fold_batch: int = Field(
        8, ge=1, le=64, description="Admitted updates folded per pass over the accumulator."
    )

    def plaintext_bound(self, largest_weight: int | None = None) -> float:
        """The ingress bound of unprotected releases: ``max-abs-update`` if set, else half
        of what one update of ``largest_weight`` (default ``max-weight``) may reach in the
        int64 sum, at most 2**20."""
        if self.max_abs_update > 0:
            return self.max_abs_update
        weight = self.max_weight if largest_weight is None else largest_weight
        return min(2.0**61 / (weight * 2.0**self.fraction_bits), 2.0**20)

    def guarded_bound(self, clip_norm: float = 0.0) -> float:
        """The ingress bound of protected releases (clipped, noised or masked):
        ``max-abs-update`` if set, else the larger of :data:`GUARDED_MAX_ABS_UPDATE` and
        ``clip_norm`` (a coordinate of a release clipped to that L2 norm can reach it; a
        masked sum adds up every member's bound)."""
        if self.max_abs_update > 0:
            return self.max_abs_update
        return max(GUARDED_MAX_ABS_UPDATE, clip_norm)

    @model_validator(mode="after")
    def _one_update_fits(self) -> AggregationConfig:
        if self.max_abs_update == 0:  # unset: resolved within what fits
            return self
        if self.max_abs_update * self.max_weight * 2.0**self.fraction_bits >= 2.0**62:
            raise ValueError(
                "max_abs_update * max_weight * 2**fraction_bits must stay below 2**62 "
                "so that a single update fits the int64 accumulator"
            )
        return self


class InnerLoopConfig(_Section):
    """The participant's H local AdamW steps."""

    steps: int = Field(10, ge=1, description="H, inner steps per round.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay.")
    batch_size: int = Field(32, ge=1, description="Examples per inner step.")
    deterministic: bool = Field(True, description="Run under torch.use_deterministic_algorithms.")


class OuterOptimizerConfig(_Section):
    """The DiLoCo outer step on the mean pseudo-gradient."""

    lr: float = Field(
        0.7,
        gt=0,
        description='Outer learning rate η. Unset or "auto": 0.7, under DP too '
        "(docs/privacy.md, *The outer step under DP*).",
    )
    momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description='Outer momentum μ. Unset or "auto": 0.9, and 0.5 under DP (noised '
        "releases; docs/privacy.md, *The outer step under DP*).",
    )
    nesterov: bool = Field(True, description="Nesterov momentum (else heavy ball).")


AUTO = "auto"
"""An ``outer-lr`` or ``outer-momentum`` left to lensemble: its default, or under DP
:data:`DP_OUTER_STEP`'s (a Flower app must list a key to let ``--run-config`` set it, so
"unset" needs a value)."""
DP_OUTER_STEP = {"lr": 0.7, "momentum": 0.5}
"""The outer step under DP, where the user did not set it: the best mean accuracy, and
never the worst, of the steps measured on the digits app under noise (FedAvg's lr 1,
momentum 0 was the worst on average; ``benchmarks/bench_dp_outer.py``, docs/privacy.md)."""


def _noised(privacy: Any) -> bool:
    """Whether raw privacy settings (a dict, a PrivacyConfig or None) add noise; a value
    that does not validate counts as not (its own section refuses it)."""
    if isinstance(privacy, PrivacyConfig):
        return privacy.noised
    if not isinstance(privacy, Mapping):
        return False
    try:
        return PrivacyConfig(**privacy).noised
    except (ConfigError, TypeError):
        return False


def resolve_outer_step(data: Any) -> Any:
    """LensembleConfig's raw ``data`` with every outer lr and momentum the user left to
    lensemble (unset, or ``"auto"``) set: the DP step (:data:`DP_OUTER_STEP`) when the
    privacy settings add noise, else the field's default. Explicit values are kept."""
    if not isinstance(data, Mapping):
        return data
    outer = data.get("outer", {})
    if isinstance(outer, OuterOptimizerConfig):
        given = {k: getattr(outer, k) for k in outer.model_fields_set}
    elif isinstance(outer, Mapping):
        given = {k: v for k, v in outer.items() if not (isinstance(v, str) and v == AUTO)}
    else:
        return data
    left = [k for k in DP_OUTER_STEP if k not in given]
    if not left:
        return data
    noised = _noised(data.get("privacy"))
    fields = OuterOptimizerConfig.model_fields
    chosen = {k: DP_OUTER_STEP[k] if noised else fields[k].default for k in left}
    return {**data, "outer": {**given, **chosen}}


class PrivacyConfig(_Section):
    """Differential privacy of each participant's release (see docs/privacy.md)."""

    clip_norm: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="L2 bound C of a release (0: no clipping)."
    )
    noise_multiplier: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="Noise std in units of C (0: no noise)."
    )
    dp_epsilon: float = Field(
        0.0,
        ge=0,
        description="Each participant's epsilon budget (on a Flower node: a request, at "
        "most the node's dp-epsilon-cap).",
    )
    dp_delta: float = Field(
        1e-5,
        gt=0,
        lt=1,
        description="The budget's delta (on a Flower node: must be the node's dp-delta).",
    )
    dp_accountant: Literal["rdp", "prv"] = Field(
        "rdp",
        description="Opacus accountant (prv: with dp-mode local only; on a Flower node: "
        "must be the node's dp-accountant).",
    )
    dp_adjacency: Adjacency = Field(
        "substitution",
        description="What epsilon protects: substitution, any change to a participant's "
        "whole dataset (sensitivity 2C); zero-out, its update against a zero update "
        "(sensitivity C, as add/remove of one update with no amplification claimed; half "
        "the noise at the same epsilon; that it took part stays public). On a Flower "
        "node: must be the node's dp-adjacency.",
    )
    dp_mode: Literal["local", "distributed"] = Field(
        "local",
        description="local: each participant adds the whole Gaussian noise to its own "
        "release; distributed: each member of a masked round adds a discrete Gaussian "
        "share in the masks' integer domain, so that the revealed sum carries the noise "
        "(needs secagg-threshold > 0 and uniform weighting).",
    )
    dp_rounds: int = Field(
        0,
        ge=0,
        le=10**6,
        description="Rounds the budget is planned for: with noise-multiplier 0, the noise "
        "is calibrated to spend dp-epsilon over them; with a noise multiplier, a plan the "
        "budget cannot cover is refused before any round (0: no plan).",
    )
    dp_overrun: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="Under sampling (sample-fraction < 1), the chance a participant is asked "
        "for more releases than the plan pays for: the plan covers the releases of "
        "dp-rounds rounds up to this tail (a participant asked more often refuses the "
        "extra ones; its budget holds).",
    )
    dp_state_dir: str = Field(
        "",
        description="Participant-side directory of budgets and commitment secrets "
        "('' : the default; on a Flower node the node's dp-budget-dir, which a run cannot "
        "change: anything else is refused).",
    )
    dp_release_metrics: bool = Field(
        False,
        description="Under DP or secure aggregation, also send each node's train loss and "
        "evaluation metrics (un-noised, per node); off: they never leave a participant. "
        "On a Flower node a request: a node whose own dp-release-metrics is not true "
        "refuses the run.",
    )

    @model_validator(mode="after")
    def _noise_needs_clip_and_budget(self) -> PrivacyConfig:
        if self.noise_multiplier > 0 and self.clip_norm <= 0:
            raise ValueError("noise-multiplier > 0 needs clip-norm > 0 (noise is calibrated to C)")
        if self.noise_multiplier > 0 and self.dp_epsilon <= 0:
            raise ValueError("noise-multiplier > 0 needs a dp-epsilon budget")
        if self.distributed and self.dp_accountant == "prv":
            raise ValueError(
                "dp-mode 'distributed' needs dp-accountant 'rdp': the revealed sum of "
                "discrete Gaussian shares is bounded in zCDP, which the RDP accountant "
                "composes as it is; PRV would account it as an exact Gaussian, which it "
                "is not"
            )
        if self.dp_rounds > 0 and (self.dp_epsilon <= 0 or self.clip_norm <= 0):
            raise ValueError(
                "dp-rounds plans a dp-epsilon budget for a clipped release: set dp-epsilon "
                "and clip-norm too"
            )
        return self

    @property
    def calibrated(self) -> bool:
        """The noise multiplier is calibrated to the budget (noise-multiplier 0, a plan of
        dp-rounds): ``privacy.calibration.noise_multiplier_of`` computes it."""
        return self.noise_multiplier == 0 and self.dp_rounds > 0

    @property
    def distributed(self) -> bool:
        """The noise is distributed: each member of a masked round adds a share of it
        (``dp-mode = "distributed"``), rather than each release its own (local)."""
        return self.dp_mode == "distributed"

    @property
    def noised(self) -> bool:
        """Releases carry Gaussian noise (an explicit or a calibrated noise multiplier)."""
        return self.noise_multiplier > 0 or self.calibrated


class ReleaseConfig(_Section):
    """How a participant encodes its release on the wire."""

    quantize: Literal["none", "int8"] = Field(
        "none",
        description="int8: per-tensor scale, unbiased stochastic rounding (~4x fewer bytes).",
    )


class RetentionConfig(_Section):
    """Which of the coordinator's checkpoints stay on disk (see docs/recovery.md). The
    ledger keeps every round's hashes whatever is pruned; the newest checkpoint and a
    pending external step's are never pruned (recovery and joining participants read
    them). These keys are the coordinator's own storage policy, not something the
    federation computes with: the run manifest does not record them, and a resumed run
    may change them."""

    keep_last_checkpoints: int = Field(
        0,
        ge=0,
        description="Keep the checkpoints of the newest N rounds and prune older ones "
        "(0: keep every checkpoint).",
    )
    keep_every_checkpoint: int = Field(
        0,
        ge=0,
        description="With keep-last-checkpoints: also keep the checkpoint of every K-th "
        "round (round 0, K, 2K, ...; 0: none beyond the newest N).",
    )

    @model_validator(mode="after")
    def _every_needs_last(self) -> RetentionConfig:
        if self.keep_every_checkpoint and not self.keep_last_checkpoints:
            raise ValueError(
                "keep-every-checkpoint needs keep-last-checkpoints > 0: without it every "
                "checkpoint is kept"
            )
        return self

    @property
    def prunes(self) -> bool:
        """Whether any checkpoint is ever pruned."""
        return self.keep_last_checkpoints > 0

    def keeps(self, round: int, head: int) -> bool:
        """Whether the checkpoint of θ_``round`` stays while round ``head`` is the newest
        committed one (θ_0 is round 0)."""
        if not self.prunes or round > head - self.keep_last_checkpoints:
            return True
        return self.keep_every_checkpoint > 0 and round % self.keep_every_checkpoint == 0


class GaugeConfig(_Section):
    """Gauge alignment: each participant rotates its latent frame onto the global one on a
    pinned public probe before it releases anything (see docs/gauge.md)."""

    align: bool = Field(False, description="Participant-side Procrustes alignment before release.")
    sketch_rows: int = Field(
        32, ge=1, le=4096, description="Rows m of the round's probe sketch A (m x probe size)."
    )
    max_condition: float = Field(
        1e6,
        gt=1,
        description="Largest condition number of the probe cross-covariance accepted as is.",
    )
    conditioning: Literal["ridge", "refuse"] = Field(
        "ridge",
        description="Ill-conditioned cross-covariance: add a ridge and retry once, or refuse.",
    )
    ridge: float = Field(
        1e-3, gt=0, description="The ridge, relative to the largest singular value."
    )
    drift_threshold: float = Field(
        0.0, ge=0, description="frame_drift above this is reported (0: never)."
    )
    warm_start_hash: str = Field(
        "", description="Round-0 encoder hash every joiner must match ('' : not checked)."
    )
    coordinator_harness: bool = Field(
        False,
        description="Plaintext research only: the coordinator aligns each raw update.",
    )


class ParamGroupsConfig(_Section):
    """Which parameter names are shared and which stay local.

    A name belongs to a group entry ``g`` if it equals ``g`` or starts with ``g + "."``.
    The entry ``"*"`` in ``shared`` (the default) means every name that is not local, so a
    model that declares no groups federates all of its floating-point arrays. A model
    with parts that must stay on a node (the world model's ``action_head``) names them in
    ``local``; a pattern that matches none of the model's names is a ``ConfigError``.
    """

    shared: tuple[str, ...] = Field(
        ("*",),
        description="Shared groups (comma-separated; '*': every floating-point array).",
    )
    local: tuple[str, ...] = Field(
        (), description="Groups that never leave a participant (comma-separated)."
    )
    averaged: tuple[str, ...] = Field(
        ("*.running_mean", "*.running_var", "running_mean", "running_var"),
        description="Shared arrays that take plain averaging (FedAvg's), not the outer "
        "step: statistics such as BatchNorm's running mean and variance (glob patterns).",
    )

    def is_averaged(self, name: str) -> bool:
        """True if ``name`` is stepped by plain averaging (matches an ``averaged`` glob)."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.averaged)

    @field_validator("shared", "local", "averaged", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @model_validator(mode="after")
    def _disjoint(self) -> ParamGroupsConfig:
        if not self.shared:
            raise ValueError("shared must name at least one group")
        overlap = set(self.shared) & set(self.local)
        if overlap:
            raise ValueError(f"groups both shared and local: {sorted(overlap)}")
        if "*" in self.local:
            raise ValueError("'*' is only meaningful in shared")
        return self


_SECTIONS: dict[str, tuple[str, type[_Section]]] = {
    # field name in LensembleConfig -> (run_config key prefix, section type)
    "federation": ("", FederationConfig),
    "aggregation": ("", AggregationConfig),
    "inner": ("inner-", InnerLoopConfig),
    "outer": ("outer-", OuterOptimizerConfig),
    "groups": ("", ParamGroupsConfig),
    "privacy": ("", PrivacyConfig),
    "release": ("", ReleaseConfig),
    "gauge": ("gauge-", GaugeConfig),
    "retention": ("", RetentionConfig),
}
UNRECORDED_SECTIONS = frozenset({"retention"})
"""Sections the run manifest does not record: how the coordinator keeps its own disk, not
what the federation computes (a run's hashes do not depend on them)."""
_GROUP_KEYS = {"shared": "shared-groups", "local": "local-groups", "averaged": "averaged-groups"}


def run_config_keys() -> dict[str, tuple[str, str]]:
    """Map every flat run_config key to its (section, field)."""
    keys: dict[str, tuple[str, str]] = {}
    for section, (prefix, model) in _SECTIONS.items():
        for field in model.model_fields:
            key = _GROUP_KEYS.get(field) if section == "groups" else None
            key = key or prefix + field.replace("_", "-")
            assert key not in keys, f"run_config key collision: {key}"
            keys[key] = (section, field)
    return keys


def closest_key(key: str, known: Iterable[str]) -> str | None:
    """The known key ``key`` most likely meant to be, or None: compared with ``_`` read
    as ``-`` and case ignored, so ``lensemble.outer_lr`` finds ``lensemble.outer-lr``."""
    by_form = {k.lower().replace("_", "-"): k for k in known}
    close = difflib.get_close_matches(key.lower().replace("_", "-"), list(by_form), n=1)
    return by_form[close[0]] if close else None


def _unrecorded_keys() -> set[str]:
    return {k for k, (section, _) in run_config_keys().items() if section in UNRECORDED_SECTIONS}


RECORDED_UNLESS_DEFAULT = {
    "dp-adjacency": "substitution",
    "deadline-mode": "fixed",
    "deadline-floor": 10.0,
    "deadline-cap": 600.0,
    "deadline-margin": 3.0,
}
"""Keys added after runs were recorded without them, whose default is what those runs
did: the manifest records them only when they are set to something else, so a run of the
default keeps the manifest header (and every ledger hash after it) it had, and a run
recorded before the key existed resumes."""


_PROTECTIVE_FIELDS = {
    ("federation", "secagg_threshold"),
    ("federation", "secagg_neighbours"),
    ("federation", "require_binding"),
    ("federation", "require_signatures"),
}


def protects(key: str) -> bool:
    """Whether a run_config key changes how participants protect what they release
    (privacy, encoding, masking, binding, which arrays leave a node)."""
    section, field = run_config_keys()[key]
    return section in ("privacy", "release", "groups") or (section, field) in _PROTECTIVE_FIELDS


def _error_from(exc: ValidationError, owner: str) -> ConfigError:
    first = exc.errors()[0]
    field = ".".join([owner, *(str(p) for p in first["loc"])])
    if not first["loc"]:  # a check across the section's fields: its message names them
        return ConfigError(field, first["msg"].removeprefix("Value error, "))
    return ConfigError(field, f"{first['msg']} (got {first.get('input')!r})")


class LensembleConfig(_Section):
    """Everything a federation needs to agree on. Frozen; hashable into the run manifest."""

    federation: FederationConfig = FederationConfig()
    aggregation: AggregationConfig = AggregationConfig()
    inner: InnerLoopConfig = InnerLoopConfig()
    outer: OuterOptimizerConfig = OuterOptimizerConfig()
    groups: ParamGroupsConfig = ParamGroupsConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    release: ReleaseConfig = ReleaseConfig()
    gauge: GaugeConfig = GaugeConfig()
    retention: RetentionConfig = RetentionConfig()

    def check_recorded(self, recorded: Mapping[str, Any]) -> None:
        """Refuse to continue a run recorded with another configuration (the keys of
        :data:`UNRECORDED_SECTIONS` are not compared: a resumed run may change them).

        Raises:
            ConfigError: naming the run_config keys that differ.
        """
        given = self.to_recorded()
        recorded = {k: v for k, v in recorded.items() if k not in _unrecorded_keys()}
        if dict(recorded) != given:
            differ = sorted(
                k for k in recorded.keys() | given.keys() if recorded.get(k) != given.get(k)
            )
            shown = ", ".join(
                f"{k}: recorded {recorded.get(k)!r}, given {given.get(k)!r}" for k in differ[:8]
            )
            raise ConfigError(
                "config",
                f"differs from the run's recorded configuration in {differ} ({shown}): "
                "give the recorded values to continue this run",
            )

    @property
    def largest_weight(self) -> int:
        """The largest weight an update can carry in the sum: 1 under uniform weighting
        (:meth:`FederationConfig.weight_of`), else ``max-weight``."""
        if self.federation.weighting == "uniform":
            return 1
        return self.aggregation.max_weight

    @property
    def protected_releases(self) -> list[str]:
        """The settings (run_config keys) under which participants protect what they
        release: clipping, noise, quantization, masking. A coordinator-side transform of
        individual updates is refused under any of them."""
        return [
            key
            for key, on in (
                ("clip-norm", self.privacy.clip_norm > 0),
                ("noise-multiplier", self.privacy.noised),
                ("quantize", self.release.quantize != "none"),
                ("secagg-threshold", self.federation.masked),
            )
            if on
        ]

    @model_validator(mode="before")
    @classmethod
    def _outer_step_under_dp(cls, data: Any) -> Any:
        return resolve_outer_step(data)

    @model_validator(mode="after")
    def _distributed_noise_needs_masked_sums(self) -> LensembleConfig:
        if not self.privacy.distributed:
            return self
        if not self.privacy.noised:
            raise ConfigError(
                "dp-mode",
                "distributed noise needs noise: a noise-multiplier, or dp-epsilon with "
                "dp-rounds to calibrate one",
            )
        if not self.federation.masked:
            raise ConfigError(
                "dp-mode",
                "distributed noise is added to masked inputs and only their sum is "
                "revealed; plaintext rounds would reveal each under-noised update: set "
                "secagg-threshold > 0, or use dp-mode = local",
            )
        if self.federation.weighting != "uniform":
            raise ConfigError(
                "dp-mode",
                "distributed noise is calibrated to a sum of clipped updates of weight "
                "1; weighting by num-examples would scale one participant's influence: "
                'set lensemble.weighting = "uniform" (federation.weighting in Python)',
            )
        if self.release.quantize != "none":
            raise ConfigError(
                "dp-mode",
                "distributed noise is added on the exact fixed-point grid: quantize must be none",
            )
        return self

    @model_validator(mode="after")
    def _harness_is_plaintext_only(self) -> LensembleConfig:
        if self.gauge.coordinator_harness and self.protected_releases:
            raise ConfigError(
                "gauge-coordinator-harness",
                f"the coordinator-side alignment harness sees individual plaintext updates; "
                f"it cannot be combined with {self.protected_releases}",
            )
        if self.gauge.coordinator_harness and self.gauge.align:
            raise ConfigError(
                "gauge-coordinator-harness",
                "participants already align (gauge-align); aligning again at the "
                "coordinator would do the work twice",
            )
        return self

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> LensembleConfig:
        """Build a config from a Flower ``run_config`` (e.g. ``context.run_config``).

        lensemble's keys are the ones under the ``lensemble.`` namespace (an app's
        ``[tool.flwr.app.config.lensemble]`` table); every other key belongs to the app
        and is neither read nor checked, even where its name is also one of lensemble's keys
        (Flower's fl-dp-sa app declares its own ``noise-multiplier``; an info line says
        which ``lensemble.`` key applies instead). Keys missing from the namespace keep
        their defaults.

        Raises:
            ConfigError: an unknown key in the namespace (the message suggests the
                closest known one) or a bad value; the message names the run_config key.
        """
        flat = {k[len(NAMESPACE) :]: v for k, v in run_config.items() if k.startswith(NAMESPACE)}
        same_names = sorted(k for k in run_config if k in run_config_keys())
        if same_names:  # the app's own keys (fl-dp-sa's noise-multiplier): said, never read
            log.info(
                "run_config keys %s are the app's own: lensemble reads only %s (a "
                "[tool.flwr.app.config.lensemble] table)",
                same_names,
                [NAMESPACE + k for k in same_names],
            )
        try:
            return cls.from_flat(flat)
        except ConfigError as exc:
            if exc.field in run_config_keys() or exc.field in flat:
                reason = exc.reason.replace("did you mean '", f"did you mean '{NAMESPACE}")
                raise ConfigError(NAMESPACE + exc.field, reason) from None
            raise

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> LensembleConfig:
        """Build a config from un-namespaced kebab-case keys (what :meth:`to_flat` gives,
        and what the run manifest records). Every key must be a lensemble key.

        Raises:
            ConfigError: an unknown key (with the closest known one) or a bad value; the
                message names the key.
        """
        keys = run_config_keys()
        nested: dict[str, dict[str, Any]] = {}
        for key, value in flat.items():
            if key not in keys:
                close = closest_key(key, keys)
                hint = f"; did you mean {close!r}?" if close else ""
                raise ConfigError(key, f"unknown lensemble run_config key{hint}")
            section, field = keys[key]
            nested.setdefault(section, {})[field] = value
        try:
            return cls(**nested)
        except ConfigError as exc:
            names = {f"{_SECTIONS[s][1].__name__}.{f}": k for k, (s, f) in keys.items()}
            if exc.field in names:
                raise ConfigError(names[exc.field], exc.reason) from None
            raise

    def to_flat(self) -> dict[str, Any]:
        """Every key with its value, un-namespaced (what the run manifest records and
        :meth:`from_flat` reads back to ``self``)."""
        flat: dict[str, Any] = {}
        for key, (section, field) in run_config_keys().items():
            value = getattr(getattr(self, section), field)
            flat[key] = ",".join(value) if isinstance(value, tuple) else value
        return flat

    def to_recorded(self) -> dict[str, Any]:
        """:meth:`to_flat` without the keys of :data:`UNRECORDED_SECTIONS`: what the run
        manifest records (and the ledger commits to through its header digest)."""
        return {
            k: v
            for k, v in self.to_flat().items()
            if k not in _unrecorded_keys()
            and not (k in RECORDED_UNLESS_DEFAULT and v == RECORDED_UNLESS_DEFAULT[k])
        }

    def to_run_config(self) -> dict[str, Any]:
        """The namespaced run_config (``lensemble.<key>``) that :meth:`from_run_config`
        reads back to ``self``."""
        return {NAMESPACE + key: value for key, value in self.to_flat().items()}


def run_config_table() -> str:
    """Every run_config key with its field, default and meaning, as markdown (for the docs)."""
    defaults = LensembleConfig()
    rows = ["| run_config key | field | default | meaning |", "| --- | --- | --- | --- |"]
    for key, (section, field) in run_config_keys().items():
        info = type(getattr(defaults, section)).model_fields[field]
        value = getattr(getattr(defaults, section), field)
        shown = ",".join(value) if isinstance(value, tuple) else value
        rows.append(f"| `{key}` | `{section}.{field}` | `{shown!r}` | {info.description} |")
    return "\n".join(rows)


def metrics_released(config: LensembleConfig) -> bool:
    """Whether a participant sends per-node metrics (train loss, evaluation): always,
    except under DP (they are not noised) or secure aggregation (only the sum is to be
    learnt), where ``dp-release-metrics`` must opt in."""
    private = config.privacy.noised or config.federation.masked
    return not private or config.privacy.dp_release_metrics
