"""The configurations the outer search visits, and the pins that shape them: ``constraints=``
checked (``check_constraints``: autopar/constraints.py's checks and the grid modes'), the meshes
the dp / tp / tp_mode / tp_shape / sequence pins allow (``allowed_meshes``), the micro-batch counts
that cut a data-parallel share evenly (``_micro_choices``, and why a pinned one cannot:
``micro_batch_error``), and every (mesh, ZeRO stage, micro-batch count) as a ``Config``
(``configurations``). autopar/search/outer.py prices and solves them."""
from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.errors import ConstraintError
from autopar.frontend.batching import global_batch
from autopar.frontend.trace import TracedGraph
from autopar.pricing.offload import NVME_MODES, PARAM_MODES
from autopar.pricing.price import Settings
from autopar.rules import sequence
from autopar.search.grid_geometry import check_grid_constraints


@dataclass
class Config:
    mesh: object
    settings: Settings


def check_constraints(constraints) -> dict:
    """``constraints=`` (a dict or autopar.Constraints) as the dict of its pinned keys, validated:
    each key and the contradictions between keys by autopar/constraints.py, a grid mode's shape by
    autopar/search/grid_geometry.py (``check_grid_constraints``)."""
    pins = Constraints.coerce(constraints).to_dict()
    check_grid_constraints(pins)   # a 2d / 2.5d / 3d grid of the pinned tp / tp_shape
    return pins


def _checkpoint_setting(ck):
    """Settings.checkpoint: "none" | "selective" | "full" | None, or per block group a sorted tuple of
    (name, bool | "none" | "selective" | "full")."""
    return tuple(sorted(ck.items())) if isinstance(ck, dict) else ck



