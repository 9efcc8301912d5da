"""Attacks on commitment binding: an update must carry the root its sender committed to,
a participant that committed stays bound, and rounds with unbound contributions are
named (issue 12, §3). Each test reproduces what worked before and shows it now fails."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.errors import (
    CommitmentMismatch,
    Response,
    UnboundContribution,
    response_to,
)
from lensemble_flwr.identity.registry import ParticipantRegistry
from lensemble_flwr.identity.signing import IdentityKey
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.protocol.messages import MessageKind, Update
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.summary import summarize_run
from lensemble_flwr.simulations.toy import ToyTrainer
from lensemble_flwr.testing import FaultPlan

ROOT = "ab" * 32


def without_root(payload: dict) -> dict:
    payload["dataset_root"] = None
    return payload


def rooted_elsewhere(payload: dict) -> dict:
    payload["dataset_root"] = "cd" * 32
    return payload


@pytest.mark.parametrize("require_binding", [True, False], ids=["required", "not-required"])
@pytest.mark.parametrize("mutate", [without_root, rooted_elsewhere], ids=["no-root", "other-root"])
def test_a_bound_participants_update_without_its_root_aborts_and_stops(
    tmp_path: Path, require_binding: bool, mutate
) -> None:
    """p01 committed in round 1; in round 2 its update comes without a root (or with
    another). It used to be a plain RoundError with binding required (the round closed
    without it), and admitted as unbound without: now the update is rejected, the attempt
    aborts with CommitmentMismatch, and the federation stops, the global state unchanged."""
    faults = FaultPlan().corrupt("p01", round=2, kind=MessageKind.UPDATE, mutate=mutate)
    config = small_config(require_binding=require_binding)
    coordinator, _network, _ = federation(tmp_path, config=config, faults=faults)
    coordinator.run(1)
    before = coordinator.global_state().params_hash
    with pytest.raises(CommitmentMismatch, match="p01"):
        coordinator.run(1)
    outcome = coordinator.outcomes[-1]
    assert outcome.state is RoundState.ABORTED and isinstance(outcome.error, CommitmentMismatch)
    assert coordinator.global_state().params_hash == before
    assert [r.round for r in Ledger(Store(tmp_path / "run")).records()] == [1]


def registry(tmp_path: Path, **kwargs) -> ParticipantRegistry:
    return ParticipantRegistry(
        small_config(require_binding=True), Store(tmp_path / "registry"), **kwargs
    )


def update(root: str | None) -> Update:
    return Update(
        run_id="run",
        round=1,
        sender="p09",
        participant_id="p09",
        dataset_root=root,
        delta={"w": np.zeros(2, np.float32)},
        num_examples=1,
    )


def test_a_root_never_committed_is_a_mismatch_for_a_registered_sender_only(
    tmp_path: Path,
) -> None:
    """An allow-listed participant that never committed is registered: its bound update is
    a CommitmentMismatch (which stops the federation). From a sender nobody registered the
    same update, or an unbound one, is only rejected: it cannot stop anything."""
    key = IdentityKey.generate()
    allowed = registry(tmp_path, identities={"p09": key.public_openssh})
    with pytest.raises(CommitmentMismatch, match="never committed"):
        allowed.check_binding(update(ROOT))
    stranger = registry(tmp_path)
    for root in (ROOT, None):
        with pytest.raises(UnboundContribution) as refused:
            stranger.check_binding(update(root))
        assert response_to(refused.value) is Response.REJECT_MESSAGE
    assert response_to(CommitmentMismatch("x")) is Response.STOP_FEDERATION


class UncommittedTrainer(ToyTrainer):
    """A participant that cannot commit to its data: its updates are unbound."""

    def dataset_records(self) -> None:  # type: ignore[override]
        return None


def test_rounds_with_unbound_contributions_are_named(tmp_path: Path, caplog) -> None:
    """Unbound contributions used to show only as None roots in the ledger: now the log
    names the round's unbound contributors at its close, the record says who they were,
    and the run summary (``lensemble-flwr show``) tags the round."""
    coordinator, network, _ = federation(tmp_path, config=small_config())
    network.attach(
        Participant(
            coordinator.config,
            participant_id="p09",
            transport=network.transport_for("p09"),
            trainer=UncommittedTrainer(9),
        )
    )
    with caplog.at_level(logging.INFO):
        coordinator.run(2)
    (record, *_) = Ledger(Store(tmp_path / "run")).records()
    assert record.unbound == ("p09",) and record.dataset_roots["p09"] is None
    assert "round 1 closed with UNBOUND contributions (no dataset commitment) from p09" in (
        caplog.text
    )
    # said as a WARNING once for the participant, not once a round
    warnings = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "UNBOUND" in r.getMessage()
    ]
    assert len(warnings) == 1 and "p09 contributes UNBOUND" in warnings[0].getMessage()
    summary = summarize_run(tmp_path / "run")
    assert [a.unbound for a in summary.closed] == [("p09",), ("p09",)]


def test_a_long_list_of_unbound_contributors_is_cut_short_in_the_log(
    tmp_path: Path, caplog
) -> None:
    """Fifty stock nodes must not make one log line per round of fifty names: the log names
    five, the ledger and ``show`` keep them all."""
    coordinator, network, _ = federation(tmp_path, config=small_config())
    unbound = [f"p{i:02d}" for i in range(10, 16)]
    for i, pid in enumerate(unbound):
        network.attach(
            Participant(
                coordinator.config,
                participant_id=pid,
                transport=network.transport_for(pid),
                trainer=UncommittedTrainer(10 + i),
            )
        )
    with caplog.at_level(logging.INFO):
        coordinator.run(1)
    (record,) = Ledger(Store(tmp_path / "run")).records()
    assert record.unbound == tuple(unbound)
    assert (
        "from p10, p11, p12, p13, p14 and 1 more (lensemble-flwr show lists them)" in caplog.text
    )


def test_the_projects_own_apps_require_binding() -> None:
    """The main job (pyproject's app config) and the in-process demos bind by default; the
    library default stays off so a stock ClientApp keeps working with the strategy."""
    import tomllib

    from lensemble_flwr.config import LensembleConfig
    from lensemble_flwr.simulations.crash_drill import drill_config

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    app = pyproject["tool"]["flwr"]["app"]["config"]
    assert app["lensemble"]["require-binding"] is True
    assert drill_config().federation.require_binding
    assert not LensembleConfig().federation.require_binding


def test_an_identity_key_is_fixed_at_the_first_commitment(tmp_path: Path) -> None:
    """A later commitment that omits the key used to wipe it (unsigned messages were then
    accepted), and one that added a key to a keyless binding made the run fail verify."""
    from lensemble_flwr.errors import ForgedMessage
    from lensemble_flwr.protocol.messages import Commitment

    reg = ParticipantRegistry(small_config(), Store(tmp_path / "registry"))
    key = IdentityKey.generate()
    common = {"run_id": "run", "round": 1, "sender": "p09", "participant_id": "p09"}
    first = key.sign(
        Commitment(**common, dataset_root=ROOT, num_examples=3, identity_key=key.public_openssh),
        7,
    )
    reg.check_signature(first, 7)
    reg.bind(first)
    later = key.sign(Commitment(**{**common, "round": 2}, dataset_root=ROOT, num_examples=3), 8)
    reg.check_signature(later, 8)
    reg.bind(later)
    assert reg.commitments["p09"].identity_key == key.public_openssh.strip()  # kept
    keyless = ParticipantRegistry(small_config(), Store(tmp_path / "other"))
    plain = Commitment(
        **{**common, "sender": "p08", "participant_id": "p08"}, dataset_root=ROOT, num_examples=3
    )
    keyless.bind(plain)
    added = key.sign(plain.model_copy(update={"round": 2, "identity_key": key.public_openssh}), 8)
    with pytest.raises(ForgedMessage, match="bound without an identity key"):
        keyless.check_signature(added, 8)
