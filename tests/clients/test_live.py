"""A ClientApp process keeps the participants it built alive between messages
(``make_client_app(keep_live_bytes=...)``, :mod:`lensemble_flwr.clients.live`): a kept one
releases exactly what a participant rebuilt from ``context.state`` releases, whether
``context.state`` is the state it saved last or one another process saved or rolled back."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from federation_helpers import small_config
from flwr.app import Context, Message, RecordDict

from lensemble_flwr.clients import live as live_module
from lensemble_flwr.clients.app import make_client_app
from lensemble_flwr.clients.live import (
    DEFAULT_KEEP_BYTES,
    LiveParticipants,
    process_participants,
    size_of,
)
from lensemble_flwr.clients.state import META_KEY, TOKEN_FIELD, load_state, saved_token
from lensemble_flwr.simulations.toy import ToyTrainer
from tests.release.test_state_codec import NODE, next_process, released_update, train_message
from tests.strategies.test_records import _serverapp_identity  # noqa: F401  (autouse: the ServerApp identity)

ROUNDS = 4


@pytest.fixture(autouse=True)
def _a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process does: no participant kept."""
    monkeypatch.setattr(live_module, "_PROCESS", {})


class Counting:
    """A trainer_fn that counts the trainers it built (and can make one fail)."""

    def __init__(self) -> None:
        self.built = 0
        self.fail = False

    def __call__(self, context: Context) -> ToyTrainer:
        self.built += 1
        trainer = ToyTrainer(1)
        loss = trainer.loss
        counter = self

        def failing_loss(model: Any, batch: Any) -> Any:
            if counter.fail:
                raise RuntimeError("the user's loss failed")
            return loss(model, batch)

        trainer.loss = failing_loss  # type: ignore[method-assign]
        return trainer


def app_for(trainer_fn: Counting, keep_live_bytes: int | None = None) -> Any:
    extra = {} if keep_live_bytes is None else {"keep_live_bytes": keep_live_bytes}
    config = small_config()
    return make_client_app(
        trainer_fn,
        config_fn=lambda context: config,
        identity_fn=lambda context: None,
        evaluate_fn=None,
        **extra,
    )


def new_context(node: int = NODE) -> Context:
    return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})


def run_rounds(app: Any, context: Context, rounds: range) -> tuple[list[Message], Context]:
    replies = []
    for rnd in rounds:
        replies.append(app(train_message(rnd), context))
        assert not replies[-1].has_error(), replies[-1].error
        context = next_process(context)  # what the SuperNode hands the next message
    return replies, context


def assert_same_updates(got: list[Message], want: list[Message]) -> None:
    for a, b in zip(got, want, strict=True):
        ua, ub = released_update(a), released_update(b)
        assert ua.delta.keys() == ub.delta.keys()
        for name in ub.delta:
            np.testing.assert_array_equal(ua.delta[name], ub.delta[name])
        assert ua.model_dump(exclude={"delta", "signature"}) == ub.model_dump(
            exclude={"delta", "signature"}
        )


def test_a_kept_participant_releases_what_a_rebuilt_one_releases() -> None:
    kept_fn, fresh_fn = Counting(), Counting()
    kept_app, fresh_app = app_for(kept_fn), app_for(fresh_fn, keep_live_bytes=0)
    kept, kept_context = run_rounds(kept_app, new_context(), range(ROUNDS))
    fresh, fresh_context = run_rounds(fresh_app, new_context(), range(ROUNDS))
    assert (kept_fn.built, fresh_fn.built) == (1, ROUNDS)
    assert process_participants().hits == ROUNDS - 1
    assert process_participants(0).hits == 0 and len(process_participants(0)) == 0
    assert_same_updates(kept, fresh)
    # and the state each leaves in context.state is the same but for its token
    a, b = load_state(kept_context.state), load_state(fresh_context.state)
    assert a.meta == b.meta
    assert a.arrays.keys() == b.arrays.keys()
    for name in b.arrays:
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])
    assert saved_token(kept_context.state) != saved_token(fresh_context.state)


def test_a_rolled_back_state_is_loaded_into_the_kept_participant() -> None:
    trainer_fn = Counting()
    app = app_for(trainer_fn)
    _, after_first = run_rounds(app, new_context(), range(1))
    _, after_second = run_rounds(app, next_process(after_first), range(1, 2))
    assert trainer_fn.built == 1
    # the node's state rolled back to what round 1 left: not the state the kept
    # participant saved last, so that state is loaded into it (nothing is rebuilt) ...
    live = process_participants()
    rolled_back = next_process(after_first)
    reply = app(train_message(2), rolled_back)
    assert (trainer_fn.built, live.stale) == (1, 1)
    # ... and it answers exactly as a process that lives for one message does
    reference = app_for(Counting(), keep_live_bytes=0)(train_message(2), next_process(after_first))
    assert_same_updates([reply], [reference])
    # a state without a token (saved by an older version, or written by hand) is loaded
    # into a participant built afresh
    stripped = next_process(after_second)
    meta = stripped.state[META_KEY]
    del meta[TOKEN_FIELD]
    app(train_message(2), stripped)
    assert trainer_fn.built == 2


