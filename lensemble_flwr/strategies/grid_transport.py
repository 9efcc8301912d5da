"""Flower's Grid as one more Transport for the coordinator.

The coordinator's state machine runs unchanged; this class only moves payloads:

* ``send`` queues an instruction for a node; the next ``recv`` pushes every queued
  instruction in one ``push_messages`` call. Each instruction's TTL is set from the
  attempt's deadlines (:func:`instruction_ttl`), never below :data:`MIN_MESSAGE_TTL`, so
  an unanswered one expires in the SuperLink instead of lingering for Flower's default
  12 hours, and none is sent with a TTL Flower would refuse.
* ``recv`` pulls replies for every outstanding instruction — including those of earlier
  rounds, so a late reply is pulled (which also deletes it from the SuperLink), decoded,
  and handed to the coordinator, which logs it with its round and drops it. An error reply
  to a RoundOpen (a ClientApp exception, an expired TTL) becomes that node's Refusal of
  the attempt, so the round does not wait for it; other error replies are logged, dropped.
  A "Message Unavailable" reply to an instruction of an attempt no longer awaited is only
  counted (:mod:`.expired`: one INFO line per attempt).
* ``broadcast(RoundClose)`` costs no exchange: the close rides on the next instruction
  to each node.
* A stock Message-API ClientApp's reply (``arrays`` + ``num-examples``) becomes an
  *unbound* update: the delta is its arrays minus the global params it was sent.
* A node is ``node-<node_id>`` until its first reply names it (its ``partition-id``,
  ``lensemble-id`` or key: :mod:`.node_names`), and only a reply whose first message is
  signed as that name requires names it (:mod:`.name_claims`). A reply whose claim is
  not proven binds nothing: its payloads go to the coordinator as delivered from the
  node's own address, and are rejected there as forged. Any other payload whose sender
  is not the node the SuperLink says it came from makes the reply malformed (the
  SuperLink authenticates nodes, not names).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid

from lensemble_flwr.coordinator.deadlines import PhaseDeadlines
from lensemble_flwr.norms import l2_norm
from lensemble_flwr.protocol.messages import (
    ControlMessage,
    MessageKind,
    RoundClose,
    RoundOpen,
    SurvivorCheck,
    UnmaskRequest,
    WirePayload,
    kind_of,
    to_wire,
)
from lensemble_flwr.strategies import records
from lensemble_flwr.strategies.expired import UNAVAILABLE, ExpiredReplies
from lensemble_flwr.strategies.layout import ArrayLayout
from lensemble_flwr.strategies.name_claims import bind_claim, claim_proven
from lensemble_flwr.strategies.node_names import NodeNames
from lensemble_flwr.strategies.open_encoding import OpenEncoder
from lensemble_flwr.strategies.traffic import RoundTraffic
from lensemble_flwr.transports.base import (
    CLIENT_APP_ERROR,
    MALFORMED_REPLY,
    STOCK_CLIENTAPP,
    DeliveredFrom,
    FiledByTransport,
)

log = logging.getLogger(__name__)


_IN_MEMORY_GRID = "flwr.superlink.grid.inmemory_grid"

MIN_MESSAGE_TTL = 5.0
"""The shortest TTL an instruction is sent with (seconds): Flower refuses a message whose
TTL is not above zero, and a node's reply inherits what is left of its instruction's."""


def instruction_ttl(deadlines: PhaseDeadlines, grace: float = 0.0) -> float:
    """The TTL of an attempt's instructions: its open and collect deadlines and its
    warm-up grace (a reply after them is not waited for), at least :data:`MIN_MESSAGE_TTL`."""
    return max(MIN_MESSAGE_TTL, deadlines.open + deadlines.collect + grace)


def is_simulation_grid(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's ``InMemoryGrid`` (the simulation engine's), checked
    without importing it: its module pulls in the SuperLink's state (SQLAlchemy, FastAPI;
    about a second), and a grid cannot be an instance of a class never imported."""
    module = sys.modules.get(_IN_MEMORY_GRID)
    return module is not None and isinstance(grid, module.InMemoryGrid)


@dataclasses.dataclass(frozen=True)
class SentInstruction:
    """What the transport remembers about an instruction until its reply is pulled."""

    peer: str
    kind: MessageKind | str  # the instruction's kind; a Flower message type beyond the protocol
    round: int
    attempt: int
    run_id: str
    params: Mapping[str, np.ndarray] | None
    pushed_at: float


