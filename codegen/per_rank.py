"""One rank's program: a new fx GraphModule built node by node from the traced graph and a Plan.

``generate(traced, plan, rank, zero3_chunks=None, compute_dtype=None, device=None) -> RankProgram``

Placeholders are this rank's parameter/buffer blocks (in the traced order) then its user-input
rows. For every call_function node of the traced graph:

1. each tensor input is moved from its producer's layout (the producer op's output layout in the
   plan, the parameter's layout, or for user inputs their batch dim — the plan's ``batch_dims``,
   dim 0 in older plans — split over the data axes) to the layout
   the op's strategy wants, by the cheapest reshard path (``plan_reshard`` with the cost model's
   ``Collectives``: the path executed is the path priced). Each step is a call to a module-level
   function of ``runtime.context`` (``all_gather(x, 1, axis=1)``), so the printed code reads like
   the plan;
2. inputs whose gradient comes back partial over an axis (``conjugates.region_inputs``: the op
   splits its work on an axis where the input is replicated) get a conjugate (a reduce-scatter
   backward fused into the last all_gather, else a ``copy``: all-reduce backward). Exception: a
   parameter replicated on a data axis whose every use splits the batch there keeps a PARTIAL
   gradient over that axis (``grad_partial_axes``): the DP/ZeRO reducer sums it, bucketed and
   overlapped with backward, instead of one all-reduce per use;
3. the op runs on local blocks via ``rules.localize.local_call`` (global view sizes rewritten to
   local ones, a ``scale`` for means over a split dim or over the micro-batches) or a special
   algorithm of ``runtime.special`` (vocab-parallel embedding / cross-entropy).

Mean losses over targets (cross-entropy / NLL, reduction mean) whose targets are split over a
mesh axis or over micro-batches run as a local sum divided by the GLOBAL denominator
(``runtime.loss.divide``: valid targets, or their class weights, over every rank and micro-batch).
``RankProgram.count_gm`` computes this rank's share of each denominator for one micro-batch: the
ancestors of the targets (and class weights) copied from the program, which must not involve a
trainable parameter; same placeholders as ``gm``, returns a tuple with one 0-d float64 per entry
of ``mean_losses`` ((loss node, mesh axes its targets are split over)). autopar.execution.compiled sums it
over the micro-batches, all-reduces over those axes and installs the results before running ``gm``.

Layouts are normalised before comparing: an axis of size 1 splits nothing, so it is dropped.
The graph returns the local loss; ``loss_layout`` says over which axes it is a partial sum. With
several micro-batches each micro-batch's program returns its exact share of the step's loss
(means over the batch are scaled by 1/num_micro_batches, mean losses use global denominators),
so the step's loss and gradients are SUMS over micro-batches.

Mixed precision (``compute_dtype`` bf16/fp16): the model was traced in fp32, so dtype arguments
in the graph (``x.to(torch.float32)``, ``full(..., dtype=torch.float32)``) name fp32; they are
rewritten to the compute dtype, so every floating value of the program has the dtype of the
working parameters (what the planner's bf16 memory and communication model counts). Ops that
need fp32 internally (the vocab-parallel cross-entropy) upcast locally.

Device (``device``, e.g. ``cuda:3`` under NCCL): the graph was traced on the CPU (or meta), so
``device=`` arguments of factory ops (``arange``, ``full``, ``ones``) are rewritten to the
rank's device; with ``None`` they are left as traced.

Random ops (dropout, SDPA with dropout, bernoulli, ...; ``codegen/random_ops.py``) run through
``runtime.rng.seeded`` with this rank's block coordinates on the axes their output is split over:
replicas draw the same mask, split blocks and data-parallel rows independent ones.

ZeRO-3 (``zero3_chunks``: parameter FQN -> chunk index): a chunk is gathered before the first op
that reads one of its parameters, freed after the last one (unless the loss is computed inside
that region), and values leaving the region are wrapped in ``zero3_exit`` so backward re-gathers it.

Activation checkpointing (the plan's ``stages[0].checkpoint``, block group -> bool): every node
emitted while translating a node of a checkpointed block instance (its collectives and ZeRO-3
calls included) is recorded under that instance; at the end ``codegen/checkpoint.py`` outlines
each instance into one ``checkpoint_region`` call. A group recomputed "selective"ly records only
the nodes of each instance's attention core, under ``<instance>.attention_core``
(codegen/selective.py).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.pricing.conjugates import region_inputs
from autopar.pricing.cost import Collectives
from autopar.rules.layout import Layout
from autopar.pricing.reshard import plan_reshard
from autopar.rules import spec_for, tensor_inputs
from autopar.rules.localize import local_call
from autopar.execution.microbatch import decompose, loss_scale
from autopar.rules.strategy import Strategy
from codegen.checkpoint import checkpointed_groups, outline_regions, program_code
from codegen.selective import selective_regions
from codegen.random_ops import is_random, random_block
from runtime import context as RC
from runtime import rng as RNG
from runtime import special as SP
from autopar.rules.sequence import zigzag_axes
from codegen import sp_ops as SPO


@dataclass
class RankProgram:
    gm: fx.GraphModule
    rank: int
    coords: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    param_names: list[str]                      # placeholder names of params/buffers, in graph order
    param_fqn: dict[str, str]                   # placeholder name -> FQN
    buffers: set[str]                           # placeholder names that are buffers
    param_layouts: dict[str, Layout]            # FQN -> layout (normalised)
    param_slices: dict[str, tuple[slice, ...]]  # FQN -> this rank's block of the full tensor
    input_names: list[str]
    input_layouts: list[Layout]
    grad_partial_axes: dict[str, tuple[int, ...]]   # FQN -> data axes its grad is left partial over
    loss_layout: Layout
    data_axes: tuple[int, ...]                   # data axes of size > 1
    zero3_chunks: dict[str, int] = field(default_factory=dict)
    checkpoint_regions: list[str] = field(default_factory=list)   # block instances run as checkpoint regions
    batch_dims: list = field(default_factory=list)   # per user input: its batch dim (or None)
    count_gm: fx.GraphModule | None = None           # this rank's share of the mean losses' denominators
    mean_losses: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)   # (loss node, target split axes)

    @property
    def code(self) -> str:
        """The program, then the body of each checkpoint region."""
        return program_code(self.gm)


def normalize(layout: Layout, mesh_shape) -> Layout:
    """Drop mesh axes of size 1: splitting over them (or being partial over them) is nothing."""
    keep = lambda a: mesh_shape[a] > 1  # noqa: E731
    return Layout(tuple(tuple(a for a in axes if keep(a)) for axes in layout.dims),
                  tuple(sorted(a for a in layout.partial if keep(a))))


def block_slices(layout: Layout, shape, mesh_shape, coords) -> tuple[slice, ...]:
    """This rank's contiguous block of a tensor of global ``shape`` (first split axis outer)."""
    out = []
    for d, size in enumerate(shape):
        idx, n = 0, 1
        for a in layout.dims[d]:
            idx = idx * mesh_shape[a] + coords[a]
            n *= mesh_shape[a]
        step = size // n
        out.append(slice(idx * step, (idx + 1) * step))
    return tuple(out)


