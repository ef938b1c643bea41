"""What the front end records about a traced graph's structure: tied weights, a structural
fingerprint (a plan records it so it cannot run on another model) and the repeated blocks
(groups of structurally identical children of an ``nn.ModuleList``/``nn.Sequential``), which
the solver solves once per group and pipelining cuts between.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node


def _strip_call_suffix(fqn: str) -> str:
    # A module called twice appears as "blocks.0@1" for its second call.
    return fqn.split("@")[0]


@dataclass
class BlockGroup:
    """Structurally identical repeats of one block. ``instances[i][p]`` is the name of the node
    at position ``p`` of instance ``i``; position p does the same op on the same shapes in
    every instance, and edges inside an instance correspond position by position."""
    name: str                    # container FQN ("blocks", "transformer.h"), "#k" if it has several groups
    instances: list[list[str]]
    module_fqns: list[str] = field(default_factory=list)   # the child module of each instance ("blocks.3")




# Tied weights


def _tied_fqns(model: nn.Module) -> dict[str, list[str]]:
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    for fqn, b in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(b), []).append(fqn)
    return {fqn: list(fqns) for fqns in groups.values() if len(fqns) > 1 for fqn in fqns}


def _drop_unused_tied_placeholders(gm, param_fqn, buffers, tied) -> None:
    """export lifts a tied tensor once per FQN but routes every use to one placeholder. Keep ONE
    placeholder per tensor: the used one, renamed to the canonical FQN (the first one
    ``named_parameters()`` reports, so ``dict(model.named_parameters())[param_fqn[name]]``
    works); drop the unused aliases."""
    if not tied:
        return
    by_fqn = {param_fqn[n.name]: n for n in gm.graph.nodes if n.op == "placeholder" and n.name in param_fqn}
    done = set()
    for fqns in tied.values():
        if fqns[0] in done:
            continue
        done.add(fqns[0])
        present = [by_fqn[f] for f in fqns if f in by_fqn]
        used = [n for n in present if n.users]
        if len(present) < 2 or len(used) > 1:
            continue   # nothing to merge (or the front end already kept them apart)
        keep = used[0] if used else present[0]
        canonical_name = next((n.name for n in present if param_fqn[n.name] == fqns[0]), keep.name)
        for n in present:
            if n is not keep:
                del param_fqn[n.name]
                buffers.discard(n.name)
                gm.graph.erase_node(n)
        is_buffer = keep.name in buffers
        del param_fqn[keep.name]
        buffers.discard(keep.name)
        # Placeholder names are free-form; the target is the forward's argument name.
        keep.name = keep.target = canonical_name
        param_fqn[canonical_name] = fqns[0]
        if is_buffer:
            buffers.add(canonical_name)
    gm.recompile()


# ---------------------------------------------------------------------------------------------
# Fingerprint


def _canon(x, index: dict[str, int]):
    """A canonical text of an argument: nodes by graph position, devices erased (a plan made on
    meta must match the same model on cpu/cuda)."""
    if isinstance(x, Node):
        return f"%{index[x.name]}"
    if isinstance(x, (list, tuple)):
        inner = ",".join(_canon(a, index) for a in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_canon(v, index)}" for k, v in sorted(x.items())) + "}"
    if isinstance(x, torch.device):
        return "device"
    return repr(x)


def _val_text(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_val_text(a) for a in v) + ")"
    return type(v).__name__ if v is not None else "-"


def fingerprint(gm: GraphModule, param_fqn: dict[str, str], buffers: set[str]) -> str:
    """sha256 over ops, argument structure, shapes and dtypes (and parameter FQNs); independent
    of node names and devices."""
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind = "buffer" if n.name in buffers else ("param" if n.name in param_fqn else "input")
            line = f"placeholder {kind} {param_fqn.get(n.name, '')} {_val_text(n.meta.get('val'))}"
        else:
            line = (f"{n.op} {n.target} {_canon(n.args, index)} {_canon(n.kwargs, index)} "
                    f"{_val_text(n.meta.get('val'))}")
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Repeated blocks


def _block_children(model: nn.Module) -> dict[str, str]:
    """FQN of every child of an nn.ModuleList / nn.Sequential -> the container's FQN."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            for child, _ in mod.named_children():
                out[f"{name}.{child}" if name else child] = name
    return out