class GridTransport:
    """The coordinator's end of a Flower Grid.

    Args:
        grid: the ServerApp's Grid (in-memory in simulation, HTTP in deployment).
        message_ttl: seconds an instruction may wait in the SuperLink (the attempt's
            deadlines, :func:`instruction_ttl`, so it expires with the attempt that sent
            it); an instruction is sent with at least :data:`MIN_MESSAGE_TTL`.
        user_config: the train config every instruction carries (as FedAvg would).
        layout: the user's array names, order and carried arrays: instructions carry the
            global arrays in that order (carried ones included), and a stock reply's
            carried arrays are left out of its update (None: the canonical order).
        arrays_key, config_key: the names of an instruction's ArrayRecord and
            ConfigRecord (FedAvg's ``arrayrecord_key`` and ``configrecord_key``).
        names: which node is which participant (learnt from the nodes' replies; set
            :attr:`on_rename` to hear when a node names itself).
        poll_interval: seconds between pulls while waiting.
        peer_refresh: seconds a node list from the SuperLink is reused.
        clock, sleep: injectable for tests.
    """

    def __init__(
        self,
        grid: Grid,
        *,
        message_ttl: float,
        user_config: Mapping[str, Any] | None = None,
        layout: ArrayLayout | None = None,
        arrays_key: str = records.ARRAYS,
        config_key: str = records.CONFIG,
        names: NodeNames | None = None,
        poll_interval: float = 0.05,
        peer_refresh: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.grid = grid
        self.message_ttl = message_ttl
        self.user_config = dict(user_config or {})
        self.layout = layout
        self.arrays_key, self.config_key = arrays_key, config_key
        self.poll_interval = poll_interval
        self.peer_refresh = peer_refresh
        self._clock = clock
        self.sleep = sleep  # how it waits (injectable: tests wait on a fake clock)
        self._queue: list[Message] = []
        self._queued_info: list[SentInstruction] = []
        self._outstanding: dict[str, SentInstruction] = {}
        self._inbox: deque[WirePayload] = deque()
        self._close: WirePayload | None = None
        self._opens = OpenEncoder()  # a RoundOpen's content, encoded once and shared
        self.names = names if names is not None else NodeNames()
        self.on_rename: Callable[[str, str], bool] | None = None  # (address, participant)
        self.allowed: Collection[str] | None = None  # the identity allow-list's names
        self.proves_name: Callable[[WirePayload], bool] | None = None  # see .name_claims
        self._unproven: set[tuple[str, str]] = set()  # (node, name) claims logged
        self.weight_key = "num-examples"  # a stock reply's example count (weighted_by_key)
        self._peers: tuple[str, ...] = ()
        self._peers_at = -float("inf")
        self.traffic = RoundTraffic()  # per-round counts the strategy reports
        self.dropped: list[tuple[str, int, str]] = []
        # the (round, attempt) whose replies are awaited: the last one sent a RoundOpen
        # (None once its driver ended it); the "Message Unavailable" replies of any other
        # are counted in `expired`
        self.awaited: tuple[int, int] | None = None
        self.expired = ExpiredReplies()
        # Flower's round hooks: the instructions handed out by take_queued until pushed,
        # and (while keep_train_replies) each attempt's raw train replies until taken
        self._handed_out: dict[int, tuple[Message, SentInstruction]] = {}
        self.keep_train_replies = False
        self._train_replies: list[tuple[int, int, Message]] = []

    # -- Transport ---------------------------------------------------------------------
    @property
    def ttl(self) -> float:
        """The TTL instructions are sent with: :attr:`message_ttl`, at least
        :data:`MIN_MESSAGE_TTL` (never zero or less, which Flower refuses)."""
        return max(MIN_MESSAGE_TTL, self.message_ttl)

    def open_attempt(
        self, user_config: Mapping[str, Any], deadlines: PhaseDeadlines | None, grace: float
    ) -> None:
        """What an attempt's instructions carry from now on: ``user_config`` (the train
        config), and a TTL that expires with the attempt's ``deadlines`` (when it has
        its own) and warm-up ``grace``."""
        self.user_config = dict(user_config)
        if deadlines is not None:
            self.message_ttl = instruction_ttl(deadlines, grace)

    def now(self) -> float:
        """Seconds on the transport's clock."""
        return self._clock()

    def peers(self, *, fresh: bool = False) -> Sequence[str]:
        """The connected nodes as participant ids, sorted: asked of the Grid at most every
        ``peer_refresh`` s (``fresh``: now), and returned as the same tuple object for as
        long as the peers stay the same, so that the coordinator reuses what it derived
        from them (:mod:`lensemble_flwr.coordinator.reach`) instead of deriving it again
        after every reply (O(N) per reply, O(N^2) per round)."""
        if fresh or self.now() - self._peers_at >= self.peer_refresh:
            peers = tuple(sorted(self.names.name_of(n) for n in self.grid.get_node_ids()))
            if peers != self._peers:
                self._peers = peers
            self._peers_at = self.now()
        return self._peers

    def declared_size(self) -> int | None:
        """On Flower's simulation engine (an ``InMemoryGrid``) every node exists from the
        start: their number. On a deployment nodes may connect later: None."""
        if is_simulation_grid(self.grid):
            return len(self.grid.get_node_ids())
        return None

    def send(self, peer_id: str, message: ControlMessage) -> None:
        """Queue a RoundOpen, SurvivorCheck or UnmaskRequest for ``peer_id`` (pushed by
        the next recv)."""
        payload = to_wire(message)
        if isinstance(message, (UnmaskRequest, SurvivorCheck)):  # an exchange's request
            content = records.encode_exchange(payload)
            self._queue_message(peer_id, content, MessageType.TRAIN, payload)
            return
        if not isinstance(message, RoundOpen):
            raise ValueError(f"the coordinator sends RoundOpen over a Grid, not {message.kind}")
        content = self._opens.content(
            message, payload, user_config=self.user_config, round_close=self._close,
            layout=self.layout, arrays_key=self.arrays_key, config_key=self.config_key,
        )  # fmt: skip
        self._queue_message(peer_id, content, MessageType.TRAIN, payload)

    def broadcast(self, message: ControlMessage) -> None:
        """Keep a RoundClose to ride on the next instruction to each node."""
        if not isinstance(message, RoundClose):
            raise ValueError(f"only RoundClose is broadcast over a Grid, not {message.kind}")
        self._close = to_wire(message)  # rides on the next instruction to each node

    def deliver_queued(self) -> None:
        """Push what is queued now (``recv`` does it too, first)."""
        self._flush()

    def recv(self, *, timeout_s: float) -> WirePayload | None:
        """Push what is queued, then the next reply payload (None after ``timeout_s``)."""
        self._flush()
        deadline = self.now() + max(0.0, timeout_s)
        while not self._inbox:
            for reply in self._pull_raw():
                self._absorb(reply)
            if self._inbox:
                break
            remaining = deadline - self.now()
            if remaining <= 0:
                return None
            self.sleep(min(self.poll_interval, remaining))
        return self._inbox.popleft()

    # -- Flower's round hooks: instructions and replies as Messages ----------------------
    @property
    def round_close(self) -> WirePayload | None:
        """The last RoundClose broadcast (it rides on the next instruction to each node)."""
        return self._close

    def take_queued(self) -> list[Message]:
        """Take the instructions queued since the last push out of the queue, as Flower
        Messages (what ``configure_train`` returns). The transport remembers each until
        :meth:`push_instructions` pushes it or reports it left out."""
        queue, infos = self._queue, self._queued_info
        self._queue, self._queued_info = [], []
        self._handed_out = {id(m): (m, i) for m, i in zip(queue, infos, strict=True)}
        return queue

    def push_instructions(
        self, messages: Iterable[Message], template: RoundOpen
    ) -> list[SentInstruction]:
        """Push ``messages`` (what ``configure_train`` returned) as the instructions of
        ``template``'s attempt, and pull their replies from then on. A Message the hook
        made itself is that attempt's instruction to its node, in place of what the node
        was handed (it gets the instructions' TTL and group).

        Returns:
            The instructions :meth:`take_queued` handed out that are not among
            ``messages`` (a ``configure_train`` override left them out): never sent.
        """
        handed_out, self._handed_out = self._handed_out, {}
        by_node = {m.metadata.dst_node_id: key for key, (m, _) in handed_out.items()}
        for message in messages:
            held = handed_out.pop(id(message), None)
            if held is not None and held[0] is message:
                info = held[1]
            else:  # made by the hook: it replaces what its node was handed, if anything
                replaced = handed_out.pop(by_node.get(message.metadata.dst_node_id, -1), None)
                info = (
                    replaced[1]
                    if replaced is not None
                    else _instruction_of(template, self.names.name_of(message.metadata.dst_node_id))
                )
                message.metadata.ttl = self.ttl
                message.metadata.group_id = str(template.round)
                if replaced is None:  # (a replaced one was counted when it was queued)
                    self.traffic.count_sent(info.peer, info.round)
            self._queue.append(message)
            self._queued_info.append(info)
        self._flush()
        left_out = [info for _, info in handed_out.values()]
        for info in left_out:  # counted when queued, never sent
            self.traffic.count_sent(info.peer, info.round, -1)
        return left_out

    def take_train_replies(self, round: int, attempt: int) -> list[Message]:
        """The raw replies (errors included) to the train instructions of ``round``'s
        ``attempt`` pulled so far, in arrival order, kept while
        :attr:`keep_train_replies` (those of earlier attempts are dropped)."""
        kept, self._train_replies = self._train_replies, []
        return [reply for r, a, reply in kept if (r, a) == (round, attempt)]

    def payloads_of(
        self, replies: Iterable[Message], template: RoundOpen
    ) -> tuple[list[WirePayload], list[str]]:
        """Decode a batch of replies to ``template``'s instructions (collected by Flower's
        own loop) as :meth:`recv` decodes each: the payloads, and the participants that
        answered (a node that names itself is named so from then on)."""
        payloads: list[WirePayload] = []
        peers: list[str] = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error() and node == SUPERLINK_NODE_ID:
                log.info("round %d: the SuperLink reports: %s", template.round, reply.error.reason)
                continue
            info = _instruction_of(template, self.names.name_of(node))
            payloads.extend(self._decoded(reply, info))
            peers.append(self.names.name_of(node))
        return payloads, peers

    # -- beyond the protocol: warm-up, evaluation, bookkeeping ---------------------------
    def request_messages(self, messages: Iterable[Message], *, timeout_s: float) -> list[Message]:
        """Send ``messages`` (made by a hook such as ``configure_evaluate``; each gets the
        instructions' TTL, or ``timeout_s`` if longer) and wait for their replies (at most
        ``timeout_s``); replies that come later are pulled and dropped by later calls."""
        for message in messages:  # they live at least as long as they are waited for
            message.metadata.ttl = max(self.ttl, timeout_s)
            if not message.metadata.group_id:
                message.metadata.group_id = "-1"  # what belongs to no round
            self._queue.append(message)
            self._queued_info.append(
                SentInstruction(
                    peer=self.names.name_of(message.metadata.dst_node_id),
                    kind=message.metadata.message_type,
                    round=-1,
                    attempt=0,
                    run_id="",
                    params=None,
                    pushed_at=0.0,
                )
            )
        wanted = {m.metadata.message_id for m in self._flush()}
        deadline = self.now() + timeout_s
        replies: list[Message] = []
        while wanted and self.now() < deadline:
            for reply in self._pull_raw():
                reply_to = reply.metadata.reply_to_message_id
                if reply_to in wanted:
                    wanted.discard(reply_to)
                    self._outstanding.pop(reply_to, None)
                    replies.append(reply)
                else:
                    self._absorb(reply)
            if wanted:
                self.sleep(self.poll_interval)
        return replies

    def exchanges(self, round: int) -> int:
        """Instructions the busiest participant had to answer in ``round`` (1 when a round
        is a single exchange)."""
        return self.traffic.exchanges(round)

    # -- internals ---------------------------------------------------------------------
    def _queue_message(
        self, peer: str, content: RecordDict, message_type: str, payload: WirePayload | None
    ) -> None:
        rnd = int(payload["round"]) if payload else -1
        message = Message(
            content=content,
            dst_node_id=self.names.node_of(peer),
            message_type=message_type,
            ttl=self.ttl,
            group_id=str(rnd),
        )
        self._queue.append(message)
        self._queued_info.append(
            SentInstruction(
                peer=peer,
                kind=kind_of(payload) or message_type,
                round=rnd,
                attempt=int(payload["attempt"]) if payload else 0,
                run_id=str(payload["run_id"]) if payload else "",
                params=payload.get("params") if payload else None,
                pushed_at=0.0,
            )
        )
        if payload is not None:
            self.traffic.count_sent(peer, rnd)
        if kind_of(payload) is MessageKind.ROUND_OPEN:  # the attempt awaited from now on
            self.awaited = (rnd, int(payload["attempt"]) if payload else 0)

    def _flush(self) -> list[Message]:
        if not self._queue:
            return []
        queue, infos = self._queue, self._queued_info
        self._queue, self._queued_info = [], []
        for message, info in zip(queue, infos, strict=True):
            self.traffic.add_bytes(info.round, sent=_content_bytes(message.content))
        # Grids name each message in place; InMemoryGrid leaves the ones it refuses out of
        # the returned ids, the HTTP grid returns None for them (or [] when the push is
        # too large), so match by id, not by position.
        pushed = {i for i in self.grid.push_messages(queue) if i}
        now = self.now()
        sent = []
        for message, info in zip(queue, infos, strict=True):
            message_id = message.metadata.message_id
            if message_id and message_id in pushed:
                self._outstanding[message_id] = dataclasses.replace(info, pushed_at=now)
                sent.append(message)
        return sent

    def _pull_raw(self) -> Iterable[Message]:
        """The replies to outstanding instructions that are ready, after forgetting the
        instructions whose TTL passed long ago (no reply will ever match them)."""
        if not self._outstanding:
            return []
        horizon = self.now() - 2 * self.ttl
        for message_id, info in list(self._outstanding.items()):
            if info.pushed_at < horizon:
                del self._outstanding[message_id]
        return list(self.grid.pull_messages(list(self._outstanding)))

    def _node_of(self, peer: str) -> int | None:
        """The Flower node ``peer`` is now (None: neither a learnt name nor an address)."""
        try:
            return self.names.node_of(peer)
        except ValueError:
            return None

    def _absorb(self, reply: Message) -> None:
        info = self._outstanding.pop(reply.metadata.reply_to_message_id, None)
        source = self.names.name_of(reply.metadata.src_node_id)
        if info is not None:  # sent before the node named itself: it is that name now
            named = self.names.name_of(self.names.node_of(info.peer))
            if named != info.peer:
                info = dataclasses.replace(info, peer=named)
        if info is None:
            log.info("dropped a reply to an unknown instruction from %s", source)
            return
        if self.keep_train_replies and info.kind is MessageKind.ROUND_OPEN:
            self._train_replies.append((info.round, info.attempt, reply))
        self._inbox.extend(self._decoded(reply, info))

    def _decoded(self, reply: Message, info: SentInstruction) -> list[WirePayload]:
        """What a reply to the instruction ``info`` stands for: the payloads of a train
        reply, or a node's refusal of its RoundOpen (an error reply, a malformed one);
        nothing for any other reply (logged)."""
        source = self.names.name_of(reply.metadata.src_node_id)
        if reply.has_error():
            self.dropped.append((info.peer, info.round, f"error {reply.error.code}"))
            if reply.error.code in UNAVAILABLE and (info.round, info.attempt) != self.awaited:
                self.expired.count_unavailable()  # expired, and no longer waited for
                return []
            refusal = error_refusal(reply, info, self._node_of(info.peer))
            if refusal is not None:  # the round stops waiting for this node
                return [refusal]
            log.info(
                "round %d: %s from %s dropped: error %s (%s)",
                info.round,
                info.kind,
                info.peer,
                reply.error.code,
                reply.error.reason,
            )
            return []
        self.traffic.add_bytes(info.round, received=_content_bytes(reply.content))
        if info.kind in records.INSTRUCTION_KINDS:
            return self._unpack_train_reply(reply.content, info, source)
        log.debug("dropped a late %s reply from %s", info.kind, info.peer)
        return []

    def _settle_claim(
        self, content: RecordDict, info: SentInstruction, source: str
    ) -> tuple[SentInstruction, str, tuple[SentInstruction, str] | None]:
        """The reply's instruction and sender once the name it claims is settled
        (:mod:`.name_claims`), and, for a claim not proven, what its payloads must name."""
        claimed = records.claimed_sender(content)
        if claimed is None or claimed == source or info.peer != source:
            return info, source, None
        if not claim_proven(content, source, claimed, self.proves_name, self._unproven):
            return info, source, (dataclasses.replace(info, peer=claimed), claimed)
        if bind_claim(
            self.names, source, claimed, connected=self.grid.get_node_ids(),
            allowed=self.allowed, on_rename=self.on_rename,
        ):  # fmt: skip  # the node named itself: it is that participant
            self._peers_at = -float("inf")
            return dataclasses.replace(info, peer=claimed), claimed, None
        return info, source, None

    def _unpack_train_reply(
        self, content: RecordDict, info: SentInstruction, source: str
    ) -> list[WirePayload]:
        try:
            info, source, as_sent = self._settle_claim(content, info, source)
            carried = self.layout.carried if self.layout else ()
            payloads = train_reply_payloads(
                content, *(as_sent or (info, source)), carried=carried, weight_key=self.weight_key
            )  # (a claim not proven: every payload must name the claimed sender)
            if info.kind is MessageKind.ROUND_OPEN and source == info.peer:
                # the node's answer to this attempt, whatever the coordinator makes of it
                node = self._node_of(source)
                payloads = [
                    DeliveredFrom(p, peer=source, round=info.round, attempt=info.attempt, node=node)
                    for p in payloads
                ]
        except ValueError as exc:
            self.dropped.append((info.peer, info.round, str(exc)))
            # it answered, badly: the round stops waiting for it (only for a reply from the
            # node the instruction names now: a renamed participant's old node is not it)
            if source == info.peer:  # the coordinator logs the refusal, with the reason
                return [malformed_refusal(info, str(exc), self._node_of(source))]
            log.warning("round %d: train reply from %s dropped: %s", info.round, source, exc)
            return []
        metrics = records.named_or_only(records.records_of(content, MetricRecord), records.METRICS)
        if metrics is not None:
            self.traffic.client_metrics[(info.round, info.peer)] = {
                k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))
            }
        return list(payloads)



