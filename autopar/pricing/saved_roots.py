"""Saved-activation accounting: which tensors autograd keeps for each op on the device that runs
it (CUDA and CPU kernels save different things: ``Saved.on``), under which storage root each
one is charged so a storage shared by several ops is counted once, and the bytes one rank keeps
under a strategy. Used by node pricing (autopar/pricing/price.py)."""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from autopar.cluster import Cluster
from autopar.pricing.local_bytes import block_fraction, letter_fraction, runtime_itemsize
from autopar.rules import tensor_inputs
from autopar.rules.candidates import FLOAT_DTYPES, Candidates, NodeInfo
from autopar.rules.table import val as node_val


def runs_cuda(cluster: Cluster) -> bool:
    """Does the cluster run CUDA kernels (what autograd saves differs: see ``Saved.on``)? A
    cluster on NCCL is a GPU cluster; gloo clusters are CPU processes."""
    return cluster.backend == "nccl"


def on_device(on: str, cuda: bool, work16: bool) -> bool:
    """Does a rule's device tag (``Saved.on``, ``OpSpec.storage_order``) name this device?
    ``work16``: the op's working floating dtype is 16-bit (bf16 mixed precision or a 16-bit trace)."""
    if not on:
        return True
    dev = "cuda" if cuda else "cpu"
    return on == dev or on == dev + ("16" if work16 else "32")


def saved_applies(sv, cuda: bool, work16: bool) -> bool:
    """Is ``Saved`` entry ``sv`` saved on this device (``Saved.on``)?"""
    return on_device(sv.on, cuda, work16)


# ops that may return a view of their input: replayed by ``device_storage_roots``
_VIEWISH = {"transpose", "permute", "view", "reshape", "_unsafe_view", "contiguous", "flatten", "unflatten",
            "squeeze", "unsqueeze", "t", "alias", "expand", "select", "slice", "clone", "_reshape_alias"}


def device_order(info: NodeInfo, cuda: bool, precision: str) -> str | None:
    """The memory order (output letters, outermost first) the device's kernel lays op ``info``'s
    output out in (``OpSpec.storage_order``), or None where it is the trace's (contiguous)."""
    spec = info.spec
    val = node_val(info.node)
    if spec is None or not spec.storage_order or not isinstance(val, torch.Tensor) or val.is_sparse:
        return None
    work16 = runtime_itemsize(val.dtype, precision) == 2
    order = next((o for on, o in spec.storage_order if on_device(on, cuda, work16)), None)
    if order is not None and order.startswith("="):   # like an input: its dims by decreasing stride (torch.empty_like)
        ref = node_val(tensor_inputs(info.node)[int(order[1:])])
        dims = sorted(range(ref.ndim), key=lambda d: (-ref.stride(d), d))
        order = "".join(spec.outputs[0][d] for d in dims)
    return order


def device_storage_roots(c: Candidates, cuda: bool, precision: str = "bf16") -> dict[str, str]:
    """Storage roots where the device's kernels lay an output out differently from the trace
    (``OpSpec.storage_order``; e.g. flash attention's output, traced on meta through the math
    path): the op's view-like consumers are replayed on a meta tensor with the device's layout,
    and each gets the root of the storage it really aliases. Returns node -> root overrides of
    ``c.storage_root``."""
    over: dict[str, str] = {}
    users: dict[str, list] = defaultdict(list)
    for node in c.graph.gm.graph.nodes:
        for p in node.all_input_nodes:
            users[p.name].append(node)
    for name in c.order:
        info = c.nodes[name]
        spec = info.spec
        if info.kind != "op" or spec is None or not spec.storage_order:
            continue
        order = device_order(info, cuda, precision)
        out = node_val(info.node)
        if order is None or not isinstance(out, torch.Tensor) or out.is_sparse:
            continue
        letters = spec.outputs[0]
        shape = dict(zip(letters, out.shape))
        base = torch.empty([shape[ch] for ch in order], dtype=out.dtype, device="meta")
        base = base.permute([order.index(ch) for ch in letters])
        owner = {id(base.untyped_storage()): c.storage_root.get(name, name)}
        keep = [base.untyped_storage()]
        vals = {name: base}
        todo = [name]
        while todo:
            n = todo.pop()
            for u in users[n]:
                op = getattr(u.target, "overloadpacket", None)
                if op is None or op.__name__ not in _VIEWISH or u.name in vals or len(u.all_input_nodes) != 1:
                    continue
                args = [vals[n] if getattr(a, "name", None) == n else a for a in u.args]
                try:
                    y = u.target(*args, **u.kwargs)
                except Exception:
                    continue
                if not isinstance(y, torch.Tensor):
                    continue
                st = y.untyped_storage()
                keep.append(st)
                owner.setdefault(id(st), u.name)
                over[u.name] = owner[id(st)]
                vals[u.name] = y
                todo.append(u.name)
        del keep
    return over


