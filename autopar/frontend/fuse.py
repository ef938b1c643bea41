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
* ``rotary``: Hugging Face's rotary position embedding ``x * cos + rotate_half(x) * sin`` with
  ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2], -1)`` (``add(mul(x, cos), mul(cat([neg(slice),
  slice]), sin))``, either operand order), cos and sin broadcasting to x's shape ->
  ``autopar.rotary(x, cos, sin)``. Partial rotary (GPT-NeoX's ``rotary_pct``, x a slice of the
  head dim) is the same pattern on the slice. Also counted as ``rotary``: GPT-J / Meta Llama's
  interleaved form (the zoo's Llama, autopar/models/llama.py), ``flatten(stack([x1 * cos - x2 *
  sin, x1 * sin + x2 * cos], -1), -2)`` with ``x1, x2 = x[..., 0::2], x[..., 1::2]`` and tables of
  width d/2 -> ``autopar.rotary_interleaved(x, cos, sin)``.
* ``softmax``: ``aten.softmax.int(x, -1)`` (no dtype, or x's) or ``aten._softmax(x, -1, False)`` over the
  last dim (explicit attention's masked scores) -> ``autopar.softmax(x)``;
* ``dropout_add``: ``residual + aten.dropout(x, p, True)``, p > 0 (either order, no alpha) with x,
  residual and the sum of one shape and dtype -> ``autopar.dropout_add(x, residual, p, train)``
  (tagged random as aten.dropout: ranks run it under runtime.rng.seeded; its mask is the kernel's
  Philox stream, not torch's: see runtime/kernels/dropout_add.py).

* ``linear_cross_entropy``: the LM head and its loss, ``aten.cross_entropy_loss(view(linear(h, W),
  [-1, V]), targets, reduction=mean or sum, ignore_index)`` (no bias, no class weights, no label
  smoothing; the logits optionally cast) -> ``autopar.linear_cross_entropy(h', W, targets,
  ignore_index, reduction)`` with ``h' = view(h, [-1, D])`` (a new node, unless h is 2-D): the
  [N, V] logits are never materialised. The weight may have other uses (GPT-2 ties it to the
  embedding); the logits may not.

A pattern is fused only where its intermediate values have no other use, so nothing the rest of
the graph reads disappears. The rewrite keeps each replaced output's ``meta["val"]`` and module
stack (blocks are found on them).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

PATTERNS = ("rms_norm", "swiglu", "layer_norm", "geglu", "rotary", "softmax", "dropout_add", "linear_cross_entropy")
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


def _replace(gm: fx.GraphModule, old: fx.Node, make, dead: list[fx.Node]) -> fx.Node:
    with gm.graph.inserting_before(old):
        new = make(gm.graph)
    new.meta.update({k: v for k, v in old.meta.items() if k != "val"})
    new.meta["val"] = old.meta["val"]
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)
    new_node = new
    for n in dead:   # producer order: an intermediate goes once nothing reads it
        for a in [u for u in n.users if u.target is _ASSERT]:
            gm.graph.erase_node(a)
        if not n.users:
            gm.graph.erase_node(n)
    return new_node


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
        m = _rotary_match(node)
        if m is not None:
            x, cos, sin, dead = m
            _replace(gm, node, lambda g, x=x, c=cos, s=sin: g.call_function(ops.ROTARY, (x, c, s)), dead)
            counts["rotary"] += 1
        m = _rotary_interleaved_match(node)
        if m is not None:
            x, cos, sin, dead = m
            _replace(gm, node, lambda g, x=x, c=cos, s=sin: g.call_function(ops.ROTARY_INTERLEAVED, (x, c, s)), dead)
            counts["rotary"] += 1
    _fuse_softmax_dropout_add(gm, ops, counts)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _fuse_linear_cross_entropy(gm, node, ops):
            counts["linear_cross_entropy"] += 1
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


# ----------------------------------------------------------------------------------------- rotary
_END = 2 ** 63 - 1


def _last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim % ndim == ndim - 1


def _slice_of(n, x: fx.Node, start: int, end: int, user: fx.Node) -> bool:
    """``n`` is ``x[..., start:end]`` (last dim, step 1; ``end`` also as past-the-end) used only by ``user``."""
    if not _is(n, aten.slice.Tensor) or n.args[0] is not x or not _only_use(n, user):
        return False
    nd = _val(x).ndim
    dim, s, e, step = (_arg(n, i, name, d) for i, name, d in
                       ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1)))
    size = _val(x).shape[-1]
    return _last_dim(dim, nd) and step == 1 and (s or 0) == start and \
        (e == end or (end == size and (e is None or e >= size)))


