"""Split one rank's program into pipeline stages: one fx GraphModule per stage.

``split_stages(prog, traced, unit_stage, num_stages) -> list[StageProgram]`` (a training program);
``split_step_stages(...) -> list[StepStageProgram]`` (an inference step's program)

The units a pipeline partitions are the traced graph's repeated-block instances, in graph order
(``pipeline_units``); ``unit_stage[u]`` is the stage of unit ``u`` (non-decreasing). Every node of
the per-rank program carries the traced node it was emitted for (``meta["autopar_source"]``,
codegen/per_rank.py), so a node of block instance ``u`` runs on ``unit_stage[u]``. A node outside
every block (embeddings before the first block, final norm / head / loss after the last) runs on
the stage of the last block node before it (stage 0 for the prologue, the last stage for the
epilogue), and never before a stage that produces one of its inputs.

Values that do not depend on a trainable parameter (the inputs' own computations: positions,
masks, the random ops' position tick, constants) are not sent between stages: they are copied
into every stage that reads them (each stage computes them from the micro-batch's inputs, which
every stage receives). What crosses the boundary between stage k and k+1 is every
parameter-dependent value produced on a stage <= k and read on a stage > k, in program order;
a stage passes on what it receives but does not use.

A stage's GraphModule takes ``(*params, *received, *inputs)``: the parameter/buffer placeholders
it reads (program order; ``param_names``), the values of the previous boundary, and the user
inputs it reads (``input_positions`` into the program's inputs). It returns the tuple of the next
boundary's values, or the loss on the last stage. A parameter read on several stages (a tied
embedding and output head) appears in each; its gradient is summed between them at run time
(runtime/pipeline.py).

Inference steps (``split_step_stages``, a ``StepProgram`` of codegen/per_rank.py
``generate_step``): the same cut, but the step's parameters are all frozen, so "parameter-
dependent" means dependent on a weight (a frozen parameter; true buffers such as a rotary
``inv_freq`` are copied like the inputs, every stage computing its cos / sin and attention mask
from the step inputs). There is no loss: stage s returns ``(*sent, *results)``, its results being
the step outputs computed on it (a layer's updated cache on its layer's stage, the logits on the
last), ``StepStageProgram.outputs`` their indices; each state input (a cache tensor) is read by
the stage that returns its output. ``even_stages`` is the even cut by blocks.

Activation checkpointing: a checkpointed block instance is one ``checkpoint_region`` call in the
program (codegen/checkpoint.py), which carries its block's source node, so it goes to its block's
stage like the nodes it replaced (its sub-GraphModule, a ``get_attr``, is copied along); the stage
program runs it under torch.utils.checkpoint as the unpipelined program does (runtime/checkpoint.py).

ZeRO-3 (``add_zero3_regions``): the per-rank program of a pipelined plan is generated without
ZeRO-3 calls (a chunk's region in the whole program may span stages: the embedding and the head
of a tied table); each stage program gets its own, as codegen/per_rank.py places them in an
unpipelined program: a chunk is gathered before the first node of the stage that reads one of
its parameters (or a value computed from its parameters alone: a view, a cast, a reshard), freed
after the last one unless that is the loss, and the values leaving the region are wrapped in
``zero3_exit`` so backward re-gathers it. So every stage gathers each of its chunks once per
micro-batch for forward and once for backward, what the planner prices (2 x micro-batches).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.errors import ExecutionError
from runtime import context as RC


@dataclass
class StageProgram:
    index: int
    gm: fx.GraphModule
    param_names: list[str]          # program parameter/buffer placeholders this stage reads
    input_positions: list[int]      # positions (into the program's user inputs) this stage reads
    received: list[str]             # program values received from the previous stage, in order
    sent: list[str] = field(default_factory=list)   # program values sent to the next stage


def pipeline_units(traced) -> list[tuple[int, int]]:
    """Every repeated-block instance, as (group, instance), in graph order of its first node."""
    first = {}
    order = {n.name: k for k, n in enumerate(traced.gm.graph.nodes)}
    for g, grp in enumerate(traced.blocks):
        for i, names in enumerate(grp.instances):
            first[(g, i)] = min(order[n] for n in names)
    return sorted(first, key=lambda u: first[u])


def assign_stages(gm: fx.GraphModule, traced, unit_stage: list[int], trainable: set[str]) -> tuple[dict, set]:
    """(node -> stage for parameter-dependent nodes, set of replicable nodes); see the module doc."""
    units = {u: k for k, u in enumerate(pipeline_units(traced))}
    if len(unit_stage) != len(units):
        raise ExecutionError(f"the plan's pipeline partitions {len(unit_stage)} blocks but the traced model has "
                             f"{len(units)}: plan made for a different model")
    stage: dict[fx.Node, int] = {}
    replicable: set[fx.Node] = set()
    dep: set[fx.Node] = set()
    cur = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.name in trainable:
                dep.add(n)
            continue
        if n.op == "output":
            continue
        src = n.meta.get("autopar_source")
        g, i, _ = traced.block_of.get(src, (None, None, None)) if src else (None, None, None)
        if g is not None:
            cur = unit_stage[units[(g, i)]]
        if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("zero3_"):
            # ZeRO-3's gather/free calls are side effects tied to a chunk, not to a value: a pipelined
            # program is generated without them and each stage gets its own (add_zero3_regions)
            raise ExecutionError(f"pipeline stages: the program node {n.name} ({n.target}) has side effects only; "
                                 f"generate a pipelined program without zero3_chunks (add_zero3_regions per stage)")
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
            stage[n] = max([cur] + [stage[a] for a in n.all_input_nodes if a in stage])
        else:
            replicable.add(n)
    return stage, replicable


def split_stages(prog, traced, unit_stage: list[int], num_stages: int) -> list[StageProgram]:
    """One StageProgram per stage (module doc)."""
    gm = prog.gm
    trainable = {n for n in prog.param_names if n not in prog.buffers}
    stage, _ = assign_stages(gm, traced, unit_stage, trainable)
    loss = list(gm.graph.nodes)[-1].args[0]
    if not isinstance(loss, fx.Node) or loss not in stage:
        raise ExecutionError("pipeline stages: the program's loss does not depend on any trainable parameter")
    return _cut(prog, stage, num_stages, {num_stages - 1: [loss]}, bare_last=True)


@dataclass
class StepStageProgram(StageProgram):
    """One stage of an inference step's program (``split_step_stages``): its GraphModule returns
    ``(*sent, *results)``, ``outputs`` the indices (into the step program's outputs) of its
    results in order; ``state_inputs`` the state inputs (a KV cache) it takes, each returned by
    this same stage."""
    outputs: list[int] = field(default_factory=list)
    state_inputs: list[str] = field(default_factory=list)


def even_stages(num_units: int, num_stages: int) -> list[int]:
    """``unit_stage`` of an even cut: unit u on stage ``u * num_stages // num_units`` (the first
    stages take one unit fewer when they do not divide)."""
    if not 1 <= num_stages <= num_units:
        raise ExecutionError(f"pipeline stages: {num_stages} stages for {num_units} blocks")
    return [u * num_stages // num_units for u in range(num_units)]


def split_step_stages(prog, traced, unit_stage: list[int], num_stages: int) -> list[StepStageProgram]:
    """The stages of an inference step's program (codegen/per_rank.py ``generate_step``, a
    ``StepProgram``): cut at block boundaries as ``split_stages`` cuts a training program (what
    depends on a parameter runs on its block's stage, the inputs' own computations are copied into
    every stage that reads them, the boundary values go from stage k to k + 1), but instead of a
    loss every stage returns the step outputs computed on it: output i is returned by the stage
    that computes it (a value computed from the inputs alone: the last stage). A state input must
    be read by the stage that returns its output (a layer's cache stays on its layer's stage).
    The step's parameters are frozen: "parameter-dependent" means dependent on a weight (a frozen
    parameter), not on a buffer."""
    gm = prog.gm
    # a step's parameters are frozen (trace_step lists them with the buffers): the weights are
    # what a stage holds, the true buffers (rotary inv_freq) are copied like the inputs
    weights = {n for n in prog.param_names if n not in prog.buffers or n in traced.frozen}
    stage, _ = assign_stages(gm, traced, unit_stage, weights)
    results = list(gm.graph.nodes)[-1].args[0]
    last = num_stages - 1
    finals: dict[int, list[fx.Node]] = {}
    out_stage = []
    for r in results:
        s = stage.get(r, last) if isinstance(r, fx.Node) else last
        out_stage.append(s)
        finals.setdefault(s, []).append(r)
    cut = _cut(prog, stage, num_stages, finals, bare_last=False)
    out = []
    for sp in cut:
        idx = [i for i, s in enumerate(out_stage) if s == sp.index]
        names = [prog.input_names[p] for p in sp.input_positions]
        out.append(StepStageProgram(**vars(sp), outputs=idx, state_inputs=[n for n in names if n in prog.state]))
    for name, o in prog.state.items():
        s = out_stage[prog.output_names.index(o)]
        readers = [sp.index for sp in out if name in sp.state_inputs]
        if readers not in ([], [s]):
            raise ExecutionError(f"pipeline stages: state input {name!r} is read on stages {readers} but its "
                                 f"output {o!r} is returned by stage {s}")
    return out


def _cut(prog, stage: dict, num_stages: int, finals: dict[int, list], bare_last: bool) -> list[StageProgram]:
    """The stage GraphModules of ``prog`` given each parameter-dependent node's stage: stage s
    returns its boundary values then ``finals[s]`` (``bare_last``: the last stage returns its one
    final value bare, a training stage's loss)."""
    gm = prog.gm
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    params = set(prog.param_names)
    inputs = [n for n in placeholders if n.name not in params]
    last = num_stages - 1

    # Where each parameter-dependent value is read (the finals: on their stage).
    readers: dict[fx.Node, set[int]] = {}

    def reads(s: int, n: fx.Node, seen: set) -> None:
        """Stage s reads n: note it, and follow replicable values to their parameter-dependent inputs."""
        if n in seen:
            return
        seen.add(n)
        if n in stage or n.op == "placeholder":
            readers.setdefault(n, set()).add(s)
            return
        for a in n.all_input_nodes:
            reads(s, a, seen)

    for n in nodes:
        if n in stage:
            seen: set = set()
            for a in n.all_input_nodes:
                reads(stage[n], a, seen)
    for s, ns in finals.items():
        seen = set()
        for n in ns:
            if isinstance(n, fx.Node):
                reads(s, n, seen)

    boundaries = []
    for k in range(last):
        boundaries.append([n for n in nodes if n in stage and stage[n] <= k
                           and any(s > k for s in readers.get(n, ()))])

    out = []
    for s in range(num_stages):
        recv = boundaries[s - 1] if s > 0 else []
        mine = [n for n in nodes if stage.get(n) == s]
        ends = [n for n in finals.get(s, []) if isinstance(n, fx.Node)]
        # replicable values this stage needs (and their replicable ancestors), plus placeholders
        need: set[fx.Node] = set()
        stack = [a for n in mine for a in n.all_input_nodes] + ends
        if s < last:
            stack += [n for n in boundaries[s]]
        while stack:
            x = stack.pop()
            if x in need or x in stage:
                continue
            need.add(x)
            stack.extend(x.all_input_nodes)
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        used_params = [n for n in placeholders if n.name in params and n in need]
        for n in used_params:
            env[n] = g.placeholder(n.name)
        for n in recv:
            env[n] = g.placeholder("recv_" + n.name)
        used_inputs = [n for n in inputs if n in need]
        for n in used_inputs:
            env[n] = g.placeholder(n.name)
        for n in nodes:
            if n.op in ("placeholder", "output") or n in env:
                continue
            if stage.get(n) == s or (n not in stage and n in need):
                env[n] = g.node_copy(n, lambda a: env[a])
        sent = [n.name for n in boundaries[s]] if s < last else []
        values = [env[n] for n in boundaries[s]] if s < last else []
        values += [env[n] if isinstance(n, fx.Node) else n for n in finals.get(s, [])]
        g.output(values[0] if bare_last and s == last else tuple(values))
        sgm = fx.GraphModule(gm, g, class_name=f"Stage{s}Program")
        out.append(StageProgram(index=s, gm=sgm, param_names=[n.name for n in used_params],
                                input_positions=[inputs.index(n) for n in used_inputs],
                                received=[n.name for n in recv], sent=sent))
    return out


def add_zero3_regions(sp: StageProgram, chunk_of: dict[str, int], returns_loss: bool) -> None:
    """Insert ZeRO-3 gather / exit / free calls into stage program ``sp`` (module doc), in place.
    ``chunk_of``: parameter placeholder name -> index of its chunk in the rank's sharded optimizer
    (parameters not in it, e.g. buffers, are left alone); ``returns_loss``: the stage's output is
    the loss (the last stage), so a region ending there is not freed (backward needs it at once)."""

    g = sp.gm.graph
    nodes = list(g.nodes)
    pos = {n: k for k, n in enumerate(nodes)}
    out_node = nodes[-1]
    # values computed from one chunk's parameters alone (the parameters, their views, casts, reshards)
    derived: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder" and n.name in chunk_of:
            derived[n] = chunk_of[n.name]
        elif n.op == "call_function" and n.all_input_nodes:
            cs = {derived.get(a, -1) for a in n.all_input_nodes}
            if len(cs) == 1 and -1 not in cs:
                derived[n] = cs.pop()
    span: dict[int, list[int]] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        for a in n.all_input_nodes:
            if a in derived:
                s = span.setdefault(derived[a], [pos[n], pos[n]])
                s[1] = max(s[1], pos[n])
    for s in span.values():   # keep a multi-output op's getitems inside its region
        while nodes[s[1] + 1].op == "call_function" and nodes[s[1] + 1].target is operator.getitem:
            s[1] += 1
    loss = out_node.args[0] if returns_loss else None
    exits: dict[fx.Node, list[int]] = {}   # value -> chunks whose region it leaves
    frees = []
    for c, (a, b) in sorted(span.items()):
        with g.inserting_before(nodes[a]):
            g.call_function(RC.zero3_gather, (c,))
        if isinstance(loss, fx.Node) and loss in pos and pos[loss] <= b:
            continue   # the loss is computed in this region
        for m in nodes[a:b + 1]:
            if m.op == "call_function" and m not in derived and any(pos.get(u, -1) > b for u in m.users):
                exits.setdefault(m, []).append(c)
        frees.append((b, c))
    # per end position: the exits of the values leaving, then the frees, before the next node
    cur = {m: m for m in exits}   # a value's latest wrapper (regions may nest: wrap the wrapper)
    for b in sorted({b for b, _ in frees}):
        anchor = nodes[b + 1]
        ending = {c for bb, c in frees if bb == b}
        with g.inserting_before(anchor):
            for m, cs in exits.items():
                mine = tuple(c for c in cs if c in ending)
                if not mine or not _maybe_float_tensor(m):
                    continue
                wrapped = g.call_function(RC.zero3_exit, (cur[m], mine))
                cur[m].replace_all_uses_with(wrapped, delete_user_cb=lambda u, b=b: pos.get(u, -1) > b)
                cur[m] = wrapped
            for c in sorted(ending):
                g.call_function(RC.zero3_free, (c,))
    g.lint()
    sp.gm.recompile()


def _maybe_float_tensor(n: fx.Node) -> bool:
    """A value that may be a floating tensor (zero3_exit passes anything else through unchanged)."""
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.is_floating_point()
    return not isinstance(val, (tuple, list, int, float, bool))


__all__ = ["StageProgram", "StepStageProgram", "pipeline_units", "assign_stages", "split_stages", "even_stages",
           "split_step_stages", "add_zero3_regions"]
