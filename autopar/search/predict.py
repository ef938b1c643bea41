"""Predictions of a solved configuration: step time and its breakdown, memory breakdown,
communication bytes per mesh axis, MFU. Computed from the same priced arrays the ILP saw,
so the plan's numbers and the solver's objective cannot drift apart.
"""
from __future__ import annotations

import math

import numpy as np

from autopar.cluster import Cluster
from autopar.plans.plan_schema import checkpoint_mode_of
from autopar.pricing.cost import exposed_comm, profile_of
from autopar.pricing.offload import NVME_MODES, OFFLOAD_BYTES, host_budget, nvme_budget
from autopar.pricing.op_base import has_contraction
from autopar.pricing.price import DEVICE_STATIC, Priced, Settings, device_static, offload_partial, step_host_time
from autopar.rules.attention_core import attention_cores
from autopar.rules.candidates import Candidates
from autopar.rules.localize import local_call
from autopar.rules.microbatch import TARGET_MEAN_LOSSES
from autopar.search.build import chosen
from solver.problem import Problem, Solution


def model_flops(c: Candidates) -> float:
    """Training FLOPs of one step on the global batch: forward + backward (2x for contractions)."""
    total = 0.0
    for info in c.nodes.values():
        if info.kind == "op" and info.spec is not None:
            total += info.spec.flops * (3 if has_contraction(info.spec) else 2)
    return total


def _count_program_edges(c: Candidates, pick: dict, micro_batches: int) -> set[tuple[str, str]]:
    """The (producer, consumer) edges whose forward reshards the count program runs: those into
    the ancestors of each target of a mean loss run as a local sum (``LocalCall.global_mean``),
    and into the loss's target input itself (the program counts the target as the loss reads it)."""
    edges: set[tuple[str, str]] = set()
    for n, k in pick.items():
        info = c.nodes.get(n)
        if info is None or info.kind != "op" or info.spec is None or info.node.target not in TARGET_MEAN_LOSSES:
            continue
        if len(info.node.args) < 2 or not hasattr(info.node.args[1], "all_input_nodes"):
            continue
        if not local_call(info.node, info.spec, info.strategies[k], c.mesh.shape, micro_batches).global_mean:
            continue
        target = info.node.args[1]
        edges.add((target.name, n))
        stack, seen = [target], set()
        while stack:
            x = stack.pop()
            if x.name in seen:
                continue
            seen.add(x.name)
            for p in x.all_input_nodes:
                edges.add((p.name, x.name))
                stack.append(p)
    return {(u, v) for u, v in edges if u in pick and v in pick}


def count_program_bytes(c: Candidates, P: Priced, pick: dict, micro_batches: int) -> dict[str, float]:
    """Mesh axis -> bytes per step of the count program (codegen/loss_counts.py ``count_program``):
    it reruns the forward reshards of the mean losses' targets before the step, once on every rank
    (a Hugging Face shifted-labels path gathers them again)."""
    out = {a: 0.0 for a in c.mesh.names}
    for u, v in _count_program_edges(c, pick, micro_batches):
        for a, arr in enumerate(P.edge_fwd_bytes.get((u, v), [])):
            out[c.mesh.names[a]] += float(arr[pick[u], pick[v]])
    return out


