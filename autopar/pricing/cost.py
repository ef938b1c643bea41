"""Time model: seconds for compute, collectives and the optimizer step on a Cluster.

Every function here returns seconds (never FLOPs or bytes), so the ILP's objective adds
like with like. The module is torch-free; its inputs are plain numbers, a ``Device``, a
``Cluster`` and a ``Mesh``.

Calibrated path (``profile_of(cluster)`` is not None: a cluster file's ``calibration:`` profile,
or the public-data profile of an A100/H100): GEMMs at the profile's rate for their arithmetic
intensity, memory-bound kernels at its bandwidth for their transfer size, collectives at its
measured bus bandwidth for their message size and group size (NVLS for all-reduce on > 4 GPUs),
and an overlap slowdown — see docs/cost-model.md for every constant and its source. What follows
describes the uncalibrated roofline / alpha-beta path (the ``cpu`` preset without a profile and
unknown devices), which the calibrated path shares its structure with.

Compute (``compute_time``): a roofline with an efficiency curve and a launch overhead::

    t = max(flops / (peak[dtype] * eff(flops)), nbytes / hbm_bandwidth) + kernel_overhead
    eff(f) = 0.8 * sqrt(f / (f + F0)),   F0 = peak[dtype] * T_SAT

``eff`` says that large matmuls reach ~80% of peak and small ones far less (they cannot fill
the machine). ``F0`` scales with the device's peak (a faster device needs more work to fill)
and is fixed by one calibration point: a 4096³ bf16 GEMM (1.37e11 FLOP) on an A100
(312 TFLOP/s) reaches ~70% of peak, so ``F0 = f · ((0.8/0.7)² − 1)``, ``T_SAT ≈ 135 µs``.
The square root is deliberate: the simpler ``0.8 · f / (f + F0)`` makes the math time
``(f + F0) / (0.8 · peak)``, i.e. a fixed ~78 µs floor for *every* op however small, which
would swamp graphs of many small kernels; with the square root the math time
``sqrt(f · (f + F0)) / (0.8 · peak)`` goes to 0 with f (e.g. 512³ GEMM ≈ 14 µs, 2048³ ≈ 127 µs
on A100: within ~1.5× of cuBLAS). ``kernel_overhead`` comes from the device (5 µs for GPUs:
launch plus tail; 1 µs for the rough ``cpu`` preset). An op that does no work (a view) costs 0.

Backward (``fwd_bwd_compute``): an op with a weight gradient (a contraction, e.g. linear or
matmul) runs two kernels of the forward's size in backward (input gradient and weight
gradient), so backward = 2 × forward; every other op's backward costs one forward.

Collectives (``Collectives``): the shared convention ``comm(kind, nbytes, axis) -> seconds``
with ``nbytes`` the per-rank size of the larger buffer (all_reduce: the tensor; all_gather:
the gathered output; reduce_scatter: the unreduced input; all_to_all: the local tensor;
broadcast: the tensor). On an axis of ``n`` ranks inside one node, ring alpha-beta::

    all_reduce       2(n-1)/n · S / B + 2(n-1) · α
    all_gather       (n-1)/n  · S / B +  (n-1) · α
    reduce_scatter   (n-1)/n  · S / B +  (n-1) · α
    all_to_all       (n-1)/n  · S / B +  (n-1) · α
    broadcast               S / B     +  (n-1) · α       (pipelined ring)

where ``B`` is the link's effective (bus) bandwidth and ``α`` its latency. An axis whose group
spans nodes (``mesh.placement(axis).inter > 1``) with ``intra`` ranks per node is hierarchical:
all_reduce = intra reduce_scatter(S) + inter all_reduce(S/intra) + intra all_gather(S);
all_gather = inter all_gather(S/intra) + intra all_gather(S); reduce_scatter = intra
reduce_scatter(S) + inter reduce_scatter(S/intra); broadcast = inter broadcast + intra
broadcast; all_to_all = flat over all n ranks at the inter-node link (most of its bytes leave
the node). A size-1 axis or an empty buffer costs 0.

Optimizer (``optimizer_step_time``): elementwise and memory-bound, so bytes touched per local
element / memory bandwidth + a fixed cost per parameter tensor. The bytes are what
runtime/optim.py's op sequence moves (it runs torch.optim's single-tensor formulas op by op, one
kernel each, on GPUs too), not what one fused kernel would: AdamW (fp32, weight decay on) reads
and writes per element: param.mul_ 8, exp_avg.lerp_ 12, exp_avg_sq.mul_ 8, addcmul_ 12, sqrt 8,
div_ 8, add_ 8, param.addcdiv_ 16 = 80 (Adam without decay 72; SGD with momentum 32; LAMB 136;
LARS 80). Mixed precision adds the gradient's upcast (read 2, write 4) and the master's cast back
(read 4, write 2): +12. tests/pricing/test_cost.py counts them from the optimizers' dispatched ops. A plan
with the Triton kernels steps AdamW in one kernel (runtime/kernels/adamw.py): 28 B per element
and one launch per tensor (``_FUSED_OPT_BYTES``).
LAMB and LARS also all-reduce each chunk's per-tensor squared norms once per step (runtime/zero_step.py:
a [2, tensors + 1] fp32 tensor, ``TRUST_NORM_BYTES_PER_TENSOR`` per tensor) over every model axis
of size > 1 and, under ZeRO 1-3, the data axes (autopar/pricing/price.py ``trust_norm_axes``):
latency-bound, priced as that all_reduce, each tensor of the chunk paying its share.

``exposed_comm``: communication that overlaps with independent compute only shows what is
left over: ``max(0, comm - compute)``; without overlap all of it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.hardware import Device, Link
from autopar.errors import PlanError
from autopar.pricing.memory import check_optimizer, check_precision
from autopar.mesh import Mesh
from autopar.profile import Calibration, LinkCurves, builtin_for, interp

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

MAX_EFFICIENCY = 0.8
# Calibration (module docstring): a 4096³ bf16 GEMM on an A100 reaches CALIBRATION_EFFICIENCY.
CALIBRATION_EFFICIENCY = 0.7
# seconds of peak-rate work that sets the efficiency curve's knee (F0 = peak · T_SAT)
T_SAT = (2 * 4096**3) * ((MAX_EFFICIENCY / CALIBRATION_EFFICIENCY) ** 2 - 1) / 312e12


def efficiency(flops: float, peak: float) -> float:
    """Fraction of ``peak`` a kernel of ``flops`` reaches: 0.8 · sqrt(f / (f + peak · T_SAT))."""
    if flops <= 0:
        return MAX_EFFICIENCY
    return MAX_EFFICIENCY * math.sqrt(flops / (flops + peak * T_SAT))


def profile_of(cluster_or_device) -> Calibration | None:
    """The calibration a cluster's costs use: its own (``calibration:``), else the public-data
    profile of a known GPU, else None (the uncalibrated roofline below)."""
    cal = getattr(cluster_or_device, "calibration", None)
    if cal is not None:
        return cal
    device = getattr(cluster_or_device, "device", cluster_or_device)
    return builtin_for(device)


def gemm_intensity(sizes: dict, tensors, itemsize: float) -> float:
    """Arithmetic intensity (FLOP per byte) of a contraction over letters ``sizes`` (local
    sizes) whose operands and result carry the letter strings ``tensors``:
    2·prod(all letters) / (itemsize · sum over tensors of prod(its letters)). For a GEMM
    M×K·K×N in bf16 this is autoparallel's AI = 2MNK / (2(MK + KN + MN))."""
    flops = 2.0 * math.prod(sizes.values())
    nbytes = itemsize * sum(math.prod(sizes[ch] for ch in t) for t in tensors if t)
    return flops / nbytes if nbytes > 0 else 0.0


