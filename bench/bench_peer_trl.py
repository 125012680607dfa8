"""Peer benchmark: tiny tasks run by TRL's synchronous `GRPOTrainer` vs rlctl's asynchronous stack.

Both sides train the same model (`build_tiny_model`, same seed) on the same environment with the same
reward, batch shape and optimiser, on the same CPU: AdamW at the recipe's lr, grad-norm clip 1, no KL
term, advantages = reward - group mean, loss normalised by the token count. TRL generates with
transformers' `generate` between optimiser steps (its default, no vLLM); rlctl runs a vLLM CPU server +
router + orchestrator + FSDP2 trainer, sampling while the trainer steps (one policy step behind, two in
the generation variant). Variants:

- `toy`: recipes/tiny-cpu.toml as it is (0.1M parameters, `sequence`, 32 x 16 rollouts of 2 tokens,
  a 2-rank trainer);
- `generation`: generation-heavy: `count_a` over 32 tokens, 16 x 16 rollouts per step, a 1-rank
  trainer (see ONE_RANK) with compiled layers (GENERATION_COMPILE), at lr 1e-3 (see GENERATION_LR);
- `compute`: compute-bound: a 25M-parameter Qwen3 (8 layers, hidden 512), `count_a` over 64 tokens,
  4 x 16 rollouts per step, a fixed number of steps (throughput only, no reward target), at lr 5e-4
  (at the toy's 2e-3 rlctl's runs, one policy step behind, collapse: see COMPUTE_LR).

Reported per side: wall time from start (before imports / before `rlctl launch`) to the first step whose
mean reward is >= 0.9, the reward reached, and rollout throughput = completion tokens generated / wall
time of the training loop (what the whole system delivers, generation and training together). For
rlctl also the start-up timeline and its own per-step overhead: the mean step interval (steady state)
minus what the critical path needs without rlctl, max(vLLM alone on the same batch, the trainer's step
compute); vLLM alone is measured just before and just after the rlctl run, and the two pooled (`around`).
`peer_report.py` prints the table and the ratios.
Goals (issue: weights and start-up): rollout tokens/s rlctl/TRL >= 0.9 (compute), >= 0.5 (generation);
overhead <= 15 % of the step (generation).

    python bench/bench_peer_trl.py [--variant toy|generation|compute|all] [--trl-python PY] [--side SIDE ...]

`--side rlctl vllm-alone --variant generation` prints the overhead alone, without TRL; `--repeat N` runs
rlctl N times, each run between two vLLM-alone measurements, and prints each overhead and their median.
`-o KEY=VALUE` (repeatable) adds a recipe override to the variant's, for every side (e.g. `-o
trainer.fsdp=2 -o trainer.micro_batch_size=128` gives the generation variant its former 2-rank trainer).

`--trl-python` runs the TRL side with another interpreter (a venv with trl + accelerate + this package).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cpu_by_component import CpuSampler
from peer_report import TARGET, json_rows, report
from vllm_alone_batch import around, use_server_settings, vllm_alone

T_START = time.time()  # before the heavy imports: TRL's start-up counts
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.toml"


@dataclass(frozen=True)
class Variant:
    overrides: tuple[str, ...] = ()
    model: tuple[tuple[str, int], ...] = ()  # tiny-model config overrides (a larger model)
    target: float | None = TARGET  # None: a fixed number of steps, throughput only
    tokens_per_s_goal: float | None = None  # rlctl / TRL rollout tokens per second
    overhead_goal: float | None = None  # rlctl's own share of the step


def _count_a(length: int, prompts: int, micro_batch: int, steps: int, off_policy: int = 1) -> tuple[str, ...]:
    """count_a overrides; every batch the policy gate lets start (`off_policy` + 1) may be in flight at once."""
    rollouts = prompts * 16
    return ("orchestrator.environment.name=count_a", f"orchestrator.environment.args={{length={length}}}",
            f"orchestrator.max_tokens={length}", f"orchestrator.rollouts_per_step={rollouts}",
            f"orchestrator.max_off_policy_steps={off_policy}",
            f"orchestrator.max_in_flight={(off_policy + 1) * rollouts}",
            f"orchestrator.expected_mean_tokens={length + 3}",
            f"orchestrator.max_steps={steps}", f"trainer.micro_batch_size={micro_batch}",
            f"inference.max_model_len={max(64, 2 * length)}")


# At the toy's 2e-3 an rlctl run sampled one step behind collapsed (reward 0.02 -> 0.25 -> 0.00 by step
# 3, every completion then 64 non-'a' tokens) while the same run on-policy (`max_off_policy_steps=0`)
# and TRL reached 1.0 in 3 steps: one update moved the policy by a KL of 0.8-2.5 (the next batch's
# mismatch_kl) and the ratio mask dropped 27-40% of a batch's tokens; the importance correction of a
# one-step-old batch does not hold steps that large. At 5e-4 the run one step behind reached 0.95 by
# step 4.
COMPUTE_LR = "trainer.optimizer.lr=5e-4"
# A 0.1M-parameter model is trained by one rank, as TRL trains it in one process: the second rank's
# collectives and its copy of every op's fixed cost took 0.07-0.08 CPU s per step from the cores the
# server shares (trainer 0.28 -> 0.20-0.21 CPU s per step, step interval 0.54-0.60 -> 0.51-0.57 s, two
# interleaved pairs of runs). The toy keeps the recipe's 2 ranks: it is the recipe as users run it.
ONE_RANK = ("trainer.fsdp=1",)
# At 2e-3 the generation variant, once it had learnt, sometimes destabilised (4 of 42 runs on one day, 2 of
# 4 on another, ending at reward 0.04-0.19): one update moved the policy by a KL of 0.13-1.8 (the next
# batch's mismatch_kl; the served logprobs matched the published weights, docs/launch.md). A collapsed
# policy also stops at EOS, so its batches are no longer the batch vLLM alone is timed on. At 1e-3 four
# runs reached 0.9 at step 49-50 (2e-3: about 28) and stayed >= 0.9, mismatch_kl <= 0.003 throughout.
GENERATION_LR = "trainer.optimizer.lr=1e-3"
# The generation variant samples up to two policy versions behind (prime-rl's default async level) with all
# three batches that allows in flight. One version behind, the two batches in flight finished in pairs and the
# third waited for the trainer's step on the first, leaving the engine idle every second step (docs/launch.md);
# two behind, three interleaved pairs of runs on one host: mean step interval 0.391-0.404 s against
# 0.413-0.444 s, rollout tokens/s +7%, reward 0.9 reached in the same 50-52 steps.
GENERATION_OFF_POLICY = 2
# The generation variant's trainer runs compiled layers (trainer.compile, warmed up while vLLM starts): its
# CPU per step fell from 0.157-0.161 s to 0.131-0.134 s, which the engine and the API server get back on the
# 2 shared cores (run total 0.68-0.71 -> 0.62-0.64 CPU s per step, rollout tokens/s 18.0-20.6k -> 19.4-22.3k,
# runs of one morning). The overhead medians (5, 6 and 14% against 14 and 7%) moved with the host more than
# with it. TRL's side is unchanged: its training part is 0.05-0.15 s of a step it runs alone.
GENERATION_COMPILE = ("trainer.compile=true",)

VARIANTS = {
    "toy": Variant(),
    "generation": Variant((*_count_a(32, 16, 256, 80, GENERATION_OFF_POLICY), *ONE_RANK, GENERATION_LR,
                           *GENERATION_COMPILE),
                          tokens_per_s_goal=0.5, overhead_goal=0.15),
    "compute": Variant((*_count_a(64, 4, 32, 12), COMPUTE_LR), target=None, tokens_per_s_goal=0.9,
                       model=(("hidden_size", 512), ("intermediate_size", 1536), ("num_hidden_layers", 8),
                              ("max_window_layers", 8), ("num_attention_heads", 8), ("num_key_value_heads", 4),
                              ("head_dim", 64))),
}


def _with(name: str, overrides: list[str]) -> Variant:
    """Variant `name` with the command line's overrides after its own."""
    return replace(VARIANTS[name], overrides=(*VARIANTS[name].overrides, *overrides))


