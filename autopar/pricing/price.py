"""Pricing candidate strategies under one ``Settings`` (step 2 of building a Problem).

``price(candidates, cluster, settings) -> Priced``: per representative node and strategy its
compute (forward + backward, and forward alone for recompute), in-op and gradient-sync
communication, optimizer step, parameter/gradient/optimizer bytes after ZeRO, saved-activation
and transient bytes per micro-batch, and which strategies divide a micro-batch; per edge the
resharding cost matrix (forward + backward), cached per (micro-batches, precision) because it
does not depend on ZeRO. Repeated blocks are priced once and multiplied by their repeats.
Units: seconds and bytes only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from autopar.cluster import Cluster
from autopar.frontend.blocks import param_chunks
from autopar.pricing.cost import (
    TRUST_NORM_BYTES_PER_TENSOR,
    TRUST_RATIO_OPTIMIZERS,
    bucket_share,
    fwd_bwd_compute,
    grad_bucket_bytes,
    optimizer_step_time,
    profile_of,
)
from autopar.pricing.edge_price import _price_edges
from autopar.pricing.local_bytes import runtime_itemsize
from autopar.pricing.memory import state_bytes, zero_shard
from autopar.pricing.mesh_comm import mesh_comm
from autopar.pricing.offload import NVME_MODES, PARAM_MODES, offload_price
from autopar.pricing.op_base import (
    batch_free,
    divides_micro_batch,
    local_intensity,
    op_base,
)
from autopar.pricing.saved_roots import device_order, device_storage_roots, runs_cuda
from autopar.rules.candidates import Candidates
from autopar.rules.table import val as node_val


@dataclass(frozen=True)
class Settings:
    optimizer: str = "adamw"
    precision: str = "bf16"
    zero: int = 0
    num_micro_batches: int = 1
    budget: float = float("inf")
    overlap_grad_comm: bool = True
    # None: the ILP decides per block group; "none" | "selective" | "full": pinned for every group; a
    # sorted tuple of (block group name, bool | mode): those groups pinned, the others by the ILP.
    checkpoint: str | tuple | None = None
    kernels: bool = False   # the plan runs the Triton kernels (autopar/frontend/fuse.py): fused optimizer step
    offload: str = "none"   # "optimizer": master weights and optimizer state on the host (pricing/offload.py);
    # "optimizer+params" also ZeRO-3's parameter shards; "optimizer-nvme": the state on NVMe;
    # "optimizer+params-nvme": both
    offload_all: bool = False   # offload every chunk (a pin), not the fewest that fit (predict.offload_fraction)


def _chunk_numel(c: Candidates) -> dict[str, int]:
    """Trainable parameter (node name) -> elements of its ZeRO chunk (frontend/blocks.param_chunks,
    the chunks execution builds), once per graph."""
    g = c.graph
    got = g.chunk_numel
    if got is None:
        trainable = [n for n in g.param_fqn if n not in g.buffers]
        key = param_chunks(g.blocks, g.param_fqn, trainable)
        vals = {n.name: n for n in g.gm.graph.nodes if n.op == "placeholder"}
        per: dict[int, int] = {}
        for n in trainable:
            per[key[n]] = per.get(key[n], 0) + (node_val(vals[n]).numel() if n in vals else 0)
        got = g.chunk_numel = {n: per[key[n]] for n in trainable}
    return got


def offload_partial(s: Settings) -> bool:
    """Whether an offloaded configuration offloads only the fewest chunks that fit (decided by
    the prediction from its memory slack: autopar/search/predict.py ``offload_fraction``), so its
    prices carry the device's optimizer step and every bound stays below its plan; else (a pinned
    offload, a pipelined candidate's inner search whose stages' memory is checked with every chunk
    offloaded: autopar/search/pipeline.py, or no budget) everything is offloaded and priced so."""
    return s.offload != "none" and not s.offload_all and math.isfinite(s.budget)


DEVICE_STATIC = ("params", "grads", "optimizer", "gathered")   # a parameter's device bytes (``static``)


def device_static(st: dict) -> np.ndarray:
    """A parameter's static device bytes per strategy: its ``static`` entries on the device."""
    return sum(st[k] for k in DEVICE_STATIC if k in st)