def _rotate_half_of(cat: fx.Node, user: fx.Node):
    """x if ``cat`` is ``cat([-x[..., d/2:], x[..., :d/2]], -1)`` used only by ``user``, else None."""
    if not _is(cat, aten.cat.default) or not _only_use(cat, user):
        return None
    parts, dim = cat.args[0], _arg(cat, 1, "dim", 0)
    if len(parts) != 2 or not _is(parts[0], aten.neg.default) or not _only_use(parts[0], cat):
        return None
    lo = parts[1]
    x = lo.args[0] if _is(lo, aten.slice.Tensor) else None
    xv = _val(x)
    if xv is None or xv.ndim < 1 or not _last_dim(dim, xv.ndim) or xv.shape[-1] % 2 or xv.shape[-1] < 2:
        return None
    h = xv.shape[-1] // 2
    if _slice_of(parts[0].args[0], x, h, xv.shape[-1], parts[0]) and _slice_of(lo, x, 0, h, cat):
        return x, [parts[0], parts[0].args[0], lo]
    return None


def _broadcasts_to(t, shape) -> bool:
    v = _val(t)
    if not isinstance(v, torch.Tensor) or v.ndim > len(shape):
        return False
    return all(s in (1, o) for s, o in zip(v.shape[::-1], tuple(shape)[::-1]))


def _rotary_match(add: fx.Node):
    """(x, cos, sin, intermediates) if ``add`` is ``x * cos + rotate_half(x) * sin``, else None."""
    if not _is(add, aten.add.Tensor) or _arg(add, 2, "alpha", 1) != 1 or len(add.args) < 2:
        return None
    out = _val(add)
    for m1, m2 in (add.args[:2], add.args[1::-1]):
        if not (_is(m1, aten.mul.Tensor) and _is(m2, aten.mul.Tensor) and _only_use(m1, add) and _only_use(m2, add)):
            continue
        for cat, sin in (m2.args[:2], m2.args[1::-1]):
            r = _rotate_half_of(cat, m2) if isinstance(sin, fx.Node) else None
            if r is None:
                continue
            x, rot_dead = r
            if x not in m1.args[:2]:
                continue
            cos = m1.args[1] if m1.args[0] is x else m1.args[0]
            xv = _val(x)
            if not isinstance(cos, fx.Node) or cos is x or out is None or tuple(out.shape) != tuple(xv.shape) \
                    or not _broadcasts_to(cos, xv.shape) or not _broadcasts_to(sin, xv.shape):
                continue
            return x, cos, sin, [m1, m2, cat] + rot_dead
    return None


def _strided_slice(n, start: int) -> fx.Node | None:
    """x if ``n`` is ``x[..., start::2]`` (last dim), else None."""
    if not _is(n, aten.slice.Tensor) or _val(n.args[0]) is None:
        return None
    x = n.args[0]
    dim, s, e, step = (_arg(n, i, name, d) for i, name, d in
                       ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1)))
    size = _val(x).shape[-1]
    if _last_dim(dim, _val(x).ndim) and step == 2 and (s or 0) == start and (e is None or e >= size):
        return x
    return None


def _mul_pair(m: fx.Node, user: fx.Node):
    """(a, b) of ``m = a * b`` used only by ``user``, else None."""
    if _is(m, aten.mul.Tensor) and _only_use(m, user) and all(isinstance(a, fx.Node) for a in m.args[:2]):
        return tuple(m.args[:2])
    return None


