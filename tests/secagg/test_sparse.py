"""SecAgg+ share placement: in a sparse graph a member deals its self-mask shares to its
k neighbours only (t_k of them recover it), and every side refuses what would break it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from federation_helpers import federation, small_config
from hypothesis import given, settings
from hypothesis import strategies as st
from secagg_helpers import mask_release, update_of

from lensemble_flwr.config import AggregationConfig, LensembleConfig
from lensemble_flwr.errors import RoundError, SecureAggregationError
from lensemble_flwr.protocol.messages import MessageKind, RoundOpen, UnmaskRequest, Update
from lensemble_flwr.protocol.round import RoundState
from lensemble_flwr.protocol.state import PseudoGradient
from lensemble_flwr.secagg import prg, shamir
from lensemble_flwr.secagg.aggregator import SecureAggregator
from lensemble_flwr.secagg.keys import SecAggKeys, public_key
from lensemble_flwr.secagg.participant_role import (
    MaskingRole,
    encode_member,
    encode_named,
    parse_members,
)
from lensemble_flwr.secagg.protocol import (
    Disclosure,
    Member,
    context_of,
    disclose,
    graph_of,
    mask,
    neighbours,
    share_threshold,
    short_of_shares,
)
from lensemble_flwr.testing import DeliveryLog, FaultPlan

CONTEXT = context_of("run", 1, 1)
N, DEGREE, THRESHOLD = 8, 4, 5  # t_k = ceil(4 * 5 / 8) = 3 of 4
TEMPLATE = {"w": np.zeros(6, np.float32)}


def members_of(n: int = N) -> tuple[dict[str, SecAggKeys], list[Member]]:
    keys = {f"p{i}": SecAggKeys.generate() for i in range(n)}
    return keys, [Member(p, k.mask_public, k.enc_public) for p, k in keys.items()]


def masked_update(
    pid: str, keys, members, *, threshold: int = THRESHOLD, degree: int = DEGREE
) -> Update:
    release = mask(
        {"w": np.arange(6, dtype=np.int64)},
        me=pid,
        keys=keys[pid],
        members=members,
        threshold=threshold,
        context=CONTEXT,
        degree=degree,
    )
    return update_of(pid, release)


def secure_aggregator(members) -> SecureAggregator:
    return SecureAggregator(
        TEMPLATE,
        AggregationConfig(),
        members=members,
        threshold=THRESHOLD,
        context=CONTEXT,
        degree=DEGREE,
    )


def test_the_share_threshold_matches_the_global_fraction_and_the_full_graph_keeps_t() -> None:
    assert share_threshold(8, 4, 5) == 3  # ceil(20 / 8)
    assert share_threshold(1000, 20, 501) == 11  # the benchmark's C = 1000: ceil(10.02)
    assert share_threshold(100, 14, 51) == 8
    assert share_threshold(10, 2, 1) == 1  # clipped below at 1 ...
    assert share_threshold(10, 4, 10) == 4  # ... and above at k
    for degree in (0, 7, 9):  # the full graph (k = 0, or k >= C - 1): t itself
        assert share_threshold(8, degree, 5) == 5


def test_a_member_deals_its_self_mask_to_its_neighbours_only() -> None:
    keys, members = members_of()
    release = mask(
        {"w": np.arange(3, dtype=np.int64)},
        me="p0",
        keys=keys["p0"],
        members=members,
        threshold=THRESHOLD,
        context=CONTEXT,
        degree=DEGREE,
    )
    near = neighbours("p0", members, DEGREE, CONTEXT)
    assert sorted(release.sealed) == near and len(near) == DEGREE
    by_id = {m.pid: m for m in members}
    from lensemble_flwr.secagg.protocol import _open_share

    shares = [_open_share(keys[h], by_id["p0"], h, release.sealed[h], CONTEXT) for h in near]
    assert [x for x, _ in shares] == list(range(1, DEGREE + 1))  # x: the place in the sorted list
    secret = shamir.combine(shares[:3], 3)
    assert all(shamir.combine(list(c), 3) == secret for c in (shares[1:], shares[::2] + shares[3:]))
    with pytest.raises(SecureAggregationError, match="3 needed"):
        shamir.combine(shares[:2], 3)  # t_k - 1 shares do not recover it
    full = mask(
        {"w": np.arange(3, dtype=np.int64)},
        me="p0",
        keys=keys["p0"],
        members=members,
        threshold=THRESHOLD,
        context=CONTEXT,
        degree=0,
    )
    assert sorted(full.sealed) == sorted(by_id)  # the full graph: a share for every member


def _all_masked(keys, members, aggregator: SecureAggregator, senders) -> None:
    for pid in senders:
        aggregator.admit(masked_update(pid, keys, members), weight=1)


def test_the_sum_is_revealed_exactly_from_the_neighbours_shares() -> None:
    keys, members = members_of()
    agg = secure_aggregator(members)
    _all_masked(keys, members, agg, [m.pid for m in members])
    requests = agg.disclosure_requests()
    for holder, request in requests.items():
        assert sorted(request.sealed_hex) == neighbours(holder, members, DEGREE, CONTEXT)
        answer = disclose(
            me=holder,
            keys=keys[holder],
            members=members,
            context=CONTEXT,
            survivors=request.survivors,
            dropped=request.dropped,
            self_mask_shares=request.self_mask_shares,
            threshold=THRESHOLD,
            degree=DEGREE,
        )
        agg.disclose(holder, answer)
    result = agg.reveal()
    np.testing.assert_array_equal(result.sums["w"], N * np.arange(6))
    agg.verify(result)


def test_too_few_surviving_neighbours_is_refused_before_anyone_is_asked() -> None:
    keys, members = members_of()
    graph = graph_of(members, DEGREE, CONTEXT)
    target = "p0"
    near = sorted(graph.near(target))
    survivors = [m.pid for m in members if m.pid not in near[:2]]  # p0 keeps 2 of 4 < 3
    assert len(survivors) >= THRESHOLD  # the global threshold alone would let it through
    assert target in short_of_shares(members, survivors, DEGREE, THRESHOLD, CONTEXT)
    agg = secure_aggregator(members)
    _all_masked(keys, members, agg, survivors)
    with pytest.raises(SecureAggregationError, match="fewer than 3 surviving neighbours"):
        agg.disclosure_requests()
    with pytest.raises(SecureAggregationError, match="fewer than 3 surviving neighbours"):
        agg.reveal()
    holder = next(s for s in survivors if s != target)
    dropped = [m.pid for m in members if m.pid not in survivors]
    with pytest.raises(SecureAggregationError, match="fewer than 3 surviving neighbours"):
        disclose(
            me=holder,
            keys=keys[holder],
            members=members,
            context=CONTEXT,
            survivors=survivors,
            dropped=dropped,
            self_mask_shares={},
            threshold=THRESHOLD,
            degree=DEGREE,
        )


def test_a_federation_refuses_the_attempt_before_it_sends_an_unmask_request(
    tmp_path: Path,
) -> None:
    """C = 5, k = 2, t = 3: t_k = ceil(2 * 3 / 5) = 2, so a drop leaves both of its
    neighbours short. The attempt aborts without an unmask request; the retry closes."""
    faults = FaultPlan().drop("p02", round=2, at=RoundState.COLLECTING)
    config = small_config(secagg_threshold=3, min_participants=3, secagg_neighbours=2)
    coordinator, network, _nodes = federation(
        tmp_path, config=config, participants=5, faults=faults
    )
    seen = DeliveryLog(network)
    coordinator.run(2)
    second = [o for o in coordinator.outcomes if o.round == 2]
    assert second[0].state is RoundState.ABORTED
    assert "fewer than 2 surviving neighbours" in str(second[0].error)
    asked = {p["attempt"] for p in seen.payloads(MessageKind.UNMASK_REQUEST, round=2)}
    assert second[0].attempt not in asked  # nobody was asked to disclose in that attempt


def _role(degree: int = DEGREE, threshold: int = THRESHOLD):
    """A MaskingRole p0 that masked for a sparse round of N members."""
    role = MaskingRole("p0")
    role.keys_for_commitment()
    mine = next(iter(role.announced))
    keys, members = members_of()
    assert role.enc_private is not None
    members[0] = Member("p0", bytes.fromhex(mine), public_key(role.enc_private))
    near = set(neighbours("p0", members, degree, CONTEXT)) | {"p0"}
    config = LensembleConfig(
        federation={
            "secagg_threshold": threshold,
            "min_participants": 2,
            "secagg_neighbours": degree,
        }
    )
    opened = RoundOpen.model_construct(
        run_id="run",
        round=1,
        attempt=1,
        secagg_threshold=threshold,
        secagg_neighbours=degree,
        secagg_prg=prg.PRG_ID,
        secagg_members=tuple(
            encode_member(m) if m.pid in near else encode_named(m) for m in members
        ),
    )
    return role, keys, members, config, opened


def _release() -> PseudoGradient:
    return PseudoGradient(
        participant_id="p0",
        round=1,
        delta={"w": np.zeros(3, np.float32)},
        l2_norm=0.0,
        dataset_root=None,
        num_examples=1,
    )


def test_a_member_masks_with_only_its_neighbours_keys_and_refuses_a_neighbour_without() -> None:
    role, _keys, members, config, opened = _role()
    parsed = parse_members(opened.secagg_members)
    assert [m.pid for m in parsed] == [m.pid for m in members]  # every member named
    assert sum(bool(m.mask_public) for m in parsed) == DEGREE + 1  # keys: p0 and neighbours
    near = neighbours("p0", members, DEGREE, CONTEXT)
    stripped = tuple(
        encode_named(m) if m.pid == near[0] else e
        for m, e in zip(members, opened.secagg_members, strict=True)
    )
    with pytest.raises(SecureAggregationError, match="without their keys"):
        role.check_round(opened.model_copy(update={"secagg_members": stripped}), config)
    full = opened.model_copy(update={"secagg_neighbours": 0})  # the full graph needs all keys
    with pytest.raises(SecureAggregationError, match="without their keys"):
        role.check_round(
            full,
            config.model_copy(
                update={"federation": config.federation.model_copy(update={"secagg_neighbours": 0})}
            ),
        )
    fields = mask_release(role, _release(), opened, config)
    assert sorted(fields["sealed_shares"]) == near


@pytest.mark.parametrize(
    "change",
    [
        {"secagg_neighbours": 2},
        {"secagg_neighbours": 0},
        {"secagg_threshold": 4},
        {"secagg_threshold": 6},
    ],
)
def test_a_member_refuses_a_round_that_announces_another_degree_or_threshold(change) -> None:
    """Another k or t would change t_k = ceil(k t / C): the member refuses before it trains."""
    role, _keys, _members, config, opened = _role()
    with pytest.raises(SecureAggregationError, match=r"threshold|neighbour graph"):
        role.check_round(opened.model_copy(update=change), config)
    role.check_round(opened, config)  # the announced k and t: accepted


def test_a_member_refuses_a_request_that_carries_a_share_of_a_non_neighbour() -> None:
    role, keys, members, config, opened = _role()
    mask_release(role, _release(), opened, config)
    near = set(neighbours("p0", members, DEGREE, CONTEXT))
    stranger = next(m.pid for m in members if m.pid not in near | {"p0"})
    # the stranger's share "for p0" (a real sealed box: it is refused for where it comes from)
    from lensemble_flwr.secagg.keys import seal_in
    from lensemble_flwr.secagg.protocol import _aad

    sealed = seal_in(
        keys[stranger].box(public_key(role.enc_private)), b"1:5", _aad(CONTEXT, stranger, "p0")
    )
    request = UnmaskRequest(
        run_id="run",
        round=1,
        attempt=1,
        sender="coordinator",
        survivors=tuple(m.pid for m in members),
        dropped=(),
        sealed={stranger: sealed.hex()},
    )
    with pytest.raises(SecureAggregationError, match="not my neighbours"):
        role.disclose(request)
    assert role.answered is None and role.round_key is not None  # nothing answered, key kept


def test_the_aggregator_refuses_shares_dealt_to_or_disclosed_by_non_neighbours() -> None:
    keys, members = members_of()
    agg = secure_aggregator(members)
    update = masked_update("p0", keys, members)
    near = set(neighbours("p0", members, DEGREE, CONTEXT))
    stranger = next(m.pid for m in members if m.pid not in near | {"p0"})
    extra = {**(update.sealed_shares or {}), stranger: next(iter(update.sealed_shares.values()))}
    with pytest.raises(RoundError, match="its neighbours, and only"):
        agg.admit(update.model_copy(update={"sealed_shares": extra}), weight=1)
    _all_masked(keys, members, agg, [m.pid for m in members])
    holder = sorted(near)[1]  # p0's second neighbour: its share of p0 is at x = 2
    with pytest.raises(RoundError, match="no neighbour of"):
        agg.disclose(stranger, Disclosure(self_mask={"p0": (1, 7)}, pair_seeds={}))
    with pytest.raises(RoundError, match="not the one dealt to it"):
        agg.disclose(holder, Disclosure(self_mask={"p0": (1, 7)}, pair_seeds={}))
    agg.disclose(holder, Disclosure(self_mask={"p0": (2, 7)}, pair_seeds={}))
    assert agg.disclosed == [holder]


def test_the_full_graph_round_open_lists_every_member_with_its_keys(tmp_path: Path) -> None:
    """The full graph is as it was: one member list, every member's keys, for everyone;
    a sparse one names everyone but gives each member its neighbours' keys only."""
    for degree, n in ((0, 4), (2, 6)):
        config = small_config(secagg_threshold=3, min_participants=3, secagg_neighbours=degree)
        coordinator, network, _nodes = federation(
            tmp_path / str(degree), config=config, participants=n
        )
        seen = DeliveryLog(network)
        coordinator.run(2)
        lists = {
            p["secagg_members"]
            for p in seen.payloads(MessageKind.ROUND_OPEN, round=2)
            if p["secagg_members"]
        }
        parsed = [parse_members(listed) for listed in lists]
        assert all(len(members) == n for members in parsed)
        keyed = [sum(bool(m.mask_public) for m in members) for members in parsed]
        assert keyed == ([n] if degree == 0 else [degree + 1] * n)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 14), degree=st.sampled_from([2, 4, 6]), need=st.integers(1, 6), data=st.data()
)
def test_counting_short_survivors_from_the_dropped_side_is_counting_them_directly(
    n: int, degree: int, need: int, data: st.DataObject
) -> None:
    _keys, members = members_of(n)
    survivors = sorted(data.draw(st.sets(st.sampled_from([m.pid for m in members]))))
    graph = graph_of(members, degree, CONTEXT)
    near = {m.pid: set(neighbours(m.pid, members, degree, CONTEXT)) for m in members}
    alive = set(survivors)
    direct = sorted(s for s in alive if len(alive & near[s]) < need) if graph.sparse else []
    assert graph.short_of(survivors, need) == direct
    assert graph.isolated(survivors) == sorted(s for s in alive if not alive & near[s])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(3, 16), degree=st.sampled_from([2, 4, 6]), data=st.data())
