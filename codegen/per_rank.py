"""One rank's program: a new fx GraphModule built node by node from the traced graph and a Plan.

``generate(traced, plan, rank, zero3_chunks=None, compute_dtype=None, device=None) -> RankProgram``

Placeholders are this rank's parameter/buffer blocks (in the traced order) then its user-input
rows. For every call_function node of the traced graph:

1. each tensor input is moved from its producer's layout (the producer op's output layout in the
   plan, the parameter's layout, or for user inputs their batch dim — the plan's ``batch_dims``,
   dim 0 in older plans — split over the data axes) to the layout
   the op's strategy wants, by the cheapest reshard path (codegen/reshard_calls.py: the path
   executed is the path priced). Each step is a call to a module-level
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

Mean losses over targets whose targets are split over a mesh axis or over micro-batches run as a
local sum divided by the GLOBAL denominator, which ``RankProgram.count_gm`` counts
(codegen/loss_counts.py).

The program's types and layout helpers (``RankProgram``, ``normalize``, ``block_slices``) are in
codegen/rank_program.py; layouts are normalised before comparing (an axis of size 1 splits
nothing, so it is dropped). The graph returns the local loss; ``loss_layout`` says over which
axes it is a partial sum. With several micro-batches each micro-batch's program returns its
exact share of the step's loss (means over the batch are scaled by 1/num_micro_batches, mean
losses use global denominators), so the step's loss and gradients are SUMS over micro-batches.

``generate_step(traced, plan, rank, state=..., whole=...) -> StepProgram``: the program of an
inference step traced by ``trace_step``: it returns every traced output (each in its plan layout,
or gathered whole) instead of a loss, and takes the ``state`` inputs (a KV cache) as this rank's
blocks in the layout the step returns them in, so they stay on their rank between steps.

Mixed precision (``compute_dtype`` bf16/fp16) and the rank's device (``device``): dtype and device
arguments traced in fp32 on the CPU (or meta) are rewritten to the working dtype and the rank's
device (codegen/retarget.py); with ``None`` they are left as traced.

Random ops (dropout, SDPA with dropout, bernoulli, ...; ``codegen/random_ops.py``) run through
``runtime.rng.seeded`` with this rank's block coordinates on the axes their output is split over:
replicas draw the same mask, split blocks and data-parallel rows independent ones.

ZeRO-3 (``zero3_chunks``: parameter FQN -> chunk index): a chunk is gathered before the first op
that reads one of its parameters or a view of one, freed after the last one (unless the loss is computed inside
that region), and values leaving the region are wrapped in ``zero3_exit`` so backward re-gathers it.

Activation checkpointing (the plan's ``stages[0].checkpoint``, block group -> bool): every node
emitted while translating a node of a checkpointed block instance (its collectives and ZeRO-3
calls included) is recorded under that instance; at the end ``codegen/checkpoint.py`` outlines
each instance into one ``checkpoint_region`` call. A group recomputed "selective"ly records only
the nodes of each instance's attention core, under ``<instance>.attention_core``
(codegen/selective.py).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.pricing.conjugates import region_inputs
from autopar.pricing.cost import Collectives
from autopar.pricing.regather import keeps_shard
from autopar.rules.layout import Layout
from autopar.rules import spec_for, tensor_inputs
from autopar.rules.candidates import storage_roots
from autopar.rules.localize import local_call
from autopar.rules.microbatch import decompose, loss_scale
from autopar.rules.strategy import Strategy
from codegen.checkpoint import checkpointed_groups, outline_regions
from codegen.loss_counts import count_program, global_mean
from codegen.rank_program import RankProgram, StepProgram, block_slices, input_layout, normalize, strategy_of
from codegen.reshard_calls import reshard
from codegen.retarget import retarget, retarget_module
from codegen.selective import selective_regions
from codegen.random_ops import is_random, random_block
from runtime import context as RC
from runtime import regather as RG
from runtime import sp_exec as SX
from runtime import rng as RNG
from runtime import special as SP
from autopar.rules.sequence import zigzag_axes
from codegen import sp_ops as SPO
from autopar.errors import ExecutionError
from autopar.frontend.batching import plan_batch_dims


def _val(node):
    return node.meta.get("val")


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


class _Builder:
    def __init__(self, traced, plan, rank: int, zero3_chunks, compute_dtype=None, device=None,
                 batch_carrying=None, step=None):
        self.traced, self.plan, self.rank = traced, plan, rank
        self.step = step   # a StepEnds: every output returned, state inputs taken as blocks (generate_step)
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
        self.full_region = False                 # ... and whether it is recomputed whole
        self.source: str | None = None           # traced node being emitted (pipeline stages split by it)
        self.region_nodes: dict[str, list[fx.Node]] = {}
        self.nm = int(plan.data.get("degrees", {}).get("num_micro_batches", 1) or 1)
        self.batch_dims = plan_batch_dims(plan.data, len(traced.input_names))
        self.mean_losses: list[tuple[str, tuple[int, ...]]] = []
        self.count_args: list[tuple] = []        # per mean loss: (target node, weight node, ignore_index)
        self.decomp = None                       # how the loss splits over micro-batches (autopar/rules/microbatch.py)
        if self.nm > 1:
            if batch_carrying is None:
                raise ExecutionError("generate: a plan with several micro-batches needs batch_carrying= "
                                     "(autopar.rules.microbatch.batch_carrying of the global and micro-batch traces)")
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

    # ------------------------------------------------------------- main
    def _zero3_aliases(self, traced, specs) -> dict[str, int]:
        """Node name -> ZeRO-3 chunk, for the chunks' parameters and every value sharing a
        parameter's storage (its views: ``t``, ``numpy_T``, ``view``, ``expand`` ...): the traced
        storage roots (autopar/rules/candidates.py ``storage_roots``) that are a chunk's parameter."""
        if not self.zero3:
            return {}
        chunk = {n: self.zero3[f] for n, f in traced.param_fqn.items() if f in self.zero3}
        roots, _ = storage_roots(traced.gm, lambda n: specs[n.name].returns_input if n.name in specs else None)
        return {**chunk, **{n: chunk[r] for n, r in roots.items() if r in chunk}}

    def build(self) -> RankProgram:
        traced = self.traced
        graph = traced.gm.graph
        nodes = list(graph.nodes)
        self.nodes_by_name = {n.name: n for n in nodes}
        missing = [n.name for n in nodes if n.op == "call_function" and n.target is not operator.getitem
                   and n.name not in self.ops]
        if missing:
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

        # ZeRO-3 regions: chunk -> (first op index, last op index) over ops that read its params or
        # a view of them: a view shares the parameter's storage, which the free releases, so its
        # users must run inside the region too (Hugging Face Falcon's ``x @ self.weight.T``: the
        # transpose was the last reader, the matmul ran after the free on a released storage).
        op_index = {n.name: k for k, n in enumerate(nodes)}
        chunk_span: dict[int, list[int]] = {}
        chunk_of = self._zero3_aliases(traced, specs)
        for n in nodes:
            if n.op != "call_function":
                continue
            for p in tensor_inputs(n):
                c = chunk_of.get(p.name)
                if c is not None:
                    span = chunk_span.setdefault(c, [op_index[n.name], op_index[n.name]])
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
                if self.step is not None and n.name in self.step.state:
                    lay = self.step_state_layout(n.name)   # this rank's block, as the step leaves it
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
        for k, n in enumerate(nodes):
            if n.op == "output":
                continue
            if n.op == "get_attr":
                self._emit_attr(n)
                continue
            if n.op != "call_function":
                continue
            g, i, _ = traced.block_of.get(n.name, (None, None, None))
            self.region = traced.blocks[g].module_fqns[i] if g in ckpt else selective.get(n.name)
            self.full_region = g in ckpt
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
        self.full_region = False

        loss_lay = self.layout[traced.output_name]
        if self.step is not None:
            output_layouts = self._step_outputs()
        else:
            # The loss: returned as this rank's local value (partial over loss_layout.partial); with
            # micro-batches, a loss that does not depend on the batch at all counts 1/nm per micro-batch.
            loss = self.env[traced.output_name]
            if self.decomp is not None and loss_scale(self.decomp, traced.output_name):
                loss = self.call(operator.mul, (loss, 1.0 / self.nm), name="loss_per_micro_batch")
            self.g.output(loss)
        root = torch.nn.Module()
        for name, obj in self.attrs.items():
            setattr(root, name, obj)
        gm = fx.GraphModule(root, self.g, class_name=f"Rank{self.rank}Program")
        # The count program copies nodes of the flat program: build it before regions are outlined.
        count_gm = count_program(self, gm, root) if self.mean_losses else None
        regions = outline_regions(gm, self.region_nodes)
        kind, extra = RankProgram, {}
        if self.step is not None:
            kind = StepProgram
            extra = dict(output_names=list(traced.outputs), output_layouts=output_layouts,
                         state=dict(self.step.state),
                         input_shapes=[tuple(_val(n).shape) if isinstance(_val(n), torch.Tensor) else ()
                                       for n in nodes if n.op == "placeholder" and n.name in traced.input_names])
        return kind(gm=gm, rank=self.rank, coords=self.coords, mesh_shape=self.mesh_shape,
                           param_names=param_names, param_fqn=dict(traced.param_fqn), buffers=set(traced.buffers),
                           param_layouts=param_layouts, param_slices=param_slices,
                           input_names=list(traced.input_names), input_layouts=input_layouts,
                           grad_partial_axes={f: tuple(a) for f, a in grad_partial.items()},
                           loss_layout=loss_lay, data_axes=self.data_axes, zero3_chunks=self.zero3,
                           checkpoint_regions=regions, batch_dims=list(self.batch_dims), count_gm=count_gm,
                           mean_losses=list(self.mean_losses), **extra)

    # ------------------------------------------------------------- inference steps (generate_step)
    def step_state_layout(self, name: str) -> Layout:
        """The layout a state input arrives in: the plan's layout of the output it was returned as."""
        out = self.step.state[name]
        op = self.ops.get(out)
        if op is None:
            raise ExecutionError(f"state input {name!r}: its output {out!r} is not computed by an op of the plan")
        return self.norm(Layout.from_json(op["outputs"][0]))

    def _step_outputs(self) -> list[Layout]:
        """Returns every traced output, in order: each in its plan layout (this rank's block), or
        replicated for those named ``whole`` (a state output is never gathered: its input arrives
        in the output's own layout, ``step_state_layout``)."""
        outs, layouts = [], []
        for name in self.traced.outputs:
            lay, x = self.layout[name], self.env[name]
            if isinstance(lay, list):
                raise NotImplementedError(f"step output {name!r} is a tuple; return its tensors one by one")
            if name in self.step.whole:
                whole = Layout.replicated(lay.ndim)
                x = reshard(self, x, lay, whole, _val(self.nodes_by_name[name]), ())   # codegen/reshard_calls.py
                lay = whole
            outs.append(x)
            layouts.append(lay)
        self.g.output(tuple(outs))
        return layouts

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
            obj = retarget_module(obj, self.compute_dtype, self.device)
        name = str(n.target).replace(".", "_")
        self.attrs[name] = obj
        self.env[n.name] = self.g.get_attr(name)
        self.layout[n.name] = Layout.replicated(obj.dim()) if isinstance(obj, torch.Tensor) else None

    def _keeps_shard(self, n: fx.Node, spec, call, new_inputs, producers, needs_grad) -> bool:
        """A linear reading its input through one all-gather, outside a recomputed block: it runs
        as ``runtime.regather.linear_keeping_shard``, as priced (autopar/pricing/regather.py)."""
        if self.full_region or call.target is not torch.ops.aten.linear.default or len(producers) < 2:
            return False
        if not keeps_shard(spec.rule, 0, producers[1].name in needs_grad, _val(producers[0])):
            return False
        return _the_gather(new_inputs[0], self.env[producers[0].name]) is not None

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
            x = reshard(self, self.env[p.name], src, dst, v, tuple(pga))   # codegen/reshard_calls.py
            if self.decomp is not None and i in self.decomp.input_scales.get(n.name, ()):
                # a batch-independent term added to the loss's share: counted once per step
                x = self.call(operator.mul, (x, 1.0 / self.nm))
            new_inputs.append(x)

        nm = self.nm if self.decomp is not None and n.name in self.decomp.reduces_batch else 1
        call = local_call(n, spec, st, self.mesh_shape, nm)
        it = iter(new_inputs)
        args, kwargs = pytree.tree_map_only(fx.Node, lambda _: next(it), (tuple(call.args), dict(call.kwargs)))
        # traced in fp32 on cpu/meta: the working dtype and the rank's device (codegen/retarget.py)
        args, kwargs = retarget(args, kwargs, self.compute_dtype, self.device)
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
        elif self._keeps_shard(n, spec, call, new_inputs, producers, needs_grad):
            gather = _the_gather(new_inputs[0], self.env[producers[0].name])   # runtime/regather.py
            out = self.call(RG.linear_keeping_shard, (args[0], gather.args[0], *args[1:]),
                            dict(kwargs, dim=gather.args[1], axis=gather.kwargs["axis"],
                                 zigzag=gather.target is SX.zz_all_gather), name=n.name)
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
            out = global_mean(self, n, out, args, kwargs, op)   # codegen/loss_counts.py
        self.env[n.name] = out
        outs = [self.norm(Layout.from_json(j)) for j in op["outputs"]]
        v = _val(n)
        self.layout[n.name] = outs if isinstance(v, (tuple, list)) else outs[0]


