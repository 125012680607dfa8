"""Rich tables for `rlctl plan`."""
from __future__ import annotations


def _fmt_s(x) -> str:
    if x is None:
        return "n/a"
    return f"{x / 60:.2f} min" if x >= 120 else f"{x:.2f} s"


def _fmt_bytes(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _disk_table(disk: dict):
    from rich.table import Table

    t = Table(title="disk (run directory)")
    for col in ("", "each", "kept at peak", "peak"):
        t.add_column(col)
    each = {"weights": disk["weights_step_bytes"], "rollouts": disk["rollout_batch_bytes"],
            "checkpoints": disk["checkpoint_bytes"]}
    for kind, size in each.items():
        t.add_row(kind, _fmt_bytes(size), str(disk["kept"][kind]), _fmt_bytes(disk["peak_bytes_by_kind"][kind]))
    t.add_row("[bold]total[/bold]", "", "", f"[bold]{_fmt_bytes(disk['peak_bytes'])}[/bold]")
    return t


def render(j: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    pl, tr, inf, orch = j["placement"], j["trainer"], j["inference"], j["orchestrator"]
    t = Table(title=f"plan: {j['recipe']} on {j['profile']} ({j['model']})", show_header=False)
    t.add_row("trainer nodes", str(pl["trainer_nodes"]), f"{pl['trainer_ranks_per_node']} ranks/node")
    t.add_row("inference nodes", str(pl["inference_nodes"]),
              f"{pl['inference_servers_per_node']} servers/node × {pl['inference_gpus_per_server']} GPU")
    t.add_row("orchestrator + router", pl["orchestrator"], "")
    con.print(t)
    t = Table(title="trainer")
    for col in ("fsdp", "ep", "cp", "tp", "GiB/GPU", "tokens/s", "step"):
        t.add_column(col)
    t.add_row(*(str(tr.get(k, "-")) for k in ("fsdp", "ep", "cp", "tp")), f"{tr.get('memory_gib_per_gpu') or 0:.1f}",
              f"{tr.get('tokens_per_s') or 0:,.0f}", _fmt_s(tr.get("step_time_s")))
    con.print(t)
    if isinstance(tr.get("memory_gib"), dict):
        m = Table(title="trainer memory per GPU (GiB)")
        for k in tr["memory_gib"]:
            m.add_column(k)
        m.add_row(*(f"{v:.2f}" for v in tr["memory_gib"].values()))
        con.print(m)
    t = Table(title="inference")
    cols = [("tp", "tp"), ("weights GiB/GPU", "weights_gib_per_gpu"), ("KV GiB/GPU", "kv_cache_gib_per_gpu"),
            ("KV tokens/GPU", "kv_tokens_per_gpu"), ("max rollouts", "max_concurrent_rollouts"),
            ("decode tok/s", "decode_tokens_per_s"), ("prefill tok/s", "prefill_tokens_per_s"),
            ("rollout step", "rollout_step_time_s")]
    for name, _ in cols:
        t.add_column(name)
    row = []
    for _, k in cols:
        v = inf.get(k)
        row.append(_fmt_s(v) if k.endswith("time_s") else (f"{v:,.0f}" if isinstance(v, (int, float)) else "-"))
    t.add_row(*row)
    con.print(t)
    disk = j.get("disk")
    if disk:
        con.print(_disk_table(disk))
        con.print(f"written per step: {_fmt_bytes(disk['written_per_step_bytes'])}; "
                  f"without retention the run would keep {_fmt_bytes(disk['unpruned_run_bytes'])}")
        if disk["router_replay_bytes_per_batch"]:
            con.print(f"router replay would add {_fmt_bytes(disk['router_replay_bytes_per_batch'])} per rollout batch")
    idle = ", ".join(f"{k} idle {v:.0%}" for k, v in orch["idle_fraction"].items() if v is not None)
    con.print(f"async step: [bold]{_fmt_s(orch['step_time_s'])}[/bold]  bottleneck: {j['bottleneck']}  {idle}")
    for w in j["warnings"]:
        con.print(f"[yellow]warning:[/yellow] {w}")
    for e in j["errors"]:
        con.print(f"[red]error:[/red] {e}")
    con.print("[green]fits[/green]" if j["fits"] else "[red]does not fit[/red]")
