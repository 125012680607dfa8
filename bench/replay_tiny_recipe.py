"""Replay the tiny recipe's learning problem in pure torch, over many sampling seeds, in seconds per seed.

The real run needs vLLM, the router and two trainer ranks, ≈ 4 minutes for one sample of a noisy
learning curve. This replay keeps what decides whether the policy learns — the same tiny model, task,
group-relative advantages, loss (rlctl.trainer.loss), AdamW settings and batch shape, with batch N
sampled by policy N-1 (the recipe's `max_off_policy_steps = 1`) — and drops the serving stack. It
is how the recipe's learning rate and target length were chosen; run it before changing them:

    python bench/replay_tiny_recipe.py [--recipe tiny-moe-cpu] [--seeds 16] [--first-seed 0] [--workers 2] [-o trainer.optimizer.lr=5e-3 ...]

`--recipe` replays another tiny recipe of the same task family (tiny-moe-cpu: the MoE model, run with
transformers' own MoE blocks; expert parallelism changes no number, see tests/test_moe.py).

Prints, per seed, the first step whose mean reward is >= 0.8 and the mean reward of the last 10 and the
last 5 steps (what tests/test_e2e_lora.py, and test_e2e_local.py / test_e2e_pool.py, check of a real
run), then how many seeds reached 0.8 and ended at >= 0.8, the five worst endings (last 5 steps: a
test that checks every run fails with the tail, not the median) and the median first step >= 0.8.
"""
from __future__ import annotations

import argparse
import copy
import random
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def replay(seed: int, recipe_path: str, overrides: list[str], model_dir: str) -> list[float]:
    """Mean reward per step of one replay of the recipe with sampling seed `seed`."""
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
    torch.set_num_threads(1)  # one seed per core: the model is far too small to gain from threads
    torch.manual_seed(seed)
    recipe = load_recipe([recipe_path], overrides)
    o, opt_cfg, loss_cfg = recipe.orchestrator, recipe.trainer.optimizer, recipe.trainer.loss
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if recipe.trainer.lora.enabled:  # the trainer's own adapters: only they train
        from rlctl.trainer.lora import apply_lora, init_adapters

        apply_lora(model, recipe.trainer.lora)
        init_adapters(model, seed=0)
    sampler = copy.deepcopy(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                                  weight_decay=opt_cfg.weight_decay)
    scheduler = build_scheduler(optimizer, opt_cfg, o.max_steps)
    env = load_environment(o.environment.name, o.environment.args)
    ids_of = vocab()
    chars = {i: c for c, i in ids_of.items()}
    rng = random.Random(seed)
    G, n_prompts = o.group_size, o.rollouts_per_step // o.group_size
    rewards = []
    for _ in range(o.max_steps):
        prompts = env.sample_prompts(rng, n_prompts)
        seq = torch.tensor([[ids_of[c] for c in p.text] for p in prompts]).repeat_interleave(G, 0)
        P = seq.shape[1]
        with torch.no_grad():  # sample with the previous policy, like a server one reload behind
            alive = torch.ones(len(seq), dtype=torch.bool)
            for _ in range(o.max_tokens):
                probs = torch.softmax(sampler(seq).logits[:, -1].float() / o.temperature, -1)
                nxt = torch.where(alive, torch.multinomial(probs, 1).squeeze(1), PAD_ID)
                seq = torch.cat([seq, nxt[:, None]], 1)
                alive &= nxt != EOS_ID  # vLLM stops a completion at EOS; the EOS token itself is trained on
            inf_lp, _ = token_logprobs_and_entropy(sampler(seq).logits / o.temperature, seq)
        loss_mask = torch.zeros_like(seq, dtype=torch.bool)
        loss_mask[:, P:] = seq[:, P:] != PAD_ID
        texts = ["".join(chars[i] for i in row[P:].tolist() if i not in (PAD_ID, EOS_ID)) for row in seq]
        r = [env.reward(prompts[i // G], t) for i, t in enumerate(texts)]
        adv = torch.tensor([a for g in range(n_prompts)
                            for a in group_advantages(r[g * G:(g + 1) * G], o.normalize_advantages)])
        sampler.load_state_dict(model.state_dict())  # the next batch comes from this step's policy
        logp, ent = token_logprobs_and_entropy(model(seq).logits, seq, entropy_grad=loss_cfg.entropy_coef > 0)
        loss, _ = importance_ratio_loss(logp, inf_lp, adv, loss_mask, loss_cfg, entropy=ent)
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
    ap.add_argument("--recipe", default="tiny-cpu", help="a tiny recipe under recipes/ (tiny-cpu, tiny-moe-cpu)")
    ap.add_argument("--seeds", type=int, default=16, help="sampling seeds FIRST..FIRST+N-1")
    ap.add_argument("--first-seed", type=int, default=0, help="the first sampling seed")
    ap.add_argument("--workers", type=int, default=2, help="seeds replayed in parallel (one core each)")
    ap.add_argument("-o", "--override", action="append", default=[], help="recipe override key=value")
    args = ap.parse_args()

    from rlctl.recipes.load import load_recipe
    from rlctl.trainer.tiny_model import build_tiny_model

    recipe_path = str(RECIPES / f"{args.recipe}.toml")
    recipe = load_recipe([recipe_path], args.override)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "model", seed=recipe.model.build_seed, name=recipe.model.name))
        n = args.seeds
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(replay, range(args.first_seed, args.first_seed + n), [recipe_path] * n, [args.override] * n, [model_dir] * n))
    report(runs, args.first_seed)
    print(f"(overrides: {' '.join(args.override) or 'none'})")


def report(runs: list[list[float]], first_seed: int) -> None:
    firsts, endings, reached = [], [], 0
    for seed, rw in enumerate(runs, first_seed):
        first = next((i for i, x in enumerate(rw) if x >= 0.8), None)
        last10, last5 = sum(rw[-10:]) / 10, sum(rw[-5:]) / 5
        reached += first is not None
        firsts.append(len(rw) if first is None else first)  # never reached: sorts after every step
        endings.append((last10, last5))
        print(f"seed {seed:2d}: start {rw[0]:.3f}  first step >= 0.8: {first if first is not None else '-':>3}  "
              f"last 10 steps {last10:.3f}  last 5 {last5:.3f}")
    ended10, ended5 = (sum(e[i] >= 0.8 for e in endings) for i in (0, 1))
    worst5 = sorted(e[1] for e in endings)[:5]
    print(f"{reached}/{len(runs)} seeds reached 0.8 (median first step {sorted(firsts)[len(firsts) // 2]}); ended "
          f">= 0.8: {ended10}/{len(runs)} over the last 10 steps, {ended5}/{len(runs)} over the last 5; worst "
          f"last-5 endings {' '.join(f'{w:.3f}' for w in worst5)}")


if __name__ == "__main__":
    main()
