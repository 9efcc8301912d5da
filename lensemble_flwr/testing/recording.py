"""What an in-process network delivers, kept to assert on.

A :class:`DeliveryLog` subscribes to
:meth:`~lensemble_flwr.transports.inprocess.InProcessNetwork.on_deliver` and keeps every
payload delivered from then on (to one party, if asked), with when, from and to whom::

    seen = DeliveryLog(network, dest=COORDINATOR)
    coordinator.run(2)
    updates = seen.payloads(MessageKind.UPDATE, round=1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from lensemble_flwr.protocol.messages import MessageKind, WirePayload, kind_of
from lensemble_flwr.transports.inprocess import InProcessNetwork


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One payload as the network delivered it."""

    time: float
    """The simulated time of the delivery."""
    source: str
    dest: str
    payload: WirePayload


class DeliveryLog:
    """Every payload ``network`` delivers from now on (only those to ``dest``, if given),
    in delivery order, whether or not its recipient is still reachable.

    Args:
        network: the in-process network to watch.
        dest: keep only what is delivered to this party (e.g. ``COORDINATOR``).
    """

    def __init__(self, network: InProcessNetwork, *, dest: str | None = None) -> None:
        self.dest = dest
        self.deliveries: list[Delivery] = []
        self._clock = network.clock
        network.on_deliver(self._record)

    def _record(self, source: str, dest: str, payload: WirePayload) -> None:
        if self.dest is None or dest == self.dest:
            self.deliveries.append(Delivery(self._clock.time, source, dest, payload))

    def payloads(
        self,
        kind: MessageKind | None = None,
        *,
        round: int | None = None,
        source: str | None = None,
    ) -> list[WirePayload]:
        """The payloads delivered, in order: of message kind ``kind`` (e.g.
        ``MessageKind.UPDATE``; its wire string is accepted too, a string that names no
        kind raises ValueError) in ``round`` from ``source``, for each filter given. A
        payload that is not a mapping (junk) passes no filter on kind or round."""
        wanted = None if kind is None else MessageKind(kind)

        def keep(d: Delivery) -> bool:
            if source is not None and d.source != source:
                return False
            if kind is None and round is None:
                return True
            if not isinstance(d.payload, Mapping):
                return False
            return (wanted is None or kind_of(d.payload) is wanted) and (
                round is None or d.payload.get("round") == round
            )

        return [d.payload for d in self.deliveries if keep(d)]

    def __len__(self) -> int:
        return len(self.deliveries)

    def __iter__(self) -> Iterator[Delivery]:
        return iter(self.deliveries)
