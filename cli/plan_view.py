"""The human output of `rlctl plan`: one section per part, a label and a value per line, so that it
reads in 80 columns (a pipe, a narrow terminal) without truncating a number; long values wrap."""
from __future__ import annotations

LABEL_WIDTH = 15


def _fmt_s(x) -> str:
    if x is None:
        return "n/a"
    if x >= 7200:
        return f"{x / 3600:.1f} h"
    return f"{x / 60:.2f} min" if x >= 120 else f"{x:.3g} s"


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _num(v, digits: int = 0) -> str:
    return f"{v:,.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _pct(v) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, (int, float)) else "n/a"


def _section(title: str, rows: list[tuple[str, str]]):
    from rich.table import Table

    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold", no_wrap=True, min_width=LABEL_WIDTH)
    t.add_column(overflow="fold")
    for label, value in rows:
        t.add_row(label, value)
    return title, t


def _placement(j: dict):
    pl, tr = j["placement"], j["trainer"]
    names = {"fsdp": "fsdp", "ep": "ep", "cp": "cp", "tp": "tp", "dp_replicate": "dp"}
    deg = " · ".join(f"{short} {tr[k]}" for k, short in names.items() if k in tr)
    gpus = pl["inference_gpus_per_server"]
    return _section("placement", [
        ("trainer", f"{pl['trainer_nodes']} node(s) × {pl['trainer_ranks_per_node']} ranks · {deg}"),
        ("inference", f"{pl['inference_nodes']} node(s) × {pl['inference_servers_per_node']} servers × "
                      f"{gpus} GPU{'s' if gpus != 1 else ''}"),
        ("orchestrator", f"{pl['orchestrator']} (with the router)"),
    ])


def _trainer(tr: dict):
    step = tr.get("step_time_s")
    comm = {k[:-len("_comm_s")]: v for k, v in tr.items() if k.endswith("_comm_s") and isinstance(v, (int, float))}
    split = []
    if isinstance(tr.get("compute_s"), (int, float)):
        split.append(f"compute {_fmt_s(tr['compute_s'])}")
    if comm:
        split.append(f"communication {_fmt_s(sum(comm.values()))} ("
                     + ", ".join(f"{k} {_fmt_s(v)}" for k, v in comm.items()) + ")")
    if isinstance(tr.get("overhead_s"), (int, float)):
        split.append(f"fixed overhead {_fmt_s(tr['overhead_s'])}")
    rows = [("step", _fmt_s(step) + (f" = {' + '.join(split)}" if split else ""))]
    rate = [f"{_num(tr.get('tokens_per_s'))} tokens/s"]
    if tr.get("mfu") is not None:
        rate.append(f"MFU {_pct(tr['mfu'])}")
    if tr.get("tokens_per_step") is not None:
        rate.append(f"{_num(tr['tokens_per_step'])} tokens/step")
    if tr.get("micro_batches") is not None:
        rate.append(f"{tr['micro_batches']} micro-batches")
    rows.append(("throughput", " · ".join(rate)))
    unit = "GPU" if tr.get("gpus") else "rank"
    of = f" of {tr['hbm_gib']:.1f} GiB" if isinstance(tr.get("hbm_gib"), (int, float)) else ""
    rows.append((f"memory/{unit}", f"{tr.get('memory_gib_per_gpu') or 0:.2f} GiB{of}"))
    if isinstance(tr.get("memory_gib"), dict):
        rows.append(("", " · ".join(f"{k} {v:.2f}" for k, v in tr["memory_gib"].items() if k != "total")))
    return _section("trainer", rows)


def _inference(inf: dict):
    rows = []
    if inf.get("gpus"):
        rows.append(("servers", f"tp {inf.get('tp')} · {inf.get('replicas', '-')} replica(s) × dp "
                                f"{inf.get('dp_per_replica', '-')}" + (f" · prefill GPUs {inf['prefill_gpus']}"
                                                                       if inf.get("prefill_gpus") else "")))
        rows.append(("memory/GPU", f"weights {inf.get('weights_gib_per_gpu', 0):.2f} GiB · KV "
                                   f"{inf.get('kv_cache_gib_per_gpu', 0):.2f} GiB "
                                   f"({_num(inf.get('kv_tokens_per_gpu'))} tokens)"))
    else:
        rows.append(("servers", f"{inf.get('servers', 1)} CPU server(s) · KV {inf.get('kv_cache_gib_per_gpu', 0):.1f} GiB"))
    rows.append(("rollouts", f"{_num(inf.get('concurrency'))} at once (KV room for "
                             f"{_num(inf.get('max_concurrent_rollouts'))})"))
    bound = f" ({inf['decode_bound']} bound)" if inf.get("decode_bound") else ""
    prefill = (f" · prefill {_num(inf['prefill_tokens_per_s'])} tok/s"
               if isinstance(inf.get("prefill_tokens_per_s"), (int, float)) else "")
    rows.append(("decode", f"{_num(inf.get('decode_tokens_per_s'))} tok/s{bound}{prefill}"))
    rows.append(("rollout step", _fmt_s(inf.get("rollout_step_time_s"))))
    return _section("inference", rows)


