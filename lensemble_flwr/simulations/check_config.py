"""Check a Flower App's run config before any engine starts: the pre-flight of ``flwr run``.

    python -m lensemble_flwr.simulations.check_config APP_DIR --run-config "lensemble.outer-lr=0.5"

reads the app's ``pyproject.toml`` ``[tool.flwr.app.config]`` and the ``--run-config``
overrides with Flower's own functions (``parse_config_args``, ``flatten_dict``,
``fuse_dicts``: the same parsing and merge as ``flwr run`` and the ServerApp), then says

* which override the app does not declare (Flower refuses the run with only "Invalid run
  configuration"), with the declared or lensemble key it most likely meant;
* which ``lensemble.`` value lensemble refuses, and why (what the ServerApp would stop on).

Exit codes as the ``lensemble-flwr`` command's: 0 the run config is good, 1 it is not (one
line per problem), 2 no app there. ``./dev.sh main`` runs it first, with its arguments.
Only ``lensemble.``-prefixed keys are lensemble's; the app's other keys are checked for
being declared, never for their values (lensemble does not know what they mean).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.common.config import (
    flatten_dict,
    fuse_dicts,
    get_project_config,
    parse_config_args,
)

from lensemble_flwr.config import (
    NAMESPACE,
    LensembleConfig,
    closest_key,
    protects,
    run_config_keys,
)
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.privacy.calibration import noise_multiplier_of

TABLE = "[tool.flwr.app.config]"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
"""The ``lensemble-flwr`` command's exit codes (``lensemble_flwr.cli.output``; not
imported from there, whose package loads torch: the check stays well under a second)."""


class NoApp(Exception):
    """``APP_DIR`` holds no ``pyproject.toml`` that Flower accepts (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class RunConfigCheck:
    """What the pre-flight found: the run config the ServerApp would get (``run_config``),
    the problems that would stop the run (``errors``) and notes that would not."""

    run_config: dict[str, Any]
    errors: tuple[ConfigError, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether the run config would be accepted (by Flower and by lensemble)."""
        return not self.errors


def declared_config(app_dir: Path) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]``, flattened as Flower flattens it
    (``lensemble.<key>`` for the keys of its lensemble table).

    Raises:
        NoApp: no ``pyproject.toml`` in ``app_dir``, or one Flower refuses.
    """
    try:
        project = get_project_config(app_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise NoApp(f"{app_dir}: {exc}") from None
    return flatten_dict(project["tool"]["flwr"]["app"].get("config", {}))


def parse_run_config(values: Sequence[str]) -> dict[str, Any]:
    """The ``--run-config`` values as ``flwr run`` reads them (``key=value`` pairs, or
    one TOML file).

    Raises:
        ConfigError: a value Flower cannot parse (field ``--run-config``).
    """
    try:
        return parse_config_args(list(values))
    except Exception as exc:  # click's ClickException (a bad pair), ValueError, OSError
        raise ConfigError("--run-config", str(exc)) from None


def dropped_by_flower(values: Sequence[str]) -> list[ConfigError]:
    """An error for each override Flower would drop: it merges ``--run-config`` values
    table by table, so a later value that sets a key of the ``lensemble`` table replaces
    every ``lensemble.`` key an earlier value set."""
    if len(values) < 2:
        return []
    kept = parse_run_config(values)
    given: dict[str, Any] = {}
    for value in values:
        given.update(parse_run_config([value]))
    return [
        ConfigError(
            key,
            "Flower drops this override: a later --run-config value sets other keys of "
            "its table, which replaces the whole table; give them in one --run-config value",
        )
        for key in given
        if key not in kept
    ]


def undeclared(overrides: Mapping[str, Any], declared: Mapping[str, Any]) -> list[ConfigError]:
    """An error for each override the app does not declare, with the key it most likely
    meant (among the declared keys and lensemble's)."""
    lensemble_keys = {NAMESPACE + key for key in run_config_keys()}
    errors = []
    for key in overrides:
        if key in declared:
            continue
        if key in lensemble_keys:
            reason = (
                f"a lensemble key this app does not declare: add {key[len(NAMESPACE) :]!r} "
                f"to its [tool.flwr.app.config.lensemble] table to set it from --run-config "
                "(Flower refuses keys an app does not declare)"
            )
        else:
            close = closest_key(key, [*declared, *lensemble_keys])
            hint = f"; did you mean {close!r}?" if close else ""
            reason = (
                f"not a key of this app's {TABLE} (Flower would refuse the run with "
                f"'Invalid run configuration'){hint}"
            )
        errors.append(ConfigError(key, reason))
    return errors


def same_name_notes(run_config: Mapping[str, Any]) -> list[str]:
    """A note for each app key that shares a name with a key lensemble protects releases
    with (``noise-multiplier``): it is the app's, and lensemble does not read it."""
    defaults = LensembleConfig().to_flat()
    return [
        f"{key}: the app's own key; lensemble reads {NAMESPACE}{key} "
        f"(= {run_config.get(NAMESPACE + key, defaults[key])!r}) for its own releases"
        for key in sorted(run_config)
        if key in run_config_keys() and protects(key)
    ]


def check_run_config(app_dir: Path, run_config_args: Sequence[str]) -> RunConfigCheck:
    """Check ``--run-config`` values (``run_config_args``) against the app in ``app_dir``.

    Raises:
        NoApp: no app there.
    """
    declared = declared_config(app_dir)
    try:
        overrides = parse_run_config(run_config_args) if run_config_args else {}
        errors = dropped_by_flower(run_config_args)
    except ConfigError as exc:
        return RunConfigCheck(dict(declared), (exc,), ())
    errors += undeclared(overrides, declared)
    fused = fuse_dicts(declared, overrides, check_keys=False)  # what Flower merges
    try:
        config = LensembleConfig.from_run_config(fused)
        # the DP plan the ServerApp checks first: it fits the budget and the run's rounds
        rounds = fused.get("num-server-rounds")
        noise_multiplier_of(config, rounds=rounds if isinstance(rounds, int) else None)
    except ConfigError as exc:
        errors.append(exc)
    return RunConfigCheck(fused, tuple(errors), tuple(same_name_notes(fused)))


def run_config_args_of(flwr_run_args: Sequence[str]) -> list[str]:
    """The ``--run-config`` values among ``flwr run``'s arguments (``--run-config X``,
    ``--run-config=X``, ``-c X``, ``-cX``), in order."""
    values: list[str] = []
    args = list(flwr_run_args)
    for i, arg in enumerate(args):
        if arg in ("--run-config", "-c") and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith("--run-config="):
            values.append(arg.split("=", 1)[1])
        elif arg.startswith("-c") and len(arg) > 2 and not arg.startswith("--"):
            values.append(arg[2:])
    return values


def build_parser() -> argparse.ArgumentParser:
    """The pre-flight's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m lensemble_flwr.simulations.check_config",
        description="Check a Flower App's run config (its pyproject.toml and --run-config "
        "overrides) before `flwr run` starts anything.",
    )
    parser.add_argument("app_dir", metavar="APP_DIR", nargs="?", default=".", type=Path)
    parser.add_argument(
        "--run-config", "-c", action="append", default=[], help="as `flwr run` takes it"
    )
    parser.add_argument(
        "--flwr-run-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest are `flwr run`'s arguments: their --run-config values are checked",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Check, print one line per problem or note (on stderr), and return the exit code."""
    args = build_parser().parse_args(argv)
    values = [*args.run_config, *run_config_args_of(args.flwr_run_args)]
    try:
        check = check_run_config(args.app_dir, values)
    except NoApp as exc:
        print(f"check-config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for note in check.notes:
        print(f"check-config: note: {note}", file=sys.stderr)
    for error in check.errors:
        print(f"check-config: {error}", file=sys.stderr)
    if not check.ok:
        print(
            f"check-config: the run config of {args.app_dir} is refused; nothing was started",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
