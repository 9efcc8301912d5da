"""The Transport protocol, and an in-process network on a simulated clock.

A transport moves wire payloads (see :mod:`messages`); receivers validate them. It also
owns the clock that timeouts are measured in: the wall clock on a real network, a
simulated clock in-process, so a federation with minutes of timeouts runs in
milliseconds and exactly the same way every time.

:class:`InProcessNetwork` runs the participants inside the coordinator's ``recv``: while
the coordinator waits, the network delivers the earliest pending message, advancing the
simulated clock to its delivery time, and lets the receiving participant react. A
:class:`FaultPlan` scripts what goes wrong: a participant that drops at a given state,
an update delayed past the deadline, a corrupted message, a participant coming back.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from lensemble_flwr.errors import LensembleError
from lensemble_flwr.protocol.messages import ControlMessage, WirePayload, to_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.transports.base import COORDINATOR, MessageHandler
from lensemble_flwr.transports.faults import FaultPlan, _Drop

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SimClock:
    """A clock that only moves when the network says so."""

    time: float = 0.0

    def advance_to(self, t: float) -> None:
        self.time = max(self.time, t)


class InProcessTransport:
    """One party's end of an :class:`InProcessNetwork`."""

    def __init__(self, network: InProcessNetwork, party: str) -> None:
        self._network = network
        self.party = party
        self.inbox: deque[WirePayload] = deque()

    def send(self, peer_id: str, message: ControlMessage) -> None:
        self._network._post(self.party, peer_id, to_wire(message))

    def broadcast(self, message: ControlMessage) -> None:
        payload = to_wire(message)
        for peer in self.peers():
            self._network._post(self.party, peer, payload)

    def peers(self) -> Sequence[str]:
        if self.party == COORDINATOR:
            return self._network.online()
        return [COORDINATOR]

    def now(self) -> float:
        return self._network.clock.time

    def recv(self, *, timeout_s: float) -> WirePayload | None:
        if self.party != COORDINATOR:
            return self.inbox.popleft() if self.inbox else None
        return self._network._run_until_coordinator_message(timeout_s)