def predict(c: Candidates, P: Priced, s: Settings, problem: Problem, sol: Solution, cluster: Cluster) -> dict:
    mesh = c.mesh
    pick = chosen(problem, sol)
    ckpt = checkpoint_modes(problem, sol.checkpoint)

    def total(d: dict) -> float:
        return float(sum(arr[pick[n]] for n, arr in d.items() if n in pick))

    compute = total(P.compute)
    fwd = total(P.fwd_compute)
    grad_comm = total(P.grad_comm)
    op_comm = total(P.comm) - grad_comm
    optimizer = total(P.optimizer)
    reshard = 0.0
    for (u, v), m in P.edges.items():
        if u in pick and v in pick:
            reshard += float(m[pick[u], pick[v]]) if u != v else float(m[pick[u], pick[u]])
    recompute = 0.0
    for i, g in enumerate(problem.checkpoint_groups):
        if sol.checkpoint[i]:
            recompute += sum(float(arr[sol.choice[n]]) for n, arr in g.recompute_time)
    # Recomputing a checkpointed block reruns its forward collectives: the in-op ones (in
    # recompute_time above) and the reshard steps of the edges into its nodes (codegen emits
    # those with the consumer, inside the consumer's checkpoint region).
    ckpt_groups = {gi for gi, blk in enumerate(c.graph.blocks) if ckpt.get(blk.name) is True}
    recomputed = {n for n, gi in c.block_of_rep.items() if gi in ckpt_groups and c.nodes[n].repeats >= 2}
    recomputed |= selective_nodes(c, ckpt)
    for (u, v), m in P.edge_fwd.items():
        if v in recomputed and u in pick and v in pick:
            recompute += float(m[pick[u], pick[v]])
    cal = profile_of(cluster)
    # the step's host work, priced with the loss (pricing/price.py), is not backward compute that
    # gradient communication could hide behind
    host = step_host_time(c, cal) if c.graph.output_name in pick else 0.0
    backward = compute - fwd - host
    exposed_grad = exposed_comm(grad_comm, backward, s.overlap_grad_comm, cal.overlap_slowdown if cal else 0.0)
    step = compute + op_comm + reshard + exposed_grad + optimizer + recompute

    static = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for n, st in P.static.items():
        for k in DEVICE_STATIC:
            if k in st:
                static[k] = static.get(k, 0.0) + float(st[k][pick[n]])
    peak_name = max(sol.peak_memory, key=lambda k: sol.peak_memory[k]) if sol.peak_memory else None
    peak = float(sol.peak_memory[peak_name]) if peak_name else sum(static.values())
    offload = offload_prediction(P, pick, s, cluster)
    if offload is not None:   # the fewest chunks offloaded that fit: the rest back on the device
        f, kept, (slower_step, more_gathers) = offload_fraction(P, pick, s, peak)
        offload = {**offload, "fraction": f, **{k: int(round(offload[k] * f))
                                                for k in OFFLOAD_BYTES if k in offload}}
        step += slower_step + more_gathers
        optimizer += slower_step
        op_comm += more_gathers
        for k, v in kept.items():
            static[k] += v
        peak += sum(kept.values())
    activations = peak - sum(static.values())
    other = 0.0
    if peak_name and peak_name.startswith("backward@"):
        n = peak_name.split("@", 1)[1]
        if n in pick:
            other = 2 * float(P.transient[n][pick[n]])
    activations -= other

    comm_bytes = {name: 0.0 for name in mesh.names}
    for n, per_axis in P.comm_bytes.items():
        if n in pick:
            for a, arr in enumerate(per_axis):
                comm_bytes[mesh.names[a]] += float(arr[pick[n]])
    for (u, v), per_axis in P.edge_bytes.items():
        if u in pick and v in pick:
            for a, arr in enumerate(per_axis):
                comm_bytes[mesh.names[a]] += float(arr[pick[u], pick[v]])
    for n in recomputed:   # the forward collectives recomputation runs again (see above)
        if n in pick:
            for a, arr in enumerate(P.fwd_comm_bytes.get(n, [])):
                comm_bytes[mesh.names[a]] += float(arr[pick[n]])
    for (u, v), per_axis in P.edge_fwd_bytes.items():
        if v in recomputed and u in pick and v in pick:
            for a, arr in enumerate(per_axis):
                comm_bytes[mesh.names[a]] += float(arr[pick[u], pick[v]])

    for a, x in count_program_bytes(c, P, pick, s.num_micro_batches).items():
        comm_bytes[a] += x

    # compute (forward + backward, all repeats) by op rule: where the step's compute goes
    by_rule: dict[str, float] = {}
    for n, arr in P.compute.items():
        info = c.nodes.get(n)
        if n in pick and info is not None and info.kind == "op" and info.spec is not None:
            by_rule[info.spec.rule] = by_rule.get(info.spec.rule, 0.0) + float(arr[pick[n]])

    if host:
        by_rule[c.nodes[c.graph.output_name].spec.rule] -= host   # priced with the loss: shown apart
        by_rule["step host work"] = host

    # communication in ops and resharding into ops (by the consumer's rule), gradients excluded
    comm_by_rule: dict[str, float] = {}
    for n, arr in P.comm.items():
        info = c.nodes.get(n)
        if n in pick and info is not None and info.kind == "op" and info.spec is not None:
            t = float(arr[pick[n]]) - float(P.grad_comm[n][pick[n]])
            if t > 0:
                comm_by_rule[info.spec.rule] = comm_by_rule.get(info.spec.rule, 0.0) + t
    for (u, v), m in P.edges.items():
        info = c.nodes.get(v)
        if u in pick and v in pick and info is not None and info.spec is not None:
            t = float(m[pick[u], pick[v]])
            if t > 0:
                key = f"reshard->{info.spec.rule}"
                comm_by_rule[key] = comm_by_rule.get(key, 0.0) + t

    dtype = "bf16" if s.precision == "bf16" else "fp32"
    flops = model_flops(c)
    mfu = flops / (step * mesh.size * cluster.device.peak_flops[dtype]) if step > 0 else 0.0
    return {
        "step_time": step,
        "time_breakdown": {"compute": compute, "recompute": recompute, "op_comm": op_comm,
                           "reshard_comm": reshard, "grad_comm": grad_comm, "grad_comm_exposed": exposed_grad,
                           "optimizer": optimizer, "bubble": 0.0},
        "compute_by_rule": dict(sorted(by_rule.items(), key=lambda kv: -kv[1])),
        "comm_by_rule": dict(sorted(comm_by_rule.items(), key=lambda kv: -kv[1])),
        "overlap_grad_comm": s.overlap_grad_comm,
        "peak_memory": int(math.ceil(peak)),
        "memory_breakdown": {k: int(round(v)) for k, v in
                             {**static, "activations": max(0.0, activations), "other": other}.items()},
        "comm_bytes": {k: int(round(v)) for k, v in comm_bytes.items()},
        "model_flops": flops,
        "mfu": mfu,
        "checkpoint": ckpt,
        **({"offload": offload} if offload is not None else {}),
    }


