"""Scaled-dot-product attention on sequence axes: the algorithms' names, what an SDPA
node is (``attention_facts``: shapes, mask proven causal or not, dropout), its strategies with
q, k, v and the output split on the sequence (Ulysses all-to-all, load-balanced or contiguous
ring attention, or the ordinary query split with K/V all-gathered by resharding), why an
algorithm is refused for an op, and each strategy's price from the runtime's closed forms
(``ulysses_bytes``, ``ring_attention_bytes``, ``ring_attention_flops``). The Ulysses x ring hybrid
on two axes is autopar/rules/hybrid_sequence.py's; called from here. The pieces both share (refusals, the
sequence split, the strategy) are in autopar/rules/attention_split.py."""
from __future__ import annotations

import math

from autopar.errors import PlanError
from autopar.mesh import Mesh
from autopar.rules import hybrid_sequence as hybrid
from autopar.rules.attention_split import CAUSAL_MASK, refuse_shape, sequence_split, sequence_strategy  # noqa: F401  (CAUSAL_MASK: public here too)
from autopar.rules.strategy import Strategy
from autopar.rules.causal_mask import mask_is_causal
from autopar.rules.spec import Saved
from autopar.rules.table import is_tensor, shape as tensor_shape
from runtime.ring_attention import ring_attention_bytes, ring_attention_flops
from runtime.seq_layout import kv_repeat_factor
from runtime.ulysses import ulysses_bytes

RING, RING_CONTIGUOUS, ULYSSES = "ring_attention", "ring_attention_contiguous", "ulysses_attention"
ALGORITHMS = (RING, RING_CONTIGUOUS, ULYSSES) + hybrid.ALGORITHMS


def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def attention_facts(node) -> dict:
    q, k, v = node.args[:3]
    (b, h, s, d), (_, hk, t, _) = tensor_shape(q), tensor_shape(k)
    mask = _arg(node, 3, "attn_mask")
    # An explicit mask proven causal from the graph (Hugging Face models build one instead of
    # passing is_causal=True: autopar/rules/causal_mask.py) is run as is_causal=True by the
    # sequence-parallel algorithms, which drop it (CAUSAL_MASK in the strategy's special).
    causal_mask, why = mask_is_causal(node) if is_tensor(mask) else (False, "")
    return dict(b=b, h=h, hk=hk, s=s, t=t, d=d, e=tensor_shape(v)[-1], mask=is_tensor(mask) and not causal_mask,
                mask_shape=tuple(tensor_shape(mask)) if is_tensor(mask) else None,
                mask_name=mask.name if is_tensor(mask) else None, mask_grad=False,
                dropout=float(_arg(node, 4, "dropout_p", 0.0) or 0.0),
                causal=bool(_arg(node, 5, "is_causal", False)) or causal_mask, causal_mask=causal_mask,
                mask_why=why, itemsize=q.meta["val"].element_size())


