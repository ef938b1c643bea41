"""Per-block-instance prices of an inner plan for the stage partition (autopar/search/pipeline.py,
step 2): ``stage_costs`` reads the inner plan's priced arrays (the ILP's chosen strategies) and
returns, per instance of the repeated blocks and for the prologue / epilogue, the seconds per
micro-batch (with its forward part), static and saved bytes, the bytes a boundary after it sends,
the bytes per mesh axis, and under activation checkpointing the recomputation's seconds and
working set. A repeated block's representative is divided by its repeats; ZeRO-3's gathers go
with the stage(s) holding the parameter, gradient traffic stays with the whole-step ``rest``.
Reshards and the copies they save go to the instances they actually enter, which need not be
alike (the first block reads the prologue, the others the block before: ``_edge_shares``,
``saved_copies.copy_bytes_by_instance``); the count program's reshards run once per step on
every rank (``count_bytes``).
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from autopar.pricing.price import device_static
from autopar.pricing.saved_copies import copy_bytes_by_instance, per_representative
from autopar.search.build import _block_input_roots, chosen
from autopar.search.predict import count_program_bytes
from codegen.stages import pipeline_units


@dataclasses.dataclass
class StageCosts:
    unit_time: list[float]       # seconds per micro-batch of each block instance
    unit_static: list[float]     # static bytes of each instance's parameters
    unit_saved: list[float]      # saved activation bytes per micro-batch
    unit_out: list[float]        # bytes of the instance's output (what a boundary after it sends)
    pro: tuple[float, float, float]   # prologue (time, static, saved)
    epi: tuple[float, float, float]
    unit_bytes: list[dict] = dataclasses.field(default_factory=list)   # per instance: mesh axis -> bytes per step
    pro_bytes: dict = dataclasses.field(default_factory=dict)
    epi_bytes: dict = dataclasses.field(default_factory=dict)
    unit_fwd: list[float] = dataclasses.field(default_factory=list)   # forward part of unit_time
    pro_fwd: float = 0.0
    epi_fwd: float = 0.0
    # activation checkpointing (the inner plan's "full" groups): per instance the seconds of its
    # recomputation per micro-batch (in unit_time, backward part) and the bytes its recomputation
    # saves again in backward beyond its kept input (one block at a time: a stage counts its largest)
    unit_recompute: list[float] = dataclasses.field(default_factory=list)
    unit_recompute_memory: list[float] = dataclasses.field(default_factory=list)
    # per instance: storages made before the blocks that all its group's instances save (RoPE
    # tables, a mask): root -> bytes per micro-batch. Every stage recomputes them and holds each
    # once, whatever share of the blocks it runs (``stage_plan.memory_parts`` counts each once)
    unit_shared: list[dict] = dataclasses.field(default_factory=list)
    # the count program's reshards (codegen/loss_counts.py: every rank counts the mean losses'
    # valid targets once per step, before the schedule): mesh axis -> bytes, on every rank
    count_bytes: dict = dataclasses.field(default_factory=dict)


def stage_costs(result, graph) -> StageCosts:
    """Per-instance and prologue/epilogue figures from the inner plan's priced arrays."""
    cands, P = result.cands, result.priced
    pick = chosen(result.problem, result.solution)
    # saved copies made by reshards (autopar/pricing/saved_copies.py), per graph node: a block
    # instance's own go to its unit (esv below), the representative's row carries none of them
    by_node = copy_bytes_by_instance(cands, P, pick)
    copies = per_representative(cands, by_node)
    nm = result.config.settings.num_micro_batches
    units = pipeline_units(graph)
    order = {n.name: k for k, n in enumerate(graph.gm.graph.nodes)}
    first_block = min(order[graph.blocks[g].instances[i][0]] for g, i in units)
    groups = {g for g, _ in units}
    t = {g: 0.0 for g in groups}
    tf = {g: 0.0 for g in groups}   # forward seconds per micro-batch
    fwd_pe = [0.0, 0.0]             # prologue, epilogue forward seconds
    st = {g: 0.0 for g in groups}
    sv = {g: 0.0 for g in groups}
    out = {g: 0.0 for g in groups}
    last_pos = {g: -1 for g in groups}
    pro, epi = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    names = result.config.mesh.names
    ub = {g: {a: 0.0 for a in names} for g in groups}
    shared = {g: {} for g in groups}   # storages all instances save, made before the blocks
    pro_b, epi_b = {a: 0.0 for a in names}, {a: 0.0 for a in names}
    # Checkpointed block groups (full recompute, as build.py prices them): a checkpointed instance
    # keeps only its input (priced as the output of the group's last node, as in the ILP), and its
    # backward reruns its forward (compute, in-op forward collectives, reshards into its nodes).
    modes = result.prediction.get("checkpoint") or {}
    full = {g for g in groups if modes.get(graph.blocks[g].name) is True}
    rec_t = {g: 0.0 for g in groups}
    rec_m = {g: 0.0 for g in groups}
    inputs_of = {g: _block_input_roots(cands, g) for g in full}

    def add_bytes(name, per_axis, r):
        """A node's (or edge's) bytes per mesh axis go with the node's block, prologue or epilogue."""
        vals = {names[a]: float(x) for a, x in enumerate(per_axis)}
        if name in graph.block_of:
            for a, x in vals.items():
                ub[graph.block_of[name][0]][a] += x / r
            return
        where = {order[name] < first_block} if name in order else set()
        for dst in ([pro_b] if True in where else []) + ([epi_b] if False in where else []):
            for a, x in vals.items():
                dst[a] += x
    users = {}
    for n in graph.gm.graph.nodes:
        for a in n.all_input_nodes:
            users.setdefault(a.name, []).append(n.name)
    for name in cands.order:
        info = cands.nodes[name]
        if name not in pick or info.repeats == 0:
            continue
        k, r = pick[name], max(1, info.repeats)
        if name in P.comm_bytes:
            per = [arr[k] for arr in P.comm_bytes[name]]
            if info.kind == "param":   # gradient traffic: with the parameter's block(s)
                gs = {graph.block_of[u][0] for u in users.get(name, []) if u in graph.block_of}
                if gs and all(u in graph.block_of for u in users.get(name, [])):
                    for g in gs:
                        for a, x in enumerate(per):
                            ub[g][names[a]] += float(x) / r
                else:
                    for side, dst in ((True, pro_b), (False, epi_b)):
                        if side in {order[u] < first_block for u in users.get(name, []) if u not in graph.block_of}:
                            for a, x in enumerate(per):
                                dst[names[a]] += float(x)
            else:
                add_bytes(name, per, r)
        if info.kind == "param":
            s = float(device_static(P.static[name])[k]) if name in P.static else 0.0
            # ZeRO-3's gathers (one for forward, one for backward, per micro-batch): on the stage(s)
            # holding the parameter, in its time per micro-batch; gradient traffic stays in ``rest``
            gt = (float(P.comm[name][k]) - float(P.grad_comm[name][k])) / nm if name in P.comm else 0.0
            gs = {graph.block_of[u][0] for u in users.get(name, []) if u in graph.block_of}
            if gs and all(u in graph.block_of for u in users.get(name, [])):
                for g in gs:
                    st[g] += s / r
                    t[g] += gt / r
                    tf[g] += gt / 2 / r
            else:   # read outside the blocks: the prologue's, the epilogue's, or both (tied)
                where = {order[u] < first_block for u in users.get(name, []) if u not in graph.block_of}
                if True in where:
                    pro[1] += s
                    pro[0] += gt
                    fwd_pe[0] += gt / 2
                if False in where:
                    epi[1] += s
                    epi[0] += gt
                    fwd_pe[1] += gt / 2
            continue
        if info.kind != "op":
            continue
        time = float(P.compute[name][k]) + float(P.comm[name][k]) - float(P.grad_comm[name][k])
        time /= nm   # per micro-batch
        # forward share: the op's forward compute share of its compute, applied to its whole time
        comp = float(P.compute[name][k])
        fshare = float(P.fwd_compute[name][k]) / comp if comp > 0 and name in P.fwd_compute else 0.5
        saved = (float(P.saved[name][k]) if name in P.saved else 0.0) + copies.get(name, 0.0)
        if name in graph.block_of:
            g = graph.block_of[name][0]
            t[g] += time / r
            tf[g] += time * fshare / r
            sv[g] += (saved - copies.get(name, 0.0)) / r
            for root in shared_roots(cands, graph, name, P.saved_by_root.get(name, {})):
                b = float(P.saved_by_root[name][root][k])
                sv[g] -= b / r
                shared[g][root] = max(shared[g].get(root, 0.0), b)
            if g in full:
                again = saved - sum(float(arr[k]) for root, arr in P.saved_by_root.get(name, {}).items()
                                    if root in inputs_of[g])
                rec_m[g] += again / r
                fwd_comm = float(P.fwd_comm[name][k] if name in P.fwd_comm else 0.0)
                rec_t[g] += (float(P.fwd_compute[name][k]) + fwd_comm) / nm / r
                for a, arr in enumerate(P.fwd_comm_bytes.get(name, [])):   # its forward collectives run again
                    ub[g][names[a]] += float(arr[k]) / r
            if order[name] > last_pos[g] and name in P.transient:
                last_pos[g], out[g] = order[name], float(P.transient[name][k])
        else:
            dst = pro if order[name] < first_block else epi
            dst[0] += time
            dst[2] += saved
            fwd_pe[0 if order[name] < first_block else 1] += time * fshare
    # Resharding goes with its consumer's instance. An edge key (producer rep, consumer rep) sums
    # every graph edge it stands for, and those need not be alike across instances: the embedding's
    # output enters only the first block, the previous block's output the others. Each key's
    # figures are split over the places its graph edges actually run (``_edge_shares``), not
    # spread evenly over the consumer's repeats (which would put part of the embedding's reshard
    # on another pipeline rank).
    shares = _edge_shares(cands, graph, order, first_block)
    eb = {u: {a: 0.0 for a in names} for u in units}   # per instance: edge bytes per axis
    et = {u: 0.0 for u in units}                       # per instance: edge seconds per micro-batch
    etf = {u: 0.0 for u in units}                      # ... their forward part
    ert = {u: 0.0 for u in units}                      # ... what recomputation reruns
    for (u, v), per_axis in P.edge_bytes.items():
        if u in pick and v in pick:
            vals = [float(arr[pick[u], pick[v]]) for arr in per_axis]
            for place, w in shares.get((u, v), ()):
                dst = eb[place] if place in eb else (pro_b if place == "pro" else epi_b)
                for a, x in enumerate(vals):
                    dst[names[a]] += w * x
    for (u, v), per_axis in P.edge_fwd_bytes.items():   # recomputation reruns the reshards into a block
        if u in pick and v in pick:
            vals = [float(arr[pick[u], pick[v]]) for arr in per_axis]
            for place, w in shares.get((u, v), ()):
                if place in eb and place[0] in full:
                    for a, x in enumerate(vals):
                        eb[place][names[a]] += w * x
    for (u, v), mat in P.edges.items():   # and so does its time
        if u in pick and v in pick:
            secs = float(mat[pick[u], pick[v]]) / nm
            fsecs = float(P.edge_fwd[(u, v)][pick[u], pick[v]]) / nm if (u, v) in P.edge_fwd else 0.0
            for place, w in shares.get((u, v), ()):
                if place in et:
                    et[place] += w * secs
                    etf[place] += w * fsecs
                    if place[0] in full:   # recomputation reruns the reshards into the block
                        ert[place] += w * fsecs
                else:
                    (pro if place == "pro" else epi)[0] += w * secs
                    fwd_pe[0 if place == "pro" else 1] += w * fsecs
    esv = {u: 0.0 for u in units}   # per instance: its saved copies
    for name, b in by_node.items():
        if name in graph.block_of:
            g, inst = graph.block_of[name][:2]
            if (g, inst) in esv and g not in full:
                esv[(g, inst)] += b
    for g in full:
        last = graph.blocks[g].instances[0][-1]
        sv[g] = float(P.transient[last][pick[last]]) if last in pick else out[g]   # what it keeps
        t[g] += rec_t[g]
    return StageCosts([t[g] + et[u] + ert[u] for u in units for g in [u[0]]],
                      [st[g] for g, _ in units], [sv[g] + esv[u] for u in units for g in [u[0]]],
                      [out[g] for g, _ in units], tuple(pro), tuple(epi),
                      [{a: ub[g][a] + eb[u][a] for a in names} for u in units for g in [u[0]]], pro_b, epi_b,
                      [tf[g] + etf[u] for u in units for g in [u[0]]], fwd_pe[0], fwd_pe[1],
                      [rec_t[g] + ert[u] for u in units for g in [u[0]]],
                      [rec_m[g] for g, _ in units],
                      [dict(shared[g]) if g not in full else {} for g, _ in units],
                      count_program_bytes(cands, P, pick, nm))


