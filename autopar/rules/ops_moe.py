"""Rule for the mixture-of-experts operator ``torch.ops.autopar.moe_experts`` (runtime/moe.py)::

    hidden "th", top_k_index "tk", top_k_weights "tk", gate_up "egh", down "eof" -> out "to"

* ``t`` (tokens) is free: data parallel, experts replicated.
* ``e`` (experts) is split only through the special algorithm "moe_experts_ep" (runtime/moe.py
  ``moe_experts_ep``): each rank runs the experts of its block on every token routed there and
  the output is a PARTIAL SUM over the expert axis (no collective of its own; the reshard after
  it all-reduces or reduce-scatters). This is how the experts' weights are split.
* Not split: ``g`` (2F: gate and up CONCATENATED, so a contiguous block of it would give one rank
  gates and the other ups; Megatron's column split needs pairs), ``f`` and ``h`` (contracted
  through the nonlinearity), ``o`` (a split down projection would recompute the whole
  intermediate on every rank: correct but the cost model would price 1/n of the work), ``k``.

FLOPs count only the chosen experts: 2 · T · k · (H · 2F + F · O) plus the gate; bytes are the
inputs (the expert weights read once) and the output, plus the intermediate written and read.
Autograd keeps the inputs only (the backward recomputes the intermediate).
"""
from __future__ import annotations

import runtime.moe  # noqa: F401  (registers torch.ops.autopar.moe_experts)
import torch

from autopar.rules.spec import OpSpec, Saved
from autopar.rules.table import io_bytes, rule, shape, val

MOE_EXPERTS = torch.ops.autopar.moe_experts.default


@rule(MOE_EXPERTS)
def moe_experts(node):
    T, H = shape(node.args[0])
    k = shape(node.args[1])[1]
    E, G, _ = shape(node.args[3])
    _, O, Fd = shape(node.args[4])
    sizes = {"t": T, "h": H, "k": k, "e": E, "g": G, "o": O, "f": Fd}
    itemsize = val(node.args[0]).element_size()
    flops = 2.0 * T * k * (H * G + Fd * O) + 4.0 * T * k * Fd
    inter = 3.0 * T * k * Fd * itemsize
    return OpSpec("moe_experts", ("th", "tk", "tk", "egh", "eof"), ("to",), sizes,
                  unsplittable=frozenset("hkgfo"), special={"e": ("moe_experts_ep", ())},
                  flops=flops, bytes=io_bytes(node) + inter,
                  saved=tuple(Saved("input", i) for i in range(5)))