def _the_gather(x, shard):
    """The emitted all-gather of ``shard`` that ``x`` is (one reshard step, maybe followed by
    ``copy`` conjugates: identities forward), or None."""
    while isinstance(x, fx.Node) and x.target is RC.copy:
        x = x.args[0]
    if isinstance(x, fx.Node) and x.target in (RC.all_gather, SX.zz_all_gather) and x.args[0] is shard:
        return x
    return None


def generate(traced, plan, rank: int, zero3_chunks: dict[str, int] | None = None,
             compute_dtype: torch.dtype | None = None, device=None,
             batch_carrying: set[str] | None = None) -> RankProgram:
    """The per-rank program of ``plan`` for ``rank`` (see the module docstring). ``traced`` is the
    graph of ONE micro-batch; with several micro-batches ``batch_carrying`` names its nodes whose
    values carry the batch (``autopar.rules.microbatch.batch_carrying``)."""
    if not 0 <= rank < plan.mesh.size:
        raise ValueError(f"rank {rank} is outside the plan's mesh {plan.mesh.describe()} ({plan.mesh.size} ranks)")
    return _Builder(traced, plan, rank, zero3_chunks, compute_dtype, device, batch_carrying).build()



@dataclass(frozen=True)
class StepEnds:
    """How an inference step's program ends (``generate_step``): ``state`` maps a state input
    (a KV-cache tensor) to the output it is returned as; ``whole`` names outputs returned
    replicated (e.g. the logits, gathered from a vocabulary-split head)."""
    state: dict[str, str]
    whole: frozenset[str] = frozenset()


