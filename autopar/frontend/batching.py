"""The batch dimension of every user input: which dim the data-parallel split and micro-batching cut.

``infer_batch_dims(shapes, override=None) -> list[int | None]`` (one entry per user input, None:
the input carries no batch and is replicated whole on every rank and every micro-batch).

Rules, in order (``override`` — ``autopar.plan(batch_dims=...)`` — wins over all of them):

1. every tensor input with at least one dim has the same size B at dim 0: dim 0 everywhere (the
   PyTorch convention, and what plans made before this field existed assumed), with a warning
   when an input also has size B elsewhere while another input is 1-D (labels: B next to a
   sequence-first x: T x B x D with T == B);
2. else the batch size B is the one size every such input has in some dim: its dim of size B
   (the first one, with a warning when an input has several); a sequence-first model fed
   ``x: T x B x D`` and ``labels: B`` gets (1, 0);
3. else (no shared size, or several) a ``PlanError`` asking for ``batch_dims=``.

A 0-d input never carries the batch. Plans record the result (``"batch_dims"`` in the plan
JSON; plans without the field mean dim 0 for every input: ``plan_batch_dims``).
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

from autopar.errors import PlanError


def _check_override(shapes, override) -> list[int | None]:
    if isinstance(override, int) or override is None:
        override = [override] * len(shapes)
    override = list(override)
    if len(override) != len(shapes):
        raise PlanError(f"batch_dims={override!r} names {len(override)} inputs but the model takes {len(shapes)} "
                        f"(give one dim, or None for an input without a batch, per example input)")
    out = []
    for i, (d, s) in enumerate(zip(override, shapes)):
        if d is None:
            out.append(None)
            continue
        if not isinstance(d, int) or not -len(s) <= d < len(s):
            raise PlanError(f"batch_dims[{i}]={d!r}: input {i} has shape {tuple(s)}, so its batch dim must be "
                            f"an int in [{-len(s)}, {len(s)}) or None")
        out.append(d % len(s))
    sizes = {s[d] for s, d in zip(shapes, out) if d is not None}
    if len(sizes) > 1:
        raise PlanError(f"batch_dims={override!r} gives batch sizes {sorted(sizes)} for inputs of shapes "
                        f"{[tuple(s) for s in shapes]}: every batch dim must have the same size")
    if not sizes:
        raise PlanError(f"batch_dims={override!r}: at least one input must carry the batch")
    return out


def infer_batch_dims(shapes: Sequence[Sequence[int]], override=None) -> list[int | None]:
    """Batch dim per input (module doc). ``shapes``: the user inputs' shapes, in order."""
    shapes = [tuple(int(x) for x in s) for s in shapes]
    if override is not None:
        return _check_override(shapes, override)
    batched = [s for s in shapes if len(s) >= 1]
    if not batched:
        raise PlanError("the example inputs have no batch dimension (no tensor input with at least one dim)")
    if len({s[0] for s in batched}) == 1:
        b = batched[0][0]
        doubtful = [i for i, s in enumerate(shapes) if len(s) > 1 and b in s[1:]]
        if doubtful and any(len(s) == 1 for s in batched):
            # e.g. x: T x B x D with T == B and labels: B — dim 0 may well be the sequence
            warnings.warn(f"autopar: inputs {doubtful} of shapes {[shapes[i] for i in doubtful]} have the batch "
                          f"size {b} in dim 0 and in another dim; using dim 0 as the batch dim (pass "
                          f"batch_dims=... to autopar.plan / autopar.compile if the batch is elsewhere, e.g. "
                          f"sequence-first inputs)", stacklevel=3)
        return [0 if len(s) else None for s in shapes]
    common = set(batched[0])
    for s in batched[1:]:
        common &= set(s)
    if len(common) != 1:
        found = "no size is shared by all inputs" if not common else f"sizes {sorted(common)} are all shared"
        raise PlanError(f"cannot tell the batch dimension of inputs of shapes {[tuple(s) for s in shapes]}: "
                        f"their dim 0 sizes differ and {found}. Pass batch_dims=(...) to autopar.plan / "
                        f"autopar.compile: one dim (or None) per input, e.g. (1, 0) for x: T x B x D, labels: B")
    b = common.pop()
    out = []
    for i, s in enumerate(shapes):
        dims = [d for d, x in enumerate(s) if x == b]
        if len(dims) > 1:
            warnings.warn(f"autopar: input {i} of shape {s} has the batch size {b} in dims {dims}; using dim "
                          f"{dims[0]} as its batch dim (pass batch_dims=... to choose)", stacklevel=3)
        out.append(dims[0] if dims else None)
    return out


def graph_batch_dims(graph) -> list[int | None]:
    """The batch dims of a TracedGraph's inputs: the ones set on it by ``autopar.plan``
    (``graph.batch_dims``), else inferred from its input shapes."""
    dims = getattr(graph, "batch_dims", None)
    if dims is not None:
        return list(dims)
    return infer_batch_dims(input_shapes(graph))


def input_shapes(graph) -> list[tuple[int, ...]]:
    by_name = {n.name: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
    out = []
    for name in graph.input_names:
        v = by_name[name].meta.get("val")
        out.append(tuple(int(x) for x in v.shape) if hasattr(v, "shape") else ())
    return out


def batch_info(graph) -> dict:
    """What one training step consumes: ``global_batch`` (the first batch-carrying input's batch
    dim) and ``tokens_per_step`` (the elements of the first batch-carrying integer input of two
    or more dims, token ids [batch, sequence]: batch x sequence; None without one)."""
    shapes, dims = input_shapes(graph), graph_batch_dims(graph)
    by_name = {n.name: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
    tokens = None
    for name, s, d in zip(graph.input_names, shapes, dims):
        v = by_name[name].meta.get("val")
        if d is not None and len(s) >= 2 and v is not None and not v.dtype.is_floating_point \
                and str(v.dtype) != "torch.bool":
            tokens = math.prod(s)
            break
    return {"global_batch": batch_size(shapes, dims), "tokens_per_step": tokens}


def plan_batch_dims(plan_data: dict, n_inputs: int) -> list[int | None]:
    """The plan's recorded batch dims; plans made before the field existed cut dim 0."""
    dims = plan_data.get("batch_dims")
    return [0] * n_inputs if dims is None else list(dims)


def batch_size(shapes, dims) -> int:
    """The global batch size: the size of the first batch-carrying input's batch dim."""
    for s, d in zip(shapes, dims):
        if d is not None:
            return int(s[d])
    raise PlanError("no user input carries the batch")


_RAISE = object()


def global_batch(graph, default=_RAISE) -> int:
    """A traced graph's global batch size (``batch_size`` of its inputs, not blindly dim 0);
    ``default`` when no input carries the batch, else that is a PlanError."""
    try:
        return batch_size(input_shapes(graph), graph_batch_dims(graph))
    except PlanError:
        if default is _RAISE:
            raise
        return default


__all__ = ["infer_batch_dims", "graph_batch_dims", "input_shapes", "plan_batch_dims", "batch_size", "global_batch"]
