"""Tests of the frozen federation config: defaults, validation, run_config round trip."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lensemble_flwr.config import (
    NAMESPACE,
    AggregationConfig,
    FederationConfig,
    LensembleConfig,
    OuterOptimizerConfig,
    ParamGroupsConfig,
    run_config_keys,
)
from lensemble_flwr.errors import ConfigError


def test_defaults() -> None:
    cfg = LensembleConfig()
    assert cfg.outer.lr == 0.7
    assert cfg.outer.momentum == 0.9
    assert cfg.outer.nesterov is True
    assert cfg.groups.shared == ("*",)  # a model that declares no groups federates it all
    assert cfg.groups.local == ()


@pytest.mark.parametrize(
    ("min_participants", "secagg_threshold", "quorum"),
    [(2, 0, 2), (3, 5, 5), (4, 4, 4), (7, 2, 7)],
)
def test_quorum_is_max_of_min_participants_and_secagg_threshold(
    min_participants: int, secagg_threshold: int, quorum: int
) -> None:
    fed = FederationConfig(min_participants=min_participants, secagg_threshold=secagg_threshold)
    assert fed.quorum == quorum


def test_config_is_frozen() -> None:
    cfg = LensembleConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.outer.lr = 0.1  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        cfg.outer = OuterOptimizerConfig(lr=0.1)  # type: ignore[misc]
    assert cfg.outer.lr == 0.7


def test_bad_nested_value_from_python_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"min_participants") as info:
        LensembleConfig(federation={"min_participants": 0})
    assert info.value.field.endswith("min_participants")


def test_bad_value_in_section_constructed_directly_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^FederationConfig\.min_participants: ") as info:
        FederationConfig(min_participants=0)
    assert info.value.field == "FederationConfig.min_participants"
    with pytest.raises(ConfigError, match=r"^OuterOptimizerConfig\.momentum: "):
        OuterOptimizerConfig(momentum=1.0)


def test_unknown_field_from_python_is_refused() -> None:
    with pytest.raises(ConfigError, match="no_such_field"):
        OuterOptimizerConfig(no_such_field=1)  # type: ignore[call-arg]


def test_bad_value_from_run_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^outer-lr: ") as info:
        LensembleConfig.from_flat({"outer-lr": -1})
    assert info.value.field == "outer-lr"
    with pytest.raises(ConfigError, match=r"^min-participants: "):
        LensembleConfig.from_flat({"min-participants": 0})


def test_unknown_run_config_key_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"^outer-lrr: unknown") as info:
        LensembleConfig.from_flat({"outer-lr": 0.5, "outer-lrr": 0.5})
    assert info.value.field == "outer-lrr"


def test_the_apps_own_keys_are_left_alone_and_lensemble_reads_its_namespace() -> None:
    cfg = LensembleConfig.from_run_config(
        {"num-server-rounds": 3, "fraction-train": 0.5, "lr": 0.1, "lensemble.outer-lr": 0.5}
    )
    assert cfg == LensembleConfig(outer={"lr": 0.5})
    assert LensembleConfig.from_run_config({"num-server-rounds": 3}) == LensembleConfig()


def test_an_unknown_key_in_the_namespace_is_refused_with_a_suggestion() -> None:
    suggestion = r"^lensemble\.outer-lrr: .*did you mean 'lensemble\.outer-lr'"
    with pytest.raises(ConfigError, match=suggestion):
        LensembleConfig.from_run_config({"lensemble.outer-lrr": 0.5})
    with pytest.raises(ConfigError, match=r"^lensemble\.outer-lr: ") as info:
        LensembleConfig.from_run_config({"lensemble.outer-lr": -1})
    assert info.value.field == "lensemble.outer-lr"


def test_a_lensemble_key_outside_the_namespace_is_not_read_and_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", logger="lensemble_flwr.config"):
        cfg = LensembleConfig.from_run_config({"outer-lr": 0.5})
    assert cfg == LensembleConfig()
    assert "lensemble.outer-lr" in caplog.text


@pytest.mark.parametrize("app_value", [0.5, -1.0, "text", True])
def test_an_app_key_that_shares_a_lensemble_name_is_neither_read_nor_checked(
    app_value: object, caplog: pytest.LogCaptureFixture
) -> None:
    """Flower's fl-dp-sa declares noise-multiplier for its own DP wrapper: only
    lensemble.noise-multiplier is lensemble's, and the app's value (even one lensemble
    would refuse) stops nothing."""
    with caplog.at_level("INFO", logger="lensemble_flwr.config"):
        cfg = LensembleConfig.from_run_config(
            {"noise-multiplier": app_value, "lensemble.noise-multiplier": 0, "clip-norm": 2.0}
        )
    assert cfg.privacy.noise_multiplier == 0 and cfg.privacy.clip_norm == 0
    assert [r.levelname for r in caplog.records] == ["INFO"]
    with pytest.raises(ConfigError, match=r"^lensemble\.noise-multiplier: "):
        LensembleConfig.from_run_config({"noise-multiplier": 0.5, "lensemble.noise-multiplier": -1})


@pytest.mark.parametrize(
    ("min_participants", "secagg_threshold", "set_by", "reason"),
    [
        (2, 3, ("secagg-threshold",), "K = 3 is set by lensemble.secagg-threshold "
         "(min-participants is 2)"),
        (4, 3, ("min-participants",), "K = 4 is set by lensemble.min-participants "
         "(secagg-threshold is 3)"),
        (3, 3, ("min-participants", "secagg-threshold"), "K = 3 is set by both "
         "lensemble.min-participants and lensemble.secagg-threshold"),
    ],
)  # fmt: skip
def test_the_quorum_names_the_key_that_sets_it(
    min_participants: int, secagg_threshold: int, set_by: tuple[str, ...], reason: str
) -> None:
    fed = FederationConfig(min_participants=min_participants, secagg_threshold=secagg_threshold)
    assert fed.quorum_set_by == set_by
    assert fed.quorum_reason("lensemble.") == reason


def test_the_namespaced_run_config_round_trips() -> None:
    config = LensembleConfig(outer={"lr": 0.5}, federation={"min_participants": 4})
    run_config = config.to_run_config()
    assert all(key.startswith(NAMESPACE) for key in run_config)
    assert LensembleConfig.from_run_config({**run_config, "num-server-rounds": 2}) == config


def test_a_nested_pyproject_table_flattens_into_the_namespace() -> None:
    from flwr.common.config import flatten_dict

    table = {"num-server-rounds": 2, "lensemble": {"min-participants": 5, "outer-lr": 1.0}}
    config = LensembleConfig.from_run_config(flatten_dict(table))
    assert config.federation.min_participants == 5 and config.outer.lr == 1.0


def test_group_lists_are_comma_separated() -> None:
    cfg = LensembleConfig.from_flat(
        {"shared-groups": "encoder, predictor,,projector ", "local-groups": "action_head"}
    )
    assert cfg.groups.shared == ("encoder", "predictor", "projector")
    assert cfg.groups.local == ("action_head",)
    assert ParamGroupsConfig(shared="a,b", local="").local == ()


def test_run_config_round_trip_equals_original() -> None:
    original = LensembleConfig(
        federation={
            "min_participants": 3,
            "secagg_threshold": 4,
            "weighting": "num-examples",
            "root_seed": 17,
            "open_timeout": 1.5,
        },
        aggregation={"fraction_bits": 24, "max_abs_update": 8.0, "fold_batch": 3},
        inner={"steps": 5, "lr": 3e-4, "deterministic": False},
        outer={"lr": 0.5, "momentum": 0.8, "nesterov": False},
        groups={"shared": ("encoder", "head.proj"), "local": ()},
    )
    flat = original.to_flat()
    assert set(flat) == set(run_config_keys())
    assert flat["shared-groups"] == "encoder,head.proj"
    assert all(isinstance(v, str | int | float | bool) for v in flat.values())
    restored = LensembleConfig.from_flat(flat)
    assert restored == original
    assert restored != LensembleConfig()
    assert LensembleConfig.from_flat(LensembleConfig().to_flat()) == LensembleConfig()


def test_shared_and_local_overlap_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"both shared and local: \['b'\]"):
        ParamGroupsConfig(shared=("a", "b"), local=("b",))
    with pytest.raises(ConfigError, match="both shared and local"):
        LensembleConfig.from_flat({"shared-groups": "a", "local-groups": "a"})


def test_star_is_refused_in_local_and_shared_must_be_non_empty() -> None:
    with pytest.raises(ConfigError, match=r"'\*' is only meaningful in shared"):
        ParamGroupsConfig(shared=("encoder",), local=("*",))
    with pytest.raises(ConfigError, match="shared must name at least one group"):
        ParamGroupsConfig(shared="")


def test_fixed_point_capacity_check_is_refused() -> None:
    # 2**20 * 4 * 2**40 == 2**62: one update would not fit the int64 accumulator.
    with pytest.raises(ConfigError, match=r"^AggregationConfig: .*below 2\*\*62"):
        AggregationConfig(fraction_bits=40, max_abs_update=2.0**20, max_weight=4)
    with pytest.raises(ConfigError, match=r"below 2\*\*62"):
        LensembleConfig.from_flat({"fraction-bits": 40, "max-abs-update": 2.0**20, "max-weight": 4})
    # One step below the limit is accepted.
    ok = AggregationConfig(fraction_bits=40, max_abs_update=2.0**20, max_weight=3)
    assert ok.max_weight == 3


def test_the_neighbour_graph_degree_must_be_even() -> None:
    assert LensembleConfig(federation={"secagg_neighbours": 4}).federation.secagg_neighbours == 4
    with pytest.raises(ConfigError, match="secagg-neighbours"):
        LensembleConfig.from_flat({"secagg-neighbours": 3})
    with pytest.raises(ConfigError, match="secagg_neighbours"):
        LensembleConfig(federation={"secagg_neighbours": -2})


@pytest.mark.parametrize(
    ("key", "value", "complaint"),
    [
        ("open-timeout", float("inf"), "finite"),  # a round that waits forever
        ("collect-timeout", float("nan"), "finite"),
        ("retry-wait", float("inf"), "finite"),
        ("dp-epsilon", float("inf"), "finite"),  # a budget that is none
        ("min-participants", True, "expected a number"),  # used to become K = 1
        ("require-signatures", "yes", "expected true or false"),
        ("require-binding", 1, "expected true or false"),
        ("inner-steps", 2.5, "whole number"),
        ("outer-lr", "0.7", "expected a number"),
    ],
)
def test_a_value_that_is_only_half_right_is_refused_naming_its_key(
    key: str, value: object, complaint: str
) -> None:
    with pytest.raises(ConfigError, match=complaint) as refused:
        LensembleConfig.from_flat({key: value})
    assert refused.value.field == key


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "require-binding",
            "false",
            "expected true or false (text: write it unquoted) (got 'false')",
        ),
        ("outer-lr", "fast", "expected a number (text: write it unquoted) (got 'fast')"),
        ("inner-steps", 2.5, "expected a whole number (got 2.5)"),
    ],
)
def test_a_wrong_value_is_quoted_once_and_text_is_called_text(
    key: str, value: object, message: str
) -> None:
    """A string where a flag or a number belongs (``--run-config "lensemble.x='false'"``) is
    told apart from a wrong flag, and the value is quoted once."""
    with pytest.raises(ConfigError) as refused:
        LensembleConfig.from_flat({key: value})
    assert str(refused.value).endswith(message) and str(refused.value).count(repr(value)) == 1


def test_whole_floats_and_ints_for_floats_are_numbers() -> None:
    config = LensembleConfig.from_flat(
        {"min-participants": 3.0, "open-timeout": 30, "require-binding": True}
    )
    assert config.federation.min_participants == 3 and config.federation.open_timeout == 30.0


_NOISED = {"clip_norm": 1.0, "noise_multiplier": 1.0, "dp_epsilon": 8.0}


def test_the_outer_step_left_to_lensemble_is_the_measured_one_under_dp() -> None:
    """docs/privacy.md, *The outer step under DP*: an outer step nobody set is 0.7 / 0.9
    without noise and 0.7 / 0.5 with it; one the user set is kept, under DP too."""
    from lensemble_flwr.config import DP_OUTER_STEP, LensembleConfig

    assert (LensembleConfig().outer.lr, LensembleConfig().outer.momentum) == (0.7, 0.9)
    private = LensembleConfig(privacy=_NOISED)
    assert (private.outer.lr, private.outer.momentum) == (DP_OUTER_STEP["lr"], 0.5)
    kept = LensembleConfig(outer={"lr": 1.0, "momentum": 0.0}, privacy=_NOISED)
    assert (kept.outer.lr, kept.outer.momentum) == (1.0, 0.0)
    half = LensembleConfig(outer={"momentum": 0.9}, privacy=_NOISED)
    assert half.outer.momentum == 0.9  # set: kept
    calibrated = LensembleConfig(privacy={"clip_norm": 1.0, "dp_epsilon": 8.0, "dp_rounds": 5})
    assert calibrated.outer.momentum == 0.5  # a calibrated plan is noised too
    assert LensembleConfig(privacy={"clip_norm": 1.0}).outer.momentum == 0.9  # clip only
    assert LensembleConfig.from_flat(private.to_flat()) == private


def test_auto_in_a_run_config_is_the_step_left_to_lensemble() -> None:
    """A Flower app lists every key (so that --run-config can set it): "auto" says unset."""
    from lensemble_flwr.config import LensembleConfig

    auto = {"lensemble.outer-lr": "auto", "lensemble.outer-momentum": "auto"}
    assert LensembleConfig.from_run_config(auto).outer.momentum == 0.9
    private = LensembleConfig.from_run_config(
        {**auto, "lensemble.clip-norm": 1.0, "lensemble.dp-epsilon": 8.0,
         "lensemble.dp-rounds": 5}
    )  # fmt: skip
    assert (private.outer.lr, private.outer.momentum) == (0.7, 0.5)
    with pytest.raises(ConfigError, match=r"lensemble\.outer-momentum"):
        LensembleConfig.from_run_config({"lensemble.outer-momentum": "automatic"})
