"""The participant: holds its data, trains H inner steps, releases a bound pseudo-gradient.

The participant never sends anything but a :class:`Commitment` (its dataset Merkle root,
once, until the coordinator says it is bound) and an :class:`Update` (the output of its
release pipeline). Its model, inner optimizer state, local groups (action heads) and data
stay with it.
"""

from __future__ import annotations

import logging
from typing import Any

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig, default_state_dir
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    LensembleError,
    ResidencyViolation,
    RoundError,
)
from lensemble_flwr.gauge.runtime import (
    GaugeSetup,
    check_round_open,
    check_warm_start_at_t0,
    require_setup,
)
from lensemble_flwr.identity.endorsement import endorsement_fields
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.params import NamedArrays, is_shared
from lensemble_flwr.participant.budget_check import budget_refusal
from lensemble_flwr.participant.local_training import (
    LocalTraining,
    PortableState,
    Trainer,
    as_local_training,
    deterministic_algorithms,
    run_inner_loop,
)
from lensemble_flwr.participant.recovery import recover_checkpoint
from lensemble_flwr.participant.release_chain import release_pipeline, with_mask
from lensemble_flwr.protocol.messages import (
    Commitment,
    ParticipantMessage,
    Refusal,
    RoundClose,
    RoundOpen,
    SurvivorCheck,
    UnmaskRequest,
    Update,
    WirePayload,
    from_wire,
    to_wire,
)
from lensemble_flwr.protocol.state import GlobalState, PseudoGradient
from lensemble_flwr.provenance.commitment_secret import commitment_secret
from lensemble_flwr.provenance.merkle import merkle_root
from lensemble_flwr.release import Release, ReleaseContext, ReleaseTransform
from lensemble_flwr.release.quantize import dequantize
from lensemble_flwr.release.state_codec import export_release_state, import_release_state
from lensemble_flwr.secagg.participant_role import MaskingRole, MaskRound, masked_answer
from lensemble_flwr.transports.base import Transport

__all__ = [
    "Participant",
    "Trainer",
    "deterministic_algorithms",
    "run_inner_loop",
    "training_state",
]

log = logging.getLogger(__name__)

_TRAINING = "training/"  # where exported state keeps the LocalTraining's arrays
_RELEASE = "release/"  # ... and the release pipeline's arrays


def training_state(state: PortableState) -> PortableState:
    """The LocalTraining's part of what :meth:`Participant.export_state` returned (its
    inner optimizer, local groups such as action heads): for an app that rebuilds its
    model from a node's saved state outside a round, e.g. to evaluate with its own head."""
    cut = len(_TRAINING)
    arrays = {k[cut:]: v for k, v in state.arrays.items() if k.startswith(_TRAINING)}
    return PortableState(arrays=arrays, meta=state.meta.get("training") or {})


