"""The one learning-rate schedule of every training loop in the harness (tiny LMs, inducing adapters,
block drafters and ExitTrain, FlexiDepth routers): linear warm-up, then a cosine or linear decay to a
floor, as torch's :class:`~torch.optim.lr_scheduler.LambdaLR`.

The warm-up counts from step 1 (``(step + 1) / warmup``: the first optimiser step already moves the
weights, unlike transformers' ``get_cosine_schedule_with_warmup``, whose step 0 has lr 0), so the
schedules of the models trained before this helper existed are reproduced to the bit.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Decay = Literal["cosine", "linear"]


def lr_at(step: int, *, lr: float, warmup: int, steps: int, decay: Decay = "cosine", floor: float = 0.1) -> float:
    """Learning rate of optimiser step ``step`` (0-based).

    Warm-up, ``step < warmup``: ``lr * (step + 1) / warmup``. Then, with ``t = (step - warmup) /
    max(1, steps - warmup)`` clipped to 1:

    * ``"cosine"``: ``lr * (floor + (1 - floor) * (1 + cos(pi * t)) / 2)`` (cosine decay to
      ``floor * lr``; the default floor 0.1 is the 10% of the tiny-LM, drafter and FlexiDepth loops);
    * ``"linear"``: ``lr * max(floor, (steps - step) / max(1, steps - warmup))`` (linear decay to
      ``floor * lr``, 0 in DEX App. C.2's adapter recipe).

    Args:
        step: optimiser step, 0-based.
        lr: peak learning rate (after warm-up).
        warmup: warm-up steps (0: none).
        steps: total optimiser steps.
        decay: ``"cosine"`` or ``"linear"``.
        floor: final learning rate as a fraction of ``lr``, in [0, 1].

    Raises:
        ValueError: ``warmup`` < 0, ``steps`` < 1, ``floor`` outside [0, 1] or an unknown ``decay``.
    """
    if warmup < 0 or steps < 1 or not 0.0 <= floor <= 1.0:
        raise ValueError(f"lr_at: need warmup >= 0, steps >= 1 and floor in [0, 1] (got {warmup}, {steps}, {floor})")
    if decay not in ("cosine", "linear"):
        raise ValueError(f"lr_at: decay must be 'cosine' or 'linear', got {decay!r}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay == "cosine":
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))
    return lr * max(floor, (steps - step) / max(1, steps - warmup))


def warmup_decay_scheduler(optimizer, *, warmup: int, steps: int, decay: Decay = "cosine", floor: float = 0.1):
    """A :class:`torch.optim.lr_scheduler.LambdaLR` over ``optimizer`` that follows :func:`lr_at` with
    each group's initial lr as the peak (call ``scheduler.step()`` after every ``optimizer.step()``).

    Raises:
        ValueError: as :func:`lr_at`, at construction.
    """

    lr_at(0, lr=1.0, warmup=warmup, steps=steps, decay=decay, floor=floor)  # validates the arguments
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, lr=1.0, warmup=warmup, steps=steps, decay=decay, floor=floor))
