"""Selective activation recompute in a per-rank program (Korthikanti et al. 2022): which nodes
form the attention-core checkpoint regions of the block groups a plan recomputes selectively.

``selective_regions(traced, plan) -> {node name: region name}``: for every block instance of a
group whose ``stages[0].checkpoint`` decision is "selective", each node of its attention core
(autopar/rules/attention_core.py: the nodes between the q/k/v projections' outputs and the output
projection's input, the s^2 part included) maps to the region ``"<instance>.attention_core"``.
codegen/per_rank.py records every node it emits for those nodes (their reshard collectives
included) under that region, and codegen/checkpoint.py's ``outline_regions`` outlines each into
one ``checkpoint_region`` call, exactly as a fully checkpointed block: the region keeps its
inputs (q, k, v, the mask), backward reruns the core (runtime/checkpoint.py counts it), and its
random ops (attention dropout) redraw the same masks from the program call's rng position.
"""
from __future__ import annotations

from autopar.rules.attention_core import attention_cores, core_region_name
from autopar.plans.plan_schema import checkpoint_mode_of


def selective_groups(traced, plan) -> set[int]:
    """Indices into ``traced.blocks`` of the groups the plan recomputes selectively."""
    stages = plan.data.get("stages") or [{}]
    decided = dict(stages[0].get("checkpoint") or {})
    return {g for g, grp in enumerate(traced.blocks) if checkpoint_mode_of(decided.get(grp.name)) == "selective"}


def selective_regions(traced, plan) -> dict[str, str]:
    groups = selective_groups(traced, plan)
    if not groups:
        return {}
    out = {}
    for (g, i), cores in attention_cores(traced).items():
        if g not in groups:
            continue
        fqn = traced.blocks[g].module_fqns[i]
        for k, core in enumerate(cores):
            for n in core:
                out[n] = core_region_name(fqn, k)
    return out


__all__ = ["selective_groups", "selective_regions"]
