"""The human output of `rlctl plan`: one section per part, a label and a value per line, so that it
reads in 80 columns (a pipe, a narrow terminal) without truncating a number; long values wrap.

Plain text (ANSI bold/colour on a terminal only): importing and laying out with rich's Console and
Table cost more than the whole plan, and rich read `[...]` in a recipe name or a warning as markup."""
from __future__ import annotations

import os
import sys

LABEL_WIDTH = 15
_ANSI = {"bold": "1", "underline": "4", "red": "31", "green": "32", "yellow": "33"}


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
    return title, rows


def wrap(text: str, width: int) -> list[str]:
    """Word wrap that never truncates: a word that does not fit starts a new line, a word longer than
    a line (a path) is cut into pieces of the line's width."""
    width = max(width, 1)
    lines: list[str] = []
    for para in text.split("\n"):
        line = ""
        for word in para.split(" "):
            if line and len(line) + 1 + len(word) <= width:
                line += " " + word
                continue
            if line:
                lines.append(line)
            while len(word) > width:
                lines.append(word[:width])
                word = word[width:]
            line = word
        lines.append(line)
    return lines


class _Out:
    """Lines for a stream, `width` columns wide, with ANSI styles when `color`; `flush` writes them."""

    def __init__(self, file=None, width: int | None = None, color: bool | None = None):
        import shutil

        self.file = file or sys.stdout
        # COLUMNS, else the terminal's width, else 80 (a pipe, a file)
        self.width = width or shutil.get_terminal_size((80, 24)).columns
        if color is None:
            color = (hasattr(self.file, "isatty") and self.file.isatty() and "NO_COLOR" not in os.environ
                     and os.environ.get("TERM") != "dumb")
        self.color = color
        self.text: list[str] = []

    def flush(self) -> None:
        try:
            self.file.write("".join(self.text))
            self.file.flush()
        except BrokenPipeError:  # `rlctl plan ... | head`: exit 1 quietly, as rich's Console did
            if self.file is sys.stdout:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None

    def style(self, text: str, *styles: str) -> str:
        if not self.color:
            return text
        return f"\x1b[{';'.join(_ANSI[s] for s in styles)}m{text}\x1b[0m"

    def line(self, text: str = "", head: str = "", head_style: tuple = (), tail: str = "",
             tail_style: tuple = ()) -> None:
        """`head + text + tail` wrapped at the width; on a terminal, head and tail in their styles."""
        lines = wrap(head + text + tail, self.width)
        if self.color and head and lines[0].startswith(head):
            lines[0] = self.style(head, *head_style) + lines[0][len(head):]
        if self.color and tail and lines[-1].endswith(tail):
            lines[-1] = lines[-1][:-len(tail)] + self.style(tail, *tail_style)
        self.text.append("\n".join(lines) + "\n")

    def title(self, text: str) -> None:
        for piece in wrap(text, self.width):
            self.text.append(self.style(piece, "bold", "underline") + "\n")

    def rows(self, rows: list[tuple[str, str]]) -> None:
        """A label column (bold, at least LABEL_WIDTH wide) and a value column that wraps."""
        lw = max([LABEL_WIDTH] + [len(label) for label, _ in rows])
        for label, value in rows:
            pieces = wrap(value, self.width - lw - 1)
            head = self.style(label, "bold") + " " * (lw - len(label) + 1)
            self.text.append((head + pieces[0]).rstrip() + "\n")
            for piece in pieces[1:]:
                self.text.append((" " * (lw + 1) + piece).rstrip() + "\n")


def _placement(j: dict):
    pl, tr = j["placement"], j["trainer"]
    names = {"fsdp": "fsdp", "ep": "ep", "cp": "cp", "tp": "tp", "dp_replicate": "dp"}
    deg = " · ".join(f"{short} {tr[k]}" for k, short in names.items() if k in tr)
    gpus = pl["inference_gpus_per_server"]
    trainer = ("trainer", f"{pl['trainer_nodes']} node(s) × {pl['trainer_ranks_per_node']} ranks · {deg}")
    pool = j.get("pool")
    if pool:  # attached: the pool's servers are not this run's (their shape is in the pool section)
        orch = next((g for g in j.get("groups") or [] if g.get("name") == "orchestrator"), {})
        where = {"cpu_partition": "1 node of the cpu partition", "gpu_partition": "1 node of the gpu partition "
                 "(no GPU)", "local": "this machine"}.get(orch.get("where"), str(orch.get("where")))
        return _section("placement", [
            trainer, ("inference", f"served by pool {pool['name']} (0 nodes of this run)"),
            ("orchestrator", f"{where}, sending to the pool's front")])
    return _section("placement", [
        trainer,
        ("inference", f"{pl['inference_nodes']} node(s) × {pl['inference_servers_per_node']} servers × "
                      f"{gpus} GPU{'s' if gpus != 1 else ''}"),
        ("orchestrator", f"{pl['orchestrator']} (with the router)"),
    ])