def _largest_chunk(c: Candidates, chunk_numel: dict) -> str | None:
    """A trainable parameter (a representative) of the largest ZeRO chunk: under ZeRO-3 that
    chunk is gathered whole around its use and its full gradient exists until it is
    reduce-scattered (runtime/zero.py), which the memory model charges once, to this parameter,
    at its strategy's split (the chunk's other parameters assumed split like it)."""
    reps = [n for n in c.order if n in chunk_numel and c.nodes[n].kind == "param" and c.nodes[n].rep == n
            and n in c.needs_grad]
    return max(reps, key=lambda n: chunk_numel[n]) if reps else None


def _chunk_tensors(c: Candidates) -> dict[str, int]:
    """Trainable parameter (node name) -> tensors in its ZeRO chunk, once per graph."""
    g = c.graph
    got = g.__dict__.get("_chunk_tensors")
    if got is None:
        trainable = [n for n in g.param_fqn if n not in g.buffers]
        key = param_chunks(g.blocks, g.param_fqn, trainable)
        per: dict[int, int] = {}
        for n in trainable:
            per[key[n]] = per.get(key[n], 0) + 1
        got = g.__dict__["_chunk_tensors"] = {n: per[key[n]] for n in trainable}
    return got


def trust_norm_axes(mesh, zero: int) -> list[int]:
    """The mesh axes LAMB/LARS sum their per-tensor norms over (runtime/zero_step.py): every model axis
    of size > 1 (the blocks of a split tensor, replicas masked) and, when ZeRO shards the chunks,
    the data axes of size > 1."""
    return [a for a in mesh.model_axes() if mesh.shape[a] > 1] + \
        ([a for a in mesh.data_axes() if mesh.shape[a] > 1] if zero >= 1 else [])


def step_host_time(c: Candidates, cal) -> float:
    """Seconds of the step's host work outside the program (``cal.step_overhead``, CPU profiles),
    priced once per step with the loss op (the graph's output), the same for each of its
    strategies; 0 when the profile has none or the output is not an op."""
    loss = c.nodes.get(c.graph.output_name)
    if cal is None or not cal.step_overhead or loss is None or loss.kind != "op" or loss.spec is None:
        return 0.0
    return cal.step_overhead

@dataclass
class Priced:
    """Per-representative cost and memory arrays under one Settings (also used by predictions)."""
    compute: dict[str, np.ndarray]          # fwd+bwd compute, all repeats
    fwd_compute: dict[str, np.ndarray]      # forward only (recompute cost), all repeats
    comm: dict[str, np.ndarray]             # in-op algorithm comm + gradient sync, all repeats
    optimizer: dict[str, np.ndarray]
    grad_comm: dict[str, np.ndarray]        # the overlappable part of comm
    # param -> {params, grads, optimizer[, gathered]} device bytes, all repeats (``device_static``;
    # offloaded: also host, d2h and h2d bytes, autopar/pricing/offload.py)
    static: dict[str, dict[str, np.ndarray]]
    saved: dict[str, np.ndarray]            # activation bytes per micro-batch, all repeats
    transient: dict[str, np.ndarray]        # output bytes per micro-batch (one instance)
    edges: dict[tuple[str, str], np.ndarray]
    comm_bytes: dict[str, list[np.ndarray]]  # per node: per mesh axis bytes per strategy (all repeats)
    edge_bytes: dict[tuple[str, str], list[np.ndarray]]
    valid: dict[str, np.ndarray] = field(default_factory=dict)   # strategies whose layouts divide a micro-batch
    # node -> {storage root: its share of ``saved``} for the tensors the op saves that are nodes'
    # outputs (inputs or outputs of the op; internal buffers such as masks are not listed)
    saved_by_root: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    # node -> (input index, storage root, charged by this node, bytes per micro-batch of all
    # repeats) of each activation input it saves: autopar/pricing/saved_copies.py
    saved_inputs: dict[str, list] = field(default_factory=dict)
    # op -> the memory order (output letters) its kernel lays its output out in on this device,
    # where it has one (``saved_roots.device_order``): autopar/pricing/saved_copies.py replays it
    storage_order: dict[str, str] = field(default_factory=dict)
    # Forward halves, what recomputing a checkpointed block runs again: the node's in-op
    # collectives (seconds and bytes per mesh axis, all repeats) and each edge's reshard steps
    # (codegen emits an edge's steps with its consumer, so they belong to the consumer's block).
    fwd_comm: dict[str, np.ndarray] = field(default_factory=dict)
    fwd_comm_bytes: dict[str, list[np.ndarray]] = field(default_factory=dict)
    edge_fwd: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    edge_fwd_bytes: dict[tuple[str, str], list[np.ndarray]] = field(default_factory=dict)
    # (edges, names, per-node arrays): autopar/search/predict.py ``step_time_lower_bound``'s memo
    edge_additions: tuple | None = field(default=None, repr=False, compare=False)


