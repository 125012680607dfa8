"""Rollouts and groups as the loop collects them, and the batch tensors of the rollout contract."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlctl.orchestrator.environments import Prompt
from rlctl.orchestrator.trajectory import Trajectory


@dataclass
class Rollout:
    """One completion: token ids, the sampled tokens' inference logprobs and per-token policy versions."""

    group_id: int
    index: int  # position within the group
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    start_version: int = 0  # policy version when the request was sent (stands in for empty completions)
    reward: float = 0.0
    payload: dict[str, Any] = field(default_factory=dict)  # opaque per-sample tensors, passed through
    # Multi-turn trajectories: per completion token, whether it is trained (environment tokens are not;
    # their logprob is 0 and version ENV_VERSION). None: every completion token is trained.
    loss_mask: list[bool] | None = None
    turns: int = 1

    @classmethod
    def from_trajectory(cls, group_id: int, index: int, traj: Trajectory) -> "Rollout":
        return cls(group_id, index, list(traj.prompt_ids), traj.completion_ids, traj.logprobs, traj.versions,
                   traj.reward_text if traj.reward_text is not None else traj.text, traj.finish_reason,
                   traj.start_version, loss_mask=traj.loss_mask, turns=traj.turns)

    @classmethod
    def from_routed_choice(cls, group_id: int, choice: dict, version: int) -> "Rollout":
        """A whole (not streamed) completion choice with the experts inference routed its tokens to,
        every token tagged with `version` (the one current when the request was sent)."""
        from rlctl.inference.client import decode_routed_experts, routed_experts_payload

        r = cls(group_id, choice["index"], list(choice.get("prompt_token_ids") or []),
                list(choice.get("token_ids") or []), start_version=version)
        r.logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if not r.prompt_ids or len(r.logprobs) != len(r.completion_ids) or not choice.get("finish_reason"):
            raise ValueError(f"choice {r.index}: incomplete (prompt ids, one logprob per token, finish reason)")
        if not choice.get("routed_experts"):
            raise ValueError("the server returned no routed_experts (router replay needs an MoE model served "
                             "with --enable-return-routed-experts)")
        routed = decode_routed_experts(choice["routed_experts"])
        r.payload["routed_experts"] = routed_experts_payload(routed, len(r.prompt_ids), len(r.completion_ids))
        r.versions = [version] * len(r.completion_ids)
        r.text, r.finish_reason = choice.get("text") or "", choice["finish_reason"]
        return r

    @property
    def trained_versions(self) -> list[int]:
        if self.loss_mask is None:
            return self.versions
        return [v for v, trained in zip(self.versions, self.loss_mask) if trained]

    @property
    def oldest_version(self) -> int:
        """The policy version of the oldest generated token: what the off-policy bound applies to."""
        versions = self.trained_versions
        return min(versions) if versions else self.start_version


@dataclass
class Group:
    group_id: int
    prompt: Prompt
    rollouts: list[Rollout]
    advantages: list[float] = field(default_factory=list)

    @property
    def oldest_version(self) -> int:
        return min(r.oldest_version for r in self.rollouts)

    @property
    def newest_version(self) -> int:
        return max((max(r.trained_versions) for r in self.rollouts if r.trained_versions), default=self.oldest_version)


def build_batch_tensors(groups: list[Group], step: int) -> dict:
    """The contract's tensors for one training batch (right-padded with 0; versions -1 off-completion and
    on environment tokens, whose loss mask is 0)."""
    import torch

    rollouts = [(r, a) for g in groups for r, a in zip(g.rollouts, g.advantages)]
    B = len(rollouts)
    T = max((len(r.prompt_ids) + len(r.completion_ids) for r, _ in rollouts), default=1)
    input_ids = torch.zeros(B, T, dtype=torch.int64)
    attention_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.int32)
    for b, (r, _) in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[b, :p] = torch.tensor(r.prompt_ids, dtype=torch.int64)
        attention_mask[b, : p + c] = True
        if c:
            input_ids[b, p : p + c] = torch.tensor(r.completion_ids, dtype=torch.int64)
            loss_mask[b, p : p + c] = True if r.loss_mask is None else torch.tensor(r.loss_mask, dtype=torch.bool)
            logprobs[b, p : p + c] = torch.tensor(r.logprobs, dtype=torch.float32)
            versions[b, p : p + c] = torch.tensor(r.versions, dtype=torch.int32)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "inference_logprobs": logprobs,
        "advantages": torch.tensor([a for _, a in rollouts], dtype=torch.float32),
        "policy_version": versions,
        "rewards": torch.tensor([r.reward for r, _ in rollouts], dtype=torch.float32),
    }
    names = {name for r, _ in rollouts for name in r.payload}
    for name in sorted(names):
        # Opaque payloads are stacked as tensors (never turned into Python lists); every sample must have
        # one. Per-token payloads (e.g. routed_experts [T_i, layers, top_k]) differ in length along dim 0:
        # they are right-padded with -1 to the longest, like the rows they align with.
        parts = [r.payload[name] for r, _ in rollouts]
        longest = max(p.shape[0] for p in parts)
        parts = [p if p.shape[0] == longest else torch.cat([p, p.new_full((longest - p.shape[0], *p.shape[1:]), -1)])
                 for p in parts]
        tensors[f"payload.{name}"] = torch.stack(parts)
    return tensors
