"""The participant: holds its data, trains H inner steps, releases a bound pseudo-gradient.

The participant never sends anything but a :class:`Commitment` (its dataset Merkle root)
and an :class:`Update` (the output of its release pipeline). Its model, inner optimizer
state, local groups (action heads) and data stay with it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import derive_seed
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.errors import (
    CheckpointIntegrityError,
    LensembleError,
    ResidencyViolation,
    RoundError,
)
from lensemble_flwr.federation.messages import (
    Commitment,
    RoundClose,
    RoundOpen,
    Update,
    WirePayload,
    from_wire,
)
from lensemble_flwr.federation.round import GlobalState, PseudoGradient, l2_norm
from lensemble_flwr.federation.transport import Transport
from lensemble_flwr.params import export_shared, is_shared, load_shared
from lensemble_flwr.provenance.ledger import Ledger, RunManifest
from lensemble_flwr.provenance.merkle import merkle_root
from lensemble_flwr.release import Release, ReleaseContext, ReleaseTransform, default_pipeline

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """A participant's model and private data, as the inner loop needs them."""

    model: torch.nn.Module

    def num_examples(self) -> int:
        """Number of private training examples."""

    def dataset_records(self) -> Iterable[bytes]:
        """Canonical bytes of every private example, in a fixed order (the Merkle leaves)."""

    def sample_batch(self, generator: torch.Generator, batch_size: int) -> Any:
        """A training batch drawn with ``generator`` (so the inner loop is seeded)."""

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``model`` on ``batch``."""


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Run the block under ``torch.use_deterministic_algorithms(enabled)``, then restore."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def run_inner_loop(
    trainer: Trainer,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    seed: int,
    batch_size: int,
) -> float:
    """H optimizer steps on batches drawn from a generator seeded with ``seed``.

    Returns:
        The loss of the last step.
    """
    generator = torch.Generator().manual_seed(seed)
    # Dropout and other layers draw from the CPU default generator. (torch.manual_seed
    # would also queue seeding of every accelerator backend, ~0.25 ms a call on CPU.)
    torch.random.default_generator.manual_seed(seed)
    trainer.model.train()
    loss_value = float("nan")
    for _ in range(steps):
        batch = trainer.sample_batch(generator, batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.loss(trainer.model, batch)
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    return loss_value


class Participant:
    """One sovereign node of the federation.

    Args:
        config: the federation's config (must match the coordinator's).
        participant_id: this node's stable identity.
        transport: its end of the transport; messages go to whoever opened the round.
        trainer: its model and private data.
        pipeline: the release pipeline; defaults to difference → bind.
    """

    def __init__(
        self,
        config: LensembleConfig,
        *,
        participant_id: str,
        transport: Transport,
        trainer: Trainer,
        pipeline: ReleaseTransform | None = None,
    ) -> None:
        self.config = config
        self.participant_id = participant_id
        self.transport = transport
        self.trainer = trainer
        self.pipeline = pipeline or default_pipeline()
        self.dataset_root = merkle_root(trainer.dataset_records())
        self.num_examples = int(trainer.num_examples())
        self._pipeline_state: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._last_open: tuple[int, int] | None = None
        self.last_close: RoundClose | None = None
        self.last_loss: float | None = None

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
        elif isinstance(message, RoundClose):
            self.last_close = message
        else:
            log.warning("%s: ignoring unexpected %s", self.participant_id, message.kind)

    def _on_round_open(self, msg: RoundOpen) -> None:
        if self._last_open == (msg.round, msg.attempt):
            return  # a duplicate RoundOpen; this attempt was already answered
        state = GlobalState(
            round=msg.round,
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
            return
        self._last_open = (msg.round, msg.attempt)
        common = {"run_id": msg.run_id, "round": msg.round, "sender": self.participant_id}
        self.transport.send(
            msg.sender,
            Commitment(
                **common,
                attempt=msg.attempt,
                participant_id=self.participant_id,
                dataset_root=self.dataset_root,
                num_examples=self.num_examples,
            ),
        )
        try:
            released = self.local_round(state, msg.sketch_seed)
        except LensembleError as exc:
            log.warning("%s: releases nothing in round %d: %r", self.participant_id, msg.round, exc)
            return
        self.transport.send(
            msg.sender,
            Update(
                **common,
                attempt=msg.attempt,
                participant_id=self.participant_id,
                dataset_root=released.dataset_root,
                delta=released.delta,
                l2_norm=released.l2_norm,
                num_examples=released.num_examples,
                transforms=released.transforms,
            ),
        )

    # -- the spec's surface ------------------------------------------------------------
    def local_round(self, global_state: GlobalState, round_seed: int) -> PseudoGradient:
        """Train H inner AdamW steps from ``global_state`` and release the bound delta.

        Raises:
            ParameterMismatch: the global params do not fit the model.
            ResidencyViolation: the release carries a name outside the shared groups.
            RoundError: the pipeline did not produce a bound delta.
        """
        groups = self.config.groups
        load_shared(self.trainer.model, global_state.params, groups)
        if self._optimizer is None:
            inner = self.config.inner
            self._optimizer = torch.optim.AdamW(
                self.trainer.model.parameters(),
                lr=inner.lr,
                betas=(inner.beta1, inner.beta2),
                eps=inner.eps,
                weight_decay=inner.weight_decay,
            )
        with deterministic_algorithms(self.config.inner.deterministic):
            self.last_loss = run_inner_loop(
                self.trainer,
                self._optimizer,
                steps=global_state.h_steps,
                seed=derive_seed(round_seed, "inner", self.participant_id),
                batch_size=self.config.inner.batch_size,
            )
        if self._pipeline_state is None:
            self._pipeline_state = self.pipeline.init(global_state.params)
        ctx = ReleaseContext(
            participant_id=self.participant_id,
            global_state=global_state,
            round_seed=round_seed,
            dataset_root=self.dataset_root,
            num_examples=self.num_examples,
        )
        local = export_shared(self.trainer.model, groups)
        release, self._pipeline_state = self.pipeline.update(
            Release(local=local), self._pipeline_state, ctx
        )
        if release.delta is None or release.bound_root != self.dataset_root:
            raise RoundError(f"{self.participant_id}: the pipeline did not bind a delta")
        leaked = sorted(n for n in release.delta if not is_shared(n, groups))
        if leaked:
            raise ResidencyViolation(f"{self.participant_id}: release carries local {leaked}")
        return PseudoGradient(
            participant_id=self.participant_id,
            round=global_state.round,
            delta=release.delta,
            l2_norm=l2_norm(release.delta),
            dataset_root=release.bound_root,
            num_examples=self.num_examples,
            transforms=release.applied,
        )

    def join(self, coordinator_endpoint: str) -> GlobalState:
        """Recover the latest committed global state from the run directory and verify it.

        A rejoiner's stale local state (inner optimizer, last answered round) is discarded
        and the model starts from the recovered global state.

        Args:
            coordinator_endpoint: the coordinator's run directory (its artifact store).

        Raises:
            CheckpointIntegrityError: the checkpoint's bytes or params do not match the
                hash the ledger (or manifest) records for it.
        """
        store = Store(coordinator_endpoint)
        head = Ledger(store).head()
        if head is None:
            manifest = RunManifest.load(store)
            digest, expected = manifest.initial_checkpoint, manifest.initial_params_hash
        else:
            digest, expected = head.checkpoint, head.new_global_hash
        checkpoint = decode_checkpoint(store.get(digest))
        if checkpoint.params_hash != expected:
            raise CheckpointIntegrityError(
                f"recovered checkpoint {digest[:12]}… does not hold the recorded global state"
            )
        state = GlobalState.create(
            checkpoint.round,
            checkpoint.params,
            sketch_seed=derive_seed(self.config.federation.root_seed, "round", checkpoint.round),
            h_steps=self.config.inner.steps,
        )
        load_shared(self.trainer.model, state.params, self.config.groups)
        self._optimizer = None
        self._last_open = None
        log.info("%s: joined at round %d (%s…)", self.participant_id, state.round,
                 state.params_hash[:12])
        return state
