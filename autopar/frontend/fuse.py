"""Fusion of traced patterns into the kernel operators (``torch.ops.autopar.*``, registered by
runtime/kernels/ops.py), done on the traced graph before planning so the planner prices, and
every rank runs, one fused op where the model wrote several.

``fuse(gm) -> dict[str, int]`` rewrites the traced GraphModule in place (autopar/frontend/trace.py
calls it with ``kernels=True``, before blocks and the fingerprint are taken) and returns how many
of each pattern it fused (patterns it found none of are left out):

* ``rms_norm``: ``x * rsqrt(mean(x², -1, keepdim) + eps)`` (``pow(x, 2)`` or ``x * x``),
  optionally cast, times a weight vector of the last dim (on either side) ->
  ``autopar.rms_norm(x, weight, eps)`` (one output: no getitem between the norm and its readers);
* ``swiglu``: ``silu(gate) * up`` with equal shapes -> ``autopar.swiglu(gate, up)``;
* ``layer_norm``: ``aten.layer_norm(x, [h], weight, bias, eps)`` over the last dim (h = x's last
  size) with a weight and a bias, y in x's dtype -> ``autopar.layer_norm(x, weight, bias, eps)``
  (one output, like the op it replaces); ``aten.native_layer_norm`` the same where only its
  output (item 0) is read;
* ``geglu``: ``gelu(gate, approximate) * up`` (exact or tanh gelu) with equal shapes and dtypes ->
  ``autopar.geglu(gate, up, approximate)``;
* ``softmax``: ``aten.softmax.int(x, -1)`` (no dtype, or x's) or ``aten._softmax(x, -1, False)`` over the
  last dim (explicit attention's masked scores) -> ``autopar.softmax(x)``;
* ``dropout_add``: ``residual + aten.dropout(x, p, True)``, p > 0 (either order, no alpha) with x,
  residual and the sum of one shape and dtype -> ``autopar.dropout_add(x, residual, p, train)``
  (tagged random as aten.dropout: ranks run it under runtime.rng.seeded; its mask is the kernel's
  Philox stream, not torch's: see runtime/kernels/dropout_add.py).

A pattern is fused only where its intermediate values have no other use, so nothing the rest of
the graph reads disappears. The rewrite keeps each replaced output's ``meta["val"]`` and module
stack (blocks are found on them).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

PATTERNS = ("rms_norm", "swiglu", "layer_norm", "geglu", "softmax", "dropout_add")
KERNELS = ("auto", "triton", "torch")


def uses_kernels(kernels: str, backend: str) -> bool:
    """Whether a plan for a cluster on ``backend`` runs the Triton kernels: ``"triton"`` always,
    ``"torch"`` never, ``"auto"`` on GPUs (NCCL). Planning needs no Triton: the fused operators
    have plain-torch bodies for fake and meta tensors."""
    if kernels not in KERNELS:
        from autopar.errors import PlanError
        raise PlanError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {kernels!r}")
    return kernels == "triton" or (kernels == "auto" and "nccl" in backend)
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}
_ASSERT = aten._assert_tensor_metadata.default


def _ops():
    from runtime.kernels import ops   # registers torch.ops.autopar.* on first import
    return ops


def _users(n: fx.Node) -> list[fx.Node]:
    """Users of ``n`` that read its value (tensor-metadata asserts do not)."""
    return [u for u in n.users if u.target is not _ASSERT]


def _only_use(n: fx.Node, user: fx.Node) -> bool:
    return isinstance(n, fx.Node) and _users(n) == [user]


def _is(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _arg(n: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` of ``n``, positional or by keyword ``name``."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _strip_cast(n: fx.Node, user: fx.Node) -> fx.Node:
    """``n`` without a dtype cast used only by ``user``."""
    if _is(n, *_CASTS) and _only_use(n, user):
        return n.args[0]
    return n


def _rms_norm_match(mul_w: fx.Node):
    """(x, weight, eps, intermediates) if ``mul_w`` ends a decomposed RMSNorm, else None."""
    if not _is(mul_w, aten.mul.Tensor):
        return None
    for normed, w in (mul_w.args, mul_w.args[::-1]):
        if not isinstance(normed, fx.Node) or not isinstance(w, fx.Node):
            continue
        wv, out = _val(w), _val(mul_w)
        if wv is None or out is None or wv.ndim != 1 or out.ndim < 1 or wv.shape[0] != out.shape[-1]:
            continue
        inner = _strip_cast(normed, mul_w)
        if not _is(inner, aten.mul.Tensor) or not _only_use(inner, normed if inner is not normed else mul_w):
            continue
        for x, r in (inner.args, inner.args[::-1]):
            if not _is(r, aten.rsqrt.default) or not _only_use(r, inner):
                continue
            add = r.args[0]
            if not _is(add, aten.add.Tensor) or not _only_use(add, r) or not isinstance(add.args[1], (int, float)):
                continue
            mean = add.args[0]
            if not _is(mean, aten.mean.dim) or not _only_use(mean, add):
                continue
            dims = list(mean.args[1]) if len(mean.args) > 1 else []
            keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
            xv = _val(x)
            if xv is None or not keep or dims not in ([-1], [xv.ndim - 1]):
                continue
            sq = mean.args[0]
            if not _only_use(sq, mean):
                continue
            squares = (_is(sq, aten.pow.Tensor_Scalar) and sq.args[0] is x and sq.args[1] == 2) or \
                      (_is(sq, aten.mul.Tensor) and sq.args[0] is x and sq.args[1] is x)
            if not squares or xv.shape != out.shape:
                continue
            dead = list(dict.fromkeys((normed, inner, r, add, mean, sq)))   # users before producers
            return x, w, float(add.args[1]), dead
    return None


def _swiglu_match(mul: fx.Node):
    if not _is(mul, aten.mul.Tensor):
        return None
    for s, up in (mul.args, mul.args[::-1]):
        if _is(s, aten.silu.default) and _only_use(s, mul) and isinstance(up, fx.Node):
            gate = s.args[0]
            gv, uv = _val(gate), _val(up)
            if gv is not None and uv is not None and gv.shape == uv.shape and gv.dtype == uv.dtype:
                return gate, up, [s]
    return None


def _geglu_match(mul: fx.Node):
    if not _is(mul, aten.mul.Tensor):
        return None
    for s, up in (mul.args, mul.args[::-1]):
        if _is(s, aten.gelu.default) and _only_use(s, mul) and isinstance(up, fx.Node):
            gate = s.args[0]
            approximate = _arg(s, 1, "approximate", "none")
            gv, uv = _val(gate), _val(up)
            if approximate in ("none", "tanh") and gv is not None and uv is not None and gv.shape == uv.shape \
                    and gv.dtype == uv.dtype:
                return gate, up, approximate, [s]
    return None


def _layer_norm_match(node: fx.Node):
    """(x, weight, bias, eps) if ``node`` is a LayerNorm the kernel runs: over the last dim, with a
    weight and a bias of that size, its output in x's dtype (and, for native_layer_norm, only its
    output read)."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    if _is(node, aten.layer_norm.default):
        x, nshape, w, b, eps = (_arg(node, i, name, d) for i, (name, d) in
                                enumerate(zip(names, (None, None, None, None, 1e-5))))
        out = _val(node)
    elif _is(node, aten.native_layer_norm.default):
        x, nshape, w, b, eps = (_arg(node, i, name, None) for i, name in enumerate(names))
        if any(not (u.target is operator.getitem and u.args[1] == 0) for u in _users(node)):
            return None
        out = (_val(node) or (None,))[0]
    else:
        return None
    xv = _val(x)
    if xv is None or out is None or xv.ndim < 1 or nshape is None or list(nshape) != [xv.shape[-1]] \
            or out.dtype != xv.dtype:
        return None
    for p in (w, b):
        pv = _val(p)
        if pv is None or tuple(pv.shape) != (xv.shape[-1],):
            return None
    return x, w, b, float(eps)