def attention_strategies(node, spec, strategies, mesh: Mesh, sps, mode, grad=frozenset()) -> list[Strategy]:
    """SDPA strategies with the sequence split over the sp axis: Ulysses and/or ring attention
    on top of every strategy of the other axes that keeps the sequence whole (``mode`` "ulysses",
    "ring", "ring-contiguous" keep that algorithm only; "auto"/None offer both and the
    replicated-on-sp ones). ``grad``: the values gradients flow to (a mask among them, a learned
    position bias, is not run by Ulysses: see ``_refuse``)."""
    if len(sps) == 2 and hybrid.axes(mesh) is not None:   # Ulysses x ring (autopar/rules/hybrid_sequence.py)
        return hybrid.attention_strategies(node, spec, strategies, mesh, attention_facts(node))
    if len(sps) != 1:
        raise PlanError(f"{node.name}: attention over {len(sps)} sequence axes is planned only as sp_mode='hybrid'")
    a = sps[0]
    sp = mesh.shape[a]
    f = attention_facts(node)
    f["mask_grad"] = f["mask_name"] in grad
    base = [st for st in strategies if st.splits[a] is None
            and not any(st.inputs[i] is not None and st.inputs[i].dims[2] for i in range(3))]
    algos = {"ulysses": [ULYSSES], "ring": [RING], "ring-contiguous": [RING_CONTIGUOUS]}.get(mode, [ULYSSES, RING])
    why = []
    out = []
    for algo in algos:
        reason = _refuse(node, f, sp, algo)
        if reason:
            why.append(reason)
            continue
        for st in base:
            made = _with_algorithm(st, spec, f, mesh, a, algo)
            if made is None:
                why.append(f"{algo}: the local heads of {st.name} do not divide by sp={sp}")
            else:
                out.append(made)
    # The ordinary strategies splitting the query rows on the axis: K/V (and a mask's key dim) are
    # all-gathered by resharding, any mask's rows sliced like the queries (the all-gathered-K/V
    # algorithm, priced as the reshards it runs). SDPA's rule allows them without is_causal.
    gathered = [st for st in strategies if st.splits[a] == "s"]
    if mode in ("ulysses", "ring", "ring-contiguous"):
        if not out and gathered and f["mask"]:
            import warnings
            reason = "; ".join(dict.fromkeys(why)) if mode == "ulysses" else \
                f"it is not provably causal: {f['mask_why']}"
            warnings.warn(f"autopar: {node.name} has an explicit attn_mask, which {mode} attention cannot run "
                          f"({reason}); it runs sequence-split with K/V all-gathered instead (priced)", stacklevel=2)
            return gathered
        if not out:
            raise PlanError(f"{node.name} (scaled_dot_product_attention): sp_mode={mode!r} cannot run it on "
                            f"sp={sp}: " + "; ".join(dict.fromkeys(why)))
        return out
    return out + gathered + base


def saves_as_run(node, spec, strategies):
    """The SDPA spec's saved tensors as its sequence-parallel algorithm keeps them, when every
    strategy left runs one (a pinned mode; the spec is shared by all strategies of the node):

    - an attn_mask proven causal is dropped (CAUSAL_MASK): nothing of it is saved, neither the
      mask nor a fused kernel's copy of it in q's dtype;
    - a general mask under Ulysses runs whole: the copy SDPA saves of a bool mask is not split on
      the query rows;
    - Ulysses saves the output of its local attention (head-split, between the two all-to-alls),
      a buffer of its own: the op's output is the second all-to-all's result, which later ops
      may save too (``y.transpose(1, 2)`` viewed by the output projection when the trace lays
      the attention output out like a (b, s, h, d) q, as Hugging Face Llama's and GPT-2's are).
      Priced as the op's output, those two were counted once.
    Ring attention saves the output it returns (laid out like q, runtime/ring_attention.py)."""
    import dataclasses
    saved = spec.saved
    if all(CAUSAL_MASK in st.special for st in strategies):
        mask = spec.inputs[3] if len(spec.inputs) > 3 else None
        saved = tuple(sv for sv in saved if not ((sv.kind == "input" and sv.index == 3)
                                                 or (sv.kind == "extra" and mask is not None and sv.letters == mask)))
    if all(ULYSSES in st.special or any(a in st.special for a in hybrid.ALGORITHMS) for st in strategies):
        isz = node.meta["val"].element_size()
        saved = tuple(Saved("extra", letters=spec.outputs[0], itemsize=isz, act=True, on=sv.on)
                      if sv.kind == "output" and sv.index == 0 else sv for sv in saved)
    if all(ULYSSES in st.special for st in strategies) and len(spec.inputs) > 3 and spec.inputs[3]:
        # a general mask runs whole (its query rows too): the copy SDPA saves of a bool mask is
        # priced over the key letter, which is never split (self-attention: as long as the query)
        mask = spec.inputs[3]
        saved = tuple(dataclasses.replace(sv, letters=mask.replace("s", "t"))
                      if sv.kind == "extra" and sv.letters == mask else sv for sv in saved)
    return spec if saved is spec.saved else dataclasses.replace(spec, saved=saved)


