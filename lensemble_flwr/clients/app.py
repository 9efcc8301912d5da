"""ClientApps whose train function is a lensemble Participant.

``make_client_app(trainer_fn)`` gives a Message-API ClientApp: for every train
instruction it rebuilds the participant from ``trainer_fn(context)`` and the state kept
in ``context.state``, lets it handle the instruction's RoundClose and RoundOpen, and
replies with what it sent (its commitment, once, and its update). Evaluate instructions
run ``evaluate_fn``; query instructions (the strategy's warm-up) are answered at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from lensemble_flwr.clients.live import (
    DEFAULT_KEEP_BYTES,
    new_token,
    process_participants,
    size_of,
)
from lensemble_flwr.clients.node_privacy import bounded_by_node_config, node_privacy
from lensemble_flwr.clients.state import load_state, save_state, saved_token
from lensemble_flwr.clients.threads import use_torch_threads
from lensemble_flwr.config import LensembleConfig, metrics_released
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.gauge.runtime import GaugeSetup
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.params import NamedArrays
from lensemble_flwr.participant.local_training import LocalTraining, Trainer
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.privacy.ownership import BudgetOwner, owned_config
from lensemble_flwr.protocol.messages import MessageKind, kind_of
from lensemble_flwr.release.pipeline import ReleaseTransform
from lensemble_flwr.strategies import records
from lensemble_flwr.transports.base import ReplyCollector

log = logging.getLogger(__name__)

TrainerFn = Callable[[Context], "Trainer | LocalTraining"]
EvaluateFn = Callable[[Any, NamedArrays, Mapping[str, Any]], Mapping[str, float]]
REFUSED = 3201
"""Error code of a reply when the participant released nothing (its reason says why)."""
LAST_BATCH_LOSS = "last-batch-loss"
"""The train reply's metric: the loss of the inner loop's last mini-batch, on the node's
locally trained model (not the global model, and not its whole data)."""
NOT_AN_INSTRUCTION = "not a lensemble instruction"


def refusal(message: Message, reason: str) -> Message:
    """The reply to ``message`` saying the participant released nothing, and why."""
    return Message(Error(code=REFUSED, reason=reason), reply_to=message)


def config_from_context(context: Context) -> LensembleConfig:
    """The lensemble part of the run config (its ``lensemble.`` namespace, validated as
    strictly as on the server); the app's own keys are left alone."""
    return LensembleConfig.from_run_config(context.run_config)


def default_evaluate(
    trainer: Any, params: NamedArrays, config: Mapping[str, Any]
) -> dict[str, float]:
    """Call ``trainer.evaluate(params)`` returning (loss, accuracy, num_examples)."""
    loss, accuracy, count = trainer.evaluate(params)
    return {"loss": float(loss), "accuracy": float(accuracy), "num-examples": int(count)}


def identity_from_node_config(context: Context) -> IdentityKey | None:
    """The node's identity key: the private key file named by the SuperNode's
    ``--node-config "identity-key='/path/to/key'"`` (OpenSSH or PEM, ECDSA P-256/P-384);
    None when the node has none (its messages go unsigned)."""
    path = context.node_config.get("identity-key")
    return IdentityKey.load(str(path)) if path else None


STABLE_ID_KEYS = ("lensemble-id", "partition-id")
"""Node config keys that name a node the same way in every run, in order of preference."""


def participant_name(context: Context, identity: IdentityKey | None) -> str:
    """This node's participant id, the same in every run: its node config's
    ``lensemble-id`` or ``partition-id`` (``partition-id-3``), else its identity key's
    fingerprint (``key-…``), else Flower's node id (``node-<id>``, which changes from run
    to run). The strategy learns it from the node's first reply."""
    for key in STABLE_ID_KEYS:
        if key in context.node_config:
            return f"{key}-{context.node_config[key]}"
    if identity is not None:
        return f"key-{identity.fingerprint}"
    return records.participant_id(context.node_id)


def stable_identity(
    context: Context, config: LensembleConfig, identity: IdentityKey | None
) -> str | None:
    """What this node's privacy budget and commitment secret are kept under: the node
    config's ``lensemble-id`` or ``partition-id``, else its identity key's fingerprint
    (None: the Participant's default). Flower's node id changes every run, so it is
    never used under DP.

    Raises:
        ConfigError: DP is on and the node has none of these (its budget would restart
            with every run).
    """
    name = participant_name(context, identity)
    if not name.startswith(records.NODE_PREFIX):
        return name
    if config.privacy.noised:
        raise ConfigError(
            "dp-epsilon",
            "a privacy budget needs a stable identity, and Flower's node id changes every "
            f"run: give the node a node config {' or '.join(STABLE_ID_KEYS)}, or an identity key",
        )
    return None


