"""Static memory model: bytes of parameters, gradients and optimizer state per device.

This module owns the per-element byte counts of model state and how ZeRO shards them; the
activation (liveness) part of the memory model lives with the op rules and the ILP builder.
Torch-free.

Bytes per parameter element (mixed precision as in the ZeRO paper, Rajbhandari et al. 2020, §3.1):

    precision  params            grads        optimizer
    bf16       2 (bf16 working)  2 (bf16)     4 (fp32 master copy) + states
    fp32       4                 4            states

    states (fp32): adamw / adam 8 (m, v); sgd 4 (momentum); lamb 8 (m, v); lars 4 (momentum)

Check: bf16 AdamW is 2 + 2 + (4 + 8) = 16 bytes per parameter, the ZeRO paper's "2Ψ + 2Ψ + 12Ψ".

ZeRO over ``dp`` data-parallel ranks (``zero_shard``): stage 1 divides the optimizer bytes by
dp, stage 2 also the gradients, stage 3 also the parameters; stage 0 divides nothing.
"""
from __future__ import annotations

import difflib
import numbers

from autopar.errors import PlanError

OPTIMIZERS = ("adamw", "adam", "sgd", "lamb", "lars")
PRECISIONS = ("bf16", "fp32")

# fp32 optimizer state bytes per element
STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "lamb": 8, "lars": 4}
# (params, grads, master copy) bytes per element
_PRECISION_BYTES = {"bf16": (2, 2, 4), "fp32": (4, 4, 0)}


def _check(name, valid: tuple[str, ...], what: str) -> str:
    if isinstance(name, str) and name in valid:
        return name
    close = difflib.get_close_matches(str(name), valid, n=1) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise PlanError(f"unknown {what} {name!r}{hint}; expected one of: {', '.join(valid)}")


def check_optimizer(name) -> str:
    """Return ``name`` if it is a supported optimizer, else raise PlanError listing them."""
    return _check(name, OPTIMIZERS, "optimizer")


def check_precision(name) -> str:
    """Return ``name`` if it is a supported precision, else raise PlanError listing them."""
    return _check(name, PRECISIONS, "precision")


def bytes_per_element(optimizer: str, precision: str) -> dict[str, int]:
    """Bytes of params / grads / optimizer state one parameter element costs (unsharded)."""
    check_optimizer(optimizer)
    check_precision(precision)
    p, g, master = _PRECISION_BYTES[precision]
    return {"params": p, "grads": g, "optimizer": master + STATE_BYTES[optimizer]}


def state_bytes(numel: float, optimizer: str, precision: str) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state for ``numel`` elements on one device
    (``numel`` may be fractional: an average over shards)."""
    if isinstance(numel, bool) or not isinstance(numel, numbers.Real) or numel < 0:
        raise PlanError(f"state_bytes: numel = {numel!r}; expected a number of elements >= 0")
    per = bytes_per_element(optimizer, precision)
    return {k: float(numel) * v for k, v in per.items()}


def zero_shard(breakdown: dict, zero_stage: int, dp: int) -> dict:
    """Apply ZeRO stage ``zero_stage`` over ``dp`` data-parallel ranks to a ``state_bytes``
    breakdown: 1 shards optimizer state, 2 also gradients, 3 also parameters. Other keys pass
    through unchanged. Returns a new dict."""
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise PlanError(f"ZeRO stage {zero_stage!r} is not one of 0, 1, 2, 3")
    if isinstance(dp, bool) or not isinstance(dp, numbers.Integral) or dp < 1:
        raise PlanError(f"data-parallel degree dp = {dp!r}; expected an integer >= 1")
    sharded = ("optimizer", "grads", "params")[:zero_stage]
    missing = [k for k in sharded if k not in breakdown]
    if missing:
        raise PlanError(f"zero_shard: breakdown lacks {missing}; expected the keys of state_bytes()")
    return {k: (v / dp if k in sharded else v) for k, v in breakdown.items()}
