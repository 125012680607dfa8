"""Router replay (R3): the trainer/inference mismatch KL on the tiny MoE, with and without replay.

    python bench/bench_router_replay.py [--policy RUN/weights/step_N] [--prompts 32] [--samples 4]
                                        [--max-tokens 24] [--serve-dtype bfloat16] [--trainer-dtype bfloat16]

The policy is a trained tiny MoE: the last weights of `--policy`'s run, or of a tiny-moe-cpu run the
bench launches first (`rlctl launch recipes/tiny-moe-cpu.toml --wait`, a few minutes). At random
initialisation the experts barely change the output, so which ones a token goes through hardly shows.
One vLLM CPU server (`python -m rlctl.inference`, routed experts on) serves it in `--serve-dtype`
(bf16 by default, as RL inference usually runs; the trainer computes in the recipe's fp32): small
numeric differences then flip the top-k choice of tokens whose router scores nearly tie, and a flipped
token goes through different experts in the trainer than it did when it was sampled. The bench samples
completions at temperature 1 with the experts vLLM routed each token to, then scores them the way the
trainer does (fp32, rlctl's grouped experts) twice: routing recomputed by the trainer's routers, and
routing replayed from vLLM (`rlctl.trainer.moe.routing_replay`). It prints the mismatch KL of both
(the trainer's `mismatch_kl` metric: k3 estimate of KL(inference || trainer) per completion token),
their ratio, and the share of token-layers whose recomputed top-k differs from vLLM's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weight_sync import _start_server, _stop_server  # noqa: E402  (one way to start a server)


async def _sample(url: str, api_key: str, prompts: list[list[int]], samples: int, max_tokens: int) -> list[dict]:
    from rlctl.inference.client import InferenceClient, decode_routed_experts, routed_experts_payload

    async with InferenceClient(url, api_key) as client:
        responses = await asyncio.gather(*(
            client.complete(p, max_tokens=max_tokens, temperature=1.0, n=samples,
                            extra={"routed_experts_prompt_start": 0}) for p in prompts))
    out = []
    for response in responses:
        for choice in response["choices"]:
            prompt, completion = choice["prompt_token_ids"], choice["token_ids"]
            routed = decode_routed_experts(choice["routed_experts"])
            out.append({"ids": prompt + completion, "prompt_len": len(prompt),
                        "logprobs": choice["logprobs"]["token_logprobs"],
                        "routed": routed_experts_payload(routed, len(prompt), len(completion))})
    return out


def _launch_training(work: Path) -> Path:
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-moe-cpu.toml"
    cmd = [sys.executable, "-m", "rlctl.cli.main", "launch", str(recipe), "--name", "policy",
           "-o", f"deployment.output_dir={work}", "--wait"]
    print("training the policy:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return work / "policy"


def _trainer_logprobs(model, sample: dict, replay: bool):
    """The trainer's logprobs of the completion tokens, computed as trainer/loss.py does."""
    import torch

    from rlctl.trainer.loss import token_logprobs_and_entropy
    from rlctl.trainer.moe import routing_replay

    ids = torch.tensor([sample["ids"]])
    with torch.no_grad(), routing_replay(model, sample["routed"].unsqueeze(0) if replay else None):
        logp, _ = token_logprobs_and_entropy(model(input_ids=ids).logits, ids)
    return logp[:, sample["prompt_len"]:]


def _mismatch_kl(trainer_logp, inference_logp: list[float], loss_config) -> tuple[float, int]:
    """(summed mismatch KL, tokens) as the trainer's loss reports them (`mismatch_kl_sum`), in fp64."""
    import torch

    from rlctl.trainer.loss import importance_ratio_loss

    inference = torch.tensor([inference_logp], dtype=torch.float64)
    every_token = torch.ones_like(inference, dtype=torch.bool)
    _, m = importance_ratio_loss(trainer_logp.double(), inference, torch.zeros(1), every_token, loss_config)
    return float(m["mismatch_kl_sum"]), int(m["tokens"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--serve-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--trainer-dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--seed", type=int, default=0, help="prompts' seed")
    p.add_argument("--policy", type=Path, default=None,
                   help="a finished tiny-moe-cpu run directory (default: launch one first)")
    args = p.parse_args(argv)

    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.trainer.tiny_model import TINY_QWEN3_MOE

    work = Path(tempfile.mkdtemp(prefix="bench-router-replay-"))
    try:
        model_dir = _policy_model(work, args.policy or _launch_training(work))
        rng = random.Random(args.seed)
        vocab = TINY_QWEN3_MOE["vocab_size"]
        prompts = [[1] + [rng.randrange(4, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(args.prompts)]
        run = RunDir(work / "run")
        run.create()
        overrides = ["trainer.router_replay=true", f'inference.dtype="{args.serve_dtype}"', "inference.max_model_len=64"]
        proc, info = _start_server(run, str(model_dir), work / "inference.log", overrides)
        try:
            samples = asyncio.run(_sample(info["url"], run.api_key(), prompts, args.samples, args.max_tokens))
        finally:
            _stop_server(run, proc)
        _report(model_dir, samples, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _policy_model(work: Path, run: Path) -> Path:
    """The tiny MoE's model directory (config, tokenizer) with the run's newest published weights."""
    from rlctl.orchestrator.exchange.steps import complete_steps, step_dir_name
    from rlctl.trainer.tiny_model import build_tiny_model

    steps = complete_steps(run / "weights")
    if not steps:
        raise SystemExit(f"{run}: no published weights (weights/step_N/COMPLETE)")
    policy = run / "weights" / step_dir_name(steps[-1])
    print(f"policy: {policy}")
    model_dir = build_tiny_model(work / "model", seed=0, name="tiny-qwen3-moe")
    for f in model_dir.glob("model*.safetensors*"):
        f.unlink()
    for f in policy.glob("model*.safetensors*"):
        shutil.copy(f, model_dir / f.name)
    return model_dir


def _report(model_dir: Path, samples: list[dict], args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.recipes.load import load_recipe
    from rlctl.trainer.moe import enable_grouped_experts, replay_counts

    loss_config = load_recipe(["tiny-moe-cpu"], []).trainer.loss
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.trainer_dtype))
    enable_grouped_experts(model)  # as the trainer runs it
    kl = {"recomputed": 0.0, "replayed": 0.0}
    tokens = 0
    replay_counts(model)  # reset: counted from here, by the replayed forwards only
    for sample in samples:
        for mode in kl:
            total, n = _mismatch_kl(_trainer_logprobs(model, sample, mode == "replayed"), sample["logprobs"],
                                    loss_config)
            kl[mode] += total
        tokens += n
    replayed, differing = replay_counts(model).tolist()  # token-layers vLLM ran, and those routed otherwise
    without, with_replay = kl["recomputed"] / tokens, kl["replayed"] / tokens
    print(json.dumps({"serve_dtype": args.serve_dtype, "trainer_dtype": args.trainer_dtype,
                      "completions": len(samples), "tokens": tokens,
                      "token_layers_routed_differently": round(differing / max(replayed, 1), 4)}))
    print(f"mismatch KL without replay: {without:.3e}")
    print(f"mismatch KL with replay:    {with_replay:.3e}")
    print(f"ratio with/without: {with_replay / without if without else float('nan'):.3f} (goal <= 0.333)")


if __name__ == "__main__":
    sys.exit(main())
