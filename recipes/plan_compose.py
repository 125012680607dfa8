"""The body of `rlctl.recipes.plan.plan`: validate degrees, resolve `auto`, run the three models."""
from __future__ import annotations

import math

from rlctl.inference.plan import choose_tp, plan_inference
from rlctl.recipes.hardware import gpu_spec
from rlctl.orchestrator.exchange.placement import Placement
from rlctl.recipes import calibration as C
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.models import get_model_spec
from rlctl.recipes.plan_disk import plan_disk
from rlctl.recipes.plan_report import (PlanReport, cpu_groups, cpu_placement, cpu_rollout_time, cpu_trainer_time,
                                       orchestrator_site)
from rlctl.recipes.plan_sync import cpu_shape, gpu_shape, weight_sync
from rlctl.trainer.degrees import ParallelDims
from rlctl.trainer.plan import lora_params, lora_rank, memory_breakdown, plan_trainer

AUTO = "auto"


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def check_static(recipe, spec, profile) -> None:
    """Impossible parallelism or node counts: one RecipeError naming the key."""
    tr, inf, dep = recipe.trainer, recipe.inference, recipe.deployment
    if not 0 <= spec.dense_layers <= spec.num_hidden_layers:  # else negative MoE layers, memory and time
        raise RecipeError(f"{spec.name} declares {spec.dense_layers} dense (mlp_only / first_k_dense) layers but has "
                          f"{spec.num_hidden_layers} layers", key="model.name")
    if isinstance(tr.ep, int) and tr.ep > 1:
        if not spec.is_moe:
            raise RecipeError(f"ep={tr.ep} but {spec.name} is a dense model (no experts); use ep = 1", key="trainer.ep")
        if spec.n_routed_experts % tr.ep:
            raise RecipeError(f"ep={tr.ep} must divide the {spec.n_routed_experts} experts of {spec.name}", key="trainer.ep")
    if isinstance(tr.cp, int) and inf.max_model_len % tr.cp:
        raise RecipeError(f"cp={tr.cp} must divide the sequence length inference.max_model_len={inf.max_model_len}", key="trainer.cp")
    if isinstance(tr.tp, int) and profile.gpus_per_node and tr.tp > profile.gpus_per_node:
        raise RecipeError(f"tp={tr.tp} exceeds the {profile.gpus_per_node} GPUs of a node", key="trainer.tp")
    if isinstance(tr.tp, int) and tr.tp > 1:
        if tr.tp > spec.num_key_value_heads or spec.num_key_value_heads % tr.tp:
            raise RecipeError(f"tp={tr.tp} must divide the {spec.num_key_value_heads} KV heads of {spec.name} "
                              "(the trainer does not replicate KV heads)", key="trainer.tp")
        ParallelDims(1, 1, 1, tr.tp, 1, tr.tp).validate("cuda")  # the trainer's refusal, before any search
    if isinstance(inf.tp, int) and inf.tp > 1:
        if spec.num_attention_heads % inf.tp:
            raise RecipeError(f"tp={inf.tp} must divide the {spec.num_attention_heads} attention heads of {spec.name}", key="inference.tp")
        if not spec.is_mla and inf.tp > spec.num_key_value_heads and inf.tp % spec.num_key_value_heads:
            raise RecipeError(f"tp={inf.tp} exceeds the {spec.num_key_value_heads} KV heads and is not a multiple "
                              "of them (KV heads can only be replicated evenly)", key="inference.tp")
        if profile.gpus_per_node and inf.tp > profile.gpus_per_node:
            raise RecipeError(f"tp={inf.tp} exceeds the {profile.gpus_per_node} GPUs of a node", key="inference.tp")
    # attached (deployment.inference_pool): inference_nodes sizes the pool's stand-in, not this run's nodes
    own = (dep.trainer_nodes,) if dep.inference_pool else (dep.trainer_nodes, dep.inference_nodes)
    pinned = [v for v in own if v != AUTO]
    if profile.scheduler != "local" and sum(pinned) > profile.nodes:  # local: one machine runs every group
        raise RecipeError(f"trainer_nodes + inference_nodes = {sum(pinned)} but cluster {profile.name!r} has "
                          f"{profile.nodes} nodes", key="deployment.trainer_nodes")
    if dep.total_nodes is not None and not 2 <= dep.total_nodes <= profile.nodes:
        raise RecipeError(f"total_nodes must be in 2..{profile.nodes} (the cluster size)", key="deployment.total_nodes")
    dis = inf.disaggregation
    inf_gpus = None if dep.inference_nodes == AUTO else dep.inference_nodes * profile.gpus_per_node
    if isinstance(inf.dp, int) and profile.gpus_per_node:
        replica = inf.dp * (inf.tp if isinstance(inf.tp, int) else 1)
        room = (dis.decode_nodes_per_replica * profile.gpus_per_node if dis.enabled else inf_gpus)
        if room is not None and replica > room:
            raise RecipeError(f"dp × tp = {replica} GPUs per replica but the {'decode replica' if dis.enabled else 'inference nodes'} "
                              f"have {room}; lower inference.dp (at most {max(1, room // (replica // inf.dp))})", key="inference.dp")
    if dis.enabled:
        need = dis.prefill_replicas * dis.prefill_nodes_per_replica + dis.decode_replicas * dis.decode_nodes_per_replica
        if dep.inference_nodes != AUTO and need > dep.inference_nodes:
            raise RecipeError(f"prefill/decode replicas need {need} nodes but inference_nodes = {dep.inference_nodes}",
                              key="inference.disaggregation")
        if min(dis.prefill_replicas, dis.prefill_nodes_per_replica, dis.decode_replicas, dis.decode_nodes_per_replica) < 1:
            raise RecipeError("replica and node counts must be >= 1", key="inference.disaggregation")


