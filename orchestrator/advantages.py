"""Group-relative advantages and the off-policy filter.

A *group* is `group_size` completions of one prompt. Its advantages are each reward minus the group's
mean (optionally divided by the group's standard deviation), so a group whose completions all score
the same teaches nothing and costs nothing.

Off-policy bound: batch N may only contain groups whose oldest completion token was produced by
policy version >= N - max_off_policy_steps; older groups are dropped and counted.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence, TypeVar


def group_advantages(rewards: Sequence[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """Reward minus the group mean; with `normalize_std`, divided by the group's (population) std + eps."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    if normalize_std:
        std = math.sqrt(sum(a * a for a in adv) / len(adv))
        adv = [a / (std + eps) for a in adv]
    return adv


def min_policy_version(step: int, max_off_policy_steps: int) -> int:
    """The oldest policy version batch `step` may contain."""
    return step - max_off_policy_steps


class HasOldestVersion(Protocol):
    @property
    def oldest_version(self) -> int: ...


G = TypeVar("G", bound=HasOldestVersion)


def is_stale(group: HasOldestVersion, step: int, max_off_policy_steps: int) -> bool:
    return group.oldest_version < min_policy_version(step, max_off_policy_steps)


def filter_stale(groups: Sequence[G], step: int, max_off_policy_steps: int) -> tuple[list[G], int]:
    """(groups fresh enough for batch `step`, number dropped)."""
    kept = [g for g in groups if not is_stale(g, step, max_off_policy_steps)]
    return kept, len(groups) - len(kept)
