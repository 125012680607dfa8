"""The learning-rate schedule: warm-up, then constant, linear or cosine decay to min_lr_ratio at the last
step, and the same curve after a resume (the scheduler's state is restored from the checkpoint)."""
from __future__ import annotations

import math

import pytest
import torch

from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import load_recipe
from rlctl.trainer.config import OptimizerConfig
from rlctl.trainer.lr_schedule import build_scheduler, lr_factor


def test_constant_after_warmup_is_the_old_behaviour():
    assert [lr_factor(s, 4, "constant", 10, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, 0, "constant", 10, 0.5) == 1.0


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_decay_runs_from_peak_after_warmup_to_the_floor_at_the_last_step(decay):
    total, warmup, floor = 20, 5, 0.1
    f = [lr_factor(s, warmup, decay, total, floor) for s in range(total + 5)]
    assert f[warmup - 1] == 1.0 and f[warmup] == 1.0
    assert all(a >= b for a, b in zip(f[warmup:], f[warmup + 1:]))
    assert math.isclose(f[total - 1], floor) and math.isclose(f[-1], floor)  # stays at the floor past the end
    mid = f[warmup + (total - 1 - warmup) // 2]
    assert 0.4 < mid < 0.7


def test_a_resumed_scheduler_continues_on_the_same_curve():
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=2, decay="cosine", min_lr_ratio=0.2)

    def scheduler():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        return opt, build_scheduler(opt, cfg, 12)

    opt, sched = scheduler()
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    opt2, sched2 = scheduler()
    for _ in range(5):
        opt2.step()
        sched2.step()
    opt3, sched3 = scheduler()  # a checkpoint restores both (the optimizer's holds the current lr)
    opt3.load_state_dict(opt2.state_dict())
    sched3.load_state_dict(sched2.state_dict())
    assert opt3.param_groups[0]["lr"] == pytest.approx(lrs[5])
    opt3.step()
    sched3.step()
    assert opt3.param_groups[0]["lr"] == pytest.approx(lrs[6])
    assert lrs[-1] == pytest.approx(cfg.lr * 0.2)


def test_bad_schedule_keys_are_refused_with_their_key():
    with pytest.raises(RecipeError, match="trainer.optimizer.decay"):
        load_recipe(["recipes/tiny-cpu.toml"], ["trainer.optimizer.decay=step"])
    with pytest.raises(RecipeError, match="trainer.optimizer.min_lr_ratio"):
        load_recipe(["recipes/tiny-cpu.toml"], ["trainer.optimizer.min_lr_ratio=1.5"])
