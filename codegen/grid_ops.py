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
    autopar.rms_norm (fused)   split RMSNorm: the mean square all-reduced over the hidden group, in
                               torch ops (the kernel needs whole rows); autopar.layer_norm the split
                               LayerNorm as ATen's; autopar.swiglu and geglu are tagged pointwise
                               and run their kernels locally on each rank's blocks;
                               autopar.rotary runs locally too where its last (head) dim is whole
    cross_entropy (mean)       split cross-entropy on split logits; each rank returns its share
                               sum(my tokens' losses) / #targets (replicated over the q ranks
                               that split the classes: the step divides the world sum by q)
    sdpa, gelu, add, dropout(p=0), views, split, cat, select, expand
                               local (whole sequences and whole heads per rank)
Unsupported ops or layouts raise GridLoweringError naming the node.
"""
from __future__ import annotations

import operator

import torch

from codegen.grid_layout import Geometry
from codegen.grid_local import NO_OUTPUT, VIEWS, GridLoweringError, Lay, LocalOps, ParamUse  # noqa: F401
from codegen.grid_replicated import ReplicatedOps
from codegen.grid_split import SplitOps
from solver import tp_grid_cost as tc
from runtime.kernels.ops import LAYER_NORM, RMS_NORM
from autopar.frontend.batching import graph_batch_dims

aten = torch.ops.aten


_NEW_TENSOR = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default}


class _ParamConflict(Exception):
    """A parameter a replicated op reads whole was given a split use earlier: analyse again with
    it whole from the start."""

    def __init__(self, name):
        super().__init__(name)
        self.name = name


class GridProgram(SplitOps, LocalOps, ReplicatedOps):
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
                aten.embedding.default: "split embedding", RMS_NORM: "split rms_norm",
                LAYER_NORM: "split layer_norm",
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
        if t is RMS_NORM:
            return self._fused_rms_norm(n, env)
        if t is LAYER_NORM:
            return self._fused_layer_norm(n, env)
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

    # ------------------------------------------------------------------ local ops
