"""The Ulysses x ring hybrid in the planner (``sp_mode="hybrid"``): its pins, its meshes,
its attention strategies and what the plan reports. autopar/rules/sequence.py owns sequence
parallelism in general and calls into this module for the hybrid; runtime/hybrid_sp.py runs it.

Pins: ``{"sp": u*r, "sp_mode": "hybrid"}`` and optionally ``"sp_shape": [u, r]`` (Ulysses size,
ring size; both at least 2, u*r = sp; with only ``sp_shape`` pinned, sp = u*r). Without
``sp_shape`` the split is chosen once the model is traced (``resolve``, from autopar.api.plan):
Ulysses over the ranks of a node, the ring across nodes -- the largest u <= sp/2 that divides
every attention op's heads and fits a node, else the largest u dividing the heads (``default_shape``).

Mesh: (dp, sp_r, sp_u[, tp]), ``sp_r`` = r the ring (outer: spans nodes), ``sp_u`` = u Ulysses
(inner: inside a node). An op carrying the sequence splits it over both axes, ring outer (the
Layout of the sequence dim is (sp_r, sp_u)); rank (ri, ui) then holds the ui-th contiguous
S/(r·u) rows of ring piece ri, exactly ``runtime.hybrid_sp.positions``. Under a causal mask the
ring pieces are zig-zag (load-balanced), so every split on ``sp_r`` is the zig-zag split
(codegen/sp_ops.py permutes its reshard steps, as for load-balanced ring attention); splits on
``sp_u`` are contiguous inside the piece. Without a causal mask the pieces are contiguous.

Attention (``aten.scaled_dot_product_attention``) runs ``runtime.hybrid_sp.hybrid_attention``:
q, k, v and the output split on the sequence over (sp_r, sp_u), priced by ``hybrid_bytes``:
Ulysses' three all-to-alls on ``sp_u`` (on a sequence of S/r), the ring's K/V and dK/dV p2p on
``sp_r`` (the kv heads a rank holds after the all-to-all). Compute: the ring's busiest rank on
the h/u local heads.

The free search (autopar/search/sequence_search.py) tries the hybrid next to each sequence-axis
size it searches, only where it can pay (``free_search_pins``): the axis spans nodes, or the
heads do not divide by sp.

Bad input is a ConstraintError naming the op: heads not divisible by u, a sequence not dividing
into 2·r·u chunks (zig-zag) or r·u (not causal), an explicit mask not proven causal, dropout,
cross-attention. The pins themselves (sp = u·r, the form of ``sp_shape``) are autopar/constraints.py's.
"""
from __future__ import annotations

import math

from autopar.errors import ConstraintError
from autopar.mesh import Mesh, enumerate_meshes
from autopar.rules.attention_split import refuse_shape, sequence_split, sequence_strategy
from autopar.rules.strategy import Strategy
from runtime.hybrid_sp import hybrid_bytes
from runtime.ring_attention import ring_attention_flops
from runtime.seq_layout import kv_repeat_factor

HYBRID = "hybrid_attention"                         # ring pieces zig-zag (causal, load-balanced)
HYBRID_CONTIGUOUS = "hybrid_attention_contiguous"   # ring pieces contiguous (no causal mask)
ALGORITHMS = (HYBRID, HYBRID_CONTIGUOUS)
RING_AXIS, ULYSSES_AXIS = "sp_r", "sp_u"


# ------------------------------------------------------------------ pins

def _shape_pin(constraints: dict) -> tuple[int, int] | None:
    """The pinned [u, r] (checked by autopar/constraints.py), or None."""
    shape = constraints.get("sp_shape")
    return None if shape is None else (int(shape[0]), int(shape[1]))


