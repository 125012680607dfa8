"""The `rlctl monitor` screen as a pure function of (status, metrics, errors) → a rich renderable, so
tests can render it to text with a recording console."""
from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from rlctl.launchers.status import DRY_RUN
from rlctl.orchestrator.exchange.metrics import EvalRecord as Eval
from rlctl.orchestrator.exchange.metrics import OrchestratorStepRecord as Orch
from rlctl.orchestrator.exchange.metrics import TrainerStepRecord as Trainer
from rlctl.orchestrator.exchange.metrics import key_of

BLOCKS = "▁▂▃▄▅▆▇█"
STATE_STYLE = {
    "running": "bold green", "completed": "bold cyan", "pending": "yellow", "starting": "yellow",
    "failed": "bold red", "lost": "bold red", "cancelled": "magenta", "unknown": "dim", "stalled": "bold red",
    DRY_RUN: "dim",
}
# (metrics key, label, plan key whose prediction goes next to the measured median)
SPARK_ROWS = (
    ("orchestrator", key_of(Orch, "reward_mean"), "reward", None),
    ("trainer", key_of(Trainer, "trainer_step_time_s"), "trainer step (s)", "trainer_step_time_s"),
    ("orchestrator", key_of(Orch, "orchestrator_step_time_s"), "orchestrator step (s)", "orchestrator_step_time_s"),
    ("orchestrator", key_of(Orch, "off_policy_lag_mean"), "off-policy lag", None),
    ("orchestrator", key_of(Orch, "rollouts_per_s"), "rollouts/s", None),
)
# Shown once the run has eval records (orchestrator.eval); x = the policy version evaluated.
EVAL_ROWS = (("eval", key_of(Eval, "reward_mean"), "eval reward", None),
             ("eval", key_of(Eval, "pass_at_k"), "eval pass@{k}", None))


def sparkline(values: list[float], width: int = 40) -> str:
    """Unicode block sparkline of the last `width` values (flat series draw at the lowest block)."""
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    if span <= 0:
        return BLOCKS[0] * len(values)
    return "".join(BLOCKS[min(len(BLOCKS) - 1, int((v - lo) / span * len(BLOCKS)))] for v in values)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _styled(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def _header(summary: dict) -> Text:
    text = Text()
    text.append(f"{summary['name']}  ", style="bold")
    text.append_text(_styled(summary["state"]))
    job = f"  job {summary['job_id']}" if summary.get("job_id") else ""
    text.append(f"  [{summary['scheduler']}{job}, attempt {summary['attempt']}]  {summary['run_dir']}", style="dim")
    if summary.get("reason"):
        text.append(f"\n{summary['reason']}", style="italic")
    return text


def _components(summary: dict) -> Table:
    table = Table(title="components", title_justify="left", expand=False, box=None, padding=(0, 2))
    for col in ("component", "state", "nodes", "restarts", "exit"):
        table.add_column(col)
    for c in summary["components"]:
        table.add_row(c["name"], _styled(c["state"]), c["nodes"] or "-", str(c["restarts"]), c["exit_code"] or "-")
    if not summary["components"]:
        table.add_row("(none reported yet)", "", "", "", "")
    return table


def _progress(summary: dict) -> Table:
    done, total = summary["steps_done"], summary["max_steps"]
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=42)
    grid.add_column()
    bar = ProgressBar(total=float(total or max(done, 1)), completed=float(done), width=40)
    pct = f" ({100 * done / total:.0f}%)" if total else ""
    eta = "" if summary["eta_s"] is None else f"  ETA {fmt_duration(summary['eta_s'])}"
    last = summary["step"] if summary["step"] is not None else "-"
    grid.add_row(bar, f"{done}/{total or '?'} steps{pct}  last step {last}{eta}")
    return grid