def input_layout(ndim: int, mesh, batch_dim: int | None = 0) -> Layout:
    """User inputs: the batch dim split over the data axes (mesh order), everything else
    replicated (an input without a batch dim: replicated whole)."""
    data = tuple(a for a in mesh.data_axes() if mesh.shape[a] > 1)
    return Layout(tuple(data if d == batch_dim else () for d in range(ndim))) if ndim else Layout(())


def strategy_of(op: dict) -> Strategy:
    lay = lambda j: None if j is None else Layout.from_json(j)  # noqa: E731
    return Strategy(op["strategy"], tuple(lay(j) for j in op["inputs"]), tuple(lay(j) for j in op["outputs"]),
                    tuple(op["splits"]), 1.0, (), tuple(op.get("special", ())))


def _val(node):
    return node.meta.get("val")


# reshard steps whose result is a new tensor, contiguous in its dims' order (runtime/collectives.py)
_NEW_TENSOR_STEPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice")


def _memory_order(val) -> tuple[int, ...] | None:
    """``val``'s dims from outermost to innermost in memory (by decreasing stride), when that is
    not their order (a transposed or permuted view, e.g. attention's q of shape (b, h, s, d)
    laid out (b, s, h, d)); None for a value already in order, a broadcast (stride 0) one, or a
    non-tensor. Dims of size 1 do not count."""
    if not isinstance(val, torch.Tensor) or val.ndim < 2 or val.layout != torch.strided:
        return None
    big = [d for d in range(val.ndim) if val.shape[d] > 1]
    if any(val.stride(d) == 0 for d in big):
        return None
    order = tuple(sorted(range(val.ndim), key=lambda d: (-val.stride(d), d)))
    if [d for d in order if d in big] == big:
        return None
    return order


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