def compute_time(flops: float, nbytes: float, dtype: str, device: Device,
                 intensity: float | None = None, calibration: Calibration | None = None,
                 op: str | None = None) -> float:
    """Seconds for one kernel doing ``flops`` arithmetic and moving ``nbytes`` of device memory.
    ``intensity`` (FLOP/byte of the local GEMM shape, ``gemm_intensity``) marks a contraction:
    with a calibration profile its rate comes from the profile's GEMM-by-intensity curve, unless
    the profile measured the rule ``op`` itself (``op_rates``: SDPA on a CPU); other kernels are
    memory-bound at the profile's bandwidth for their transfer size."""
    _non_negative(flops=flops, nbytes=nbytes)
    cal = calibration if calibration is not None else builtin_for(device)
    if flops == 0 and nbytes == 0:
        return cal.view_overhead if cal is not None else 0.0
    if cal is None:
        peak = device.peak(dtype)
        t_math = flops / (peak * efficiency(flops, peak)) if flops > 0 else 0.0
        t_mem = nbytes / device.hbm_bandwidth
        return max(t_math, t_mem) + device.kernel_overhead
    t_mem = nbytes / interp(cal.memory, nbytes) if nbytes > 0 else 0.0
    measured = cal.rate_for(op)
    if intensity is not None and flops > 0 and measured is None:
        rate = interp(cal.gemm, max(intensity, 1e-3)) * _dtype_scale(device, dtype, cal.gemm_dtype)
        return max(flops / rate, t_mem) + max(cal.gemm_latency, cal.kernel_overhead)
    t_math = 0.0
    if flops > 0:   # a rule's measured rate (``op``: OpSpec.rule), else elementwise arithmetic's
        # A measured rate wins over the GEMM curve for a contraction too: SDPA (q·k, then ·v) is
        # a contraction, but its kernel (blocked online softmax around small GEMMs) is not a GEMM
        # of its intensity. On these CPUs the GEMM curve priced the bench GPT's attention at 0.55
        # ms a call where it runs in 0.86 ms and its own measured rate says 0.80.
        rate = measured or cal.vector_rate or cal.gemm[-1][1]
        t_math = flops / (rate * _dtype_scale(device, dtype, cal.gemm_dtype))
    return max(t_math, t_mem) + cal.kernel_overhead


