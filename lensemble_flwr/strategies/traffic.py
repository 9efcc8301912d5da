"""What a GridTransport counts per round: instructions, bytes, the nodes' own metrics.

The strategy reports them with the round (``lensemble.exchanges``, ``lensemble.bytes-sent``,
``lensemble.bytes-received``, and the contributors' metrics aggregated as FedAvg does),
then forgets them (:meth:`RoundTraffic.forget_through`), so that nothing here grows with
the run. Round -1 holds what belongs to no round (evaluation instructions, replies).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RoundTraffic:
    """Per-round counts of one transport (see the module)."""

    # instructions per participant, per round (every attempt of the round together)
    sent_per_round: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    bytes_sent: int = 0  # over the whole run
    bytes_received: int = 0
    # (sent, received) bytes of each round's instructions and their replies
    bytes_per_round: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # (round, participant) -> the numeric metrics of its train reply
    client_metrics: dict[tuple[int, str], dict[str, float]] = dataclasses.field(
        default_factory=dict
    )

    def count_sent(self, peer: str, round: int, count: int = 1) -> None:
        """``count`` more instructions of ``round`` for ``peer`` (negative: taken back)."""
        per_peer = self.sent_per_round.setdefault(round, {})
        per_peer[peer] = per_peer.get(peer, 0) + count

    def add_bytes(self, round: int, *, sent: int = 0, received: int = 0) -> None:
        """Content bytes sent for, or received from, ``round``'s messages."""
        self.bytes_sent += sent
        self.bytes_received += received
        counts = self.bytes_per_round.setdefault(round, [0, 0])
        counts[0] += sent
        counts[1] += received

    def exchanges(self, round: int) -> int:
        """Instructions the busiest participant had to answer in ``round`` (1 when a round
        is a single exchange)."""
        return max(self.sent_per_round.get(round, {}).values(), default=0)

    def round_bytes(self, round: int) -> tuple[int, int]:
        """Bytes of ``round``'s instructions sent and of their replies received (every
        attempt of the round; content bytes, as ``bytes_sent`` counts them)."""
        sent, received = self.bytes_per_round.get(round, (0, 0))
        return sent, received

    def forget_through(self, round: int) -> None:
        """Drop the counts of ``round`` and every round before it, once the strategy
        reported it: kept, they grew with every round of a long run."""
        self.client_metrics = {k: m for k, m in self.client_metrics.items() if k[0] > round}
        self.sent_per_round = {r: n for r, n in self.sent_per_round.items() if r > round}
        self.bytes_per_round = {r: b for r, b in self.bytes_per_round.items() if r > round}
