"""Sequence parallelism in the planner: the modes and their pins, which meshes have a
sequence axis, which letters carry the sequence, which strategies ops keep on it (``restrict``),
and what the plan reports (``degrees``). What attention does there is
autopar/rules/sequence_attention.py's (SDPA) and autopar/rules/sequence_heads.py's (explicit
matmul/softmax attention run head-split).

Three modes (``constraints={"sp_mode": ...}``, docs/constraints.md):

- ``"megatron"``: no new axis. Around tensor-parallel linears the norms split the sequence over
  the tensor axis, the residual adds are not whole there (``_megatron``) and dropouts follow as
  the ILP finds cheapest; resharding turns
  the row-parallel all-reduce into a reduce-scatter and the column-parallel entry into an
  all-gather (autopar/pricing/reshard.py: same paths, same prices as any other layout change). The pin
  keeps only the norm strategies that split a non-batch token letter on every model axis and
  Megatron's column/row linears; the plan reports "megatron" whenever a norm runs that way.
- ``"ulysses"`` / ``"ring"``: a mesh axis named ``sp`` (between ``dp`` and ``tp``). Parameters
  are replicated on it (their gradients come back complete through the usual conjugates); an op
  that carries a sequence letter (propagated from the user inputs' first non-batch dim, the way
  batch letters are) splits it there, other ops stay replicated there. Attention
  (``aten.scaled_dot_product_attention``) gets its own strategies on the axis: q, k, v and the
  output split on the sequence, run by ``runtime.ulysses.ulysses_attention`` (all-to-all to
  heads and back) or ``runtime.ring_attention.ring_attention`` (K/V around the ring), priced with
  the runtime's closed forms (``ulysses_bytes``, ``ring_attention_bytes``,
  ``ring_attention_flops``). Causal ring attention is load-balanced ("zigzag" layout: every
  split over the sp axis is then a zig-zag split, so slices and gathers on that axis permute,
  codegen/sp_ops.py); ``"ring-contiguous"`` keeps contiguous blocks (unbalanced). An explicit
  attn_mask runs with them only when autopar/rules/causal_mask.py proves it causal from the graph
  (Hugging Face models build one from position ids): the algorithm then drops it and runs
  is_causal=True; any other mask (padding, sliding window) runs whole under Ulysses, each rank
  taking its heads' rows (unless gradients flow to it: a learned bias such as T5's), and under
  ring attention keeps the sequence split with K/V all-gathered (priced, warned).
  Explicit matmul/softmax attention needs no special op. Its ops (the attention core of
  autopar/rules/attention_core.py: head split, scores, scale, mask, softmax, dropout, x V, head
  merge) may either split the query sequence (K/V all-gathered by ordinary resharding, the mask
  sliced alike: the all-gathered-K/V algorithm) or split the HEAD letter on the axis (Ulysses:
  the edges into and out of the core become reshard ``all_to_all`` steps, sequence dim <-> head
  dim, whose bytes are ``ulysses_bytes``; ``head_letters`` finds the head letter per op). Pinned
  "ulysses" keeps only the head-split form wherever the heads divide (grouped-query K/V whose
  kv heads do not divide by sp stay sequence-split up to the kv-head repeat, so the repeated
  heads move: Ulysses' repeat when sp > kv_heads); "auto" offers both and the ILP chooses by
  cost; ring modes need SDPA.

- ``"hybrid"``: Ulysses x ring on two sequence axes ``sp_r`` (ring, outer) and ``sp_u`` (Ulysses,
  inner), pinned with ``sp`` = u·r and optionally ``sp_shape`` = [u, r]; its meshes, attention
  strategies and errors are autopar/rules/hybrid_sequence.py's, called from here.

In the free search (no ``sp`` / ``sp_mode`` pin; ``sp=1`` rules sequence axes out),
sequence axes are searched in two cases (autopar/search/sequence_search.py, called by
autopar/search/pipeline_search.py step 4), each time as
the ordinary search rerun with every sp size dividing the devices pinned and the attention mode
left to the ILP ("auto": Ulysses, ring or K/V all-gather per attention op); only for a model with
attention (softmax or SDPA) whose inputs carry a sequence dim (``has_sequence_attention``):

(a) nothing fits memory without them (pp=1 and pipelined candidates): ``search_with_sp``; the
    fastest plan that fits wins, and if none does the MemoryBudgetError reports the smallest peak
    over the free search and every retry. Tensor parallelism stays inside a node, so across nodes
    a sequence axis is what splits one sequence's activations further.
(b) some attention's sequence is at least ``SP_UPFRONT_RATIO`` (2) times its hidden size (heads x
    head dim): ``fastest_with_sp``; a plan with a sequence axis replaces the incumbent when it is
    predicted faster. Measured on a Llama-7B shape on 8 A100s, batch 1 (benchmarks/RESULTS.md
    section 11), best sp plan against the best without: s = h +0.6% (slower), 2h -3.6%, 4h -5.4%,
    8h -13.4% step time. Below it attention is a small share of the layer and sp would only add
    searches: the zoo's small models (s <= h) never run them.

Bad input is a ConstraintError / PlanError naming the op: a sequence that does not divide,
heads % sp for Ulysses, a mask other than none/causal under ring attention.
"""
from __future__ import annotations

