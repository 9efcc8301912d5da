"""Endorsements: every record is signed by the participants it names, so a history
rewritten and resealed by someone without their keys is refused by ``verify``, resume and
a joining participant, naming the record and what it lacks (issue 41, item 2). Untouched
runs, signed or not, in process and over Flower's Grid, verify with no finding."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from federation_helpers import federation, signed_federation, small_config
from run_dir_helpers import synthetic_run

from lensemble_flwr.artifacts.checkpoint import decode_checkpoint, encode_checkpoint
from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.canonical import canonical_json
from lensemble_flwr.cli import main
from lensemble_flwr.cli.output import EXIT_FAILED, EXIT_OK
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.coordinator.endorsements import endorsements_of, take_endorsement
from lensemble_flwr.errors import LedgerError, RoundError
from lensemble_flwr.identity.endorsement import endorse, endorsement_review, verify_run
from lensemble_flwr.identity.endorsement_report import review_run
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.messages import from_wire
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import (
    GENESIS,
    REGISTRY,
    ContributionRecord,
    Ledger,
    RunManifest,
    entries_digest,
    ledger_name,
    manifest_entry_name,
)
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.simulations.toy import ToyTrainer
from lensemble_flwr.transports.inprocess import InProcessNetwork

PIDS = ("p00", "p01", "p02", "p03")
KEYS = {pid: IdentityKey.generate() for pid in PIDS}
OUTSIDER = IdentityKey.generate()


def signed_run(tmp_path: Path, rounds: int = 3, config: LensembleConfig | None = None) -> Store:
    coordinator, network, _ = signed_federation(tmp_path, KEYS, config=config)
    coordinator.run(rounds)
    network.flush()
    return coordinator.store


def rewrite_from(
    store: Store,
    round: int,
    *,
    record: dict[str, Any] | None = None,
    entry: dict[str, Any] | None = None,
    endorsements: dict[int, dict[str, str] | None] | None = None,
) -> None:
    """What someone who can write the run directory can do: change round ``round``'s
    record (and its closing manifest entry, so they agree), then reseal it and every
    record after it, so that every hash and link holds again. ``endorsements``: what
    the resealed records carry instead of what they carried (round -> endorsements)."""
    manifest = RunManifest.load(store)
    records = Ledger(store).records()
    previous = records[round - 2].record_hash if round > 1 else GENESIS
    for rec in records[round - 1 :]:
        entries = [e for e in manifest.rounds if e.round == rec.round and e.attempt <= rec.attempt]
        if rec.round == round and entry:
            closing = next(e for e in entries if e.state is RoundState.CLOSED)
            changed = closing.model_copy(update=entry)
            name = manifest_entry_name(rec.round, rec.attempt)
            store.bind(name, store.put(canonical_json(changed.model_dump(mode="json"))))
            entries = [changed if e is closing else e for e in entries]
        update: dict[str, Any] = {
            "previous_record_hash": previous,
            "entries_digest": entries_digest(entries),
            "record_hash": "",
        }
        if rec.round == round:
            update |= record or {}
        if endorsements is not None and rec.round in endorsements:
            update["endorsements"] = endorsements[rec.round]
        forged = rec.model_copy(update=update).sealed()
        store.bind(
            ledger_name(rec.round), store.put(canonical_json(forged.model_dump(mode="json")))
        )
        previous = forged.record_hash


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out, _ = capsys.readouterr()
    return code, out


# -- untouched runs: 0 false positives ---------------------------------------------------------
def test_an_untouched_signed_run_is_endorsed_record_by_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = signed_run(tmp_path)
    records = Ledger(store).records()
    assert [sorted(r.endorsements or {}) for r in records] == [[], list(PIDS), list(PIDS)]
    reviews = verify_run(store)
    assert [r.status for r in reviews] == ["endorsed", "endorsed", "pending"]
    assert reviews[0].endorsers == PIDS and reviews[2].describe().startswith("not yet endorsed")
    code, out = run_cli(capsys, "verify", store.root)
    assert code == EXIT_OK, out
    assert "policy next-round; rounds 1-2 endorsed; round 3 not yet endorsed" in out
    code, out = run_cli(capsys, "verify", store.root, "--expect-head", records[-1].record_hash)
    assert code == EXIT_OK, out
    code, out = run_cli(capsys, "show", store.root)
    assert "round 1: endorsed by p00, p01, p02, p03 (4 of 4 keyed)" in out
    Coordinator.resume(small_config(), store=store)  # resumes, as before


def test_an_untouched_unsigned_run_and_a_run_written_before_endorsements_verify_and_say_so(
    tmp_path: Path,
) -> None:
    coordinator, _, _ = federation(tmp_path)
    coordinator.run(2)
    assert [r.status for r in verify_run(coordinator.store)] == ["keyless", "keyless"]
    legacy = Store(synthetic_run(tmp_path / "legacy", [{"p00": "ab" * 32}] * 2))
    assert RunManifest.load(legacy).endorsement is None
    assert [r.status for r in verify_run(legacy)] == ["legacy", "legacy"]
    found = review_run(legacy)
    assert found is not None and found[2] == []


def test_an_untouched_run_over_flowers_grid_with_signing_clientapps_is_endorsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ClientApp code (``handle_train``) hears each RoundClose with the next
    instruction and endorses it in its reply; a resealed chain then refuses the resume."""
    from flwr.app import Context, RecordDict

    from lensemble_flwr.simulations.toy import initial_params
    from lensemble_flwr.strategies import LensembleStrategy
    from lensemble_flwr.strategies.records import arrays_to_record
    from tests.strategies.test_grid_transport import (
        NODES,
        FakeClock,
        FakeGrid,
        _serverapp_identity,
        clientapp_node,
    )

    _serverapp_identity.__wrapped__(monkeypatch)  # the fixture's body: no Flower process
    config = small_config(min_participants=3)
    keys = {n: IdentityKey.generate() for n in NODES}

    def grid() -> FakeGrid:
        contexts = {
            n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
            for n in NODES
        }
        nodes = {n: clientapp_node(i, contexts[n], config, keys[n]) for i, n in enumerate(NODES)}
        return FakeGrid(FakeClock(), nodes)

    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0.0)
    strategy.start(grid=grid(), initial_arrays=arrays_to_record(initial_params()), num_rounds=3)
    store = Store(tmp_path / "run")
    assert [r.status for r in verify_run(store)] == ["endorsed", "endorsed", "pending"]
    rewrite_from(store, 2, record={"epsilon": {}}, endorsements={3: None})
    verify(store)  # every hash and link holds again
    again = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0.0, resume=True)
    with pytest.raises(LedgerError, match=r"round 2: ledger record \w+… is UNENDORSED"):
        again.start(grid=grid(), initial_arrays=arrays_to_record(initial_params()), num_rounds=4)