class Participant:
    """One sovereign node of the federation.

    Args:
        config: the federation's config (must match the coordinator's).
        participant_id: this node's stable identity.
        transport: its end of the transport; replies go to whoever opened the round.
        trainer: a :class:`Trainer` (trained with AdamW for H steps) or any
            :class:`~lensemble_flwr.participant.local_training.LocalTraining`.
        pipeline: the release chain; defaults to what the config asks for (see
            :func:`~lensemble_flwr.participant.release_chain.release_pipeline`):
            difference → bind, or difference alone for a participant that cannot commit
            to its data, with clip, noise, quantize and mask as configured. A masked
            federation's custom chain without a mask stage gets one before bind
            (:func:`~lensemble_flwr.participant.release_chain.with_mask`).
        gauge: the model's gauge adapter and the pinned probe; required when the config
            aligns latent frames (``gauge-align``).
        identity: the participant's signing key; every message it sends is signed, and
            its Commitment registers the public key with the coordinator.
        stable_id: the identity its privacy budget and its commitment secret are kept
            under, which must not change between runs (default: its identity key's
            fingerprint when it has one, else ``participant_id``).
    """

    def __init__(
        self,
        config: LensembleConfig,
        *,
        participant_id: str,
        transport: Transport,
        trainer: Trainer | LocalTraining,
        pipeline: ReleaseTransform | None = None,
        gauge: GaugeSetup | None = None,
        identity: IdentityKey | None = None,
        stable_id: str | None = None,
    ) -> None:
        require_setup(config, gauge)
        self.config = config
        self.gauge = gauge
        self.identity = identity
        self.participant_id = participant_id
        self.transport = transport
        self.trainer = trainer
        self.training = as_local_training(trainer, config)
        self.stable_id = stable_id or (
            f"key-{identity.fingerprint}" if identity is not None else participant_id
        )
        records = self.training.dataset_records()
        self.dataset_root: str | None = None
        if records is not None:  # a hiding commitment: salted under a secret kept locally
            state_dir = config.privacy.dp_state_dir or default_state_dir()
            secret = commitment_secret(state_dir, self.stable_id)
            self.dataset_root = merkle_root(records, secret)
        # the default chain's budget is looked at before training (budget_check)
        self._budget_key = self.stable_id if pipeline is None else None
        if pipeline is None:
            pipeline = release_pipeline(
                config,
                participant_id=participant_id,
                dataset_root=self.dataset_root,
                gauge=gauge,
                budget_key=self.stable_id,
            )
        self.pipeline = with_mask(pipeline, config)  # masked federations mask in the chain
        self._pipeline_state: Any = None
        self._last_open: tuple[int, int, int] | None = None
        self.masking = MaskingRole(participant_id)
        self.last_close: RoundClose | None = None

    @property
    def last_loss(self) -> float | None:
        """Loss of the last inner step (when the training reports one)."""
        return getattr(self.training, "last_loss", None)

    @property
    def pipeline_state(self) -> Any:
        """The release chain's state (None until its first release): a value, which
        :meth:`export_state` carries to the participant's next message. A noise stage's
        entry is the privacy charge (:class:`~lensemble_flwr.release.PrivacyState`)."""
        return self._pipeline_state

    @property
    def last_answered(self) -> tuple[int, int, int] | None:
        """(round, attempt, member count) of the last RoundOpen answered: a participant
        answers each attempt once."""
        return self._last_open

    # -- the protocol ------------------------------------------------------------------
    def handle(self, payload: WirePayload) -> None:
        """React to one payload from the coordinator (invalid ones are logged and dropped)."""
        try:
            message = from_wire(payload)
        except RoundError as exc:
            log.warning("%s: rejected at ingress: %s", self.participant_id, exc)
            return
        if isinstance(message, RoundOpen):
            self._on_round_open(message)
        elif isinstance(message, (UnmaskRequest, SurvivorCheck)):
            self._on_masked_request(message)
        elif isinstance(message, RoundClose):
            if self.last_close is None or message.round >= self.last_close.round:
                self.last_close = message  # the newest close: the head join trusts
        else:
            log.warning("%s: ignoring unexpected %s", self.participant_id, message.kind)

    def _on_round_open(self, msg: RoundOpen) -> None:
        """Answer a RoundOpen: commit when asked, then release into the round (or refuse).

        The walk of one update: the masking role opens the round (checks, keys), the
        LocalTraining trains, the release chain releases (masked, in a masked round), and
        the Update leaves; nothing goes back to an earlier module.
        """
        opened = (msg.round, msg.attempt, len(msg.secagg_members))
        if self._last_open == opened:
            return  # a duplicate RoundOpen; this attempt was already answered
        state = self._global_state_of(msg)
        if state is None:
            return
        self._last_open = opened
        common = {
            "run_id": msg.run_id,
            "round": msg.round,
            "attempt": msg.attempt,
            "sender": self.participant_id,
            "participant_id": self.participant_id,
        }
        masked_round = self.config.federation.masked
        try:
            check_round_open(
                self.gauge,
                self.config,
                round=msg.round,
                probe_hash=msg.probe_hash,
                landmark_hashes=msg.landmark_hashes,
                params=msg.params,
            )
        except LensembleError as exc:  # ProbeError, GaugeError: this round is rejected
            log.warning("%s: rejects round %d: %r", self.participant_id, msg.round, exc)
            self._refuse(msg, common, exc)
            return
        if msg.needs_commitment and self.dataset_root is not None:
            self._send(msg.sender, self._commitment(common, masked_round))
        if self._budget_refuses(msg, common, state):  # found before the inner loop runs
            return
        try:  # before training: a round it will refuse spends no budget
            mask_round = self.masking.open_round(msg, self.config) if masked_round else None
        except LensembleError as exc:
            log.warning("%s: releases nothing in round %d: %r", self.participant_id, msg.round, exc)
            self._refuse(msg, common, exc)
            return
        if masked_round and mask_round is None:
            return  # not (yet) a member of this masked round: committing was the answer
        try:
            release = self._release(state, msg.sketch_seed, mask_round)
        except BaseException as exc:
            if mask_round is not None:  # nothing released: the round's key is unused
                self.masking.restore(mask_round.before)
            if not isinstance(exc, LensembleError):
                raise  # a trainer's own error propagates, as it always did
            log.warning("%s: releases nothing in round %d: %r", self.participant_id, msg.round, exc)
            self._refuse(msg, common, exc)
            return
        self._send(msg.sender, self._update_of(common, release))

    def _budget_refuses(self, msg: RoundOpen, common: dict[str, Any], state: GlobalState) -> bool:
        """Refuse the round (True) when the default chain's budget cannot pay for it."""
        error = budget_refusal(self.config, self._budget_key, state.params)
        if error is not None:
            log.warning("%s: refuses round %d: %s", self.participant_id, msg.round, error)
            self._refuse(msg, common, error)
        return error is not None

    def _global_state_of(self, msg: RoundOpen) -> GlobalState | None:
        """The global state ``msg`` broadcasts, verified (None, logged, if it does not
        hold the params its hash names)."""
        state = GlobalState(
            round=msg.round - 1,  # round r starts from θ_{r-1}
            params=dict(msg.params),
            params_hash=msg.global_hash,
            sketch_seed=msg.sketch_seed,
            h_steps=msg.h_steps,
            probe_hash=msg.probe_hash,
            landmark_hashes=msg.landmark_hashes,
        )
        try:
            state.verify()
        except CheckpointIntegrityError as exc:
            log.warning("%s: refusing round %d: %s", self.participant_id, msg.round, exc)
            return None
        return state

    def _commitment(self, common: dict[str, Any], masked_round: bool) -> Commitment:
        """This participant's Commitment (with its masking keys for a masked federation)."""
        assert self.dataset_root is not None  # the caller checks
        keys = self.masking.keys_for_commitment() if masked_round else {}
        return Commitment(
            **common,
            dataset_root=self.dataset_root,
            num_examples=self.training.num_examples(),
            identity_key=self.identity.public_openssh if self.identity else None,
            **keys,
            **endorsement_fields(self.identity, self.last_close),
        )

    def _refuse(self, msg: RoundOpen, common: dict[str, Any], exc: LensembleError) -> None:
        self._send(msg.sender, Refusal(**common, error=type(exc).__name__, reason=str(exc)[:2000]))

    def _update_of(self, common: dict[str, Any], release: Release) -> Update:
        """The Update carrying ``release`` (the chain's output) into the round."""
        meta = release.metadata
        fields: dict[str, Any] = {
            "dataset_root": release.bound_root,
            "delta": release.delta,
            "num_examples": meta["num_examples"],
            "transforms": release.applied,
            "epsilon": meta.get("epsilon"),
            "sketch_fingerprint": meta.get("sketch_fingerprint"),
        }
        if release.masked:
            fields |= {
                "l2_norm": None,
                "scales": None,
                "masked": True,
                "sealed_shares": meta["sealed_shares"],
                "next_mask_key": meta["next_mask_key"],
            }
        else:
            fields |= {"l2_norm": meta["released_norm"], "scales": meta.get("scales")}
        return Update(**common, **fields, **endorsement_fields(self.identity, self.last_close))

    def _send(self, dest: str, message: ParticipantMessage) -> None:
        """Sign (when this participant has an identity) and send."""
        if self.identity is not None:
            seed = derive_seed(self.config.federation.root_seed, "round", message.round)
            message = self.identity.sign(message, seed)
        self.transport.send(dest, message)

    def _on_masked_request(self, request: UnmaskRequest | SurvivorCheck) -> None:
        """Disclose (an UnmaskRequest) or attest the survivor set to the other survivors
        (a SurvivorCheck: a masked round with drops); a refused request gets no answer."""
        try:
            answer = masked_answer(self.masking, request)
        except LensembleError as exc:
            what = "attestation" if isinstance(request, SurvivorCheck) else "disclosure"
            log.warning("%s: no %s for round %d: %r", self.participant_id, what, request.round, exc)
            return
        self._send(request.sender, answer)

    # -- the spec's surface ------------------------------------------------------------
    def local_round(self, global_state: GlobalState, round_seed: int) -> PseudoGradient:
        """Train H inner steps from ``global_state`` and release the (bound) delta, in the
        clear (a masked federation's chain refuses: it releases only into a masked round).

        Raises:
            ParameterMismatch: the global params do not fit the model.
            ResidencyViolation: the release carries a name outside the shared groups, or
                one the coordinator did not broadcast.
            DegenerateProcrustes: alignment is on and the probe cannot fix the frame.
            GaugeError: ``global_state`` is θ_0 and its encoder is not the agreed warm
                start (INV-WARMSTART-T0: checked here too, for a caller that trains
                without a RoundOpen).
            RoundError: the pipeline did not produce a delta bound as it should be.
        """
        check_warm_start_at_t0(
            self.gauge, self.config, round=global_state.next_round, params=global_state.params
        )
        release = self._release(global_state, round_seed, None)
        assert release.delta is not None  # _release checks
        return PseudoGradient(
            participant_id=self.participant_id,
            round=global_state.next_round,
            delta=release.delta,
            l2_norm=release.metadata["released_norm"],
            scales=release.metadata.get("scales"),
            dataset_root=release.bound_root,
            num_examples=release.metadata["num_examples"],
            transforms=release.applied,
            epsilon=release.metadata.get("epsilon"),
            sketch_fingerprint=release.metadata.get("sketch_fingerprint"),
        )

    def _release(
        self, global_state: GlobalState, round_seed: int, mask_round: MaskRound | None
    ) -> Release:
        """Train, then run the release chain once: what it returns is what leaves.

        ``metadata`` gains ``num_examples`` (after fit: a NumPyClient reports it there)
        and, for a release in the clear, ``released_norm`` (the norm of exactly what is
        released). Raises what :meth:`local_round` lists.
        """
        local = self.training.fit(
            global_state.params,
            steps=global_state.h_steps,
            seed=derive_seed(round_seed, "inner", self.participant_id),
        )
        chain_state = self._pipeline_state
        if chain_state is None:
            chain_state = self.pipeline.init(global_state.params)
        ctx = ReleaseContext(
            participant_id=self.participant_id,
            global_state=global_state,
            round_seed=round_seed,
            dataset_root=self.dataset_root,
            num_examples=self.training.num_examples(),
            mask_round=mask_round,
        )
        release, self._pipeline_state = self.pipeline.update(Release(local=local), chain_state, ctx)
        if release.delta is None or release.bound_root != self.dataset_root:
            raise RoundError(f"{self.participant_id}: the pipeline did not bind its delta")
        if release.noise_share is not None:  # charged for, but no mask stage added it
            raise RoundError(
                f"{self.participant_id}: the release chain drew a distributed noise share "
                "that no mask stage added (distributed noise needs a masked federation)"
            )
        self._check_residency(release.delta, global_state)
        meta = {**release.metadata, "num_examples": ctx.num_examples}
        if not release.masked:
            scales = meta.get("scales")
            released = dequantize(release.delta, scales) if scales else release.delta
            meta["released_norm"] = l2_norm(released)
        return release.replace(metadata=meta)

    def _check_residency(self, delta: NamedArrays, global_state: GlobalState) -> None:
        """Only shared, broadcast arrays may leave.

        Raises:
            ResidencyViolation: a name outside the shared groups, or one the coordinator
                did not broadcast.
        """
        beyond = sorted(set(delta) - set(global_state.params))
        if beyond:  # whatever the groups say, only what was broadcast may go back
            raise ResidencyViolation(
                f"{self.participant_id}: a release may carry only the broadcast arrays, "
                f"not {beyond}"
            )
        leaked = sorted(n for n in delta if not is_shared(n, self.config.groups))
        if leaked:  # action heads and other local groups never leave the participant
            raise ResidencyViolation(
                f"{self.participant_id}: a release may carry only shared parameters, not {leaked}"
            )

    def join(self, coordinator_endpoint: str, *, expect_head: str | None = None) -> GlobalState:
        """Recover the latest committed global state from the run directory and verify it.

        A rejoiner's stale local state (inner optimizer, last answered round) is discarded.

        Args:
            coordinator_endpoint: the coordinator's run directory (its artifact store).
            expect_head: the record hash the newest record must carry, held outside the
                run directory (an operator's pin, another participant's RoundClose).

        The ledger is checked as a chain, not only its head: every record's hash and its
        links back to the manifest's θ_0 (a forged, resealed head would otherwise pass
        with a checkpoint to match), and the newest RoundClose this participant received
        — the head it trusts — must be in it, with the same record and global hash.
        Records must carry the endorsements their policy requires (identity/endorsement.py);
        an unendorsed newest record without a RoundClose or ``expect_head`` is joined with
        a warning.

        Raises:
            CheckpointIntegrityError: the checkpoint's bytes or params do not match the
                hash the ledger (or manifest) records for it, or the ledger does not hold
                the round this participant saw closed.
            LedgerError: the ledger's chain is broken, a record lacks its endorsements,
                or the newest record is not ``expect_head``.
        """
        checkpoint = recover_checkpoint(
            Store(coordinator_endpoint), self.last_close, self.participant_id, expect_head
        )
        # a (re)joiner at θ_0 revalidates the warm start
        check_warm_start_at_t0(
            self.gauge, self.config, round=checkpoint.round + 1, params=checkpoint.params
        )
        state = GlobalState.create(
            checkpoint.round,
            checkpoint.params,
            sketch_seed=derive_seed(
                self.config.federation.root_seed, "round", checkpoint.round + 1
            ),  # the seed of the round that starts from θ_{checkpoint.round}
            h_steps=self.config.inner.steps,
        )
        self.training.forget()
        self._last_open = None
        log.info(
            "%s: joined at round %d (%s…)",
            self.participant_id,
            state.next_round,
            state.params_hash[:12],
        )
        return state

    # -- state that must outlive a process ---------------------------------------------
    def export_state(self) -> PortableState:
        """Everything this participant must remember until its next message: the last
        round it answered, its masking keys, its LocalTraining's state (arrays under
        ``training/``) and the state of every release stage (arrays under ``release/``,
        described by ``meta["release"]``; see :mod:`lensemble_flwr.release.state_codec`).

        Raises:
            ConfigError: a release stage keeps state that cannot be exported (the error
                names the stage); nothing is silently left out.
        """
        release_arrays, release_meta = export_release_state(self.pipeline, self._pipeline_state)
        inner = self.training.export_state()
        meta = {
            "last_open": list(self._last_open) if self._last_open else None,
            "last_close": to_wire(self.last_close) if self.last_close else None,
            "training": inner.meta,
            "masking": self.masking.export(),
            "release": release_meta,
        }
        arrays = {f"{_TRAINING}{k}": v for k, v in inner.arrays.items()}
        arrays.update({f"{_RELEASE}{k}": v for k, v in release_arrays.items()})
        return PortableState(arrays=arrays, meta=meta)

    def import_state(self, state: PortableState) -> None:
        """Restore what :meth:`export_state` returned (a fresh participant if empty; a
        state saved before release states were exported restores an uninitialised
        pipeline state).

        Raises:
            RoundError: the release state is malformed or does not fit this participant's
                pipeline; the participant is left unchanged.
        """
        cut = len(_RELEASE)
        release_arrays = {k[cut:]: v for k, v in state.arrays.items() if k.startswith(_RELEASE)}
        release_meta = state.meta.get("release")
        if release_meta is None:
            if release_arrays:
                raise RoundError("release state: arrays without a description")
            pipeline_state = None
        else:
            pipeline_state = import_release_state(self.pipeline, release_arrays, release_meta)
        last_open = state.meta.get("last_open")
        close = state.meta.get("last_close")
        if isinstance(close, dict) and isinstance(close.get("contributors"), list):
            # saved by an earlier version, whose close listed the contributors' ids
            close = {k: v for k, v in close.items() if k != "contributors"} | {
                "count": len(close["contributors"])
            }
        last_close = from_wire(close) if close else None  # RoundError: nothing restored yet
        if last_close is not None and not isinstance(last_close, RoundClose):
            raise RoundError("a participant's saved last_close is not a RoundClose")
        self._last_open = tuple(last_open) if last_open else None  # type: ignore[assignment]
        self.last_close = last_close
        self.masking.restore(state.meta.get("masking") or {})
        self.training.import_state(training_state(state))
        self._pipeline_state = pipeline_state