def _instruction_of(template: RoundOpen, peer: str) -> SentInstruction:
    """What the transport knows of ``template``'s attempt's instruction to ``peer``."""
    return SentInstruction(
        peer=peer,
        kind=MessageKind.ROUND_OPEN,
        round=template.round,
        attempt=template.attempt,
        run_id=template.run_id,
        params=template.params,
        pushed_at=0.0,
    )


def train_reply_payloads(
    content: RecordDict,
    info: SentInstruction,
    source: str,
    *,
    carried: Collection[str] = (),
    weight_key: str = "num-examples",
) -> list[WirePayload]:
    """The payloads a train reply stands for.

    A lensemble participant's reply carries its payloads; a stock ClientApp's reply
    becomes one unbound update (its arrays minus the global params it was sent; the
    ``carried`` arrays it returns, such as BatchNorm's counts, are not part of it).

    Raises:
        ValueError: a payload names another sender than the node it came from, or the
            reply is neither kind.
    """
    if records.is_lensemble_reply(content):
        payloads = records.decode_reply(content)
        for payload in payloads:
            if payload.get("sender") != source or source != info.peer:
                raise ValueError(
                    f"a {payload.get('kind')} claiming to be {payload.get('sender')!r}"
                )
        return list(payloads)
    stock = records.stock_reply(content, weight_key)
    if stock is None or info.params is None:
        raise ValueError(
            "neither a lensemble nor a stock train reply (a stock reply is one ArrayRecord "
            f"and one MetricRecord holding a positive number under {weight_key!r}, the "
            f"strategy's weighted_by_key): {_reply_shape(content, weight_key)}"
        )
    arrays, count, _ = stock
    arrays = {name: array for name, array in arrays.items() if name not in carried}
    _check_stock_arrays(arrays, info.params)
    delta = {
        n: np.asarray(arrays[n], dtype=np.float32) - np.asarray(info.params[n], np.float32)
        for n in sorted(arrays)
    }
    norm = l2_norm(delta)
    if not math.isfinite(norm):
        bad = next(n for n in sorted(delta) if not np.isfinite(delta[n]).all())
        raise ValueError(f"array {bad!r} holds NaN or infinite values")
    return [
        {
            "kind": MessageKind.UPDATE.value,
            "run_id": info.run_id,
            "round": info.round,
            "attempt": info.attempt,
            "sender": info.peer,
            "participant_id": info.peer,
            "dataset_root": None,
            "delta": delta,
            "l2_norm": norm,
            "num_examples": count,
            "transforms": (STOCK_CLIENTAPP,),
        }
    ]