def _instance_key(node: Node, children: dict[str, str]):
    """(container, raw stack key, child FQN) of the outermost block ``node`` belongs to."""
    for key, (fqn, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        fqn = _strip_call_suffix(fqn)
        if fqn in children:
            return children[fqn], key, fqn
    return None


def _instance_signature(names: list[str], nodes: dict[str, Node], param_fqn, buffers) -> str:
    """Canonical text of one instance: in-instance references by position, outside references by
    kind, shape and dtype (the previous block's output differs per instance but must match)."""
    pos = {name: i for i, name in enumerate(names)}

    def ref(x):
        if isinstance(x, Node):
            if x.name in pos:
                return f"%{pos[x.name]}"
            # A user input and an activation play the same role (block 0 reads the input,
            # block i the previous block's output); parameters and buffers do not.
            kind = "buffer" if x.name in buffers else "param" if x.name in param_fqn else "act"
            return f"ext:{kind}:{_val_text(x.meta.get('val'))}"
        if isinstance(x, (list, tuple)):
            return "(" + ",".join(ref(a) for a in x) + ")"
        if isinstance(x, dict):
            return "{" + ",".join(f"{k}:{ref(v)}" for k, v in sorted(x.items())) + "}"
        if isinstance(x, torch.device):
            return "device"
        return repr(x)

    return "\n".join(f"{nodes[n].target} {ref(nodes[n].args)} {ref(nodes[n].kwargs)} "
                     f"{_val_text(nodes[n].meta.get('val'))}" for n in names)


def find_blocks(gm: GraphModule, model: nn.Module, param_fqn: dict[str, str], buffers: set[str]):
    """Group call_function nodes by the container child they belong to, then group instances with
    identical canonical signatures. Returns (groups, block_of)."""
    children = _block_children(model)
    nodes = {n.name: n for n in gm.graph.nodes}
    instances: dict[str, list[str]] = {}        # raw stack key -> node names, graph order
    meta: dict[str, tuple[str, str]] = {}       # raw stack key -> (container, child FQN)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        key = _instance_key(n, children)
        if key is None:
            continue
        container, raw, fqn = key
        instances.setdefault(raw, []).append(n.name)
        meta[raw] = (container, fqn)

    by_sig: dict[tuple[str, str], list[str]] = {}   # (container, signature) -> raw keys, graph order
    for raw, names in instances.items():
        sig = _instance_signature(names, nodes, param_fqn, buffers)
        by_sig.setdefault((meta[raw][0], sig), []).append(raw)

    groups: list[BlockGroup] = []
    per_container: dict[str, int] = {}
    for (container, _sig), raws in by_sig.items():
        if len(raws) < 2:
            continue
        k = per_container.get(container, 0)
        per_container[container] = k + 1
        name = (container or "<root>") + (f"#{k}" if k else "")
        groups.append(BlockGroup(name, [instances[r] for r in raws], [meta[r][1] for r in raws]))
    block_of = {name: (g, i, p) for g, grp in enumerate(groups)
                for i, inst in enumerate(grp.instances) for p, name in enumerate(inst)}
    return groups, block_of


def param_chunks(blocks, param_fqn: dict[str, str], trainable) -> dict[str, int]:
    """The ZeRO chunk of each trainable parameter (placeholder name -> chunk key): one chunk per
    repeated-block instance (its parameters are reduced, gathered and freed together,
    runtime/zero.py), every other parameter in one last chunk. Execution builds its chunks from
    this and pricing charges each collective at its chunk's size, so both agree."""
    chunk_of_module: dict[str, int] = {}
    for grp in blocks:
        for fqn in grp.module_fqns:
            chunk_of_module.setdefault(fqn, len(chunk_of_module))
    rest = len(chunk_of_module)

    def key(fqn: str) -> int:
        for m, k in chunk_of_module.items():
            if fqn.startswith(m + "."):
                return k
        return rest
    return {n: key(param_fqn[n]) for n in trainable}
