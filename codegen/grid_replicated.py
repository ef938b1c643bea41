"""The replicated fallback of the grid program (codegen/grid_ops.py): an op no grid rule covers
runs whole on every rank of the grid, on this rank's rows of the batch (its micro-batch and dp
replica), and the values around it are converted at its borders.

Layout ``Lay("rep", tdim=d)``: whole over the grid; dim ``d`` (the batch dim, None for a
batch-free value such as a rotary table) holds this rank's ``batch_parts`` share of the rows.
Gradient convention: every rank holds the complete gradient of a rep value (as every rank holds
the exact gradient of its block of an ``act`` value), so the conversions are conjugate pairs:

    act  -> rep   all-gather over the hidden group, then the token groups (inner, outer);
                  backward: this rank's block of the gradient (no communication)
    hid  -> rep   all-gather over the hidden group; backward: the block, kept on the first rank
                  of the token groups only (a hid value's gradient is partial over them)
    red  -> rep   all-gather over the token groups; backward: this rank's rows, kept on the first
                  rank of the hidden group only (a red value's gradient is partial there)
    in   -> rep   this rank's rows (no gradient)
    loss -> rep   the token groups' shares summed (all-reduce): a loss share replicated over
                  the grid; backward: identity
    rep  -> act   this rank's block (no communication); backward: all-gather of the gradient
                  blocks over the hidden group and the token groups

A parameter a replicated op reads is held whole on every rank (``ParamUse("whole")``): its
gradient is then complete on every rank, like a rep value's.

Reductions over the batch dim (with several micro-batches or dp replicas a rank holds a share of
the rows) give a *share* of the global value (``Lay("rep", share=True)``): sums as they are,
means scaled by 1/batch_parts, a mean cross-entropy divided by the global count of targets.
Shares add up over the micro-batches and replicas (the step sums the losses and the gradients),
so only sums and scalings of shares are allowed after them.
"""
from __future__ import annotations

import torch

from codegen.grid_local import GridLoweringError, Lay, ParamUse
from solver import tp_grid_cost as tc
from runtime import collectives as C
from runtime.grid import grad_on_first

aten = torch.ops.aten

# reductions that may reduce over the batch dim: their value over a share of the rows, times this
# factor (of batch_parts), is a share of the whole batch's
_SUMS = {aten.sum.default: False, aten.sum.dim_IntList: False, aten.mean.default: True, aten.mean.dim: True}
_LOSSES = {aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
           aten.binary_cross_entropy_with_logits.default}
_CROSS_ENTROPY = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default}
# what may follow a share: sums of shares, scalings by constants
_SHARE_OPS = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
              aten.clone.default, aten.alias.default, aten.view.default, aten.reshape.default,
              aten.squeeze.default, aten.unsqueeze.default, aten.squeeze.dim}


# random ops: each rank would draw its own values for what must be one whole value
_RANDOM = {aten.dropout.default, aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p,
           aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.rand.default,
           aten.randn.default, aten.randperm.default, aten.multinomial.default}