def shared_roots(cands, graph, name: str, charged: dict) -> list:
    """The storage roots representative ``name`` is charged for that every instance it stands
    for saves as one storage made outside the blocks (a RoPE table; saved_roots charges such a
    storage once, not once per instance)."""
    if cands.nodes[name].repeats < 2 or not charged:
        return []
    reads = [{cands.storage_root.get(p.name, p.name) for p in cands.inputs(cands.nodes[u].node)}
             for u in cands.instances(name)]
    return [root for root in charged if root not in graph.block_of and all(root in rd for rd in reads)]


def _edge_shares(cands, graph, order, first_block) -> dict:
    """Edge key (producer rep, consumer rep) -> [(place, share)]: where the graph edges the key
    stands for run (a block instance (group, instance), "pro" or "epi"), each with its fraction
    of the key's edges."""
    count: dict = {}
    for name in cands.order:
        info = cands.nodes[name]
        if info.kind != "op":
            continue
        b = graph.block_of.get(name)
        place = (b[0], b[1]) if b is not None else ("pro" if order.get(name, 0) < first_block else "epi")
        for p in cands.inputs(info.node):
            if p.name in cands.nodes:
                count.setdefault((cands.nodes[p.name].rep, info.rep), Counter())[place] += 1
    return {k: [(place, n / sum(c.values())) for place, n in c.items()] for k, c in count.items()}


__all__ = ["StageCosts", "shared_roots", "stage_costs"]