def price(c: Candidates, cluster: Cluster, s: Settings, edges: bool = True) -> Priced:
    """Price every node under ``s``; with ``edges`` also the resharding matrices (the costly
    part: the outer search prices them only for configurations its lower bound keeps)."""
    P = price_nodes(c, cluster, s)
    if edges:
        price_edges(c, cluster, s, P)
    return P


def _edges_key(cluster: Cluster, s: Settings) -> tuple:
    # edges depend on micro-batching and precision only, not on ZeRO
    return (cluster, s.num_micro_batches, s.precision)


def price_edges(c: Candidates, cluster: Cluster, s: Settings, P: Priced) -> None:
    key = _edges_key(cluster, s)
    if key not in c.edge_cache:
        _price_edges(c, cluster, s, mesh_comm(c, cluster), P)
        c.edge_cache[key] = (P.edges, P.edge_bytes, P.edge_fwd, P.edge_fwd_bytes)
    P.edges, P.edge_bytes, P.edge_fwd, P.edge_fwd_bytes = c.edge_cache[key]


def edges_priced(c: Candidates, cluster: Cluster, s: Settings) -> bool:
    """Whether ``price_edges`` for ``s`` is a cache lookup (another ZeRO stage priced them)."""
    return _edges_key(cluster, s) in c.edge_cache


