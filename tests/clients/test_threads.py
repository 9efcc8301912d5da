"""torch's intra-op threads where participants share a machine (clients/threads.py): one
by default, what LENSEMBLE_TORCH_THREADS says otherwise, and a bad value refused before
anything is set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from lensemble_flwr.clients.threads import THREADS_ENV, torch_threads, use_torch_threads
from lensemble_flwr.errors import ConfigError
from tests.strategies.test_records import _serverapp_identity  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_participants_that_share_a_machine_get_one_thread_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert torch_threads() == 1
    assert torch_threads(10) == 1
    assert torch_threads(1) is None  # alone on the machine: torch's default
    torch.set_num_threads(2)
    assert use_torch_threads() == 1 == torch.get_num_threads()


@pytest.mark.parametrize(("value", "expected"), [("3", 3), (" 2 ", 2), ("1", 1), ("0", None)])
def test_the_environment_variable_decides(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: int | None
) -> None:
    monkeypatch.setenv(THREADS_ENV, value)
    assert torch_threads() == expected
    assert torch_threads(1) == expected  # also for a participant alone on its machine


def test_zero_leaves_torchs_own_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(THREADS_ENV, "0")
    torch.set_num_threads(2)
    assert use_torch_threads() == 2 == torch.get_num_threads()


@pytest.mark.parametrize("value", ["-1", "two", "1.5", "1e3"])
def test_a_value_that_is_not_a_thread_count_is_refused_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(THREADS_ENV, value)
    torch.set_num_threads(2)
    with pytest.raises(ConfigError, match=THREADS_ENV):
        use_torch_threads()
    assert torch.get_num_threads() == 2


def test_fewer_than_one_participant_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    with pytest.raises(ConfigError, match="participants_here"):
        torch_threads(0)


def test_a_clientapp_trains_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The train handler sets the threads in whatever process runs it (an actor of the
    simulation engine gets the app pickled: nothing at build time runs there)."""
    from lensemble_flwr.clients import app as client_app_module

    monkeypatch.delenv(THREADS_ENV, raising=False)
    calls: list[int] = []
    monkeypatch.setattr(client_app_module, "use_torch_threads", lambda: calls.append(1) or 1)
    app = client_app_module.make_client_app(lambda context: None)  # type: ignore[arg-type,return-value]

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    message = Message(RecordDict(), dst_node_id=1, message_type="train")
    reply = app(message, context)  # an empty instruction: refused, after the threads were set
    assert reply.has_error() and calls == [1]