class ReplicatedOps:
    """Mixin of GridProgram: the replicated fallback and the conversions at its borders."""

    # ------------------------------------------------------------------ token / hidden groups
    def _tok_chain(self, L) -> list[tuple[str, int]]:
        """(label, size) of the groups splitting the tokens of layout L, outer first (the token
        block index is outer * inner_size + inner; codegen/grid_layout.py tok_block)."""
        geo = self.geo
        if geo.mode == "3d":
            return [(L[0], geo.q), (L[2], geo.q)]
        if geo.mode == "2.5d":
            return [("depth", geo.d), ("col", geo.q)]
        return [("col", geo.q)]

    def _coll(self, kind, label, size, nbytes, phase):
        if size > 1:
            self.colls.append(tc.Collective(kind, label, size, int(nbytes), 1, phase))

    # ------------------------------------------------------------------ conversions
    def _rows(self, t, dim):
        """This rank's rows (micro-batch, dp replica) of a whole-batch input along ``dim``."""
        geo = self.geo
        parts = geo.batch_parts
        if parts == 1:
            return t
        idx = 0 if self.meta else self.coords.get("mb", 0) * geo.dp + self.coords.get("dp", 0)
        return torch.chunk(t, parts, dim=dim)[idx]

    def _to_rep(self, n, val, name=None):
        """A value (or a parameter) as a rep tensor; returns (tensor, Lay)."""
        geo = self.geo
        if isinstance(val, tuple) and len(val) == 2 and val[0] == "param":
            pname = val[1]
            gshape = tuple(self.g.gm.graph.find_nodes(op="placeholder", target=pname)[0].meta["val"].shape)
            return self._param(pname, ParamUse("whole", None), gshape), Lay("rep")
        t, lay = val
        if not isinstance(t, torch.Tensor):
            raise GridLoweringError(f"{geo.mode} tensor parallelism cannot run node {n.name} ({n.target}) replicated: "
                                    f"an argument holds {type(t).__name__}")
        if lay.kind in ("rep", "full"):
            return t, (lay if lay.kind == "rep" else Lay("rep"))
        if lay.kind == "in":
            return (self._rows(t, lay.tdim) if lay.tdim is not None else t), Lay("rep", tdim=lay.tdim)
        if lay.kind == "loss":
            chain = self._tok_chain(lay.L if lay.L is not None else geo.L0)
            for label, size in chain:
                self._coll("all_reduce", label, size, t.numel() * 4, "forward")
                if not self.meta and size > 1:
                    t = C.all_reduce(t, self.grid.group(label), label)
            return t, Lay("rep", share=True)
        if lay.kind == "hid":
            return self._gather_hidden(t, lay, first_keeps_grad=True), Lay("rep")
        if lay.kind == "red":    # whole over the hidden group, its gradient partial there
            if not self.meta and t.requires_grad:
                t = grad_on_first(t, self.coords[geo.hid_group(lay.L)] == 0)
            lay = Lay("act", lay.L, lay.tdim, None)
        if lay.kind == "act":
            t = self._gather_hidden(t, lay)
            for label, size in reversed(self._tok_chain(lay.L)):     # inner first
                if lay.tdim is None:
                    break
                self._coll("all_gather", label, size, t.numel() * t.element_size() * size, "forward")
                t = self._gather(t, lay.tdim, label, size)
            return t, Lay("rep", tdim=lay.tdim)
        raise GridLoweringError(f"{geo.mode} tensor parallelism cannot run node {n.name} ({n.target}) replicated: "
                                f"an argument is laid out as {lay.kind}")

    def _gather_hidden(self, t, lay, first_keeps_grad=False):
        geo = self.geo
        if first_keeps_grad and not self.meta and t.requires_grad:
            first = all(self.coords[label] == 0 for label, _ in self._tok_chain(lay.L))
            t = grad_on_first(t, first)
        if lay.hdim is None:
            return t
        label = geo.hid_group(lay.L)
        self._coll("all_gather", label, geo.q, t.numel() * t.element_size() * geo.q, "forward")
        return self._gather(t, lay.hdim, label, geo.q)

    def _gather(self, t, dim, label, size):
        if size == 1:
            return t
        if self.meta:
            shape = list(t.shape)
            shape[dim] *= size
            return torch.empty(shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad)
        return C.all_gather(t.contiguous(), dim, self.grid.group(label), label, partial_grad=False)

    def _rep_to_act(self, n, val, L):
        """This rank's block of a rep value whose dim 0 is the batch and last dim the hidden."""
        geo = self.geo
        t, lay = val
        if lay.share or lay.tdim != 0 or t.dim() < 2:
            raise GridLoweringError(f"{geo.mode} tensor parallelism cannot run node {n.name} ({n.target}) on the grid: "
                                    f"its input is whole on every rank and not [batch, ..., hidden]")
        if t.shape[0] % geo.grid_tok_parts or t.shape[-1] % geo.q:
            raise GridLoweringError(f"{geo.mode} tensor parallelism cannot run node {n.name} ({n.target}) on the grid: "
                                    f"{tuple(t.shape)} does not split into {geo.grid_tok_parts} x {geo.q} blocks")
        for label, size in self._tok_chain(L):      # outer first
            t = self._slice(t, 0, label, size)
        t = self._slice(t, t.dim() - 1, geo.hid_group(L), geo.q)
        return t, Lay("act", L, 0, t.dim() - 1)

    def _slice(self, t, dim, label, size):
        if size == 1:
            return t
        self._coll("all_gather", label, size, t.numel() * t.element_size(), "backward")
        if self.meta:
            return torch.chunk(t, size, dim=dim)[0].contiguous()
        return C.slice_block(t, dim, self.grid.group(label), label)

    # ------------------------------------------------------------------ the replicated op
    def _replicated(self, n, env):
        geo = self.geo
        t = n.target
        vals = [self._val(env, a) for a in n.all_input_nodes]
        shares = [v for v in vals if isinstance(v, tuple) and isinstance(v[1], Lay) and
                  (v[1].share or v[1].kind == "loss")]
        if shares and t not in _SHARE_OPS:
            raise GridLoweringError(
                f"{geo.mode} tensor parallelism cannot run node {n.name} ({t}): it takes a loss reduced over a share "
                f"of the batch (micro-batches x dp replicas) through a non-linear op; pin dp=1 and num_micro_batches=1")
        if t in _RANDOM and not (t is aten.dropout.default and (not n.args[2] or n.args[1] == 0)):
            raise GridLoweringError(
                f"{geo.mode} tensor parallelism cannot run node {n.name} ({t}): a random op run whole on every rank "
                f"would draw a different value on each; set its probability to 0 (dropout p=0) or use tp_mode '1d'")
        if str(t) == "autopar.dropout_add.default":   # the fused active dropout (runtime/kernels/dropout_add.py)
            raise GridLoweringError(
                f"{geo.mode} tensor parallelism cannot run node {n.name} ({t}): a random op run whole on every rank "
                f"would draw a different value on each; set its probability to 0 (dropout p=0) or use tp_mode '1d'")
        batched = False

        def conv(a):
            nonlocal batched
            if isinstance(a, torch.fx.Node):
                r, lay = self._to_rep(n, self._val(env, a))
                batched |= lay.tdim is not None
                rows.append((r, lay))
                return r
            if isinstance(a, (list, tuple)):
                return type(a)(conv(x) for x in a)
            return a

        rows: list = []

        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default):
            x = self._to_rep(n, self._val(env, n.args[0]))
            if t is aten.expand.default:
                return self._expand(n, x)
            return self._view(n, x)
        args = [conv(a) for a in n.args]
        kwargs = {k: conv(v) for k, v in n.kwargs.items()}
        if self._share_rows(batched):
            cut = self._whole_rows(rows)
            if cut:
                def sub(a):
                    if isinstance(a, torch.Tensor) and id(a) in cut:
                        return cut[id(a)]
                    if isinstance(a, (list, tuple)):
                        return type(a)(sub(x) for x in a)
                    return a
                args, kwargs = [sub(a) for a in args], {k: sub(v) for k, v in kwargs.items()}
        if t in _CROSS_ENTROPY and self._share_rows(batched):
            return self._share_cross_entropy(n, env, args, kwargs)
        args, kwargs = self._on_meta(args), self._on_meta(kwargs)
        out = t(*args, **kwargs)
        share = bool(shares)
        if self._share_rows(batched) and self._lost_batch(n, out):
            if t in _SUMS:
                out = out / geo.batch_parts if _SUMS[t] else out
            elif t in _LOSSES and _reduction(n, args, kwargs) in (1, 2):
                out = out / geo.batch_parts if _reduction(n, args, kwargs) == 1 else out
            else:
                raise GridLoweringError(
                    f"{geo.mode} tensor parallelism cannot run node {n.name} ({t}): it reduces over the batch, which "
                    f"is split into {geo.batch_parts} shares (micro-batches x dp replicas); pin dp=1 and "
                    f"num_micro_batches=1")
            share = True
        if self.meta:
            self.local_shapes[n.name] = ([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)],
                                         [tuple(o.shape) for o in (out if isinstance(out, (tuple, list)) else (out,))
                                          if isinstance(o, torch.Tensor)])
        if isinstance(out, (tuple, list)):
            return out, Lay("rep", tdim=None, share=share)
        like = next((lay.tdim for r, lay in rows if lay.tdim is not None and isinstance(r, torch.Tensor)
                     and isinstance(out, torch.Tensor) and tuple(r.shape) == tuple(out.shape)), None)
        return out, self._rep_lay(n, out, batched, share, like)

    def _whole_rows(self, vals) -> dict:
        """With the batch split into shares (micro-batches x dp replicas), a whole value (a
        constant built in the model: a position table expanded over the batch, a mask) that
        holds every row of the batch, met by values holding this rank's rows: this rank's rows of
        it. Its rows are the dim aligned (broadcasting, from the right) with a batch-carrying
        argument's batch dim whose size is batch_parts times that argument's rows.
        Returns id(tensor) -> its rows."""
        parts = self.geo.batch_parts
        batched = [(t, lay) for t, lay in vals if lay.tdim is not None and isinstance(t, torch.Tensor)]
        out = {}
        for t, lay in vals:
            if lay.tdim is not None or lay.share or not isinstance(t, torch.Tensor) or id(t) in out:
                continue
            for b, blay in batched:
                d = blay.tdim - (b.dim() - t.dim())
                if 0 <= d < t.dim() and t.shape[d] == b.shape[blay.tdim] * parts:
                    out[id(t)] = self._rows(t, d)
                    break
        return out

    def _share_rows(self, batched: bool) -> bool:
        return batched and self.geo.batch_parts > 1

    def _lost_batch(self, n, out) -> bool:
        """The op's output no longer carries the batch's split dim."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)
        for o, v in zip(outs, vals):
            if isinstance(o, torch.Tensor) and hasattr(v, "shape") and tuple(o.shape) != tuple(v.shape):
                return False
        return True

    def _rep_lay(self, n, out, batched, share=False, like=None) -> Lay:
        """The batch dim of a replicated op's output, from its local and global shapes (``like``:
        the batch dim of an argument shaped as the output, an elementwise op's)."""
        geo = self.geo
        v = n.meta.get("val")
        if not isinstance(out, torch.Tensor) or not hasattr(v, "shape"):
            return Lay("rep", share=share)
        g, loc = tuple(v.shape), tuple(out.shape)
        if geo.batch_parts > 1:
            diff = [d for d, (a, b) in enumerate(zip(loc, g)) if a != b]
            if not diff:
                return Lay("rep", share=share)
            if len(diff) != 1 or len(loc) != len(g) or loc[diff[0]] * geo.batch_parts != g[diff[0]]:
                raise GridLoweringError(f"{geo.mode} tensor parallelism cannot run node {n.name} ({n.target}) "
                                        f"replicated: its output {loc} on a share of the batch does not match {g}")
            return Lay("rep", tdim=diff[0], share=share)
        if like is not None:
            return Lay("rep", tdim=like, share=share)
        return Lay("rep", tdim=0 if batched and g and g[0] == self.batch else None, share=share)

    def _share_cross_entropy(self, n, env, args, kwargs):
        """A mean cross-entropy (or NLL) over this rank's rows as its share of the global mean:
        the sum over the rows divided by the global count of counted targets."""
        geo = self.geo
        names = ["input", "target", "weight", "reduction", "ignore_index"] + (
            ["label_smoothing"] if n.target is aten.cross_entropy_loss.default else [])
        full = dict(zip(names, args))
        full.update({("input" if k == "self" else k): v for k, v in kwargs.items()})
        red = full.get("reduction", 1)
        if full.get("weight") is not None and red == 1:
            raise GridLoweringError(f"{geo.mode} tensor parallelism cannot run node {n.name} ({n.target}): a class-"
                                    f"weighted mean over a batch split into {geo.batch_parts} shares")
        target, ignore = full["target"], full.get("ignore_index", -100)
        full["reduction"] = 2 if red == 1 else red
        out = n.target(full["input"], full["target"], **{k: full[k] for k in names[2:] if k in full})
        if red != 1:
            return out, Lay("rep", share=red == 2)
        tval = self._val(env, n.args[1])
        if self.meta:
            denom = max(1, target.numel() * geo.batch_parts)
        elif tval[1].kind == "in":        # the whole batch's targets are on every rank
            denom = int((tval[0] != ignore).sum())
        elif geo.nm > 1:
            raise GridLoweringError(f"{geo.mode} tensor parallelism cannot run node {n.name} ({n.target}) over "
                                    f"{geo.nm} micro-batches: its targets are computed in the model, so the step's "
                                    f"count of targets is not known up front; pin num_micro_batches=1")
        else:
            import torch.distributed as dist
            c = (target != ignore).sum().reshape(1).to(torch.float64)
            dist.all_reduce(c, group=self.grid.dp_group)    # uncounted: 8 bytes, the loss's denominator
            denom = int(c[0])
        return out / max(denom, 1), Lay("rep", share=True)


def _reduction(n, args, kwargs):
    """The reduction argument of a loss op (0 none, 1 mean, 2 sum)."""
    schema = n.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == "reduction":
            if a.name in kwargs:
                return kwargs[a.name]
            return args[i] if i < len(args) else a.default_value
    return None