def _recipe(variant: Variant) -> dict:
    from rlctl.recipes.load import compose, validate

    return validate(compose([str(TINY)], list(variant.overrides))).model_dump()


def build_model(variant: Variant, out_dir: Path) -> Path | None:
    """The variant's larger model, built once for both sides (None: the recipe's own tiny model)."""
    if not variant.model:
        return None
    from rlctl.trainer.tiny_model import build_tiny_model

    return build_tiny_model(out_dir / "model", seed=0, overrides=dict(variant.model))


def _model_or_tiny(recipe: dict, model_dir: Path | None, out_dir: Path) -> Path:
    """The shared model a child side was given, else the recipe's tiny model built into `out_dir`."""
    from rlctl.trainer.tiny_model import build_tiny_model

    return model_dir or build_tiny_model(out_dir / "model", seed=recipe["model"]["build_seed"])


def run_trl(variant: Variant, max_steps: int, out_dir: Path, model_dir: Path | None) -> dict:
    """The TRL side, in this process (run with the interpreter that has trl)."""
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlctl.orchestrator.environments import Prompt, load_environment

    r = _recipe(variant)
    o, opt = r["orchestrator"], r["trainer"]["optimizer"]
    if variant.target is None:
        max_steps = o["max_steps"]
    env = load_environment(o["environment"]["name"], o["environment"]["args"])
    prompts_per_step = o["rollouts_per_step"] // o["group_size"]
    drawn = env.sample_prompts(random.Random(o["seed"]), prompts_per_step * max_steps)
    data = Dataset.from_list([{"prompt": p.text, "target": p.target} for p in drawn])

    def reward(prompts, completions, target, **_):
        return [env.reward(Prompt(p, t), c) for p, c, t in zip(prompts, completions, target)]

    model_dir = _model_or_tiny(r, model_dir, out_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = GRPOConfig(
        output_dir=str(out_dir / "trl"), max_steps=max_steps, seed=0, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True,
        per_device_train_batch_size=o["rollouts_per_step"], num_generations=o["group_size"],
        steps_per_generation=1, num_iterations=1, max_completion_length=o["max_tokens"],
        temperature=o["temperature"], learning_rate=opt["lr"], lr_scheduler_type="constant",
        adam_beta1=opt["betas"][0], adam_beta2=opt["betas"][1], weight_decay=opt["weight_decay"],
        max_grad_norm=opt["max_grad_norm"], beta=0.0, loss_type="dapo", scale_rewards="none",
    )
    log: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log.append({"step": state.global_step, "time": time.time(), "reward": logs["reward"],
                            "mean_length": logs.get("completions/mean_length")})

    class Stop(TrainerCallback):  # the budget is steps, but there is no point going on once 0.9 is held
        def on_log(self, args, state, control, logs=None, **kw):
            if variant.target is not None and len(log) >= 5 and min(x["reward"] for x in log[-5:]) >= variant.target:
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Record(), Stop()])
    t_loop = time.time()
    trainer.train()
    t_end = time.time()
    tokens = sum((x["mean_length"] or 0) * o["rollouts_per_step"] for x in log)
    return _summary("trl", [x["reward"] for x in log], [x["time"] for x in log], T_START, t_loop, t_end, tokens,
                    {"trl": __import__("trl").__version__})