def test_an_untouched_mixed_run_of_signing_and_stock_clientapps_over_flowers_grid_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two signing ClientApps and two stock ones (unbound, no key, in no registry) in a run
    whose registry holds keys: the stock contributors are what the run admits (neither
    require-binding nor require-signatures), so nothing is refused."""
    from flwr.app import Context, RecordDict

    from lensemble_flwr.simulations.toy import initial_params
    from lensemble_flwr.strategies import LensembleStrategy
    from lensemble_flwr.strategies.records import arrays_to_record
    from tests.strategies.test_grid_transport import (
        NODES,
        FakeClock,
        FakeGrid,
        _serverapp_identity,
        clientapp_node,
        quickstart_node,
    )

    _serverapp_identity.__wrapped__(monkeypatch)
    config = small_config(min_participants=3)
    signing, stock = NODES[:2], NODES[2:]
    contexts = {
        n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
        for n in signing
    }
    nodes = {
        **{n: clientapp_node(i, contexts[n], config, IdentityKey.generate()) for i, n in
           enumerate(signing)},
        **dict.fromkeys(stock, quickstart_node),
    }  # fmt: skip
    strategy = LensembleStrategy(config, run_dir=tmp_path / "run", fraction_evaluate=0.0)
    grid = FakeGrid(FakeClock(), nodes)
    strategy.start(grid=grid, initial_arrays=arrays_to_record(initial_params()), num_rounds=3)
    store = Store(tmp_path / "run")
    records = Ledger(store).records()
    assert all(len(r.unbound) == 2 and len(r.contributors) == 4 for r in records)
    reviews = verify_run(store)
    assert [r.status for r in reviews] == ["endorsed", "endorsed", "pending"]
    assert all(len(r.keyed) == 2 for r in reviews)


def test_an_untouched_keyed_run_verifies_under_every_admission_rule_and_its_allow_list(
    tmp_path: Path,
) -> None:
    """0 false positives for the keyless rules: a signed run with require-binding and
    require-signatures, resumed with and without the allow-list its coordinator held."""
    config = small_config(require_binding=True, require_signatures=True)
    store = signed_run(tmp_path, config=config)
    assert [r.status for r in verify_run(store)] == ["endorsed", "endorsed", "pending"]
    Coordinator.resume(config, store=store)
    identities = {pid: key.public_openssh for pid, key in KEYS.items()}
    Coordinator.resume(config, store=store, identities=identities)
    coordinator, _, _ = federation(tmp_path / "unsigned", config=small_config(require_binding=True))
    coordinator.run(2)  # bound, keyless participants: keyless, as before
    assert [r.status for r in verify_run(coordinator.store)] == ["keyless", "keyless"]


# -- forgeries ------------------------------------------------------------------------------
def _renamed_to_strangers(store: Store, round: int) -> None:
    """Round ``round`` rewritten as if unknown, unbound, keyless contributors (``x00``…)
    had sent other updates, and resealed from there (the reviewer's attack A)."""
    rec = Ledger(store).records()[round - 1]
    renamed = {p: "x" + p[1:] for p in rec.contributors}
    contributors = tuple(renamed[p] for p in rec.contributors)
    digests = dict.fromkeys(contributors, "ab" * 32)
    record = {
        "contributors": contributors,
        "update_digests": digests,
        "dataset_roots": dict.fromkeys(contributors),
        "epsilon": {renamed.get(p, p): e for p, e in rec.epsilon.items()},
    }
    entry = {"contributors": contributors, "update_digests": digests}
    rewrite_from(store, round, record=record, entry=entry, endorsements={round + 1: None})


@pytest.mark.parametrize(
    ("flag", "complaint"),
    [
        ("require_binding", r"round 2: ledger record \w+… names unbound contributors "
         r"x00, x01, x02, x03, yet require-binding is set: FORGED"),
        ("require_signatures", r"round 2: ledger record \w+… names contributors x00, x01, "
         r"x02, x03 that hold no identity key in the run, yet require-signatures is set"),
    ],
)  # fmt: skip
def test_a_round_renamed_to_unknown_keyless_contributors_is_refused_where_the_run_admits_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, complaint: str
) -> None:
    """Attack A: between an endorsed round 1 and round 3, round 2 is rewritten with
    contributors nobody registered, so that it would pass as keyless (nobody could have
    endorsed it). The run's config says such contributors cannot take part: refused."""
    config = small_config(**{flag: True})
    store = signed_run(tmp_path, config=config)
    _renamed_to_strangers(store, 2)
    verify(store)  # every hash and link holds
    with pytest.raises(LedgerError, match=complaint):
        verify_run(store)
    with pytest.raises(LedgerError, match=complaint):
        Coordinator.resume(config, store=store)
    code, out = run_cli(capsys, "verify", store.root)
    assert code == EXIT_FAILED and "BROKEN round 2" in out, out


