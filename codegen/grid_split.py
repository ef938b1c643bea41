"""The split ops of the grid program (codegen/grid_ops.py): the ops 2D / 2.5D / 3D tensor
parallelism runs over the grid with their own collectives - embedding, linear (SUMMA /
Tesseract / 3D matmul, a tied classifier, a patch-embedding conv), LayerNorm, a sum / mean over the
hidden dim, cross-entropy - each appending, on meta, the exact collectives solver/tp_grid_cost.py
gives for it and recording what it saves for backward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from codegen.grid_local import VIEWS, Lay, ParamUse
from solver import tp_grid_cost as tc
from runtime import collectives as C
from runtime import matmul3d, summa, tesseract
from runtime.split_attention import qkv_column_order
from runtime.split_loss import split_cross_entropy

aten = torch.ops.aten


class SplitOps:
    """Mixin of GridProgram: the ops split over the grid."""

    def _mod(self):
        return {"2d": summa, "2.5d": tesseract, "3d": matmul3d}[self.geo.mode]

    def _embedding(self, n, env):
        geo = self.geo
        w_name = self._pname(n, n.args[0])
        V, h = self._gshape(n.args[0])
        ids_val = self._val(env, n.args[1])
        self._div(n, "embedding dim", h, geo.table_parts())
        L = geo.L0
        if ids_val[1].kind == "in":
            ids, lay = self._tokens(ids_val, L), Lay("act", L, 0, len(self._gshape(n)) - 1)
        elif ids_val[1].kind == "full":
            ids, lay = ids_val[0], Lay("hid", L, None, len(self._gshape(n)) - 1)
        else:
            self._fail(n, "indices must be a model input or a constant")
        table = self._param(w_name, ParamUse("table", L), (V, h // geo.table_parts()))
        self.colls += tc.embedding(geo.mode, V, h, geo.q, geo.d, axes=L if geo.mode == "3d" else ("x", "y", "z"))
        if self.meta:
            return F.embedding(ids, self._fresh((V, h // geo.q))), lay
        m = self._mod()
        out = m.embedding(ids, table, self.grid, L) if geo.mode == "3d" else m.embedding(ids, table, self.grid)
        return out, lay

    def _as_act(self, n, val, L=None):
        t, lay = val
        if lay.kind == "in":
            L = L or self.geo.L0
            t = self._tokens(val, L)
            if self.meta:
                s = list(t.shape)
                s[-1] //= self.geo.q
                return torch.empty(s, dtype=t.dtype, device="meta"), Lay("act", L, lay.tdim, t.dim() - 1)
            idx, q = self.geo.hid_block(L, self.coords)
            return torch.chunk(t, q, dim=-1)[idx].contiguous(), Lay("act", L, lay.tdim, t.dim() - 1)
        if lay.kind == "rep":
            return self._rep_to_act(n, val, L or self.geo.L0)
        if lay.kind != "act" or lay.tdim != 0 or lay.hdim != t.dim() - 1:
            self._fail(n, f"input must be an activation split on tokens (dim 0) and hidden (last dim), got {lay}")
        return t, lay

    def _qkv_order(self, n, out_features):
        """Head-grouped column order when the linear's output is split into Q, K, V heads."""
        users = list(n.users)
        if len(users) != 1 or users[0].target is not aten.split.Tensor:
            return None
        sp = users[0]
        size = sp.args[1]
        if size * 3 != out_features:
            return None
        heads = None
        for gi in sp.users:
            for v in gi.users:
                if v.target in VIEWS and len(self._gshape(v)) == 4:
                    heads = self._gshape(v)[2]
        if heads is None:
            return None
        return tuple(qkv_column_order(size, heads, self.geo.q))

    def _linear(self, n, env):
        geo = self.geo
        val = self._val(env, n.args[0])
        L_in = None
        if geo.mode == "3d" and isinstance(val, tuple) and val[1].kind == "rep" and \
                isinstance(n.args[1], torch.fx.Node) and not self._tied(n.args[1].name):
            met = self._met_layout(n, env)    # a whole value cut into blocks: in the layout whose
            L_in = None if met is None else geo.swap(met)   # output meets the residual as it is
        x, lay = self._as_act(n, val, L_in)
        L = lay.L
        w_name = self._pname(n, n.args[1])
        b_node = n.args[2] if len(n.args) > 2 else None
        out_f, in_f = self._gshape(n.args[1])
        m = math.prod(self._gshape(n.args[0])[:-1])
        if self._tied(w_name):
            if b_node is not None:
                self._fail(n, "a classifier tied to an embedding table must have no bias")
            return self._tied_head(n, x, lay, w_name, m, out_f, in_f)
        tp = geo.table_parts()
        self._div(n, "in features", in_f, geo.q)
        self._div(n, "out features", out_f, geo.q * geo.q if geo.mode == "3d" else geo.q)
        if b_node is not None:
            self._div(n, "bias length", out_f, tp)
        self._div(n, "tokens", m, geo.tok_parts)
        perm = self._qkv_order(n, out_f)
        if perm is not None:
            self.grouped.add(n.name)
        q = geo.q
        w_shape = (in_f // q, out_f // (q * q) if geo.mode == "3d" else out_f // q)
        w = self._param(w_name, ParamUse("weight", L, perm), w_shape)
        b = None
        if b_node is not None:
            b = self._param(self._pname(n, b_node), ParamUse("bias", L, perm), (out_f // geo.table_parts(),))
        return self._grid_linear(x, lay, w, b, m, in_f, out_f, n)

    def _grid_linear(self, x, lay, w, b, m, k, nf, n):
        geo, q, L = self.geo, self.geo.q, lay.L
        bias = b is not None
        # SUMMA (2D; 2.5D per plane): q GEMMs [my tokens, k/q] x [k/q, n/q], one per step; 3D:
        # one GEMM of the gathered blocks [m/q, k/q] x [k/q, n/q] (runtime/summa.py, matmul3d.py)
        if geo.mode == "3d":
            self.gemms[n.name] = (1, m // (geo.batch_parts * q), k // q, nf // q)
        else:
            self.gemms[n.name] = (q, m // geo.tok_parts, k // q, nf // q)
        if geo.mode == "2d":
            self.colls += tc.linear_2d(m // geo.batch_parts, k, nf, q, bias=bias)
        elif geo.mode == "2.5d":
            self.colls += tc.linear_2p5d(m // geo.batch_parts, k, nf, q, geo.d, bias=bias)
        else:
            self.colls += tc.linear_3d(m // geo.batch_parts, k, nf, q, bias=bias, axes=L)
        if geo.mode != "3d" and not x.requires_grad:
            # an input without gradient (a model input, patches): SUMMA's backward skips dA (its
            # column broadcasts of W and row reduces of the partial dA); the 3D matmul computes
            # dX regardless
            a_blk, w_blk = x.numel() * 4, w.numel() * 4
            for drop in (tc.Collective("broadcast", "col", geo.q, w_blk, geo.q, "backward"),
                         tc.Collective("reduce", "row", geo.q, a_blk, geo.q, "backward")):
                self.colls.remove(drop)
        L2 = geo.swap(L)
        out_lay = Lay("act", L2, 0, x.dim() - 1)
        if self.meta:
            shape = list(x.shape[:-1])
            if geo.mode == "3d":   # tokens re-split: my rows of Y are those of layout swap(L)
                self._save(self._fresh((m // geo.batch_parts // q, k // q)), self._fresh((k // q, nf // q)))
            else:
                self._save(x.reshape(-1, x.shape[-1]))
            y = self._fresh(shape + [nf // q])
            if bias:
                y = y + self._fresh((nf // q,))
            return y, out_lay
        mod = self._mod()
        if geo.mode == "3d":
            return mod.linear(x, w, b, self.grid, L), out_lay
        return mod.linear(x, w, b, self.grid), out_lay

    def _met_layout(self, n, env, depth: int = 4):
        """3D: the layout of a split activation that node ``n``'s output meets downstream (within
        ``depth`` ops: a residual add after a bias, a dropout), or None."""
        frontier, seen = [n], {n}
        for _ in range(depth):
            nxt = []
            for m in frontier:
                for u in m.users:
                    for a in u.all_input_nodes:
                        v = env.get(a.name) if a not in seen else None
                        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], Lay) and v[1].kind == "act":
                            return v[1].L
                    if u not in seen:
                        seen.add(u)
                        nxt.append(u)
            frontier = nxt
        return None

    def _tied(self, name):
        return any(u.target is aten.embedding.default and u.args[0].name == name
                   for u in self.g.gm.graph.find_nodes(op="placeholder", target=name)[0].users)

    def _tied_head(self, n, x, lay, w_name, m, V, h):
        """logits = x @ table^T with the table stored as for the embedding: its hidden block
        gathered (as the embedding does), a local GEMM giving partial logits over the hidden
        group, reduce-scattered there so the classes end split like an activation's hidden."""
        geo, L = self.geo, lay.L
        if L != geo.L0:
            self._fail(n, "a tied classifier's input must have the embedding's layout")
        table = self._param(w_name, ParamUse("table", L), (V, h // geo.table_parts()))
        hg = geo.hid_group(L)
        rows = m // geo.tok_parts
        self.gemms[n.name] = (1, rows, h // geo.q, V)     # x [rows, h/q] @ gathered table^T [h/q, V]
        self.colls += tc.embedding(geo.mode, V, h, geo.q, geo.d, axes=L if geo.mode == "3d" else ("x", "y", "z"))
        self.colls += [tc.Collective("reduce_scatter", hg, geo.q, rows * V * 4, 1, "forward"),
                       tc.Collective("all_gather", hg, geo.q, rows * V * 4, 1, "backward")]
        out_lay = Lay("act", L, 0, x.dim() - 1)
        if self.meta:
            part = x.reshape(-1, x.shape[-1]) @ self._fresh((V, h // geo.q)).t()
            return self._fresh(list(x.shape[:-1]) + [V // geo.q]), out_lay
        if geo.mode == "3d":
            am, ak, an = L
            blk = C.all_gather(C.all_gather(table, 1, self.grid.group(an), an), 1, self.grid.group(am), am)
        else:
            tb = table if geo.mode == "2d" else C.copy(table, self.grid.depth_group, "depth")
            blk = C.all_gather(tb, 1, self.grid.col_group, "col")
        part = x.reshape(-1, x.shape[-1]) @ blk.t()
        group = self.grid.group(hg)
        y = C.reduce_scatter(part, 1, group, hg)
        return y.reshape(*x.shape[:-1], V // geo.q), out_lay

    def _conv(self, n, env):
        """A patch embedding (stride = kernel, no padding) as a grid linear on unfolded patches."""
        geo = self.geo
        img_val = self._val(env, n.args[0])
        w_name = self._pname(n, n.args[1])
        b_node = n.args[2] if len(n.args) > 2 else None
        out_c, c_in, kh, kw = self._gshape(n.args[1])
        stride = list(n.args[3]) if len(n.args) > 3 else [1, 1]
        pad = list(n.args[4]) if len(n.args) > 4 else [0, 0]
        if img_val[1].kind != "in" or stride != [kh, kw] or any(pad) \
                or (len(n.args) > 5 and list(n.args[5]) != [1, 1]) \
                or (len(n.args) > 6 and n.args[6] != 1):
            self._fail(n, "only a patch embedding (a model input, stride = kernel, no padding) runs on the grid")
        B, oc, ph, pw = self._gshape(n)
        L = geo.swap(geo.L0)                 # so the patch tokens come out in layout L0
        imgs = self._tokens(img_val, L)
        k = c_in * kh * kw
        if self.meta:
            val = (torch.empty((imgs.shape[0], ph * pw, k // geo.q), device="meta"), Lay("act", L, 0, 2))
        else:
            patches = F.unfold(imgs, (kh, kw), stride=(kh, kw)).transpose(1, 2)
            idx, q = geo.hid_block(L, self.coords)
            val = (torch.chunk(patches, q, dim=-1)[idx].contiguous(), Lay("act", L, 0, 2))
        x, lay = val
        q = geo.q
        w = self._param(w_name, ParamUse("conv", L), (k // q, out_c // (q * q) if geo.mode == "3d" else out_c // q))
        b = None if b_node is None else self._param(self._pname(n, b_node), ParamUse("bias", L),
                                                    (out_c // geo.table_parts(),))
        y, ylay = self._grid_linear(x, lay, w, b, B * ph * pw, k, out_c, n)
        y = y.reshape(y.shape[0], ph, pw, y.shape[-1]).permute(0, 3, 1, 2)
        return y, Lay("act", ylay.L, 0, 1)

    def _layer_norm(self, n, env):
        h = self._gshape(n.args[0])[-1]
        if list(n.args[1]) != [h]:
            self._fail(n, "LayerNorm over more than the last dim")
        eps = n.args[4] if len(n.args) > 4 else 1e-5
        return self._split_layer_norm(n, env, n.args[0], n.args[2], n.args[3], eps)

    def _fused_layer_norm(self, n, env):
        """The fused ``autopar.layer_norm(x, w, b, eps)`` (autopar/frontend/fuse.py): the split
        LayerNorm as ATen's (the kernel needs whole rows)."""
        return self._split_layer_norm(n, env, n.args[0], n.args[1], n.args[2], n.args[3])

    def _split_layer_norm(self, n, env, x_node, w_node, b_node, eps):
        geo = self.geo
        x, lay = self._as_act(n, self._val(env, x_node))
        h = self._gshape(x_node)[-1]
        self._div(n, "LayerNorm size", h, geo.table_parts())
        L = lay.L
        vec = (h // geo.table_parts(),)
        g = self._param(self._pname(n, w_node), ParamUse("norm", L), vec)
        b = self._param(self._pname(n, b_node), ParamUse("norm", L), vec)
        m = math.prod(self._gshape(x_node)[:-1])
        if geo.mode == "2d":
            self.colls += tc.layer_norm_2d(m // geo.batch_parts, h, geo.q)
        elif geo.mode == "2.5d":
            self.colls += tc.layer_norm_2p5d(m // geo.batch_parts, h, geo.q, geo.d)
        else:
            self.colls += tc.layer_norm_3d(m // geo.batch_parts, h, geo.q, axes=L)
        if self.meta:
            x_hat = self._fresh(x.shape)
            self._save(x_hat, self._fresh(list(x.shape[:-1]) + [1]))
            return x_hat * self._fresh((h // geo.q,)) + self._fresh((h // geo.q,)), lay
        mod = self._mod()
        if geo.mode == "3d":
            return mod.layer_norm(x, g, b, self.grid, L, eps), lay
        return mod.layer_norm(x, g, b, self.grid, eps), lay

    def _fused_rms_norm(self, n, env):
        """The fused ``autopar.rms_norm(x, w, eps) -> y`` (autopar/frontend/fuse.py) on an
        activation split over hidden: the split norm, as the decomposed RMSNorm runs on the grid
        (the kernel needs whole rows): the local sum of squares all-reduced over the hidden group
        (forward and backward, as ``_hidden_reduce``), then x * rstd * my block of the weight (a
        "loose" parameter split over hidden like x, as the decomposed norm's)."""
        geo = self.geo
        x, lay = self._val(env, n.args[0])
        if lay.kind != "act" or lay.hdim is None or lay.hdim != x.dim() - 1:
            self._fail(n, "an RMSNorm whose input is not an activation split over its last (hidden) dim")
        w, _ = self._loose(n, self._pname(n, n.args[1]), lay, x.dim())
        eps = n.args[2]
        h = self._gshape(n.args[0])[-1]
        out_dtype = torch.promote_types(x.dtype, w.dtype)
        xf = x.float()
        ss = (xf * xf).sum(dim=-1, keepdim=True) / h
        label = geo.hid_group(lay.L)
        nbytes = ss.numel() * 4
        self.colls += [tc.Collective("all_reduce", label, geo.q, nbytes, 1, "forward"),
                       tc.Collective("all_reduce", label, geo.q, nbytes, 1, "backward")]
        if self.meta:
            ss = self._fresh(ss.shape, ss.dtype)
        else:
            group = self.grid.group(label)
            ss = C.copy(C.all_reduce(ss, group, label), group, label)
        return (xf * torch.rsqrt(ss + eps) * w.float()).to(out_dtype), lay

    def _hidden_reduce(self, n, env):
        """A sum / mean over the hidden dim of a split activation (an RMSNorm's mean square):
        the local sum all-reduced over the hidden group. Its consumers broadcast it against hidden
        blocks, so its gradient is partial there: the backward all-reduces it too (Lay "red")."""
        geo = self.geo
        x, lay = self._val(env, n.args[0])
        dims = n.args[1] if len(n.args) > 1 else None
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        if lay.kind != "act" or lay.hdim is None or dims is None or n.kwargs.get("dtype") is not None:
            self._fail(n, "a reduction that is not over the hidden dim of a split activation")
        dims = sorted({d % x.dim() for d in dims})
        if dims != [lay.hdim]:
            self._fail(n, "a reduction over other dims than the hidden one")
        h = self._gshape(n.args[0])[lay.hdim]
        label = geo.hid_group(lay.L)
        out = x.sum(dim=lay.hdim, keepdim=bool(keep))
        if n.target is aten.mean.dim:
            out = out / h
        nbytes = out.numel() * 4
        self.colls += [tc.Collective("all_reduce", label, geo.q, nbytes, 1, "forward"),
                       tc.Collective("all_reduce", label, geo.q, nbytes, 1, "backward")]
        tdim = lay.tdim if keep or lay.tdim is None or lay.tdim < lay.hdim else lay.tdim - 1
        red = Lay("red", lay.L, tdim, None)
        if self.meta:
            return self._fresh(out.shape, out.dtype), red
        group = self.grid.group(label)
        return C.copy(C.all_reduce(out, group, label), group, label), red

    def _cross_entropy(self, n, env):
        geo = self.geo
        logits, lay = self._as_act(n, self._val(env, n.args[0]))
        tval = self._val(env, n.args[1])
        args = list(n.args) + [None, 1, -100, 0.0][len(n.args) - 2:]
        weight, reduction, ignore, smooth = args[2:6]
        if weight is not None or smooth or reduction != 1 or logits.dim() != 2:
            self._fail(n, "only a mean cross-entropy over [tokens, classes] logits without class weights or "
                          "label smoothing runs on the grid")
        if tval[1].kind == "rep" and tval[1].tdim == 0 and not tval[1].share and geo.batch_parts == 1 \
                and not tval[0].requires_grad:
            # targets computed from an input by ops run whole on every rank (a causal LM's labels
            # shifted by pad + slice): every rank holds them all; my token block of them
            full_t = target = tval[0]
            for label, size in self._tok_chain(lay.L):      # outer first, as tok_block numbers them
                target = torch.chunk(target, size, dim=0)[0 if self.meta else self.coords[label]]
        elif tval[1].kind != "in":
            self._fail(n, "targets must come from a model input (or from one, computed whole on every rank)")
        else:
            full_t = tval[0]
            target = self._tokens(tval, lay.L)
        m = self._gshape(n.args[0])[0]
        self.colls += tc.cross_entropy(geo.mode, m // geo.batch_parts, geo.q, geo.d,
                                       axes=geo.swap(lay.L) if geo.mode == "3d" else ("x", "y", "z"))
        denom = m if self.meta else int((full_t != ignore).sum())
        if self.meta:
            rows, c = logits.shape
            self._save(self._fresh((rows, c)), torch.empty(rows, dtype=torch.int64, device="meta"),
                       torch.empty(rows, dtype=torch.bool, device="meta"))
            return (self._fresh((rows,)) * (target != ignore).to(torch.float32)).sum() / denom, Lay("loss", lay.L)
        hg = geo.hid_group(lay.L)
        blk, _ = geo.hid_block(lay.L, self.coords)
        tok = split_cross_entropy(logits, target, blk, self.grid.group(hg), hg)
        tok = tok * (target != ignore).to(tok.dtype)
        return tok.sum() / denom, Lay("loss", lay.L)
