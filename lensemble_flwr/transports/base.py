"""The Transport protocol every party speaks, and the transport of a party that only answers.

A transport moves wire payloads (see :mod:`lensemble_flwr.protocol.messages`); receivers
validate them. It also owns the clock that timeouts are measured in: the wall clock on a
real network, a simulated clock in-process.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from lensemble_flwr.protocol.messages import ControlMessage, WirePayload, to_wire

COORDINATOR = "coordinator"


@runtime_checkable
class Transport(Protocol):
    """Carries control-plane messages between one party and its peers."""

    def send(self, peer_id: str, message: ControlMessage) -> None:
        """Send ``message`` to ``peer_id`` (fire and forget)."""

    def recv(self, *, timeout_s: float) -> WirePayload | None:
        """The next payload addressed to this party, or None once ``timeout_s`` passed."""

    def broadcast(self, message: ControlMessage) -> None:
        """Send ``message`` to every current peer."""

    def peers(self) -> Sequence[str]:
        """The peers currently reachable, sorted."""

    def now(self) -> float:
        """Seconds on the clock that ``recv`` timeouts are measured in."""


CLIENT_APP_ERROR = "ClientAppError"
"""The error of a Refusal filed for a node whose reply was an error (its app raised, or
the SuperLink reports it unavailable)."""
MALFORMED_REPLY = "MalformedReply"
"""The error of a Refusal filed for a node whose reply cannot become an update."""
TRANSPORT_ERRORS = frozenset({CLIENT_APP_ERROR, MALFORMED_REPLY})
"""The only errors a :class:`FiledByTransport` refusal may name."""
STOCK_CLIENTAPP = "stock-clientapp"
"""The transform an update made by a transport of a stock ClientApp's reply names: an
unbound, unsigned update (its arrays minus the global params it was sent)."""


class FiledByTransport(dict[str, Any]):
    """A Refusal payload that a coordinator's own transport files on a node's behalf,
    from what it delivered for that node: an error reply to the node's instruction, or a
    reply that cannot become an update. The node signed nothing, so the coordinator does
    not ask for its signature; the refusal only says that the node releases nothing this
    attempt (it stops nothing: see :func:`~lensemble_flwr.coordinator.admission.admit`).

    Only code makes one: no payload decoded from a message is of this type, so a node
    cannot pass its own words off as the transport's."""

    def __init__(self, payload: Mapping[str, Any], *, node: int | None = None):
        super().__init__(payload)
        self.node = node  # the transport's address of the node it files for


class DeliveredFrom(dict[str, Any]):
    """A payload a coordinator's transport took from ``peer``'s reply to its instruction
    of ``round`` and ``attempt``: the transport, not the payload, says who answered (on
    Flower, the SuperLink authenticates the node a reply comes from). When the coordinator
    rejects such an update, that peer has still answered the attempt, and the round stops
    waiting for it (see :meth:`~lensemble_flwr.coordinator.coordinator.Coordinator.receive`).
    Only code makes one: no payload decoded from a message is of this type."""

    def __init__(
        self,
        payload: Mapping[str, Any],
        *,
        peer: str,
        round: int,
        attempt: int,
        node: int | None = None,
    ):
        super().__init__(payload)
        self.peer = peer
        self.round = round
        self.attempt = attempt
        self.node = node  # the transport's address of the node that answered


@runtime_checkable
class DeclaresFederation(Protocol):
    """A coordinator's transport that knows how many participants the federation has in
    all, reachable or not (the in-process network, Flower's simulation engine). A
    deployment, where nodes may connect at any time, declares nothing."""

    def declared_size(self) -> int | None:
        """The number of participants the federation is declared with (None: unknown)."""


@runtime_checkable
class BuffersSends(Protocol):
    """A transport whose :meth:`~Transport.send` only queues, and which delivers the queue
    on its next ``recv`` (Flower's Grid: one push for the round's instructions). The
    coordinator has it deliver the queue when it wants the messages out before other
    work."""

    def deliver_queued(self) -> None:
        """Deliver every queued message now."""


class MessageHandler(Protocol):
    """A party the in-process network drives (a Participant, or a test double)."""

    participant_id: str

    def handle(self, payload: WirePayload) -> None:
        """React to one payload addressed to this party."""


class ReplyCollector:
    """The transport of a participant that only answers: what it sends is kept, to go
    back as one reply (a Flower train reply, a shared-folder record), and it receives
    nothing (its instructions are handed to :meth:`Participant.handle` directly)."""

    def __init__(self) -> None:
        self.sent: list[ControlMessage] = []

    def send(self, peer_id: str, message: ControlMessage) -> None:
        """Keep ``message`` for the reply (every message goes to the coordinator)."""
        self.sent.append(message)

    def broadcast(self, message: ControlMessage) -> None:
        """Keep ``message`` for the reply, as :meth:`send` does."""
        self.sent.append(message)

    def recv(self, *, timeout_s: float) -> WirePayload | None:
        """Always None, at once: nothing arrives through this transport."""
        return None

    def peers(self) -> Sequence[str]:
        """Only the coordinator."""
        return [COORDINATOR]

    def now(self) -> float:
        """The monotonic wall clock (``time.monotonic``)."""
        return time.monotonic()

    def take(self) -> list[WirePayload]:
        """The wire payloads of what was sent since the last ``take``, in order."""
        sent, self.sent = self.sent, []
        return [to_wire(message) for message in sent]