def _lora_targets(tr) -> tuple:
    return tuple(tr.lora.target_modules) if lora_rank(tr) else ()


def rollout_shape(o, max_model_len: int) -> tuple[int, int, str | None]:
    """(mean tokens per rollout, mean completion tokens, a warning when assumed). A multi-turn rollout
    generates up to `max_tokens` in each of its `max_turns` turns (within `max_trajectory_tokens`); the
    environment's replies count as prompt (prefilled, not decoded). Without `expected_mean_tokens`,
    completions average half of what may be generated and prompts half the room that max_model_len
    leaves them — never a prompt of 0 tokens, which would make prefill free."""
    generated = o.max_generated_tokens
    if o.expected_mean_tokens:
        mean = min(o.expected_mean_tokens, max_model_len)
        return mean, min(generated, mean), None
    completion = max(1, min(generated, max_model_len) // 2)
    prompt = max(1, (max_model_len - min(generated, max_model_len)) // 2)
    mean = min(max_model_len, prompt + completion)
    return mean, min(completion, mean), (
        f"orchestrator.expected_mean_tokens is not set: planning with {mean - min(completion, mean)}-token prompts "
        f"and {completion}-token completions (half of what max_model_len leaves the prompt and half of what "
        f"max_tokens × max_turns lets a rollout generate); set it")


def _trainer_degrees(recipe, spec, world: int, gpn: int):
    tr = recipe.trainer
    tp = tr.tp if tr.tp != AUTO else 1
    if tr.ep != AUTO:
        ep = tr.ep
    elif spec.is_moe:
        ep = max(e for e in _pow2_upto(max(1, min(gpn or 1, world))) if spec.n_routed_experts % e == 0)
    else:
        ep = 1
    fsdp = None if tr.fsdp == AUTO else tr.fsdp
    return tp, ep, fsdp


def _trainer(recipe, spec, profile, gpu, nodes: int, tokens: int, mean_seq: int, warnings: list, errors: list):
    tr, seq = recipe.trainer, recipe.inference.max_model_len
    gpn = profile.gpus_per_node
    world = nodes * gpn
    tp, ep, fsdp = _trainer_degrees(recipe, spec, world, gpn)
    model_ranks_base = tp * (fsdp or 1)
    mem = lambda cp: memory_breakdown(spec, shard=(fsdp or world // (cp * tp)) * cp * tp, ep=ep, cp=cp, tp=tp,  # noqa: E731
                                      seq_len=seq, micro_batch=tr.micro_batch_size,
                                      activation_checkpointing=tr.activation_checkpointing,
                                      optimizer_dtype=tr.optimizer_dtype, lora_rank=lora_rank(tr),
                                      lora_targets=_lora_targets(tr))[0]["total"]
    # the trainer's Ulysses CP splits attention heads and cannot split DSA's indexer (it needs every key)
    cp_ok = lambda c: c == 1 or (not spec.index_topk and spec.num_attention_heads % c == 0)  # noqa: E731
    cands = [c for c in _pow2_upto(world) if seq % c == 0 and world % (c * model_ranks_base) == 0 and cp_ok(c)]
    if isinstance(tr.cp, int) and not cp_ok(tr.cp):  # still planned: the figures show what it would take
        errors.append(f"trainer.cp: cp={tr.cp} cannot run: " + (
            f"context parallelism does not support DeepSeek sparse attention ({spec.name}: its indexer needs every "
            "key of the sequence); allowed: cp = 1" if spec.index_topk else
            f"Ulysses splits the {spec.num_attention_heads} attention heads, which cp must divide"))
    if tr.cp == AUTO:
        cp = next((c for c in cands if mem(c) <= gpu.hbm_gib), cands[-1] if cands else 1)
    else:
        cp = tr.cp
    used = (fsdp or 1) * cp * tp
    if fsdp and world % used:
        errors.append(f"trainer.fsdp: fsdp × cp × tp = {used} must divide the {world} trainer GPUs")
        return None
    if used > world or (ep > max(1, (fsdp or world // (cp * tp)) * cp * tp)):
        errors.append(f"trainer: fsdp × cp × tp = {used} (ep {ep}) exceeds the {world} trainer GPUs; "
                      "add trainer nodes or lower the degrees")
        return None
    shard = fsdp or world // (cp * tp)
    try:  # the trainer's own rules: what it would refuse at start-up, this split cannot run
        ParallelDims(world // (shard * cp * tp), shard, cp, tp, ep, world).validate("cuda")
    except RecipeError as e:
        errors.append(str(e))
        return None
    p = plan_trainer(spec, tr, gpus=world, gpus_per_node=gpn, gpu=gpu, seq_len=seq, tokens_per_step=tokens,
                     mean_seq=mean_seq, inter_gbps=profile.interconnect_gbps, intra_gbps=profile.intra_node_gbps,
                     ep=ep, cp=cp, tp=tp, fsdp=fsdp, compiled=tr.compile)
    if not p.fits:
        better = next((c for c in cands if c > cp and mem(c) <= gpu.hbm_gib), None)
        msg = f"trainer needs {p.memory_gib_per_gpu:.0f} GiB/GPU at cp={cp} (GPU has {gpu.hbm_gib:.0f} GiB)"
        if better:
            msg += f"; cp={better} needs {mem(better):.0f} GiB — set trainer.cp={better}"
        elif not tr.activation_checkpointing:
            msg += "; set trainer.activation_checkpointing=true"
        elif tr.optimizer_dtype == "float32":
            msg += "; set trainer.optimizer_dtype=\"bfloat16\" or add trainer nodes"
        else:
            msg += "; add trainer nodes"
        errors.append(msg)
    warnings.extend(p.notes)
    return p


def _inference(recipe, spec, profile, gpu, nodes: int, rollouts: int, mean: int, completion: int, in_flight: int):
    inf = recipe.inference
    gpn = profile.gpus_per_node
    lora = lora_params(spec, lora_rank(recipe.trainer), _lora_targets(recipe.trainer))
    tp = inf.tp if inf.tp != AUTO else choose_tp(spec, inf, gpu, gpn, lora)
    dp = inf.dp if inf.dp != AUTO else max(1, gpn // tp)
    return plan_inference(spec, inf, nodes=nodes, gpus_per_node=gpn, gpu=gpu, rollouts=rollouts, mean_tokens=mean,
                          lora_params=lora,
                          completion_tokens=completion, max_in_flight=in_flight, tp=tp, dp=dp)


def _async_step(trainer_s: float, rollout_s: float, max_off_policy: int, weights: dict | None = None) -> float:
    """Steady-state step: with ≥ 1 step of allowed staleness the two sides overlap fully and the slower
    one sets the pace; at 0 (synchronous RL) they alternate, and wait for the whole sync in between.

    The weight sync (`weights`, recipes/plan_sync.py) is on each side for the time it blocks that side:
    the trainer cannot start its next step while it writes or sends its part (its parameters are being
    read out), so that part is on the trainer's side; the servers generate nothing while paused for the
    reload (reading or receiving, then the fixed reload cost), so that part is on the rollout side. The
    rest of the hand-off the model does not explain (C.ASYNC_STEP_SYNC_S, fitted by calibration) is on
    the trainer's side of the loop."""
    trainer_sync, rollout_sync = _sync_sides(weights)
    if max_off_policy >= 1:
        return max(trainer_s + trainer_sync + C.ASYNC_STEP_SYNC_S, rollout_s + rollout_sync)
    whole = weights["sync_time_s"][weights["transport"]] if weights else 0.0
    return trainer_s + C.ASYNC_STEP_SYNC_S + whole + rollout_s


def _sync_sides(weights: dict | None) -> tuple[float, float]:
    """(trainer side, rollout side) of the chosen transport's weight sync."""
    return (weights["trainer_side_s"], weights["rollout_side_s"]) if weights else (0.0, 0.0)


def _gpu_weights(recipe, spec, profile, tp_, ip, t_nodes: int, i_nodes: int) -> dict:
    return weight_sync(recipe, spec, profile, gpu_shape(recipe, profile, tp_, ip, t_nodes, i_nodes), on_gpu=True)


def _split_candidates(recipe, profile) -> list[tuple[int, int]]:
    dep, dis = recipe.deployment, recipe.inference.disaggregation
    total = dep.total_nodes or profile.nodes
    min_inf = (dis.prefill_replicas * dis.prefill_nodes_per_replica
               + dis.decode_replicas * dis.decode_nodes_per_replica) if dis.enabled else 1
    if dep.trainer_nodes != AUTO and dep.inference_nodes != AUTO:
        return [(dep.trainer_nodes, dep.inference_nodes)]
    if dep.trainer_nodes != AUTO:
        return [(dep.trainer_nodes, max(min_inf, total - dep.trainer_nodes))]
    if dep.inference_nodes != AUTO:
        return [(max(1, total - dep.inference_nodes), dep.inference_nodes)]
    if dis.enabled:
        return [(max(1, total - min_inf), min_inf)]
    # A 1-node cluster has no split: plan one node each (the plan then says the cluster is too small,
    # unless the local scheduler runs every group on the one machine).
    return [(t, total - t) for t in range(1, total)] or [(1, 1)]


def _evaluate(recipe, spec, profile, gpu, t_nodes, i_nodes, shape):
    errors, warnings = [], []
    rollouts, mean, completion, in_flight, tokens = shape
    tp_ = _trainer(recipe, spec, profile, gpu, t_nodes, tokens, mean, warnings, errors)
    ip = _inference(recipe, spec, profile, gpu, i_nodes, rollouts, mean, completion, in_flight)
    return tp_, ip, errors, warnings


def _score(tp_, ip, weights, off):
    if tp_ is None or not tp_.fits or not ip.fits:
        return math.inf
    return _async_step(tp_.step_time_s, _rollout_s(ip), off, weights)


def _search(recipe, spec, profile, gpu, shape):
    """Best split: trainer time falls and rollout time rises with trainer nodes; bisect for the crossing
    of the two sides. Beyond it the rollout side sets the step, and it need not rise monotonically: the
    filesystem weight sync grows with the inference nodes that read the model, so fewer of them can be
    faster; the rollout side is unimodal there, so a ternary search finds its minimum."""
    cands = _split_candidates(recipe, profile)
    off = recipe.orchestrator.max_off_policy_steps
    seen: dict = {}

    def ev(c):  # (trainer plan, inference plan, weight sync) of the split c
        if c not in seen:
            tp_, ip, _, _ = _evaluate(recipe, spec, profile, gpu, c[0], c[1], shape)
            seen[c] = (tp_, ip, _gpu_weights(recipe, spec, profile, tp_, ip, c[0], c[1]))
        return seen[c]

    def score(c):
        return _score(*ev(c), off)

    if len(cands) <= 3:
        return cands[0] if len(cands) == 1 else min(cands, key=score)
    lo, hi = 0, len(cands) - 1
    while hi - lo > 2:
        mid = (lo + hi) // 2
        tp_, ip, w = ev(cands[mid])
        trainer_sync, rollout_sync = _sync_sides(w)
        if tp_ is None or not tp_.fits or (ip.fits and tp_.step_time_s + trainer_sync > _rollout_s(ip) + rollout_sync):
            lo = mid  # trainer-bound or does not fit: give the trainer more nodes
        else:
            hi = mid
    a, b = hi, len(cands) - 1
    while b - a > 2:
        m1, m2 = a + (b - a) // 3, b - (b - a) // 3
        if score(cands[m1]) <= score(cands[m2]):
            b = m2
        else:
            a = m1
    window = cands[max(0, lo - 1): hi + 2] + cands[max(0, a - 1): b + 2]
    return min(window, key=score)


def _cpu_report(recipe, spec, profile, shape, errors, warnings):
    placement = cpu_placement(recipe, profile)
    rollouts, mean, completion, in_flight, tokens = shape
    ranks = placement.trainer_ranks_per_node * placement.trainer_nodes
    deg = placement.trainer_degrees
    mem, _ = memory_breakdown(spec, shard=deg["dp_shard"] * deg["cp"] * deg["tp"], ep=deg["ep"], cp=deg["cp"],
                              tp=deg["tp"], seq_len=recipe.inference.max_model_len,
                              micro_batch=recipe.trainer.micro_batch_size,
                              activation_checkpointing=recipe.trainer.activation_checkpointing,
                              optimizer_dtype=recipe.trainer.optimizer_dtype)
    mem = {k: v for k, v in mem.items() if k != "reserved"}
    mem["total"] = round(sum(v for k, v in mem.items() if k != "total"), 3)
    budget = profile.mem_gib_per_node / max(1, ranks)
    if mem["total"] > budget:
        errors.append(f"trainer needs {mem['total']:.1f} GiB per rank but a rank gets {budget:.1f} GiB of host memory")
    cpu_t = cpu_trainer_time(spec, recipe, profile, placement, tokens, mean)  # the CPU model: plan_report.py
    cpu_r = cpu_rollout_time(spec, recipe, profile, placement, rollouts, mean, completion, in_flight)
    trainer_s, rollout_s = cpu_t["step_time_s"], cpu_r["rollout_step_time_s"]
    trainer = {"gpus": 0, "ranks": ranks, "fsdp": deg["dp_shard"], "ep": deg["ep"], "cp": deg["cp"], "tp": deg["tp"],
               "dp_replicate": deg["dp_replicate"], "memory_gib": mem,
               "memory_gib_per_gpu": mem["total"], **cpu_t, "tokens_per_step": tokens}
    inference = {"gpus": 0, "tp": 1, "servers": placement.inference_servers, **cpu_r,
                 "kv_cache_gib_per_gpu": recipe.inference.kv_cache_gib_cpu, "completion_tokens": completion}
    return placement, trainer, inference, trainer_s, rollout_s


def build_report(recipe, profile, size_attached=None):
    """`size_attached`: sizes a run attached to a shared pool (plan_pool.sizer; passed in, as that
    module builds on this one)."""
    spec = get_model_spec(recipe.model.name)
    check_static(recipe, spec, profile)
    o = recipe.orchestrator
    mean, completion, assumed = rollout_shape(o, recipe.inference.max_model_len)
    in_flight = o.max_in_flight or 2 * o.rollouts_per_step
    shape = (o.rollouts_per_step, mean, completion, in_flight, o.rollouts_per_step * mean)
    errors: list[str] = []
    warnings: list[str] = [assumed] if assumed else []

    attached = None
    if size_attached is not None:  # a shared pool serves the rollouts
        attached = size_attached(recipe, spec, profile, shape, errors, warnings)
        placement, trainer, inference, trainer_s, rollout_s, weights = attached.parts()
    elif profile.gpus_per_node == 0 or cpu_groups(recipe):
        placement, trainer, inference, trainer_s, rollout_s = _cpu_report(recipe, spec, profile, shape, errors, warnings)
        weights = weight_sync(recipe, spec, profile, cpu_shape(placement), on_gpu=False)
    else:
        gpu = gpu_spec(profile.gpu)
        t_nodes, i_nodes = _search(recipe, spec, profile, gpu, shape)
        tp_, ip, errs, warns = _evaluate(recipe, spec, profile, gpu, t_nodes, i_nodes, shape)
        errors += errs
        warnings += warns
        if not ip.fits:
            errors.append("inference: " + ("; ".join(ip.notes) or "no KV cache left") + " — raise inference.tp or use fp8")
        else:
            warnings += ip.notes
        gpn = profile.gpus_per_node
        placement = Placement(trainer_nodes=t_nodes, inference_nodes=i_nodes, trainer_ranks_per_node=gpn,
                              inference_servers_per_node=max(1, gpn // ip.tp), inference_gpus_per_server=min(ip.tp, gpn),
                              orchestrator=_site(recipe, profile), trainer_degrees=_degrees_of(tp_))
        trainer = tp_.to_json() if tp_ else {"step_time_s": None, "tokens_per_s": None, "memory_gib_per_gpu": None}
        inference = ip.to_json()
        trainer_s = tp_.step_time_s if tp_ else math.inf
        rollout_s = _rollout_s(ip)
        weights = _gpu_weights(recipe, spec, profile, tp_, ip, t_nodes, i_nodes)
    step = _async_step(trainer_s, rollout_s, o.max_off_policy_steps, weights)
    trainer_sync, rollout_sync = _sync_sides(weights)
    trainer_busy, rollout_busy = trainer_s + trainer_sync + C.ASYNC_STEP_SYNC_S, rollout_s + rollout_sync
    bottleneck = "inference" if rollout_busy >= trainer_busy else "trainer"
    other = trainer_busy if bottleneck == "inference" else rollout_busy
    orchestrator = {"step_time_s": _finite(step), "trainer_step_time_s": _finite(trainer_s),
                    "rollout_step_time_s": _finite(rollout_s), "max_off_policy_steps": o.max_off_policy_steps,
                    "weight_sync_trainer_s": trainer_sync, "weight_sync_rollout_s": rollout_sync,
                    "idle_fraction": {("trainer" if bottleneck == "inference" else "inference"):
                                      round(1 - other / step, 3) if math.isfinite(step) and step > 0 else None},
                    "max_in_flight": in_flight, "mean_tokens": mean, "completion_tokens": completion}
    nodes_used = attached.nodes_used if attached else placement.trainer_nodes + placement.inference_nodes
    if profile.scheduler != "local" and nodes_used > profile.nodes:
        errors.append(f"deployment: the plan needs {nodes_used} nodes but {profile.name!r} has {profile.nodes}")
    groups = [{"name": "orchestrator", "nodes": 1 if placement.orchestrator == "cpu_partition" else 0,
               "where": placement.orchestrator},
              {"name": "inference", "nodes": placement.inference_nodes, "ntasks_per_node": placement.inference_servers_per_node},
              {"name": "trainer", "nodes": placement.trainer_nodes, "ntasks_per_node": placement.trainer_ranks_per_node}]
    return PlanReport(recipe=recipe.name, profile=profile.name, model=spec.name, placement=placement,
                      groups=attached.groups if attached else groups, trainer=trainer, inference=inference,
                      orchestrator=orchestrator, bottleneck=bottleneck, fits=not errors, errors=errors,
                      warnings=warnings, disk=plan_disk(recipe, spec), weights=weights,
                      pool=attached.section if attached else None)


def _degrees_of(tp_) -> dict | None:
    """The degrees the trainer runs with (ParallelDims' names), written with the placement."""
    if tp_ is None:
        return None
    return {"dp_replicate": tp_.dp_replicate, "dp_shard": tp_.fsdp, "cp": tp_.cp, "tp": tp_.tp, "ep": tp_.ep}


def _finite(x: float):
    return x if math.isfinite(x) else None


def _rollout_s(ip) -> float:
    """The inference plan's rollout step for comparisons: None (nothing decodes) ranks as endless."""
    return math.inf if ip.rollout_step_time_s is None else ip.rollout_step_time_s


def _site(recipe, profile) -> str:
    return orchestrator_site(recipe, profile)