import math

from autopar.errors import PlanError
from autopar.mesh import Mesh, enumerate_meshes
from autopar.rules import hybrid_sequence as hybrid
from autopar.rules.sequence_attention import (ALGORITHMS, RING, RING_CONTIGUOUS, ULYSSES, attention_strategies,
                                              saves_as_run)
from autopar.rules.sequence_heads import check_heads_split, head_letters, head_split_strategies
from autopar.rules.strategy import Strategy
from autopar.frontend.batching import graph_batch_dims
from autopar.rules.strategy import propagate_batch
from autopar.rules.table import input_dim_sets, shape as tensor_shape, val as node_val

SP_AXIS = "sp"
_NORMS = ("layer_norm", "rms_norm")


# ------------------------------------------------------------------ pins, policy, meshes
# (the sp / sp_mode / sp_shape pins are checked by autopar/constraints.py)

def mode_of(constraints: dict) -> str | None:
    mode = constraints.get("sp_mode")
    if mode is None and constraints.get("sp", 1) > 1:
        return "auto"       # a sequence axis, attention mode left to the ILP
    return mode


def policy_for(policy: str | None, constraints: dict) -> str | None:
    """The candidates policy string: the caller's policy plus ``+sp:<mode>`` when sequence
    parallelism is pinned (candidates are cached per mesh, so the mode travels with the policy)."""
    mode = mode_of(constraints)
    if mode is None:
        return policy
    return f"{policy or ''}+sp:{mode}"


def split_policy(policy: str | None) -> tuple[str | None, str | None]:
    """(base policy, sequence mode) of a policy string made by ``policy_for``."""
    if not policy or "+sp:" not in policy:
        return policy, None
    base, mode = policy.split("+sp:", 1)
    return base or None, mode


def seq_axes(mesh: Mesh) -> tuple[int, ...]:
    return tuple(a for a in range(mesh.ndim) if mesh.names[a].startswith(SP_AXIS))


def param_axes(mesh: Mesh) -> tuple[int, ...]:
    """Model axes parameters may be split over (not the sequence axes: weights are replicated there)."""
    return tuple(a for a in mesh.model_axes() if not mesh.names[a].startswith(SP_AXIS))