def handle_train(
    message: Message,
    context: Context,
    trainer: Trainer | LocalTraining,
    config: LensembleConfig,
    *,
    gauge: GaugeSetup | None = None,
    identity: IdentityKey | None = None,
    pipeline: ReleaseTransform | None = None,
    owner: BudgetOwner | None = None,
) -> Message:
    """Run one train instruction through a Participant rebuilt from ``context.state``.

    ``pipeline`` is the participant's release pipeline (None: the one the config asks
    for); its stages' state is restored from and saved to ``context.state`` with the rest
    of the participant's state. ``owner``: the node's budget settings (None: its node
    config's, :func:`~lensemble_flwr.clients.node_privacy.node_privacy`)."""
    payloads = instruction_payloads(message)
    if not payloads:
        return refusal(message, NOT_AN_INSTRUCTION)
    built = build_participant(
        context, trainer, config, gauge=gauge, identity=identity, pipeline=pipeline, owner=owner
    )
    if isinstance(built, Error):
        return Message(built, reply_to=message)
    return train_participant(message, payloads, context, built)[0]


def refreshed(participant: Participant, context: Context) -> Participant | None:
    """``participant`` (kept by this process) with the state in ``context.state`` loaded,
    which another process saved or which was rolled back; None if that state does not
    load (the caller then builds a participant afresh, which reports why)."""
    try:
        participant.import_state(load_state(context.state))
    except Exception:  # the rebuild below raises it again, with its context
        return None
    return participant


def instruction_payloads(message: Message) -> list[dict[str, Any]]:
    """The lensemble payloads of ``message`` (RoundClose first), or [] if it carries no
    lensemble instruction (a RoundOpen, RoundClose or UnmaskRequest)."""
    payloads = records.decode_instruction(message.content)
    if not any(kind_of(p) in records.INSTRUCTION_KINDS for p in payloads):
        return []
    return payloads


def build_participant(
    context: Context,
    trainer: Trainer | LocalTraining,
    config: LensembleConfig,
    *,
    gauge: GaugeSetup | None = None,
    identity: IdentityKey | None = None,
    pipeline: ReleaseTransform | None = None,
    owner: BudgetOwner | None = None,
) -> Participant | Error:
    """This node's Participant with the state kept in ``context.state``, or the Error
    saying why it cannot be built.

    ``config`` is what the run asks for; the privacy budget is the node's (``owner``,
    default: its node config): a run that asks for more epsilon than the node's cap,
    another delta, accountant or adjacency, another budget directory, or per-node
    metrics the node does not release gets an Error naming both, and nothing is trained
    or released (:func:`~lensemble_flwr.privacy.ownership.owned_config`)."""
    try:
        owned = owned_config(config, node_privacy(context) if owner is None else owner)
        participant = Participant(
            owned,
            participant_id=participant_name(context, identity),
            transport=ReplyCollector(),
            trainer=trainer,
            gauge=gauge,
            identity=identity,
            pipeline=pipeline,
            stable_id=stable_identity(context, owned, identity),
        )
    except ConfigError as exc:  # beyond the node's budget, no stable identity under DP, ...
        return Error(code=REFUSED, reason=str(exc))
    participant.import_state(load_state(context.state))
    return participant


@dataclass(frozen=True)
class SavedState:
    """The state a participant saved to ``context.state``, and the token it is under."""

    token: str
    arrays: Mapping[str, np.ndarray]


