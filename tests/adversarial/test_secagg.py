"""Attacks on secure aggregation by an honest-but-curious coordinator: from its own
transcript, it must never recover an individual release (issue 12, §1).

The attack that worked before: mask keys were reused across rounds, so a member whose
self mask was revealed in round t (it survived) and whose mask key was reconstructed in a
later round (it dropped, or was late) had its round-t release recovered bit for bit from
the commitments' public keys, its masked update, the self-mask shares of round t and the
mask-key shares of the later round. Now every round attempt masks with fresh keys, and no
private key is ever reconstructed: survivors disclose their seeds with a dropped member
for that one round attempt only.

The scripted attack below uses everything the coordinator holds; a positive control runs
the same attack with the key it would have needed and recovers the release, so the test
fails if the protocol ever hands the coordinator that key again.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from federation_helpers import federation, small_config
from hypothesis import given, settings
from hypothesis import strategies as st
from secagg_helpers import mask_release

from lensemble_flwr.aggregation.fixed_point import to_fixed_point
from lensemble_flwr.errors import SecureAggregationError
from lensemble_flwr.protocol.messages import MessageKind, kind_of
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.secagg import prg, shamir
from lensemble_flwr.secagg.keys import SecAggKeys, pair_seed
from lensemble_flwr.secagg.participant_role import parse_members
from lensemble_flwr.secagg.protocol import (
    MaskedSum,
    Member,
    context_of,
    disclose,
    graph_of,
    isolated_survivors,
    mask,
    neighbours,
    share_threshold,
    short_of_shares,
)
from lensemble_flwr.testing import DeliveryLog, FaultPlan
from tests.strategies.test_grid_transport import _serverapp_identity  # noqa: F401  (autouse)

THRESHOLD = 3
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _flat(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[n], np.int64).reshape(-1) for n in sorted(arrays)])


def hex_secrets(value: Any) -> set[bytes]:
    """Every 32-byte value written as hex anywhere in a payload (keys, seeds, digests)."""
    found: set[bytes] = set()
    if isinstance(value, str):
        for part in value.split(":"):
            if _HEX64.match(part):
                found.add(bytes.fromhex(part))
    elif isinstance(value, Mapping):
        for k, v in value.items():
            found |= hex_secrets(k) | hex_secrets(v)
    elif isinstance(value, list | tuple | set):
        for v in value:
            found |= hex_secrets(v)
    return found


def combined_shares(
    transcript: Iterable[Mapping[str, Any]], threshold: Mapping[int, int] | None = None
) -> dict[tuple, bytes]:
    """(round, attempt, sender) -> the secret its disclosed Shamir shares recover, for
    every sender with enough of them in the transcript (``threshold``: round -> shares
    needed, as ``share_threshold`` says; THRESHOLD when a round is not named)."""
    shares: dict[tuple, dict[int, tuple[int, int]]] = {}
    for p in transcript:
        if kind_of(p) is MessageKind.UNMASK_RESPONSE:
            for sender, share in p["b_shares"].items():
                x, y = share.split(":")
                shares.setdefault((p["round"], p["attempt"], sender), {})[int(x)] = (
                    int(x),
                    int(y, 16),
                )
    out = {}
    for key, found in shares.items():
        try:
            needed = (threshold or {}).get(key[0], THRESHOLD)
            out[key] = shamir.combine(list(found.values()), needed)
        except SecureAggregationError:
            continue
    return out


def unmask_with(
    masked: np.ndarray, me: str, self_seed: bytes, seeds: Mapping[str, bytes]
) -> np.ndarray:
    """``masked`` minus the self mask and the pairwise masks of ``seeds`` (peer -> seed)."""
    total = masked.copy()
    streams = [(self_seed, -1)] + [(s, -1 if me < peer else +1) for peer, s in seeds.items()]
    prg.add_streams(streams, total)
    return total


def recover(
    transcript: list[Mapping[str, Any]],
    target: str,
    round: int,
    attempt: int,
    *extra: bytes,
    degree: int = 0,
) -> np.ndarray | None:
    """The coordinator's attack on ``target``'s masked update of one round attempt, with
    everything in the transcript (and ``extra`` candidate keys): its self mask from the
    disclosed shares, then every 32-byte value as the target's mask key, and every
    combination of disclosed seeds as its pairwise seeds. Returns every candidate plaintext
    it can build (stacked); the caller compares them with the truth."""
    (update,) = [
        p
        for p in transcript
        if kind_of(p) is MessageKind.UPDATE
        and (p["participant_id"], p["round"], p["attempt"]) == (target, round, attempt)
    ]
    opened = {
        tuple(p["secagg_members"])
        for p in transcript
        if kind_of(p) is MessageKind.ROUND_OPEN
        and (p["round"], p["attempt"]) == (round, attempt)
        and p["secagg_members"]
    }  # one list (full graph), or one per member (sparse: its neighbours' keys only)
    keyed: dict[str, Member] = {}
    for listed in opened:
        for m in parse_members(listed):
            if m.mask_public:
                keyed[m.pid] = m  # every member's keys, from whichever list carries them
    members = sorted(keyed.values(), key=lambda m: m.pid)
    near = set(neighbours(target, members, degree, context_of(update["run_id"], round, attempt)))
    peers = [m for m in members if m.pid in near]
    secrets = combined_shares(
        transcript, {round: share_threshold(len(members), degree, THRESHOLD)}
    )
    self_seed = secrets.get((round, attempt, target))
    if self_seed is None:
        return None  # the self mask was never disclosed: nothing to start from
    context = context_of(update["run_id"], round, attempt)
    masked = _flat(update["delta"])
    candidates = []
    keys = set().union(*(hex_secrets(p) for p in transcript)) | set(secrets.values()) | set(extra)
    for key in keys:  # the target's round key, were it anywhere in the transcript
        seeds = {m.pid: pair_seed(key, m.mask_public, context) for m in peers}
        candidates.append(unmask_with(masked, target, self_seed, seeds))
    disclosed = sorted(
        {
            bytes.fromhex(h)
            for p in transcript
            if kind_of(p) is MessageKind.UNMASK_RESPONSE
            for h in p["pair_seeds"].values()
        }
    )
    for choice in itertools.product(disclosed, repeat=len(peers)):  # the seeds themselves
        seeds = dict(zip((m.pid for m in peers), choice, strict=True))
        candidates.append(unmask_with(masked, target, self_seed, seeds))
    return np.stack(candidates) if candidates else None


def release_integers(update: Mapping[str, Any], config) -> np.ndarray:
    """The fixed-point integers of a plaintext update: what the masked one hides."""
    weight = config.federation.weight_of(update["num_examples"])
    unit = float(weight) * 2.0**config.aggregation.fraction_bits
    return _flat(to_fixed_point(update["delta"], {n: unit for n in update["delta"]}))


@pytest.mark.parametrize(
    "later",
    [  # made per test: a FaultPlan is spent as its faults happen
        lambda: FaultPlan().drop("p02", round=2, at=RoundState.COLLECTING).rejoin("p02", round=3),
        lambda: FaultPlan().delay("p02", round=2, seconds=1e4),  # late: declared dropped
    ],
    ids=["drops-later", "late-later"],
)
@pytest.mark.parametrize(
    ("degree", "n"), [(0, 4), (2, 6)], ids=["full", "sparse"]
)  # sparse: t_k = ceil(2 * 3 / 6) = 1 share of the 2 neighbours'
def test_a_survivors_release_stays_hidden_when_it_later_drops_or_is_late(
    tmp_path: Path, later: Callable[[], FaultPlan], degree: int, n: int
) -> None:
    later = later()
    config = small_config(
        secagg_threshold=THRESHOLD, min_participants=THRESHOLD, secagg_neighbours=degree
    )
    plain, plain_net, _ = federation(
        tmp_path, config=small_config(min_participants=THRESHOLD), name="plain", participants=n
    )
    plain_seen = DeliveryLog(plain_net)
    plain.run(1)
    coordinator, network, nodes = federation(
        tmp_path, config=config, name="masked", faults=later, participants=n
    )
    seen = DeliveryLog(network)  # the coordinator's whole transcript, both directions
    p02 = next(n for n in nodes if n.participant_id == "p02")
    used: list[bytes | None] = []  # ground truth, for the positive control only
    open_round = p02.masking.open_round

    def spy(*args, **kwargs):
        opened = open_round(*args, **kwargs)
        if opened is not None:  # a round that lists p02: it masks with this key
            used.append(p02.masking.round_key)  # deleted once it answers the unmask request
        return opened

    p02.masking.open_round = spy  # type: ignore[method-assign]
    coordinator.run(1)  # round 1: p02 survives, its self mask is disclosed
    (round_key,) = used
    assert round_key is not None and p02.masking.round_key is None
    coordinator.run(3)  # round 2: p02 drops or is late; then it comes back
    assert "p02" not in coordinator.outcomes[1].contributors
    transcript = seen.payloads()
    late_update = [
        p
        for p in transcript
        if kind_of(p) is MessageKind.UPDATE and p["participant_id"] == "p02" and p["round"] == 2
    ]
    assert bool(late_update) == bool(later.delays)  # late: it did arrive; dropped: never

    (plain_update,) = plain_seen.payloads(MessageKind.UPDATE, round=1, source="p02")
    truth = release_integers(plain_update, config)
    candidates = recover(transcript, "p02", 1, 1, degree=degree)
    assert candidates is not None  # its round-1 self mask is known: the attack can start
    assert not (candidates == truth).all(axis=1).any()  # ...and gets nowhere

    # positive control: with p02's round-1 mask key the same attack succeeds
    controlled = recover(transcript, "p02", 1, 1, round_key, degree=degree)
    assert controlled is not None and (controlled == truth).all(axis=1).any()

    # the round p02 was late in: its masked input reached the coordinator, filed late,
    # and its self mask of that round was never disclosed
    if late_update:
        assert "p02" in coordinator.manifest.rounds[1].late
        assert recover(transcript, "p02", 2, 1, degree=degree) is None


# -- the property, over random drop and late patterns -----------------------------------
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 9),
    rounds=st.integers(2, 4),
    sparse=st.booleans(),
    data=st.data(),
)
def test_no_member_ever_has_its_self_mask_and_all_its_pairwise_masks_disclosed(
    n: int, rounds: int, sparse: bool, data: st.DataObject
) -> None:
    """Several rounds, fresh keys each (as the participants make them), random members that
    drop before sending and random ones that are late (their masked input arrives after
    the set froze). For every (member, round): the transcript never discloses both its
    self mask and every pairwise mask of that round, no key in the transcript derives the
    missing ones, and the revealed sum is bitwise the plaintext sum of the survivors. With
    a sparse graph the self-mask shares go to the neighbours only (t_k of them recover
    one): the same must hold."""
    threshold = data.draw(st.integers(2, n - 1))
    degree = data.draw(st.sampled_from([2, 4] if n >= 7 else [2])) if sparse and n >= 5 else 0
    thresholds: dict[int, int] = {}  # round -> shares that recover a self mask
    pids = [f"p{i}" for i in range(n)]
    transcript: list[dict[str, Any]] = []
    views = []  # (round, member, masked input, its round key)
    for rnd in range(rounds):
        keys = {p: SecAggKeys.generate() for p in pids}  # fresh mask keys every round
        members = [Member(p, keys[p].mask_public, keys[p].enc_public) for p in pids]
        context = context_of("run", rnd, 1)
        missing = data.draw(st.sets(st.sampled_from(pids), max_size=n - threshold))
        late = data.draw(st.sets(st.sampled_from(sorted(missing)))) if missing else set()
        survivors = [p for p in pids if p not in missing]
        graph = graph_of(members, degree, context)
        if (
            isolated_survivors(members, survivors, degree, context)
            or short_of_shares(members, survivors, degree, threshold, context)
            or (graph.sparse and graph.groups(survivors) > 1)
        ):
            continue  # refused by both sides: tested in test_secagg and test_secagg_sparse
        thresholds[rnd] = share_threshold(n, degree, threshold)
        rng = np.random.default_rng(rnd)
        values = {p: {"w": rng.integers(-(2**40), 2**40, 7, dtype=np.int64)} for p in pids}
        releases = {
            p: mask(
                values[p],
                me=p,
                keys=keys[p],
                members=members,
                threshold=threshold,
                context=context,
                degree=degree,
            )
            for p in pids
        }
        summed = MaskedSum(
            {"w": np.zeros(7)}, members, threshold=threshold, context=context, degree=degree
        )
        for p in survivors:
            summed.add(p, releases[p].masked)
        answers = {
            h: disclose(
                me=h,
                keys=keys[h],
                members=members,
                context=context,
                survivors=survivors,
                dropped=summed.dropped,
                self_mask_shares={s: releases[s].sealed[h] for s in survivors
                                  if h in releases[s].sealed},  # sparse: neighbours only
                threshold=threshold,
                degree=degree,
            )
            for h in survivors
        }
        revealed = summed.reveal(answers)
        with np.errstate(over="ignore"):
            expected = sum((values[p]["w"] for p in survivors), np.zeros(7, np.int64))
        np.testing.assert_array_equal(revealed["w"], expected)
        for p in [*survivors, *sorted(late)]:  # what reached the coordinator
            transcript.append(
                {"kind": "update", "round": rnd, "participant_id": p, "masked": releases[p]}
            )
            views.append((rnd, p, members, context, keys[p].mask_private, p in late))
        for h, answer in answers.items():
            transcript.append(
                {
                    "kind": "unmask-response",
                    "round": rnd,
                    "attempt": 1,
                    "participant_id": h,
                    "b_shares": {s: f"{x}:{y:x}" for s, (x, y) in answer.self_mask.items()},
                    "pair_seeds": {d: s.hex() for d, s in answer.pair_seeds.items()},
                }
            )
        transcript.append({"kind": "round-open", "members": [m.mask_public.hex() for m in members]})

    disclosed_b = combined_shares(transcript, thresholds)
    disclosed_seeds = {
        bytes.fromhex(h)
        for p in transcript
        if p["kind"] == "unmask-response"
        for h in p["pair_seeds"].values()
    }
    keys_in_transcript = set().union(*(hex_secrets(p) for p in transcript)) | set(
        disclosed_b.values()
    )
    for rnd, pid, members, context, true_key, was_late in views:
        assert true_key not in keys_in_transcript  # no private key is ever disclosed
        # the attack's own control: it recovers every survivor's self mask, a late one's never
        assert ((rnd, 1, pid) in disclosed_b) is not was_late
        if (rnd, 1, pid) not in disclosed_b:
            continue  # its self mask is hidden: its input is
        near = neighbours(pid, members, degree, context)
        by_id = {m.pid: m for m in members}
        pair = {v: pair_seed(true_key, by_id[v].mask_public, context) for v in near}
        known = {v for v, s in pair.items() if s in disclosed_seeds}
        assert known != set(near), f"{pid} fully unmasked in round {rnd}"


# -- a coordinator that asks twice, lowers the threshold, or a member with bad keys -------
def _role_with_a_round(threshold: int = 2, n: int = 3):
    """A MaskingRole that masked for a round of ``n`` members (p0 is the role)."""
    from lensemble_flwr.config import LensembleConfig
    from lensemble_flwr.protocol.messages import RoundOpen
    from lensemble_flwr.protocol.state import PseudoGradient
    from lensemble_flwr.secagg.participant_role import MaskingRole, encode_member

    role = MaskingRole("p0")
    role.keys_for_commitment()
    mine = next(iter(role.announced))
    others = {f"p{i}": SecAggKeys.generate() for i in range(1, n)}
    members = [Member("p0", bytes.fromhex(mine), public_of(role.enc_private))] + [
        Member(p, k.mask_public, k.enc_public) for p, k in others.items()
    ]
    config = LensembleConfig(federation={"secagg_threshold": threshold, "min_participants": 2})
    opened = RoundOpen.model_construct(
        run_id="run",
        round=1,
        attempt=1,
        secagg_prg=prg.PRG_ID,
        secagg_members=tuple(encode_member(m) for m in members),
        secagg_threshold=threshold,
        secagg_neighbours=0,
    )
    release = PseudoGradient(
        participant_id="p0",
        round=1,
        delta={"w": np.zeros(3, np.float32)},
        l2_norm=0.0,
        dataset_root=None,
        num_examples=1,
    )
    fields = mask_release(role, release, opened, config)
    return role, members, fields, config, opened


def public_of(private: bytes | None) -> bytes:
    from lensemble_flwr.secagg.keys import public_key

    assert private is not None
    return public_key(private)


def test_a_member_answers_one_partition_per_attempt_and_then_deletes_its_key() -> None:
    """A coordinator that asked once with 'p2 survived' and again with 'p2 dropped' would
    get p2's self mask from some holders and its pairwise seeds from the others. The
    same request again gets the same answer; another partition is refused."""
    from lensemble_flwr.protocol.messages import UnmaskRequest

    role, _members, fields, *_ = _role_with_a_round()
    common = {"run_id": "run", "round": 1, "attempt": 1, "sender": "coordinator"}
    first = UnmaskRequest(
        **common,
        survivors=("p0", "p1", "p2"),
        dropped=(),
        sealed={"p0": fields["sealed_shares"]["p0"]},
    )
    answer = role.disclose(first)
    assert role.round_key is None  # answered: the round's mask key is gone
    assert role.disclose(first) == answer  # a resent request: the same answer
    second = first.model_copy(update={"survivors": ("p0", "p1"), "dropped": ("p2",)})
    with pytest.raises(SecureAggregationError, match="another partition"):
        role.disclose(second)
    restored = type(role)("p0")
    restored.restore(role.export())  # the answer survives a restart of the participant
    with pytest.raises(SecureAggregationError, match="another partition"):
        restored.disclose(second)


def test_a_member_refuses_a_round_with_another_threshold_before_it_trains(tmp_path) -> None:
    """A coordinator that lowers the threshold to 1 could unmask a member from its own
    share; a threshold of 0 used to crash the member (an untyped ValueError)."""
    role, _members, _fields, config, opened = _role_with_a_round()
    role.keys_for_commitment()
    for threshold in (0, 1, 3):
        with pytest.raises(SecureAggregationError, match="threshold"):
            role.check_round(opened.model_copy(update={"secagg_threshold": threshold}), config)
    with pytest.raises(SecureAggregationError, match="fewer than the threshold"):
        role.check_round(
            opened.model_copy(update={"secagg_members": opened.secagg_members[:1]}), config
        )
    with pytest.raises(SecureAggregationError, match="member list that does not parse"):
        role.check_round(opened.model_copy(update={"secagg_members": ("no-colons",) * 3}), config)


def test_a_low_order_mask_key_is_rejected_at_ingress_and_crashes_nobody() -> None:
    """An all-zero X25519 key used to make every member's exchange with it raise an
    untyped ValueError (the member crashed, after its budget was charged)."""
    from lensemble_flwr.coordinator.admission import check_usable_key
    from lensemble_flwr.errors import RoundError
    from lensemble_flwr.secagg.keys import check_public_key

    with pytest.raises(SecureAggregationError, match="not a usable X25519"):
        pair_seed(SecAggKeys.generate().mask_private, bytes(32), b"ctx")
    with pytest.raises(SecureAggregationError):
        check_public_key(bytes(32))
    with pytest.raises(RoundError, match="p9: mask_key"):
        check_usable_key("p9", "mask_key", "00" * 32)
    check_usable_key("p9", "mask_key", SecAggKeys.generate().mask_public.hex())


def test_bad_sealed_shares_and_shares_at_another_holders_point_are_refused() -> None:
    from lensemble_flwr.errors import RoundError
    from lensemble_flwr.secagg.aggregator import SecureAggregator
    from lensemble_flwr.secagg.keys import open_sealed, seal
    from lensemble_flwr.secagg.protocol import Disclosure

    alice, bob = SecAggKeys.generate(), SecAggKeys.generate()
    with pytest.raises(SecureAggregationError, match="sealed share is 5 bytes"):
        open_sealed(bob.enc_private, alice.enc_public, b"short", b"ctx")
    from lensemble_flwr.secagg.protocol import _aad, _open_share

    sealed = seal(alice.enc_private, bob.enc_public, b"not a share", _aad(b"ctx", "a", "b"))
    with pytest.raises(SecureAggregationError, match="not a share"):
        _open_share(bob, Member("a", alice.mask_public, alice.enc_public), "b", sealed, b"ctx")
    with pytest.raises(SecureAggregationError, match="not a point"):
        shamir.combine([(0, 5), (1, 6)], 2)
    keys = {p: SecAggKeys.generate() for p in ("a", "b", "c")}
    members = [Member(p, k.mask_public, k.enc_public) for p, k in keys.items()]
    from lensemble_flwr.config import AggregationConfig

    agg = SecureAggregator(
        {"w": np.zeros(2, np.float32)}, AggregationConfig(), members=members, threshold=2,
        context=b"ctx",
    )  # fmt: skip
    agg._weights.update({"a": 1, "b": 1, "c": 1})  # three survivors (no sum needed here)
    agg._sum.survivors.extend(["a", "b", "c"])
    with pytest.raises(RoundError, match="not the one dealt to it"):
        agg.disclose("b", Disclosure(self_mask={"a": (1, 7)}, pair_seeds={}))  # a's point
    agg.disclose("b", Disclosure(self_mask={"a": (2, 7)}, pair_seeds={}))  # b's own point