def _dtype_scale(device: Device, dtype: str, measured: str) -> float:
    if dtype == measured:
        return 1.0
    return device.peak(dtype) / device.peak(measured)


def fwd_bwd_compute(flops: float, nbytes: float, dtype: str, device: Device,
                    weight_grad: bool, intensity: float | None = None,
                    calibration: Calibration | None = None, op: str | None = None) -> tuple[float, float]:
    """(forward seconds, backward seconds). Ops with a weight gradient run two forward-sized
    kernels in backward (grad input, grad weight: the same three shapes, so the same intensity);
    other ops one. A calibration profile may carry measured per-op ratios (``op``: the rule
    name, ``OpSpec.rule``) and a measured ratio for ops without a weight gradient."""
    fwd = compute_time(flops, nbytes, dtype, device, intensity if weight_grad else None, calibration, op=op)
    cal = calibration if calibration is not None else builtin_for(device)
    if cal is None:
        return fwd, (2.0 if weight_grad else 1.0) * fwd
    bwd = cal.backward_ratio_for(op, weight_grad) * fwd
    if cal.op_floors and (flops or nbytes):   # the host's least time for one such op (tiny ops on a CPU)
        f0, b0 = cal.floor_for(op)
        fwd, bwd = max(fwd, f0), max(bwd, b0)
    return fwd, bwd


def _ring(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Flat ring alpha-beta on ``n`` ranks over ``link``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    frac = (n - 1) / n
    if kind == "all_reduce":
        return 2 * frac * nbytes / link.bandwidth + 2 * (n - 1) * link.latency
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return frac * nbytes / link.bandwidth + (n - 1) * link.latency
    # broadcast: pipelined along the ring, every rank receives the whole tensor once
    return nbytes / link.bandwidth + (n - 1) * link.latency


_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
           "broadcast": lambda n: 1.0}
_STEPS = {"all_reduce": lambda n: 2 * (n - 1)}