def _sparks(summary: dict, metrics: list[dict]) -> Table:
    from rlctl.launchers.run_summary import by_step, recent_median, series

    table = Table(title="metrics (last 40 steps)", title_justify="left", box=None, padding=(0, 2))
    for col, justify in (("metric", "left"), ("trend", "left"), ("last", "right"), ("median", "right"), ("plan", "right")):
        table.add_column(col, justify=justify)
    records = {c: by_step(metrics, c) for c in ("trainer", "orchestrator", "eval")}
    evals = records["eval"]
    for component, key, label, plan_key in SPARK_ROWS + (EVAL_ROWS if evals else ()):
        label = label.format(k=evals[-1].get("k", "k") if evals else "k")
        values = [v for _, v in series(records[component], key)]
        # Each row's own series: the eval rows share key names with the orchestrator's (reward_mean)
        median = recent_median(records[component], key)
        predicted = summary["predicted"].get(plan_key) if plan_key else None
        table.add_row(label, Text(sparkline(values), style="cyan"), _num(values[-1] if values else None),
                      _num(median), _num(predicted) if plan_key else "")
    return table


def _idle(summary: dict) -> Text:
    text = Text("idle  ")
    for side in ("trainer", "inference"):
        frac = summary["idle"].get(side)
        if frac is None:
            text.append(f"{side} -   ")
            continue
        filled = int(round(frac * 10))
        text.append(f"{side} ")
        text.append("█" * filled + "░" * (10 - filled), style="red" if frac > 0.5 else "green")
        text.append(f" {100 * frac:.0f}%   ")
    return text


def _heartbeats(summary: dict) -> Text | None:
    rows = summary.get("heartbeats") or []
    if not rows or summary["state"] == "completed":  # a finished run's last beats say nothing (a failed one's may)
        return None
    text = Text("heartbeats  ")
    for h in rows:
        if h["stalled"]:
            text.append(f"{h['component']} stalled {fmt_duration(h['stalled_s'])}", style="bold red")
        elif h["waiting_for"]:
            text.append(f"{h['component']} waiting for {h['waiting_for']}", style="yellow")
        else:
            text.append(f"{h['component']} ok ({fmt_duration(h['since_progress_s'])} ago)", style="green")
        text.append("   ")
    return text


def _plan_extra(summary: dict) -> Text | None:
    shown = {row[3] for row in SPARK_ROWS if row[3]}
    extra = {k: v for k, v in summary["predicted"].items() if k not in shown}
    if not extra:
        return None
    return Text("plan: " + "  ".join(f"{k}={_num(v)}" for k, v in sorted(extra.items())), style="dim")


def _errors(summary: dict) -> Text | None:
    if not summary["errors"]:
        return None
    text = Text("last errors", style="bold red")
    for e in summary["errors"]:
        text.append(f"\n  {e['file']}: ", style="dim")
        text.append(e["line"], style="default")
    return text


def render_summary(summary: dict, metrics: list[dict]) -> Panel:
    parts = [_header(summary), Text(""), _components(summary), Text(""), _progress(summary),
             _sparks(summary, metrics), _idle(summary), _heartbeats(summary), _plan_extra(summary), _errors(summary)]
    return Panel(Group(*(p for p in parts if p is not None)), title="rlctl monitor", title_align="left")


def render_status(status, metrics: list[dict], errors: list[dict] | None = None, beats=None) -> Panel:
    """The monitor screen for a RunStatus, its metric records and heartbeats."""
    from rlctl.launchers.run_summary import summarize

    return render_summary(summarize(status, metrics, errors, beats), metrics)


def progress_line(summary: dict) -> str:
    """One compact line for `--wait` in non-interactive output (CI logs)."""
    eta = "" if summary["eta_s"] is None else f" ETA {fmt_duration(summary['eta_s'])}"
    return (f"{summary['name']}: {summary['state']} step {summary['steps_done']}/{summary['max_steps'] or '?'}"
            f" reward {_num(summary['reward_mean'])}{eta}")
