"""The verification rules (provenance/verify.py) on hand-made values: each rule's guard
trips on its own, a sound round trips none, and ``verify`` raises a rule's own sentence.
(Whole runs, tampered on disk, are in test_adversarial_verify.py and test_audit.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    ContributionRecord,
    ExternalStep,
    RoundEntry,
    pruned_name,
)
from lensemble_flwr.provenance.verify import (
    LinkBreak,
    attempt_breaks,
    closed_attempt,
    newest_checkpoint_breaks,
)


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


BEFORE = _hash("g0")  # the global state the round before left


def _entry(attempt: int, state: RoundState = RoundState.ABORTED, **changes: object) -> RoundEntry:
    fields: dict[str, object] = {
        "round": 2,
        "attempt": attempt,
        "state": state,
        "round_seed": 5,
        "prior_global_hash": BEFORE,
    }
    if state is RoundState.CLOSED:
        fields["new_global_hash"] = _hash("g1")
    fields.update(changes)
    return RoundEntry(**fields)  # type: ignore[arg-type]


def _breaks(attempts: list[RoundEntry], *, last_round: bool = False) -> list[LinkBreak]:
    return list(attempt_breaks(2, attempts, committed_hash=BEFORE, last_round=last_round))


def test_a_sound_round_breaks_no_attempt_rule() -> None:
    attempts = [_entry(1), _entry(2), _entry(3, RoundState.CLOSED)]
    assert _breaks(attempts) == []
    assert closed_attempt(attempts) == attempts[2]
    assert _breaks([_entry(1)], last_round=True) == []  # the newest round may be open still
    assert _breaks([]) == [] and closed_attempt([]) is None


def test_attempts_are_numbered_in_order() -> None:
    (broken,) = _breaks([_entry(1), _entry(3, RoundState.CLOSED)])
    assert (broken.field, broken.expected, broken.found) == ("manifest.attempt", "2", "3")
    assert broken.round == 2 and broken.attempt is None  # about the round, not one attempt


def test_no_attempt_follows_the_closed_one() -> None:
    (broken,) = _breaks([_entry(1, RoundState.CLOSED), _entry(2)])
    assert broken.field == "manifest.state"
    assert broken.expected == "no attempt after closed attempt 1"
    assert broken.found == f"attempt 2 ({RoundState.ABORTED})"


def test_a_round_with_only_aborted_attempts_must_be_the_last() -> None:
    (broken,) = _breaks([_entry(1), _entry(2)])
    assert (broken.field, broken.expected, broken.found) == (
        "manifest.state",
        "a closed attempt before the next round",
        "only aborted attempts",
    )


def test_every_attempt_starts_from_the_state_the_round_before_left() -> None:
    (broken,) = _breaks([_entry(1, RoundState.CLOSED, prior_global_hash=_hash("other"))])
    assert (broken.field, broken.expected, broken.found) == (
        "manifest.prior_global_hash",
        BEFORE,
        _hash("other"),
    )
    assert broken.attempt == 1
    # a missing prior state is shown as it is: None, not the string "None"
    (missing,) = attempt_breaks(2, [_entry(1)], committed_hash=None, last_round=True)
    assert missing.expected is None


def test_an_aborted_attempt_produces_no_global_state() -> None:
    (broken,) = _breaks([_entry(1, new_global_hash=_hash("g1")), _entry(2, RoundState.CLOSED)])
    assert (broken.field, broken.found, broken.attempt) == (
        "manifest.new_global_hash",
        _hash("g1"),
        1,
    )


def test_a_round_has_one_external_step_starting_from_the_state_before() -> None:
    step = ExternalStep(
        committed_hash=BEFORE, adopted_hash=_hash("adopted"), checkpoint=_hash("c"), change_norm=1.0
    )
    adopted = {"external_step": step, "prior_global_hash": step.adopted_hash}
    sound = [_entry(1, **adopted), _entry(2, RoundState.CLOSED, **adopted)]
    assert _breaks(sound) == []
    (changed,) = _breaks([_entry(1, **adopted), _entry(2, RoundState.CLOSED)])
    assert (changed.field, changed.found, changed.attempt) == ("manifest.external_step", "none", 2)
    elsewhere = step.model_copy(update={"committed_hash": _hash("elsewhere")})
    (broken,) = _breaks(
        [_entry(1, RoundState.CLOSED, external_step=elsewhere, prior_global_hash=step.adopted_hash)]
    )
    assert (broken.field, broken.expected, broken.found) == (
        "manifest.external_step.committed_hash",
        BEFORE,
        _hash("elsewhere"),
    )


def _record(round: int, checkpoint: str) -> ContributionRecord:
    return ContributionRecord(
        round=round,
        attempt=1,
        invited=(),
        contributors=("p0",),
        count=1,
        total_weight=1,
        dataset_roots={"p0": None},
        update_digests={"p0": _hash("u")},
        aggregate_digest=_hash("a"),
        previous_global_hash=BEFORE,
        new_global_hash=_hash("g1"),
        checkpoint=checkpoint,
        round_seed=1,
        header_digest=_hash("h"),
        entries_digest=_hash("e"),
        registry_digest=None,
        previous_record_hash=_hash("r"),
    )


def test_the_newest_checkpoint_must_be_kept(tmp_path: Path) -> None:
    store = Store(tmp_path)
    kept = store.put(b"a checkpoint")
    gone = _hash("pruned checkpoint")  # not in the store, and marked pruned
    store.bind(pruned_name(gone), store.put(b"round 3"))
    assert list(newest_checkpoint_breaks(store, [])) == []
    assert list(newest_checkpoint_breaks(store, [_record(3, gone), _record(4, kept)])) == []
    (broken,) = newest_checkpoint_breaks(store, [_record(3, kept), _record(4, gone)])
    assert (broken.round, broken.field, broken.expected, broken.found) == (
        4,
        "checkpoint",
        "kept (newest)",
        "pruned",
    )
    # what verify raises (test_retention.py runs it on a pruned run)
    assert broken.message == "round 4: the newest checkpoint was pruned (resuming needs it)"
    missing = _hash("lost")  # missing without a marker: the checkpoint rules' business
    assert list(newest_checkpoint_breaks(store, [_record(4, missing)])) == []
