"""``lensemble-flwr report``'s curves: training and validation loss and accuracy from the
run's round-metrics.jsonl, beside the audit panels; C_t with integer ticks and aborted
attempts drawn whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lensemble_flwr.cli.report import (
    ACCURACY_PANEL,
    LOSS_PANEL,
    metric_panels,
    render_figure,
    write_report,
)
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


def test_the_report_plots_training_and_validation_curves_beside_the_audit_panels(
    run: Path, tmp_path: Path
) -> None:
    write_round_metrics(run, METRICS)
    summary = summarize_run(run)
    fig = render_figure(summary, read_round_metrics(run))
    axes = fig.axes
    titles = [ax.get_title(loc="left") for ax in axes]
    assert titles[:3] == [LOSS_PANEL, ACCURACY_PANEL, "C_t (contributors)"]
    loss_labels = [line.get_label() for line in axes[0].get_lines()]
    assert loss_labels == [
        "evaluate: global-train-loss",
        "evaluate: global-val-loss",
        "train replies: last-batch-loss",
    ]
    val = axes[0].get_lines()[1]
    assert list(val.get_xdata()) == [1, 2, 3]
    assert list(val.get_ydata()) == pytest.approx([1.1, 0.55, 1.1 / 3])
    assert [line.get_label() for line in axes[1].get_lines()] == ["evaluate: accuracy"]
    # C_t: integer ticks, and the aborted attempt (C_t = 0) is inside the axis, drawn whole
    c_t = axes[2]
    ticks = [t for t in c_t.get_yticks() if c_t.get_ylim()[0] <= t <= c_t.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    (aborted,) = c_t.collections
    assert len(summary.aborted) == 1 and aborted.get_offsets()[0][1] == 0
    assert c_t.get_ylim()[0] < 0 and not aborted.get_clip_on()
    # the written report: the curves panels make a taller PNG than the audit panels alone
    with_curves, _ = write_report(run, tmp_path / "with")
    (run / METRICS_NAME).unlink()
    without, _ = write_report(run, tmp_path / "without")
    assert with_curves.png.stat().st_size > without.png.stat().st_size


def test_no_metrics_no_curve_panels() -> None:
    assert metric_panels({}) == []
    only_train = {1: {"train": {"last-batch-loss": 0.5}, "evaluate": {}}}
    ((title, curves),) = metric_panels(only_train)
    assert title == LOSS_PANEL and [c[0] for c in curves] == ["train replies: last-batch-loss"]
