"""Replay the multi-turn tool recipe's learning problem in pure torch, over many sampling seeds.

Like bench/replay_tiny_recipe.py (read it first), for recipes/tiny-tools-cpu.toml: the same tiny model,
`tool_lookup` environment (its prompts, tool replies and reward), loss, AdamW settings and batch shape,
batch N sampled by policy N-1; turn 1, the tool's reply (loss mask 0, as in the real rollout files),
turn 2. It is how the recipe's learning rate, group size and step count were chosen:

    python bench/replay_tools_recipe.py [--seeds 8] [--workers 2] [-o trainer.optimizer.lr=3e-3 ...]

Prints per seed the first-step reward, the first step >= 0.8 and the last-5-step mean.
"""
from __future__ import annotations

import argparse
import copy
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-tools-cpu.toml")


def replay(seed: int, overrides: list[str], model_dir: str, lag: int = 1) -> list[float]:
    """Mean reward per step of one replay with sampling seed `seed`, batch N sampled by policy N - lag."""
    import json

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rlctl.orchestrator.advantages import group_advantages
    from rlctl.orchestrator.environments import load_environment
    from rlctl.recipes.load import load_recipe
    from rlctl.trainer.loss import importance_ratio_loss, token_logprobs_and_entropy
    from rlctl.trainer.lr_schedule import build_scheduler
    from rlctl.trainer.tiny_model import EOS_ID, PAD_ID, vocab

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    recipe = load_recipe([RECIPE], overrides)
    o, opt_cfg, loss_cfg = recipe.orchestrator, recipe.trainer.optimizer, recipe.trainer.loss
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sampler = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                                  weight_decay=opt_cfg.weight_decay)
    scheduler = build_scheduler(optimizer, opt_cfg, o.max_steps)
    env = load_environment(o.environment.name, o.environment.args)
    ids_of = vocab()
    chars = {i: c for c, i in ids_of.items()}
    rng = random.Random(seed)
    G, n_prompts = o.group_size, o.rollouts_per_step // o.group_size

    def text(row) -> str:
        return "".join(chars[i] for i in row.tolist() if i not in (PAD_ID, EOS_ID))

    budget = o.max_trajectory_tokens or o.max_turns * o.max_tokens

    def turn(seq, alive, used):
        start = seq.shape[1]
        for _ in range(min(o.max_tokens, budget - used)):
            probs = torch.softmax(sampler(seq).logits[:, -1].float() / o.temperature, -1)
            nxt = torch.where(alive, torch.multinomial(probs, 1).squeeze(1), PAD_ID)
            seq = torch.cat([seq, nxt[:, None]], 1)
            alive = alive & (nxt != EOS_ID)  # vLLM ends a turn at EOS (the EOS itself is trained on)
        return seq, seq[:, start:]

    rewards, history = [], []
    for _ in range(o.max_steps):
        prompts = [p for p in env.sample_prompts(rng, n_prompts) for _ in range(G)]
        seq = torch.tensor([[ids_of[c] for c in p.text] for p in prompts])
        mask = torch.zeros_like(seq, dtype=torch.bool)
        with torch.no_grad():
            seq, call = turn(seq, torch.ones(len(seq), dtype=torch.bool), 0)
            mask = torch.cat([mask, call != PAD_ID], 1)
            calls = [text(row) for row in call]
            reply = torch.tensor([[ids_of[c] for c in env.reply(p, c)] for p, c in zip(prompts, calls)])
            seq, mask = torch.cat([seq, reply], 1), torch.cat([mask, torch.zeros_like(reply, dtype=torch.bool)], 1)
            seq, answer = turn(seq, torch.ones(len(seq), dtype=torch.bool), call.shape[1] + reply.shape[1])
            mask = torch.cat([mask, answer != PAD_ID], 1)
            inf_lp, _ = token_logprobs_and_entropy(sampler(seq).logits / o.temperature, seq)
        r = [env.reward(p, json.dumps({"call": c, "answer": text(a)})) for p, c, a in zip(prompts, calls, answer)]
        adv = torch.tensor([a for g in range(n_prompts)
                            for a in group_advantages(r[g * G:(g + 1) * G], o.normalize_advantages)])
        # the sampler serves the policy `lag` steps behind the one about to be trained
        history.append(copy.deepcopy(model.state_dict()))
        sampler.load_state_dict(history.pop(0) if len(history) >= lag else history[0])
        logp, ent = token_logprobs_and_entropy(model(seq).logits, seq, entropy_grad=loss_cfg.entropy_coef > 0)
        loss, _ = importance_ratio_loss(logp, inf_lp, adv, mask, loss_cfg, entropy=ent)
        optimizer.zero_grad()
        loss.backward()
        if opt_cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        rewards.append(sum(r) / len(r))
    return rewards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8, help="sampling seeds 0..N-1")
    ap.add_argument("--workers", type=int, default=2, help="seeds replayed in parallel (one core each)")
    ap.add_argument("--lag", type=int, default=1, help="policy lag of every batch (the real loop: 0 or 1)")
    ap.add_argument("-o", "--override", action="append", default=[], help="recipe override key=value")
    args = ap.parse_args()

    from rlctl.recipes.load import load_recipe
    from rlctl.trainer.tiny_model import build_tiny_model

    recipe = load_recipe([RECIPE], args.override)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "model", seed=recipe.model.build_seed))
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(replay, range(args.seeds), [args.override] * args.seeds, [model_dir] * args.seeds,
                                  [args.lag] * args.seeds))
    ended = 0
    for seed, rw in enumerate(runs):
        first = next((i for i, x in enumerate(rw) if x >= 0.8), None)
        last5 = sum(rw[-5:]) / 5
        ended += last5 >= 0.8
        print(f"seed {seed:2d}: start {rw[0]:.3f}  first step >= 0.8: {first if first is not None else '-':>3}  "
              f"last 5 steps {last5:.3f}  curve {' '.join(f'{x:.2f}' for x in rw[::5])}")
    print(f"{ended}/{len(runs)} ended >= 0.8 (overrides: {' '.join(args.override) or 'none'})")


if __name__ == "__main__":
    main()