def _summary(side, rewards, times, t0, t_loop, t_end, tokens, extra) -> dict:
    hit = next((i for i, rw in enumerate(rewards) if rw >= TARGET), None)
    return {
        "side": side, "steps": len(rewards), "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None, "reward_max": max(rewards, default=None),
        "steps_to_target": None if hit is None else hit + 1,
        "wall_to_target_s": None if hit is None else times[hit] - t0,
        "startup_s": t_loop - t0, "loop_s": t_end - t_loop, "completion_tokens": tokens,
        "rollout_tokens_per_s": tokens / (t_end - t_loop) if t_end > t_loop else None, **extra,
    }


def _median(values):
    return statistics.median(values) if values else None


def rlctl_summary(run: Path, t0: float | None) -> dict:
    from rlctl.launchers.run_summary import by_step
    from rlctl.orchestrator.exchange.metrics import read_records

    metrics = read_records(run)
    orch, trainer = by_step(metrics, "orchestrator"), by_step(metrics, "trainer")
    if t0 is None:
        t0 = float(json.loads((run / "run.json").read_text())["submit_time"])
    # The loop starts when the first batch starts being collected: its end minus its own step time.
    t_loop = orch[0]["time"] - orch[0]["orchestrator_step_time_s"]
    t_end = max(r["time"] for r in trainer + orch)
    tokens = sum(r["tokens"] for r in orch)
    steady = orch[3:] if len(orch) > 6 else orch  # past the start-up batches
    # The mean interval over the steady window, not the median: batches in flight together finish in pairs,
    # so the intervals alternate short and long and their median lands on either (0.34 s where the window's
    # mean was 0.39 s in one run).
    span, n = steady[-1]["time"] - steady[0]["time"], len(steady) - 1
    return _summary("rlctl", [r["reward_mean"] for r in orch], [r["time"] for r in orch], t0, t_loop, t_end,
                    tokens, {"step_interval_s": span / n if n else None,
                             "step_intervals_s": [b["time"] - a["time"] for a, b in zip(steady, steady[1:])],
                             "steady_window": (steady[0]["time"], steady[-1]["time"], n),
                             "trainer_step_s": _median([r["trainer_step_time_s"] for r in trainer
                                                        if "trainer_step_time_s" in r][3:]),
                             "orchestrator_tokens_per_s_median": _median([r["tokens_per_s"] for r in orch])})


