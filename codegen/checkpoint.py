"""Activation checkpoint regions in a per-rank program: which block instances the plan
checkpoints, and the post-pass that outlines each one into a sub-GraphModule.

``checkpointed_groups(traced, plan) -> set[int]``: indices into ``traced.blocks`` of the block
groups the plan checkpoints fully (``plan.data["stages"][0]["checkpoint"]``, group name -> True;
"selective" groups outline only their attention cores: codegen/selective.py).

``outline_regions(gm, regions) -> list[str]``: ``regions`` maps a region name (the instance's
module, e.g. ``blocks.1``) to the program nodes codegen/per_rank.py emitted for that instance,
in graph order: the instance's ops, the reshard collectives and conjugates emitted for their
inputs, and ZeRO-3 ``zero3_gather`` / ``zero3_exit`` / ``zero3_free`` calls of its chunk. The span
from the first to the last of them becomes the body of one sub-GraphModule (attribute
``ckpt_blocks_1``), called once as ``runtime.checkpoint.checkpoint_region(body, "blocks.1",
*inputs)``; values used after the span come back as its outputs. The program stays printable:
``program_code(gm)`` prints the top level and then every region body.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.errors import ExecutionError
from autopar.plans.plan_schema import checkpoint_mode_of
from runtime.checkpoint import checkpoint_region


def checkpointed_groups(traced, plan) -> set[int]:
    stages = plan.data.get("stages") or [{}]
    if len(stages) > 1:
        raise ExecutionError("activation checkpointing with several pipeline stages is not implemented")
    decided = dict(stages[0].get("checkpoint") or {})
    names = {grp.name: g for g, grp in enumerate(traced.blocks)}
    unknown = sorted(set(decided) - set(names))
    if unknown:
        raise ExecutionError(f"the plan checkpoints block groups {unknown} that the traced model does not have "
                             f"(it has {sorted(names)}): plan made for a different model")
    return {names[n] for n, on in decided.items() if checkpoint_mode_of(on) == "full"}


def attr_name(region: str) -> str:
    return "ckpt_" + "".join(ch if ch.isalnum() else "_" for ch in region)


def _span(graph: fx.Graph, nodes: list[fx.Node], region: str, owner: dict) -> list[fx.Node]:
    """Every node from the first to the last of ``nodes``. Nodes of no region that codegen put in
    between come along (recomputed too); get_attr nodes move before the span (an input)."""
    first, last = nodes[0], nodes[-1]
    span, n = [], first
    while True:
        span.append(n)
        if n is last:
            break
        n = n.next
        if n.op == "root":
            raise ExecutionError(f"checkpoint region {region}: its nodes are not in graph order")
    for n in [m for m in span if m.op == "get_attr"]:
        first.prepend(n)
        span.remove(n)
    other = sorted({owner[m] for m in span if owner.get(m, region) != region})
    if other:
        raise ExecutionError(f"checkpoint region {region}: its nodes interleave with those of {other} in the "
                             f"traced graph; checkpointing interleaved block instances is not supported")
    bad = [m.name for m in span if m.op not in ("call_function", "call_method", "call_module")]
    if bad:
        raise ExecutionError(f"checkpoint region {region}: cannot outline {bad[:3]} (placeholders/output inside)")
    return span


def outline_regions(gm: fx.GraphModule, regions: dict[str, list[fx.Node]]) -> list[str]:
    """Outline every region (module doc); returns the region names in program order."""
    graph = gm.graph
    owner = {n: region for region, nodes in regions.items() for n in nodes}
    done = []
    for region, nodes in regions.items():
        if not nodes:
            continue
        span = _span(graph, nodes, region, owner)
        inside = set(span)
        inputs: list[fx.Node] = []
        for n in span:
            for a in n.all_input_nodes:
                if a not in inside and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in span if any(u not in inside for u in n.users)]
        if not outputs:
            raise ExecutionError(f"checkpoint region {region}: nothing it computes is used afterwards")

        body = fx.Graph()
        env = {a: body.placeholder(a.name) for a in inputs}
        for n in span:
            env[n] = body.node_copy(n, lambda x: env[x])
        body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
        name = attr_name(region)
        setattr(gm, name, fx.GraphModule(torch.nn.Module(), body, class_name=name.title().replace("_", "")))

        with graph.inserting_before(span[0]):
            sub = graph.get_attr(name)
            call = graph.create_node("call_function", checkpoint_region, (sub, region, *inputs), {},
                                     name=name + "_out")
            news = [call] if len(outputs) == 1 else \
                [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
        # the traced node it stands for (its block instance's): pipeline stages place it by that
        source = next((n.meta["autopar_source"] for n in span if n.meta.get("autopar_source")), None)
        if source is not None:
            call.meta["autopar_source"] = source
        for old, new in zip(outputs, news):
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in inside)
        for n in reversed(span):
            graph.erase_node(n)
        done.append(region)
    graph.lint()
    gm.recompile()
    return done


def program_code(gm: fx.GraphModule) -> str:
    """The program's code followed by each checkpoint region's body."""
    parts = [gm.code]
    for name, sub in gm.named_children():
        if name.startswith("ckpt_") and isinstance(sub, fx.GraphModule):
            parts.append(f"\n# checkpoint region body self.{name} (rerun in backward):" +
                         sub.code.replace("def forward(self", f"def {name}(self", 1))
    return "".join(parts)