def train_participant(
    message: Message,
    payloads: list[dict[str, Any]],
    context: Context,
    participant: Participant,
) -> tuple[Message, SavedState]:
    """Let ``participant`` handle ``payloads``, the instruction in ``message``; save its
    state to ``context.state`` under a new token. The reply, and what was saved."""
    collector = ReplyCollector()
    participant.transport = collector
    use_arrays = getattr(participant.training, "use_instruction_arrays", None)
    if callable(use_arrays):  # a NumPyClient gets the arrays in the server's order
        use_arrays(records.instruction_arrays(message.content))
    use_config = getattr(participant.training, "use_instruction_config", None)
    opens = any(kind_of(p) is MessageKind.ROUND_OPEN for p in payloads)
    if callable(use_config) and opens:  # the user's train config (start(train_config=...))
        use_config(records.instruction_user_config(message.content))
    for payload in payloads:
        participant.handle(payload)
    portable = participant.export_state()
    saved = SavedState(token=new_token(), arrays=portable.arrays)
    save_state(context.state, portable, saved.token)
    if not collector.sent:  # it did not even accept the round (e.g. a tampered state)
        return refusal(message, f"{participant.participant_id} refused the round"), saved
    config = participant.config
    metrics: dict[str, float] = {"num-examples": participant.training.num_examples()}
    if releases_metrics(config):
        own = getattr(participant.training, "last_metrics", None) or {}
        metrics.update({k: v for k, v in own.items() if k != "num-examples"})
        if participant.last_loss is not None:  # the local model's, on one mini-batch
            metrics[LAST_BATCH_LOSS] = float(participant.last_loss)
    content = records.encode_reply(collector.take(), metrics)
    return Message(content=content, reply_to=message), saved


def releases_metrics(config: LensembleConfig) -> bool:
    """Whether per-node, data-dependent metrics (train loss, evaluation) may leave this
    participant: not under DP (they are not noised) and not in masked rounds (the
    coordinator is to learn only the sum), unless ``dp-release-metrics`` opts in."""
    return metrics_released(config)


def handle_evaluate(
    message: Message,
    context: Context,
    trainer: Any,
    evaluate_fn: EvaluateFn,
    config: LensembleConfig | None = None,
    *,
    owner: BudgetOwner | None = None,
) -> Message:
    """Evaluate the instruction's global arrays on the participant's local data (refused
    under DP or secure aggregation unless the run's ``dp-release-metrics`` asks for the
    metrics and the node's own ``dp-release-metrics`` allows it: they are not noised).
    ``config``: the run's request, checked against ``owner`` (None: the node config's
    settings) as a train instruction's is."""
    if config is not None:
        try:
            config = owned_config(config, node_privacy(context) if owner is None else owner)
        except ConfigError as exc:  # e.g. metrics asked for that the node does not release
            return refusal(message, str(exc))
        if not releases_metrics(config):
            return refusal(
                message,
                "under DP or secure aggregation, evaluation metrics are not released "
                "(dp-release-metrics is off: they are per node and not noised)",
            )
    arrays = records.named_or_only(message.content.array_records, records.ARRAYS)
    if arrays is None:
        return refusal(message, "evaluate without arrays")
    config = dict(
        records.named_or_only(message.content.config_records, records.CONFIG) or ConfigRecord()
    )
    metrics = evaluate_fn(trainer, records.record_to_arrays(arrays), config)
    return Message(
        content=RecordDict({records.METRICS: MetricRecord(dict(metrics))}), reply_to=message
    )


def node_owner(
    context: Context, node_privacy_fn: Callable[[Context], BudgetOwner] = node_privacy
) -> BudgetOwner:
    """This node's budget settings: ``node_privacy_fn``'s, within what the SuperNode's
    node config sets when the function is an app's own
    (:func:`~lensemble_flwr.clients.node_privacy.bounded_by_node_config`).

    Raises:
        ConfigError: the node config, or the function, gives settings that are not valid.
    """
    owner = node_privacy_fn(context)
    if node_privacy_fn is not node_privacy:  # the operator's keys still bind
        owner = bounded_by_node_config(owner, context.node_config)
    return owner