def test_a_keyed_history_resealed_without_its_registry_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attack B (header untouched: policy next-round): the current registry still holds
    p00-p03's keys, so the records cannot pass as keyless."""
    store = signed_run(tmp_path)
    _strip_registry(store)
    verify(store)  # the chain, and no record binds anyone: the registry is not compared
    complaint = (
        r"round 1: ledger record \w+… names no participant registry, yet its contributors "
        r"p00, p01, p02, p03 hold identity keys in the run: FORGED"
    )
    with pytest.raises(LedgerError, match=complaint):
        verify_run(store)
    with pytest.raises(LedgerError, match=complaint):
        Coordinator.resume(small_config(), store=store)
    code, out = run_cli(capsys, "verify", store.root)
    assert code == EXIT_FAILED and "BROKEN round 1" in out, out


def _strip_registry(store: Store) -> None:
    """Attack B: every record resealed naming no registry, its roots unbound and its
    endorsements dropped, contributors and header untouched, round 2 with other updates."""
    for round in (1, 2, 3):
        rec = Ledger(store).records()[round - 1]
        change: dict[str, Any] = {
            "registry_digest": None,
            "dataset_roots": dict.fromkeys(rec.dataset_roots),
        }
        entry = None
        if round == 2:
            change["update_digests"] = entry = dict.fromkeys(rec.update_digests, "ab" * 32)
        rewrite_from(
            store, round, record=change, entry=entry and {"update_digests": entry},
            endorsements={2: None, 3: None},
        )  # fmt: skip