def _pool(p: dict):
    """An attached run's pool: what its rollouts were planned on, and who else is attached."""
    mode = "LoRA" if p.get("mode") == "lora" else "full-weight"
    if p.get("planned_with") == "pool":
        state = f"{p['state']} · {mode} runs of {p.get('model')} · max_model_len {p.get('max_model_len')}"
    else:
        state = f"{p['state']}: planned with this recipe's [inference] section as its size"
    each = f" × {p['gpus_per_server']} GPU(s)" if p.get("gpus_per_server") else " (CPU)"
    runs = p.get("runs") or []
    rows = [("state", state),
            ("servers", f"{p['servers']} server(s){each} on {p['nodes']} node(s)"
                        + (f" · {p['gpus']} GPUs" if p.get("gpus") else "")),
            ("attached now", f"{len(runs)} run(s)" + (": " + ", ".join(runs) if runs else "")),
            ("rollout step", f"{_fmt_s(p.get('rollout_step_alone_s'))} with the pool to itself; the runs attached share "
                             "it (slower when they send at once)")]
    if p.get("where"):
        rows.append(("directory", p["where"]))
    return _section(f"pool {p['name']}", rows)


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
        prefill = (inf.get("replica_memory_gib") or {}).get("prefill")
        if prefill:  # P/D: prefill replicas hold the weights over fewer GPUs
            rows.append(("prefill/GPU", f"weights {prefill['weights']:.2f} GiB · KV {prefill['kv_cache']:.2f} GiB "
                                        f"of {inf['usable_gib_per_gpu']:.1f} GiB usable"))
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
    w = j.get("weights") or {}
    if w.get("sync_time_s"):
        chosen, times = w["transport"], w["sync_time_s"]
        others = " · ".join(f"{t} {_fmt_s(v)}" for t, v in times.items() if t != chosen)
        rows.append(("weight sync", f"{chosen} {_fmt_s(times[chosen])} per step, {_fmt_bytes(w['bytes'])} "
                                    f"{w['dtype']} (trainer blocked {_fmt_s(w['trainer_side_s'])}, servers "
                                    f"paused {_fmt_s(w['rollout_side_s'])}) · {others}"))
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


def render(j: dict, file=None, width: int | None = None, color: bool | None = None) -> None:
    """Print the plan `j` (PlanReport.to_json()) on `file` (stdout), `width` columns wide (the
    terminal's, or 80 in a pipe); ANSI styles when `color` (default: on a terminal, no NO_COLOR)."""
    out = _Out(file, width, color)
    verdict = ("fits", ("green",)) if j["fits"] else ("does not fit", ("red",))
    out.line(f": {j['recipe']} on {j['profile']} ({j['model']}): ", head="plan", head_style=("bold",),
             tail=verdict[0], tail_style=verdict[1])
    if j.get("calibration"):
        out.line(f"calibrated by {j['calibration']}")
    sections = [_placement(j), _trainer(j["trainer"]), _inference(j["inference"]), _loop(j)]
    if j.get("pool"):  # attached: the inference figures are the pool's servers'
        sections[2] = (f"inference (on pool {j['pool']['name']})", sections[2][1])
        sections.insert(2, _pool(j["pool"]))
    if j.get("disk"):
        sections.append(_disk(j["disk"]))
    for title, rows in sections:
        out.line()
        out.title(title)
        out.rows(rows)
    if j["warnings"] or j["errors"]:
        out.line()
    for w in j["warnings"]:
        out.line(" " + w, head="warning:", head_style=("yellow",))
    for e in j["errors"]:
        out.line(" " + e, head="error:", head_style=("red",))
    out.flush()


def render_calibration(written: dict, profile: str, file=None, width: int | None = None,
                       color: bool | None = None) -> None:
    """What `--calibrate` measured, the scale it fitted per side, and how to use the file."""
    out = _Out(file, width, color)
    src = written["source"]
    m, scale = src["measured"], src["scale"]
    title, rows = _section(f"calibration from {src['run']}", [
        ("measured", f"trainer step {_fmt_s(m['trainer_step_time_s'])} · orchestrator step "
                     f"{_fmt_s(m['orchestrator_step_time_s'])} (medians of {m['steps']} steps)"),
        ("fitted", " · ".join(f"{side} constants × {s:.3g}" for side, s in scale.items()) or "nothing to fit"),
        ("constants", ", ".join(sorted(written["constants"])) or "-"),
        ("wrote", written["path"]),
    ])
    out.title(title)
    out.rows(rows)
    out.line(f"use it: add `calibration: {written['path']}` to the {profile!r} profile YAML, or pass "
             f"--calibration {written['path']}")
    out.line()
    out.flush()