def _replace(gm: fx.GraphModule, old: fx.Node, make, dead: list[fx.Node]) -> None:
    with gm.graph.inserting_before(old):
        new = make(gm.graph)
    new.meta.update({k: v for k, v in old.meta.items() if k != "val"})
    new.meta["val"] = old.meta["val"]
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)
    for n in dead:   # producer order: an intermediate goes once nothing reads it
        for a in [u for u in n.users if u.target is _ASSERT]:
            gm.graph.erase_node(a)
        if not n.users:
            gm.graph.erase_node(n)


def fuse(gm: fx.GraphModule) -> dict[str, int]:
    """Fuse the patterns of the module doc in ``gm``, in place."""
    ops = _ops()
    counts = dict.fromkeys(PATTERNS, 0)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.graph is not gm.graph:
            continue
        m = _rms_norm_match(node)
        if m is not None:
            x, w, eps, dead = m

            _replace(gm, node, lambda g, x=x, w=w, eps=eps: g.call_function(ops.RMS_NORM, (x, w, eps)), dead)
            counts["rms_norm"] += 1
            continue
        m = _swiglu_match(node)
        if m is not None:
            gate, up, dead = m
            _replace(gm, node, lambda g, gate=gate, up=up: g.call_function(ops.SWIGLU, (gate, up)), dead)
            counts["swiglu"] += 1
            continue
        m = _geglu_match(node)
        if m is not None:
            gate, up, approximate, dead = m
            _replace(gm, node, lambda g, gate=gate, up=up, a=approximate: g.call_function(ops.GEGLU, (gate, up, a)),
                     dead)
            counts["geglu"] += 1
            continue
        m = _layer_norm_match(node)
        if m is not None:
            _fuse_layer_norm(gm, node, m, ops)
            counts["layer_norm"] += 1
    _fuse_softmax_dropout_add(gm, ops, counts)
    gm.graph.lint()
    gm.recompile()
    return {k: v for k, v in counts.items() if v}