def _curve(kind: str, nbytes: float, n: int, lc: LinkCurves, nvls: bool = False) -> float:
    """Measured bus bandwidth by message size (nccl-tests convention, see autopar/profile.py):
    t = factor(n) · S / busbw(S), busbw from the curve measured at the group size nearest ``n``;
    when that size differs, each extra (or missing) ring step adds (removes) ``hop_latency``.
    NVLink SHARP (an ``all_reduce_nvls`` curve) is used for all-reduce on more than 4 GPUs only."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    key = "all_reduce_nvls" if (nvls and kind == "all_reduce" and n > 4 and lc.has("all_reduce_nvls")) else kind
    table, ref = lc.curve(key, n)
    t = _FACTOR[kind](n) * nbytes / interp(table, nbytes)
    steps = _STEPS.get(kind, lambda m: m - 1)
    return max(t + (steps(n) - steps(ref)) * lc.hop_latency, steps(n) * lc.hop_latency)


@dataclass(frozen=True)
class Collectives:
    """``comm(kind, nbytes, axis) -> seconds`` for one (cluster, mesh). Frozen and hashable so
    resharding planners can cache on it."""
    cluster: Cluster
    mesh: Mesh

    def __call__(self, kind: str, nbytes: float, axis: int) -> float:
        if kind not in KINDS:
            raise PlanError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")
        if not 0 <= axis < self.mesh.ndim:
            raise PlanError(f"mesh axis {axis} out of range for mesh {self.mesh.describe()} "
                            f"({self.mesh.ndim} axes)")
        _non_negative(nbytes=nbytes)
        p = self.mesh.placement(axis)
        if p.size <= 1 or nbytes == 0:
            return 0.0
        cal = profile_of(self.cluster)
        if cal is None:
            intra, inter = self.cluster.intra_link, self.cluster.inter_link
            ring = _ring
        else:
            intra, inter = cal.intra, cal.inter
            ring = _curve
        if p.inter <= 1:
            if cal is not None:
                return _curve(kind, nbytes, p.size, intra, nvls=True)
            return ring(kind, nbytes, p.size, intra)
        a, b = p.intra, p.inter   # ranks per node in one group, nodes one group spans
        if kind == "all_reduce":
            return (ring("reduce_scatter", nbytes, a, intra) + ring("all_reduce", nbytes / a, b, inter)
                    + ring("all_gather", nbytes, a, intra))
        if kind == "all_gather":
            return ring("all_gather", nbytes / a, b, inter) + ring("all_gather", nbytes, a, intra)
        if kind == "reduce_scatter":
            return ring("reduce_scatter", nbytes, a, intra) + ring("reduce_scatter", nbytes / a, b, inter)
        if kind == "broadcast":
            return ring("broadcast", nbytes, b, inter) + ring("broadcast", nbytes, a, intra)
        return ring("all_to_all", nbytes, p.size, inter)


# runtime/zero.py sizes stage-0 data-parallel buckets to half the gradient bytes, between 1 MiB
# and DDP's 25 MiB (runtime/ddp.py); ZeRO reduces and gathers whole chunks of parameters. Either
# way one collective carries many parameters, so a parameter pays its share of a bucket-sized
# collective, not a latency-bound collective of its own.
BUCKET_MIN, BUCKET_MAX = 2**20, 25 * 2**20


def grad_bucket_bytes(total_grad_bytes: float) -> float:
    """Bytes per gradient collective the runtime issues for a model of ``total_grad_bytes``
    (a model smaller than one bucket: one collective of all its gradients)."""
    return min(BUCKET_MAX, max(BUCKET_MIN, total_grad_bytes / 2), total_grad_bytes)


def bucket_share(comm, kind: str, nbytes: float, axis: int, bucket: float) -> float:
    """Seconds of one parameter's part of a bucketed gradient collective: ``nbytes / bucket`` of
    one ``bucket``-byte collective (a parameter larger than a bucket gets one of its own)."""
    if nbytes <= 0:
        return 0.0
    if nbytes >= bucket:
        return comm(kind, nbytes, axis)
    return nbytes / bucket * comm(kind, bucket, axis)


# bytes moved per element by one optimizer step as runtime/optim.py runs it, fp32 (module doc;
# counted from the dispatched ops by tests/pricing/test_cost.py); mixed precision adds MIXED_CAST_BYTES
_OPT_BYTES = {"adamw": 80, "adam": 72, "sgd": 32, "lamb": 136, "lars": 80}
MIXED_CAST_BYTES = 2 + 4 + 4 + 2   # the gradient upcast to fp32, the master cast back (runtime/zero.py)
TRUST_RATIO_OPTIMIZERS = ("lamb", "lars")   # per-tensor norms summed across ranks each step (module doc)
TRUST_NORM_BYTES_PER_TENSOR = 8             # ||w||^2 and ||u||^2 (LARS: ||g||^2), fp32


# the fused Triton steps (runtime/kernels): each tensor read once, the updated ones written once
# (AdamW: param, grad, exp_avg, exp_avg_sq in; param, exp_avg, exp_avg_sq out; SGD with momentum:
# param, grad, buffer in, param, buffer out; LAMB: the direction kernel 16 in, 12 out, the norms
# 8 in, the apply 8 in, 4 out; LARS: the norms 8 in, the step 12 in, 8 out)
_FUSED_OPT_BYTES = {"adamw": 28, "sgd": 20, "lamb": 48, "lars": 28}


def optimizer_bytes_per_element(optimizer: str, precision: str, fused: bool = False) -> int:
    check_optimizer(optimizer)
    check_precision(precision)
    step = _FUSED_OPT_BYTES.get(optimizer, _OPT_BYTES[optimizer]) if fused else _OPT_BYTES[optimizer]
    return step + (0 if precision == "fp32" else MIXED_CAST_BYTES)


def optimizer_step_time(numel_local: float, optimizer: str, precision: str, device: Device,
                        calibration: Calibration | None = None, fused: bool = False) -> float:
    """Seconds for one optimizer step over ``numel_local`` parameter elements on one device
    (``fused``: the plan runs the Triton kernels, which fuse AdamW's step)."""
    _non_negative(numel_local=numel_local)
    per = optimizer_bytes_per_element(optimizer, precision, fused)
    if numel_local == 0:
        return 0.0
    cal = calibration if calibration is not None else builtin_for(device)
    if cal is not None and cal.optimizer_overhead and not (fused and optimizer in _FUSED_OPT_BYTES):
        # (a fused step is one kernel per tensor: the memory time plus one launch, below)
        return compute_time(0.0, numel_local * per, "fp32", device, calibration=cal) \
            - cal.kernel_overhead + cal.optimizer_overhead
    return compute_time(0.0, numel_local * per, "fp32", device, calibration=calibration)


def exposed_comm(comm_seconds: float, overlappable_compute_seconds: float, overlap: bool,
                 slowdown: float = 0.0) -> float:
    """Communication time left visible after overlapping it with independent compute, plus the
    compute slowdown overlap causes: ``slowdown`` × the hidden part (the communication kernels
    take SMs and memory bandwidth from the compute they hide behind)."""
    _non_negative(comm_seconds=comm_seconds, overlappable_compute_seconds=overlappable_compute_seconds)
    if not overlap:
        return float(comm_seconds)
    return float(exposed_comm_arrays(comm_seconds, overlappable_compute_seconds, slowdown))


def exposed_comm_arrays(comm_seconds, overlappable_compute_seconds, slowdown: float = 0.0):
    """``exposed_comm`` with overlap, elementwise over arrays (numbers >= 0, unchecked): what
    autopar/pricing/edge_price.py charges per strategy pair for a regathering linear."""
    import numpy as np

    hidden = np.minimum(comm_seconds, overlappable_compute_seconds)
    return np.maximum(0.0, np.subtract(comm_seconds, overlappable_compute_seconds)) + slowdown * hidden


def _non_negative(**values: float) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) or v < 0:
            raise PlanError(f"cost model: {name} = {v!r}; expected a number >= 0")
