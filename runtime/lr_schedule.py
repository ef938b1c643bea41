"""Learning-rate schedules and large-batch learning-rate scaling.

A schedule is a function ``t -> multiplier`` of the number ``t`` of optimizer steps already taken
(0 for the first step), like torch.optim.lr_scheduler.LambdaLR's ``lr_lambda``; the step's
learning rate is ``lr * multiplier``. It is a pure function of the step count, so a checkpoint's
step count is the whole schedule state.

Named schedules (``make_schedule``), ``w = warmup_steps``, ``T = total_steps``:

* ``"constant"``: 1 (after the warm-up when ``w`` > 0);
* ``"warmup-linear"``, ``"warmup-poly"`` (``power``), ``"warmup-cosine"``: a linear warm-up
  ``(t + 1) / w`` for ``t < w`` (the first step already moves: not 0 as in Hugging Face's
  schedules), then with ``p = (t - w) / (T - w)`` clipped to [0, 1]: ``1 - p``, ``(1 - p) ** power``
  (NVIDIA's BERT LAMB recipe: power 0.5), ``(1 + cos(pi p)) / 2``. Past ``T`` the multiplier is 0.

``scaled_lr(lr, global_batch, base_batch, rule)``: ``"linear"`` multiplies by
``global_batch / base_batch`` (Goyal et al. 2017), ``"sqrt"`` by its square root (Hoffer et al.
2017; the LAMB paper's rule), None leaves ``lr``.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

Schedule = Callable[[int], float]
NAMES = ("constant", "warmup-linear", "warmup-poly", "warmup-cosine")


def make_schedule(spec: Union[str, Schedule, None], warmup_steps: int = 0, total_steps: Optional[int] = None,
                  power: float = 1.0) -> Optional[Schedule]:
    """The schedule ``spec`` names (module doc), a callable as it is, or None for None."""
    if spec is None:
        if warmup_steps or total_steps is not None:
            raise ValueError("warmup_steps / total_steps need lr_schedule= (e.g. 'warmup-poly')")
        return None
    if callable(spec):
        return spec
    if spec not in NAMES:
        raise ValueError(f"unknown lr_schedule {spec!r}: expected a callable(step) -> multiplier or one of {NAMES}")
    w = int(warmup_steps)
    if w < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if spec != "constant":
        if total_steps is None or int(total_steps) <= w:
            raise ValueError(f"lr_schedule {spec!r} needs total_steps > warmup_steps, got total_steps={total_steps}")
    if spec == "warmup-poly" and not power > 0:
        raise ValueError(f"power must be > 0, got {power}")
    T = None if total_steps is None else int(total_steps)
    p_ = float(power)

    def decay(p: float) -> float:
        if spec == "constant":
            return 1.0
        if spec == "warmup-cosine":
            return 0.5 * (1.0 + math.cos(math.pi * p))
        return (1.0 - p) ** (1.0 if spec == "warmup-linear" else p_)

    def schedule(t: int) -> float:
        if t < w:
            return (t + 1) / w
        if T is None:
            return 1.0
        return decay(min(1.0, max(0.0, (t - w) / (T - w))))

    schedule.spec = dict(name=spec, warmup_steps=w, total_steps=T, power=p_)   # for reports
    return schedule


def scaled_lr(lr: float, global_batch: int, base_batch: Optional[int], rule: Optional[str]) -> float:
    """``lr`` scaled from ``base_batch`` to ``global_batch`` by ``rule`` (module doc)."""
    if rule is None:
        return float(lr)
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"lr_scaling must be 'linear', 'sqrt' or None, got {rule!r}")
    if base_batch is None or int(base_batch) <= 0:
        raise ValueError(f"lr_scaling={rule!r} needs base_batch= (a positive batch size), got {base_batch!r}")
    k = global_batch / int(base_batch)
    return float(lr) * (k if rule == "linear" else math.sqrt(k))


__all__ = ["Schedule", "NAMES", "make_schedule", "scaled_lr"]
