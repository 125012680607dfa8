"""Group-relative advantages and the stale-group filter."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rlctl.orchestrator.advantages import filter_stale, group_advantages, min_policy_version
from rlctl.orchestrator.batch import Group, Rollout, build_batch_tensors
from rlctl.orchestrator.environments import Prompt


def test_advantage_is_reward_minus_group_mean():
    assert group_advantages([1.0, 0.0, 0.5, 0.5]) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_std_normalisation():
    adv = group_advantages([1.0, 0.0, 1.0, 0.0], normalize_std=True)
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0], rel=1e-4)
    assert sum(adv) == pytest.approx(0.0)
    assert all(math.isfinite(a) for a in group_advantages([2.0, 2.0], normalize_std=True))


@dataclass
class _G:
    oldest_version: int


def test_filter_drops_groups_older_than_bound_and_counts_them():
    groups = [_G(v) for v in (0, 1, 2, 3, 1)]
    kept, dropped = filter_stale(groups, step=3, max_off_policy_steps=1)
    assert min_policy_version(3, 1) == 2
    assert [g.oldest_version for g in kept] == [2, 3] and dropped == 3
    kept, dropped = filter_stale(groups, step=3, max_off_policy_steps=3)
    assert len(kept) == 5 and dropped == 0


def test_oldest_version_is_the_oldest_token_of_any_completion():
    g = Group(0, Prompt("ab"), [Rollout(0, 0, versions=[2, 3, 3]), Rollout(0, 1, versions=[4]),
                                Rollout(0, 2, versions=[], start_version=5)])
    assert g.oldest_version == 2


def test_batch_tensors_follow_the_contract():
    r0 = Rollout(0, 0, prompt_ids=[5, 6], completion_ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3], versions=[1, 1, 2],
                 reward=1.0, payload={"experts": torch.ones(2, 5, dtype=torch.int16)})
    r1 = Rollout(0, 1, prompt_ids=[5, 6], completion_ids=[7], logprobs=[-0.5], versions=[2], reward=0.0,
                 payload={"experts": torch.zeros(2, 5, dtype=torch.int16)})
    g = Group(0, Prompt("x"), [r0, r1], advantages=[0.5, -0.5])
    t = build_batch_tensors([g], step=2)
    assert t["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert t["attention_mask"].tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert t["loss_mask"].tolist() == [[False, False, True, True, True], [False, False, True, False, False]]
    assert t["inference_logprobs"][0].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert t["policy_version"].tolist() == [[-1, -1, 1, 1, 2], [-1, -1, 2, -1, -1]]
    assert t["advantages"].tolist() == [0.5, -0.5] and t["rewards"].tolist() == [1.0, 0.0]
    assert t["payload.experts"].shape == (2, 2, 5) and t["payload.experts"].dtype == torch.int16
    assert (t["input_ids"].dtype, t["policy_version"].dtype) == (torch.int64, torch.int32)
