"""Participant behaviour: binding once, unbound contributions, state that outlives a process."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config

from lensemble_flwr.artifacts.store import Store
from lensemble_flwr.config import LensembleConfig
from lensemble_flwr.coordinator.coordinator import Coordinator
from lensemble_flwr.errors import RoundError
from lensemble_flwr.participant.local_training import PortableState, TorchTraining
from lensemble_flwr.participant.participant import Participant
from lensemble_flwr.privacy.budget import PrivacyBudget
from lensemble_flwr.protocol.messages import MessageKind
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import GlobalState
from lensemble_flwr.provenance.ledger import Ledger
from lensemble_flwr.provenance.verify import verify
from lensemble_flwr.release import bind, chain, clip, difference, distributed_noise
from lensemble_flwr.simulations.toy import ToyTrainer, initial_params
from lensemble_flwr.transports.inprocess import InProcessNetwork


def messages_per_round(network: InProcessNetwork, kind: MessageKind) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _, _, _, k, rnd in network.delivered:  # the network logs the wire's kind string
        if k == kind.value:
            counts[rnd] = counts.get(rnd, 0) + 1
    return counts


def test_commitment_is_bound_once_then_a_round_is_one_exchange(tmp_path: Path) -> None:
    coordinator, network, _ = federation(tmp_path, participants=4)
    coordinator.run(3)
    assert messages_per_round(network, MessageKind.COMMITMENT) == {1: 4}
    assert messages_per_round(network, MessageKind.UPDATE) == {1: 4, 2: 4, 3: 4}
    assert messages_per_round(network, MessageKind.ROUND_OPEN) == {1: 4, 2: 4, 3: 4}


class UnboundToy(ToyTrainer):
    """A participant that cannot commit to its data (like a stock Flower ClientApp)."""

    def dataset_records(self) -> Iterable[bytes] | None:  # type: ignore[override]
        return None


def mixed_federation(tmp_path: Path, *, require_binding: bool):
    config = small_config(require_binding=require_binding, min_participants=2)
    network = InProcessNetwork(join_endpoint=str(tmp_path / "run"))
    for i in range(3):
        trainer = UnboundToy(i) if i == 2 else ToyTrainer(i)
        pid = f"p{i:02d}"
        network.attach(
            Participant(
                config, participant_id=pid, transport=network.transport_for(pid), trainer=trainer
            )
        )
    coordinator = Coordinator(
        config,
        transport=network.coordinator,
        initial_params=initial_params(),
        store=Store(tmp_path / "run"),
    )
    return coordinator, network


def test_unbound_contributions_are_admitted_and_recorded_as_unbound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator, _ = mixed_federation(tmp_path, require_binding=False)
    with caplog.at_level(logging.INFO):
        coordinator.run(2)
    records = verify(Store(tmp_path / "run"))
    assert all(r.count == 3 for r in records)
    assert records[0].dataset_roots["p02"] is None
    assert records[0].dataset_roots["p00"] is not None
    warnings = [r for r in caplog.records if "contributes UNBOUND" in r.getMessage()]
    assert len(warnings) == 1  # said once per participant, not every round
    assert warnings[0].levelno == logging.WARNING
    closes = [r for r in caplog.records if "closed with UNBOUND" in r.getMessage()]
    assert len(closes) == 2  # and each round that had them is named, as INFO
    assert all(r.levelno == logging.INFO for r in closes)


def test_require_binding_refuses_unbound_contributions(tmp_path: Path) -> None:
    coordinator, _ = mixed_federation(tmp_path, require_binding=True)
    coordinator.run(2)
    assert all(o.rejected == 1 and "p02" not in o.contributors for o in coordinator.outcomes)
    records = Ledger(Store(tmp_path / "run")).records()
    assert all(None not in r.dataset_roots.values() for r in records)


def test_bind_refuses_a_participant_without_a_commitment() -> None:
    config = small_config()
    participant = Participant(
        config,
        participant_id="p",
        transport=InProcessNetwork().transport_for("p"),
        trainer=UnboundToy(0),
        pipeline=chain(difference(), bind()),
    )
    state = GlobalState.create(0, initial_params(), sketch_seed=1, h_steps=1)
    with pytest.raises(RoundError, match="no dataset commitment"):
        participant.local_round(state, 1)


def test_exported_state_continues_training_exactly(tmp_path: Path) -> None:
    """A participant rebuilt from its exported state releases what the original would."""
    config = small_config()
    network = InProcessNetwork()
    original = Participant(
        config, participant_id="p", transport=network.transport_for("p"), trainer=ToyTrainer(1)
    )
    state0 = GlobalState.create(0, initial_params(), sketch_seed=11, h_steps=3)
    original.local_round(state0, 11)  # builds AdamW state and trains the local head
    exported = original.export_state()
    assert any(k.startswith("training/optimizer/") for k in exported.arrays)
    assert any("action_head" in k for k in exported.arrays)
    assert not any(k.startswith("training/model/encoder") for k in exported.arrays)

    rebuilt = Participant(
        config, participant_id="p", transport=network.transport_for("q"), trainer=ToyTrainer(1)
    )
    rebuilt.import_state(exported)
    state1 = GlobalState.create(1, initial_params(seed=3), sketch_seed=12, h_steps=3)
    a = original.local_round(state1, 12)
    b = rebuilt.local_round(state1, 12)
    assert a.delta.keys() == b.delta.keys()
    for name in a.delta:
        np.testing.assert_array_equal(a.delta[name], b.delta[name])

    fresh = Participant(
        config, participant_id="p", transport=network.transport_for("r"), trainer=ToyTrainer(1)
    )
    c = fresh.local_round(state1, 12)  # no AdamW history, no trained head: differs
    assert any(not np.array_equal(a.delta[n], c.delta[n]) for n in a.delta)


def test_empty_state_imports_as_a_fresh_participant() -> None:
    config = small_config()
    p = Participant(
        config,
        participant_id="p",
        transport=InProcessNetwork().transport_for("p"),
        trainer=ToyTrainer(0),
    )
    p.import_state(PortableState())
    assert isinstance(p.training, TorchTraining) and p.training.optimizer is None


def test_a_participant_appearing_while_the_round_is_open_is_invited(tmp_path: Path) -> None:
    config = small_config(min_participants=4, open_timeout=30.0)
    coordinator, network, _nodes = federation(tmp_path, participants=3, config=config)
    late = Participant(
        config, participant_id="p09", transport=network.transport_for("p09"), trainer=ToyTrainer(9)
    )
    # it attaches 5 simulated seconds into round 0's OPEN phase
    network.call_at(5.0, lambda: network.attach(late))
    coordinator.run(1)
    outcome = coordinator.outcomes[0]
    assert outcome.state is RoundState.CLOSED and "p09" in outcome.contributors


# -- a masked round whose release fails leaves the masking role as it was --------------------
class _Broken(ToyTrainer):
    def __init__(self, error: Exception) -> None:
        super().__init__(1)
        self.error = error

    def sample_batch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise self.error


def _masked_open(participant: Participant, others: int = 2):  # type: ignore[no-untyped-def]
    """A RoundOpen of a masked round of 1 + ``others`` members that lists ``participant``
    with the key it announced."""
    from lensemble_flwr.protocol.messages import RoundOpen
    from lensemble_flwr.secagg import prg
    from lensemble_flwr.secagg.keys import SecAggKeys
    from lensemble_flwr.secagg.participant_role import encode_member
    from lensemble_flwr.secagg.protocol import Member

    keys = participant.masking.keys_for_commitment()
    mine = Member(participant.participant_id, bytes.fromhex(keys["mask_key"]),
                  bytes.fromhex(keys["enc_key"]))  # fmt: skip
    peers = {f"q{i}": SecAggKeys.generate() for i in range(others)}
    members = [mine] + [Member(p, k.mask_public, k.enc_public) for p, k in peers.items()]
    state = GlobalState.create(0, initial_params(), sketch_seed=3, h_steps=1)
    return RoundOpen(
        run_id="run", round=1, attempt=1, sender="coordinator", global_hash=state.params_hash,
        params=state.params, sketch_seed=3, h_steps=1, secagg_prg=prg.PRG_ID,
        secagg_threshold=2, secagg_members=tuple(sorted(encode_member(m) for m in members)),
        needs_commitment=False,
    )  # fmt: skip


@pytest.mark.parametrize("error", [RoundError("refused"), RuntimeError("the trainer broke")])
def test_a_masked_release_that_fails_keeps_the_listed_key_unused(error: Exception) -> None:
    network = InProcessNetwork()
    node = Participant(
        small_config(secagg_threshold=2, min_participants=2),
        participant_id="p",
        transport=network.transport_for("p"),
        trainer=_Broken(error),
    )
    opened = _masked_open(node)
    before = node.masking.export()
    rounds: list = []
    open_round = node.masking.open_round
    node.masking.open_round = lambda *a: rounds.append(open_round(*a)) or rounds[-1]  # type: ignore[method-assign]
    if isinstance(error, RoundError):
        node._on_round_open(opened)  # refused: a Refusal is sent, nothing is masked
    else:
        with pytest.raises(RuntimeError, match="the trainer broke"):
            node._on_round_open(opened)
    assert len(rounds) == 1 and rounds[0] is not None  # the round was opened, then put back
    assert node.masking.export() == before  # the listed key is still announced, unused
    assert node.masking.round_key is None


def test_a_distributed_noise_share_that_no_mask_stage_added_is_refused(tmp_path: Path) -> None:
    """A custom chain that draws (and pays for) a distributed-noise share in a federation
    with no mask stage would release the update without the noise it claims: refused."""
    budget = PrivacyBudget(tmp_path, "p", epsilon=1e6, delta=1e-5)
    noise = distributed_noise(2.0, 0.5, fraction_bits=16, threshold=3, budget=budget)
    node = Participant(
        LensembleConfig(federation={"min_participants": 1}), participant_id="p",
        transport=InProcessNetwork().transport_for("p"), trainer=ToyTrainer(1),
        pipeline=chain(difference(), clip(0.5), noise, bind()),
    )  # fmt: skip
    state = GlobalState.create(0, initial_params(seed=0), sketch_seed=100, h_steps=2)
    with pytest.raises(RoundError, match="noise share that no mask stage added"):
        node.local_round(state, 11)
