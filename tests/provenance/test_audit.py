"""The run audit: a real run directory passes, and each way of tampering with it is caught
and named by round, field, expected and found value."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from run_dir_helpers import (
    blob_path,
    digest_of,
    flip_byte,
    read_json,
    rebind,
    reseal_record,
    rewrite_json,
    synthetic_run,
)

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import LedgerError, LensembleError
from lensemble_flwr.provenance.audit import (
    AuditFailure,
    Finding,
    NotARunDirectory,
    audit_run,
    open_run,
)
from lensemble_flwr.provenance.ledger import REGISTRY, Ledger
from lensemble_flwr.provenance.verify import verify


def test_an_untouched_run_passes_with_its_counts(run: Path) -> None:
    report = audit_run(run)
    assert report.ok and report.first is None
    assert (report.rounds_closed, report.attempts_aborted, report.records) == (3, 1, 3)
    assert report.checkpoints == 4  # θ_0 and one per closed round
    records = verify(Store(run))
    assert report.head_record_hash == records[-1].record_hash
    assert report.final_global_hash == records[-1].new_global_hash
    report.raise_on_failure()  # nothing to raise


def test_a_hand_made_run_passes(tmp_path: Path) -> None:
    roots = [{"a": "aa" * 32, "b": "bb" * 32}, {"a": "aa" * 32}]
    assert audit_run(synthetic_run(tmp_path / "syn", roots)).ok


def test_the_manifests_frame_drift_must_be_the_ledgers(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "syn", [{"a": "aa" * 32}] * 2)
    entry = read_json(run, "manifest/rounds/00000002-0001")
    rewrite_json(
        run,
        "manifest/rounds/00000002-0001",
        diagnostics=entry["diagnostics"] | {"frame_drift": 0.5},
    )
    first = audit_run(run).first
    assert first == Finding("round 2", "manifest.diagnostics.frame_drift", "0.02", "0.5", 2)


def test_a_folder_that_is_not_a_run_is_refused_and_left_untouched(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotARunDirectory, match="not a run directory"):
        audit_run(empty)
    with pytest.raises(NotARunDirectory):
        open_run(tmp_path / "missing")
    assert list(empty.iterdir()) == [] and not (tmp_path / "missing").exists()


# -- tampering: each case names its first broken link ------------------------------------------
def _checkpoint_of(run: Path, round: int) -> Path:
    return blob_path(run, read_json(run, f"ledger/{round:08d}")["checkpoint"])


def flip_checkpoint_byte(run: Path) -> tuple[str, str, str | None]:
    flip_byte(_checkpoint_of(run, 2))
    return "round 2", "checkpoint sha256", read_json(run, "ledger/00000002")["checkpoint"]


def delete_checkpoint(run: Path) -> tuple[str, str, str | None]:
    _checkpoint_of(run, 3).unlink()
    return "round 3", "checkpoint", read_json(run, "ledger/00000003")["checkpoint"]


def point_record_at_a_non_checkpoint(run: Path) -> tuple[str, str, str | None]:
    # a resealed head record whose "checkpoint" is a blob that is no checkpoint at all
    reseal_record(run, "ledger/00000003", checkpoint=digest_of(run, "manifest/header"))
    return "round 3", "checkpoint", "a lensemble checkpoint"


def flip_initial_checkpoint_byte(run: Path) -> tuple[str, str, str | None]:
    digest = read_json(run, "manifest/header")["initial_checkpoint"]
    flip_byte(blob_path(run, digest))
    return "initial checkpoint", "checkpoint sha256", digest


def edit_record_in_place(run: Path) -> tuple[str, str, str | None]:
    # the record's blob no longer hashes to its address
    path = blob_path(run, digest_of(run, "ledger/00000002"))
    path.write_bytes(path.read_bytes().replace(b'"count":4', b'"count":5'))
    return "ledger/00000002", "blob sha256", digest_of(run, "ledger/00000002")


def edit_record_count(run: Path) -> tuple[str, str, str | None]:
    rewrite_json(run, "ledger/00000002", count=3)  # the record hash still covers count=4
    return "round 2", "ledger.record_hash", None


def reseal_edited_record(run: Path) -> tuple[str, str, str | None]:
    # a forger who recomputes the record hash breaks the next record's link instead
    forged = reseal_record(run, "ledger/00000002", epsilon=dict.fromkeys(("p00", "p01"), 0.0))
    return "round 3", "ledger.previous_record_hash", forged.record_hash


def remove_middle_record(run: Path) -> tuple[str, str, str | None]:
    (run / "names" / "ledger" / "00000002").unlink()
    return "round 2", "ledger record", "a record for closed attempt 2"


def remove_last_record(run: Path) -> tuple[str, str, str | None]:
    (run / "names" / "ledger" / "00000003").unlink()
    return "round 3", "ledger record", "a record for closed attempt 1"


def alter_aggregate_digest(run: Path) -> tuple[str, str, str | None]:
    expected = read_json(run, "ledger/00000002")["aggregate_digest"]
    rewrite_json(run, "manifest/rounds/00000002-0002", aggregate_digest="ab" * 32)
    return "round 2", "manifest.aggregate_digest", expected


def alter_update_digest(run: Path) -> tuple[str, str, str | None]:
    entry = read_json(run, "manifest/rounds/00000003-0001")
    digests = entry["update_digests"] | {"p02": "cd" * 32}
    rewrite_json(run, "manifest/rounds/00000003-0001", update_digests=digests)
    return "round 3", "manifest.update_digests", None


def alter_aborted_prior_hash(run: Path) -> tuple[str, str, str | None]:
    expected = read_json(run, "ledger/00000001")["new_global_hash"]
    rewrite_json(run, "manifest/rounds/00000002-0001", prior_global_hash="ef" * 32)
    return "round 2 attempt 1", "manifest.prior_global_hash", expected


def rename_record(run: Path) -> tuple[str, str, str | None]:
    # ledger/00000002 now holds round 3's record
    (run / "names" / "ledger" / "00000002").write_text(digest_of(run, "ledger/00000003") + "\n")
    return "ledger/00000002", "round", "ledger/00000002"


def tamper_manifest_header(run: Path) -> tuple[str, str, str | None]:
    flip_byte(blob_path(run, digest_of(run, "manifest/header")), offset=5)
    return "manifest/header", "blob sha256", digest_of(run, "manifest/header")


def header_with_rounds(run: Path) -> tuple[str, str, str | None]:
    # a header carries no rounds (they are entries of their own): the audit reads it with
    # the same parser as the runtime, so both refuse it
    rewrite_json(run, "manifest/header", rounds=[])
    return "manifest/header", "contents", None


def unsorted_contributors(run: Path) -> tuple[str, str, str | None]:
    # the contributing set is the sorted list of who sent an update: same set, other order
    record = read_json(run, "ledger/00000003")
    reseal_record(run, "ledger/00000003", contributors=record["contributors"][::-1])
    return "round 3", "ledger.update_digests senders", None


def skip_a_round(run: Path) -> tuple[str, str, str | None]:
    # an aborted attempt of round 5 where round 4 was never attempted
    entry = read_json(run, "manifest/rounds/00000003-0001") | {"round": 5, "state": "aborted"}
    entry |= {"new_global_hash": None, "reason": "forged"}
    entry["prior_global_hash"] = read_json(run, "ledger/00000003")["new_global_hash"]
    rebind(run, "manifest/rounds/00000005-0001", json.dumps(entry, sort_keys=True).encode())
    return "round 5", "round sequence", "4"


def mark_closed_attempt_aborted(run: Path) -> tuple[str, str, str | None]:
    rewrite_json(run, "manifest/rounds/00000003-0001", state="aborted", new_global_hash=None)
    return "round 3", "manifest closed attempt", None


def file_entry_under_another_attempt(run: Path) -> tuple[str, str, str | None]:
    # round 3's entry (attempt 1) bound a second time, as attempt 2
    (run / "names" / "manifest" / "rounds" / "00000003-0002").write_text(
        digest_of(run, "manifest/rounds/00000003-0001") + "\n"
    )
    return "manifest/rounds/00000003-0002", "round and attempt", "manifest/rounds/00000003-0002"


def remove_aborted_attempt(run: Path) -> tuple[str, str, str | None]:
    # round 2's closed attempt 2 is now its first
    (run / "names" / "manifest" / "rounds" / "00000002-0001").unlink()
    return "round 2", "manifest.attempt", "1"


def give_aborted_attempt_a_new_state(run: Path) -> tuple[str, str, str | None]:
    rewrite_json(run, "manifest/rounds/00000002-0001", new_global_hash="ef" * 32)
    return "round 2 attempt 1", "manifest.new_global_hash", "none (the attempt was aborted)"


def garble_a_name(run: Path) -> tuple[str, str, str | None]:
    (run / "names" / "ledger" / "00000002").write_text("not a digest\n")
    return "ledger/00000002", "name", "a bound name"


TAMPERS: list[Callable[[Path], tuple[str, str, str | None]]] = [
    flip_checkpoint_byte,
    delete_checkpoint,
    point_record_at_a_non_checkpoint,
    flip_initial_checkpoint_byte,
    edit_record_in_place,
    edit_record_count,
    reseal_edited_record,
    remove_middle_record,
    remove_last_record,
    alter_aggregate_digest,
    alter_update_digest,
    alter_aborted_prior_hash,
    rename_record,
    tamper_manifest_header,
    header_with_rounds,
    unsorted_contributors,
    skip_a_round,
    mark_closed_attempt_aborted,
    file_entry_under_another_attempt,
    remove_aborted_attempt,
    give_aborted_attempt_a_new_state,
    garble_a_name,
]

# links verify() does not look at: none since it checks the round in flight's entries too
# (skip_a_round was one); the aborted attempts' entries of committed rounds are in it since
# the records commit to their round's entries
BEYOND_VERIFY: set[Callable[..., object]] = set()


@pytest.mark.parametrize("tamper", TAMPERS, ids=lambda f: f.__name__)
def test_tampering_is_caught_and_the_first_broken_link_named(
    run: Path, tamper: Callable[[Path], tuple[str, str, str | None]]
) -> None:
    where, field, expected = tamper(run)
    report = audit_run(run)
    assert not report.ok
    first = report.first
    assert first is not None
    assert (first.where, first.field) == (where, field), report.findings
    if expected is not None:
        assert first.expected == expected
    assert first.found is not None and first.found != first.expected
    with pytest.raises(AuditFailure) as caught:
        report.raise_on_failure()
    assert isinstance(caught.value, LedgerError) and caught.value.finding == first
    # the audit is never weaker than the runtime's own check, and verify() applies the
    # same link rules (ledger.py) to everything but the manifest's own consistency
    try:
        verify(Store(run))
    except LensembleError:
        assert tamper not in BEYOND_VERIFY
    else:
        assert tamper in BEYOND_VERIFY, "verify() rejects nothing here, yet the audit does"


def test_the_finding_says_expected_and_found(run: Path) -> None:
    alter_aggregate_digest(run)
    first = audit_run(run).first
    assert first is not None and first.round == 2
    assert str(first) == (
        f"round 2: manifest.aggregate_digest: expected {first.expected}, found {'ab' * 32}"
    )


def test_a_resealed_head_passes_unless_the_head_is_pinned(run: Path) -> None:
    head = audit_run(run).head_record_hash
    forged = reseal_record(run, "ledger/00000003", epsilon={"p00": 0.0})
    assert audit_run(run).ok  # nothing inside the directory contradicts the newest record
    pinned = audit_run(run, expected_head=head)
    assert pinned.first == Finding("ledger head", "record_hash", head, forged.record_hash)


def test_a_resealed_record_with_another_checkpoint_is_caught_by_the_checkpoint(
    run: Path,
) -> None:
    # a forger re-points the head record at θ_0's checkpoint and reseals it
    initial = read_json(run, "manifest/header")["initial_checkpoint"]
    reseal_record(run, "ledger/00000003", checkpoint=initial)
    first = audit_run(run).first
    assert first is not None and (first.where, first.field) == ("round 3", "checkpoint.params_hash")


def test_a_round_whose_attempts_all_aborted_cannot_be_followed_by_another(run: Path) -> None:
    # round 1's only attempt recorded as aborted, its record gone
    rewrite_json(run, "manifest/rounds/00000001-0001", state="aborted", new_global_hash=None)
    (run / "names" / "ledger" / "00000001").unlink()
    fields = [(f.where, f.field) for f in audit_run(run).findings]
    assert ("round 1", "manifest.state") in fields


def test_findings_serialise_to_json(run: Path) -> None:
    remove_middle_record(run)
    doc = json.loads(json.dumps(audit_run(run).to_json()))
    assert doc["ok"] is False and doc["findings"][0]["round"] == 2


def test_an_extra_attempt_after_a_closed_one_is_a_finding(run: Path) -> None:
    entry = read_json(run, "manifest/rounds/00000003-0001") | {"attempt": 2, "state": "aborted"}
    entry |= {"new_global_hash": None, "reason": "forged"}
    rebind(run, "manifest/rounds/00000003-0002", json.dumps(entry, sort_keys=True).encode())
    fields = [(f.where, f.field) for f in audit_run(run).findings]
    assert fields == [("round 3", "manifest.state")]


def test_verify_raises_the_message_of_the_rule_the_audit_names(run: Path) -> None:
    unsorted_contributors(run)
    with pytest.raises(LedgerError, match=r"^round 3: contributing set and C_t disagree$"):
        verify(Store(run))


def test_the_manifest_must_agree_with_the_ledger_for_verify_too(run: Path) -> None:
    alter_update_digest(run)
    with pytest.raises(LedgerError, match=r"^round 3: manifest and ledger disagree$"):
        verify(Store(run))


def test_the_audit_reads_each_blob_once(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registries = {r.registry_digest for r in Ledger(Store(run)).records()}
    registries.add(Store(run).resolve(REGISTRY))
    fetched: list[str] = []
    get = Store.get

    def counting_get(self: Store, digest: str) -> bytes:
        fetched.append(digest)
        return get(self, digest)

    monkeypatch.setattr(Store, "get", counting_get)
    assert audit_run(run).ok
    # header, 4 manifest entries, 3 records, 4 checkpoints, the registries the records
    # used (the same one here: nobody joined after round 1) and the current one
    assert len(fetched) == len(set(fetched)) == 12 + len(registries)
