"""Peer benchmark: the tiny task run by TRL's synchronous `GRPOTrainer` vs rlctl's asynchronous stack.

Both sides train the same tiny Qwen3 (`build_tiny_model`, same seed) on the same environment (`sequence`
with the args of recipes/tiny-cpu.toml, same reward) on the same CPU, with the recipe's batch shape and
optimiser: 32 prompts x 16 completions per step, at most 2 completion tokens, temperature 1, AdamW at the
recipe's lr, grad-norm clip 1, no KL term, advantages = reward - group mean, loss normalised by the token count.
TRL generates with transformers' `generate` between optimiser steps (its default, no vLLM); rlctl runs a
vLLM CPU server + router + orchestrator + 2-rank FSDP2 trainer overlapping by one policy step.

Reported per side: wall time from start (before imports / before `rlctl launch`) to the first step whose
mean reward is >= 0.9, the reward reached, and rollout throughput = completion tokens generated / wall
time of the training loop (what the whole system delivers, generation and training together).

    python bench/bench_peer_trl.py [--trl-python PY] [--trl-max-steps 400] [--rlctl-run RUN_DIR]

`--trl-python` runs the TRL side with another interpreter (a venv with trl + accelerate + this package);
`--rlctl-run` reads an already finished run of the tiny recipe instead of launching one (start = its
run.json submit_time, which leaves out the CLI's own start-up of ~1 s).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.time()  # before the heavy imports: TRL's start-up counts
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny-cpu.toml"
TARGET = 0.9


def _recipe() -> dict:
    from rlctl.recipes.load import compose, validate

    return validate(compose([str(TINY)], [])).model_dump()


def run_trl(max_steps: int, out_dir: Path) -> dict:
    """The TRL side, in this process (run with the interpreter that has trl)."""
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlctl.orchestrator.environments import Prompt, load_environment
    from rlctl.trainer.tiny_model import build_tiny_model

    r = _recipe()
    o, opt = r["orchestrator"], r["trainer"]["optimizer"]
    env = load_environment(o["environment"]["name"], o["environment"]["args"])
    prompts_per_step = o["rollouts_per_step"] // o["group_size"]
    drawn = env.sample_prompts(random.Random(o["seed"]), prompts_per_step * max_steps)
    data = Dataset.from_list([{"prompt": p.text, "target": p.target} for p in drawn])

    def reward(prompts, completions, target, **_):
        return [env.reward(Prompt(p, t), c) for p, c, t in zip(prompts, completions, target)]

    model_dir = build_tiny_model(out_dir / "model", seed=r["model"]["build_seed"])
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

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Record()])

    class Stop(TrainerCallback):  # the budget is steps, but there is no point going on once 0.9 is held
        def on_log(self, args, state, control, logs=None, **kw):
            if len(log) >= 5 and min(x["reward"] for x in log[-5:]) >= TARGET:
                control.should_training_stop = True

    trainer.add_callback(Stop())
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
    per_step = sorted(r["tokens_per_s"] for r in orch)
    return _summary("rlctl", [r["reward_mean"] for r in orch], [r["time"] for r in orch], t0, t_loop, t_end,
                    tokens, {"orchestrator_tokens_per_s_median": per_step[len(per_step) // 2]})


def launch_rlctl(out_root: Path) -> dict:
    t0 = time.time()
    rlctl = Path(sys.executable).with_name("rlctl")
    subprocess.run([str(rlctl), "launch", str(TINY), "--name", "peer-bench", "-o", f"deployment.output_dir={out_root}",
                    "--wait"], check=True, stdout=subprocess.DEVNULL)
    return rlctl_summary(out_root / "peer-bench", t0)


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter with trl + accelerate installed")
    ap.add_argument("--trl-max-steps", type=int, default=400)
    ap.add_argument("--rlctl-run", type=Path, help="a finished run of recipes/tiny-cpu.toml to read instead of launching")
    ap.add_argument("--side", choices=["both", "trl", "rlctl"], default="both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlctl-peer-") as tmp:
        if args.side == "trl" and os.environ.get("RLCTL_BENCH_TRL_CHILD"):
            print(json.dumps(run_trl(args.trl_max_steps, Path(tmp))))
            return
        rows = []
        if args.side in ("both", "rlctl"):
            rows.append(rlctl_summary(args.rlctl_run, None) if args.rlctl_run else launch_rlctl(Path(tmp)))
        if args.side in ("both", "trl"):
            # A fresh interpreter: its start-up and imports are part of TRL's wall time, as rlctl's are.
            out = subprocess.run([args.trl_python, __file__, "--side", "trl", "--trl-max-steps", str(args.trl_max_steps)],
                                 capture_output=True, text=True, check=False,
                                 env={**os.environ, "RLCTL_BENCH_TRL_CHILD": "1", "OMP_NUM_THREADS": str(os.cpu_count())})
            if out.returncode != 0:
                sys.exit(f"TRL side failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"| side | start-up s | wall to reward {TARGET} s | steps to {TARGET} | reward first -> last (steps) "
          "| reward max | rollout tok/s (loop) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {_fmt(r['startup_s'])} | {_fmt(r['wall_to_target_s'])} | {r['steps_to_target'] or '-'} "
              f"| {_fmt(r['reward_first'], '.3f')} -> {_fmt(r['reward_last'], '.3f')} ({r['steps']}) "
              f"| {_fmt(r['reward_max'], '.3f')} | {_fmt(r['rollout_tokens_per_s'], '.0f')} |")


if __name__ == "__main__":
    main()
