"""traffic.py: a transport's per-round counts, and forgetting them once reported."""

from __future__ import annotations

from lensemble_flwr.strategies.traffic import RoundTraffic


def test_counts_are_per_round_and_the_runs_totals_add_up() -> None:
    traffic = RoundTraffic()
    traffic.count_sent("a", 1)
    traffic.count_sent("a", 1)  # a retried attempt: a second instruction in round 1
    traffic.count_sent("b", 1)
    traffic.add_bytes(1, sent=100)
    traffic.add_bytes(1, received=40)
    traffic.add_bytes(-1, sent=7)  # an evaluation instruction: no round's
    assert traffic.exchanges(1) == 2 and traffic.exchanges(2) == 0
    assert traffic.round_bytes(1) == (100, 40) and traffic.round_bytes(2) == (0, 0)
    assert (traffic.bytes_sent, traffic.bytes_received) == (107, 40)


def test_an_instruction_taken_back_is_not_counted() -> None:
    traffic = RoundTraffic()
    traffic.count_sent("a", 3)
    traffic.count_sent("a", 3, -1)  # left out by configure_train: never sent
    assert traffic.exchanges(3) == 0


def test_forgetting_a_round_keeps_the_later_ones_and_the_totals() -> None:
    traffic = RoundTraffic()
    for r in (1, 2, 3):
        traffic.count_sent("a", r)
        traffic.add_bytes(r, sent=10)
        traffic.client_metrics[(r, "a")] = {"loss": float(r)}
    traffic.forget_through(2)
    assert list(traffic.sent_per_round) == [3] and list(traffic.bytes_per_round) == [3]
    assert list(traffic.client_metrics) == [(3, "a")]
    assert traffic.bytes_sent == 30
