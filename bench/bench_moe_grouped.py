"""Trainer tokens/s of a tiny MoE (forward + backward): rlctl's grouped experts vs transformers' loop.

The model is the built-in `tiny-qwen3-moe` config (optionally with more experts), fp32 on CPU. Three
runs of the same weights and tokens:
- `loop`: transformers' eager experts (`experts_implementation="eager"`: one Python iteration per
  expert hit, gathering its tokens),
- `transformers grouped_mm`: transformers' own grouped implementation (its default since 5.x), shown
  for reference,
- `rlctl grouped`: `rlctl.trainer.moe.enable_grouped_experts` (routing + experts patched; what the
  trainer runs).
A step is forward + backward of a next-token loss over `--batch` × `--seq` tokens; the median of
`--steps` timed steps after two warm-up steps.

The defaults give the tiny model qwen3-30b-a3b's routing (128 experts, top-8), where the loop's
per-expert overhead shows. With the recipe's own 8 or 16 experts, top-2, at hidden 64 the experts are
a small share of a CPU step (attention and the dense matmuls dominate): expect a ratio near 1.

    python bench/bench_moe_grouped.py [--experts 128] [--top-k 8] [--batch 64] [--seq 32] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def build(experts: int, top_k: int, implementation: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlctl.trainer.tiny_model import TINY_MODELS

    skip = ("architectures", "model_type", "torch_dtype")
    cfg = {k: v for k, v in TINY_MODELS["tiny-qwen3-moe"].items() if k not in skip}
    cfg.update(num_experts=experts, num_experts_per_tok=top_k, use_cache=False)
    config = AutoConfig.for_model("qwen3_moe", **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)  # spread the tokens over the experts
    return model


def step_seconds(model, ids: torch.Tensor, steps: int) -> float:
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        flat = logits[:, :-1].reshape(-1, logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from rlctl.trainer.moe import enable_grouped_experts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    loop = build(args.experts, args.top_k, "eager")
    hf_grouped = build(args.experts, args.top_k, "grouped_mm")
    ours = copy.deepcopy(loop)
    enable_grouped_experts(ours)
    vocab = loop.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # same function: the comparison is of speed only
        a, b = loop(input_ids=ids).logits, ours(input_ids=ids).logits
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), float((a - b).abs().max())
    tokens = ids.numel()
    print(f"tiny-qwen3-moe, {args.experts} experts top-{args.top_k}, hidden {loop.config.hidden_size}, "
          f"expert intermediate {loop.config.moe_intermediate_size}, {loop.config.num_hidden_layers} layers; "
          f"{args.batch}×{args.seq} = {tokens} tokens per step, forward+backward, {args.threads} thread(s)")
    results = {}
    for name, model in (("loop (transformers eager)", loop), ("transformers grouped_mm", hf_grouped),
                        ("rlctl grouped", ours)):
        seconds = step_seconds(model, ids, args.steps)
        results[name] = tokens / seconds
        print(f"  {name:28s} {seconds * 1000:8.1f} ms/step  {tokens / seconds:10.0f} tokens/s")
    ratio = results["rlctl grouped"] / results["loop (transformers eager)"]
    print(f"rlctl grouped / per-expert loop: {ratio:.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
