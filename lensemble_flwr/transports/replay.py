"""A transport that replays replies which were already collected.

Whoever collected the replies some other way runs the *same* state machine on them by
wrapping them in this transport: Flower's stock ``Strategy.start`` loop (which hands them
to ``aggregate_train``) and the shared-folder barrier (whose records are in a folder).
Sends go nowhere (the instructions already went out), ``recv`` returns the collected
payloads in order and then nothing, and its clock jumps past each timeout.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from lensemble_flwr.protocol.messages import ControlMessage, WirePayload


class ReplayTransport:
    """The coordinator's end of a set of already-collected replies."""

    def __init__(self, payloads: Iterable[WirePayload], peers: Iterable[str]) -> None:
        self._payloads = deque(payloads)
        self._peers = sorted(set(peers))
        self._time = 0.0
        self.sent: list[tuple[str, ControlMessage]] = []

    def send(self, peer_id: str, message: ControlMessage) -> None:
        self.sent.append((peer_id, message))

    def broadcast(self, message: ControlMessage) -> None:
        self.sent.extend((peer, message) for peer in self._peers)

    def peers(self) -> Sequence[str]:
        return list(self._peers)

    def now(self) -> float:
        return self._time

    def recv(self, *, timeout_s: float) -> WirePayload | None:
        if self._payloads:
            return self._payloads.popleft()
        self._time += max(0.0, timeout_s)
        return None