def splits(sp: int) -> list[tuple[int, int]]:
    """Every (u, r) with u*r = sp and u, r >= 2, largest u first."""
    return [(u, sp // u) for u in range(sp // 2, 1, -1) if sp % u == 0 and sp // u >= 2]


def default_shape(sp: int, room: int, heads: list[int] | None = None) -> tuple[int, int] | None:
    """The (u, r) used when ``sp_shape`` is not pinned: Ulysses inside a node (u <= ``room``, the
    ranks of a node left to the sequence axes), ring across nodes; the largest such u dividing
    every attention's ``heads``, else the largest u dividing them anywhere; None when none does."""
    ok = [(u, r) for u, r in splits(sp) if all(h % u == 0 for h in heads or ())]
    inside = [(u, r) for u, r in ok if u <= room]
    return (inside or ok or [None])[0]


def _sdpa_heads(graph) -> dict[str, int]:
    """Query heads of each SDPA node of the traced graph (the ops the hybrid runs)."""
    return {n.name: n.args[0].meta["val"].shape[1] for n in graph.gm.graph.nodes
            if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)}


def free_search_pins(graph, cluster, sp: int) -> dict | None:
    """The hybrid's pins the free search adds for sequence-axis size ``sp``
    (autopar/search/sequence_search.py), or None. Only where it can pay: the sequence axis spans
    more than one node (a cluster of several nodes: with dp=1 the sequence and tensor axes fill
    them all, so Ulysses' all-to-alls would cross the slow link where the ring's p2p overlaps
    with compute), or some attention's heads do not divide by sp (Ulysses alone cannot run it).
    The split: Ulysses over the sequence ranks of one node at dp=1 (sp / nodes), the ring across
    nodes (``default_shape``); the model must run SDPA."""
    heads = _sdpa_heads(graph)
    if not heads or not splits(sp):
        return None
    nodes = max(1, cluster.num_devices // cluster.devices_per_node)
    if nodes == 1 and all(h % sp == 0 for h in heads.values()):
        return None
    shape = default_shape(sp, max(1, sp // nodes), list(heads.values()))
    return None if shape is None else {"sp_mode": "hybrid", "sp_shape": list(shape)}


def resolve(graph, cluster, constraints: dict | None) -> dict | None:
    """``constraints`` with ``sp_shape`` filled in for an unpinned hybrid split (autopar.api.plan,
    once the model is traced): ``default_shape`` with the attention ops' head counts (and ``sp``
    for a pinned ``sp_shape`` alone). A model whose heads no u divides is a ConstraintError
    naming its attention op."""
    if not constraints or constraints.get("sp_mode") != "hybrid":
        return constraints
    if "sp_shape" in constraints:   # sp = u*r for what reads only sp (pipeline.check_stage_axes)
        u, r = _shape_pin(constraints)
        return constraints if "sp" in constraints else {**constraints, "sp": u * r}
    sp = constraints["sp"]   # pinned, and a product u*r (autopar/constraints.py checks both)
    heads = _sdpa_heads(graph)
    tp = constraints.get("tp")
    room = max(1, cluster.devices_per_node // (tp if isinstance(tp, int) and tp > 0 else 1))
    shape = default_shape(sp, room, list(heads.values()))
    if shape is None and heads:
        name, h = next(((n, h) for n, h in heads.items() if not any(h % u == 0 for u, _ in splits(sp))),
                       next(iter(heads.items())))
        raise ConstraintError(f"{name} (scaled_dot_product_attention): sp_mode='hybrid' with sp={sp} splits its "
                              f"{h} heads over the Ulysses size u of some u x r = {sp} with u, r >= 2 "
                              f"({', '.join(f'{u}x{r}' for u, r in splits(sp))}), and none of these u divides "
                              f"{h}; use another sp, or sp_mode='ring'")
    return {**constraints, "sp_shape": list(shape)}


# ------------------------------------------------------------------ meshes

def meshes(cluster, constraints: dict) -> list[Mesh]:
    """The hybrid meshes (dp, sp_r, sp_u[, tp]) for the pinned sp / sp_shape (module doc)."""
    n = cluster.num_devices
    shape = _shape_pin(constraints)
    sp = shape[0] * shape[1] if shape else constraints["sp"]
    if n % sp:
        return []
    out = []
    for m in enumerate_meshes(n // sp, cluster.devices_per_node, max_model_axes=1):
        tp = math.prod(m.shape[1:])
        u, r = shape or default_shape(sp, max(1, cluster.devices_per_node // tp)) or (0, 0)
        if not u:
            continue
        out.append(Mesh((m.shape[0], r, u) + m.shape[1:], (m.names[0], RING_AXIS, ULYSSES_AXIS) + m.names[1:],
                        cluster.devices_per_node))
    return out


def mesh_allowed(mesh: Mesh, constraints: dict) -> bool:
    if RING_AXIS not in mesh.names or ULYSSES_AXIS not in mesh.names:
        return False
    u, r = mesh.shape[mesh.axis(ULYSSES_AXIS)], mesh.shape[mesh.axis(RING_AXIS)]
    shape = _shape_pin(constraints)
    return (shape is None or shape == (u, r)) and constraints.get("sp", u * r) == u * r


def axes(mesh: Mesh) -> tuple[int, int] | None:
    """(ring axis, Ulysses axis) of a hybrid mesh, or None."""
    if RING_AXIS in mesh.names and ULYSSES_AXIS in mesh.names:
        return mesh.axis(RING_AXIS), mesh.axis(ULYSSES_AXIS)
    return None


# ------------------------------------------------------------------ strategies

def keep_nested(strategies, mesh: Mesh) -> list[Strategy]:
    """Ops other than attention on a hybrid mesh: a strategy splitting the sequence splits the SAME
    letter on both axes (ring outer), so every layout is one of ``hybrid_sp.positions``."""
    ra, ua = axes(mesh)
    return [st for st in strategies if st.splits[ra] == st.splits[ua]]


def attention_strategies(node, spec, strategies, mesh: Mesh, f: dict) -> list[Strategy]:
    """SDPA's strategies on a hybrid mesh: ``hybrid_attention`` on top of every strategy of the
    other axes that keeps the sequence whole, or a ConstraintError naming the op."""
    ra, ua = axes(mesh)
    r, u = mesh.shape[ra], mesh.shape[ua]
    algo = HYBRID if f["causal"] else HYBRID_CONTIGUOUS
    why = _refuse(f, u, r)
    if why:
        raise ConstraintError(f"{node.name} (scaled_dot_product_attention): sp_mode='hybrid' (u={u} Ulysses x "
                              f"r={r} ring) cannot run it: {why}")
    base = [st for st in strategies if st.splits[ra] is None and st.splits[ua] is None
            and not any(st.inputs[i] is not None and st.inputs[i].dims[2] for i in range(3))]
    out = [made for st in base if (made := _with_hybrid(st, spec, f, mesh, ra, ua, algo)) is not None]
    if not out:
        raise ConstraintError(f"{node.name} (scaled_dot_product_attention): sp_mode='hybrid' splits its heads over "
                              f"u={u} Ulysses ranks, but the heads on each tensor-parallel rank do not divide by "
                              f"{u}; pin another sp_shape or tp")
    return out


def _refuse(f: dict, u: int, r: int) -> str | None:
    why = refuse_shape(f, "the Ulysses x ring hybrid")
    if why:
        return why
    if f["mask"]:
        return (f"an explicit attn_mask that is not provably causal ({f['mask_why']}): the hybrid supports no mask "
                f"or the causal mask only")
    if f["h"] % u:
        return f"Ulysses splits the {f['h']} heads over u={u} ranks: the heads must divide by u"
    chunks = 2 * r * u if f["causal"] else r * u
    if f["s"] % chunks:
        extra = (f" (zig-zag load balancing cuts it into 2·r = {2 * r} ring pieces, each split over u = {u})"
                 if f["causal"] else "")
        return f"the sequence length {f['s']} does not divide into {chunks} chunks{extra}"
    return None


def _with_hybrid(st: Strategy, spec, f: dict, mesh: Mesh, ra: int, ua: int, algo: str) -> Strategy | None:
    r, u = mesh.shape[ra], mesh.shape[ua]
    ins, outs, local = sequence_split(st, spec, mesh, (ra, ua))
    b, h, hk, d = local["b"], local["h"], local.get("g", local["h"]), local["d"]
    if h % u or (hk * kv_repeat_factor(h, hk, u)) % u:
        return None
    s, isz = f["s"], f["itemsize"]
    uly, ring = hybrid_bytes(b, h, hk, s, d, r, u, isz)
    # Ulysses on the inner axis (a sequence of s/r): forward all-to-alls of q, stacked k/v and the
    # output, the same bytes backward (pricing doubles each forward entry)
    one = b * (s // (r * u)) * d * isz
    kvh = hk * kv_repeat_factor(h, hk, u)
    comms = (("all_to_all", ua, float(h * one)), ("all_to_all", ua, float(2 * kvh * one)),
             ("all_to_all", ua, float(h * one)))
    assert abs(sum(c[2] for c in comms) - uly.forward_bytes) < 1e-6 * max(uly.forward_bytes, 1)
    # Ulysses' backward mirrors its forward; the ring on the outer axis sends more backward (fp32
    # dK/dV), so forward and backward are priced apart (as ring attention)
    backward = comms + (("all_to_all", ra, float(ring.backward_bytes)),)
    comms += (("all_to_all", ra, float(ring.forward_bytes)),)
    layout = "zigzag" if algo == HYBRID else "contiguous"
    fwd_flops, _ = ring_attention_flops(b, h // u, s, d, r, is_causal=f["causal"], layout=layout)
    work = fwd_flops / spec.flops if spec.flops else 1.0 / (r * u)
    splits_ = list(st.splits)
    splits_[ra] = splits_[ua] = "s"
    return sequence_strategy(st, f"{mesh.names[ra]},{mesh.names[ua]}", algo, f["causal_mask"], ins, outs, splits_,
                             work, comms, backward)


# ------------------------------------------------------------------ the plan

def zigzag_axis(op: dict) -> int | None:
    """The ring axis of a plan op running load-balanced hybrid attention (its splits there are
    zig-zag), else None: the outer of its two sequence-split axes."""
    if HYBRID not in op.get("special", ()):
        return None
    return min(a for a, s in enumerate(op["splits"]) if s == "s")
