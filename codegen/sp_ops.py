"""Emission of sequence-parallel ops into a per-rank program (autopar/rules/sequence.py plans them).

``attention(builder, node, strategy, args, kwargs)``: an SDPA node whose strategy carries a
sequence-parallel algorithm becomes one call of runtime/sp_exec.py (``ulysses``, ``ring`` or, on the
two sequence axes of sp_mode="hybrid", ``hybrid`` with the ring axis outer) on
the local q, k, v blocks, with the traced is_causal and scale (an attn_mask the planner proved causal,
``CAUSAL_MASK`` in the strategy's special, is dropped and is_causal set; another mask is passed whole
to Ulysses, the one algorithm that runs it). ``reshard_step(builder, x, step,
kwargs)``: a reshard step on an axis where the plan's splits are zig-zag (load-balanced ring
attention) becomes the zig-zag form of the step (runtime/sp_exec.py explains why that keeps
values, gradients and bytes right); ``None`` for steps the caller emits as usual.
"""
from __future__ import annotations

from autopar.errors import ExecutionError
from autopar.rules import hybrid_sequence as HS
from autopar.rules.sequence_attention import ALGORITHMS, CAUSAL_MASK, RING, RING_CONTIGUOUS, ULYSSES
from runtime import sp_exec as SX


def handles(strategy) -> bool:
    return any(a in ALGORITHMS for a in strategy.special)


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def attention(builder, node, strategy, args, kwargs):
    algo = next(a for a in strategy.special if a in ALGORITHMS)
    axes = [a for a, s in enumerate(strategy.splits) if s == "s" and builder.mesh_shape[a] > 1]
    hybrid = algo in HS.ALGORITHMS
    if len(axes) != (2 if hybrid else 1) or (hybrid and HS.axes(builder.mesh) != tuple(axes)):
        raise ExecutionError(f"{node.name}: {algo} needs " + ("its two sequence axes (sp_r, sp_u)" if hybrid else
                                                             "exactly one sequence axis") + f", the plan gives {axes}")
    q, k, v = args[:3]
    # a mask the planner proved causal (autopar/rules/causal_mask.py) is dropped: is_causal=True
    causal_mask = CAUSAL_MASK in strategy.special
    if causal_mask and _arg(args, kwargs, 3, "attn_mask") is None:
        raise ExecutionError(f"{node.name}: the plan runs its attn_mask as causal, but the model passes none "
                             f"(plan/model mismatch)")
    # a general mask runs under Ulysses only (whole, each rank taking its heads' rows)
    mask = None if causal_mask else _arg(args, kwargs, 3, "attn_mask")
    if (mask is not None and algo != ULYSSES) or float(_arg(args, kwargs, 4, "dropout_p", 0.0) or 0.0):
        raise ExecutionError(f"{node.name}: {algo} runs without attn_mask and dropout only (plan/model mismatch)")
    kw = {"axis": axes[0], "is_causal": causal_mask or bool(_arg(args, kwargs, 5, "is_causal", False)),
          "scale": kwargs.get("scale")}
    if algo == ULYSSES:
        return builder.call(SX.ulysses, (q, k, v) if mask is None else (q, k, v, mask), kw, name=node.name)
    if hybrid:   # ring axis outer, Ulysses axis inner (autopar/rules/hybrid_sequence.py)
        kw["ring_axis"], kw["axis"] = HS.axes(builder.mesh)
        kw["layout"] = "zigzag" if algo == HS.HYBRID else "contiguous"
        return builder.call(SX.hybrid, (q, k, v), kw, name=node.name)
    kw["layout"] = "zigzag" if algo == RING else "contiguous"
    assert algo in (RING, RING_CONTIGUOUS)
    return builder.call(SX.ring, (q, k, v), kw, name=node.name)


def reshard_step(builder, x, step, kwargs):
    if step.axis not in builder.zigzag_axes:
        return None
    if step.kind == "slice":
        return builder.call(SX.zz_slice, (x, step.dim), {"axis": step.axis})
    if step.kind == "all_gather":
        return builder.call(SX.zz_all_gather, (x, step.dim), kwargs)
    if step.kind == "reduce_scatter":
        return builder.call(SX.zz_reduce_scatter, (x, step.dim), {"axis": step.axis})
    if step.kind == "all_to_all":
        raise ExecutionError(f"an all-to-all on mesh axis {step.axis}, whose splits are zig-zag (load-balanced ring "
                             f"attention), is not supported")
    return None