class InProcessNetwork:
    """Every party of a federation in one process, on one simulated clock.

    Args:
        latency_s: one-way delivery time of every message.
        compute_s: simulated time a participant spends between receiving RoundOpen and
            its update leaving (its H inner steps); override per participant with
            :meth:`set_compute_time`.
        faults: the scripted faults.
        join_endpoint: what a rejoining participant's ``join`` is given.
    """

    def __init__(
        self,
        *,
        latency_s: float = 0.01,
        compute_s: float = 1.0,
        faults: FaultPlan | None = None,
        join_endpoint: str = "",
    ) -> None:
        self.clock = SimClock()
        self.latency_s = latency_s
        self.compute_s = compute_s
        self.faults = faults or FaultPlan()
        self.join_endpoint = join_endpoint
        self.coordinator = InProcessTransport(self, COORDINATOR)
        self._handlers: dict[str, MessageHandler] = {}
        self._transports: dict[str, InProcessTransport] = {}
        self._compute: dict[str, float] = {}
        self._offline: set[str] = set()
        self._queue: list[tuple[float, int, str, str, WirePayload]] = []
        self._opened: set[tuple[Any, Any]] = set()
        self._seq = itertools.count()
        self.crashes: list[tuple[str, BaseException]] = []
        self.delivered: list[tuple[float, str, str, str, int]] = []

    # -- wiring ------------------------------------------------------------------------
    def transport_for(self, participant_id: str) -> InProcessTransport:
        """The transport a participant is constructed with."""
        if participant_id == COORDINATOR:
            raise ValueError(f"{COORDINATOR!r} is reserved for the coordinator")
        return self._transports.setdefault(participant_id, InProcessTransport(self, participant_id))

    def attach(self, handler: MessageHandler) -> None:
        """Register a participant so the network delivers its messages to it."""
        self.transport_for(handler.participant_id)
        self._handlers[handler.participant_id] = handler

    def set_compute_time(self, participant_id: str, seconds: float) -> None:
        self._compute[participant_id] = seconds

    def online(self) -> list[str]:
        return sorted(p for p in self._handlers if p not in self._offline)

    # -- delivery ----------------------------------------------------------------------
    def _post(self, source: str, dest: str, payload: WirePayload) -> None:
        # the network routes on kind and round; junk there is the recipient's to reject
        kind = payload.get("kind") if isinstance(payload.get("kind"), str) else None
        rnd = payload.get("round") if isinstance(payload.get("round"), int) else None
        if source == COORDINATOR and kind == "round-open":
            key = (rnd, payload.get("attempt"))
            if key not in self._opened:  # the first RoundOpen of an attempt
                self._opened.add(key)
                self._round_opens(rnd)  # type: ignore[arg-type]
        if source in self._offline or dest in self._offline:
            return
        delay = self.latency_s
        if source != COORDINATOR and kind == "update":
            delay += self._compute.get(source, self.compute_s)
            delay += self.faults.delays.pop((source, rnd), 0.0)  # type: ignore[arg-type]
            if self._take_drop(source, rnd, RoundState.COLLECTING):
                log.info("fault: %s drops in round %s before its update", source, rnd)
                self._offline.add(source)
                return
        for c in list(self.faults.corruptions):
            if (c.participant_id, c.round, c.kind) == (source, rnd, kind):
                self.faults.corruptions.remove(c)
                payload = c.mutate(dict(payload))
        due = self.clock.time + delay
        heapq.heappush(self._queue, (due, next(self._seq), source, dest, payload))

    def _take_drop(self, pid: str, rnd: Any, at: RoundState) -> bool:
        drop = _Drop(pid, rnd, at)
        if drop in self.faults.drops:
            self.faults.drops.remove(drop)
            return True
        return False

    def _round_opens(self, rnd: int) -> None:
        """Apply the rejoins and OPEN-state drops scripted for round ``rnd``."""
        for pid in sorted(self._handlers):
            if pid in self._offline and rnd in self.faults.rejoins.get(pid, []):
                self.faults.rejoins[pid].remove(rnd)
                self._offline.discard(pid)
                join = getattr(self._handlers[pid], "join", None)
                if join is not None:
                    log.info("fault: %s rejoins at round %s", pid, rnd)
                    try:
                        join(self.join_endpoint)
                    except LensembleError as exc:  # e.g. a tampered checkpoint: it stays out
                        log.warning("%s cannot rejoin: %r", pid, exc)
                        self._offline.add(pid)
            if self._take_drop(pid, rnd, RoundState.OPEN):
                log.info("fault: %s drops in round %s before RoundOpen", pid, rnd)
                self._offline.add(pid)

    def _deliver(self, source: str, dest: str, payload: WirePayload) -> None:
        kind = payload.get("kind") if isinstance(payload, dict) else None
        rnd = payload.get("round") if isinstance(payload, dict) else None
        self.delivered.append((self.clock.time, source, dest, str(kind), rnd))  # type: ignore[arg-type]
        if dest == COORDINATOR:
            self.coordinator.inbox.append(payload)
            return
        if dest in self._offline or dest not in self._handlers:
            return
        self._transports[dest].inbox.append(payload)
        handler = self._handlers[dest]
        transport = self._transports[dest]
        while transport.inbox:
            item = transport.inbox.popleft()
            try:
                handler.handle(item)
            except Exception as exc:  # a participant bug is its crash, not the federation's
                log.exception("participant %s crashed handling %s", dest, kind)
                self.crashes.append((dest, exc))
                self._offline.add(dest)
                return

    def flush(self) -> None:
        """Deliver everything still in flight (e.g. the last RoundClose after ``run``)."""
        while self._queue:
            t, _, source, dest, payload = heapq.heappop(self._queue)
            self.clock.advance_to(t)
            self._deliver(source, dest, payload)

    def _run_until_coordinator_message(self, timeout_s: float) -> WirePayload | None:
        deadline = self.clock.time + max(0.0, timeout_s)
        while not self.coordinator.inbox:
            if not self._queue or self._queue[0][0] > deadline:
                self.clock.advance_to(deadline)
                return None
            t, _, source, dest, payload = heapq.heappop(self._queue)
            self.clock.advance_to(t)
            self._deliver(source, dest, payload)
        return self.coordinator.inbox.popleft()
