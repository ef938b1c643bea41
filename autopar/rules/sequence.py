"""Sequence parallelism in the planner (issue 7): which meshes have a sequence axis, which
strategies ops get on it, what attention does there, and what the plan reports.

Three modes (``constraints={"sp_mode": ...}``, shared/api.md):

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
  is_causal=True; any other mask keeps the sequence split with K/V all-gathered (priced, warned).
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

In the free search (issue 7: no ``sp`` / ``sp_mode`` pin; ``sp=1`` rules sequence axes out),
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
    head dim): ``faster_with_sp``; a plan with a sequence axis replaces the incumbent when it is
    predicted faster. Measured on a Llama-7B shape on 8 A100s, batch 1 (benchmarks/RESULTS.md
    section 11), best sp plan against the best without: s = h +0.6% (slower), 2h -3.6%, 4h -5.4%,
    8h -13.4% step time. Below it attention is a small share of the layer and sp would only add
    searches: the zoo's small models (s <= h) never run them (issue 12's planning times).

Bad input is a ConstraintError / PlanError naming the op: a sequence that does not divide,
heads % sp for Ulysses, a mask other than none/causal under ring attention.
"""
from __future__ import annotations

import math
import operator

from autopar.errors import ConstraintError, PlanError
from autopar.rules import hybrid_sequence as hybrid
from autopar.rules.layout import Layout
from autopar.mesh import Mesh, enumerate_meshes
from autopar.rules.strategy import Strategy

SP_AXIS = "sp"
MODES = (None, "megatron", "ulysses", "ring", "ring-contiguous", "hybrid")
RING, RING_CONTIGUOUS, ULYSSES = "ring_attention", "ring_attention_contiguous", "ulysses_attention"
ALGORITHMS = (RING, RING_CONTIGUOUS, ULYSSES) + hybrid.ALGORITHMS
# In an SDPA strategy's special beside the algorithm: its attn_mask is the causal mask
# (autopar/rules/causal_mask.py), so the algorithm runs is_causal=True without it.
CAUSAL_MASK = "causal_attn_mask"
_NORMS = ("layer_norm", "rms_norm")


# ------------------------------------------------------------------ constraints, policy, meshes