def launch_rlctl(variant: Variant, out_root: Path, model_dir: Path | None) -> dict:
    """`rlctl launch` of the variant, watched from outside for the start-up timeline (bench_startup)."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_startup import launch_and_watch

    extra = [f"model.name={json.dumps(str(model_dir))}"] if model_dir else []
    args = argparse.Namespace(recipe=str(TINY), override=[*variant.overrides, *extra], steps=None)
    t0 = time.time()
    sampler = CpuSampler(out_root)
    sampler.start()
    watcher, first_step, rc = launch_and_watch(out_root, args)
    sampler.stop.set()
    sampler.join()
    if rc != 0:
        sys.exit(f"rlctl launch failed (exit {rc})")
    summary = rlctl_summary(next(out_root.iterdir()), t0)
    summary["cpu_per_step_s"] = sampler.per_step(*summary.pop("steady_window"))
    timeline = {name: round(t - watcher.launched, 2) for name, t in watcher.seen.items()}
    if first_step is not None:
        timeline["first trainer step starts"] = round(
            first_step["time"] - first_step["trainer_step_time_s"] - first_step.get("weight_publish_s", 0.0) - watcher.launched, 2)
    summary["startup_timeline_s"] = dict(sorted(timeline.items(), key=lambda kv: kv[1]))
    return summary


def _child(side: str, variant_name: str, python: str, model_dir: Path | None, max_steps: int,
           overrides: list[str]) -> dict:
    """A side in a fresh interpreter: its start-up and imports are part of its wall time, as rlctl's are."""
    cmd = [python, __file__, "--side", side, "--variant", variant_name, "--trl-max-steps", str(max_steps)]
    cmd += [arg for o in overrides for arg in ("-o", o)]
    if model_dir:
        cmd += ["--model-dir", str(model_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "RLCTL_BENCH_CHILD": "1", "OMP_NUM_THREADS": str(os.cpu_count())})
    if out.returncode != 0:
        sys.exit(f"{side} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=[*VARIANTS, "all"], default="all")
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter with trl + accelerate installed")
    ap.add_argument("--trl-max-steps", type=int, default=400)
    ap.add_argument("--side", choices=["all", "trl", "rlctl", "vllm-alone"], nargs="+", default=["all"],
                    help="sides to run (rlctl vllm-alone: the overhead without TRL installed)")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override added to the variant's, for every side (repeatable)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="rlctl runs of a variant, each between two vLLM-alone measurements: the overhead of each "
                    "and their median (the host's speed drifts more than the goal's margin)")
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)  # a child side gets the shared model
    ap.add_argument("--json", action="store_true", help="the results as JSON, with each run's overhead")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat: at least 1")
    if os.environ.get("RLCTL_BENCH_CHILD"):
        variant = _with(args.variant, args.override)
        with tempfile.TemporaryDirectory(prefix="rlctl-peer-") as tmp:
            if args.side == ["trl"]:
                row = run_trl(variant, args.trl_max_steps, Path(tmp), args.model_dir)
            else:
                recipe = _recipe(variant)
                use_server_settings(recipe)  # before building the model imports torch
                row = vllm_alone(recipe, _model_or_tiny(recipe, args.model_dir, Path(tmp)))
        print(json.dumps(row))
        return
    results, sides = {}, set(args.side)
    for name in VARIANTS if args.variant == "all" else [args.variant]:
        variant, rows = _with(name, args.override), {}
        with tempfile.TemporaryDirectory(prefix="rlctl-peer-") as tmp:
            model_dir = build_model(variant, Path(tmp))
            alone = sides & {"all", "vllm-alone"} and variant.overhead_goal is not None

            def measure_alone():
                return _child("vllm-alone", name, sys.executable, model_dir, 0, args.override) if alone else None
            before = measure_alone()
            if sides & {"all", "rlctl"}:
                for i in range(args.repeat):
                    run = launch_rlctl(variant, Path(tmp) / f"runs{i}", model_dir)
                    after = measure_alone()  # again right after it: see `around`
                    rows.setdefault("repeats", []).append((run, after and around(before, after)))
                    before = after
                rows["rlctl"], rows["vllm-alone"] = rows["repeats"][0]
            else:
                rows["vllm-alone"] = before
            if sides & {"all", "trl"}:
                rows["trl"] = _child("trl", name, args.trl_python, model_dir, args.trl_max_steps, args.override)
        results[name] = rows
        if not args.json:
            report(name, variant, rows)
    if args.json:
        print(json.dumps({name: json_rows(rows) for name, rows in results.items()}, indent=2))


if __name__ == "__main__":
    main()