def offload_prediction(P: Priced, pick: dict, s: Settings, cluster: Cluster) -> dict | None:
    """What an offloaded plan holds on and moves to and from the host per rank (per step), from
    the parameters' prices (autopar/pricing/offload.py); None when nothing is offloaded."""
    if s.offload == "none":
        return None
    tot = {k: 0.0 for k in ("host", "d2h", "h2d", "nvme")}
    for n, st in P.static.items():
        if n in pick and "host" in st:
            for k in tot:
                tot[k] += float(st[k][pick[n]])
    out = {"mode": s.offload, "target": "nvme" if s.offload in NVME_MODES else "host", "fraction": 1.0,
           "host_bytes": int(round(tot["host"])), "host_budget": int(host_budget(cluster)),
           "d2h_bytes": int(round(tot["d2h"])), "h2d_bytes": int(round(tot["h2d"]))}
    if s.offload in NVME_MODES:   # the optimizer state on the drives, read and written each step
        out.update(nvme_bytes=int(round(tot["nvme"])), nvme_budget=int(nvme_budget(cluster)))
    return out


def offload_fraction(P: Priced, pick: dict, s: Settings, peak: float) -> tuple[float, dict, tuple]:
    """Gemini's rule: of an offloaded plan, the least fraction of the rank's parameter elements
    whose optimizer (and streamed gradients, and with "optimizer+params" parameter shards) must
    stay on the host for the plan to fit its budget; the runtime offloads whole chunks, first to
    last, until they cover it (runtime/offload.py). Device bytes are the same at every point of the
    step (static), so keeping a share 1 - f on the device raises every memory row by that share
    of the bytes offloading saves, and the step is faster by that share of the difference between
    the host's and the device's optimizer step (and of the host-to-device copies before
    "optimizer+params" gathers). Returns (f, device bytes kept per memory key, (optimizer
    seconds and gather copy seconds to add to the priced step: the prices carry the device's
    step when the fraction is decided here, ``price.offload_partial``, the host's otherwise)). A
    pinned offload and a pipelined candidate's inner search (``Settings.offload_all``: its stages'
    memory is checked later, with every chunk offloaded) offload everything."""
    tot = {k: 0.0 for k in ("kept_optimizer", "kept_grads", "kept_params", "kept_step", "offload_step",
                            "offload_gathers")}
    for n, st in P.static.items():
        if n in pick and "kept_step" in st:
            for k in tot:
                tot[k] += float(st[k][pick[n]])
    saved = tot["kept_optimizer"] + tot["kept_grads"] + tot["kept_params"]
    if not offload_partial(s):
        return 1.0, {}, (0.0, 0.0)
    if saved <= 0:
        f = 1.0
    else:
        f = min(1.0, max(0.0, 1.0 - (s.budget - peak) / saved))
        f = max(math.ceil(f * 1000) / 1000, 1e-3)   # a thousandth of a rank's elements; at least one chunk
    keep = 1.0 - f
    kept = {"optimizer": keep * tot["kept_optimizer"], "grads": keep * tot["kept_grads"],
            "params": keep * tot["kept_params"]}
    return f, kept, (f * max(0.0, tot["offload_step"] - tot["kept_step"]), f * tot["offload_gathers"])


def host_bytes_of(P: Priced, pick: dict | None = None, key: str = "host") -> float:
    """Host bytes (``key`` "nvme": NVMe bytes) of the chosen strategies (``pick``), or the least
    any plan of ``P`` holds."""
    total = 0.0
    for n, st in P.static.items():
        if key in st and len(st[key]):
            total += float(st[key][pick[n]]) if pick is not None else float(np.min(st[key]))
    return total


