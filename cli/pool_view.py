"""The screen of `rlctl monitor POOL` and `rlctl pool show`: a pure function of `describe_pool`'s dict
→ a rich renderable (tests render it to text): the pool's state and endpoint, idle fraction, residency switches, and per attached
run its share of the servers' time, queue, wait and the weights it is served with."""
from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rlctl.cli.monitor_view import STATE_STYLE, fmt_duration


def _header(info: dict) -> Text:
    text = Text(f"pool {info['name']}  ", style="bold")
    text.append(info["state"], style=STATE_STYLE.get(info["state"], "default"))
    text.append(f"  {info['mode']} runs of {info['model']} on {info['servers']} server(s)")
    if info.get("url"):
        text.append(f"  {info['url']}", style="dim")
    return text


def _totals(stats: dict) -> Text:
    if stats.get("idle_fraction") is None:
        return Text("no run attached yet", style="dim")
    text = Text(f"idle {stats['idle_fraction']:.0%} of {fmt_duration(stats['uptime_s'])} since the first attach  "
                f"in flight {stats['inflight']}  residency switches {stats['switches']} ({stats['switch_s']:.1f} s)")
    holders = stats.get("holders")
    if holders:
        text.append("\nservers hold: " + "  ".join(f"{i}={h or '-'}" for i, h in enumerate(holders)), style="dim")
    return text


def _runs(stats: dict) -> Table | Text:
    runs = stats.get("runs") or {}
    if not runs:
        return Text("no run attached now", style="dim")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("run", "share", "requests", "queued", "waited", "served with"):
        table.add_column(column, justify="left" if column in ("run", "served with") else "right")
    for name, r in runs.items():
        served = str(r.get("weights") or "base model").rsplit("/", 1)[-1]  # a step directory's name
        table.add_row(name, f"{r['share']:.0%}", str(r["requests"]), str(r["queued"]), f"{r['wait_s']:.1f} s", served)
    return table


def render_pool(info: dict) -> Panel:
    parts: list = [_header(info)]
    stats = info.get("stats")
    if stats:
        parts += [Text(""), _totals(stats)]
        if stats.get("idle_fraction") is not None:  # before the first attach _totals already said so
            parts += [Text(""), _runs(stats)]
    elif info["state"] == "running":
        parts.append(Text("the front has not announced itself yet", style="dim"))
    return Panel(Group(*parts), title="rlctl pool", title_align="left")