def check_constraints(constraints: dict) -> None:
    """Validate the ``sp`` / ``sp_mode`` pins (called by search.check_constraints)."""
    mode = constraints.get("sp_mode")
    if mode not in MODES:
        raise ConstraintError(f"constraint sp_mode={mode!r}: must be one of {', '.join(map(repr, MODES))}")
    sp = constraints.get("sp")
    if "sp" in constraints and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1):
        raise ConstraintError(f"constraint sp={sp!r}: must be a positive integer")
    hybrid.check_constraints(constraints)   # sp_shape, and sp = u*r (autopar/rules/hybrid_sequence.py)
    if mode in ("ulysses", "ring", "ring-contiguous") and sp == 1:
        raise ConstraintError(f"constraints sp=1 and sp_mode={mode!r} contradict each other: {mode} attention needs "
                              f"a sequence axis of at least 2 ranks")
    if mode == "megatron" and sp not in (None, 1) and "tp" in constraints and sp != constraints["tp"]:
        raise ConstraintError(f"constraint sp_mode='megatron' splits the sequence over the tensor axis, so sp must "
                              f"equal tp: got sp={sp}, tp={constraints['tp']}")
    if mode == "megatron" and constraints.get("tp") == 1:
        raise ConstraintError("constraint sp_mode='megatron' needs tensor parallelism (tp > 1): the sequence is "
                              "split over the tensor axis around the tensor-parallel linears")


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
    from autopar.rules.table import shape as tensor_shape
    from autopar.rules.table import val as node_val
    out = {}
    placeholders = {n.name: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
    for name, bd in zip(graph.input_names, batch_dims):
        v = node_val(placeholders[name]) if name in placeholders else None
        nd = len(tensor_shape(v)) if v is not None and hasattr(v, "shape") else 0
        dims = [d for d in range(nd) if d != bd]
        out[name] = frozenset(dims[:1]) if bd is not None and nd >= 2 else frozenset()
    return out


def restrict(graph, mesh: Mesh, nodes: dict, order: list[str], policy: str | None) -> None:
    """Apply the sequence mode of ``policy`` to the candidates' strategies in place (called by
    candidates.candidates before block representatives are assigned: deterministic per spec,
    so every block instance keeps the same list)."""
    _, mode = split_policy(policy)
    sps = [a for a in seq_axes(mesh) if mesh.shape[a] > 1]
    if mode is None and not sps:
        return
    seq = seq_letters(graph, nodes, order)
    heads = head_letters(graph, nodes, order, seq) if sps else {}
    has_sdpa = any(nodes[n].kind == "op" and nodes[n].spec.rule == "sdpa" for n in order)
    if (mode in ("ring", "ring-contiguous", "hybrid") and not has_sdpa) or (mode == "ulysses" and not has_sdpa and not heads):
        raise PlanError(f"sp_mode={mode!r} runs scaled_dot_product_attention with {mode} attention, but the model "
                        f"has no such op" + (" nor an explicit matmul/softmax attention whose heads it can split"
                                             if mode == "ulysses" else " (explicit matmul/softmax attention?)")
                        + ": pin only sp, and its attention runs on the sequence split with K/V all-gathered by "
                          "resharding")
    for name, letters in seq.items():
        info = nodes[name]
        node, spec = info.node, info.spec
        if mode == "megatron":
            info.strategies = _megatron(node, spec, info.strategies, mesh, letters) or info.strategies
        if sps:
            info.strategies = _on_seq_axes(node, spec, info.strategies, mesh, sps, letters, mode, heads.get(name))
            if spec.rule == "sdpa" and info.strategies:
                info.spec = _saves_as_run(node, spec, info.strategies)
    if mode == "ulysses" and heads:
        _check_heads_split(graph, nodes, heads, mesh, sps)


def seq_letters(graph, nodes: dict, order: list[str]) -> dict[str, frozenset]:
    """Per op node: its letters that carry the sequence (not the batch), propagated from the
    user inputs' sequence dims as batch letters are (``strategy.propagate_batch``)."""
    from autopar.frontend.batching import graph_batch_dims
    from autopar.rules.table import input_dim_sets
    from autopar.rules.strategy import propagate_batch
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


def _on_seq_axes(node, spec, strategies, mesh: Mesh, sps, seq_letters, mode, head=None) -> list[Strategy]:
    """Strategies on the sequence axes: a sequence letter or nothing; attention its own algorithms;
    an explicit attention core's op (``head``: its head letter) also the head split (Ulysses)."""
    if spec.rule == "sdpa":
        return attention_strategies(node, spec, strategies, mesh, sps, mode)
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


# ------------------------------------------------------------------ explicit attention, head-split (Ulysses)

HEAD_TAG = "[ulysses-heads]"   # in the names of head-split strategies: what `autopar show` prints per op


def head_letters(graph, nodes: dict, order: list[str], seq: dict[str, frozenset]) -> dict[str, str]:
    """Per op node of an explicit (matmul/softmax) attention core: the letter of its spec that
    carries the attention heads, for the ops that have one.

    Seeded at each core's softmax (its letters that are neither batch, sequence, the softmax dim
    nor size 1: the heads), then propagated through the core's specs in both directions (a
    letter shared by an op's inputs and outputs is one dimension) until nothing changes.
    Grouped-query K/V repeated by expand + reshape (Hugging Face ``repeat_kv``) carry the letter
    back to the kv heads: the reshape's leading letter is shared with the kv-head dim, so kv heads
    that divide by sp move before the repeat. A ``repeat_interleave`` keeps its repeated dim
    whole (ops_shape.py), so there the repeated heads move. Propagation stays inside the core:
    the q/k/v and output projections keep the sequence split, so the head split begins and
    ends on the core's edges (the all-to-alls)."""
    from autopar.rules.attention_core import attention_cores, is_anchor
    from autopar.rules.table import input_dim_sets, tensor_inputs
    core = []
    for cores in attention_cores(graph).values():
        for names in cores:
            core.extend(n for n in names if n in nodes and nodes[n].kind == "op")
    inside = set(core)
    core = [n for n in order if n in inside]   # graph order: one forward sweep settles most of it

    def barred(name):   # letters that are never heads at this node: batch, sequence, size 1, unsplittable
        info = nodes[name]
        spec = info.spec
        batch = {ls[d] for ls, dims in zip(spec.outputs, info.batch_dims) for d in dims if d < len(ls)}
        return batch | set(seq.get(name, ())) | set(spec.unsplittable) | {
            ch for ch, size in spec.sizes.items() if size <= 1}

    dims: dict[str, list[frozenset]] = {}   # node -> per output: its head dims
    for name in core:
        info = nodes[name]
        if is_anchor(info.node) and info.spec.rule != "sdpa" and info.spec.outputs:
            out = info.spec.outputs[0]
            bad = barred(name)
            dims[name] = [frozenset(d for d, ch in enumerate(out) if ch not in bad)] + \
                [frozenset()] * (len(info.spec.outputs) - 1)
    letters: dict[str, frozenset] = {}
    changed = bool(dims)
    while changed:
        changed = False
        for name in core:
            info = nodes[name]
            node, spec = info.node, info.spec
            ins = tensor_inputs(node)
            got = set()
            for ls, ds in zip(spec.inputs, input_dim_sets(node, dims, ins)):
                if ls is not None:
                    got |= {ls[d] for d in ds if d < len(ls)}
            for o, ds in zip(spec.outputs, dims.get(name, ())):
                got |= {o[d] for d in ds if d < len(o)}
            got = frozenset(got - barred(name))
            if got == letters.get(name, frozenset()):
                continue
            letters[name] = got
            changed = True
            dims[name] = [frozenset(d for d, ch in enumerate(o) if ch in got) for o in spec.outputs]
            for p, ls in zip(ins, spec.inputs):
                if ls is None or p.name not in inside:
                    continue
                idx = node.args[1] if node.target is operator.getitem else 0
                have = dims.setdefault(p.name, [frozenset()] * len(nodes[p.name].spec.outputs))
                if idx < len(have):
                    have[idx] = have[idx] | frozenset(d for d, ch in enumerate(ls) if ch in got)
    # one head letter per op; an op where two letters claim to be heads is left alone (ambiguous)
    return {n: next(iter(ls)) for n, ls in letters.items() if len(ls) == 1}


def head_split_strategies(spec, strategies, mesh: Mesh, a: int, head: str) -> list[Strategy]:
    """Each strategy replicated on sequence axis ``a`` made head-split there: ``a`` appended as
    the innermost split of every dim carrying the ``head`` letter. Innermost, so that with heads
    already split over a tensor axis (Megatron) each tensor rank's heads split over ``a`` -- the
    layout one reshard all-to-all reaches from a sequence split (autopar/pricing/reshard.py
    appends the axis innermost), the way DeepSpeed-Ulysses nests inside tensor parallelism."""
    sp = mesh.shape[a]
    out, seen = [], set()
    for st in strategies:
        if st.splits[a] is not None:
            continue
        factor = math.prod(mesh.shape[x] for x, s in enumerate(st.splits) if s == head)
        if spec.sizes.get(head, 1) % (factor * sp):
            continue

        def add(lay: Layout | None, letters: str | None) -> Layout | None:
            if lay is None or letters is None:
                return lay
            return Layout(tuple(axes + (a,) if ch == head else axes for axes, ch in zip(lay.dims, letters)),
                          lay.partial)

        ins = tuple(add(l, ls) for l, ls in zip(st.inputs, spec.inputs))
        outs = tuple(add(l, o) for l, o in zip(st.outputs, spec.outputs))
        if (ins, outs) in seen:
            continue
        seen.add((ins, outs))
        splits = list(st.splits)
        splits[a] = head
        name = "" if st.name == "R" else st.name
        name = (name + " " if name else "") + f"S({head})@{mesh.names[a]} {HEAD_TAG}"
        out.append(Strategy(name, ins, outs, tuple(splits), st.work_fraction / sp, st.comms, st.special,
                            st.backward_comms))
    return out


def _check_heads_split(graph, nodes: dict, heads: dict[str, str], mesh: Mesh, sps) -> None:
    """Pinned Ulysses: every explicit attention's softmax must run head-split (a head letter found
    and dividing by sp on some strategy), else a PlanError naming the op."""
    from autopar.rules.attention_core import attention_cores, is_anchor
    a = sps[0]
    sp = mesh.shape[a]
    for cores in attention_cores(graph).values():
        for names in cores:
            for name in names:
                info = nodes.get(name)
                if info is None or info.kind != "op" or not is_anchor(info.node) or info.spec.rule == "sdpa":
                    continue
                ch = heads.get(name)
                if ch is None:
                    raise PlanError(f"{name} ({info.node.target}, explicit attention): sp_mode='ulysses' splits its "
                                    f"heads over sp={sp} ranks, but no dim of it could be told to be the heads (not "
                                    f"batch, sequence or the softmax dim); pin only sp (the attention then runs "
                                    f"sequence-split with K/V all-gathered)")
                if not any(st.splits[a] == ch for st in info.strategies):
                    raise PlanError(f"{name} ({info.node.target}, explicit attention): sp_mode='ulysses' splits its "
                                    f"{info.spec.sizes[ch]} heads over sp={sp} ranks, but the heads (on each "
                                    f"tensor-parallel rank) do not divide by {sp}; use an sp that divides the head "
                                    f"count, or pin only sp (the attention then runs sequence-split with K/V "
                                    f"all-gathered)")


# ------------------------------------------------------------------ attention on the sequence axis

def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def attention_facts(node) -> dict:
    from autopar.rules.causal_mask import mask_is_causal
    from autopar.rules.table import is_tensor
    from autopar.rules.table import shape as tensor_shape
    q, k, v = node.args[:3]
    (b, h, s, d), (_, hk, t, _) = tensor_shape(q), tensor_shape(k)
    mask = _arg(node, 3, "attn_mask")
    # An explicit mask proven causal from the graph (Hugging Face models build one instead of
    # passing is_causal=True: autopar/rules/causal_mask.py) is run as is_causal=True by the
    # sequence-parallel algorithms, which drop it (CAUSAL_MASK in the strategy's special).
    causal_mask, why = mask_is_causal(node) if is_tensor(mask) else (False, "")
    return dict(b=b, h=h, hk=hk, s=s, t=t, d=d, e=tensor_shape(v)[-1], mask=is_tensor(mask) and not causal_mask,
                dropout=float(_arg(node, 4, "dropout_p", 0.0) or 0.0),
                causal=bool(_arg(node, 5, "is_causal", False)) or causal_mask, causal_mask=causal_mask,
                mask_why=why, itemsize=q.meta["val"].element_size())


def attention_strategies(node, spec, strategies, mesh: Mesh, sps, mode) -> list[Strategy]:
    """SDPA strategies with the sequence split over the sp axis: Ulysses and/or ring attention
    on top of every strategy of the other axes that keeps the sequence whole (``mode`` "ulysses",
    "ring", "ring-contiguous" keep that algorithm only; "auto"/None offer both and the
    replicated-on-sp ones)."""
    if len(sps) == 2 and hybrid.axes(mesh) is not None:   # Ulysses x ring (autopar/rules/hybrid_sequence.py)
        return hybrid.attention_strategies(node, spec, strategies, mesh, attention_facts(node))
    if len(sps) != 1:
        raise PlanError(f"{node.name}: attention over {len(sps)} sequence axes is planned only as sp_mode='hybrid'")
    a = sps[0]
    sp = mesh.shape[a]
    f = attention_facts(node)
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
            warnings.warn(f"autopar: {node.name} has an explicit attn_mask, which {mode} attention cannot split "
                          f"(it is not provably causal: {f['mask_why']}); it runs sequence-split with K/V "
                          f"all-gathered instead (priced)", stacklevel=2)
            return gathered
        if not out:
            raise PlanError(f"{node.name} (scaled_dot_product_attention): sp_mode={mode!r} cannot run it on "
                            f"sp={sp}: " + "; ".join(dict.fromkeys(why)))
        return out
    return out + gathered + base


def _saves_as_run(node, spec, strategies):
    """The SDPA spec's saved tensors as its sequence-parallel algorithm keeps them, when every
    strategy left runs one (a pinned mode; the spec is shared by all strategies of the node):

    - an attn_mask proven causal is dropped (CAUSAL_MASK): nothing of it is saved, neither the
      mask nor a fused kernel's copy of it in q's dtype;
    - Ulysses saves the output of its local attention (head-split, between the two all-to-alls),
      a buffer of its own: the op's output is the second all-to-all's result, which later ops
      may save too (``y.transpose(1, 2)`` viewed by the output projection when the trace lays
      the attention output out like a (b, s, h, d) q, as Hugging Face Llama's and GPT-2's are).
      Priced as the op's output, those two were counted once.
    Ring attention saves the output it returns (laid out like q, runtime/ring_attention.py)."""
    import dataclasses
    from autopar.rules.spec import Saved
    saved = spec.saved
    if all(CAUSAL_MASK in st.special for st in strategies):
        mask = spec.inputs[3] if len(spec.inputs) > 3 else None
        saved = tuple(sv for sv in saved if not ((sv.kind == "input" and sv.index == 3)
                                                 or (sv.kind == "extra" and mask is not None and sv.letters == mask)))
    if all(ULYSSES in st.special or any(a in st.special for a in hybrid.ALGORITHMS) for st in strategies):
        isz = node.meta["val"].element_size()
        saved = tuple(Saved("extra", letters=spec.outputs[0], itemsize=isz, act=True, on=sv.on)
                      if sv.kind == "output" and sv.index == 0 else sv for sv in saved)
    return spec if saved is spec.saved else dataclasses.replace(spec, saved=saved)


def _refuse(node, f, sp, algo) -> str | None:
    if f["s"] != f["t"]:
        return f"cross-attention (query length {f['s']}, key length {f['t']}) is not sequence-parallel"
    if f["dropout"]:
        return f"attention dropout (dropout_p={f['dropout']}) is not supported by {algo}"
    if f["mask"]:
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


def _with_algorithm(st: Strategy, spec, f, mesh: Mesh, a: int, algo: str) -> Strategy | None:
    from runtime.ring_attention import ring_attention_bytes, ring_attention_flops
    from runtime.ulysses import ulysses_bytes
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
        from runtime.seq_layout import kv_repeat_factor
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
