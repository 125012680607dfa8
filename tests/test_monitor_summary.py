"""What `rlctl monitor` computes and shows from a run's records, without a run: idle fractions, the ETA
across a resume, and which lines a finished run's view keeps."""
from __future__ import annotations

import pytest


def test_idle_and_eta_leave_out_each_attempt_start_and_the_gap_before_it(tmp_path):
    """An attempt's first trainer step waits for the servers to start, and a resume's first step comes
    after the time the run was down: neither is the trainer idle because inference is behind, nor a step."""
    from rlctl.launchers.run_summary import summarize
    from rlctl.launchers.status import RunStatus

    def record(step, t, wait, first=False):
        return {"component": "trainer", "step": step, "time": t, "trainer_step_time_s": 0.3, "wait_batch_s": wait,
                "weight_publish_s": 0.1, "attempt_start": first}

    first = [record(0, 100.0, 30.0, True)] + [record(s, 100.0 + s, 0.6) for s in range(1, 5)]
    resumed = [record(5, 4000.0, 45.0, True)] + [record(s, 4000.0 + 2 * (s - 5), 1.6) for s in range(6, 9)]
    status = RunStatus("running", str(tmp_path), "r", "local", max_steps=20)
    summary = summarize(status, first + resumed)
    # steady steps: 4 at 0.6 s wait and 3 at 1.6 s, each with 0.4 s of step + publish
    assert summary["idle"]["trainer"] == pytest.approx((4 * 0.6 + 3 * 1.6) / (4 * 1.0 + 3 * 2.0))
    assert summary["eta_s"] == pytest.approx(2.0 * (20 - 9))  # this attempt's 2 s per step, not the gap


def test_the_plot_marks_where_a_resumed_attempt_began(tmp_path, monkeypatch):
    """The first attempt's start is no resume; each later one gets a dashed line on every panel."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from rlctl.cli.monitor import write_plot
    from rlctl.launchers.run_summary import by_step, resumed_at
    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.orchestrator.exchange.metrics import append_record, read_records

    run = RunDir(tmp_path)
    for step in range(9):
        append_record(run, "trainer", {"step": step, "time": 100.0 + step, "trainer_step_time_s": 0.3,
                                       "wait_batch_s": 0.1, "weight_publish_s": 0.1, "attempt_start": step in (0, 5, 7)})
    assert resumed_at(by_step(read_records(run), "trainer")) == [5, 7]
    drawn, labels, real = [], [], Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda ax, x, **kw: drawn.append(x) or labels.append(kw.get("label"))
                        or real(ax, x, **kw))
    write_plot(tmp_path, tmp_path / "p.png")
    assert drawn == [5, 7] * 3 and (tmp_path / "p.png").stat().st_size > 1000
    assert labels == ["resumed"] + [None] * 5  # one legend entry, on the top panel


@pytest.mark.parametrize("state, shown", [("running", True), ("failed", True), ("completed", False)])
def test_heartbeats_are_shown_unless_the_run_completed(state, shown):
    """A completed run's last beats ('waiting for trainer (final weights)', 'ok (3 h ago)') say nothing;
    a failed run's last beat may say what it waited on."""
    from rich.console import Console

    from rlctl.cli.monitor_view import render_summary

    beat = {"component": "orchestrator", "group": "orchestrator", "progress": 5, "waiting_for": "trainer (final weights)",
            "since_progress_s": 2.0, "stalled": False, "stalled_s": None}
    summary = {"name": "r", "state": state, "scheduler": "local", "attempt": 0, "run_dir": "r", "components": [],
               "steps_done": 5, "max_steps": 5, "eta_s": None, "step": 4, "measured": {}, "predicted": {},
               "idle": {}, "errors": [], "heartbeats": [beat]}
    console = Console(record=True, width=130, color_system=None)
    console.print(render_summary(summary, []))
    assert ("waiting for trainer (final weights)" in console.export_text()) == shown
