"""The peer bench's report: one variant's rows as the text table and ratios `bench_peer_trl.py` prints,
or as the JSON its `--json` prints."""
from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING

from cpu_by_component import floor_s
from vllm_alone_batch import overhead

if TYPE_CHECKING:
    from bench_peer_trl import Variant

TARGET = 0.9  # the mean reward a side must reach; its wall time to it is compared


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def report(name: str, variant: Variant, rows: dict) -> None:
    rl, trl, alone, repeats = rows.get("rlctl"), rows.get("trl"), rows.get("vllm-alone"), rows.get("repeats", [])
    print(f"\n## {name}\n")
    print(f"| side | start-up s | wall to reward {TARGET} s | steps to {TARGET} | reward first -> last (steps) "
          "| reward max | rollout tok/s (loop) |")
    print("|---|---|---|---|---|---|---|")
    for r in (rl, trl):
        if r:
            print(f"| {r['side']} | {_fmt(r['startup_s'])} | {_fmt(r['wall_to_target_s'])} | {r['steps_to_target'] or '-'} "
                  f"| {_fmt(r['reward_first'], '.3f')} -> {_fmt(r['reward_last'], '.3f')} ({r['steps']}) "
                  f"| {_fmt(r['reward_max'], '.3f')} | {_fmt(r['rollout_tokens_per_s'], '.0f')} |")
    if rl:
        print("rlctl start-up (s after launch): " + ", ".join(f"{k} {v}" for k, v in rl["startup_timeline_s"].items()))
    if rl and trl and rl["rollout_tokens_per_s"] and trl["rollout_tokens_per_s"]:
        ratio = rl["rollout_tokens_per_s"] / trl["rollout_tokens_per_s"]
        goal = variant.tokens_per_s_goal
        print(f"rollout tokens/s rlctl/TRL: {ratio:.2f}x" + (f" (goal >= {goal}x: {'ok' if ratio >= goal else 'MISSED'})"
                                                             if goal else ""))
        if alone and alone["batch_s"]:
            # What vLLM itself allows: its offline speed on this batch (one process, no server, no trainer beside
            # it) against TRL's loop. rlctl, which generates with vLLM, cannot beat this ceiling.
            ceiling = alone["batch_tokens"] / alone["batch_s"] / trl["rollout_tokens_per_s"]
            print(f"ceiling set by vLLM alone (its offline tokens/s / TRL's loop tokens/s): {ceiling:.2f}x; "
                  f"rlctl reaches {ratio / ceiling:.0%} of it")
        if rl["wall_to_target_s"] and trl["wall_to_target_s"]:
            print(f"wall to reward {TARGET} rlctl/TRL: {rl['wall_to_target_s'] / trl['wall_to_target_s']:.2f}x")
    if rl and rl.get("cpu_per_step_s"):
        cpu = rl["cpu_per_step_s"]
        print("rlctl CPU seconds per step (steady state, from /proc): "
              + ", ".join(f"{name} {v:.3f}" for name, v in cpu.items())
              + f"; {sum(cpu.values()):.3f} in all on {os.cpu_count()} cores, so no step interval below "
              f"{floor_s(cpu):.2f} s however they are scheduled"
              + (f" (vLLM alone: {alone['batch_cpu_s']:.3f} CPU s per batch)" if alone and alone.get("batch_cpu_s") else ""))
    share = overhead(rl, alone)
    if share is not None:
        goal = variant.overhead_goal
        drift = (f", {alone['batch_s_before']:.2f} before the run and {alone['batch_s_after']:.2f} after it"
                 if "batch_s_before" in alone else "")
        print(f"step interval {rl['step_interval_s']:.2f} s; vLLM alone {alone['batch_s']:.2f} s per batch "
              f"({alone['batch_tokens']} tokens{drift}), trainer step {_fmt(rl['trainer_step_s'], '.2f')} s; rlctl's own "
              f"overhead {share:.0%} of the step" + (f" (goal <= {goal:.0%}: {'ok' if share <= goal else 'MISSED'})"
                                                     if goal and len(repeats) < 2 else ""))
    if len(repeats) > 1:
        shares = [overhead(r, a) for r, a in repeats]
        line = f"{len(repeats)} rlctl runs: step interval " + ", ".join(
            f"{r['step_interval_s']:.2f}" for r, _ in repeats) + " s; rollout tok/s " + ", ".join(
            f"{r['rollout_tokens_per_s']:.0f}" for r, _ in repeats)
        if None not in shares:
            median, goal = statistics.median(shares), variant.overhead_goal
            batch_s = ", ".join(f"{a['batch_s']:.2f}" for _, a in repeats)
            line += (f"; vLLM alone around each run {batch_s} s"
                     f"; overhead {', '.join(f'{x:.0%}' for x in shares)} of the step, median {median:.0%}"
                     + (f" (goal <= {goal:.0%}: {'ok' if median <= goal else 'MISSED'})" if goal else ""))
        print(line)


def json_rows(rows: dict) -> dict:
    """A variant's rows for --json: with --repeat N > 1 each run once, under "repeats", with its overhead and
    their median (the text report shows the first run in full, the JSON would otherwise hold it twice)."""
    out = {k: v for k, v in rows.items() if k != "repeats"}
    repeats = rows.get("repeats", [])
    if len(repeats) > 1:
        out.pop("rlctl"), out.pop("vllm-alone")
        out["repeats"] = [{"rlctl": r, "vllm-alone": a, "overhead": overhead(r, a)} for r, a in repeats]
        shares = [x["overhead"] for x in out["repeats"]]
        out["overhead_median"] = None if None in shares else statistics.median(shares)
    elif repeats:
        out["overhead"] = overhead(*repeats[0])
    return out
