"""LoRA weight update: swapping the adapter in a running vLLM server vs reloading the full weights.

    python bench/bench_lora_swap.py [--size tiny|medium] [--rank 8] [--repeats 5]

swap   = a LoRA run's update as the orchestrator applies it (`weight_watcher.inference_reloader` on a
         PEFT `weights/step_N/`): pause → `/v1/load_lora_adapter` (load_inplace, same name) → resume,
         after the trainer's adapter-only publish (`lora.write_adapter` through `steps.publish_step`);
reload = a full-weight run's update on a server without LoRA: `FilesystemWeightStore.publish_state` +
         pause → in-place reload over /collective_rpc → resume.
Each server is started with `python -m rlctl.inference` as in a run. Medians over `--repeats`; prints
both, their ratio, the bytes each publishes, and a correctness check: after a swap the server's prompt
logprobs equal a transformers forward of the base + the same adapter (the trainer's LoRALinear).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weight_sync import SIZES, _start_server, _stop_server  # noqa: E402  (one way to start a server)


def _adapter(model_dir: Path, rank: int, seed: int) -> dict:
    """A non-trivial adapter: the trainer's wrapper on the HF model, B drawn small and non-zero."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.trainer.lora import LoRALinear, adapter_state, apply_lora, init_adapters
    from rlctl.trainer.lora_config import LoRAConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    apply_lora(model, LoRAConfig(rank=rank))
    init_adapters(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.copy_(0.05 * torch.randn(m.lora_B.weight.shape, generator=gen))
    return model, adapter_state(model)


def _publish_adapter(run, step: int, tensors: dict, rank: int) -> None:
    from rlctl.orchestrator.exchange.steps import publish_step
    from rlctl.trainer.lora import adapter_config, write_adapter
    from rlctl.trainer.lora_config import LoRAConfig

    config = adapter_config(LoRAConfig(rank=rank), "bench")
    publish_step(run.weights, f"step_{step}", lambda stage: write_adapter(stage, tensors, config),
                 {"step": step, "kind": "lora"}, sync_metadata=False)


async def _served_prompt_logprobs(url: str, api_key: str, ids: list[int]) -> list[float]:
    from rlctl.inference.client import InferenceClient, prompt_logprobs_of

    async with InferenceClient(url, api_key) as client:
        response = await client.complete(ids, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return prompt_logprobs_of(response)[1:]


def _trained_prompt_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits.float().log_softmax(-1)[0]
    return [float(logits[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def _updates(run, model_dir: Path, lora: bool, rank: int, repeats: int, log: Path) -> tuple[list, list, float, int]:
    """(publish seconds, apply seconds, max |served - trained| logprob (LoRA only), bytes per publish)."""
    from safetensors.torch import load_file

    from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore
    from rlctl.orchestrator.weight_watcher import inference_reloader

    overrides = [f"trainer.lora.rank={rank}"] if lora else []
    proc, info = _start_server(run, str(model_dir), log, overrides)
    publish, apply, diff, nbytes = [], [], float("nan"), 0
    loop = asyncio.Runner()
    try:
        reloader, close = inference_reloader([info["url"]], run.admin_token())
        config = json.loads((model_dir / "config.json").read_text())
        base = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
        for step in range(1, repeats + 1):
            t = time.perf_counter()
            if lora:
                model, tensors = _adapter(model_dir, rank, seed=step)
                t = time.perf_counter()
                _publish_adapter(run, step, tensors, rank)
                nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
            else:
                state = {k: v + 1e-3 * step for k, v in base.items()}
                t = time.perf_counter()
                FilesystemWeightStore(run.weights).publish_state(step, state, config)
                nbytes = sum(v.numel() * v.element_size() for v in state.values())
            publish.append(time.perf_counter() - t)
            t = time.perf_counter()
            loop.run(reloader(run.weights / f"step_{step}"))
            apply.append(time.perf_counter() - t)
        if lora:  # the last adapter is served: compare with the trainer's forward of base + adapter
            ids = [1, 7, 12, 9, 15, 4, 22, 5]
            served = loop.run(_served_prompt_logprobs(info["url"], run.api_key(), ids))
            diff = max(abs(a - b) for a, b in zip(served, _trained_prompt_logprobs(model, ids)))
        loop.run(close())
    finally:
        _stop_server(run, proc)
        loop.close()
    return publish, apply, diff, nbytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)

    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.trainer.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-lora-swap-", dir=args.workdir))
    try:
        model_dir = build_tiny_model(work / "model", seed=0, overrides=SIZES[args.size])
        results = {}
        for lora in (True, False):
            run = RunDir(work / ("run-lora" if lora else "run-full"))
            run.create()
            results[lora] = _updates(run, model_dir, lora, args.rank, args.repeats,
                                     work / f"inference-{'lora' if lora else 'full'}.log")
    except Exception:
        for log in work.glob("inference-*.log"):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    (lp, la, diff, lb), (fp, fa, _, fb) = results[True], results[False]
    print(f"model: {args.size}, LoRA rank {args.rank}; medians over {args.repeats} updates")
    print(f"{'':<34}{'publish':>10}{'apply':>10}{'total':>10}{'bytes':>12}")
    for name, pub, app, nbytes in (("adapter swap (load_lora_adapter)", lp, la, lb),
                                   ("full reload (collective_rpc)", fp, fa, fb)):
        print(f"{name:<34}{med(pub) * 1e3:8.1f}ms{med(app) * 1e3:8.1f}ms{med([a + b for a, b in zip(pub, app)]) * 1e3:8.1f}ms"
              f"{nbytes / 2**20:10.2f}MiB")
    swap, full = med([a + b for a, b in zip(lp, la)]), med([a + b for a, b in zip(fp, fa)])
    print(f"ratio full reload / adapter swap (publish + apply): {full / swap:.2f}x; "
          f"apply only: {med(fa) / med(la):.2f}x")
    print(f"served vs trained prompt logprobs after a swap: max |diff| = {diff:.2e}")
    return 0 if diff < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
