"""The optimizers and their LR schedule: AdamW, linear warm-up, then cosine decay."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from molt.learner.config import OptimizerSettings


def lr_factor(step: int, opt: OptimizerSettings) -> float:
    """Linear warm-up over ``warmup_steps`` then cosine from 1 to ``min_lr_ratio`` at ``total_steps``."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    progress = min(1.0, (step - opt.warmup_steps) / max(1, opt.total_steps - opt.warmup_steps))
    return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw(
    params: Iterable[torch.nn.Parameter], opt: OptimizerSettings, lr: float, *, fused: bool = False
) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW at peak ``lr`` with ``opt``'s betas, eps and weight decay, and its schedule (stepped once per
    learner step). ``fused``: on CUDA one kernel updates every parameter; on CPU torch's for-loop."""
    optimizer = torch.optim.AdamW(
        params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, fused=True if fused else None
    )
    return optimizer, LambdaLR(optimizer, lambda step: lr_factor(step, opt))