def _loop(j: dict):
    orch, lag, cost = j["orchestrator"], j.get("off_policy") or {}, j.get("cost") or {}
    idle = ", ".join(f"{k} idle {v:.0%}" for k, v in orch["idle_fraction"].items() if v is not None)
    rows = [("async step", f"{_fmt_s(orch['step_time_s'])} · bottleneck {j['bottleneck']}" + (f" · {idle}" if idle else ""))]
    if lag.get("lag_mean_steps") is not None:
        rows.append(("off-policy lag", f"mean rollout {_fmt_s(lag['rollout_mean_s'])} = {lag['lag_mean_steps']:.2f} steps · "
                                       f"longest {_fmt_s(lag['rollout_max_s'])} = {lag['lag_max_steps']:.2f} steps · "
                                       f"bound {lag['max_off_policy_steps']}"))
    if cost.get("wall_time_s") is not None:
        hours = (f"{cost['gpu_hours_per_step']:.3g} GPU-h/step · {cost['gpu_hours_per_run']:,.1f} GPU-h per run"
                 if cost["gpus"] else f"{cost['node_hours_per_run']:.3g} node-h per run (CPU)")
        rows.append(("cost", f"{cost['gpus']} GPUs on {cost['nodes']} nodes · {hours}"))
        rows.append(("wall time", f"{_fmt_s(cost['wall_time_s'])} to {cost['max_steps']} steps "
                                  f"(checkpoint write {_fmt_s(cost['checkpoint_write_s'])})"))
    return _section("loop", rows)


def _disk(disk: dict):
    rows = []
    each = {"weights": disk["weights_step_bytes"], "rollouts": disk["rollout_batch_bytes"],
            "checkpoints": disk["checkpoint_bytes"]}
    for kind, size in each.items():
        rows.append((kind, f"{_fmt_bytes(size)} × {disk['kept'][kind]} kept = {_fmt_bytes(disk['peak_bytes_by_kind'][kind])}"))
    rows.append(("peak", f"{_fmt_bytes(disk['peak_bytes'])} · written per step {_fmt_bytes(disk['written_per_step_bytes'])}"
                         f" · without retention {_fmt_bytes(disk['unpruned_run_bytes'])}"))
    if disk.get("router_replay_bytes_per_batch"):
        rows.append(("router replay", f"+{_fmt_bytes(disk['router_replay_bytes_per_batch'])} per rollout batch"))
    return _section("disk (run directory)", rows)


def render(j: dict, console=None) -> None:
    from rich.console import Console

    con = console or Console()
    verdict = "[green]fits[/green]" if j["fits"] else "[red]does not fit[/red]"
    con.print(f"[bold]plan[/bold]: {j['recipe']} on {j['profile']} ({j['model']}): {verdict}")
    if j.get("calibration"):
        con.print(f"calibrated by {j['calibration']}", overflow="fold")
    sections = [_placement(j), _trainer(j["trainer"]), _inference(j["inference"]), _loop(j)]
    if j.get("disk"):
        sections.append(_disk(j["disk"]))
    for title, table in sections:
        con.print(f"\n[bold underline]{title}[/bold underline]")
        con.print(table)
    if j["warnings"] or j["errors"]:
        con.print()
    for w in j["warnings"]:
        con.print(f"[yellow]warning:[/yellow] {w}", overflow="fold")
    for e in j["errors"]:
        con.print(f"[red]error:[/red] {e}", overflow="fold")


def render_calibration(written: dict, profile: str, console=None) -> None:
    """What `--calibrate` measured, the scale it fitted per side, and how to use the file."""
    from rich.console import Console

    con = console or Console()
    src = written["source"]
    m, scale = src["measured"], src["scale"]
    title, t = _section(f"calibration from {src['run']}", [
        ("measured", f"trainer step {_fmt_s(m['trainer_step_time_s'])} · orchestrator step "
                     f"{_fmt_s(m['orchestrator_step_time_s'])} (medians of {m['steps']} steps)"),
        ("fitted", " · ".join(f"{side} constants × {s:.3g}" for side, s in scale.items()) or "nothing to fit"),
        ("constants", ", ".join(sorted(written["constants"])) or "-"),
        ("wrote", written["path"]),
    ])
    con.print(f"[bold underline]{title}[/bold underline]", overflow="fold")
    con.print(t)
    con.print(f"use it: add `calibration: {written['path']}` to the {profile!r} profile YAML, or pass "
              f"--calibration {written['path']}\n", overflow="fold")