def generate_step(traced, plan, rank: int, state: dict[str, str] | None = None, whole=(),
                  compute_dtype: torch.dtype | None = None, device=None) -> StepProgram:
    """The per-rank program of a step traced by ``autopar.frontend.trace.trace_step``: it returns
    every traced output (``traced.outputs``, in order) instead of a loss, each as this rank's block
    in the plan's layout (``StepProgram.output_layouts``), or replicated for the outputs named in
    ``whole``. The inputs named in ``state`` (input name -> the output it is returned as: a KV
    cache) are taken as this rank's blocks in that output's layout (``StepProgram.input_layouts``),
    so a step's state outputs are the next step's state inputs with no communication; other user
    inputs are taken as ``generate`` takes them. No micro-batches, no ZeRO-3."""
    state = dict(state or {})
    unknown = sorted(set(state) - set(traced.input_names)) + sorted(set(state.values()) - set(traced.outputs))
    bad_whole = sorted(set(whole) - set(traced.outputs))
    if unknown or bad_whole:
        raise ValueError(f"generate_step: not an input/output of the traced step: {unknown + bad_whole}")
    if set(whole) & set(state.values()):
        raise ValueError(f"generate_step: state outputs stay in their layout, not gathered whole: "
                         f"{sorted(set(whole) & set(state.values()))}")
    if not 0 <= rank < plan.mesh.size:
        raise ValueError(f"rank {rank} is outside the plan's mesh {plan.mesh.describe()} ({plan.mesh.size} ranks)")
    return _Builder(traced, plan, rank, None, compute_dtype, device, None,
                    step=StepEnds(state, frozenset(whole))).build()
