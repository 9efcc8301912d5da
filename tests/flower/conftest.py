"""The locked-down deployment of test_deployment_auth.py, started once per session.

test_deployment.py's runs ask for it first, so that it comes up and runs beside them (a
deployment mostly waits on Flower's polls); test_deployment_auth.py asserts on what it
showed. Alone, test_deployment_auth.py starts it and waits for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.flower.test_deployment_auth import LockedDown, LockedDownThread


@pytest.fixture(scope="session")
def locked_down_started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LockedDownThread]:
    """The locked-down deployment, under way in a thread of its own; the session waits
    for it to stop its processes, whether or not a test looked at it."""
    # imported here: the module skips itself where the Flower CLIs are missing
    from tests.flower.test_deployment_auth import LockedDownThread

    started = LockedDownThread(tmp_path_factory.mktemp("locked-down"))
    yield started
    started.result()


@pytest.fixture(scope="session")
def locked_down(locked_down_started: LockedDownThread) -> LockedDown:
    """What the locked-down deployment showed, once it has stopped."""
    return locked_down_started.result()
