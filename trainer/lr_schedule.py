"""The learning-rate multiplier per optimizer step: linear warm-up, then constant, linear or cosine decay
to `min_lr_ratio` at the run's last step. A plain function of the step, so a resumed run (which restores
the scheduler's step count) continues on the same curve."""
from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, decay: str, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based optimizer step `step` of a `total_steps` run."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    if decay == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, opt_cfg, total_steps: int):
    """torch LambdaLR over `lr_factor` with the recipe's [trainer.optimizer] settings."""
    import torch  # the trainer's modules import torch lazily, where it is used

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, opt_cfg.warmup_steps, opt_cfg.decay, total_steps, opt_cfg.min_lr_ratio)
    )
