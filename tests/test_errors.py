"""Tests of the error taxonomy and its response table."""

from __future__ import annotations

import pytest

from lensemble_flwr import errors
from lensemble_flwr.errors import (
    RESPONSES,
    CheckpointIntegrityError,
    CommitmentMismatch,
    ConfigError,
    DegenerateProcrustes,
    FaultToleranceExceeded,
    GaugeError,
    IllegalTransition,
    LensembleError,
    NonDeterministicAggregation,
    ParameterMismatch,
    PrivacyBudgetExceeded,
    ProbeError,
    ResidencyViolation,
    Response,
    RoundError,
    SecureAggregationError,
    response_to,
)

# The spec's twelve error classes and the response each one gets.
TAXONOMY: dict[str, Response] = {
    "RoundError": Response.REJECT_MESSAGE,
    "FaultToleranceExceeded": Response.RETRY_ROUND,
    "SecureAggregationError": Response.RETRY_ROUND,
    "NonDeterministicAggregation": Response.STOP_FEDERATION,
    "PrivacyBudgetExceeded": Response.STOP_FEDERATION,
    "CommitmentMismatch": Response.STOP_FEDERATION,
    "CheckpointIntegrityError": Response.STOP_FEDERATION,
    "ResidencyViolation": Response.STOP_FEDERATION,
    "ConfigError": Response.STOP_FEDERATION,
    "ProbeError": Response.REFUSE_RELEASE,
    "GaugeError": Response.REFUSE_RELEASE,
    "DegenerateProcrustes": Response.REFUSE_RELEASE,
}


def _instance(cls: type[LensembleError]) -> LensembleError:
    return cls("field", "reason") if cls is ConfigError else cls("boom")


def test_taxonomy_has_twelve_classes_deriving_from_lensemble_error() -> None:
    assert len(TAXONOMY) == 12
    for name in TAXONOMY:
        cls = getattr(errors, name)
        assert isinstance(cls, type)
        assert issubclass(cls, LensembleError), name
        assert cls is not LensembleError


@pytest.mark.parametrize(("name", "response"), sorted(TAXONOMY.items()))
def test_response_to_each_taxonomy_class(name: str, response: Response) -> None:
    cls = getattr(errors, name)
    assert response_to(_instance(cls)) is response


@pytest.mark.parametrize(
    ("cls", "response"),
    [
        (FaultToleranceExceeded, Response.RETRY_ROUND),
        (SecureAggregationError, Response.RETRY_ROUND),
        (PrivacyBudgetExceeded, Response.STOP_FEDERATION),
        (CommitmentMismatch, Response.STOP_FEDERATION),
        (NonDeterministicAggregation, Response.STOP_FEDERATION),
        (RoundError, Response.REJECT_MESSAGE),
        (ProbeError, Response.REFUSE_RELEASE),
        (GaugeError, Response.REFUSE_RELEASE),
        (DegenerateProcrustes, Response.REFUSE_RELEASE),
        (CheckpointIntegrityError, Response.STOP_FEDERATION),
        (ResidencyViolation, Response.STOP_FEDERATION),
    ],
)
def test_spec_responses(cls: type[LensembleError], response: Response) -> None:
    assert response_to(cls("x")) is response


@pytest.mark.parametrize("cls", [IllegalTransition, ParameterMismatch])
def test_subclasses_inherit_the_response_of_round_error(cls: type[RoundError]) -> None:
    assert issubclass(cls, RoundError)
    assert cls not in RESPONSES  # the response really is inherited, not listed
    assert response_to(cls("x")) is Response.REJECT_MESSAGE


def test_a_new_subclass_inherits_its_nearest_listed_ancestor() -> None:
    class LateProbe(ProbeError):
        pass

    class LateRetry(FaultToleranceExceeded):
        pass

    assert response_to(LateProbe("x")) is Response.REFUSE_RELEASE
    assert response_to(LateRetry("x")) is Response.RETRY_ROUND


def test_every_listed_class_is_a_lensemble_error() -> None:
    for cls, response in RESPONSES.items():
        assert issubclass(cls, LensembleError)
        assert isinstance(response, Response)


@pytest.mark.parametrize(
    "error", [ValueError("x"), KeyError("x"), RuntimeError("x"), KeyboardInterrupt()]
)
def test_non_lensemble_exceptions_stop_the_federation(error: BaseException) -> None:
    assert response_to(error) is Response.STOP_FEDERATION


def test_bare_lensemble_error_stops_the_federation() -> None:
    assert response_to(LensembleError("x")) is Response.STOP_FEDERATION


def test_config_error_names_the_field_and_is_not_a_value_error() -> None:
    err = ConfigError("outer-lr", "must be positive")
    assert str(err) == "outer-lr: must be positive"
    assert (err.field, err.reason) == ("outer-lr", "must be positive")
    assert not isinstance(err, ValueError)


def test_response_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        RESPONSES[ProbeError] = Response.STOP_FEDERATION  # type: ignore[index]


def test_an_error_a_participant_reports_is_rebuilt_for_the_table() -> None:
    from lensemble_flwr.errors import (
        ConfigError,
        PrivacyBudgetExceeded,
        ProbeError,
        Response,
        reported,
        response_to,
    )

    spent = reported("PrivacyBudgetExceeded", "p1: budget spent")
    assert isinstance(spent, PrivacyBudgetExceeded) and str(spent) == "p1: budget spent"
    assert response_to(spent) is Response.STOP_FEDERATION
    assert response_to(reported("ProbeError", "x")) is Response.REFUSE_RELEASE
    assert isinstance(reported("ProbeError", "x"), ProbeError)
    assert isinstance(reported("ConfigError", "bad"), ConfigError)
    assert reported("ValueError", "not ours") is None
    assert reported("Exception", "not ours") is None
