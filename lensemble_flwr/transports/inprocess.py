"""An in-process network on a simulated clock: every party of a federation in one process.

A transport moves wire payloads (see :mod:`messages`); receivers validate them. It also
owns the clock that timeouts are measured in: the wall clock on a real network, a
simulated clock in-process, so a federation with minutes of timeouts runs in
milliseconds and exactly the same way every time.

:class:`InProcessNetwork` runs the participants inside the coordinator's ``recv``: while
the coordinator waits, the network delivers the earliest pending message, advancing the
simulated clock to its delivery time, and lets the receiving participant react. A
:class:`FaultPlan` scripts what goes wrong: a participant that drops at a given state,
an update delayed past the deadline, a corrupted or duplicated message, a participant
coming back. What a test does by hand goes through public seams too:
:meth:`InProcessNetwork.inject` (a raw payload, as if a party sent it: junk, replays),
:meth:`~InProcessNetwork.take_offline` / :meth:`~InProcessNetwork.bring_online`,
:meth:`~InProcessNetwork.call_at` (act at a simulated time) and
:meth:`~InProcessNetwork.on_deliver` (watch every delivery).
:attr:`InProcessNetwork.delivered` keeps the most recent deliveries (a bounded log: a long
run does not grow it without end).
:mod:`lensemble_flwr.testing` gathers them for tests and users.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lensemble_flwr.errors import LensembleError
from lensemble_flwr.protocol.messages import (
    ControlMessage,
    MessageKind,
    WirePayload,
    kind_of,
    to_wire,
)
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.transports.base import COORDINATOR, MessageHandler
from lensemble_flwr.transports.faults import FaultPlan, _Drop

log = logging.getLogger(__name__)

DeliveryObserver = Callable[[str, str, WirePayload], None]
"""Called as ``observer(source, dest, payload)`` for every payload the network delivers."""

DELIVERY_LOG = 10_000
"""How many of the latest deliveries :attr:`InProcessNetwork.delivered` keeps by default."""

Delivery = tuple[float, str, str, str, "int | None"]
"""One logged delivery: ``(time, source, dest, kind, round)`` (kind as the wire's string)."""


@dataclasses.dataclass
class SimClock:
    """A clock that only moves when the network says so."""

    time: float = 0.0

    def advance_to(self, t: float) -> None:
        """Move to ``t``; a clock never goes back, so an earlier ``t`` changes nothing."""
        self.time = max(self.time, t)


class InProcessTransport:
    """One party's end of an :class:`InProcessNetwork`."""

    def __init__(self, network: InProcessNetwork, party: str) -> None:
        self._network = network
        self.party = party
        self.inbox: deque[WirePayload] = deque()

    def send(self, peer_id: str, message: ControlMessage) -> None:
        """Post ``message`` to ``peer_id`` on the network (latency, compute time and the
        scripted faults apply)."""
        self._network._post(self.party, peer_id, to_wire(message))

    def broadcast(self, message: ControlMessage) -> None:
        """Post ``message`` to every one of :meth:`peers`, as :meth:`send` does."""
        payload = to_wire(message)
        for peer in self.peers():
            self._network._post(self.party, peer, payload)

    def peers(self) -> Sequence[str]:
        """The coordinator's side: the participants online, sorted, as a tuple that stays
        the same object until one of them comes or goes (so a caller may remember what it
        derived from it); a participant's side: the coordinator."""
        if self.party == COORDINATOR:
            return self._network._online_tuple()
        return [COORDINATOR]

    def now(self) -> float:
        """The network's simulated clock, in seconds."""
        return self._network.clock.time

    def declared_size(self) -> int | None:
        """The coordinator's side: the size the network was declared with, if any."""
        return self._network.declared_size if self.party == COORDINATOR else None

    def recv(self, *, timeout_s: float) -> WirePayload | None:
        """The coordinator's side: run the network (deliveries, participants' handlers,
        scheduled calls) until a payload reaches the coordinator, or return None with the
        clock at ``timeout_s`` from now. A participant's side: the next payload left in
        its inbox (its handler is normally given each one on delivery), or None at once."""
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
        declared_size: how many participants the federation has in all, when that is
            fixed (a coordinator then refuses a quorum above it before any attempt);
            None (the default) lets participants attach at any time.
        delivery_log: how many of the latest deliveries :attr:`delivered` keeps (0: none;
            None: every one, for a short run that needs its whole history).

    Raises:
        ValueError: ``delivery_log`` is negative.
    """

    def __init__(
        self,
        *,
        latency_s: float = 0.01,
        compute_s: float = 1.0,
        faults: FaultPlan | None = None,
        join_endpoint: str = "",
        declared_size: int | None = None,
        delivery_log: int | None = DELIVERY_LOG,
    ) -> None:
        if delivery_log is not None and delivery_log < 0:
            raise ValueError(f"delivery_log must be >= 0 or None, not {delivery_log}")
        self.clock = SimClock()
        self.declared_size = declared_size
        self.latency_s = latency_s
        self.compute_s = compute_s
        self.faults = faults or FaultPlan()
        self.join_endpoint = join_endpoint
        self.coordinator = InProcessTransport(self, COORDINATOR)
        self._handlers: dict[str, MessageHandler] = {}
        self._transports: dict[str, InProcessTransport] = {}
        self._compute: dict[str, float] = {}
        self._offline: set[str] = set()
        self._online: tuple[str, ...] | None = None  # sorted; None once it changed
        self._queue: list[tuple[float, int, str, str, WirePayload]] = []
        self._calls: list[tuple[float, int, Callable[[], None]]] = []
        self._observers: list[DeliveryObserver] = []
        self._opened: set[tuple[Any, Any]] = set()
        self._seq = itertools.count()
        self.crashes: list[tuple[str, BaseException]] = []
        self.delivered: deque[Delivery] = deque(maxlen=delivery_log)
        """The latest deliveries, oldest first (at most ``delivery_log``)."""

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
        self._online = None

    def set_compute_time(self, participant_id: str, seconds: float) -> None:
        """Simulate ``seconds`` between RoundOpen and this participant's update leaving,
        instead of the network's ``compute_s``."""
        self._compute[participant_id] = seconds

    def online(self) -> list[str]:
        """The attached participants that are not offline, sorted."""
        return list(self._online_tuple())

    def _online_tuple(self) -> tuple[str, ...]:
        """:meth:`online` as a tuple, sorted once per change of who is online."""
        if self._online is None:
            self._online = tuple(sorted(p for p in self._handlers if p not in self._offline))
        return self._online

    def _go_offline(self, participant_id: str) -> None:
        if participant_id not in self._offline:
            self._offline.add(participant_id)
            self._online = None

    def _go_online(self, participant_id: str) -> None:
        if participant_id in self._offline:
            self._offline.discard(participant_id)
            self._online = None

    # -- what a test does by hand --------------------------------------------------------
    def inject(self, source: str, dest: str, payload: WirePayload) -> None:
        """Post ``payload`` as if ``source`` had sent it to ``dest``: junk, a replay of a
        payload seen earlier, a copy relabelled for another round. It travels like any
        message ``source`` sends (latency, compute time, the scripted faults), and
        ``dest`` validates it as it validates everything it receives."""
        self._post(source, dest, payload)

    def take_offline(self, participant_id: str) -> None:
        """The participant vanishes now, until :meth:`bring_online` or a scripted rejoin:
        nothing it sends from now on leaves (what it sent before is still delivered),
        nothing reaches it (messages in flight to it are lost), and the coordinator no
        longer sees it among its peers."""
        if participant_id == COORDINATOR:
            raise ValueError("the coordinator cannot be taken offline; stop calling recv")
        self._go_offline(participant_id)

    def bring_online(self, participant_id: str) -> None:
        """Undo :meth:`take_offline`: the participant is reachable again, as it was when
        it vanished (it is not rejoined: ``join`` is not called)."""
        self._go_online(participant_id)

    def call_at(self, time_s: float, action: Callable[[], None]) -> None:
        """Run ``action()`` when the simulated clock reaches ``time_s`` (e.g. attach a
        participant while a round is OPEN). Calls run in time order, interleaved with the
        deliveries; one due at the same time as a message runs after the messages posted
        before it was scheduled. A call due after the last message :meth:`flush`
        delivers does not run there."""
        heapq.heappush(self._calls, (time_s, next(self._seq), action))

    def on_deliver(self, observer: DeliveryObserver) -> DeliveryObserver:
        """Call ``observer(source, dest, payload)`` for every payload delivered from now
        on (to the coordinator or a participant, reachable or not), before its recipient
        sees it. Returns ``observer``, so it can decorate a function."""
        self._observers.append(observer)
        return observer

    # -- delivery ----------------------------------------------------------------------
    def _post(self, source: str, dest: str, payload: WirePayload) -> None:
        # the network routes on kind and round; junk there is the recipient's to reject
        kind = kind_of(payload)
        rnd = payload.get("round") if isinstance(payload.get("round"), int) else None
        if source == COORDINATOR and kind is MessageKind.ROUND_OPEN:
            key = (rnd, payload.get("attempt"))
            if key not in self._opened and self._opens_anew(rnd):  # an attempt's first
                self._opened.add(key)
                self._round_opens(rnd)  # type: ignore[arg-type]
        if source in self._offline or dest in self._offline:
            return
        delay = self.latency_s
        if source != COORDINATOR and kind is MessageKind.UPDATE:
            delay += self._compute.get(source, self.compute_s)
            delay += self.faults.delays.pop((source, rnd), 0.0)  # type: ignore[arg-type]
            if self._take_drop(source, rnd, RoundState.COLLECTING):
                log.info("fault: %s drops in round %s before its update", source, rnd)
                self._go_offline(source)
                return
        sent = payload
        for c in list(self.faults.corruptions):
            if (c.participant_id, c.round, c.kind) == (source, rnd, kind):
                self.faults.corruptions.remove(c)
                payload = c.mutate(dict(payload))
        due = self.clock.time + delay
        heapq.heappush(self._queue, (due, next(self._seq), source, dest, payload))
        for d in list(self.faults.duplicates):
            if (d.participant_id, d.round, d.kind) == (source, rnd, kind):
                self.faults.duplicates.remove(d)
                log.info("fault: %s sends its %s of round %s twice", source, kind, rnd)
                heapq.heappush(self._queue, (due, next(self._seq), source, dest, dict(sent)))

    def _opens_anew(self, rnd: Any) -> bool:
        """Whether a RoundOpen of round ``rnd`` may be the first of its attempt: only the
        latest round's attempts are remembered (a set of every attempt ever opened would
        grow without end); one of an earlier round opens nothing again."""
        latest = max((r for r, _ in self._opened if isinstance(r, int)), default=None)
        if isinstance(rnd, int) and latest is not None and rnd != latest:
            if rnd < latest:
                return False
            self._opened = {k for k in self._opened if not isinstance(k[0], int)}
        return True

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
                self._go_online(pid)
                join = getattr(self._handlers[pid], "join", None)
                if join is not None:
                    log.info("fault: %s rejoins at round %s", pid, rnd)
                    try:
                        join(self.join_endpoint)
                    except LensembleError as exc:  # e.g. a tampered checkpoint: it stays out
                        log.warning("%s cannot rejoin: %r", pid, exc)
                        self._go_offline(pid)
            if self._take_drop(pid, rnd, RoundState.OPEN):
                log.info("fault: %s drops in round %s before RoundOpen", pid, rnd)
                self._go_offline(pid)

    def _deliver(self, source: str, dest: str, payload: WirePayload) -> None:
        kind = kind_of(payload) if isinstance(payload, dict) else None
        rnd = payload.get("round") if isinstance(payload, dict) else None
        if self.delivered.maxlen != 0:
            self.delivered.append((self.clock.time, source, dest, str(kind), rnd))  # type: ignore[arg-type]
        for observer in self._observers:
            observer(source, dest, payload)
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
                self._go_offline(dest)
                return

    def flush(self) -> None:
        """Deliver everything still in flight (e.g. the last RoundClose after ``run``)."""
        while self._queue:
            self._step(float("inf"))

    def _step(self, deadline: float) -> bool:
        """Deliver the earliest message, or run the earliest :meth:`call_at` action, due
        by ``deadline``; False if nothing is due by then."""
        message = self._queue[0][:2] if self._queue else None
        call = self._calls[0][:2] if self._calls else None
        if call is not None and call[0] <= deadline and (message is None or call < message):
            t, _, action = heapq.heappop(self._calls)
            self.clock.advance_to(t)
            action()
            return True
        if message is None or message[0] > deadline:
            return False
        t, _, source, dest, payload = heapq.heappop(self._queue)
        self.clock.advance_to(t)
        self._deliver(source, dest, payload)
        return True

    def _run_until_coordinator_message(self, timeout_s: float) -> WirePayload | None:
        deadline = self.clock.time + max(0.0, timeout_s)
        while not self.coordinator.inbox:
            if not self._step(deadline):
                self.clock.advance_to(deadline)
                return None
        return self.coordinator.inbox.popleft()