def _check_stock_arrays(arrays: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """Refuse a stock reply's arrays that are not the model's: other names, shapes, or a
    dtype that is not floating (its values would be truncated into the model's).

    Raises:
        ValueError: saying which array, and how it differs.
    """
    if set(arrays) != set(model):
        missing = _some(sorted(set(model) - set(arrays)))
        unexpected = _some(sorted(set(arrays) - set(model)))
        raise ValueError(
            f"its arrays are not the model's: missing {missing}, unexpected {unexpected}"
        )
    for name in sorted(arrays):
        sent, got = np.shape(model[name]), np.shape(arrays[name])
        if got != sent:
            raise ValueError(f"array {name!r} has shape {got}; the model's has {sent}")
        kind, model_kind = np.asarray(arrays[name]).dtype, np.asarray(model[name]).dtype
        if kind.kind != "f":  # an integer or boolean array would be cast to a model
            raise ValueError(
                f"array {name!r} has dtype {kind}; the model's has {model_kind} (a float "
                "array is expected: the reply's values would otherwise be truncated)"
            )


def _reply_shape(content: RecordDict, weight_key: str | None = None) -> str:
    """What a train reply holds, by record type and name, with the value it holds under
    ``weight_key`` if any (for an error message)."""
    parts = []
    kinds = (
        (ArrayRecord, "ArrayRecord"),
        (MetricRecord, "MetricRecord"),
        (ConfigRecord, "ConfigRecord"),
    )
    for kind, label in kinds:
        for name, record in records.records_of(content, kind).items():
            keys = f" {sorted(record)}" if kind is not ArrayRecord else ""
            if weight_key is not None and kind is not ArrayRecord and weight_key in record:
                keys += f" ({weight_key} = {record[weight_key]!r})"
            parts.append(f"{label} {name!r}{keys}")
    return "it holds " + (", ".join(parts) if parts else "no arrays and no metrics")


def _some(names: list[str], shown: int = 8) -> str:
    """``names`` for an error message: the first ``shown``, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def malformed_refusal(
    info: SentInstruction, reason: str, node: int | None = None
) -> WirePayload | None:
    """A node's malformed reply to a RoundOpen (one that cannot become an update: wrong
    arrays, NaN, no example count) as that node's Refusal of the attempt, None for any
    other instruction: the node answered and will not answer again, so the round must
    not wait its deadline out for it, as for an error reply. The source is the node
    Flower delivered the reply from, answering this instruction: no payload field says
    so."""
    if info.kind is not MessageKind.ROUND_OPEN:
        return None
    return _refusal_of(info, MALFORMED_REPLY, f"malformed train reply: {reason}", node)


def error_refusal(
    reply: Message, info: SentInstruction, node: int | None = None
) -> WirePayload | None:
    """A node's error reply to a RoundOpen as that node's Refusal of the attempt (None for
    any other instruction): a ClientApp that raised, or a SuperLink that reports the node
    unavailable, will not deliver an update, so the round must not wait its deadline out
    for it. Logged once, with the node and the error's text."""
    if info.kind is not MessageKind.ROUND_OPEN:
        return None
    where = "the SuperLink" if reply.metadata.src_node_id == SUPERLINK_NODE_ID else info.peer
    reason = f"error {reply.error.code} from {where}: {reply.error.reason}"
    log.warning("round %d: %s replied with an error: %s", info.round, info.peer, reason)
    return _refusal_of(info, CLIENT_APP_ERROR, reason, node)


def unsent_refusal(info: SentInstruction) -> WirePayload:
    """The refusal of a node whose instruction a ``configure_train`` override left out of
    what it returned: the node was invited and was never sent anything, so the attempt
    must not wait for its answer. Filed by the transport, as for an error reply."""
    reason = "never sent: configure_train left this node's instruction out"
    return _refusal_of(info, CLIENT_APP_ERROR, reason)


def _refusal_of(
    info: SentInstruction, error: str, reason: str, node: int | None = None
) -> FiledByTransport:
    """The Refusal of the attempt ``info`` names, on behalf of the node it was sent to
    (``node``: its Flower id; filed by the transport: a node that signs its messages
    signed none of it)."""
    return FiledByTransport(
        {
            "kind": MessageKind.REFUSAL.value,
            "run_id": info.run_id,
            "round": info.round,
            "attempt": info.attempt,
            "sender": info.peer,
            "participant_id": info.peer,
            "error": error,
            "reason": reason[:2000],
        },
        node=node,
    )


def _content_bytes(content: RecordDict) -> int:
    """Bytes of the arrays in ``content`` (what dominates the wire)."""
    return sum(record.count_bytes() for record in records.records_of(content, ArrayRecord).values())