def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _micro_choices(per_dp: int, constraints: dict) -> list[int]:
    """Numbers of micro-batches for a data-parallel share of ``per_dp`` rows: only counts that
    cut it into equal micro-batches of at least one row (a pinned count that does not is
    dropped here and reported by ``micro_batch_error``); unpinned, micro-batch sizes that are
    powers of two (plus the whole share). Both pinned (a pipelined candidate's count with the
    user's size): that count where it cuts micro-batches of that size."""
    if "num_micro_batches" in constraints:
        nm = constraints["num_micro_batches"]
        size = constraints.get("micro_batch_size", per_dp // nm)
        return [nm] if per_dp % nm == 0 and per_dp // nm == size else []
    if "micro_batch_size" in constraints:
        mbs = constraints["micro_batch_size"]
        return [per_dp // mbs] if per_dp % mbs == 0 else []
    sizes = {per_dp}
    m = 1
    while m < per_dp:
        if per_dp % m == 0:
            sizes.add(m)
        m *= 2
    return sorted({per_dp // s for s in sizes})


def micro_batch_error(batch: int, dps: list[int], constraints: dict) -> str | None:
    """Why a pinned num_micro_batches / micro_batch_size cannot be met on any mesh that the other
    pins allow (None when it can on some): says which counts divide."""
    key = "num_micro_batches" if "num_micro_batches" in constraints else \
        "micro_batch_size" if "micro_batch_size" in constraints else None
    if key is None or not dps:
        return None
    if any(_micro_choices(batch // dp, constraints) for dp in dps):
        return None
    parts = []
    for dp in sorted(set(dps)):
        per_dp = batch // dp
        share = f"the global batch of {batch} rows" if dp == 1 else f"{per_dp} rows per data-parallel rank " \
            f"(global batch {batch} / dp={dp})"
        what = "micro-batch counts" if key == "num_micro_batches" else "micro-batch sizes"
        counts = ", ".join(map(str, _divisors(per_dp)))
        parts.append(f"{share} splits into equal micro-batches only for {what} {counts}")
    return (f"constraint {key}={constraints[key]} cannot be met: " + "; ".join(parts)
            + ". Pin one of those, or change the batch size or dp")


def configurations(graph: TracedGraph, cluster: Cluster, base: Settings, constraints: dict, max_zero: int = 3):
    """Every (mesh, ZeRO stage, micro-batch count) the pins allow. Unpinned, ZeRO-1 is left out
    with one micro-batch where ZeRO-2 is allowed: there the two run the same collectives (one
    reduce-scatter of the gradients, one all-gather of the parameters: pricing.price_nodes), so
    they cost the same time, and ZeRO-2 holds a shard of the gradients instead of all of them: no
    ZeRO-1 plan is faster or fits where the ZeRO-2 one does not. Each is also visited with the
    optimizer offloaded (``offload_choices``), except ZeRO-0 on more than one data-parallel rank:
    offloaded, it holds the same device bytes as ZeRO-1 and steps dp times the elements on the
    CPU. On one data-parallel rank an offloaded configuration is ZeRO-2 (of one rank): its
    gradients go to the host as backward produces them, so the device holds none."""
    batch = global_batch(graph)
    offloads = offload_choices(cluster, constraints)
    for mesh in allowed_meshes(cluster, constraints):
        dp = mesh.degree("dp")
        if batch % dp:
            continue
        zeros = [constraints["zero"]] if "zero" in constraints else \
            ([z for z in (0, 1, 2, 3) if z <= max_zero] if dp > 1 else [0])
        for nm in _micro_choices(batch // dp, constraints):
            for off in offloads:
                for z in zeros:
                    if z == 1 and nm == 1 and 2 in zeros and "zero" not in constraints:
                        continue   # dominated by ZeRO-2 (docstring)
                    if off != "none" and z == 0 and dp > 1 and "zero" not in constraints:
                        continue   # dominated by ZeRO-1 with the same offload (docstring)
                    if off != "none" and dp == 1 and "zero" not in constraints:
                        z = 3 if off in PARAM_MODES else 2   # one rank: stage 2 streams the
                        # gradients to the host (docstring), stage 3 keeps the parameters there
                    if off in PARAM_MODES and z != 3:
                        continue   # offloads ZeRO-3's parameter shards
                    yield Config(mesh, Settings(optimizer=base.optimizer, precision=base.precision, zero=z,
                                                num_micro_batches=nm, budget=base.budget,
                                                overlap_grad_comm=base.overlap_grad_comm, kernels=base.kernels,
                                                checkpoint=_checkpoint_setting(constraints.get("checkpoint")),
                                                offload=off, offload_all=base.offload_all or "offload" in constraints))


def offload_choices(cluster: Cluster, constraints: dict) -> list[str]:
    """The offload modes a search visits: the pinned one; unpinned, "none" and (when the cluster
    describes its host, and its devices are not the host's CPUs: not gloo) "optimizer", at ZeRO-3
    "optimizer+params" and, when it describes its NVMe, "optimizer-nvme" and (ZeRO-3)
    "optimizer+params-nvme" (pinned on a gloo
    cluster, offload runs the same code, host and device pools both in CPU memory: what tests
    check numerics and bytes with). An offloaded
    configuration is solved only where its twin without offload does not prune it
    (autopar/search/outer.py), and its plan offloads the fewest chunks that fit
    (autopar/search/predict.py ``offload_fraction``)."""
    if "offload" in constraints:
        if constraints["offload"] != "none" and cluster.host is None:
            raise ConstraintError(f"constraint offload={constraints['offload']!r} cannot be met: cluster "
                                  f"{cluster.name!r} describes no host (memory, copy and CPU bandwidth); add a "
                                  f"`host:` section to its YAML (examples/cluster.yaml) or use a preset that has one")
        if constraints["offload"] in NVME_MODES and cluster.nvme is None:
            raise ConstraintError(f"constraint offload={constraints['offload']!r} cannot be met: cluster "
                                  f"{cluster.name!r} describes no NVMe (capacity, read and write bandwidth); add an "
                                  f"`nvme:` section to its YAML (examples/cluster.yaml) or offload to the host "
                                  f"(offload='optimizer')")
        return [constraints["offload"]]
    if cluster.host is None or cluster.backend == "gloo":
        return ["none"]   # gloo: the devices' memory is the host's, offloading frees none of it
    # NVMe: the host's optimizer state on the drives, priced strictly slower than keeping it in
    # host memory (pricing/offload.py), so chosen only where the host cannot hold it
    return ["none", "optimizer", "optimizer+params"] + (list(NVME_MODES) if cluster.nvme is not None else [])


def allowed_meshes(cluster: Cluster, constraints: dict):
    """The cluster's logical meshes that the dp/tp/tp_mode/tp_shape pins allow."""
    if constraints.get("tp_mode") in ("2d", "2.5d", "3d"):
        return   # grid modes are not ILP meshes (autopar/search/grid_search.py)
    for mesh in list(cluster.meshes()) + sequence.meshes(cluster, constraints):
        dp, tp = mesh.degree("dp"), sequence.tp_degree(mesh)   # sequence axes are not tensor axes
        if constraints.get("dp", dp) != dp or constraints.get("tp", tp) != tp:
            continue
        if not sequence.mesh_allowed(mesh, constraints):
            continue
        model_axes = sequence.param_axes(mesh)
        axes = len(model_axes)
        if constraints.get("tp_mode") == "1d" and axes > 1 or constraints.get("tp_mode") == "2d-reshard" and axes != 2:
            continue   # 1d: at most one model axis (Megatron; tp=1 is plain DP); 2d-reshard: exactly two
        if "tp_shape" in constraints and list(constraints["tp_shape"]) != [mesh.shape[a] for a in model_axes]:
            continue
        yield mesh