def _saved_roots(c: Candidates, info: NodeInfo, precision: str, charged: set[str], cuda: bool = False,
                 roots: dict[str, str] | None = None, saved_inputs: list | None = None):
    """(storage root or None, function strategy -> bytes) for each tensor this op saves, each
    storage counted once (root None: a buffer of the op's own, e.g. a dropout mask). ``cuda``:
    count what CUDA kernels save (``runs_cuda``), else what CPU kernels save; ``roots``: storage
    roots on that device (``device_storage_roots``), default the traced ones. ``saved_inputs``:
    a list to receive (input index, root, charged here, the input's bytes) of every activation
    input the op saves, charged here or not: an input read through a reshard is a new storage
    whatever was charged (autopar/pricing/saved_copies.py)."""
    mesh = c.mesh
    roots = c.storage_root if roots is None else roots
    fns = []
    ins = tensor_inputs(info.node)
    val = node_val(info.node)
    outs = val if isinstance(val, (tuple, list)) else (val,)
    if info.name not in c.needs_grad:
        return fns          # autograd records nothing for an op none of whose inputs needs a gradient
    floats = [node_val(p).dtype for p in ins
              if isinstance(node_val(p), torch.Tensor) and node_val(p).dtype in FLOAT_DTYPES]
    work16 = any(runtime_itemsize(d, precision) == 2 for d in floats)
    for sv in info.spec.saved:
        if not saved_applies(sv, cuda, work16):
            continue
        if sv.for_grad_of and not any(j < len(ins) and ins[j].name in c.needs_grad for j in sv.for_grad_of):
            continue
        if sv.kind in ("input", "output"):
            if sv.kind == "input":
                if sv.index >= len(ins):
                    continue
                src = ins[sv.index]
                root = roots.get(src.name)
                t = node_val(src)
            else:
                if sv.index >= len(outs):
                    continue
                root = roots.get(info.name) if sv.index == 0 else f"{info.name}#{sv.index}"
                t = outs[sv.index]
            if root is None or not isinstance(t, torch.Tensor):
                continue
            if root in c.nodes and c.nodes[root].kind == "param":
                continue    # parameters are counted as parameters, not activations
            if saved_inputs is not None and sv.kind == "input":
                saved_inputs.append((sv.index, root, root not in charged,
                                     t.numel() * runtime_itemsize(t.dtype, precision)))
            if root in charged:
                continue
            charged.add(root)
            nbytes = c.root_bytes.get(root, t.numel() * t.element_size())
            nbytes = nbytes // t.element_size() * runtime_itemsize(t.dtype, precision)
            if sv.kind == "input" and info.repeats > 1:
                # price_nodes multiplies by the repeats; instances that all save one storage made
                # before the blocks (RoPE's cos and sin) save it once: charge each its share
                nbytes = nbytes * len(_instance_input_roots(c, info, sv.index, roots)) / info.repeats
            idx = sv.index

            def fn(st, nbytes=nbytes, idx=idx, kind=sv.kind):
                lay = (st.inputs[idx] if idx < len(st.inputs) else None) if kind == "input" else \
                    (st.outputs[idx] if idx < len(st.outputs) else None)
                return nbytes * block_fraction(lay, mesh)
            fns.append((root, fn))
        else:
            size = math.prod(info.spec.sizes[ch] for ch in sv.letters) if sv.letters else 1
            # fixed-size extras (fp32 statistics, bool masks) keep their itemsize; an activation-
            # typed one follows the working dtype (a fp32-traced dropout mask is 2 bytes under bf16)
            itemsize = min(sv.itemsize, 2) if sv.act and precision == "bf16" else sv.itemsize
            nbytes = size * itemsize
            fns.append((None, lambda st, nbytes=nbytes, letters=sv.letters:
                        nbytes * letter_fraction(letters, st, mesh)))
    return fns


def _instance_input_roots(c: Candidates, info: NodeInfo, index: int, roots: dict[str, str]) -> set[str]:
    """Storage roots of tensor input ``index`` over the block instances ``info`` stands for."""
    out = set()
    for n in c.instances(info.name):
        ins = tensor_inputs(c.nodes[n].node)
        if index < len(ins):
            out.add(roots.get(ins[index].name, ins[index].name))
    return out