def test_a_state_saved_by_another_process_is_loaded_into_the_kept_one() -> None:
    """On the simulation engine a node's messages go to whichever actor is free: two
    processes, each keeping its own participant for the node, take turns. Each loads the
    state the other saved, and the node releases what one process rebuilding every time
    releases."""
    fns = {"a": Counting(), "b": Counting()}
    processes: dict[str, dict[int, LiveParticipants]] = {"a": {}, "b": {}}
    apps = {name: app_for(fns[name]) for name in fns}
    context, replies = new_context(), []
    for rnd, name in enumerate("aabab"):
        live_module._PROCESS = processes[name]  # this message runs in process `name`
        replies.append(apps[name](train_message(rnd), context))
        assert not replies[-1].has_error(), replies[-1].error
        context = next_process(context)
    assert (fns["a"].built, fns["b"].built) == (1, 1)
    a, b = processes["a"][DEFAULT_KEEP_BYTES], processes["b"][DEFAULT_KEEP_BYTES]
    assert (a.hits, a.stale, a.misses) == (1, 1, 1)  # built, reused, refreshed
    assert (b.hits, b.stale, b.misses) == (0, 1, 1)
    live_module._PROCESS = {}
    fresh, _ = run_rounds(app_for(Counting(), keep_live_bytes=0), new_context(), range(5))
    assert_same_updates(replies, fresh)


def test_a_state_that_does_not_load_gets_a_participant_built_afresh() -> None:
    """A kept participant is not left half-loaded by a state that does not load: it is
    dropped, and the participant built afresh reports why the state does not load."""
    trainer_fn = Counting()
    app = app_for(trainer_fn)
    _, context = run_rounds(app, new_context(), range(1))
    broken = next_process(context)
    meta = broken.state[META_KEY]
    meta[TOKEN_FIELD] = "another process saved this"
    saved = json.loads(str(meta["json"]))
    assert saved["training"]["optimizer"]["param_groups"]  # AdamW's state was saved ...
    saved["training"]["optimizer"]["param_groups"] = []  # ... and is now broken
    meta["json"] = json.dumps(saved)
    # it fails late, in the optimizer, after the round state was restored: the kept
    # participant is then half-loaded, and must not be used
    with pytest.raises(ValueError, match="parameter groups"):
        app(train_message(1), broken)
    assert trainer_fn.built == 2  # the kept one was dropped: a rebuilt one raised
    assert len(process_participants()) == 0
    with pytest.raises(ValueError, match="parameter groups"):
        app_for(Counting(), keep_live_bytes=0)(train_message(1), next_process(broken))


def test_a_participant_that_failed_half_way_is_not_reused() -> None:
    trainer_fn = Counting()
    app = app_for(trainer_fn)
    _, context = run_rounds(app, new_context(), range(1))
    trainer_fn.fail = True
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        app(train_message(1), context)  # the state is the one round 1 left
    assert len(process_participants()) == 0
    trainer_fn.fail = False
    reply = app(train_message(1), context)  # retried: a participant built afresh
    assert not reply.has_error(), reply.error
    assert trainer_fn.built == 2


def test_nodes_of_one_process_keep_their_own_participants() -> None:
    trainer_fn = Counting()
    app = app_for(trainer_fn)
    contexts = {n: new_context(n) for n in (7, 8)}
    for rnd in range(3):
        for node in contexts:
            message = train_message(rnd)
            message.metadata.__dict__["_dst_node_id"] = node
            reply = app(message, contexts[node])
            assert not reply.has_error(), reply.error
            contexts[node] = next_process(contexts[node])
    assert trainer_fn.built == 2
    assert len(process_participants()) == 2


def test_participants_are_kept_by_size_least_recently_used_out() -> None:
    live = LiveParticipants(capacity_bytes=100)
    live.keep("a", "ta", "A", 40)
    live.keep("b", "tb", "B", 40)
    assert live.take("a", "ta") == "A"  # handed out once ...
    assert live.take("a", "ta") is None  # ... and not kept until kept again
    live.keep("a", "ta2", "A", 40)  # now b is the least recently used
    live.keep("c", "tc", "C", 40)
    assert len(live) == 2 and live.size == 80
    assert live.take("b", "tb") is None
    assert live.take("c", "wrong token") is None  # and c is no longer kept
    assert live.take("a", "ta2") == "A"
    live.keep("big", "t", "BIG", 101)  # larger than the capacity: not kept
    assert len(live) == 0 and live.size == 0  # the running total follows every take
    none = LiveParticipants(capacity_bytes=0)
    none.keep("a", "t", "A", 0 + 1)
    assert none.take("a", "t") is None
    for bad in (lambda: LiveParticipants(capacity_bytes=-1), lambda: process_participants(-1)):
        with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
            bad()


def test_copies_of_an_app_share_the_participants_of_their_process() -> None:
    """The simulation engine hands its actors a new copy of the ClientApp (cloudpickled,
    closures by value) with every message; a copy carries none of the kept participants."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    app = app_for(Counting())
    context = new_context()
    sizes = []
    for rnd in range(3):
        data = cloudpickle.dumps(app)
        sizes.append(len(data))
        copy = cloudpickle.loads(data)
        assert not copy(train_message(rnd), context).has_error()
        context = next_process(context)
    assert process_participants().hits == 2
    assert sizes[0] == sizes[1] == sizes[2]  # what is kept does not travel with the app


def test_a_participants_size_counts_its_state_and_its_model() -> None:
    trainer = ToyTrainer(1)
    model_bytes = sum(t.nbytes for t in trainer.model.state_dict().values())
    arrays = {"x": np.zeros(10, np.float32)}
    assert size_of(arrays, trainer) == 40 + model_bytes
    assert size_of(arrays, object()) == 40
