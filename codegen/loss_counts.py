"""Mean losses over targets in a per-rank program, and the count program of their denominators.

Mean losses over targets (cross-entropy / NLL, reduction mean) whose targets are split over a
mesh axis or over micro-batches run as a local sum divided by the GLOBAL denominator
(``runtime.loss.divide``: valid targets, or their class weights, over every rank and micro-batch):
``global_mean(builder, ...)`` emits that division and records what must be counted.
``count_program(builder, gm, root)`` builds ``RankProgram.count_gm``, this rank's share of each
denominator for one micro-batch: the ancestors of the targets (and class weights) copied from the
program, which must not involve a trainable parameter; same placeholders as ``gm``, returns a
tuple with one 0-d float64 per entry of ``mean_losses`` ((loss node, mesh axes its targets are
split over)). autopar.execution.compiled sums it over the micro-batches, all-reduces over those
axes and installs the results before running ``gm``.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.rules.layout import Layout
from autopar.rules.microbatch import TARGET_ARGS
from autopar.errors import ExecutionError
from runtime import loss as RL


def global_mean(builder, n: fx.Node, out: fx.Node, args, kwargs, op: dict) -> fx.Node:
    """A mean loss run as a local sum: divide by its global denominator, and remember what
    the count program must count (module doc)."""

    ti, wi, ii = TARGET_ARGS.get(n.target, (1, 2, 4))
    target = args[ti]
    weight = None if wi is None else _loss_arg(args, kwargs, wi, "weight", None)
    ignore = _loss_arg(args, kwargs, ii, "ignore_index", -100)
    tgt_layout = builder.norm(Layout.from_json(op["inputs"][ti]))
    builder.mean_losses.append((n.name, tuple(sorted(tgt_layout.axes_used()))))
    builder.count_args.append((target, weight, ignore))
    return builder.call(RL.divide, (out, n.name), name=n.name + "_global_mean")


def count_program(builder, gm: fx.GraphModule, root) -> fx.GraphModule:
    """The program computing this rank's share of every mean loss's denominator (module doc)."""

    wanted = [x for t, w, _ in builder.count_args for x in (t, w) if isinstance(x, fx.Node)]
    keep: set[fx.Node] = set()
    stack = list(wanted)
    while stack:
        x = stack.pop()
        if x in keep:
            continue
        keep.add(x)
        stack.extend(x.all_input_nodes)
    trainable = {name for name in builder.traced.param_fqn if name not in builder.traced.buffers}
    bad = sorted(x.name for x in keep if x.op == "placeholder" and x.name in trainable)
    if bad:
        fqns = [builder.traced.param_fqn[b] for b in bad]
        raise ExecutionError(
            f"the mean losses {[n for n, _ in builder.mean_losses]} have targets or class weights computed from "
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
    for t, w, ignore in builder.count_args:
        outs.append(g.call_function(RL.local_count, (env[t], env[w] if isinstance(w, fx.Node) else None,
                                                     int(ignore))))
    g.output(tuple(outs))
    return fx.GraphModule(root, g, class_name=f"Rank{builder.rank}Counts")


def _loss_arg(args, kwargs, i: int, name: str, default):
    return args[i] if len(args) > i else kwargs.get(name, default)