def test_the_ring_scan_counts_the_groups_a_search_of_the_graph_finds(
    n: int, degree: int, data: st.DataObject
) -> None:
    _keys, members = members_of(n)
    survivors = sorted(data.draw(st.sets(st.sampled_from([m.pid for m in members]))))
    graph = graph_of(members, degree, CONTEXT)
    near = {m.pid: set(neighbours(m.pid, members, degree, CONTEXT)) for m in members}
    alive, groups = set(survivors), 0
    unseen = set(alive)
    while unseen:  # connected components of the survivors' own graph
        groups += 1
        frontier = [unseen.pop()]
        while frontier:
            reached = near[frontier.pop()] & unseen
            unseen -= reached
            frontier.extend(reached)
    assert graph.groups(survivors) == groups


@pytest.mark.parametrize(
    ("n", "degree", "threshold", "dropped_places"),
    [(20, 4, 10, (0, 1, 10, 11)), (10, 2, 3, (0, 3))],
)
def test_survivors_in_unconnected_groups_are_never_revealed(
    n: int, degree: int, threshold: int, dropped_places: tuple[int, ...]
) -> None:
    """Found in review: every survivor has t_k surviving neighbours, none is isolated,
    there are t survivors, yet the survivors fall into two groups with no edge between
    them. Each group's masks cancel up to the seeds with dropped members, which are
    disclosed, so revealing would hand the coordinator each group's sum (of fewer than t
    members, with fewer than t noise shares). The coordinator refuses before asking, and
    every member refuses to disclose."""
    keys, members = members_of(n)
    graph = graph_of(members, degree, CONTEXT)
    ring = graph._ring
    dropped = sorted(ring[at] for at in dropped_places)
    survivors = [m.pid for m in members if m.pid not in dropped]
    assert graph.groups(survivors) == 2
    assert len(survivors) >= threshold and not graph.isolated(survivors)
    need = share_threshold(n, degree, threshold)
    assert not graph.short_of(survivors, need)  # the older checks all pass
    agg = SecureAggregator(
        TEMPLATE, AggregationConfig(), members=members, threshold=threshold,
        context=CONTEXT, degree=degree,
    )  # fmt: skip
    for pid in survivors:
        agg.admit(
            masked_update(pid, keys, members, threshold=threshold, degree=degree), weight=1
        )
    with pytest.raises(SecureAggregationError, match="unconnected groups"):
        agg.disclosure_requests()
    with pytest.raises(SecureAggregationError, match="unconnected groups"):
        disclose(
            me=survivors[0], keys=keys[survivors[0]], members=members, context=CONTEXT,
            survivors=survivors, dropped=dropped, self_mask_shares={},
            threshold=threshold, degree=degree,
        )  # fmt: skip


