"""One real vLLM CPU server of a LoRA run (`python -m rlctl.inference`): an adapter swapped in place is
served from what the swap loaded, not read again from its directory at later steps (see
rlctl.inference.vllm_main): the swapped adapter's files can go and the server keeps serving it."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from inference_fixtures import served  # noqa: E402
from rlctl.inference.client import InferenceClient, parse_samples  # noqa: E402
from rlctl.inference.lora_serving import ADAPTER_WEIGHTS, write_zero_adapter  # noqa: E402
from test_inference_reload import make_run  # noqa: E402

LORA = ("model.name=tiny-qwen3-lora", "trainer.lora.rank=8")
PROMPT = [1, 4, 5, 6, 7]


def random_adapter(run, out: Path, seed: int) -> Path:
    """A PEFT adapter whose update is far from zero (random A and B), written as the trainer would."""
    from safetensors.torch import load_file, save_file

    from rlctl.recipes.load import load_recipe

    recipe = load_recipe(["tiny-cpu"], list(LORA))
    path = write_zero_adapter(run.model, recipe.trainer.lora, out)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    return path


async def greedy_logprobs(client: InferenceClient) -> list[float]:
    resp = await client.complete(PROMPT, max_tokens=4, temperature=0.0)
    return parse_samples(resp)[0].logprobs


def test_a_swapped_adapter_is_served_without_its_files(tmp_path):
    run = make_run(tmp_path / "run", *LORA)

    async def check(url: str) -> None:
        # written once the server has built the run's model
        adapters = [random_adapter(run, tmp_path / f"adapter_{i}", seed=i) for i in (1, 2)]
        async with InferenceClient(url, run.admin_token()) as client:
            base = await greedy_logprobs(client)  # the zero adapter the server starts with
            await client.swap_adapter(str(adapters[0]))
            first = await greedy_logprobs(client)
            assert first != pytest.approx(base, abs=1e-3)  # the swap took: not the base any more
            shutil.rmtree(adapters[0])  # as retention does to an older step
            assert await greedy_logprobs(client) == pytest.approx(first, abs=1e-4)
            await client.swap_adapter(str(adapters[1]))
            second = await greedy_logprobs(client)
            assert second != pytest.approx(first, abs=1e-3)
            shutil.rmtree(adapters[1])
            assert await greedy_logprobs(client) == pytest.approx(second, abs=1e-4)

    with served(run, tmp_path / "inference.log") as (info, _):
        asyncio.run(check(info["url"]))
