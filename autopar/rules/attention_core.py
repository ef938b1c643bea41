"""The attention core of each block instance: what selective activation recompute (Korthikanti
et al. 2022, "Reducing Activation Recomputation in Large Transformer Models") reruns in backward.

``attention_cores(traced) -> {(group, instance): [core, ...]}``: per block instance, one list of
node names (graph order) per attention op in it. Found structurally on the traced ATen graph,
whatever the model calls its modules:

- the *anchor* is an attention op: a softmax (explicit attention: QK^T matmul, scale, mask,
  softmax, dropout, x V) or a fused ``scaled_dot_product_attention`` variant;
- *projections* are contractions (linear / matmul / mm / addmm / bmm / einsum) with one input
  derived from parameters only and one derived from the model's inputs: the q/k/v projections
  are the projections met walking back from the anchor, the output projection is the first
  projection after it (in graph order);
- the core is every node of the instance that lies on a path from a q/k/v projection's output
  to the output projection's input, the projections themselves excluded. For explicit attention
  that is the head split, the s^2 part (scores, scale, mask, softmax, dropout, x V) and the head
  merge; for SDPA the head split, the fused op and the merge (its saved tensors are q, k, v, its
  output and the log-sum-exp: selective saves little there, but runs correctly). Nodes of the
  instance that read only parameters/buffers and feed only the core (a causal mask cut from a
  buffer) belong to it too: recomputed, not kept.

The planner prices the core (autopar/search/build.py ``_selective_groups``) and codegen outlines it
(codegen/selective.py), both from this one function, so what is priced is what runs.
"""
from __future__ import annotations

_CONTRACTIONS = ("linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "einsum")


def op_name(n) -> str:
    """The ATen op's name without namespace and overload ("linear" for aten.linear.default)."""
    t = n.target
    name = getattr(t, "__name__", None) or str(t)
    # "linear.default" / "aten.linear.default" -> "linear"
    parts = str(getattr(t, "_name", name)).split("::")[-1].split(".")
    return parts[0]


def is_anchor(n) -> bool:
    if n.op != "call_function":
        return False
    name = op_name(n)
    return name in ("softmax", "_softmax", "_safe_softmax") or "scaled_dot_product" in name


def _kinds(traced) -> dict[str, str]:
    """Node -> "act" (depends on a user input), "param" (on parameters/buffers/constants only)."""
    kinds: dict[str, str] = {}
    params = set(traced.param_fqn) | set(getattr(traced, "buffers", ()) or ())
    for n in traced.gm.graph.nodes:
        if n.op == "placeholder":
            kinds[n.name] = "param" if n.name in params else "act"
        elif n.op == "get_attr":
            kinds[n.name] = "param"
        else:
            ins = [kinds.get(a.name, "param") for a in n.all_input_nodes]
            kinds[n.name] = "act" if "act" in ins else "param"
    return kinds


def _is_projection(n, kinds) -> bool:
    if n.op != "call_function" or op_name(n) not in _CONTRACTIONS:
        return False
    ins = [kinds.get(a.name) for a in n.all_input_nodes]
    return "act" in ins and "param" in ins


def _cores_of_instance(nodes: dict, names: list[str], kinds) -> list[list[str]]:
    inside = set(names)
    order = {name: i for i, name in enumerate(names)}
    cores, taken = [], set()
    for name in names:
        a = nodes[name]
        if not is_anchor(a) or name in taken or kinds.get(name) != "act":
            continue
        # the output projection: the first projection downstream of the anchor, in graph order
        seen, todo, outs = {name}, [a], []
        while todo:
            m = todo.pop()
            for u in m.users:
                if u.name in inside and u.name not in seen:
                    seen.add(u.name)
                    (outs if _is_projection(u, kinds) else todo).append(u)
        if not outs:
            continue
        out = min(outs, key=lambda u: order[u.name])
        # back from the output projection's activation inputs, stopping at projections
        back, todo, ins = set(), [p for p in out.all_input_nodes if kinds.get(p.name) == "act"], set()
        while todo:
            m = todo.pop()
            if m.name not in inside or m.name in back:
                continue
            if _is_projection(m, kinds):
                ins.add(m.name)
                continue
            back.add(m.name)
            todo.extend(m.all_input_nodes)
        if name not in back or not ins:
            continue
        # forward from the q/k/v projections, stopping at the output projection
        fwd, todo = set(), [u for p in ins for u in nodes[p].users]
        while todo:
            m = todo.pop()
            if m.name not in inside or m.name in fwd or m is out or m.name in ins:
                continue
            fwd.add(m.name)
            todo.extend(m.users)
        core = back & fwd
        # parameter/buffer-only nodes that feed only the core (a causal mask cut from a buffer)
        # belong to it: outlined with it, they are recomputed, not kept
        grew = True
        while grew:
            grew = False
            for m in names:
                if m not in core and kinds.get(m) == "param" and nodes[m].op == "call_function" and \
                        nodes[m].users and all(u.name in core for u in nodes[m].users):
                    core.add(m)
                    grew = True
        core = sorted(core, key=order.get)
        if name in core:
            cores.append(core)
            taken.update(core)
    return cores


def attention_cores(traced) -> dict[tuple[int, int], list[list[str]]]:
    """Per (block group, instance): the attention cores in it (module doc); cached on ``traced``."""
    cached = getattr(traced, "_attention_cores", None)
    if cached is not None:
        return cached
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    kinds = _kinds(traced)
    out = {}
    for g, grp in enumerate(traced.blocks):
        for i, names in enumerate(grp.instances):
            cores = _cores_of_instance(nodes, names, kinds)
            if cores:
                out[g, i] = cores
    try:
        traced._attention_cores = out
    except AttributeError:   # a frozen/slotted object: recompute next time
        pass
    return out


def core_region_name(module_fqn: str, k: int) -> str:
    """The checkpoint-region name of the k-th attention core of a block instance."""
    return f"{module_fqn}.attention_core" + (str(k) if k else "")


__all__ = ["attention_cores", "core_region_name", "is_anchor"]