class _Builder:
    def __init__(self, traced, plan, rank: int, zero3_chunks, compute_dtype=None, device=None,
                 batch_carrying=None):
        self.traced, self.plan, self.rank = traced, plan, rank
        self.device = None if device is None else torch.device(device)
        self.compute_dtype = compute_dtype if compute_dtype not in (None, torch.float32) else None
        self.mesh = plan.mesh
        self.mesh_shape = tuple(self.mesh.shape)
        self.coords = tuple(self.mesh.coords(rank))
        self.comm = Collectives(plan.cluster, self.mesh)
        self.ops = {o["node"]: o for o in plan.data["ops"]}
        self.zigzag_axes = zigzag_axes(plan.data["ops"])   # load-balanced ring attention's axes
        self.params_by_node = {v["node"]: (fqn, v) for fqn, v in plan.data["params"].items()}
        self.zero3 = dict(zero3_chunks or {})
        self.g = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.layout: dict[str, object] = {}      # node name -> Layout or list of Layouts (tuple outputs)
        self.data_axes = tuple(a for a in self.mesh.data_axes() if self.mesh_shape[a] > 1)
        self.attrs: dict[str, object] = {}      # get_attr targets of the new program (submodules, constants)
        self.region: str | None = None           # checkpointed block instance being emitted (module FQN)
        self.source: str | None = None           # traced node being emitted (pipeline stages split by it)
        self.region_nodes: dict[str, list[fx.Node]] = {}
        self.nm = int(plan.data.get("degrees", {}).get("num_micro_batches", 1) or 1)
        from autopar.frontend.batching import plan_batch_dims
        self.batch_dims = plan_batch_dims(plan.data, len(traced.input_names))
        self.mean_losses: list[tuple[str, tuple[int, ...]]] = []
        self.count_args: list[tuple] = []        # per mean loss: (target node, weight node, ignore_index)
        self.decomp = None                       # how the loss splits over micro-batches (autopar/execution/microbatch.py)
        if self.nm > 1:
            from autopar.errors import ExecutionError
            if batch_carrying is None:
                raise ExecutionError("generate: a plan with several micro-batches needs batch_carrying= "
                                     "(autopar.execution.microbatch.batch_carrying of the global and micro-batch traces)")
            self.decomp = decompose(traced, batch_carrying)
            if self.decomp.error:
                raise ExecutionError(f"the plan runs {self.nm} micro-batches but {self.decomp.error}")

    def norm(self, lay: Layout) -> Layout:
        return normalize(lay, self.mesh_shape)

    # ------------------------------------------------------------- analysis before emission
    def _needs_grad(self) -> set[str]:
        """Float values autograd differentiates: parameters and whatever they reach."""
        out = set()
        for n in self.traced.gm.graph.nodes:
            if n.op == "placeholder":
                if n.name in self.traced.param_fqn and n.name not in self.traced.buffers and _is_float(_val(n)):
                    out.add(n.name)
            elif n.op == "call_function":
                v = _val(n)
                floaty = _is_float(v) or (isinstance(v, (tuple, list)) and any(_is_float(x) for x in v))
                if floaty and any(p.name in out for p in tensor_inputs(n)):
                    out.add(n.name)
        return out

    def _param_partial_axes(self, strategies, specs) -> dict[str, tuple[int, ...]]:
        """Parameter placeholder -> data axes over which its grad stays partial (see module doc)."""
        uses: dict[str, list[tuple[str, int]]] = {}
        for n in self.traced.gm.graph.nodes:
            if n.op == "call_function" and n.target is not operator.getitem:
                for i, p in enumerate(tensor_inputs(n)):
                    if p.name in self.traced.param_fqn and p.name not in self.traced.buffers:
                        uses.setdefault(p.name, []).append((n.name, i))
        out = {}
        for pname, us in uses.items():
            lay = self.src_layout_param(pname)
            axes = []
            for a in self.data_axes:
                if a in lay.axes_used():
                    continue
                if all((i, a) in self.regions[op] for op, i in us):
                    axes.append(a)
            out[pname] = tuple(axes)
        return out

    def src_layout_param(self, pname: str) -> Layout:
        entry = self.params_by_node.get(pname)
        if entry is not None:
            return self.norm(Layout.from_json(entry[1]["layout"]))
        # Not in the plan (e.g. a buffer the planner did not list): replicated.
        ndim = next(_val(n).dim() for n in self.traced.gm.graph.nodes if n.name == pname)
        return Layout.replicated(ndim)

    # ------------------------------------------------------------- emission helpers
    def call(self, fn, args, kwargs=None, name=None):
        node = self.g.create_node("call_function", fn, tuple(args), dict(kwargs or {}), name=name)
        if self.source is not None:   # the traced node this one was emitted for (codegen/stages.py)
            node.meta["autopar_source"] = self.source
        if self.region is not None:
            self.region_nodes.setdefault(self.region, []).append(node)
        return node

    def reshard(self, x: fx.Node, src: Layout, dst: Layout, val, partial_grad_axes) -> fx.Node:
        """Steps from src to dst on this rank's block of ``val``, plus the gradient conjugates.

        The collectives return new tensors, contiguous in the order of their dims; a value the
        trace lays out in another order (``val`` a transposed view: q, k, v of attention) is
        viewed in its traced memory order around the steps (``_memory_order``: two permutes,
        no copy), so the result has the traced layout. What a consumer's kernel then does with
        it (flash attention lays its output out like q; a later ``reshape`` is a view or a copy)
        is what the trace did, which is what the memory model counts (pricing.py)."""
        steps = ()
        if src != dst:
            steps = plan_reshard(src, dst, tuple(val.shape), val.element_size(), self.mesh_shape, self.comm).steps
        order = _memory_order(val) if any(s.kind in _NEW_TENSOR_STEPS for s in steps) else None
        if order is not None:
            at = {d: i for i, d in enumerate(order)}   # traced dim -> its position in memory order
            steps = tuple(dataclasses.replace(s, dim=None if s.dim is None else at[s.dim],
                                              dst_dim=None if s.dst_dim is None else at[s.dst_dim])
                          for s in steps)
            x = self.call(torch.ops.aten.permute.default, (x, list(order)))
        last_on_axis = {s.axis: i for i, s in enumerate(steps)}
        fused = {a for a in partial_grad_axes if a in last_on_axis and steps[last_on_axis[a]].kind == "all_gather"}
        for i, s in enumerate(steps):
            kw = {"axis": s.axis, **({"partial_grad": True} if s.axis in fused and i == last_on_axis[s.axis] else {})}
            zz = SPO.reshard_step(self, x, s, kw) if self.zigzag_axes else None   # codegen/sp_ops.py
            if zz is not None:
                x = zz
            elif s.kind == "all_reduce":
                x = self.call(RC.all_reduce, (x,), {"axis": s.axis})
            elif s.kind == "reduce_scatter":
                x = self.call(RC.reduce_scatter, (x, s.dim), {"axis": s.axis})
            elif s.kind == "all_gather":
                kw = {"axis": s.axis}
                if s.axis in fused and i == last_on_axis[s.axis]:
                    kw["partial_grad"] = True
                x = self.call(RC.all_gather, (x, s.dim), kw)
            elif s.kind == "all_to_all":
                x = self.call(RC.all_to_all, (x, s.dim, s.dst_dim), {"axis": s.axis})
            elif s.kind == "slice":
                x = self.call(RC.slice_block, (x, s.dim), {"axis": s.axis})
            elif s.kind == "partial":
                x = self.call(RC.make_partial, (x,), {"axis": s.axis})
        if order is not None:
            x = self.call(torch.ops.aten.permute.default, (x, [order.index(d) for d in range(len(order))]))
        for a in sorted(set(partial_grad_axes) - fused):
            x = self.call(RC.copy, (x,), {"axis": a})
        return x

    # ------------------------------------------------------------- main
    def build(self) -> RankProgram:
        traced = self.traced
        graph = traced.gm.graph
        nodes = list(graph.nodes)
        missing = [n.name for n in nodes if n.op == "call_function" and n.target is not operator.getitem
                   and n.name not in self.ops]
        if missing:
            from autopar.errors import ExecutionError
            raise ExecutionError(f"the plan has no strategy for nodes {missing[:5]} of the traced graph: "
                                 f"plan made for a different model or graph")

        specs, strategies, self.regions = {}, {}, {}
        input_bd = dict(zip(traced.input_names, self.batch_dims))
        for n in nodes:
            if n.op == "call_function" and n.target is not operator.getitem:
                specs[n.name] = spec_for(n)
                strategies[n.name] = strategy_of(self.ops[n.name])
                regs = region_inputs(strategies[n.name], specs[n.name].inputs)
                self.regions[n.name] = {(i, a) for i, a in regs if self.mesh_shape[a] > 1}
        needs_grad = self._needs_grad()
        partial_params = self._param_partial_axes(strategies, specs)

        # ZeRO-3 regions: chunk -> (first op index, last op index) over ops that read its params.
        op_index = {n.name: k for k, n in enumerate(nodes)}
        chunk_span: dict[int, list[int]] = {}
        for n in nodes:
            if n.op != "call_function":
                continue
            for p in tensor_inputs(n):
                fqn = traced.param_fqn.get(p.name)
                if fqn in self.zero3:
                    span = chunk_span.setdefault(self.zero3[fqn], [op_index[n.name], op_index[n.name]])
                    span[1] = op_index[n.name]
        for c, span in chunk_span.items():   # keep a multi-output op's getitems inside its region
            while span[1] + 1 < len(nodes) and nodes[span[1] + 1].target is operator.getitem \
                    and nodes[span[1] + 1].op == "call_function":
                span[1] += 1
        starts = {}
        ends = {}
        for c, (s, e) in sorted(chunk_span.items()):
            starts.setdefault(s, []).append(c)
            ends.setdefault(e, []).append(c)
        loss_index = op_index[traced.output_name]

        param_names, param_layouts, param_slices, grad_partial = [], {}, {}, {}
        input_layouts = []
        for n in nodes:
            if n.op != "placeholder":
                continue
            ph = self.g.placeholder(n.name)
            self.env[n.name] = ph
            if n.name in traced.param_fqn:
                fqn = traced.param_fqn[n.name]
                lay = self.src_layout_param(n.name)
                param_names.append(n.name)
                param_layouts[fqn] = lay
                param_slices[fqn] = block_slices(lay, tuple(_val(n).shape), self.mesh_shape, self.coords)
                grad_partial[fqn] = partial_params.get(n.name, ())
                self.layout[n.name] = lay
            else:
                v = _val(n)
                lay = input_layout(v.dim() if isinstance(v, torch.Tensor) else 0, self.mesh, input_bd.get(n.name))
                input_layouts.append(lay)
                self.layout[n.name] = lay

        # Random ops draw from a generator seeded per (position, op, block): the position is ticked
        # once per program call, here before any op, so a recomputed region reuses it (runtime/rng.py).
        self.op_index = op_index
        self.rng_position = None
        if any(n.op == "call_function" and is_random(n) for n in nodes):
            self.rng_position = self.call(RNG.tick, (), name="rng_position")

        ckpt = checkpointed_groups(traced, self.plan)
        selective = selective_regions(traced, self.plan)   # attention cores recomputed selectively
        out_node = None
        for k, n in enumerate(nodes):
            if n.op == "output":
                out_node = n
                continue
            if n.op == "get_attr":
                self._emit_attr(n)
                continue
            if n.op != "call_function":
                continue
            g, i, _ = traced.block_of.get(n.name, (None, None, None))
            self.region = traced.blocks[g].module_fqns[i] if g in ckpt else selective.get(n.name)
            self.source = n.name
            for c in starts.get(k, ()):
                self.call(RC.zero3_gather, (c,))
            if n.target is operator.getitem:
                src, idx = n.args
                self.env[n.name] = self.call(operator.getitem, (self.env[src.name], idx), name=n.name)
                lays = self.layout[src.name]
                self.layout[n.name] = lays[idx] if isinstance(lays, list) else lays
            else:
                self._emit_op(n, specs[n.name], strategies[n.name], needs_grad, partial_params)
            for c in ends.get(k, ()):
                if k >= loss_index:
                    continue   # the loss is computed in this region: backward needs it right away
                crossing = [m for m in nodes[chunk_span[c][0]:k + 1]
                            if m.op == "call_function" and _is_float(_val(m))
                            and any(op_index.get(u.name, -1) > k for u in m.users) and m.name in needs_grad]
                for m in crossing:
                    self.env[m.name] = self.call(RC.zero3_exit, (self.env[m.name], (c,)))
                self.call(RC.zero3_free, (c,))
        self.region = self.source = None

        # The loss: returned as this rank's local value (partial over loss_layout.partial); with
        # micro-batches, a loss that does not depend on the batch at all counts 1/nm per micro-batch.
        loss_lay = self.layout[traced.output_name]
        loss = self.env[traced.output_name]
        if self.decomp is not None and loss_scale(self.decomp, traced.output_name):
            loss = self.call(operator.mul, (loss, 1.0 / self.nm), name="loss_per_micro_batch")
        self.g.output(loss)
        root = torch.nn.Module()
        for name, obj in self.attrs.items():
            setattr(root, name, obj)
        gm = fx.GraphModule(root, self.g, class_name=f"Rank{self.rank}Program")
        # The count program copies nodes of the flat program: build it before regions are outlined.
        count_gm = self._count_program(gm, root) if self.mean_losses else None
        regions = outline_regions(gm, self.region_nodes)
        return RankProgram(gm=gm, rank=self.rank, coords=self.coords, mesh_shape=self.mesh_shape,
                           param_names=param_names, param_fqn=dict(traced.param_fqn), buffers=set(traced.buffers),
                           param_layouts=param_layouts, param_slices=param_slices,
                           input_names=list(traced.input_names), input_layouts=input_layouts,
                           grad_partial_axes={f: tuple(a) for f, a in grad_partial.items()},
                           loss_layout=loss_lay, data_axes=self.data_axes, zero3_chunks=self.zero3,
                           checkpoint_regions=regions, batch_dims=list(self.batch_dims), count_gm=count_gm,
                           mean_losses=list(self.mean_losses))

    def _count_program(self, gm: fx.GraphModule, root) -> fx.GraphModule:
        """The program computing this rank's share of every mean loss's denominator (module doc)."""
        from runtime import loss as RL

        wanted = [x for t, w, _ in self.count_args for x in (t, w) if isinstance(x, fx.Node)]
        keep: set[fx.Node] = set()
        stack = list(wanted)
        while stack:
            x = stack.pop()
            if x in keep:
                continue
            keep.add(x)
            stack.extend(x.all_input_nodes)
        trainable = {name for name in self.traced.param_fqn if name not in self.traced.buffers}
        bad = sorted(x.name for x in keep if x.op == "placeholder" and x.name in trainable)
        if bad:
            from autopar.errors import ExecutionError
            fqns = [self.traced.param_fqn[b] for b in bad]
            raise ExecutionError(
                f"the mean losses {[n for n, _ in self.mean_losses]} have targets or class weights computed from "
                f"the trainable parameters {fqns[:3]}: autopar divides a mean loss split over ranks or "
                f"micro-batches by its global number of valid targets, counted before the step runs. Compute "
                f"the targets from the inputs only, or use reduction='sum' and divide yourself")
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for x in gm.graph.nodes:
            if x.op == "placeholder":
                env[x] = g.placeholder(x.name)
            elif x in keep:
                env[x] = g.node_copy(x, lambda a: env[a])
        outs = []
        for t, w, ignore in self.count_args:
            outs.append(g.call_function(RL.local_count, (env[t], env[w] if isinstance(w, fx.Node) else None,
                                                         int(ignore))))
        g.output(tuple(outs))
        return fx.GraphModule(root, g, class_name=f"Rank{self.rank}Counts")

    def _emit_attr(self, n: fx.Node) -> None:
        """A get_attr of the traced graph: a submodule of a higher-order op (e.g. the body of
        ``wrap_with_set_grad_enabled``) or a constant tensor, copied into the program whole
        (replicated); a floating constant takes the working dtype and the rank's device."""
        obj = self.traced.gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and self.compute_dtype is not None:
                obj = obj.to(self.compute_dtype)
            if self.device is not None:
                obj = obj.to(self.device)
        elif isinstance(obj, fx.GraphModule):
            obj = self._retarget_module(obj)
        name = str(n.target).replace(".", "_")
        self.attrs[name] = obj
        self.env[n.name] = self.g.get_attr(name)
        self.layout[n.name] = Layout.replicated(obj.dim()) if isinstance(obj, torch.Tensor) else None

    def _retarget(self, args, kwargs):
        """dtype and device arguments for this rank's program (module doc)."""
        if self.compute_dtype is not None:
            args, kwargs = pytree.tree_map_only(
                torch.dtype, lambda d: self.compute_dtype if d == torch.float32 else d, (args, kwargs))
        if self.device is not None:
            args, kwargs = pytree.tree_map_only(torch.device, lambda _: self.device, (args, kwargs))
        return args, kwargs

    def _retarget_module(self, gm: fx.GraphModule) -> fx.GraphModule:
        """A copy of a higher-order op's body with its dtype/device arguments retargeted."""
        if self.compute_dtype is None and self.device is None:
            return gm
        import copy

        gm = copy.deepcopy(gm)
        for node in gm.graph.nodes:
            node.args, node.kwargs = self._retarget(node.args, node.kwargs)
        for name, sub in list(gm.named_children()):
            if isinstance(sub, fx.GraphModule):
                setattr(gm, name, self._retarget_module(sub))
        for name, buf in list(gm.named_buffers(recurse=False)):
            setattr(gm, name, buf.to(self.compute_dtype or buf.dtype) if buf.is_floating_point() else buf)
        gm.recompile()
        return gm

    def _global_mean(self, n: fx.Node, out: fx.Node, args, kwargs, op: dict) -> fx.Node:
        """A mean loss run as a local sum: divide by its global denominator, and remember what
        the count program must count (module doc)."""
        from runtime import loss as RL

        target = args[1]
        weight = _loss_arg(args, kwargs, 2, "weight", None)
        ignore = _loss_arg(args, kwargs, 4, "ignore_index", -100)
        tgt_layout = self.norm(Layout.from_json(op["inputs"][1]))
        self.mean_losses.append((n.name, tuple(sorted(tgt_layout.axes_used()))))
        self.count_args.append((target, weight, ignore))
        return self.call(RL.divide, (out, n.name), name=n.name + "_global_mean")

    def _emit_op(self, n: fx.Node, spec, st: Strategy, needs_grad, partial_params):
        op = self.ops[n.name]
        producers = tensor_inputs(n)
        regions = self.regions[n.name]
        new_inputs = []
        for i, p in enumerate(producers):
            src = self.layout[p.name]
            if isinstance(src, list):
                raise NotImplementedError(f"{n.name}: reads the tuple output of {p.name} directly")
            dst_json = op["inputs"][i] if i < len(op["inputs"]) else None
            v = _val(p)
            if dst_json is None or not isinstance(v, torch.Tensor):
                dst = src if dst_json is None else self.norm(Layout.from_json(dst_json))
                if not isinstance(v, torch.Tensor):
                    new_inputs.append(self.env[p.name])
                    continue
            else:
                dst = self.norm(Layout.from_json(dst_json))
            pga = []
            if p.name in needs_grad:
                for (j, a) in sorted(regions):
                    if j == i and a not in partial_params.get(p.name, ()):
                        pga.append(a)
            x = self.reshard(self.env[p.name], src, dst, v, tuple(pga))
            if self.decomp is not None and i in self.decomp.input_scales.get(n.name, ()):
                # a batch-independent term added to the loss's share: counted once per step
                x = self.call(operator.mul, (x, 1.0 / self.nm))
            new_inputs.append(x)

        nm = self.nm if self.decomp is not None and n.name in self.decomp.reduces_batch else 1
        call = local_call(n, spec, st, self.mesh_shape, nm)
        it = iter(new_inputs)
        args, kwargs = pytree.tree_map_only(fx.Node, lambda _: next(it), (tuple(call.args), dict(call.kwargs)))
        args, kwargs = self._retarget(args, kwargs)   # traced in fp32 on cpu/meta (module doc)
        if SPO.handles(st):
            out = SPO.attention(self, n, st, args, kwargs)   # Ulysses / ring attention (codegen/sp_ops.py)
        elif call.needs_algorithm:
            algo = call.needs_algorithm
            if "," in algo:
                raise NotImplementedError(f"{n.name}: several special algorithms at once ({algo})")
            letters = [ch for ch, (name, _) in spec.special.items() if name == algo]
            axes = tuple(a for a, s in enumerate(st.splits) if s in letters and self.mesh_shape[a] > 1)
            fn = SP.ALGORITHMS.get(algo)
            if fn is None:
                raise NotImplementedError(f"{n.name}: special algorithm {algo!r} is not implemented")
            if axes:
                out = self.call(fn, args, dict(kwargs, axes=axes), name=n.name)
            else:
                out = self.call(call.target, args, kwargs, name=n.name)
        elif is_random(n):
            # Replicas of the output block draw the same mask, other blocks their own (runtime/rng.py).
            block = random_block(self.norm(Layout.from_json(op["outputs"][0])), self.coords)
            out = self.call(RNG.seeded, (call.target, self.rng_position, self.op_index[n.name], block, *args),
                            kwargs, name=n.name)
        else:
            out = self.call(call.target, args, kwargs, name=n.name)
        if call.scale is not None and call.scale != 1:
            out = self.call(operator.mul, (out, float(call.scale)), name=n.name + "_scaled")
        if call.global_mean:
            out = self._global_mean(n, out, args, kwargs, op)
        self.env[n.name] = out
        outs = [self.norm(Layout.from_json(j)) for j in op["outputs"]]
        v = _val(n)
        self.layout[n.name] = outs if isinstance(v, (tuple, list)) else outs[0]