def _fuse_layer_norm(gm: fx.GraphModule, node: fx.Node, match, ops) -> None:
    """One output, as aten.layer_norm: the fused op takes the node's place (native_layer_norm's
    item-0 readers read it directly)."""
    x, w, b, eps = match
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(ops.LAYER_NORM, (x, w, b, eps))
    fused.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    if node.target is aten.native_layer_norm.default:
        fused.meta["val"] = _val(node)[0]
        for u in list(node.users):
            if u.target is operator.getitem:
                u.replace_all_uses_with(fused)
                gm.graph.erase_node(u)
            else:   # a metadata assert on the tuple
                gm.graph.erase_node(u)
    else:
        fused.meta["val"] = _val(node)
        node.replace_all_uses_with(fused)
    gm.graph.erase_node(node)


# ------------------------------------------------------------------------- softmax, dropout_add
def _softmax_match(node: fx.Node):
    """x if ``node`` is a softmax over the last dim, in x's dtype, the kernel's row fits."""
    if _is(node, aten.softmax.int):
        dtype = _arg(node, 2, "dtype", None)
        if dtype is not None and (_val(node.args[0]) is None or dtype != _val(node.args[0]).dtype):
            return None
    elif _is(node, aten._softmax.default):
        if _arg(node, 2, "half_to_float", False):
            return None
    else:
        return None
    x = node.args[0]
    xv, out = _val(x), _val(node)
    if xv is None or out is None or xv.ndim < 1 or not xv.dtype.is_floating_point or out.dtype != xv.dtype:
        return None
    if node.args[1] not in (-1, xv.ndim - 1):
        return None
    from runtime.kernels import MAX_HIDDEN
    return x if xv.shape[-1] <= MAX_HIDDEN else None


def _dropout_add_match(add: fx.Node):
    """(x, residual, p, train, dropout node) if ``add`` is residual + dropout(x) of one shape and dtype."""
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    for d, res in (add.args[::-1], add.args):
        if not _is(d, aten.dropout.default) or not _only_use(d, add) or not isinstance(res, fx.Node):
            continue
        x = d.args[0]
        p, train = float(_arg(d, 1, "p", 0.5)), bool(_arg(d, 2, "train", True))
        if not train or p <= 0.0:   # inactive: aten.dropout returns x itself, nothing to fuse
            continue
        vals = [_val(x), _val(res), _val(add)]
        if any(v is None or not isinstance(v, torch.Tensor) for v in vals) or not isinstance(x, fx.Node):
            continue
        if len({tuple(v.shape) for v in vals}) == 1 and len({v.dtype for v in vals}) == 1 \
                and vals[0].dtype.is_floating_point:
            return x, res, p, train, d
    return None


def _fuse_softmax_dropout_add(gm: fx.GraphModule, ops, counts: dict) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.graph is not gm.graph:
            continue
        x = _softmax_match(node)
        if x is not None:
            _replace(gm, node, lambda g, x=x: g.call_function(ops.SOFTMAX, (x,)), [])
            counts["softmax"] += 1
            continue
        m = _dropout_add_match(node)
        if m is not None:
            x, res, p, train, d = m
            _replace(gm, node, lambda g, x=x, r=res, p=p, t=train: g.call_function(ops.DROPOUT_ADD, (x, r, p, t)),
                     [d])
            counts["dropout_add"] += 1