def price_nodes(c: Candidates, cluster: Cluster, s: Settings) -> Priced:
    mesh = c.mesh
    comm = mesh_comm(c, cluster)
    device = cluster.device
    cal = profile_of(cluster)
    nm = s.num_micro_batches
    dtype = "bf16" if s.precision == "bf16" else "fp32"
    dp = math.prod(mesh.shape[a] for a in mesh.data_axes())
    P = Priced({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {})
    charged_roots: set[str] = set()
    cuda = runs_cuda(cluster)
    cache = c.memo.device_roots   # depends on the graph, device and precision only
    if (cuda, s.precision) not in cache:
        cache[cuda, s.precision] = {**c.storage_root, **device_storage_roots(c, cuda, s.precision)}
    roots = cache[cuda, s.precision]
    # gradient collectives run in buckets (cost.bucket_share): size them as the runtime does
    if c.memo.grad_numel is None:
        c.memo.grad_numel = sum(node_val(i.node).numel() * i.repeats for n, i in c.nodes.items()
                                        if i.kind == "param" and i.rep == n and n in c.needs_grad)
    bucket = grad_bucket_bytes(c.memo.grad_numel * (2 if s.precision == "bf16" else 4))

    def share(kind, nbytes, a):
        return bucket_share(comm, kind, nbytes, a, bucket)
    # ZeRO 1-3 reduce-scatter and gather a repeated-block instance's parameters together (one
    # collective per chunk, runtime/zero.py): a parameter pays its share of its chunk's collective
    chunk_numel = _chunk_numel(c)
    gathered = _largest_chunk(c, chunk_numel) if s.zero == 3 else None
    # An offload whose fraction the prediction decides (``offload_partial``): the ILP and every
    # bound see the device's optimizer step, the prediction adds the offloaded share's extra time
    partial = offload_partial(s)
    chunk_tensors = _chunk_tensors(c)
    norm_axes = trust_norm_axes(mesh, s.zero)
    step_host = step_host_time(c, cal)
    # Ops' prices do not depend on the ZeRO stage (only parameters' do): price them once per
    # (cluster, micro-batches, precision) and re-use them for every stage.
    ops_key = ("ops", cluster, nm, s.precision)
    ops_done = c.edge_cache.get(ops_key)
    ops_new: dict = {}
    # what does not depend on the micro-batch count, once per (mesh, precision, device kind): op_base
    op_bases = c.edge_cache.setdefault(("op bases", s.precision, cuda), {})
    compute_memo = c.edge_cache.setdefault(("compute", cluster, dtype), {})   # fwd_bwd_compute is pure
    for name in c.order:
        info = c.nodes[name]
        if info.rep != name:
            continue
        if info.kind == "op" and ops_done is not None:
            for fname, val in ops_done[name].items():
                getattr(P, fname)[name] = val
            continue
        k = info.repeats
        S = len(info.strategies)
        compute = np.zeros(S)
        fwd = np.zeros(S)
        comm_t = np.zeros(S)
        grad_t = np.zeros(S)
        opt_t = np.zeros(S)
        saved = np.zeros(S)
        transient = np.zeros(S)
        axis_bytes = [np.zeros(S) for _ in mesh.shape]
        fwd_comm = np.zeros(S)
        fwd_bytes = [np.zeros(S) for _ in mesh.shape]
        static = {"params": np.zeros(S), "grads": np.zeros(S), "optimizer": np.zeros(S)}
        if s.offload != "none" and info.kind == "param":
            # the host's share (bytes held, copied per step), and what the device would hold and
            # spend if the parameter's chunk stayed there (autopar/search/predict.py offload_fraction)
            static.update(host=np.zeros(S), d2h=np.zeros(S), h2d=np.zeros(S), nvme=np.zeros(S),
                          kept_optimizer=np.zeros(S),
                          kept_grads=np.zeros(S), kept_params=np.zeros(S), kept_step=np.zeros(S),
                          offload_step=np.zeros(S), offload_gathers=np.zeros(S))
        val = node_val(info.node)
        if info.kind == "param":
            numel = val.numel()
            for j, st in enumerate(info.strategies):
                local = numel * st.outputs[0].shard_fraction(mesh.shape)
                sb = zero_shard(state_bytes(local, s.optimizer, s.precision), s.zero, dp)
                if name not in c.needs_grad:   # a buffer: stored, never trained
                    sb = {"params": local * runtime_itemsize(val.dtype, s.precision), "grads": 0, "optimizer": 0}
                opt_local = local / (dp if s.zero >= 1 else 1)
                off = None
                if s.offload != "none" and name in c.needs_grad:
                    off = offload_price(opt_local, s.optimizer, s.precision, cluster, s.zero, nm,
                                        optimizer_step_time(1, s.optimizer, s.precision, device, cal),
                                        params=s.offload in PARAM_MODES, nvme=s.offload in NVME_MODES)
                    static["kept_optimizer"][j] = sb["optimizer"] * k
                    static["kept_grads"][j] = sb["grads"] * k if s.zero >= 2 else 0.0
                    static["kept_params"][j] = sb["params"] * k if off.gather_h2d_bytes else 0.0
                    static["kept_step"][j] = optimizer_step_time(opt_local, s.optimizer, s.precision, device, cal,
                                                                 s.kernels) * k
                    static["offload_step"][j] = off.seconds * k
                    static["offload_gathers"][j] = off.gather_seconds * k
                    sb["optimizer"] = 0.0   # master and state live on the host
                    if s.zero >= 2:
                        sb["grads"] = 0.0   # gradient shards streamed to the host
                    if off.gather_h2d_bytes:
                        sb["params"] = 0.0   # ZeRO-3's shard too; copied up for each gather
                        comm_t[j] += 0.0 if partial else off.gather_seconds * k
                    static["host"][j], static["d2h"][j], static["h2d"][j], static["nvme"][j] = \
                        off.host_bytes * k, off.d2h_bytes * k, off.h2d_bytes * k, off.nvme_bytes * k
                for key in ("params", "grads", "optimizer"):
                    static[key][j] = sb[key] * k
                if name == gathered:   # ZeRO-3: the largest chunk gathered whole, with its gradient
                    static.setdefault("gathered", np.zeros(S))[j] = 2 * chunk_numel[name] * \
                        st.outputs[0].shard_fraction(mesh.shape) * (2 if s.precision == "bf16" else 4)
                if name not in c.needs_grad:
                    continue
                opt_t[j] = (off.seconds if off is not None and not partial else
                            optimizer_step_time(opt_local, s.optimizer, s.precision, device, cal, s.kernels)) * k
                if s.optimizer in TRUST_RATIO_OPTIMIZERS:
                    # LAMB/LARS: a chunk's per-tensor squared norms ([2, tensors] fp32) all-reduced
                    # over each norm axis once per step, latency-bound: each tensor pays its share
                    share_t = 1.0 / chunk_tensors.get(name, 1)
                    nb = TRUST_NORM_BYTES_PER_TENSOR * (chunk_tensors.get(name, 1) + 1)
                    opt_t[j] += sum(comm("all_reduce", nb, a) for a in norm_axes) * share_t * k
                gbytes = local * (2 if s.precision == "bf16" else 4)
                pbytes = local * (2 if s.precision == "bf16" else 4)
                for a in mesh.data_axes():
                    if mesh.shape[a] == 1:
                        continue
                    if s.zero == 0:
                        t = share("all_reduce", gbytes, a)
                        axis_bytes[a][j] += gbytes * k
                        grad_t[j] += t * k
                    else:
                        # As runtime/zero.py runs it (checked by tests/execution/test_predictions_measured.py):
                        # stages 2/3 reduce-scatter each micro-batch's gradient as soon as backward
                        # produced it (the full gradient is not kept across micro-batches), stage 1
                        # once per step; stages 1/2 all-gather the updated shards after the step,
                        # stage 3 does not (it keeps only the shard: the next forward's gather,
                        # priced below, is that all-gather). ZeRO-3 total: 3x params (ZeRO paper).
                        n_rs = nm if s.zero >= 2 else 1
                        n_ag = 0 if s.zero == 3 else 1
                        # the chunk's other parameters assumed split like this one
                        in_chunk = chunk_numel.get(name, numel) / numel if numel else 1.0
                        gchunk, pchunk = gbytes * in_chunk, pbytes * in_chunk
                        t = (n_rs * bucket_share(comm, "reduce_scatter", gbytes, a, gchunk)
                             + n_ag * bucket_share(comm, "all_gather", pbytes, a, pchunk))
                        axis_bytes[a][j] += (n_rs * gbytes + n_ag * pbytes) * k
                        grad_t[j] += t * k
                        if s.zero == 3:   # parameters gathered for forward and again for backward, per micro-batch
                            comm_t[j] += 2 * nm * bucket_share(comm, "all_gather", pbytes, a, pchunk) * k
                            axis_bytes[a][j] += 2 * nm * pbytes * k
        elif info.kind == "op":
            spec = info.spec
            base = op_bases.get(name)
            if base is None:
                base = op_bases[name] = op_base(c, info, s.precision, cuda, roots, charged_roots)
            wgrad = base.wgrad
            # the step's host work outside the program (cal.step_overhead, CPU only), once per
            # step: carried by the loss, the same for each of its strategies
            host_step = step_host if name == c.graph.output_name else 0.0
            for j, st in enumerate(info.strategies):
                ai = local_intensity(c, spec, info, j, mesh, nm, 2 if dtype == "bf16" else 4) if wgrad else None
                fkey = (base.flops[j] / nm, base.nbytes[j] / nm, ai, wgrad, spec.rule)
                fb = compute_memo.get(fkey)
                if fb is None:
                    fb = compute_memo[fkey] = fwd_bwd_compute(fkey[0], fkey[1], dtype, device, wgrad, ai, cal,
                                                              op=spec.rule)
                f, b = fb
                compute[j] = (f + b) * nm * k + host_step
                fwd[j] = f * nm * k
                mirrored = st.backward_comms is None
                for (kind, a, nbytes) in st.comms:
                    nb = nbytes / nm
                    # forward collective and (mirrored) its backward conjugate moving the same bytes
                    comm_t[j] += (2 if mirrored else 1) * nm * comm(kind, nb, a) * k
                    axis_bytes[a][j] += (2 if mirrored else 1) * nbytes * k
                    fwd_comm[j] += nm * comm(kind, nb, a) * k
                    fwd_bytes[a][j] += nbytes * k
                for (kind, a, nbytes) in () if mirrored else st.backward_comms:
                    comm_t[j] += nm * comm(kind, nbytes / nm, a) * k
                    axis_bytes[a][j] += nbytes * k
                # backward all-reduces of replicated inputs (autopar/pricing/conjugates.py); a
                # batch-carrying tensor is 1/nm of its size each of the nm times backward runs
                if base.region[j]:
                    t, per_axis = 0.0, {}
                    for a, nb, batchy in base.region[j]:
                        size = nb / nm if batchy else nb
                        t += comm("all_reduce", size, a) * nm
                        per_axis[a] = per_axis.get(a, 0.0) + size * nm
                    comm_t[j] += t * k
                    for a, nb in per_axis.items():
                        axis_bytes[a][j] += nb * k
            # saved bytes are per micro-batch: a batch-carrying tensor is 1/nm of the batch's, a
            # batch-free one (``batch_free``) is whole in every micro-batch
            fixed = sum((base.saved_by_root[r] for r in base.fixed_roots), np.zeros(len(info.strategies)))
            saved = ((base.saved - fixed) / nm + fixed) * k
            transient = base.transient / nm
            P.saved_by_root[name] = {root: arr * k / (1 if root in base.fixed_roots else nm)
                                     for root, arr in base.saved_by_root.items()}
            if base.saved_inputs:
                P.saved_inputs[name] = [(i, root, here, nb * k / (1 if batch_free(c, root) else nm))
                                        for i, root, here, nb in base.saved_inputs]
            if spec.storage_order:
                order = device_order(info, cuda, s.precision)
                if order is not None:
                    P.storage_order[name] = order
        P.compute[name], P.fwd_compute[name], P.comm[name] = compute, fwd, comm_t + grad_t
        P.grad_comm[name], P.optimizer[name], P.saved[name] = grad_t, opt_t, saved
        P.transient[name], P.comm_bytes[name] = transient, axis_bytes
        P.fwd_comm[name], P.fwd_comm_bytes[name] = fwd_comm, fwd_bytes
        # which strategies divide a micro-batch depends on the mesh and the count only: once per (mesh, nm)
        valid = c.edge_cache.setdefault(("valid", nm), {})
        if name not in valid:
            valid[name] = np.array([divides_micro_batch(c, info, st, nm) for st in info.strategies], dtype=bool)
        P.valid[name] = valid[name]
        if info.kind == "param":
            P.static[name] = static
        if info.kind == "op" and ops_done is None:
            ops_new[name] = {f: getattr(P, f)[name] for f in _NODE_FIELDS if name in getattr(P, f)}
    if ops_done is None:
        c.edge_cache[ops_key] = ops_new
    return P


# Per-node fields of Priced that price_nodes fills for ops (edges are priced by price_edges,
# ``static`` is the parameters'): every other dict field, so a new one is cached too.
_NODE_FIELDS = tuple(f.name for f in dataclasses.fields(Priced) if not f.name.startswith("edge") and f.name != "static")