def test_a_history_rewritten_with_its_registry_is_refused_by_a_coordinator_with_an_allow_list(
    tmp_path: Path,
) -> None:
    """Attack B, and the current registry rebound to a copy without identity keys: the
    run directory no longer says anyone held a key (``verify`` reports every round
    keyless: the whole-run rewrite), but the coordinator's allow-list, held outside the
    directory, does."""
    store = signed_run(tmp_path)
    _strip_registry(store)
    registry = json.loads(store.get(store.resolve(REGISTRY)))
    for commitment in registry["commitments"].values():
        commitment["identity_key"] = None
    store.bind(REGISTRY, store.put(canonical_json(registry)))
    assert [r.status for r in verify_run(store)] == ["keyless"] * 3
    identities = {pid: key.public_openssh for pid, key in KEYS.items()}
    with pytest.raises(
        LedgerError, match=r"round 1: ledger record \w+… names no participant registry, yet "
        r"its contributors p00, p01, p02, p03 hold identity keys in the run: FORGED"
    ):  # fmt: skip
        Coordinator.resume(small_config(), store=store, identities=identities)


@pytest.mark.parametrize(
    ("unbind", "why"),
    [
        (False, "its contributors p00, p01, p02, p03 are bound to dataset roots"),
        (True, r"an earlier record named one \(a registry is never removed\)"),
    ],
)
def test_a_keyless_run_record_that_drops_its_registry_is_refused(
    tmp_path: Path, unbind: bool, why: str
) -> None:
    """In a run with no key at all, round 2 resealed naming no registry: with its roots
    kept (bound contributors need one), or unbound too (round 1 named one)."""
    coordinator, _, _ = federation(tmp_path)
    coordinator.run(2)
    store = coordinator.store
    rec = Ledger(store).records()[1]
    change: dict[str, Any] = {"registry_digest": None}
    if unbind:
        change["dataset_roots"] = dict.fromkeys(rec.dataset_roots)
    rewrite_from(store, 2, record=change)
    with pytest.raises(LedgerError, match=rf"round 2: ledger record \w+… names no .*, yet {why}"):
        verify_run(store)