def _rotary_interleaved_match(flat: fx.Node):
    """(x, cos, sin, intermediates) if ``flat`` is ``flatten(stack([x1 * cos - x2 * sin,
    x1 * sin + x2 * cos], -1), -2)`` with ``x1, x2 = x[..., 0::2], x[..., 1::2]``, else None."""
    if not _is(flat, aten.flatten.using_ints):
        return None
    stack = flat.args[0]
    out = _val(flat)
    if not _is(stack, aten.stack.default) or not _only_use(stack, flat) or out is None:
        return None
    sv = _val(stack)
    start, end = _arg(flat, 1, "start_dim", 0), _arg(flat, 2, "end_dim", -1)
    if sv is None or start % sv.ndim != sv.ndim - 2 or end % sv.ndim != sv.ndim - 1:
        return None
    parts, sdim = stack.args[0], _arg(stack, 1, "dim", 0)
    if len(parts) != 2 or sdim % sv.ndim != sv.ndim - 1:
        return None
    sub, add = parts
    if not (_is(sub, aten.sub.Tensor) and _is(add, aten.add.Tensor) and _only_use(sub, stack)
            and _only_use(add, stack)) or _arg(sub, 2, "alpha", 1) != 1 or _arg(add, 2, "alpha", 1) != 1:
        return None
    m1, m2, m3, m4 = (_mul_pair(m, u) for m, u in ((sub.args[0], sub), (sub.args[1], sub),
                                                   (add.args[0], add), (add.args[1], add)))
    if None in (m1, m2, m3, m4):
        return None

    def split(pair, start):   # (x, the slice, the table) of slice * table, either order
        for sl, t in (pair, pair[::-1]):
            x = _strided_slice(sl, start)
            if x is not None:
                return x, sl, t
        return None

    a, b = split(m1, 0), split(m2, 1)          # x1 * cos, x2 * sin
    if a is None or b is None or a[0] is not b[0]:
        return None
    x, x1, cos = a
    _, x2, sin = b
    for pair in ((m3, m4), (m4, m3)):          # x1 * sin and x2 * cos, either order
        c, d = split(pair[0], 0), split(pair[1], 1)
        if c is not None and d is not None and c[1] is x1 and d[1] is x2 and c[2] is sin and d[2] is cos:
            break
    else:
        return None
    muls = [sub.args[0], sub.args[1], add.args[0], add.args[1]]
    if set(_users(x1)) | set(_users(x2)) != set(muls) or len(set(muls)) != 4:
        return None
    xv = _val(x)
    if cos is x or sin is x or tuple(out.shape) != tuple(xv.shape) or xv.shape[-1] % 2:
        return None
    tshape = (*xv.shape[:-1], xv.shape[-1] // 2)
    if not _broadcasts_to(cos, tshape) or not _broadcasts_to(sin, tshape):
        return None
    return x, cos, sin, [stack, sub, add, *muls, x1, x2]


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


# ---------------------------------------------------------------------------- linear_cross_entropy
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _linear_cross_entropy_match(ce: fx.Node):
    """(hidden, weight, targets, ignore_index, reduction, intermediates) if ``ce`` is the
    cross-entropy of an LM head's logits (module doc), else None."""
    if not _is(ce, aten.cross_entropy_loss.default) or len(ce.args) < 2:
        return None
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    _, targets, cw, reduction, ignore, smoothing = (_arg(ce, i, name, d) for i, (name, d) in
                                                     enumerate(zip(names, (None, None, None, 1, -100, 0.0))))
    if cw is not None or smoothing or reduction not in (1, 2) or not isinstance(ignore, int):
        return None
    view = ce.args[0]
    lv, tv = _val(view), _val(targets)
    if not _is(view, *_VIEWS) or not _only_use(view, ce) or lv is None or lv.ndim != 2 or tv is None \
            or tuple(tv.shape) != (lv.shape[0],) or tv.dtype.is_floating_point:
        return None
    lin = _strip_cast(view.args[0], view)
    cast = view.args[0] if lin is not view.args[0] else None
    if not _is(lin, aten.linear.default) or not _only_use(lin, cast or view) or _arg(lin, 2, "bias") is not None:
        return None
    h, w = lin.args[0], lin.args[1]
    hv, wv, ov = _val(h), _val(w), _val(lin)
    if hv is None or wv is None or ov is None or wv.ndim != 2 or hv.ndim < 2 or hv.shape[-1] != wv.shape[1] \
            or tuple(lv.shape) != (hv.numel() // hv.shape[-1], wv.shape[0]) or not hv.dtype.is_floating_point:
        return None
    dead = [view] + ([cast] if cast is not None else []) + [lin]
    return h, w, targets, ignore, reduction, dead


def _fuse_linear_cross_entropy(gm: fx.GraphModule, ce: fx.Node, ops) -> bool:
    m = _linear_cross_entropy_match(ce)
    if m is None:
        return False
    h, w, targets, ignore, reduction, dead = m
    lin = dead[-1]
    hv = _val(h)
    if hv.ndim != 2:   # [..., D] -> [N, D], where the linear was (its module stack)
        d = hv.shape[-1]
        with gm.graph.inserting_before(ce):
            h = gm.graph.call_function(aten.view.default, (h, [-1, d]))
        h.meta.update({k: v for k, v in lin.meta.items() if k != "val"})
        h.meta["val"] = hv.reshape(-1, d)
    old_name = ce.name
    new = _replace(gm, ce, lambda g, h=h, w=w, t=targets, i=ignore, r=reduction:
                   g.call_function(ops.LINEAR_CROSS_ENTROPY, (h, w, t, i, r)), dead)
    gm.meta.setdefault("autopar_renamed", {})[old_name] = new.name   # the loss (TracedGraph.output_name)
    return True
