"""Router replay's data path: the tiny MoE (built offline, checkpoint names vLLM loads), vLLM's routed
experts decoded into an int16 tensor aligned with the rollout's input_ids (-1 where unknown), stored as
the rollout payload and stacked into `payload.routed_experts` [B, T, layers, top_k]; and the real vLLM
CPU server on the tiny MoE (fused-MoE path, logprobs equal to transformers')."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import random

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from rlctl.inference.client import decode_routed_experts, routed_experts_payload  # noqa: E402
from rlctl.orchestrator.batch import Group, Rollout, build_batch_tensors  # noqa: E402
from rlctl.recipes.errors import RecipeError  # noqa: E402
from rlctl.trainer import tiny_model  # noqa: E402
from rlctl.trainer.tiny_model import TINY_QWEN3_MOE, build_tiny_model  # noqa: E402

LAYERS, TOP_K, EXPERTS = TINY_QWEN3_MOE["num_hidden_layers"], TINY_QWEN3_MOE["num_experts_per_tok"], 8


def encode(array) -> str:
    """What vLLM's `numpy2base64` sends: base64 of the array's `.npy` bytes."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _recipe(*overrides):
    from rlctl.recipes.load import load_recipe

    return load_recipe(["tiny-moe-cpu"], list(overrides))


# ---- the tiny MoE --------------------------------------------------------------------------------------

def test_moe_build_is_deterministic_and_writes_one_tensor_per_expert(tmp_path):
    from safetensors.torch import load_file

    a = build_tiny_model(tmp_path / "a", seed=0, name="tiny-qwen3-moe")
    b = build_tiny_model(tmp_path / "b", seed=0, name="tiny-qwen3-moe")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text()) == TINY_QWEN3_MOE
    state = load_file(a / "model.safetensors")
    assert "lm_head.weight" not in state  # tied, as tiny-qwen3
    for layer in range(LAYERS):
        assert state[f"model.layers.{layer}.mlp.gate.weight"].shape == (EXPERTS, 64)
        for e in range(EXPERTS):
            for proj, shape in (("gate_proj", (64, 64)), ("up_proj", (64, 64)), ("down_proj", (64, 64))):
                assert state[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].shape == shape
    assert not [k for k in state if "gate_up_proj" in k or k.endswith("experts.down_proj")]  # nothing fused
    assert sum(t.numel() for t in state.values()) == tiny_model.parameter_count(TINY_QWEN3_MOE)


