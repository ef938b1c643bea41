"""What an SDPA strategy on sequence axes is made of, shared by the single-axis algorithms
(autopar/rules/sequence_attention.py: Ulysses, ring) and the Ulysses x ring hybrid on two axes
(autopar/rules/hybrid_sequence.py): the refusals whatever the algorithm (``refuse_shape``), the
layouts with q, k, v and the output split on the sequence (``sequence_split``), and the strategy
named after the algorithm (``sequence_strategy``)."""
from __future__ import annotations

import math

from autopar.mesh import Mesh
from autopar.rules.layout import Layout
from autopar.rules.strategy import Strategy

# In an SDPA strategy's special beside the algorithm: its attn_mask is the causal mask
# (autopar/rules/causal_mask.py), so the algorithm runs is_causal=True without it.
CAUSAL_MASK = "causal_attn_mask"


def refuse_shape(f: dict, algo: str) -> str | None:
    """Why no sequence-parallel algorithm runs this attention whatever its mask and sizes (cross-
    attention, attention dropout), or None; ``algo`` names the algorithm in the reason."""
    if f["s"] != f["t"]:
        return f"cross-attention (query length {f['s']}, key length {f['t']}) is not sequence-parallel"
    if f["dropout"]:
        return f"attention dropout (dropout_p={f['dropout']}) is not supported by {algo}"
    return None


def sequence_split(st: Strategy, spec, mesh: Mesh, axes: tuple[int, ...]):
    """(input layouts, output layouts, local letter sizes) of SDPA strategy ``st`` with q, k, v
    and the output split on the sequence (dim 2) over mesh ``axes`` too; the sizes are ``st``'s
    (the sequence split is the algorithm's own)."""
    def seq_split(lay: Layout) -> Layout:
        dims = list(lay.dims)
        dims[2] = dims[2] + tuple(axes)
        return Layout(tuple(dims), lay.partial)

    ins = tuple(seq_split(l) if (l is not None and i < 3) else l for i, l in enumerate(st.inputs))
    outs = (seq_split(st.outputs[0]),)
    local = {ch: spec.sizes[ch] // math.prod(mesh.shape[x] for x, s in enumerate(st.splits) if s == ch)
             for ch in spec.sizes}
    return ins, outs, local


def sequence_strategy(st: Strategy, axes: str, algo: str, causal_mask: bool, ins, outs, splits, work,
                      comms, backward_comms=None) -> Strategy:
    """The attention strategy running ``algo`` with the sequence split over ``axes`` (mesh axis
    names) on top of ``st``: named after both, its special the algorithm (and CAUSAL_MASK when
    the explicit mask it drops is the proven causal one). ``backward_comms``: the backward's
    collectives when they are not ``comms`` mirrored (``Strategy.backward_comms``)."""
    name = "" if st.name == "R" else st.name
    name = (name + " " if name else "") + f"S(s)@{axes} [{algo}]"
    special = (algo,)
    if causal_mask:
        name += " (attn_mask causal)"
        special += (CAUSAL_MASK,)
    return Strategy(name, ins, outs, tuple(splits), work, comms, special, backward_comms)
