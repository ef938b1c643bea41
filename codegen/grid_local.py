"""Ops of the grid program (codegen/grid_ops.py) that run locally on each rank's blocks: views,
transposes, split, cat, select, expand, elementwise ops, attention - and the "loose" parameters
they meet (a class token, a position table), split over hidden like the activation they join,
their gradient summed over the token groups.

A value's ``Lay`` says which dims are split (tokens: ``tdim``, hidden: ``hdim``); the layout
algebra below carries them through each op: a split dim must stay the outermost non-trivial dim
of its group in a view (its blocks stay contiguous), cat / select / split on a split dim are
refused (except a split of QKV columns stored head-grouped).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from solver import tp_grid_cost as tc
from runtime import collectives as C
from runtime.kernels.ops import ROTARY, ROTARY_INTERLEAVED

aten = torch.ops.aten


class GridLoweringError(ValueError):
    """The model has an op or a layout the grid program cannot run."""


@dataclass(frozen=True)
class Lay:
    kind: str                 # act | hid | red | full | in | rep | loss
    L: object = None          # layout (codegen/grid_layout.py)
    tdim: int | None = None   # dim split into token blocks (act, red) / batch dim (in, rep)
    hdim: int | None = None   # dim split into hidden blocks (act, hid)
    share: bool = False       # rep: a share of a value reduced over the batch (codegen/grid_replicated.py)
    # red: an act reduced over its hidden dim (an RMSNorm's mean): tokens split as the act's, whole
    # over the hidden group, its gradient partial over the hidden group (it broadcasts against
    # hidden blocks); any other use converts it (replicated)


@dataclass
class ParamUse:
    kind: str                 # weight | bias | norm | table | conv | loose | whole
    L: object
    perm: tuple | None = None     # QKV column order of a weight / bias
    hdim: int | None = None       # loose: the hidden dim



VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# elementwise ops torch does not tag pointwise
_ELEMENTWISE = {aten._to_copy.default, aten.alias.default, aten.detach.default, aten.type_as.default,
                aten.dropout.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.clone.default,
                aten.contiguous.default, aten.lift_fresh_copy.default}
# ops without an output that check metadata only (export inserts them around dtype casts)
NO_OUTPUT = {aten._assert_tensor_metadata.default}

def is_pointwise(target) -> bool:
    """An ATen op torch tags pointwise (elementwise with broadcasting)."""
    return torch.Tag.pointwise in getattr(target, "tags", ())


class LocalOps:
    """Mixin of GridProgram: the local ops."""

    def _loose(self, n, name, lay_like: Lay, ndim: int):
        """A parameter met by an activation outside the grid ops: split over hidden like it,
        replicated over the token groups (its gradient summed there)."""
        geo = self.geo
        gshape = list(self.g.gm.graph.find_nodes(op="placeholder", target=name)[0].meta["val"].shape)
        hdim = lay_like.hdim - (ndim - len(gshape))
        if hdim < 0 or gshape[hdim] == 1:
            self._fail(n, "a parameter broadcast over the hidden dim")
        L = lay_like.L
        shape = list(gshape)
        shape[hdim] //= geo.q
        t = self._param(name, ParamUse("loose", L, hdim=hdim), shape)
        trainable = name not in self.g.buffers
        if trainable:
            for label, size in geo.tok_groups(L):
                self.colls.append(tc.Collective("all_reduce", label, size, math.prod(shape) * 4, 1, "backward"))
        if not self.meta and trainable:
            for label, _ in geo.tok_groups(L):
                t = C.copy(t, self.grid.group(label), label)
        return t, Lay("hid", L, None, hdim)

    def _local(self, n, env):
        geo = self.geo
        args = [self._val(env, a) if isinstance(a, torch.fx.Node) else a for a in n.args]
        tensors = [a for a in args if isinstance(a, tuple) and isinstance(a[1], Lay)]
        nd = len(self._gshape(n)) if hasattr(n.meta.get("val"), "shape") else None
        # the split layout the op's values share, aligned to the output's dims
        ref_t = next((v for v in tensors if v[1].kind == "act"), None) or \
            next((v for v in tensors if v[1].kind == "hid"), None) or \
            next((v for v in tensors if v[1].kind == "red"), None)
        ref = None if ref_t is None else _align(ref_t[1], ref_t[0].dim(), nd)
        for i, a in enumerate(args):
            if isinstance(a, tuple) and isinstance(a[1], str):      # a parameter met here
                if nd is None:
                    self._fail(n, f"parameter {a[1]} used by an op without a tensor output")
                gshape = list(self.g.gm.graph.find_nodes(op="placeholder", target=a[1])[0].meta["val"].shape)
                hd = None if ref is None or ref.hdim is None else ref.hdim - (nd - len(gshape))
                if a[1] in self.g.buffers and (ref is None or hd is None or hd < 0 or gshape[hd] == 1):
                    # a buffer (no gradient) met by no split value, or broadcasting over the hidden
                    # blocks (rotary tables against heads): whole on every rank, cut where it
                    # meets a split dim
                    args[i] = (self._param(a[1], ParamUse("whole", None), gshape), Lay("rep"))
                else:
                    args[i] = self._loose(n, a[1], ref or Lay("hid", geo.L0, None, nd - 1), nd)
        if ref is None:
            ref_t = next((v for v in args if isinstance(v, tuple) and v[1].kind == "hid"), None)
            ref = None if ref_t is None else _align(ref_t[1], ref_t[0].dim(), nd)
        if n.target is aten.cat.default:
            return self._cat(n, env)
        t = n.target
        x0 = args[0] if isinstance(args[0], tuple) else None
        if t in VIEWS or t is aten.flatten.using_ints:
            return self._view(n, x0)
        if t is aten.expand.default:
            return self._expand(n, x0)
        if t is aten.transpose.int:
            d0, d1 = (a % x0[0].dim() for a in args[1:3])
            perm = list(range(x0[0].dim()))
            perm[d0], perm[d1] = perm[d1], perm[d0]
            return x0[0].transpose(d0, d1), _permute(x0[1], perm)
        if t is aten.permute.default:
            return x0[0].permute(*args[1]), _permute(x0[1], [p % x0[0].dim() for p in args[1]])
        if t is aten.select.int:
            dim = args[1] % x0[0].dim()
            if dim in (x0[1].tdim, x0[1].hdim):
                self._fail(n, "select on a split dim")
            return x0[0].select(dim, args[2]), _drop(x0[1], dim)
        if t is aten.unsqueeze.default:
            dim = args[1] % (x0[0].dim() + 1)
            return x0[0].unsqueeze(dim), _insert(x0[1], dim)
        if t is aten.split.Tensor:
            return self._split(n, x0, args)
        if t is aten.stack.default:
            return self._stack(n, env)
        if t is aten.repeat_interleave.self_int and x0 is not None and x0[1].kind in ("act", "hid") \
                and len(args) > 2 and isinstance(args[2], int):
            # each block repeats its own rows: the blocks of the repeated tensor, in order (a
            # GQA key/value head block serves the query head block of the same index)
            out = x0[0].repeat_interleave(args[1], dim=args[2])
            lay = x0[1]
            if list(out.shape) != self._lshape(self._gshape(n), lay):
                self._fail(n, "a repeat whose blocks are not the repeated blocks")
            return out, lay
        if t is aten.chunk.default and x0 is not None:
            dim = (args[2] if len(args) > 2 else 0) % x0[0].dim()
            if dim in (x0[1].tdim, x0[1].hdim) and x0[1].kind in ("act", "hid", "rep", "red"):
                self._fail(n, "chunk along a split dim")
            return list(x0[0].chunk(args[1], dim)), x0[1]
        if t is aten.slice.Tensor:
            dim = (args[1] if len(args) > 1 else 0) % x0[0].dim()
            if dim in (x0[1].tdim, x0[1].hdim) and x0[1].kind in ("act", "hid", "rep", "red"):
                self._fail(n, "slice along a split dim")
            return aten.slice.Tensor(x0[0], dim, *args[2:]), x0[1]
        if ref is None and any(isinstance(a, tuple) and (a[1].kind in ("rep", "loss") or a[1].share) for a in args):
            # values whole on every rank with a gradient (a replicated op's output): the op runs
            # replicated too, which keeps their layout (batch rows, shares)
            self._fail(n, "an op on values whole on every rank")
        if t is aten.dropout.default and args[1] and args[2]:
            self._fail(n, "dropout with p > 0 (its random mask would differ from one process)")
        if t is aten.scaled_dot_product_attention.default:
            lay = x0[1]
            if lay.kind != "act" or lay.tdim != 0 or lay.hdim != 1:
                self._fail(n, "attention needs whole sequences and heads split on dim 1")
            if len(args) > 4 and args[4]:
                self._fail(n, "attention with dropout")
            if len(args) > 3 and isinstance(args[3], tuple):
                args[3] = self._attn_mask(n, args[3], lay, x0[0])
            if self.meta:
                # meta has no fused CPU kernel: what it saves (q, k, v, the output and the fp32
                # logsumexp; docs/architecture.md "Memory") is recorded here
                qv, kv, vv = (a[0] for a in args[:3])
                b_, h_, s_, d_ = qv.shape     # CPU's flash kernel lays its output out as (b, s, h, d)
                out = self._fresh((b_, s_, h_, d_), qv.dtype).transpose(1, 2)
                self.local_shapes[n.name] = ([tuple(qv.shape), tuple(kv.shape), tuple(vv.shape)], [tuple(out.shape)])
                self._save(qv, kv, vv, out, self._fresh(qv.shape[:-1]))
                if len(args) > 3 and isinstance(args[3], torch.Tensor):
                    self._save(args[3])
                return out, x0[1]
        # an elementwise op (torch's pointwise tag) on values of one split layout; anything else
        # runs replicated (codegen/grid_replicated.py)
        if t in (ROTARY, ROTARY_INTERLEAVED) and x0 is not None and x0[1].kind in ("act", "hid", "rep", "red") \
                and x0[0].dim() - 1 in (x0[1].tdim, x0[1].hdim):
            self._fail(n, "rotary with its rotated (last) dim split")   # elementwise over the other dims
        if t not in _ELEMENTWISE and t is not aten.scaled_dot_product_attention.default \
                and t not in (ROTARY, ROTARY_INTERLEAVED) and not is_pointwise(t):
            self._fail(n, "not an elementwise op")
        if any(isinstance(v, torch.fx.Node) for v in n.kwargs.values()):
            self._fail(n, "a tensor keyword argument")
        if ref is None and any(isinstance(a, torch.fx.Node) and a.name in self.g.param_fqn for a in n.args):
            self._fail(n, "a parameter met by no split activation")
        if ref is not None:
            for i, a in enumerate(args):
                if not isinstance(a, tuple):
                    continue
                if a[1].kind == "in":
                    args[i] = (self._tokens(a, ref.L), None)
                elif a[1].kind == "red" and ref.kind == "act":
                    # a value reduced over the hidden dim meets the hidden blocks it was reduced
                    # from: broadcast along them (its gradient is partial there, as its layout says)
                    r = _align(a[1], a[0].dim(), nd)
                    off = nd - a[0].dim()
                    if r.L != ref.L or r.tdim != ref.tdim or (ref.hdim is not None and ref.hdim - off >= 0
                                                              and a[0].shape[ref.hdim - off] != 1):
                        self._fail(n, "a value reduced over the hidden dim met by another split")
                elif a[1].kind in ("act", "hid", "red"):
                    if _align(a[1], a[0].dim(), nd) != replace(ref, kind=a[1].kind) and \
                            not (a[1].kind == "hid" and _align(a[1], a[0].dim(), nd).hdim == ref.hdim
                                 and a[1].L == ref.L):
                        self._fail(n, "values of different split layouts")
                elif a[1].kind in ("rep", "full", "loss") or a[1].share:
                    args[i] = (self._block_of_whole(n, a, ref, nd), None)
        out = t(*self._on_meta([a[0] if isinstance(a, tuple) else a for a in args]), **self._on_meta(n.kwargs))
        if ref is not None and isinstance(out, torch.Tensor) and nd is not None \
                and list(out.shape) != self._lshape(self._gshape(n), ref):
            self._fail(n, f"its output {list(out.shape)} is not the block {self._lshape(self._gshape(n), ref)} "
                          f"of its split inputs")
        if self.meta:   # the local shapes the kernel ran on (planning: its GEMM efficiency)
            self.local_shapes[n.name] = ([tuple(a[0].shape) for a in args if isinstance(a, tuple)
                                          and isinstance(a[0], torch.Tensor)],
                                         [tuple(o.shape) for o in (out if isinstance(out, (tuple, list)) else (out,))
                                          if isinstance(o, torch.Tensor)])
        if ref is not None:
            return out, ref
        ins = [l for _, l in tensors if l.kind == "in"]
        if ins and nd == tensors[0][0].dim():
            return out, ins[0]
        return out, Lay("full")

    def _attn_mask(self, n, val, ref: Lay, q):
        """My block of an attention mask / bias: its batch rows and (if it has them) heads as the
        query's; a mask split like the query (a position bias computed from split values) as it is."""
        t, lay = val
        if lay.kind == "in":
            t = self._tokens(val, ref.L)
        elif lay.kind in ("act", "hid"):
            if _align(lay, t.dim(), 4) != replace(ref, kind=lay.kind):
                self._fail(n, "an attention mask split unlike the query")
        else:
            t = self._block_of_whole(n, val, ref, 4)
        off = 4 - t.dim()
        for d in (0, 1):
            if d - off >= 0 and t.shape[d - off] not in (1, q.shape[d]):
                self._fail(n, f"an attention mask {tuple(t.shape)} that does not match the query's block "
                              f"{tuple(q.shape)}")
        return t

    def _on_meta(self, args):
        """A device argument (``to(device="cpu")``, a factory op's ``device=``) names the device
        the program runs on: meta while planning, the rank's device on a rank (a meta model traced
        on meta says meta)."""
        dev = torch.device("meta") if self.meta else getattr(self, "device", None)
        if dev is None:
            return args
        if isinstance(args, dict):
            return {k: self._on_meta([v])[0] for k, v in args.items()}
        return [dev if isinstance(a, torch.device) else a for a in args]

    def _block_of_whole(self, n, val, ref: Lay, nd: int):
        """My block of a whole value (rep / full, no gradient) that an elementwise op broadcasts
        against values split as ``ref``: cut along the split dims where it has their size."""
        t, lay = val
        if lay.kind == "loss" or lay.share or t.requires_grad:
            self._fail(n, "a whole value with a gradient met by split values")
        off = nd - t.dim()
        geo = self.geo
        d = ref.tdim
        if geo.batch_parts > 1 and (lay.kind == "full" or lay.tdim is None) and d is not None and d - off >= 0 \
                and t.shape[d - off] == self._gshape(n)[d]:
            t = self._rows(t, d - off)    # a whole value holding every row of the batch: this rank's rows
        for key, chain in (("tdim", self._tok_chain(ref.L)), ("hdim", [(self.geo.hid_group(ref.L), self.geo.q)])):
            d = getattr(ref, key)
            if d is None or d - off < 0 or t.shape[d - off] == 1:
                continue
            for label, size in chain:
                if t.shape[d - off] % size:
                    self._fail(n, f"a whole value of size {t.shape[d - off]} on a dim split into {size}")
                idx = 0 if self.meta else self.coords[label]
                t = torch.chunk(t, size, dim=d - off)[idx]
        return t

    def _cat(self, n, env):
        parts = [self._val(env, a) for a in n.args[0]]
        dim = n.args[1] if len(n.args) > 1 else 0
        lays = {l for _, l in parts}
        if len(lays) != 1:
            self._fail(n, f"cat of differently split values {lays}")
        lay = lays.pop()
        dim %= parts[0][0].dim()
        if dim in (lay.tdim, lay.hdim):
            self._fail(n, "cat along a split dim")
        return torch.cat([p for p, _ in parts], dim), lay

    def _stack(self, n, env):
        parts = [self._val(env, a) for a in n.args[0]]
        dim = n.args[1] if len(n.args) > 1 else 0
        lays = {l for _, l in parts}
        if len(lays) != 1 or next(iter(lays)).kind not in ("act", "hid", "red"):
            self._fail(n, f"stack of differently split values {lays}")
        lay = lays.pop()
        dim %= parts[0][0].dim() + 1
        return torch.stack([p for p, _ in parts], dim), _insert(lay, dim)

    def _view(self, n, x):
        t, lay = x
        old, new = self._gshape(n.args[0]), self._gshape(n)
        lay2 = _map_view(old, new, lay, self.geo, n, self._fail)
        return t.reshape(self._lshape(new, lay2) if lay2.kind != "in" else new), lay2

    def _expand(self, n, x):
        t, lay = x
        new = list(self._gshape(n))
        off = len(new) - t.dim()
        if lay.kind == "hid" and new[0] == self.batch and (off > 0 or t.shape[0] == 1):
            lay2 = Lay("act", lay.L, 0, lay.hdim + off)
        elif lay.kind == "rep" and lay.tdim is None and new[0] == self.batch and (off > 0 or t.shape[0] == 1):
            lay2 = Lay("rep", tdim=0)     # a batch-free value expanded over this rank's rows
        else:
            lay2 = _shift(lay, off)
        return t.expand(*self._lshape(new, lay2)), lay2

    def _split(self, n, x, args):
        t, lay = x
        size, dim = args[1], (args[2] if len(args) > 2 else 0) % t.dim()
        if dim == lay.tdim:
            self._fail(n, "split along the token dim")
        if dim == lay.hdim:
            if n.args[0].name not in self.grouped:
                self._fail(n, "split along the hidden dim of a value whose columns are not grouped per block")
            size //= self.geo.q
        return list(torch.split(t, size, dim)), lay