def test_moe_loads_in_transformers_with_the_same_weights(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = build_tiny_model(tmp_path / "m", seed=0, name="tiny-qwen3-moe")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    state = load_file(out / "model.safetensors")
    experts = model.model.layers[1].mlp.experts  # fused in memory: gate_up [E, 2I, H], down [E, H, I]
    for e in range(EXPERTS):
        assert torch.equal(experts.gate_up_proj[e, :64], state[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(experts.gate_up_proj[e, 64:], state[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])
        assert torch.equal(experts.down_proj[e], state[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
    assert torch.equal(model.model.layers[0].mlp.gate.weight, state["model.layers.0.mlp.gate.weight"])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_moe_is_in_the_catalog_and_the_recipe_plans():
    from rlctl.recipes.model_catalog import CATALOG
    from rlctl.recipes.plan import plan

    assert CATALOG["tiny-qwen3-moe"] == TINY_QWEN3_MOE
    assert tiny_model.is_tiny_model("tiny-qwen3-moe") and not tiny_model.is_tiny_model("qwen3-30b-a3b")
    assert (_recipe().model.name, _recipe().trainer.ep, _recipe().trainer.router_replay) == ("tiny-qwen3-moe", 2, True)
    report = plan(_recipe())  # the plan sizes the replayed experts of a batch
    assert report.disk["router_replay_bytes_per_batch"] == 512 * 64 * LAYERS * TOP_K * 2  # int16 ids


# ---- decoding and alignment ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32"])
def test_decode_gives_int16_tensor_with_the_same_ids(dtype):
    array = np.random.default_rng(0).integers(0, EXPERTS, size=(9, LAYERS, TOP_K)).astype(dtype)
    routed = decode_routed_experts(encode(array))
    assert routed.dtype == torch.int16 and routed.shape == (9, LAYERS, TOP_K)
    assert torch.equal(routed, torch.from_numpy(array.astype(np.int64)).to(torch.int16))


def test_decode_refuses_what_is_not_integer_rows_layers_topk():
    with pytest.raises(ValueError, match="routed_experts"):
        decode_routed_experts(encode(np.zeros((4, 2), dtype=np.uint8)))
    with pytest.raises(ValueError, match="routed_experts"):
        decode_routed_experts(encode(np.zeros((4, 2, 2), dtype=np.float32)))


def test_payload_rows_align_with_input_ids_and_the_last_token_is_unknown():
    prompt, completion = 4, 3  # vLLM reports rows for tokens 0 .. P + C - 2
    routed = torch.arange((prompt + completion - 1) * LAYERS * TOP_K, dtype=torch.int16).view(-1, LAYERS, TOP_K)
    payload = routed_experts_payload(routed, prompt, completion)
    assert payload.shape == (prompt + completion, LAYERS, TOP_K) and payload.dtype == torch.int16
    assert torch.equal(payload[:-1], routed)
    assert (payload[-1] == -1).all()
    short = routed_experts_payload(routed[:2], prompt, completion)  # e.g. an aborted request: rest unknown
    assert torch.equal(short[:2], routed[:2]) and (short[2:] == -1).all()
    with pytest.raises(ValueError, match="rows"):
        routed_experts_payload(torch.zeros(prompt + completion, LAYERS, TOP_K, dtype=torch.int16), prompt, completion)


def _rollout(group: int, index: int, prompt: int, completion: int, fill: int) -> Rollout:
    r = Rollout(group, index, prompt_ids=[1] * prompt, completion_ids=[5] * completion,
                logprobs=[-0.5] * completion, versions=[0] * completion)
    routed = torch.full((prompt + completion - 1, LAYERS, TOP_K), fill, dtype=torch.int16)
    r.payload["routed_experts"] = routed_experts_payload(routed, prompt, completion)
    return r


def test_batch_stacks_payloads_of_different_lengths_padded_with_minus_one():
    rollouts = [_rollout(0, 0, 3, 2, fill=1), _rollout(0, 1, 3, 5, fill=2)]
    tensors = build_batch_tensors([Group(0, None, rollouts, advantages=[0.5, -0.5])], step=0)
    routed = tensors["payload.routed_experts"]
    T = tensors["input_ids"].shape[1]
    assert routed.shape == (2, T, LAYERS, TOP_K) and routed.dtype == torch.int16 and T == 8
    assert (routed[0, :4] == 1).all() and (routed[0, 4:] == -1).all()  # 5 tokens: last one and padding
    assert (routed[1, :7] == 2).all() and (routed[1, 7:] == -1).all()
    # a known row exactly where attention_mask is on, minus each rollout's last token
    known = (routed != -1).all(-1).all(-1)
    last = tensors["attention_mask"].sum(1) - 1
    expected = tensors["attention_mask"].clone()
    expected[torch.arange(2), last] = False
    assert torch.equal(known, expected)


# ---- the rollout loop asks for whole completions and stores the payload ---------------------------------

def test_loop_stores_routed_experts_of_each_choice(tmp_path):
    pytest.importorskip("aiohttp")
    from aiohttp import web
    from sim_inference import MemoryBatchWriter, completions_endpoint

    from rlctl.orchestrator.environments import load_environment
    from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop

    seen = []

    async def completions(request):
        body = await request.json()
        seen.append(body)
        prompt = [1] + [4 + (ord(c) % 30) for c in body["prompt"]]
        choices = []
        for i in range(body["n"]):
            completion = [7] * (1 + i % body["max_tokens"])
            rows = len(prompt) + len(completion) - 1
            routed = (np.arange(rows * LAYERS * TOP_K) % EXPERTS + i).reshape(rows, LAYERS, TOP_K).astype(np.uint8)
            choices.append({"index": i, "text": "x" * len(completion), "finish_reason": "length",
                            "prompt_token_ids": prompt, "token_ids": completion,
                            "logprobs": {"token_logprobs": [-1.0] * len(completion)},
                            "routed_experts": encode(routed)})
        return web.json_response({"choices": choices})

    async def main():
        settings = LoopSettings(rollouts_per_step=8, group_size=4, max_tokens=3, max_off_policy_steps=1,
                                max_in_flight=8, routed_experts=True)
        env = load_environment("sequence", {"alphabets": ["digits"], "strides": [1], "prompt_len": 3,
                                            "target_len": 2})
        writer = MemoryBatchWriter()
        async with completions_endpoint(completions) as url:
            loop = RolloutLoop(settings, env, url, None, PolicyVersion(0), writer, rng=random.Random(0))
            await asyncio.wait_for(loop.run(), 60)
        return writer.batches

    batches = asyncio.run(main())
    assert all("stream" not in body and body["routed_experts_prompt_start"] == 0 for body in seen)
    tensors = batches[0]
    routed = tensors["payload.routed_experts"]
    B, T = tensors["input_ids"].shape
    assert routed.shape == (B, T, LAYERS, TOP_K) and routed.dtype == torch.int16
    lengths = tensors["attention_mask"].sum(1)
    for b in range(B):
        n = int(lengths[b])
        assert (routed[b, : n - 1] >= 0).all() and (routed[b, n - 1 :] == -1).all()
    assert (tensors["policy_version"][tensors["loss_mask"]] == 0).all()


# ---- server flags ---------------------------------------------------------------------------------------

def test_router_replay_turns_on_routed_experts_in_the_server():
    from pathlib import Path

    from rlctl.inference.server import render_server_command, server_env
    from rlctl.orchestrator.exchange.placement import Placement

    placement = Placement(1, 1, 1, 1, 0, "inference_node")

    def gpu_command(recipe):
        return render_server_command(recipe, placement, "gpu", model_dir="m", host="h", port=1,
                                     has_module=lambda m: True)

    on, off = _recipe("trainer.router_replay=true"), _recipe("trainer.router_replay=false")
    assert "--enable-return-routed-experts" in gpu_command(on)
    assert "--enable-return-routed-experts" not in gpu_command(off)
    # vLLM returns routed experts only from Model Runner V2
    assert server_env(on, "gpu", Path("run"), "a", "b")["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in server_env(off, "gpu", Path("run"), "a", "b")


def test_router_replay_on_cpu_needs_the_aux_output_connector_and_no_model_runner_v2():
    from pathlib import Path

    from rlctl.inference.server import server_env, validate_features, vllm_cpu_returns_routed_experts

    with pytest.raises(RecipeError) as err:
        validate_features(_recipe("trainer.router_replay=true"), "cpu", lambda m: True, routed_experts_cpu=lambda: False)
    assert err.value.key == "trainer.router_replay" and "0.32" in str(err.value)
    validate_features(_recipe("trainer.router_replay=true"), "cpu", lambda m: True, routed_experts_cpu=lambda: True)
    validate_features(_recipe("trainer.router_replay=false"), "cpu", lambda m: True, routed_experts_cpu=lambda: False)
    # V2 needs Triton, which the CPU build lacks: the CPU V1 runner returns them (cpu_routed_experts.py)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in server_env(_recipe("trainer.router_replay=true"), "cpu", Path("r"), "a", "b")
    if pytest.importorskip("vllm"):
        assert vllm_cpu_returns_routed_experts()



# ---- the real vLLM CPU server on the tiny MoE -----------------------------------------------------------

PROMPT = [1] + list(range(4, 24))  # <bos> then 20 characters of the tiny vocabulary


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """`python -m rlctl.inference` on tiny-qwen3-moe, as the launchers start it, routed experts on."""
    pytest.importorskip("vllm")
    from inference_fixtures import served
    from rlctl.orchestrator.exchange.files import atomic_write_json
    from rlctl.orchestrator.exchange.layout import RunDir

    routed = True
    root = tmp_path_factory.mktemp("moe-inference")
    run = RunDir(root / "run")
    run.create()
    atomic_write_json(run.recipe_json, _recipe(f"trainer.router_replay={str(routed).lower()}").model_dump(mode="json"))
    run.admin_token(create=True)
    run.api_key(create=True)
    log = root / "inference.log"
    with served(run, log) as (info, _proc):
        yield run, info, log, routed


def _served(run, info, **extra) -> dict:
    from rlctl.inference.client import InferenceClient

    async def go():
        async with InferenceClient(info["url"], run.admin_token()) as client:
            return await client.complete(PROMPT, max_tokens=6, temperature=0.0, prompt_logprobs=0, extra=extra)

    return asyncio.run(go())


def _transformers_forward(model_dir, ids):
    """Log-probabilities and the experts transformers' routers pick, [T, layers, top_k], for `ids`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    picks = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, li=li: picks.__setitem__(li, out[2]))
             for li, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    for h in hooks:
        h.remove()
    return logp, torch.stack([picks[li] for li in range(len(model.model.layers))], 1)


@pytest.mark.slow
def test_served_tiny_moe_uses_fused_cpu_experts_and_matches_transformers(moe_server):
    from rlctl.inference.client import prompt_logprobs_of

    run, info, log, routed = moe_server
    assert "CPUUnquantizedExperts" in log.read_text()  # vLLM's fused-MoE CPU path, not a per-expert loop
    resp = _served(run, info)
    choice = resp["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert choice["prompt_token_ids"] == PROMPT
    logp, _ = _transformers_forward(run.model, ids)
    p = len(PROMPT)
    prompt_diff = max(abs(x - logp[i, PROMPT[i + 1]].item()) for i, x in enumerate(prompt_logprobs_of(resp)[1:]))
    sampled = choice["logprobs"]["token_logprobs"]
    greedy_diff = max(abs(x - logp[p - 1 + i, t].item()) for i, (x, t) in enumerate(zip(sampled, choice["token_ids"])))
    print(f"\n[measure] tiny MoE served vs transformers: prompt logprobs max |diff| {prompt_diff:.2e}, "
          f"greedy completion {greedy_diff:.2e}")
    assert prompt_diff < 1e-4 and greedy_diff < 1e-4
    assert choice["token_ids"] == logp[p - 1 :].argmax(-1)[: len(choice["token_ids"])].tolist()


@pytest.mark.slow
def test_served_routed_experts_align_and_agree_with_transformers(moe_server):
    run, info, log, routed = moe_server
    assert "routed experts are captured by the CPU model runner" in log.read_text()
    choice = _served(run, info, routed_experts_prompt_start=0)["choices"][0]
    p, c = len(choice["prompt_token_ids"]), len(choice["token_ids"])
    got = decode_routed_experts(choice["routed_experts"])
    assert got.shape == (p + c - 1, LAYERS, TOP_K)  # every layer; the last sampled token never ran
    payload = routed_experts_payload(got, p, c)
    _, picks = _transformers_forward(run.model, choice["prompt_token_ids"] + choice["token_ids"])
    same = (payload[:-1].long().sort(-1).values == picks[:-1].sort(-1).values).all(-1)
    print(f"\n[measure] routed experts equal to transformers' top-{TOP_K} (as sets): "
          f"{same.float().mean().item():.3f} of {same.numel()} token-layers")
    assert same.float().mean() >= 0.95


@pytest.mark.slow
def test_reloaded_moe_weights_match_transformers(moe_server):
    """Last on the module's server (it changes the weights): every tensor perturbed, experts and router
    included, published and reloaded; the server must then compute what transformers computes with the
    new weights. vLLM 0.32's CPU fused-MoE path left the experts unpacked after a reload (off by 0.03
    even for identical weights) until the worker extension repacked them."""
    import shutil

    from safetensors.torch import load_file, save_file

    from rlctl.inference.client import InferenceClient, prompt_logprobs_of, reload_all
    from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore
    from rlctl.trainer.weights import load_config

    run, info, _log, _routed = moe_server
    state = {}
    for f in sorted(run.model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(11)
    new = {k: v + 0.5 * v.std().clamp(min=0.02) * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    config = load_config(run.model)
    names = sorted(new)
    thirds = [{k: new[k].contiguous() for k in names[i::3]} for i in range(3)]  # three ranks' shards
    step_dir = FilesystemWeightStore(run.weights).publish(1, config, thirds)

    async def reload():
        async with InferenceClient(info["url"], run.admin_token()) as client:
            return await reload_all([client], str(step_dir))

    timing = asyncio.run(reload())
    served = prompt_logprobs_of(_served(run, info))[1:]
    # the new policy as a model directory of its own: transformers converts the per-expert checkpoint
    # tensors to its fused layout on load (load_state_dict would silently skip the experts)
    new_dir = run.root / "new-policy"
    shutil.copytree(run.model, new_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(new, str(new_dir / "model.safetensors"))
    logp, _ = _transformers_forward(new_dir, PROMPT)
    old, _ = _transformers_forward(run.model, PROMPT)
    target = [(i, PROMPT[i + 1]) for i in range(len(served))]
    diff = max(abs(x - logp[i, t].item()) for x, (i, t) in zip(served, target))
    moved = max(abs(old[i, t].item() - logp[i, t].item()) for i, t in target)
    print(f"\n[measure] tiny MoE after a reload: served vs transformers max |diff| {diff:.2e} "
          f"(the perturbation moved logprobs by up to {moved:.2f}); reload {timing}")
    assert moved > 0.1  # the check below can tell old weights from new ones
    assert diff < 1e-3
