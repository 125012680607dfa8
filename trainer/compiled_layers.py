"""`trainer.compile = true`: every decoder layer goes through `torch.compile` (inductor).

torchtitan compiles per block too, with FSDP applied last: fully_shard's all-gather and reduce-scatter
hooks then sit between the compiled layers and no collective is traced. One layer's code is compiled
once and serves every layer of its class (their parameters are graph inputs, not constants): a tiny
model with 8 layers compiled in the time one with 2 layers took (15 s on one CPU core). Each layer is
compiled in place (`Module.compile`), not wrapped: a wrapper module would put `_orig_mod.` into the
parameter names that publishing and checkpoints use.

The compiled layer runs *inside* its activation checkpoint, not around it as in torchtitan: with torch
2.13 a compiled CheckpointWrapper captured no graph at all (dynamo skips the wrapper's frame, and the
layer ran eagerly), and an MoE layer's data-dependent dispatch would break the single graph dynamo needs
to trace checkpointing anyway. Inside, the checkpoint's recompute runs the compiled forward again. The
MoE block itself is never traced (moe.enable_grouped_experts): it keeps state between a forward and its
recompute that a traced graph would bake in; attention, norms and dense MLPs around it are compiled.

Shapes are dynamic from the first call: a rollout batch's micro-batches differ in rows and in length
(each is cut to its longest row). What compiling buys is fused elementwise kernels (norms, rotary
embeddings, activations) and fewer launches; matmuls and attention run the same kernels as eager. The
trainer compiles before its first batch, while inference starts (step.warm_up_compile); a length in
another of the power-of-two ranges inductor's CPU kernels are guarded on compiles once more when it
first comes (about 5 s for the tiny model). The tiny model's trainer step then takes 0.8-0.85x the
eager one (docs/trainer.md).
"""
from __future__ import annotations

import importlib.util
import os
import shutil

from rlctl.recipes.errors import RecipeError

KEY = "trainer.compile"
CXX_CANDIDATES = ("g++", "c++", "clang++")
"""The C++ compilers inductor's CPU backend looks for when `CXX` is not set."""


def compile_unavailable_reason(device) -> str | None:
    """Why `torch.compile` cannot build kernels for `device` (a torch.device or its type string); None
    when it can: inductor writes C++ on CPU and Triton on NVIDIA GPUs."""
    kind = device if isinstance(device, str) else device.type
    if kind == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on GPUs needs triton (pip install triton) and it is not installed"
        return None
    if kind == "cpu":
        wanted = os.environ.get("CXX")
        if wanted and shutil.which(wanted) is None:
            return f"torch.compile on CPU needs a C++ compiler; CXX={wanted} is not on PATH"
        if not wanted and not any(shutil.which(c) for c in CXX_CANDIDATES):
            return f"torch.compile on CPU needs a C++ compiler ({', '.join(CXX_CANDIDATES)}); none is on PATH"
        return None
    return f"torch.compile is not set up for {kind} devices here"


def check_compile(trainer_cfg, device) -> None:
    """RecipeError naming the key when the recipe asks for compiled layers the device cannot build."""
    if not getattr(trainer_cfg, "compile", False):
        return
    reason = compile_unavailable_reason(device)
    if reason is not None:
        raise RecipeError(f"{reason}; set {KEY} = false", KEY)


def use_user_compile_cache() -> str:
    """Send inductor's kernels to the cache the user's runs share, as the inference servers do
    (rlctl.inference.caches.compile_cache_dir), not torch's default under /tmp: with a private /tmp per
    job, as Slurm's job_container/tmpfs gives, every job compiled again, a resumed one too (docs/trainer.md:
    14.4 s to the first step with a cold cache, 1.9 s with a warm one). torch puts its precompiled C++
    header under `<tmp>/torchinductor_<user>` whatever the cache dir, hence the link. Holds after torch
    has looked up its cache dir: it reads the variable at each lookup. Returns the directory."""
    import tempfile

    from rlctl.inference.caches import compile_cache_dir, share_compile_cache

    cache = compile_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    share_compile_cache(tempfile.gettempdir(), cache)
    return cache


def wrap_layers(layers, *, checkpoint: bool, compile: bool) -> None:
    """torch.compile and/or activation checkpointing around each decoder layer of `layers` (an
    nn.ModuleList), in place: the compiled layer inside its checkpoint (the module docstring says why)."""
    for i, layer in enumerate(list(layers)):
        if compile:  # in place (Module.compile): no wrapper module, so no `_orig_mod.` in parameter names
            layer.compile(dynamic=True)
        if checkpoint:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        layers[i] = layer


def is_compiled(layer) -> bool:
    """Whether `layer`, or the module inside its checkpoint wrapper, runs through torch.compile."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in layer.modules())


def compile_summary() -> str:
    """What dynamo has compiled in this process so far, for the trainer's log after its warm-up: a layer
    it could not trace at all would run eagerly and show no graphs."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    return f"{graphs} graph(s) compiled, {breaks} graph break(s)"