# ------------------------------------------------------------------ layout algebra of local ops

def _shift(lay: Lay, off: int) -> Lay:
    return replace(lay, tdim=None if lay.tdim is None else lay.tdim + off,
                   hdim=None if lay.hdim is None else lay.hdim + off)


def _align(lay: Lay, nd_in, nd_out) -> Lay:
    return _shift(lay, (nd_out or 0) - (nd_in or 0)) if nd_in is not None and nd_out is not None else lay


def _permute(lay: Lay, perm) -> Lay:
    def m(d):
        return None if d is None else perm.index(d)
    return replace(lay, tdim=m(lay.tdim), hdim=m(lay.hdim))


def _drop(lay: Lay, dim) -> Lay:
    def m(d):
        return None if d is None else d - (d > dim)
    return replace(lay, tdim=m(lay.tdim), hdim=m(lay.hdim))


def _insert(lay: Lay, dim) -> Lay:
    def m(d):
        return None if d is None else d + (d >= dim)
    return replace(lay, tdim=m(lay.tdim), hdim=m(lay.hdim))


def _groups(old, new):
    """Pairs (old dims, new dims) whose sizes multiply to the same product, in order."""
    out, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        oi, nj = [i] if i < len(old) else [], [j] if j < len(new) else []
        po = old[i] if i < len(old) else 1
        pn = new[j] if j < len(new) else 1
        i, j = i + (i < len(old)), j + (j < len(new))
        while po != pn:
            if po < pn:
                oi.append(i)
                po *= old[i]
                i += 1
            else:
                nj.append(j)
                pn *= new[j]
                j += 1
        out.append((oi, nj))
    return out


def _map_view(old, new, lay: Lay, geo, n, fail) -> Lay:
    """Where the split dims of ``lay`` go through a view: a split dim must be the outermost
    non-trivial dim of its group (its blocks stay contiguous) and lands on the group's first
    non-trivial new dim."""
    res = {}
    for key, parts in (("tdim", geo.tok_parts), ("hdim", geo.q)):
        d = getattr(lay, key)
        if d is None or lay.kind in ("full",) or (key == "hdim" and lay.kind == "in"):
            res[key] = None
            continue
        if lay.kind == "in" and key == "tdim":
            parts = 1
        if lay.kind == "rep" and key == "tdim":
            parts = geo.batch_parts
        for oi, nj in _groups(list(old), list(new)):
            if d in oi:
                first_o = next(o for o in oi if old[o] != 1)
                if first_o != d:
                    fail(n, f"a view that moves the split dim {d} inside a merged group")
                tgt = next((k for k in nj if new[k] != 1), None)
                if tgt is None or new[tgt] % parts:
                    fail(n, f"a view whose new dim cannot hold the {parts} blocks of dim {d}")
                res[key] = tgt
                break
    return replace(lay, **res)

