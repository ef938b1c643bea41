"""How one step's loss decomposes over micro-batches: what each micro-batch program must return so
that the step's loss (and so its gradients) is the SUM of the micro-batch programs' losses.

``batch_carrying(global_graph, micro_graph) -> set[str]``: nodes whose value carries the batch,
found by comparing the graph traced on the global batch with the one traced on one micro-batch
(same node names): a value whose shape changes with the batch size carries it. Comparing shapes
is exact where the op rules' letters are not (a view merging a non-leading batch dim, as
``nn.MultiheadAttention(batch_first=False)`` does, or an op without a rule, drops the batch letter).

``decompose(micro_graph, carrying) -> Decomposition``: walks the graph giving each value a role —
"batch" (cut into micro-batches), "share" (a sum over micro-batches gives the step's value),
"same" (identical in every micro-batch: parameters, inputs without a batch dim, their functions)
— and says what the per-rank program must change when it runs ``nm`` micro-batches:

- an op that reduces the batch away (``reduces_batch``) makes a share: a sum as is, a mean over
  a fixed number of elements (``aten.mean``, mse / l1 / bce ... losses with reduction "mean")
  scaled by 1/nm, a mean over targets (cross-entropy / NLL with reduction "mean": the count
  depends on the data) divided by the global count of valid targets (runtime/loss.py); both in
  ``rules.localize.local_call(micro_batches=nm)``;
- a share passes through ops linear in it (views, casts, sums, scaling by a "same" value); an
  "same" value added to a share is scaled by 1/nm (``input_scales``: counted once per step);
- a loss that is "same" (does not depend on the batch at all) is scaled by 1/nm;
- anything else (a non-linear function of a share, e.g. ``sqrt(loss)`` or ``loss + 1``, or a
  reduction over the batch that is not a sum or a mean) cannot be computed micro-batch by
  micro-batch: ``error`` says which op, and compile refuses to run more than one micro-batch.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from runtime.kernels import ops as _K

from autopar.rules.table import spec_for, tensor_inputs

aten = torch.ops.aten

# Ops reducing to a mean over a FIXED number of elements when their reduction argument is 1
# (Reduction::Mean): op -> index of the reduction argument.
FIXED_MEAN_LOSSES = {
    aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
    aten.huber_loss.default: 2, aten.soft_margin_loss.default: 2, aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4, aten.kl_div.default: 2,
    aten.multilabel_margin_loss.default: 2,
}
# Means over the targets: the count depends on ignore_index / class weights (runtime/loss.py).
TARGET_MEAN_LOSSES = {aten.cross_entropy_loss.default: 3, aten.nll_loss.default: 3}
# The fused linear + cross-entropy (runtime/kernels/ops.py) is one too: reduction argument 4.
TARGET_MEAN_LOSSES[_K.LINEAR_CROSS_ENTROPY] = 4
# Where a target-mean loss's arguments are: op -> (targets, class weights or None, ignore_index)
# (default (1, 2, 4), ATen's cross_entropy_loss / nll_loss).
TARGET_ARGS = {_K.LINEAR_CROSS_ENTROPY: (2, None, 3)}
_MEANS = {aten.mean.default, aten.mean.dim}
_SUMS = {aten.sum.default, aten.sum.dim_IntList}
_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor}
# Ops that read only their input's dtype and device, never its values: a fresh tensor of a given
# size (Hugging Face Mistral's sliding-window mask is ``x.new_ones(...)`` of a batch-carrying x).
# Their output is "same" in every micro-batch unless its shape carries the batch.
_VALUE_FREE = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
               aten.new_empty.default, aten.new_empty_strided.default}


@dataclass
class Decomposition:
    roles: dict[str, str] = field(default_factory=dict)              # node -> "batch" | "share" | "same"
    reduces_batch: set[str] = field(default_factory=set)             # ops turning batch values into a share
    input_scales: dict[str, list[int]] = field(default_factory=dict)  # node -> tensor inputs to scale by 1/nm
    error: str | None = None


def _shapes(v):
    if isinstance(v, (tuple, list)):
        return tuple(_shapes(x) for x in v)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def batch_carrying(global_graph, micro_graph) -> set[str]:
    """Names of the nodes (placeholders included) whose value's shape depends on the batch size."""
    g = {n.name: _shapes(n.meta.get("val")) for n in global_graph.gm.graph.nodes}
    out = set()
    for n in micro_graph.gm.graph.nodes:
        if n.name in g and _shapes(n.meta.get("val")) != g[n.name]:
            out.add(n.name)
    return out