def meshes(cluster, constraints: dict):
    """Meshes with a sequence axis (dp, sp[, tp]) for the pinned sp (or every sp dividing the
    devices when only sp_mode is pinned); none unless a Ulysses/ring mode or sp > 1 is pinned."""
    mode = mode_of(constraints)
    if mode in (None, "megatron"):
        return []
    if mode == "hybrid":   # two sequence axes (dp, sp_r, sp_u[, tp])
        return hybrid.meshes(cluster, constraints)
    n = cluster.num_devices
    sps = [constraints["sp"]] if "sp" in constraints else [k for k in range(2, n + 1) if n % k == 0]
    out = []
    for sp in sps:
        if n % sp:
            continue
        for m in enumerate_meshes(n // sp, cluster.devices_per_node, max_model_axes=1):
            out.append(Mesh((m.shape[0], sp) + m.shape[1:], (m.names[0], SP_AXIS) + m.names[1:],
                            cluster.devices_per_node))
    return out


def tp_degree(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in param_axes(mesh))


# ------------------------------------------------------------------ sequence letters

def input_seq_dims(graph, batch_dims) -> dict[str, frozenset]:
    """Each user input's sequence dim: its first dim that is not the batch dim (2-D+ inputs)."""
    out = {}
    placeholders = {n.name: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
    for name, bd in zip(graph.input_names, batch_dims):
        v = node_val(placeholders[name]) if name in placeholders else None
        nd = len(tensor_shape(v)) if v is not None and hasattr(v, "shape") else 0
        dims = [d for d in range(nd) if d != bd]
        out[name] = frozenset(dims[:1]) if bd is not None and nd >= 2 else frozenset()
    return out


def restrict(graph, mesh: Mesh, nodes: dict, order: list[str], policy: str | None,
             needs_grad=frozenset()) -> None:
    """Apply the sequence mode of ``policy`` to the candidates' strategies in place (called by
    candidates.candidates before block representatives are assigned: deterministic per spec,
    so every block instance keeps the same list). ``needs_grad``: the values gradients flow to
    (``Candidates.needs_grad``; a mask among them is a learned bias: sequence_attention)."""
    _, mode = split_policy(policy)
    sps = [a for a in seq_axes(mesh) if mesh.shape[a] > 1]
    if mode is None and not sps:
        return
    seq = seq_letters(graph, nodes, order)
    heads = head_letters(graph, nodes, order, seq) if sps else {}
    has_sdpa = any(nodes[n].kind == "op" and nodes[n].spec.rule == "sdpa" for n in order)
    if ((mode in ("ring", "ring-contiguous", "hybrid") and not has_sdpa)
            or (mode == "ulysses" and not has_sdpa and not heads)):
        raise PlanError(f"sp_mode={mode!r} runs scaled_dot_product_attention with {mode} attention, but the model "
                        f"has no such op" + (" nor an explicit matmul/softmax attention whose heads it can split"
                                             if mode == "ulysses" else " (explicit matmul/softmax attention?)")
                        + ": pin only sp, and its attention runs on the sequence split with K/V all-gathered by "
                          "resharding")
    grad = frozenset(needs_grad)
    for name, letters in seq.items():
        info = nodes[name]
        node, spec = info.node, info.spec
        if mode == "megatron":
            info.strategies = _megatron(node, spec, info.strategies, mesh, letters) or info.strategies
        if sps:
            info.strategies = _on_seq_axes(node, spec, info.strategies, mesh, sps, letters, mode, heads.get(name),
                                           grad)
            if spec.rule == "sdpa" and info.strategies:
                info.spec = saves_as_run(node, spec, info.strategies)
    if mode == "ulysses" and heads:
        check_heads_split(graph, nodes, heads, mesh, sps)


def seq_letters(graph, nodes: dict, order: list[str]) -> dict[str, frozenset]:
    """Per op node: its letters that carry the sequence (not the batch), propagated from the
    user inputs' sequence dims as batch letters are (``strategy.propagate_batch``)."""
    seq_of = {n: (d,) for n, d in input_seq_dims(graph, graph_batch_dims(graph)).items()}
    out = {}
    for name in order:
        info = nodes[name]
        if info.kind != "op":
            continue
        node, spec = info.node, info.spec
        ins = input_dim_sets(node, seq_of)
        letters, out_dims = propagate_batch(spec, ins)
        if spec.rule == "sdpa" and ins and 2 in ins[0]:
            # causal attention keeps "s" unsplittable for ordinary strategies; its own
            # sequence-parallel algorithms split it, and its output carries the sequence on
            letters, out_dims = frozenset("s") | letters, [frozenset({2})]
        seq_of[name] = tuple(out_dims)
        batch_letters = {ls[d] for ls, dims in zip(spec.outputs, info.batch_dims) for d in dims if d < len(ls)}
        out[name] = frozenset(letters - batch_letters)
    return out


def norm_like(node, spec) -> bool:
    """A norm, or a norm written out by hand (a mean over the last dim with keepdim: RMSNorm's
    statistics): the ops Megatron-SP splits on the sequence."""
    if spec.rule in _NORMS:
        return True
    if spec.rule != "mean" or not spec.inputs or not spec.inputs[0]:
        return False
    ins, outs = spec.inputs[0], spec.outputs[0]
    return len(ins) >= 2 and len(outs) == len(ins) and ins[:-1] == outs[:-1] and outs[-1] != ins[-1]


def _megatron(node, spec, strategies, mesh: Mesh, seq_letters) -> list[Strategy]:
    """Megatron-SP: norms split a sequence letter on every model axis; linears column/row; an
    addition carrying the sequence (the residual adds) is not whole on the model axes (split on
    some letter there, or a partial sum), where it can be.

    The last rule is what turns the row-parallel all-reduce into a reduce-scatter: without it the
    ILP may keep the residual stream whole. Hugging Face Llama's RMSNorm then computes its mean on
    the sequence split, gathers the (b, s, 1) statistics and multiplies the whole hidden states,
    keeping Megatron's all-reduce (one collective's latency cheaper on small CPU models, but not
    sequence parallelism: every rank keeps the full-sequence residual stream and norm inputs)."""
    axes = [a for a in mesh.model_axes() if mesh.shape[a] > 1]
    if norm_like(node, spec) and seq_letters:
        return [st for st in strategies if all(st.splits[a] in seq_letters for a in axes)]
    if spec.rule == "linear":
        return [st for st in strategies if all(any(a in ax for ax in st.inputs[1].dims) for a in axes)]
    if spec.rule == "add" and seq_letters:
        return [st for st in strategies if all(st.splits[a] is not None for a in axes)] or strategies
    return strategies


def _on_seq_axes(node, spec, strategies, mesh: Mesh, sps, seq_letters, mode, head=None,
                 grad=frozenset()) -> list[Strategy]:
    """Strategies on the sequence axes: a sequence letter or nothing; attention its own algorithms;
    an explicit attention core's op (``head``: its head letter) also the head split (Ulysses)."""
    if spec.rule == "sdpa":
        return attention_strategies(node, spec, strategies, mesh, sps, mode, grad)
    if hybrid.axes(mesh) is not None:   # the sequence split over both axes, ring outer
        strategies = hybrid.keep_nested(strategies, mesh)
    keep = [st for st in strategies if all(st.splits[a] is None or st.splits[a] in seq_letters for a in sps)]
    splitting = [st for st in keep if all(st.splits[a] in seq_letters for a in sps)]
    # As data axes must split the batch: an op carrying the sequence splits it (when it can).
    out = splitting or [st for st in keep if all(st.splits[a] is None for a in sps)] or strategies[:1]
    if head is None or len(sps) != 1 or mode not in ("ulysses", "auto", None):
        return out
    split_heads = head_split_strategies(spec, strategies, mesh, sps[0], head)
    if mode == "ulysses":
        # Pinned: the core runs head-split wherever its heads divide; an op whose heads do not
        # (GQA kv heads < sp before their repeat) keeps the sequence split, and the repeated
        # heads are what the all-to-all moves.
        return split_heads or out
    return out + split_heads


# ------------------------------------------------------------------ what the plan did

def degrees(cands, pick, mesh: Mesh) -> dict:
    """``sp`` and ``sp_mode`` of a solved configuration (``pick``: representative -> index)."""
    sps = [a for a in seq_axes(mesh) if mesh.shape[a] > 1]
    algos = set()
    megatron = False
    model = [a for a in mesh.model_axes() if mesh.shape[a] > 1 and a not in sps]
    seq = seq_letters(cands.graph, cands.nodes, cands.order) if (model or sps) else {}
    # explicit attention ops split on their head letter over the sequence axis ran Ulysses
    heads = head_letters(cands.graph, cands.nodes, cands.order, seq) if sps else {}
    for name in cands.order:
        info = cands.nodes[name]
        if info.kind != "op":
            continue
        st = info.strategies[pick[info.rep]]
        algos |= {x for x in st.special if x in ALGORITHMS}
        if name in heads and any(st.splits[a] == heads[name] for a in sps):
            algos.add(ULYSSES)
        if model and norm_like(info.node, info.spec) and any(st.splits[a] in seq.get(name, ()) for a in model):
            megatron = True
    if sps:
        sp = math.prod(mesh.shape[a] for a in sps)
        if algos == {ULYSSES}:
            mode = "ulysses"
        elif algos == {RING}:
            mode = "ring"
        elif algos == {RING_CONTIGUOUS}:
            mode = "ring-contiguous"
        elif algos and algos <= set(hybrid.ALGORITHMS):
            ra, ua = hybrid.axes(mesh)
            return {"sp": sp, "sp_mode": "hybrid", "sp_shape": [mesh.shape[ua], mesh.shape[ra]]}
        elif not algos:
            mode = "sequence"      # sequence axis, attention kept whole on it
        else:
            mode = "mixed"
        return {"sp": sp, "sp_mode": mode}
    if megatron:
        return {"sp": math.prod(mesh.shape[a] for a in model), "sp_mode": "megatron"}
    return {"sp": 1, "sp_mode": None}


def zigzag_axes(plan_ops: list[dict]) -> tuple[int, ...]:
    """Mesh axes whose splits are zig-zag in a plan (those load-balanced ring attention runs on)."""
    axes = set()
    for op in plan_ops:
        if RING in op.get("special", ()):
            axes |= {a for a, s in enumerate(op["splits"]) if s == "s"}
        if hybrid.zigzag_axis(op) is not None:   # the hybrid's ring axis (its Ulysses axis is contiguous)
            axes.add(hybrid.zigzag_axis(op))
    return tuple(sorted(axes))


def mesh_allowed(mesh: Mesh, constraints: dict) -> bool:
    """Whether a mesh fits the sequence pins: a sequence axis exactly when a Ulysses/ring mode
    (or sp > 1 without a mode) is pinned, of the pinned size; Megatron-SP needs tensor axes."""
    mode = mode_of(constraints)
    sps = seq_axes(mesh)
    if mode in (None, "megatron"):
        if sps:
            return False
        if mode == "megatron":   # Megatron-SP: one tensor axis, the sequence split over it
            tp = tp_degree(mesh)
            return tp > 1 and len(param_axes(mesh)) == 1 and constraints.get("sp", tp) == tp
        return True
    if mode == "hybrid":
        return hybrid.mesh_allowed(mesh, constraints)
    return len(sps) == 1 and math.prod(mesh.shape[a] for a in sps) == constraints.get("sp", mesh.shape[sps[0]])
