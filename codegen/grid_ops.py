"""The per-rank program of a 2D / 2.5D / 3D tensor-parallel plan: the traced ATen graph run node
by node with every activation split over the grid (codegen/grid_layout.py) and the grid ops of
runtime/summa.py, tesseract.py, matmul3d.py, split_norm.py, split_loss.py in place of linear,
layer_norm, embedding and cross_entropy.

One interpreter, two uses:
  * ``meta=True`` (planning, no process group): local shapes on meta tensors; every grid op
    appends the exact collectives solver/tp_grid_cost.py gives for it, and what it saves for
    backward (its own saved list, plus what the local torch ops around it save, counted by
    saved_tensors_hooks on meta storages). The parameters' block specs are decided here, at
    first use: linear weights [in, out] 2D/3D-split (QKV columns in runtime/split_attention's
    head-grouped order when the output is split into Q, K, V heads), biases and LayerNorm
    vectors 1/q^2 or 1/q^3, embedding tables split over hidden, other parameters ("loose": a
    class token, a position table added to the activations) split over hidden like the
    activation they meet, their gradient summed over the token groups.
  * ``meta=False`` (a rank): real tensors, real grid ops, COMM_STATS counts the bytes.

What each op becomes:
    embedding(table, ids)      runtime *.embedding (ids = my tokens; or whole positions: a
                               hidden-split value broadcast over tokens)
    linear(x, W, b)            SUMMA / Tesseract / 3D matmul (+ gathered bias); W tied to an
                               embedding table: logits = x @ table_blk^T, reduce-scattered over
                               the hidden group so classes end split like an activation's hidden
    conv2d (stride = kernel)   patches (unfold) -> the same grid linear (ViT's patch embedding)
    layer_norm                 split LayerNorm, statistics over the hidden group
    cross_entropy (mean)       split cross-entropy on split logits; each rank returns its share
                               sum(my tokens' losses) / #targets (replicated over the q ranks
                               that split the classes: the step divides the world sum by q)
    sdpa, gelu, add, dropout(p=0), views, split, cat, select, expand
                               local (whole sequences and whole heads per rank)
Unsupported ops or layouts raise GridLoweringError naming the node.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from codegen.grid_layout import Geometry
from codegen.grid_local import NO_OUTPUT, VIEWS, GridLoweringError, Lay, LocalOps, ParamUse  # noqa: F401
from codegen.grid_replicated import ReplicatedOps
from solver import tp_grid_cost as tc

aten = torch.ops.aten


_NEW_TENSOR = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default}


class _ParamConflict(Exception):
    """A parameter a replicated op reads whole was given a split use earlier: analyse again with
    it whole from the start."""

    def __init__(self, name):
        super().__init__(name)
        self.name = name


class GridProgram(LocalOps, ReplicatedOps):
    """``graph``: autopar.frontend.trace.TracedGraph; ``geo``: the grid; ``grid``: runtime/grid.py grid
    (None with ``meta``)."""

    def __init__(self, graph, geo: Geometry, batch: int):
        self.g, self.geo, self.batch = graph, geo, batch
        self.uses: dict[str, ParamUse] = {}
        self.colls: list[tc.Collective] = []
        self.saved = 0
        self.grouped: set[str] = set()     # linear outputs whose columns are in QKV head-group order
        self.kinds: dict[str, str] = {}     # node -> what it runs as (the plan's per-op strategy)
        self.loss_lay = Lay("loss", geo.L0)   # the output's: a split cross-entropy's share, or a rep scalar
        self.replicated: set[str] = set()  # nodes run whole on every rank (codegen/grid_replicated.py)
        self.why: dict[str, str] = {}      # ... and why the grid could not run them
        self.force_whole: set[str] = set()   # parameters held whole (a replicated op reads them)
        # what each rank's kernels compute (planning, for the GEMM efficiency curve): grid op ->
        # (forward GEMM kernels, rows, inner, cols) of one kernel; local op -> the local shapes
        # of its tensor arguments and of its output
        self.gemms: dict[str, tuple[int, int, int, int]] = {}
        self.local_shapes: dict[str, tuple[list, list]] = {}

    # ------------------------------------------------------------------ planning
    def analyse(self) -> "GridProgram":
        """Run on meta: decides parameter layouts, collects collectives and saved bytes (of one
        micro-batch: a step runs the program ``geo.nm`` times)."""
        geo = self.geo
        if self.batch % geo.tok_parts:
            raise GridLoweringError(
                f"{geo.mode} tensor parallelism cannot split the batch of {self.batch} rows into {geo.tok_parts} "
                f"blocks of whole sequences ({geo.nm} micro-batch(es) x dp={geo.dp} x {geo.grid_tok_parts} token "
                f"blocks of the grid): choose a batch divisible by {geo.tok_parts}")
        self.meta, self.grid, self.coords = True, None, None
        self.replicated, self.why, self.force_whole = set(), {}, set()
        while True:
            try:
                return self._analyse_once()
            except _ParamConflict as e:   # bounded: each round holds one more parameter whole
                self.force_whole.add(e.name)
                self.replicated, self.why = set(), {}

    def _analyse_once(self) -> "GridProgram":
        self.uses, self.colls, self.saved = {}, [], 0
        self.gemms, self.local_shapes, self.kinds, self.grouped = {}, {}, {}, set()
        self._keep = []
        seen: dict[int, object] = {}
        self._seen = seen

        def pack(t):
            st = t.untyped_storage()
            if id(st) not in seen and id(st) not in self._param_storages:
                seen[id(st)] = st
            return t

        self._param_storages = set()
        params = {}
        for n in self.g.gm.graph.nodes:
            if n.op == "placeholder" and n.name in self.g.param_fqn:
                params[n.name] = n   # shapes decided at first use
        self._meta_params = params
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self._run({})
        self.saved = sum(st.nbytes() for st in seen.values())
        self.saved_detail = [(st.nbytes(),) for st in seen.values()]
        return self

    def loss_partial_labels(self) -> list[str]:
        """The groups (COMM_STATS labels) whose ranks hold different shares of the loss, whose sum
        is the step's loss: the dp replicas, and the token groups of a split cross-entropy (its
        share is replicated over the class split); a loss computed whole only the dp replicas."""
        lay = self.loss_lay
        toks = [label for label, _ in self._tok_chain(lay.L)] if lay.kind == "loss" else []
        return ["dp"] + toks

    def bytes_per_group(self) -> dict[str, int]:
        """Per rank, one forward + backward: bytes per COMM_STATS label."""
        return tc.bytes_per_group(self.colls)

    # ------------------------------------------------------------------ execution
    def bind(self, grid, coords: dict, local_params: dict, device=None):
        """Run on a rank: ``grid`` (runtime/grid.py), this rank's coordinates, its parameter
        blocks by name, its device (factory ops' device arguments are rewritten to it)."""
        self.meta, self.grid, self.coords = False, grid, coords
        self.local, self.device = local_params, device
        return self

    def forward(self, inputs: dict) -> torch.Tensor:
        """This rank's loss share (a scalar with autograd)."""
        self.colls = []
        return self._run(inputs)

    # ------------------------------------------------------------------ interpreter
    def _run(self, inputs: dict):
        env: dict[str, tuple] = {}
        from autopar.frontend.batching import graph_batch_dims
        bdims = dict(zip(self.g.input_names, graph_batch_dims(self.g)))
        for n in self.g.gm.graph.nodes:
            if n.op == "placeholder":
                if n.name in self.g.param_fqn:
                    env[n.name] = ("param", n.name)
                else:
                    v = n.meta["val"]
                    t = torch.empty(v.shape, dtype=v.dtype, device="meta") if self.meta else inputs[n.name]
                    bd = bdims.get(n.name)
                    env[n.name] = (t, Lay("in", tdim=bd) if bd is not None else Lay("full"))
            elif n.op == "call_function":
                env[n.name] = self._lower(n, env)
            elif n.op == "output":
                out = n.args[0]
                out = out[0] if isinstance(out, (tuple, list)) else out
                t, lay = env[out.name]
                if lay.kind == "loss" or (lay.kind == "rep" and t.dim() == 0
                                          and (lay.share or self.geo.batch_parts == 1)):
                    self.loss_lay = lay
                else:
                    raise GridLoweringError(f"the grid program's output {out.name} is not a loss (a scalar reduced "
                                            f"over the batch)")
                return t
        raise GridLoweringError("graph has no output")

    def _lower(self, n, env):
        """Node ``n`` on the grid, or replicated when the grid cannot run it: decided while
        analysing (on meta; whatever the attempt recorded is rolled back), followed on a rank."""
        if n.name not in self.replicated:
            mark = self._mark()
            try:
                out = self._op(n, env)
                self.kinds[n.name] = self._kind(n)
                return out
            except _ParamConflict:
                raise
            except Exception as e:   # an op or layout no grid rule covers, a shape that does not divide
                if not self.meta:
                    raise GridLoweringError(f"{self.geo.mode} tensor parallelism cannot run node {n.name} "
                                            f"({n.target}): {e}") from e
                self._rollback(mark)
                self.replicated.add(n.name)
                self.why[n.name] = str(e)
        try:
            out = self._replicated(n, env)
        except (GridLoweringError, _ParamConflict):
            raise
        except Exception as e:
            raise GridLoweringError(f"{self.geo.mode} tensor parallelism cannot run node {n.name} ({n.target}), "
                                    f"not even whole on every rank: {e}") from e
        self.kinds[n.name] = "replicated"
        return out

    def _mark(self):
        return (len(self.colls), len(self.uses), len(self._seen) if self.meta else 0, len(self._keep),
                set(self.grouped))

    def _rollback(self, mark):
        colls, uses, seen, keep, grouped = mark
        del self.colls[colls:]
        for k in list(self.uses)[uses:]:
            del self.uses[k]
        for k in list(self._seen)[seen:]:
            del self._seen[k]
        del self._keep[keep:]
        self.grouped = grouped

    # ---- helpers
    def _fail(self, n, why):
        raise GridLoweringError(f"{self.geo.mode} tensor parallelism cannot run node {n.name} ({n.target}): {why}")

    def _val(self, env, a):
        return env[a.name] if isinstance(a, torch.fx.Node) else a

    def _gshape(self, n):
        return tuple(n.meta["val"].shape)

    def _lshape(self, gshape, lay: Lay):
        s = list(gshape)
        if lay.kind in ("act", "red") and lay.tdim is not None:
            s[lay.tdim] //= self.geo.tok_parts
        if lay.kind in ("act", "hid") and lay.hdim is not None:
            s[lay.hdim] //= self.geo.q
        if lay.kind == "rep" and lay.tdim is not None:
            s[lay.tdim] //= self.geo.batch_parts
        return s

    def _fresh(self, shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)

    def _save(self, *ts):
        for t in ts:
            st = t.untyped_storage()
            self._seen.setdefault(id(st), st)

    def _tokens(self, val, L):
        """A user input (batch-carrying, full on every rank) cut to my token block of layout L."""
        t, lay = val
        if lay.kind != "in":
            return t
        # a view of the input's storage, as on a rank (what embedding saves is that storage)
        idx, parts = (0, self.geo.tok_parts) if self.meta else self.geo.tok_block(L, self.coords)
        return torch.chunk(t, parts, dim=lay.tdim)[idx].contiguous()

    def _param(self, name, use: ParamUse, stored_shape):
        """My block of parameter ``name`` for ``use`` (recorded; one use per parameter, except a
        table shared with a tied classifier)."""
        old = self.uses.get(name)
        if use.kind == "whole" and self.meta and old is not None and old.kind != "whole":
            raise _ParamConflict(name)
        if use.kind != "whole" and name in self.force_whole:
            raise GridLoweringError(f"parameter {self.g.param_fqn[name]} is held whole (an op runs replicated on it)")
        if old is not None and (old.kind, old.L, old.perm) != (use.kind, use.L, use.perm):
            raise GridLoweringError(f"parameter {self.g.param_fqn[name]} is used as {old.kind} and as {use.kind}")
        self.uses[name] = use
        if self.meta:
            dtype = self._meta_params[name].meta["val"].dtype   # an int64 buffer (position ids) stays int64
            t = torch.empty(stored_shape, dtype=dtype, device="meta",
                            requires_grad=name not in self.g.buffers and dtype.is_floating_point)
            self._param_storages.add(id(t.untyped_storage()))
            self._keep = getattr(self, "_keep", []) + [t]
            return t
        return self.local[name]

    def _div(self, n, what, size, parts):
        if size % parts:
            self._fail(n, f"{what} = {size} does not split evenly into {parts} blocks over the "
                          f"{self.geo.mode} grid (q={self.geo.q}); choose a size divisible by {parts}")

    def _pname(self, n, a):
        if not (isinstance(a, torch.fx.Node) and a.op == "placeholder" and a.name in self.g.param_fqn):
            self._fail(n, f"argument {a} must be a parameter")
        return a.name

    def _kind(self, n) -> str:
        algo = {"2d": "SUMMA", "2.5d": "Tesseract", "3d": "3D"}[self.geo.mode]
        t = n.target
        if t is aten.linear.default:
            return "tied classifier" if self._tied(n.args[1].name) else f"{algo} linear"
        return {aten.conv2d.default: f"{algo} patch linear", aten.layer_norm.default: "split layer_norm",
                aten.embedding.default: "split embedding",
                aten.cross_entropy_loss.default: "split cross_entropy"}.get(t, "local")

    # ---- dispatch
    def _op(self, n, env):
        t = n.target
        if t is aten.embedding.default:
            return self._embedding(n, env)
        if t is aten.linear.default:
            return self._linear(n, env)
        if t is aten.conv2d.default:
            return self._conv(n, env)
        if t in (aten.mean.dim, aten.sum.dim_IntList):
            return self._hidden_reduce(n, env)
        if t is aten.layer_norm.default:
            return self._layer_norm(n, env)
        if t is aten.cross_entropy_loss.default:
            return self._cross_entropy(n, env)
        if t in NO_OUTPUT:
            return None, Lay("full")
        if t is operator.getitem:
            (vals, lay), i = self._val(env, n.args[0]), n.args[1]
            if lay.kind == "rep" and isinstance(vals[i], torch.Tensor):
                return vals[i], self._rep_lay(n, vals[i], True, lay.share)
            return vals[i], lay
        if t in _NEW_TENSOR:    # a constant shaped by its arguments, not by its input's rows
            x = self._val(env, n.args[0])[0]
            return t(x, *n.args[1:], **self._on_meta(n.kwargs)), Lay("full")
        if t is aten.arange.default or t is aten.arange.start:
            if self.meta:
                return torch.empty(self._gshape(n), dtype=n.meta["val"].dtype, device="meta"), Lay("full")
            return t(*n.args, **self._on_meta(n.kwargs)), Lay("full")
        return self._local(n, env)

    # ------------------------------------------------------------------ grid ops
    def _mod(self):
        from runtime import matmul3d, summa, tesseract
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
        from runtime.split_attention import qkv_column_order
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
        from runtime import collectives as C
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
        if img_val[1].kind != "in" or stride != [kh, kw] or any(pad) or (len(n.args) > 5 and list(n.args[5]) != [1, 1]) \
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
        b = None if b_node is None else self._param(self._pname(n, b_node), ParamUse("bias", L), (out_c // geo.table_parts(),))
        y, ylay = self._grid_linear(x, lay, w, b, B * ph * pw, k, out_c, n)
        y = y.reshape(y.shape[0], ph, pw, y.shape[-1]).permute(0, 3, 1, 2)
        return y, Lay("act", ylay.L, 0, 1)

    def _layer_norm(self, n, env):
        geo = self.geo
        x, lay = self._as_act(n, self._val(env, n.args[0]))
        h = self._gshape(n.args[0])[-1]
        if list(n.args[1]) != [h]:
            self._fail(n, "LayerNorm over more than the last dim")
        eps = n.args[4] if len(n.args) > 4 else 1e-5
        self._div(n, "LayerNorm size", h, geo.table_parts())
        L = lay.L
        vec = (h // geo.table_parts(),)
        g = self._param(self._pname(n, n.args[2]), ParamUse("norm", L), vec)
        b = self._param(self._pname(n, n.args[3]), ParamUse("norm", L), vec)
        m = math.prod(self._gshape(n.args[0])[:-1])
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
        from runtime import collectives as C
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
        self.colls += tc.cross_entropy(geo.mode, m // geo.batch_parts, geo.q, geo.d, axes=geo.swap(lay.L) if geo.mode == "3d" else ("x", "y", "z"))
        denom = m if self.meta else int((full_t != ignore).sum())
        if self.meta:
            rows, c = logits.shape
            self._save(self._fresh((rows, c)), torch.empty(rows, dtype=torch.int64, device="meta"),
                       torch.empty(rows, dtype=torch.bool, device="meta"))
            return (self._fresh((rows,)) * (target != ignore).to(torch.float32)).sum() / denom, Lay("loss", lay.L)
        from runtime.split_loss import split_cross_entropy
        hg = geo.hid_group(lay.L)
        blk, _ = geo.hid_block(lay.L, self.coords)
        tok = split_cross_entropy(logits, target, blk, self.grid.group(hg), hg)
        tok = tok * (target != ignore).to(tok.dtype)
        return tok.sum() / denom, Lay("loss", lay.L)

    # ------------------------------------------------------------------ local ops