def _reduction(node, index: int, default: int = 1):
    return node.args[index] if len(node.args) > index else node.kwargs.get("reduction", default)


def decompose(micro_graph, carrying: set[str]) -> Decomposition:
    """Roles and per-program changes for running the step micro-batch by micro-batch (module doc)."""
    d = Decomposition()
    roles = d.roles

    def fail(node, why):
        if d.error is None:
            d.error = (f"the loss cannot be computed micro-batch by micro-batch: {node.name} "
                       f"({node.target}) {why}. Plan with constraints={{'num_micro_batches': 1}}, or "
                       f"make the loss a sum or mean over the batch")
        roles[node.name] = "bad"

    for n in micro_graph.gm.graph.nodes:
        if n.op == "placeholder":
            roles[n.name] = "batch" if n.name in carrying else "same"
            continue
        if n.op != "call_function":
            if n.op == "get_attr":
                roles[n.name] = "same"
            continue
        if _shapes(n.meta.get("val")) is None:
            roles[n.name] = "same"     # no tensor value (an assertion, a size): nothing to add up
            continue
        ins = [roles.get(p.name, "same") for p in tensor_inputs(n)]
        if "bad" in ins:
            roles[n.name] = "bad"
        elif n.name in carrying:
            if "share" in ins:
                fail(n, "combines a per-micro-batch share of the loss with batch-carrying values")
            else:
                roles[n.name] = "batch"
        elif n.target is operator.getitem:
            roles[n.name] = ins[0] if ins else "same"
        elif all(r == "same" for r in ins) or n.target in _VALUE_FREE:
            roles[n.name] = "same"
        elif "batch" in ins:
            _reduces_batch(n, ins, d, fail)
        else:
            _linear_in_shares(n, ins, d, fail)
    return d


def _reduces_batch(n, ins, d: Decomposition, fail) -> None:
    """``n`` takes batch-carrying inputs and returns a value that no longer carries the batch."""
    if "share" in ins:
        fail(n, "combines a per-micro-batch share of the loss with batch-carrying values")
        return
    t = n.target
    if t in FIXED_MEAN_LOSSES and _reduction(n, FIXED_MEAN_LOSSES[t]) not in (1, 2):
        fail(n, f"has reduction {_reduction(n, FIXED_MEAN_LOSSES[t])!r}")
    elif t in _SUMS or t in _MEANS or t in TARGET_MEAN_LOSSES or t in FIXED_MEAN_LOSSES:
        d.roles[n.name] = "share"     # localize scales the means (module doc)
        d.reduces_batch.add(n.name)
    else:
        fail(n, "reduces over the batch and is neither a sum nor a mean")


def _linear_in_shares(n, ins, d: Decomposition, fail) -> None:
    """``n`` takes shares (and "same" values): it must be linear in the shares."""
    shares = [i for i, r in enumerate(ins) if r == "share"]
    t = n.target
    if t in _ADDITIVE and all(isinstance(a, torch.fx.Node) for a in n.args[:2]):
        d.roles[n.name] = "share"
        same = [i for i, r in enumerate(ins) if r == "same"]
        if same:
            d.input_scales[n.name] = same     # counted once per step, not once per micro-batch
        return
    if t in (aten.mul.Tensor, aten.mul.Scalar) and len(shares) == 1:
        d.roles[n.name] = "share"
        return
    if t in (aten.div.Tensor, aten.div.Scalar) and shares == [0]:
        d.roles[n.name] = "share"
        return
    spec = spec_for(n)
    if not spec.replicate_only and t not in (aten.mul.Tensor, aten.div.Tensor) \
            and all(i in spec.partial_inputs for i in shares):
        d.roles[n.name] = "share"
        return
    fail(n, "is not linear in the per-micro-batch share of the loss it reads")


def loss_scale(decomp: Decomposition, output_name: str) -> bool:
    """Whether the loss itself must be scaled by 1/nm (it does not depend on the batch)."""
    return decomp.roles.get(output_name) == "same"


__all__ = ["batch_carrying", "decompose", "Decomposition", "loss_scale", "FIXED_MEAN_LOSSES",
           "TARGET_MEAN_LOSSES", "TARGET_ARGS"]
