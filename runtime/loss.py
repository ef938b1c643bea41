"""Global denominators of mean-reduced losses (cross-entropy / NLL with reduction "mean").

A mean over targets is sum(loss_i) / count, where count is the number of valid targets (not
``ignore_index``), or the sum of their class weights when the loss has class weights. When the
targets are spread over ranks (data or model axes) or over micro-batches, the mean of local
means is not the global mean as soon as the pieces hold different numbers of valid targets
(masked-LM labels, padding). So a per-rank program runs such a loss as a local SUM and divides
it by the GLOBAL count (``divide``), which ``autopar.execution.compiled`` computes before the micro-batches
run (a count program codegen derives from the targets' ancestors, summed over every micro-batch
and all-reduced over the axes the targets are split over) and installs with ``set_denominators``.
Each rank's loss is then its exact share of the global loss.

The denominators live in the execution context (runtime/context.py), keyed by the loss node's name.
"""
from __future__ import annotations

import torch

from runtime import context

_KEY = "loss_denominators"


def local_count(target: torch.Tensor, weight: torch.Tensor | None = None, ignore_index: int = -100,
                classes: int | None = None) -> torch.Tensor:
    """This rank's share of the denominator of a mean loss over ``target`` (float64, 0-d):
    valid targets, or the sum of their class weights. Probability targets (floating, the class
    dim 1 included) count one per row."""
    if target.is_floating_point():
        rows = target.numel() // (classes or (target.shape[1] if target.dim() > 1 else target.numel()))
        return torch.tensor(float(rows), dtype=torch.float64, device=target.device)
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(torch.float64)
    w = weight[target.masked_fill(~valid, 0)]
    return (w.to(torch.float64) * valid).sum()


class Pending:
    """A denominator whose all-reduce is still running (issued asynchronously before the forward,
    so it overlaps the forward instead of blocking it): the first reader waits for it."""

    def __init__(self, value: torch.Tensor, work):
        self.value, self.work = value, work

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.value


def set_denominators(values: dict) -> None:
    """Install this step's global denominators (name of the loss node -> 0-d tensor, or a
    ``Pending`` one)."""
    context.current().extra[_KEY] = dict(values)


def settle() -> None:
    """Wait for every denominator still in flight (the step's end: none is left running)."""
    for v in context.current().extra.get(_KEY, {}).values():
        if isinstance(v, Pending):
            v.result()


def denominator(name: str) -> torch.Tensor:
    d = context.current().extra.get(_KEY, {})
    if name not in d:
        raise RuntimeError(f"autopar: no global denominator for the mean loss {name!r} was computed before "
                           f"running the program (autopar.execution.compiled computes them in step / __call__)")
    v = d[name]
    return v.result() if isinstance(v, Pending) else v


def divide(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` (a local sum of a mean loss) divided by the loss's global denominator, in fp32 at
    least: a bf16 count is exact only up to 256."""
    d = denominator(name)
    if x.dtype in (torch.float32, torch.float64):
        return x / d.to(x.dtype)
    return (x.float() / d.float()).to(x.dtype)


__all__ = ["Pending", "local_count", "set_denominators", "settle", "denominator", "divide"]