def _loss_arg(args, kwargs, i: int, name: str, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def generate(traced, plan, rank: int, zero3_chunks: dict[str, int] | None = None,
             compute_dtype: torch.dtype | None = None, device=None, batch_carrying: set[str] | None = None) -> RankProgram:
    """The per-rank program of ``plan`` for ``rank`` (see the module docstring). ``traced`` is the
    graph of ONE micro-batch; with several micro-batches ``batch_carrying`` names its nodes whose
    values carry the batch (``autopar.execution.microbatch.batch_carrying``)."""
    if not 0 <= rank < plan.mesh.size:
        raise ValueError(f"rank {rank} is outside the plan's mesh {plan.mesh.describe()} ({plan.mesh.size} ranks)")
    return _Builder(traced, plan, rank, zero3_chunks, compute_dtype, device, batch_carrying).build()


def per_rank_code(plan, rank: int, factory, pairs=()) -> str:
    """Printed code of ``rank``'s program for ``autopar show plan.json --code --rank R --factory F``.
    ``factory`` is a zoo name / "module:FN" / a callable returning (model, example_inputs);
    ``pairs`` are "name=value" keyword arguments for it (values parsed as Python literals)."""
    import ast

    from autopar.models import load_factory
    from autopar.frontend.trace import trace

    fn = load_factory(factory) if isinstance(factory, str) else factory
    kwargs = {}
    for pair in pairs or ():
        k, _, v = pair.partition("=")
        try:
            kwargs[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            kwargs[k] = v
    model, inputs = fn(**kwargs)
    nm = plan.data["degrees"].get("num_micro_batches", 1) or 1
    traced = trace(model, inputs)
    if traced.fingerprint != plan.fingerprint:
        from autopar.errors import ExecutionError
        raise ExecutionError(f"plan made for a different model: plan fingerprint {plan.fingerprint[:12]}, "
                             f"{factory} traces to {traced.fingerprint[:12]}")
    carrying = None
    if nm > 1:   # the program runs one micro-batch: cut every input along its batch dim
        from autopar.frontend.batching import plan_batch_dims
        from autopar.execution.microbatch import batch_carrying
        dims = plan_batch_dims(plan.data, len(inputs))
        micro = trace(model, tuple(x if d is None else x.narrow(d, 0, x.shape[d] // nm) for x, d in zip(inputs, dims)))
        carrying, traced = batch_carrying(traced, micro), micro
    prog = generate(traced, plan, rank, batch_carrying=carrying)
    header = (f"# rank {rank} of mesh {plan.mesh.describe()}, coords {prog.coords}\n"
              f"# loss layout: {prog.loss_layout.describe(plan.mesh.names)}\n")
    code = header + prog.code
    if prog.count_gm is not None:   # what step runs first: this rank's share of the mean losses' denominators
        axes = ", ".join(f"{n} over {[plan.mesh.names[a] for a in ax]}" for n, ax in prog.mean_losses)
        code += f"\n# global denominators of mean losses (summed over micro-batches, all-reduced: {axes}):\n" \
            + prog.count_gm.code
    return code
