"""The human output of `rlctl plan … --multiplex`: the runs, then one table of both modes and one of each
run's slowdown. Plain text like the single plan (cli/plan_view.py says why not rich)."""
from __future__ import annotations

import sys

from rlctl.cli.plan_view import _fmt_s


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}×"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(  # noqa: E731 - first column left-aligned, numbers right-aligned
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def lines(report: dict) -> list[str]:
    iso, sh = report["isolated"], report["shared"]
    out = [f"Multiplexing {len(report['runs'])} runs on {report['profile']} "
           f"({report['nodes']} nodes × {report['gpus_per_node']} GPUs)", ""]
    out += _table(["run", "model", "trainer", "inference", "steps", "trainer step", "rollout step", "off-policy"],
                  [[r["name"], r["model"], r["trainer_nodes"], r["inference_nodes"], r["steps"],
                    _fmt_s(r["trainer_step_s"]), _fmt_s(r["rollout_step_s"]), r["max_off_policy_steps"]]
                   for r in report["runs"]])
    out.append("")
    out += _table(["mode", "makespan", "GPU-hours", "utilisation", "inference nodes", "weight switches"], [
        ["isolated (split async)", _fmt_s(iso["makespan_s"]), f"{iso['gpu_hours']:,.1f}", _pct(iso["utilization"]),
         sum(r["inference_nodes"] for r in report["runs"]), "-"],
        ["shared pool (HRRS)", _fmt_s(sh["makespan_s"]), f"{sh['gpu_hours']:,.1f}", _pct(sh["utilization"]),
         f"{sh['pool_nodes']} (pool)", sh["weight_switches"]]])
    out.append("")
    iso_runs = {r["name"]: r for r in iso["runs"]}
    out += _table(["run", "isolated: wall", "queued", "shared: wall", "slowdown"],
                  [[r["name"], _fmt_s(iso_runs[r["name"]]["duration_s"]), _fmt_s(iso_runs[r["name"]]["start_s"]),
                    _fmt_s(r["duration_s"]), _ratio(r["slowdown"])] for r in sh["runs"]])
    out += ["", f"GPU-hours saved by the shared pool: {_pct(report['gpu_hours_saving'])}; makespan "
                f"{_ratio(report['makespan_ratio'])} of isolated (pool sizes tried: "
                f"{', '.join(map(str, sh['pool_sizes_tried']))} nodes)"]
    return out


def render(report: dict, file=None) -> None:
    file = file or sys.stdout
    try:
        file.write("\n".join(lines(report)) + "\n")
        file.flush()
    except BrokenPipeError:  # `… | head`: stop quietly
        raise SystemExit(1) from None