@pytest.mark.parametrize(
    ("carried", "complaint"),
    [
        ("kept", r"round 2: FORGED endorsement: round 3's record carries an endorsement of "
         r"record \w+… in p00's name that p00's registered identity key did not sign"),
        ("dropped", r"round 2: ledger record \w+… is UNENDORSED, so FORGED .* needs the "
         r"endorsement of 3 of p00, p01, p02, p03; missing p00, p01, p02, p03"),
    ],
)  # fmt: skip
def test_a_resealed_history_is_refused_by_verify_resume_and_join_naming_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], carried: str, complaint: str
) -> None:
    """Round 2 rewritten to say p00 sent another update, its manifest entry to agree, and
    rounds 2 and 3 resealed: every hash and link holds (``provenance.verify`` passes), but
    the participants' endorsements of round 2 are of the record they saw, and a forger
    cannot make new ones."""
    store = signed_run(tmp_path)
    digests = dict(Ledger(store).records()[1].update_digests, p00="ab" * 32)
    rewrite_from(
        store,
        2,
        record={"update_digests": digests},
        entry={"update_digests": digests},
        endorsements=None if carried == "kept" else {3: None},
    )
    verify(store)  # the chain alone cannot tell
    with pytest.raises(LedgerError, match=complaint):
        verify_run(store)
    with pytest.raises(LedgerError, match=complaint):
        Coordinator.resume(small_config(), store=store)
    joiner = Participant(
        small_config(),
        participant_id="p09",
        transport=InProcessNetwork().transport_for("p09"),
        trainer=ToyTrainer(9),
    )
    with pytest.raises(LedgerError, match=complaint):
        joiner.join(str(store.root))  # no RoundClose to compare with: the policy decides
    code, out = run_cli(capsys, "verify", store.root)
    assert code == EXIT_FAILED and "BROKEN round 2: endorsement" in out


def test_an_endorsement_signed_by_another_key_is_forged(tmp_path: Path) -> None:
    store = signed_run(tmp_path)
    records = Ledger(store).records()
    carried = dict(records[2].endorsements or {}, p01=endorse(OUTSIDER, records[1].record_hash))
    rewrite_from(store, 3, endorsements={3: carried})
    with pytest.raises(LedgerError, match=r"round 2: FORGED endorsement: .* in p01.s name"):
        verify_run(store)


def test_a_record_needs_a_majority_of_its_keyed_contributors_that_took_part_again(
    tmp_path: Path,
) -> None:
    """Four keyed contributors, all in the next round: three signatures are enough, two
    are not. Contributors that took no part in the next round are not waited for; a
    record none of them came back after is not yet endorsed (never "endorsed" by nobody)."""
    store = signed_run(tmp_path)
    records = Ledger(store).records()
    carried = dict(records[2].endorsements or {})
    policy = RunManifest.load(store).endorsement
    three = records[2].model_copy(
        update={"endorsements": {p: carried[p] for p in ("p01", "p02", "p03")}}
    )
    two = records[2].model_copy(update={"endorsements": {p: carried[p] for p in ("p02", "p03")}})
    away = two.model_copy(update={"contributors": ("p02", "p03")})  # p00, p01 sat out
    gone = away.model_copy(update={"contributors": ("p09",), "endorsements": None})
    for following, status, required in [
        (three, "endorsed", 3),
        (two, "unendorsed", 3),
        (away, "endorsed", 2),
        (gone, "pending", 0),  # none of them took part since: not yet, like the head
    ]:
        reviews, _ = endorsement_review(store, [records[1], following], policy)
        assert (reviews[0].status, reviews[0].required) == (status, required)


def test_a_joiner_pinned_to_another_head_refuses_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = signed_run(tmp_path, rounds=2)
    joiner = Participant(
        small_config(),
        participant_id="p09",
        transport=InProcessNetwork().transport_for("p09"),
        trainer=ToyTrainer(9),
    )
    head = Ledger(store).head()
    assert head is not None
    assert joiner.join(str(store.root), expect_head=head.record_hash).round == 2
    assert "not yet endorsed" not in caplog.text
    caplog.set_level(logging.WARNING)
    assert joiner.join(str(store.root)).round == 2  # unpinned: joined, and said so
    assert f"p09: joins at round 2, whose record {head.record_hash[:12]}… is not yet" in caplog.text
    with pytest.raises(LedgerError, match="ledger head: record_hash: expected 00"):
        joiner.join(str(store.root), expect_head="00" * 32)