def make_client_app(
    trainer_fn: TrainerFn,
    *,
    config_fn: Callable[[Context], LensembleConfig] = config_from_context,
    evaluate_fn: EvaluateFn | None = default_evaluate,
    gauge_fn: Callable[[Context], GaugeSetup | None] | None = None,
    identity_fn: Callable[[Context], IdentityKey | None] = identity_from_node_config,
    pipeline_fn: Callable[[Context], ReleaseTransform | None] | None = None,
    keep_live_bytes: int = DEFAULT_KEEP_BYTES,
    mods: list[Mod] | None = None,
    node_privacy_fn: Callable[[Context], BudgetOwner] = node_privacy,
) -> ClientApp:
    """A ClientApp whose participants are built by ``trainer_fn(context)``.

    A process that handles several train messages (an actor of the simulation engine, a
    long-lived ClientApp process) keeps the participants it built alive between them (in
    the process, whichever copy of the app handles the message), up to
    ``keep_live_bytes`` (their saved state's arrays plus their model's tensors; least
    recently used out; 0 keeps none). A kept participant is reused as it is while
    ``context.state`` holds the state it saved last (a token says so). A state saved by
    another process or rolled back is loaded into the kept participant, which then holds
    exactly what a participant built afresh from that state holds; a state without a
    token, or one that does not load, gets a participant built afresh, which is what a
    process that lives for one message does every time.

    Args:
        trainer_fn: builds this node's Trainer (torch model + private data) or
            LocalTraining; called whenever a participant is built (for every message in
            a process that lives for one message), so it should be deterministic: the
            same node must get the same model and data every time.
        config_fn: the federation config on this node (default: from the run config).
        evaluate_fn: ``(trainer, global_arrays, config) -> metrics`` with ``num-examples``;
            None to refuse evaluate instructions.
        gauge_fn: the model's gauge adapter and pinned probe (for ``gauge-align``).
        identity_fn: this node's signing key (default: the ``identity-key`` node config).
        pipeline_fn: this node's release pipeline, e.g. ``chain(difference(), my_stage(),
            bind())`` (default, or when it returns None: the one the config asks for, see
            :func:`~lensemble_flwr.participant.release_chain.release_pipeline`). Called
            for every train message, so it must build the same stages every time: the
            state of every stage is kept in ``context.state`` between messages (see
            :mod:`lensemble_flwr.release.state_codec` for what a state may hold).
        keep_live_bytes: bytes of participants this process keeps between messages.
        mods: Flower mods around every handler, as ``ClientApp(mods=...)`` takes them
            (e.g. ``[fixedclipping_mod]`` for Flower's client-side DP wrapper). Give them
            here: Flower fixes a handler's mods when the handler is registered.
        node_privacy_fn: this node's privacy budget settings, which a run's config may
            only ask within (default: the SuperNode's node config ``dp-epsilon-cap``,
            ``dp-delta``, ``dp-accountant``, ``dp-adjacency``, ``dp-release-metrics``,
            ``dp-budget-dir``; see docs/privacy.md). What the node config sets still
            binds a function given here: the smaller cap, metrics only if both allow
            them, and the node config's delta, accountant, adjacency and directory where
            it sets them.
    """
    app = ClientApp(mods=list(mods or []))
    process_participants(keep_live_bytes)  # a negative size fails here, not per message

    @app.train()
    def train(message: Message, context: Context) -> Message:
        use_torch_threads()  # nodes share a machine (clients/threads.py), in every process
        payloads = instruction_payloads(message)
        if not payloads:
            return refusal(message, NOT_AN_INSTRUCTION)
        live = process_participants(keep_live_bytes)  # not captured: the app is pickled
        key = (context.run_id, context.node_id)
        participant, current = live.take_any(key, saved_token(context.state))
        if participant is not None and not current:
            participant = refreshed(participant, context)
        if participant is None:
            try:
                owner = node_owner(context, node_privacy_fn)
            except ConfigError as exc:  # the node's own settings are bad: nothing trains
                return refusal(message, str(exc))
            built = build_participant(
                context,
                trainer_fn(context),
                config_fn(context),
                gauge=gauge_fn(context) if gauge_fn is not None else None,
                identity=identity_fn(context),
                pipeline=pipeline_fn(context) if pipeline_fn is not None else None,
                owner=owner,
            )
            if isinstance(built, Error):
                return Message(built, reply_to=message)
            participant = built
        reply, saved = train_participant(message, payloads, context, participant)
        live.keep(key, saved.token, participant, size_of(saved.arrays, participant.trainer))
        return reply

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        if evaluate_fn is None:
            return refusal(message, "no evaluate_fn")
        use_torch_threads()
        try:
            owner = node_owner(context, node_privacy_fn)
        except ConfigError as exc:  # the node's own settings are bad: nothing is evaluated
            return refusal(message, str(exc))
        return handle_evaluate(
            message, context, trainer_fn(context), evaluate_fn, config_fn(context), owner=owner
        )

    @app.query()
    def query(message: Message, context: Context) -> Message:
        return Message(
            content=RecordDict({records.METRICS: MetricRecord({"ready": 1})}), reply_to=message
        )

    return app