def test_a_member_refuses_to_disclose_a_sum_of_fewer_than_t_survivors() -> None:
    """In a sparse graph t_k neighbours can survive around every survivor of a set
    smaller than t; the member's own check keeps such a sum (fewer noise shares than
    distributed DP is sized for) from being revealed."""
    keys, members = members_of(12)
    graph = graph_of(members, 4, CONTEXT)
    survivors = graph._ring[:6]  # one connected run of 6 < t = 9
    dropped = [m.pid for m in members if m.pid not in survivors]
    with pytest.raises(SecureAggregationError, match="6 survivors, threshold 9"):
        disclose(
            me=survivors[2], keys=keys[survivors[2]], members=members, context=CONTEXT,
            survivors=survivors, dropped=dropped, self_mask_shares={},
            threshold=9, degree=4,
        )  # fmt: skip


def test_a_member_refuses_a_round_listing_a_member_twice() -> None:
    role, _keys, _members, config, opened = _role()
    listed = opened.secagg_members
    twice = opened.model_copy(update={"secagg_members": (*listed, listed[-1])})
    with pytest.raises(SecureAggregationError, match="lists a member twice"):
        role.check_round(twice, config)
    role.check_round(opened, config)  # the round as announced: accepted


def test_a_member_restored_without_a_threshold_refuses_to_unmask() -> None:
    """A state without the round's threshold (one saved before the share placement, or
    tampered) cannot say how many neighbours must survive: the member refuses to
    disclose rather than guess, and keeps its key."""
    role, _keys, members, config, opened = _role()
    mask_release(role, _release(), opened, config)
    role.threshold = 0
    request = UnmaskRequest(
        run_id="run", round=1, attempt=1, sender="coordinator",
        survivors=tuple(m.pid for m in members), dropped=(), sealed={},
    )  # fmt: skip
    with pytest.raises(SecureAggregationError, match="no masked round to unmask"):
        role.disclose(request)
    assert role.answered is None and role.round_key is not None
