"""The `[trainer]` section of a recipe: optimizer, parallelism, memory savers, loss."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlctl.recipes.base import Count, Degree, Fraction, NonNegative, Seconds, StrictModel
from rlctl.trainer.lora_config import LoRAConfig


class OptimizerConfig(StrictModel):
    """AdamW settings."""

    lr: Annotated[float, Field(gt=0, le=1)] = 1e-6
    """Peak learning rate, in (0, 1]."""
    # strict=False on the pair only: recipe.json gives a JSON list; the two numbers stay strict.
    betas: Annotated[tuple[Fraction, Fraction], Field(strict=False)] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    weight_decay: NonNegative = 0.0
    """Decoupled weight decay."""
    max_grad_norm: NonNegative = 1.0
    """Gradient-norm clip; 0 disables clipping."""
    warmup_steps: Count = 0
    """Linear warm-up steps of the learning rate."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after the warm-up, until orchestrator.max_steps: a decay damps the late
    oscillations of a policy that is already near its best reward."""
    min_lr_ratio: Fraction = 0.0
    """Where a decay ends, as a fraction of `lr` (in [0, 1))."""


class LossConfig(StrictModel):
    """The policy-gradient loss; `path` may name any callable with the default's signature."""

    path: str = "rlctl.trainer.loss:importance_ratio_loss"
    """Dotted path `module:function` of the loss function."""
    mask_low: Annotated[float, Field(ge=0, le=1)] = 0.125
    """Tokens whose trainer/inference probability ratio is below this are masked out (in [0, 1]:
    a bound above 1 would mask the on-policy tokens themselves)."""
    mask_high: Annotated[float, Field(ge=1)] = 8.0
    """Tokens whose trainer/inference probability ratio is above this are masked out (>= 1)."""
    entropy_coef: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Weight of an entropy bonus (loss -= coef x mean entropy over the completion tokens); 0 = off.
    A prompt whose whole group samples the same answer gets no gradient from its tied rewards, so a
    policy that locks onto a wrong answer stays there; the bonus keeps some sampling spread."""


class TrainerConfig(StrictModel):
    """FSDP2 trainer: how the model is sharded and how each step is computed."""

    fsdp: Degree = "auto"
    """FSDP shard degree (dp_shard) per model replica, or 'auto' (all remaining trainer GPUs)."""
    ep: Degree = 1
    """Expert-parallel degree for MoE models (must divide the expert count); 'auto' lets the planner pick."""
    cp: Degree = 1
    """Context-parallel degree (splits the sequence; must divide max_model_len); 'auto' lets the planner pick."""
    tp: Degree = 1
    """Tensor-parallel degree inside a node (rarely needed with FSDP2)."""
    pp: Literal[1] = 1
    """Pipeline parallelism is not supported by the trainer (it has no pipeline stages): pp must be 1; split a large model with fsdp, tp, cp or ep."""
    activation_checkpointing: bool = True
    """Recompute activations in backward (full per-layer recompute): less memory, ~33% more compute."""
    compile: bool = False
    """torch.compile each decoder layer (inductor, dynamic shapes; torchtitan's per-block compile): fused
    elementwise kernels and fewer launches, planned as a compiled step (an MoE layer's MoE block stays
    eager, and is planned so). The trainer compiles before its first batch, while inference starts (seconds
    to minutes; a later job of the user's finds the kernels in TORCHINDUCTOR_CACHE_DIR, default
    $XDG_CACHE_HOME/rlctl/torchinductor). Needs triton on GPUs, a C++ compiler on CPU."""
    fp8: bool = False
    """FP8 matmuls via torchao float8 training on GPUs with compute capability >= 8.9 (refused elsewhere)."""
    micro_batch_size: Annotated[int, Field(ge=1, le=4096)] = 1
    """Sequences per micro-batch per GPU."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of parameters (master weights and optimizer state stay fp32)."""
    optimizer_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the sharded master weights, gradients and AdamW moments: float32 = 16 B/param, bfloat16 = 8 B/param (for the largest MoE models)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer settings."""
    loss: LossConfig = LossConfig()
    """Loss settings."""
    router_replay: bool = False
    """Router replay (R3) for MoE models: inference returns the experts it routed each token to, the
    orchestrator stores them in the rollout batch (`payload.routed_experts`, int16 `[T, layers, top_k]`
    per rollout, -1 where unknown) and the trainer's routers use them instead of recomputing their top-k
    (a smaller trainer/inference mismatch)."""
    batch_timeout_s: Seconds = 3600.0
    """Seconds the trainer waits for the orchestrator's next rollout batch before failing."""
    lora: LoRAConfig = LoRAConfig()
    """Low-rank adapters (`rank` > 0) instead of full fine-tuning; planned by `rlctl plan`."""
