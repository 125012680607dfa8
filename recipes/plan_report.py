"""The plan report and the placement rules every part of the planner shares (no search here)."""
from __future__ import annotations

from dataclasses import dataclass, field

import math

from rlctl.orchestrator.exchange.placement import DEGREE_KEYS, Placement, shared_host_trainer_threads
from rlctl.recipes import calibration as C
from rlctl.trainer.compiled_layers import check_compile
from rlctl.trainer.degrees import resolve_dims
from rlctl.trainer.fp8 import check_fp8

AUTO = "auto"


def _int_or(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def orchestrator_site(recipe, profile) -> str:
    forced = recipe.deployment.orchestrator_placement
    if forced != AUTO:
        return forced
    return "cpu_partition" if profile.partitions.cpu and profile.cpu_nodes > 0 else "inference_node"


def cpu_groups(recipe) -> bool:
    """Trainer and inference both request 0 GPUs per node: a CPU run (e.g. the tiny recipe on a GPU
    cluster), placed like on a CPU profile — ranks from the parallel degrees, the CPU build of vLLM."""
    dep = recipe.deployment
    return dep.trainer.gpus_per_node == 0 and dep.inference.gpus_per_node == 0


def cpu_placement(recipe, profile) -> Placement:
    """Placement of a CPU run: ranks from the parallel degrees, node counts as given (no search), and
    the trainer degrees the trainer will run with (refused here, naming the key, when it cannot)."""
    tr, dep = recipe.trainer, recipe.deployment
    check_fp8(tr, "cpu")
    if profile.scheduler == "local":  # this host runs the trainer: refused now, not after vLLM has started
        check_compile(tr, "cpu")
    # fsdp 'auto' on CPU: as many shard ranks as the expert degree needs (ep borrows from them), else 1
    shard = _int_or(tr.fsdp, _int_or(tr.ep, 1))
    ranks = shard * _int_or(tr.cp, 1) * _int_or(tr.tp, 1)
    nodes = _int_or(dep.trainer_nodes, 1)
    dims = resolve_dims(tr, nodes * ranks, "cpu")
    return Placement(
        trainer_nodes=nodes, inference_nodes=_int_or(dep.inference_nodes, 1),
        trainer_ranks_per_node=ranks, inference_servers_per_node=_int_or(recipe.inference.dp, 1),
        inference_gpus_per_server=0, orchestrator=orchestrator_site(recipe, profile),
        trainer_degrees={k: getattr(dims, k) for k in DEGREE_KEYS},
    )


def cpu_trainer_time(spec, recipe, profile, placement, tokens: int, mean_seq: float) -> dict:
    """Trainer step of a CPU run: training FLOPs over the cores of the trainer nodes (on a local host those
    the servers leave, as the local launcher gives them out) and the small ops of each token (fewer with
    `trainer.compile`), plus fixed costs (what dominates a tiny model): per micro-batch for each MoE layer,
    and with several ranks per step and per micro-batch for their collectives."""
    from rlctl.trainer.plan import flops_per_token, per_layer_cost

    ranks = max(1, placement.trainer_ranks_per_node * placement.trainer_nodes)
    rows = max(1, math.ceil(tokens / max(1.0, mean_seq)))  # sequences in the batch
    micro_batches = math.ceil(rows / ranks / max(1, recipe.trainer.micro_batch_size))
    flops = tokens * sum(flops_per_token(spec, mean_seq))
    cores = max(1, profile.cpus_per_node) * max(1, placement.trainer_nodes)
    if profile.scheduler == "local":  # the servers share the host: the launcher leaves them a core each
        cores = ranks * shared_host_trainer_threads(cores, placement.inference_servers, ranks)
    token_share = {"eager": 1.0, "compiled": C.CPU_TRAIN_COMPILED_TOKEN_SHARE}  # MoE blocks stay eager
    token_s = C.CPU_TRAIN_TOKEN_OVERHEAD_S * per_layer_cost(spec, token_share, recipe.trainer.compile, False)
    compute_s = (flops / C.CPU_TRAIN_FLOPS_PER_CORE + tokens * token_s) / cores
    per_micro_batch = spec.moe_layers * C.CPU_TRAIN_MOE_LAYER_OVERHEAD_S
    step_fixed = 0.0  # one rank: its fixed costs are within the per-token cost (fitted to one-rank runs)
    if ranks > 1:  # gloo collectives: FSDP's gathers in every micro-batch, the gradients' reduce-scatter
        step_fixed = C.CPU_TRAIN_STEP_OVERHEAD_S
        per_micro_batch += C.CPU_TRAIN_MICROBATCH_OVERHEAD_S + spec.moe_layers * C.CPU_TRAIN_MOE_LAYER_SHARDED_S
    overhead_s = step_fixed + micro_batches * per_micro_batch
    step = compute_s + overhead_s
    return {"step_time_s": step, "tokens_per_s": tokens / step, "compute_s": compute_s, "overhead_s": overhead_s,
            "micro_batches": micro_batches, "flops_per_token": flops / max(1, tokens),
            "mfu": None}


def cpu_rollout_time(spec, recipe, profile, placement, rollouts: int, mean: int, completion: int,
                     in_flight: int) -> dict:
    """Rollout step of a CPU run: decode steps (weights streamed from memory, GEMMs on the cores, a fixed
    scheduler cost, a cost per sequence) times the waves the KV cache allows, then per rollout its prefill
    FLOPs and, for each of its turns (`max_turns`, one per generated token at most), a serving cost
    (request, stream, parse)."""
    from rlctl.inference.plan import kv_bytes_per_token_per_gpu, weight_bytes

    servers = max(1, placement.inference_servers)
    kv_tokens = recipe.inference.kv_cache_gib_cpu * 2**30 / max(1.0, kv_bytes_per_token_per_gpu(spec, 1))
    max_seqs = recipe.inference.engine_max_num_seqs(C.VLLM_CPU_MAX_NUM_SEQS)
    per_server = min(max_seqs, int(kv_tokens // max(1, mean)))
    concurrency = max(1, min(in_flight, rollouts, servers * per_server))
    batch = concurrency / servers
    waves = math.ceil(rollouts / concurrency)
    cores = max(1, profile.cpus_per_node) * max(1, placement.inference_nodes)
    core_share = cores / servers  # servers on the same nodes split the cores
    weights = sum(weight_bytes(spec, False))
    flops_tok = 2.0 * spec.active_params
    step_s = (C.CPU_DECODE_STEP_OVERHEAD_S + weights / C.CPU_MEM_BYTES_PER_S
              + batch * flops_tok / (core_share * C.CPU_INFER_FLOPS_PER_CORE)
              + batch * C.CPU_DECODE_TOKEN_OVERHEAD_S)
    prompt = max(0, mean - completion)
    prefill_s = rollouts * prompt * flops_tok / (cores * C.CPU_INFER_FLOPS_PER_CORE)
    turns = max(1, min(recipe.orchestrator.max_turns, completion))
    serving_s = rollouts * turns * C.CPU_ROLLOUT_OVERHEAD_S
    rollout_s = waves * completion * step_s + prefill_s + serving_s
    return {"rollout_step_time_s": rollout_s, "decode_step_s": step_s, "concurrency": concurrency,
            "decode_tokens_per_s": concurrency / step_s, "prefill_s": prefill_s, "rollout_serving_s": serving_s,
            "max_concurrent_rollouts": servers * per_server}


@dataclass
class PlanReport:
    recipe: str
    profile: str
    model: str
    placement: Placement
    groups: list
    trainer: dict
    inference: dict
    orchestrator: dict
    bottleneck: str
    fits: bool
    errors: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    disk: dict = field(default_factory=dict)
    """Run-directory disk: bytes per step and at the peak (see `rlctl.recipes.plan_disk`)."""
    cost: dict = field(default_factory=dict)
    """GPU-hours per step and per run, wall time to max_steps (see `rlctl.recipes.plan_extras`)."""
    off_policy: dict = field(default_factory=dict)
    """Off-policy lag the plan implies, against the bound."""
    calibration: str | None = None
    """The calibration file whose constants the plan used (None: the built-in ones)."""
    weights: dict = field(default_factory=dict)
    """Weight sync per step: bytes, the time of each transport, the chosen one's part on each side of the
    async step (see `rlctl.recipes.plan_sync`)."""
    pool: dict | None = None
    """An attached run's shared inference pool: its servers, state, the runs attached now, and the rollout
    step with the pool to itself (see `rlctl.recipes.plan_pool`); None for a run with servers of its own."""

    def to_json(self) -> dict:
        """Machine-readable plan; numbers are SI (seconds, tokens/s, bytes) except the *_gib memory fields."""
        return {
            "recipe": self.recipe, "profile": self.profile, "model": self.model, "fits": self.fits,
            "placement": self.placement.to_dict(), "groups": self.groups, "trainer": self.trainer,
            "inference": self.inference, "orchestrator": self.orchestrator, "bottleneck": self.bottleneck,
            "errors": list(self.errors), "warnings": list(self.warnings), "disk": self.disk,
            "cost": self.cost, "off_policy": self.off_policy, "calibration": self.calibration,
            "weights": self.weights, "pool": self.pool,
        }
