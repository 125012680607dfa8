"""Expert parallelism: each rank of the `ep` mesh holds E/ep experts; tokens travel by all-to-all.

torchtitan's approach (its `ExpertParallel` style) on transformers' experts modules: the fused expert
weights become DTensors `Shard(0)` over `ep`; the forward sends each token (already sorted by expert,
see `moe.grouped_experts_forward`) to the rank owning its expert with `all_to_all_single_autograd`,
runs the local experts as grouped matmuls and sends the results back. torch's all-to-all works on
gloo (CPU) and NCCL; DeepEP's fused kernels are not used (GPU-only, and no recipe key selects them).
"""
from __future__ import annotations

import torch

from rlctl.recipes.errors import RecipeError
from rlctl.trainer.moe import enable_grouped_experts, expert_mlp, moe_blocks

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def apply_expert_parallel(model, ep_mesh, ep_group=None) -> int:
    """Shard every MoE block's experts over the 1-D `ep_mesh` (meta or real parameters) and make the
    blocks dispatch tokens to them over `ep_group` (default: the mesh's group); enables the grouped
    forward. Returns the number of MoE blocks."""
    from torch.distributed.tensor import Shard, distribute_tensor

    n_blocks = enable_grouped_experts(model)
    ep = ep_mesh.size()
    if ep == 1:
        return n_blocks
    for _, block in moe_blocks(model):
        experts = block.experts
        n_experts = experts.gate_up_proj.shape[0]
        if n_experts % ep:
            raise RecipeError(f"must divide the model's {n_experts} experts per layer (got {ep})", "trainer.ep")
        for name in EXPERT_PARAMS:
            param = getattr(experts, name)
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts._rlctl_ep_group = ep_group if ep_group is not None else ep_mesh.get_group()
        experts._rlctl_ep_dispatch = dispatch_compute_combine
    return n_blocks


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters sharded over different meshes (experts over
    (efsdp, ep), dense ones over fsdp), which torch's cannot stack: the 2-norm of each mesh's gradients,
    combined; every gradient scaled by the one coefficient. Returns the total norm (a plain tensor)."""
    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts[e] of every ep rank for my experts: [ep × local experts], source-rank major."""
    import torch.distributed as dist

    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


def dispatch_compute_combine(experts, routed: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                             down: torch.Tensor, group) -> torch.Tensor:
    """Expert outputs for `routed` [S, H] (this rank's token copies sorted by global expert, `counts`
    [E] per expert): tokens go to the rank owning their expert, come back in the same order."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep = group.size()
    n_local = counts.numel() // ep
    with torch.no_grad():
        received_counts = _exchange_counts(counts, group).view(ep, n_local)  # [source rank, local expert]
        send_splits = counts.view(ep, n_local).sum(dim=1).tolist()
        recv_splits = received_counts.sum(dim=1).tolist()
        # arrived source-rank major; the grouped matmul wants local-expert major
        segment = torch.arange(ep * n_local, device=counts.device)
        source, expert = segment // n_local, segment % n_local
        row_key = torch.repeat_interleave(expert * ep + source, received_counts.reshape(-1),
                                          output_size=int(sum(recv_splits)))
        order = torch.argsort(row_key, stable=True)
    arrived = all_to_all_single_autograd(routed.contiguous(), recv_splits, send_splits, group)
    computed = expert_mlp(experts, arrived[order], received_counts.sum(dim=0), gate_up, down)
    back = torch.empty_like(computed).index_copy(0, order, computed)
    return all_to_all_single_autograd(back, send_splits, recv_splits, group)