def checkpoint_modes(problem: Problem, decision) -> dict:
    """Block group -> True (full recompute), False (none) or "selective" (only its attention
    cores: the group's companion "<group>/attention" is on, the group itself off; build.py)."""
    groups = problem.checkpoint_groups
    companion = {g.implied_by: i for i, g in enumerate(groups) if g.implied_by is not None}
    out = {}
    for i, g in enumerate(groups):
        if g.implied_by is not None:
            continue
        sel = i in companion and bool(decision[companion[i]])
        out[g.name] = True if decision[i] else ("selective" if sel else False)
    return out


def selective_nodes(c: Candidates, ckpt: dict) -> set[str]:
    """Representative nodes of the attention cores of the groups ``ckpt`` recomputes selectively."""
    sel = {gi for gi, blk in enumerate(c.graph.blocks) if ckpt.get(blk.name) == "selective"}
    if not sel:
        return set()
    return {n for (gi, i), cores in attention_cores(c.graph).items() if gi in sel and i == 0
            for core in cores for n in core if n in c.nodes and c.nodes[n].repeats >= 2}


def checkpoint_mode(ckpt: dict) -> str:
    """One word for a plan's per-group decisions: none / selective / full / mixed."""
    vals = {checkpoint_mode_of(v) for v in ckpt.values()}
    if not vals:
        return "none"
    return vals.pop() if len(vals) == 1 else "mixed"


def step_time_lower_bound(P: Priced, edges: bool = False, work_only: bool = False) -> float:
    """A lower bound of the predicted step time of any plan of this configuration. Two per-node
    bounds, the larger one counts: (a) each node at its cheapest compute + in-op communication +
    optimizer step, gradient communication free (it may hide behind backward); (b) the same with
    gradient communication but without backward compute (whatever of the gradient communication
    backward cannot hide is exposed: ``step >= forward + all communication + optimizer``).
    Recompute is taken as free. With ``edges`` (P.edges priced), each resharding matrix is added
    to one of its two nodes as its cheapest entry per strategy of that node (every edge to its
    consumer, or every edge to its producer, whichever bound is larger): still a bound for any
    choice, and much tighter where a configuration must reshard. ``work_only``: bound (a) alone,
    i.e. of the plan's compute, in-op and resharding communication and optimizer step, whatever
    its gradient communication (what a pipeline's stages split among themselves:
    autopar/search/pipeline_search.py)."""
    names = [n for n, comp in P.compute.items() if len(comp)]
    if not names:
        return 0.0
    sizes = [len(P.compute[n]) for n in names]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    flat = {f: np.concatenate([getattr(P, f)[n] for n in names])
            for f in ("compute", "comm", "grad_comm", "optimizer", "fwd_compute")}
    ba = flat["compute"] + flat["comm"] - flat["grad_comm"] + flat["optimizer"]
    bb = flat["fwd_compute"] + flat["comm"] + flat["optimizer"]

    def total(base: np.ndarray, add: np.ndarray | None) -> float:
        # each node's cheapest strategy: one reduceat over the nodes' concatenated arrays
        return float(np.minimum.reduceat(base if add is None else base + add, starts).sum())

    if not edges:
        return total(ba, None) if work_only else max(total(ba, None), total(bb, None))
    to_cons, to_prod = _edge_additions(P, names, starts, len(ba))
    if work_only:
        return max(total(ba, to_cons), total(ba, to_prod))
    return max(total(ba, to_cons), total(ba, to_prod), total(bb, to_cons), total(bb, to_prod))


def _edge_additions(P: Priced, names: list, starts, length: int):
    """For ``step_time_lower_bound(edges=True)``: every resharding matrix's cheapest entry per strategy
    of its consumer (first array) or of its producer (second), summed per node and laid out like the
    nodes' concatenated arrays. Kept on ``P`` (a configuration's bound is asked up to four times), not
    in a module-level cache that would keep every search's matrices alive."""
    edges = P.edges
    got = P.edge_additions
    if got is not None and got[0] is edges and got[1] == names:
        return got[2]
    where = {n: int(s) for n, s in zip(names, starts)}
    to_cons, to_prod = np.zeros(length), np.zeros(length)
    for (u, v), m in edges.items():
        if u not in where or v not in where:
            continue
        if u == v:
            d = np.diag(m)
            to_cons[where[v]:where[v] + len(d)] += d
            to_prod[where[u]:where[u] + len(d)] += d
            continue
        a, b = m.min(axis=0), m.min(axis=1)
        to_cons[where[v]:where[v] + len(a)] += a
        to_prod[where[u]:where[u] + len(b)] += b
    P.edge_additions = (edges, names, (to_cons, to_prod))
    return to_cons, to_prod


def static_memory_lower_bound(P: Priced) -> float:
    """Parameters, gradients and optimizer state at their most sharded layouts: no plan of this
    configuration needs less memory than this."""
    total = 0.0
    for parts in P.static.values():
        arr = device_static(parts)
        if len(arr):
            total += float(np.min(arr))
    return total
