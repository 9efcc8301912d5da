"""``lensemble-flwr report``'s figure and summary: every series the run recorded (the
server's, the federated evaluation's and the train replies' metrics from round-metrics.jsonl,
round 0 included, and the ledger's), one labelled panel per family, rounds with aborted
attempts marked; and the round-metrics file itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lensemble_flwr.cli.figure import (
    ABORTED,
    SAME_AS_LEDGER,
    metric_panels,
    readable,
)
from lensemble_flwr.cli.report import render_figure, render_markdown, write_report
from lensemble_flwr.errors import ConfigError
from lensemble_flwr.provenance.round_metrics import (
    METRICS_NAME,
    append_round_metrics,
    read_round_metrics,
    write_round_metrics,
)
from lensemble_flwr.provenance.summary import summarize_run

METRICS = {
    r: {
        "train": {"last-batch-loss": 1.0 / r, "lensemble.C_t": 2.0},
        "evaluate": {
            "global-train-loss": 0.9 / r,
            "global-val-loss": 1.1 / r,
            "accuracy": 0.5 + 0.1 * r,
            "bad": float("nan"),
        },
    }
    for r in (1, 2, 3)
}


def test_round_metrics_round_trip_and_drop_what_is_not_a_finite_number(tmp_path: Path) -> None:
    write_round_metrics(tmp_path, METRICS)
    back = read_round_metrics(tmp_path)
    assert sorted(back) == [1, 2, 3]
    assert back[2]["evaluate"]["global-val-loss"] == pytest.approx(0.55)
    assert "bad" not in back[1]["evaluate"]
    assert read_round_metrics(tmp_path / "none") == {}
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_NAME]  # no temp file left


@pytest.mark.parametrize("durable", [True, False])
def test_round_metrics_are_fsynced_only_when_the_run_writes_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    import os

    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    write_round_metrics(tmp_path, METRICS, durable=durable)
    assert len(synced) == (2 if durable else 0)  # the file and its folder, or neither
    assert sorted(read_round_metrics(tmp_path)) == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == [METRICS_NAME]


def test_the_server_evaluation_is_a_kind_of_its_own_written_only_when_there_is_one(
    tmp_path: Path,
) -> None:
    """A run without an evaluate_fn writes the lines it always wrote (train and evaluate);
    one with it adds ``server``, round 0 (the initial model) included."""
    append_round_metrics(tmp_path, 0, {"server": {"loss": 2.3, "bad": float("inf")}}, durable=False)
    append_round_metrics(tmp_path, 1, {"train": {"loss": 1.0}}, durable=False)
    lines = (tmp_path / METRICS_NAME).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"round": 0, "train": {}, "evaluate": {}, "server": {"loss": 2.3}},
        {"round": 1, "train": {"loss": 1.0}, "evaluate": {}},
    ]
    back = read_round_metrics(tmp_path)
    assert back[0]["server"] == {"loss": 2.3} and "server" not in back[1]


def test_a_broken_round_metrics_file_is_refused(tmp_path: Path) -> None:
    for broken in (
        json.dumps({"rounds": {"x": {}}}),  # no round number
        json.dumps({"round": "1", "train": {}}),
        json.dumps({"round": True, "train": {}}),
        json.dumps({"round": 1, "train": {"loss": "high"}}),
        json.dumps([1, 2]),
        "not json",
    ):
        (tmp_path / METRICS_NAME).write_text(json.dumps({"round": 1}) + "\n" + broken + "\n")
        with pytest.raises(ConfigError, match=f"{METRICS_NAME} line 2"):
            read_round_metrics(tmp_path)


def test_each_round_appends_one_line_and_a_reported_round_keeps_its_last(
    tmp_path: Path,
) -> None:
    for r in (1, 2, 3):
        append_round_metrics(tmp_path, r, METRICS[r], durable=False)
    path = tmp_path / METRICS_NAME
    assert path.read_bytes().count(b"\n") == 3
    assert read_round_metrics(tmp_path) == read_round_metrics_of(METRICS, tmp_path / "whole")
    # a resumed run reports round 3 again: the last line wins
    append_round_metrics(tmp_path, 3, {"train": {"loss": 0.1}}, durable=False)
    assert read_round_metrics(tmp_path)[3] == {"train": {"loss": 0.1}, "evaluate": {}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_NAME, "whole"]


def read_round_metrics_of(metrics: dict, folder: Path) -> dict:
    write_round_metrics(folder, metrics, durable=False)
    return read_round_metrics(folder)


def test_a_line_a_killed_writer_left_unfinished_is_skipped_then_cut_off(
    tmp_path: Path,
) -> None:
    append_round_metrics(tmp_path, 1, METRICS[1], durable=False)
    append_round_metrics(tmp_path, 2, METRICS[2], durable=False)
    path = tmp_path / METRICS_NAME
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # round 2's line, torn
    assert sorted(read_round_metrics(tmp_path)) == [1]
    append_round_metrics(tmp_path, 2, METRICS[2], durable=False)  # cuts the torn line off
    assert path.read_bytes() == whole
    path.write_bytes(b'{"round": 1, "tr')  # a first line, torn: no line at all
    assert read_round_metrics(tmp_path) == {}
    append_round_metrics(tmp_path, 1, METRICS[1], durable=False)
    assert sorted(read_round_metrics(tmp_path)) == [1]


@pytest.mark.parametrize("durable", [True, False])
def test_an_append_is_fsynced_only_when_the_run_writes_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    import os

    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    append_round_metrics(tmp_path, 1, METRICS[1], durable=durable)
    assert len(synced) == (2 if durable else 0)  # a new file: the file and its folder
    append_round_metrics(tmp_path, 2, METRICS[2], durable=durable)
    assert len(synced) == (3 if durable else 0)  # then the file only


RECORDED = {  # what a run with an evaluate_fn, federated evaluation and start's loop writes
    0: {"train": {}, "evaluate": {}, "server": {"loss": 2.3, "accuracy": 0.1}},
    **{
        r: {
            "train": {
                "last-batch-loss": 1.0 / r,
                "lensemble.C_t": 4.0,
                "lensemble.attempts": 1.0 + (r == 2),
                "lensemble.aborted-attempts": float(r == 2),
                "lensemble.seconds": 1.5 * r,
                "lensemble.late": 0.0,
                "lensemble.rejected": 0.0,
                "lensemble.refused": 0.0,
                "lensemble.exchanges": 8.0,
                "lensemble.bytes-sent": 2e6,
                "lensemble.bytes-received": 1e6,
                "lensemble.frame-drift": 0.01,
                "lensemble.new-counter": 3.0,  # bookkeeping this version does not know
            },
            "evaluate": {"loss": 2.0 / r, "accuracy": 0.3 + 0.1 * r, "f1_macro": 0.2 * r},
            "server": {"loss": 2.1 / r, "accuracy": 0.25 + 0.1 * r},
        }
        for r in (1, 2, 3)
    },
}


def drawn_series(fig: Any) -> set[str]:
    return {s for ax in fig.axes for line in ax.get_lines() for s in (line.get_gid() or "").split()}


def test_the_report_draws_every_metric_the_run_recorded(run: Path) -> None:
    write_round_metrics(run, RECORDED)
    summary = summarize_run(run)
    fig = render_figure(summary, read_round_metrics(run))
    recorded = {
        f"{kind}:{name}" for kinds in RECORDED.values() for kind, names in kinds.items()
        for name in names
    }  # fmt: skip
    drawn = drawn_series(fig) - {ABORTED}
    ledger = {"ledger:C_t", "ledger:epsilon", "ledger:mean_delta_l2"}
    # lensemble.frame-drift repeats the ledger's frame_drift, which this run has none of
    assert drawn == (recorded - {"train:lensemble.frame-drift"}) | ledger
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles == [
        "Loss",
        "Accuracy",
        "F1 macro",
        "Contributors per round",
        "Privacy spent",
        "Mean update norm",
        "Attempts per round",
        "Round duration",
        "Participants left out",
        "Messages exchanged",
        "Traffic",
        "New counter",
    ]
    ylabels = [ax.get_ylabel() for ax in fig.axes]
    assert ylabels[:6] == [
        "loss",
        "accuracy",
        "f1 macro",
        "contributors (C_t)",
        "ε (largest cumulative)",
        "L2 norm of the mean update",
    ]
    assert ylabels[7] == "seconds" and ylabels[10] == "megabytes (MB)"
    assert all(ax.get_xlabel() == "round" and ax.get_ylabel() for ax in fig.axes)
    loss = fig.axes[0]
    labels = [line.get_label() for line in loss.get_lines() if line.get_gid() != ABORTED]
    assert labels == [
        "server evaluation: loss",
        "federated evaluation: loss",
        "training replies: last-batch-loss",
    ]
    server = loss.get_lines()[0]
    assert list(server.get_xdata()) == [0, 1, 2, 3]  # round 0: the initial model
    assert list(server.get_ydata()) == pytest.approx([2.3, 2.1, 1.05, 0.7])
    attempts = fig.axes[6]
    assert [line.get_label() for line in attempts.get_lines()[:2]] == [
        "attempts",
        "aborted attempts",
    ]
    traffic = next(ax for ax in fig.axes if ax.get_title(loc="left") == "Traffic")
    assert [list(line.get_ydata()) for line in traffic.get_lines()[:2]] == [[2.0] * 3, [1.0] * 3]


def test_rounds_with_aborted_attempts_are_marked_on_every_panel(run: Path) -> None:
    write_round_metrics(run, RECORDED)
    summary = summarize_run(run)
    assert [(a.round, a.attempt) for a in summary.aborted] == [(2, 1)]
    fig = render_figure(summary, read_round_metrics(run))
    for ax in fig.axes:
        marks = [line for line in ax.get_lines() if line.get_gid() == ABORTED]
        assert [list(line.get_xdata()) for line in marks] == [[2, 2]], ax.get_title(loc="left")
    assert "1 aborted attempt (dashed red" in fig._suptitle.get_text()
    # C_t: integer ticks, and the aborted attempt (C_t = 0) is inside the axis, drawn whole
    c_t = next(ax for ax in fig.axes if ax.get_title(loc="left") == "Contributors per round")
    ticks = [t for t in c_t.get_yticks() if c_t.get_ylim()[0] <= t <= c_t.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    (aborted,) = c_t.collections
    assert aborted.get_offsets()[0][1] == 0 and aborted.get_label() == "aborted attempts (1)"
    assert c_t.get_ylim()[0] < 0 and not aborted.get_clip_on()


def test_a_run_without_round_metrics_draws_the_ledgers_series(run: Path, tmp_path: Path) -> None:
    fig = render_figure(summarize_run(run), {})
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        "Contributors per round",
        "Privacy spent",
        "Mean update norm",
    ]
    assert drawn_series(fig) - {ABORTED} == {"ledger:C_t", "ledger:epsilon", "ledger:mean_delta_l2"}
    # the written report: the metrics' panels make a larger PNG than the ledger's alone
    without, _ = write_report(run, tmp_path / "without")
    write_round_metrics(run, RECORDED)
    with_metrics, _ = write_report(run, tmp_path / "with")
    assert with_metrics.png.stat().st_size > without.png.stat().st_size


def test_metric_families_titles_and_labels() -> None:
    assert metric_panels({}) == ([], [])
    users, bookkeeping = metric_panels(
        {
            1: {
                "train": {"last-batch-loss": 0.5, "lensemble.C_t": 3.0},
                "evaluate": {"top1_acc": 0.4},
            }
        }
    )
    assert [(p.title, p.ylabel, [c.label for c in p.curves]) for p in users] == [
        ("Loss", "loss", ["training replies: last-batch-loss"]),
        ("Accuracy", "accuracy", ["federated evaluation: top1_acc"]),
    ]
    assert bookkeeping == []  # C_t is the ledger's series
    assert set(SAME_AS_LEDGER) == {"lensemble.C_t", "lensemble.frame-drift", "lensemble.epsilon"}
    # the deadlines share a panel in seconds; the round's two times share another
    _, timing = metric_panels(
        {
            1: {
                "train": {
                    "lensemble.open-deadline": 30.0, "lensemble.collect-deadline": 30.0,
                    "lensemble.seconds": 2.0, "lensemble.round-time": 1.5,
                }
            }
        }
    )  # fmt: skip
    assert [(p.title, p.ylabel, len(p.curves)) for p in timing] == [
        ("Round duration", "seconds", 2), ("Deadlines", "seconds", 2)
    ]
    assert readable("global-val-loss") == "Global val loss"
    assert readable("mean_delta_l2") == "Mean delta l2"
    assert readable("lensemble.new-counter") == "Lensemble new counter"


def test_the_summary_gives_the_evaluations_first_and_last_values(run: Path) -> None:
    from lensemble_flwr.provenance.audit import audit_run

    summary, audit = summarize_run(run), audit_run(run)
    md = render_markdown(summary, audit, "rounds.png", RECORDED)
    assert "| server evaluation | loss | 2.3 (round 0) | 0.7 (round 3) |" in md
    assert "| federated evaluation | f1_macro | 0.2 (round 1) | 0.6 (round 3) |" in md
    bare = render_markdown(summary, audit, "rounds.png", {})
    assert "No evaluation was recorded" in bare