# -- the coordinator's side -------------------------------------------------------------------
def test_the_coordinator_records_only_its_senders_endorsements_of_the_head(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    head, other = "aa" * 32, "bb" * 32
    attempt: Any = SimpleNamespace(endorsements={}, round=4)
    registry: Any = SimpleNamespace(key_of=lambda pid: KEYS[pid].public_openssh)

    def message(pid: str, record: str, key: IdentityKey) -> Any:
        return SimpleNamespace(
            participant_id=pid, endorses=record, endorsement=endorse(key, record)
        )

    assert take_endorsement(attempt, message("p00", head, KEYS["p00"]), registry)
    assert not take_endorsement(attempt, message("p01", head, OUTSIDER), registry)
    assert "p01: its endorsement of record aaaaaaaaaaaa… is not its registered key's" in caplog.text
    assert take_endorsement(attempt, message("p02", other, KEYS["p02"]), registry)
    assert not take_endorsement(attempt, SimpleNamespace(participant_id="p03"), registry)
    assert list(endorsements_of(attempt, head) or {}) == ["p00"]  # p02's is of another record
    assert "p02 endorsed another record than the ledger head" in caplog.text
    assert endorsements_of(SimpleNamespace(endorsements={}, round=1), head) is None


def test_a_record_without_its_signature_or_a_signature_without_its_record_is_malformed() -> None:
    base = {
        "kind": "commitment",
        "run_id": "r",
        "round": 1,
        "sender": "p00",
        "participant_id": "p00",
        "dataset_root": "ab" * 32,
        "num_examples": 3,
    }
    assert from_wire(base).endorses is None  # an old message: no endorsement, as before
    for half in ({"endorses": "cd" * 32}, {"endorsement": "ef" * 32}):
        with pytest.raises(RoundError, match="endorses and endorsement come together"):
            from_wire(base | half)


def test_a_record_round_trips_with_and_without_endorsements() -> None:
    record = ContributionRecord(
        round=1, attempt=1, invited=("p00",), contributors=("p00",), count=1, total_weight=1,
        dataset_roots={"p00": None}, update_digests={"p00": "ab" * 32},
        aggregate_digest="cd" * 32, previous_global_hash="ef" * 32,
        new_global_hash="01" * 32, checkpoint="23" * 32, round_seed=1,
        header_digest="45" * 32, entries_digest="67" * 32, registry_digest=None,
        previous_record_hash=GENESIS,
    ).sealed()  # fmt: skip
    assert "endorsements" not in record.model_dump(mode="json")  # hashes as before
    endorsed = record.model_copy(update={"endorsements": {"p00": "89" * 32}}).sealed()
    assert endorsed.record_hash != record.record_hash  # the endorsements are chained
    assert ContributionRecord.model_validate(endorsed.model_dump(mode="json")) == endorsed


def test_a_checkpoint_forged_with_its_record_is_refused_at_the_head_only_when_pinned(
    tmp_path: Path,
) -> None:
    """What the head can and cannot be trusted for: under the ``next-round`` policy the
    newest record has no endorsement yet, so replacing it alone (model and all) is found
    only against a pin: a RoundClose, or ``expect_head``."""
    store = signed_run(tmp_path, rounds=2)
    head = Ledger(store).head()
    assert head is not None
    real = decode_checkpoint(store.get(head.checkpoint))
    forged_params = {n: a + 1.0 for n, a in real.params.items()}
    from lensemble_flwr.canonical import digest_arrays

    new_hash = digest_arrays(forged_params, "params")
    digest = store.put(encode_checkpoint(real.round, forged_params, real.momentum))
    rewrite_from(
        store, 2, record={"checkpoint": digest, "new_global_hash": new_hash},
        entry={"new_global_hash": new_hash},
    )  # fmt: skip
    assert [r.status for r in verify_run(store)] == ["endorsed", "pending"]
    with pytest.raises(LedgerError, match="ledger head: record_hash"):
        verify_run(store, expect_head=head.record_hash)