def ulysses_mask_refusal(f: dict) -> str | None:
    """Why Ulysses cannot run this attention's explicit (not causal) mask, or None. Ulysses runs
    attention over the whole sequence for a share of the heads, so the mask is used whole, each
    rank taking its heads' rows of a per-head mask (runtime/ulysses.py): it must span the whole
    query and key lengths, and no gradient may flow to it (a learned position bias, T5's: each
    rank would hold its heads' share of the gradient of a mask kept whole on the axis)."""
    shape = f["mask_shape"]
    if len(shape) < 2 or shape[-2:] != (f["s"], f["t"]) or len(shape) > 4:
        return f"the attn_mask of shape {shape} does not span the whole query x key lengths ({f['s']} x {f['t']})"
    if len(shape) >= 3 and shape[-3] not in (1, f["h"]):
        return f"the attn_mask's head dim ({shape[-3]}) is neither 1 nor the {f['h']} heads"
    if f["mask_grad"]:
        return "gradients flow to the attn_mask (a learned bias): Ulysses keeps the mask whole on the axis"
    return None


def _refuse(node, f, sp, algo) -> str | None:
    why = refuse_shape(f, algo)
    if why:
        return why
    if f["mask"] and algo == ULYSSES:
        why = ulysses_mask_refusal(f)
        if why:
            return f"ulysses_attention with an explicit attn_mask: {why}"
    elif f["mask"]:
        return (f"an explicit attn_mask: {algo} supports no mask or is_causal=True only (ring attention would "
                f"have to split a general mask over its blocks); write the attention as matmul/softmax to get "
                f"the all-gathered-K/V form, or use is_causal")
    chunks = 2 * sp if (algo == RING and f["causal"]) else sp
    if f["s"] % chunks:
        extra = " (load-balanced causal ring attention cuts it into 2·sp zig-zag chunks)" if chunks == 2 * sp else ""
        return f"the sequence length {f['s']} does not divide into {chunks} chunks for sp={sp}{extra}"
    if algo == ULYSSES and f["h"] % sp:
        return f"Ulysses splits the {f['h']} heads over sp={sp} ranks: heads must divide by sp"
    return None


def _with_algorithm(st: Strategy, spec, f, mesh: Mesh, a: int, algo: str) -> Strategy | None:
    sp = mesh.shape[a]
    ins, outs, local = sequence_split(st, spec, mesh, (a,))
    b, h, hk, d = local["b"], local["h"], local.get("g", local["h"]), local["d"]
    s, isz = f["s"], f["itemsize"]
    splits = list(st.splits)
    splits[a] = "s"
    if algo == ULYSSES:
        if h % sp or (hk * (math.lcm(hk, sp) // hk)) % sp:
            return None
        tr = ulysses_bytes(b, h, hk, s, d, sp, isz)
        one = b * (s // sp) * d * isz
        kvh = hk * kv_repeat_factor(h, hk, sp)
        # forward all-to-alls of q, stacked k/v and the output; backward moves the same (priced x2)
        comms = (("all_to_all", a, float(h * one)), ("all_to_all", a, float(2 * kvh * one)),
                 ("all_to_all", a, float(h * one)))
        assert abs(sum(c[2] for c in comms) - tr.forward_bytes) < 1e-6 * max(tr.forward_bytes, 1)
        work = 1.0 / sp
    else:
        layout = "zigzag" if algo == RING else "contiguous"
        tr = ring_attention_bytes(b, hk, s, d, sp, isz)
        # Forward and backward priced apart: backward also sends the fp32 dK/dV accumulators, and
        # a recomputed (checkpointed) forward repeats the forward's bytes only.
        # Time: an all-to-all of that size on the axis ~ the ring's (sp-1) hops per direction.
        comms = (("all_to_all", a, float(tr.forward_bytes)),)
        backward = (("all_to_all", a, float(tr.backward_bytes)),)
        fwd_flops, _ = ring_attention_flops(b, h, s, d, sp, is_causal=f["causal"], layout=layout)
        # executed matmul FLOPs of the busiest rank (causal contiguous: the last rank does sp blocks)
        work = fwd_flops / spec.flops if spec.flops else 1.0 / sp
        return sequence_strategy(st, mesh.names[a], algo, f["causal_mask"], ins, outs, splits, work, comms,
                                 backward)
    return sequence_strategy(st, mesh.names[a], algo, f["causal_mask"], ins, outs, splits, work, comms)
