"""Calibration profiles: measured (or published) rates the cost model interpolates.

A profile is what ``autopar calibrate`` writes and what a cluster file references with
``calibration: profile.yaml`` (or inline). Every rate is absolute (FLOP/s, bytes/s, seconds),
so a profile does not depend on the cluster's nominal peak figures. Torch-free.

YAML schema (all tables are ``[size, rate]`` pairs, interpolated log-log, clamped at the ends)::

    name: cpu-measured                # free text
    source: "autopar calibrate, 2 gloo processes, 2026-11-23"   # where the numbers come from
    gemm_dtype: fp32                  # dtype the GEMM table was measured in (others scale by peak)
    gemm:            [[intensity FLOP/byte, FLOP/s], ...]       # GEMM rate by arithmetic intensity
    gemm_latency: 10us                # fixed cost of one GEMM kernel (wave tail, launch)
    memory:          [[bytes moved, bytes/s], ...]              # memory-bound kernels by transfer size
    kernel_overhead: 5us              # fixed cost of any other kernel
    overlap_slowdown: 0.1             # compute slowed by this fraction of the comm time it hides
    vector_rate: 2e9                  # optional: FLOP/s of elementwise arithmetic (default: GEMM plateau)
    optimizer_overhead: 60us          # optional: fixed cost per parameter tensor of an optimizer step
    backward_ratio: 1.0               # optional: backward / forward time of ops without a weight gradient
    backward_ratios: {sdpa: 5.1, gelu: 2.6}   # optional: measured backward / forward time per op rule
                                      # (OpSpec.rule); overrides backward_ratio and the 2x of contractions
    view_overhead: 0us                # optional: host cost of an op that moves no data (CPU: not hidden)
    op_floors: {gelu: [13us, 20us]}   # optional: least forward / backward seconds of one op per rule
                                      # (a tiny call through autograd: the host's floor, CPU only)
    op_rates: {layer_norm: 5e9}       # optional: FLOP/s (as the rule counts FLOPs) of a rule's
                                      # forward, measured on representative activations
    step_overhead: 300us              # optional: the runtime's host work per training step outside
                                      # the program's ops (batch checks, loss count, CPU only)
    host_copy_bandwidth: 12e9         # optional: bytes/s of one host<->device copy of a large buffer
                                      # (256 MiB; GPU: pinned host memory), the slower direction, while
                                      # every process copies at once (CPU: host buffer to host buffer)
    host_cpu_bandwidth: 8e9           # optional: bytes/s one process's AdamW step on the host reaches
                                      # (cost.optimizer_bytes_per_element("adamw", "fp32") per element
                                      # over its time on 16 Mi fp32 elements) while every process of the
                                      # calibration steps at once: a per-rank figure, the node's is
                                      # this x its processes. Both override the cluster's host: figures
                                      # for offload (pricing/offload.py host_rates)
    links:
      intra:
        hop_latency: 2us              # per extra ring step when the group differs from a measured one
        curves:                       # bus bandwidth by message size, per collective and group size
          all_reduce@8: [[bytes, bytes/s], ...]
          all_gather@8: ...
          all_reduce_nvls@8: ...      # optional: NVLink SHARP (used for all_reduce on > 4 GPUs)
      inter: {...}                    # optional; defaults to intra

Bus bandwidth follows nccl-tests: ``busbw = factor · S / t`` with factor 2(n−1)/n for
all-reduce, (n−1)/n for all-gather / reduce-scatter / all-to-all, 1 for broadcast; ``S`` is
the larger buffer (all_reduce: the tensor; all_gather: the output; reduce_scatter: the input).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autopar.errors import ClusterError
from autopar.units import parse_quantity

Table = tuple[tuple[float, float], ...]


_XS: dict[int, list] = {}
_KEEP: list = []


def interp(table: Table, x: float) -> float:
    """Log-log interpolation in a sorted ``((x, y), ...)`` table, clamped at both ends."""
    if not table:
        raise ValueError("empty table")
    if x <= table[0][0]:
        return table[0][1]
    if x >= table[-1][0]:
        return table[-1][1]
    xs = _XS.get(id(table))
    if xs is None or len(xs) != len(table):
        xs = _XS[id(table)] = [p[0] for p in table]
        _KEEP.append(table)   # ids stay valid: tables cached here are never freed
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))


@dataclass(frozen=True)
class LinkCurves:
    """Bus bandwidth by message size per (collective, group size) on one link type."""
    curves: tuple[tuple[str, int, Table], ...]      # (kind, ranks, table)
    hop_latency: float = 2e-6
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def curve(self, kind: str, n: int) -> tuple[Table, int]:
        """The table for ``kind`` measured at the group size nearest ``n`` (else all_reduce's)."""
        hit = self._memo.get((kind, n))
        if hit is None:
            hit = self._memo[(kind, n)] = self._curve(kind, n)
        return hit

    def _curve(self, kind: str, n: int) -> tuple[Table, int]:
        for want in (kind, "all_gather" if kind in ("broadcast", "all_to_all") else kind, "all_reduce"):
            cands = [(abs(math.log(r) - math.log(n)), -r, r, t) for k, r, t in self.curves if k == want]
            if cands:
                _, _, r, t = min(cands)
                return t, r
        raise ClusterError(f"calibration profile: no all_reduce curve for a link (have "
                           f"{sorted({k for k, _, _ in self.curves})})")

    def has(self, kind: str) -> bool:
        return any(k == kind for k, _, _ in self.curves)


@dataclass(frozen=True)
class Calibration:
    name: str
    gemm: Table                       # (intensity FLOP/byte, FLOP/s)
    memory: Table                     # (bytes, bytes/s)
    intra: LinkCurves
    inter: LinkCurves
    gemm_dtype: str = "bf16"
    gemm_latency: float = 0.0
    kernel_overhead: float = 5e-6
    overlap_slowdown: float = 0.0
    source: str = ""
    vector_rate: float | None = None  # FLOP/s of elementwise arithmetic (None: the GEMM plateau)
    optimizer_overhead: float | None = None   # seconds per parameter tensor per step (None: kernel_overhead)
    backward_ratio: float = 1.0       # backward / forward time of ops without a weight gradient
    view_overhead: float = 0.0        # seconds per op that moves no data (a view): host dispatch
    # measured backward / forward time per op rule (OpSpec.rule), as sorted (rule, ratio) pairs:
    # on a CPU SDPA's backward takes ~5x its forward and GELU's ~2.6x, not the 2x / 1x of the
    # generic model (autopar calibrate measures them; GPU built-ins carry none)
    backward_ratios: tuple[tuple[str, float], ...] = ()
    # least (forward, backward) seconds of one op per rule, as sorted (rule, fwd, bwd): on a CPU a
    # tiny GELU takes 28 us forward and 70 us backward (measured here) however few its elements
    # (dispatch, autograd bookkeeping, the kernel's own set-up), more than kernel_overhead's
    # elementwise chain says
    op_floors: tuple[tuple[str, float, float], ...] = ()
    # seconds of host work per training step outside the program's ops (batch checks and
    # slicing, the mean loss's count and its all-reduce's launch, the loss's all-reduce's
    # launch, zero_grad): measured on the runtime compiled for a minimal model (CPU only; on a
    # GPU the host runs ahead of the device)
    step_overhead: float = 0.0
    # FLOP/s of a rule's forward as its OpSpec counts FLOPs (sorted (rule, rate)): a layer norm
    # counts 8 FLOPs an element and runs vectorized at several GFLOP/s, where vector_rate (the
    # median of exp, tanh, gelu, sigmoid, x*x) is under 1 GFLOP/s on these CPUs: priced at
    # vector_rate, a 65k-element layer norm took 0.6 ms against 77 us measured
    op_rates: tuple[tuple[str, float], ...] = ()
    # measured host figures for offload (None: the cluster's Host figures; pricing/offload.py
    # host_rates): bytes/s of one host<->device copy per direction (the slower) while every
    # process copies, and bytes/s of one process's CPU AdamW step while every process steps (per
    # rank, not per node: the node's figure is this times the processes calibrate ran)
    host_copy_bandwidth: float | None = None
    host_cpu_bandwidth: float | None = None

    def rate_for(self, rule: str | None) -> float | None:
        """Measured FLOP/s of ``rule``'s forward, or None."""
        row = _row(self.op_rates, rule)
        return row[1] if row else None

    def floor_for(self, rule: str | None) -> tuple[float, float]:
        """(forward, backward) floor seconds of one op of ``rule``; (0, 0) when not measured."""
        row = _row(self.op_floors, rule)
        return (row[1], row[2]) if row else (0.0, 0.0)

    def backward_ratio_for(self, rule: str | None, weight_grad: bool) -> float:
        """Backward / forward time of an op: its measured ratio if the profile has one, else 2
        for a contraction (grad input + grad weight, same shapes), else ``backward_ratio``."""
        row = _row(self.backward_ratios, rule)
        return row[1] if row else (2.0 if weight_grad else self.backward_ratio)

    # ---- serialisation
    def to_dict(self) -> dict:
        def link(lc: LinkCurves) -> dict:
            return {"hop_latency": lc.hop_latency,
                    "curves": {f"{k}@{r}": [list(p) for p in t] for k, r, t in lc.curves}}
        return {"name": self.name, "source": self.source, "gemm_dtype": self.gemm_dtype,
                "gemm": [list(p) for p in self.gemm], "gemm_latency": self.gemm_latency,
                "memory": [list(p) for p in self.memory], "kernel_overhead": self.kernel_overhead,
                "overlap_slowdown": self.overlap_slowdown,
                **({"vector_rate": self.vector_rate} if self.vector_rate else {}),
                **({"optimizer_overhead": self.optimizer_overhead} if self.optimizer_overhead else {}),
                **({"backward_ratio": self.backward_ratio} if self.backward_ratio != 1.0 else {}),
                **({"view_overhead": self.view_overhead} if self.view_overhead else {}),
                **({"backward_ratios": dict(self.backward_ratios)} if self.backward_ratios else {}),
                **({"op_floors": {r: [f, b] for r, f, b in self.op_floors}} if self.op_floors else {}),
                **({"step_overhead": self.step_overhead} if self.step_overhead else {}),
                **({"op_rates": dict(self.op_rates)} if self.op_rates else {}),
                **({"host_copy_bandwidth": self.host_copy_bandwidth} if self.host_copy_bandwidth else {}),
                **({"host_cpu_bandwidth": self.host_cpu_bandwidth} if self.host_cpu_bandwidth else {}),
                "links": {"intra": link(self.intra), "inter": link(self.inter)}}

    @staticmethod
    def from_dict(d: Any, source: str = "<calibration>") -> "Calibration":
        return _parse(d, source)

    def to_yaml(self, path) -> None:
        text = "# autopar calibration profile (schema: autopar/profile.py)\n"
        Path(path).write_text(text + yaml.safe_dump(self.to_dict(), sort_keys=False))

    @staticmethod
    def from_yaml(path) -> "Calibration":
        p = Path(path)
        if not p.is_file():
            raise ClusterError(f"{p}: calibration profile does not exist (write one with `autopar calibrate`)")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ClusterError(f"{p}: invalid YAML: {e}") from None
        return _parse(data, str(p))


def _row(table: tuple, rule: str | None) -> tuple | None:
    """The row of a per-rule table (sorted tuples, the rule first) for ``rule``, or None."""
    if rule is not None:
        for row in table:
            if row[0] == rule:
                return row
    return None


def _parse(d: Any, source: str) -> Calibration:
    def fail(path, msg):
        return ClusterError(f"{source}: calibration.{path}: {msg}")

    if not isinstance(d, dict):
        raise ClusterError(f"{source}: calibration profile must be a mapping, got {type(d).__name__}")
    allowed = {"name", "source", "gemm_dtype", "gemm", "gemm_latency", "memory", "kernel_overhead",
               "overlap_slowdown", "links", "vector_rate", "optimizer_overhead", "backward_ratio",
               "view_overhead", "backward_ratios", "op_floors", "step_overhead", "op_rates",
               "host_copy_bandwidth", "host_cpu_bandwidth"}
    extra = set(d) - allowed
    if extra:
        raise fail(sorted(extra)[0], f"unknown field; expected one of {sorted(allowed)}")

    def table(v, path) -> Table:
        if not isinstance(v, (list, tuple)) or not v:
            raise fail(path, f"got {v!r}; expected a non-empty list of [size, rate] pairs")
        out = []
        for i, p in enumerate(v):
            if (not isinstance(p, (list, tuple)) or len(p) != 2
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                               for x in p)):
                raise fail(f"{path}[{i}]", f"got {p!r}; expected [size > 0, rate > 0]")
            out.append((float(p[0]), float(p[1])))
        out.sort()
        return tuple(out)

    def seconds(v, path, default):
        if v is None:
            return default
        try:
            return parse_quantity(v, "time")
        except ClusterError as e:
            raise fail(path, str(e)) from None

    def link(v, path) -> LinkCurves:
        if not isinstance(v, dict) or "curves" not in v:
            raise fail(path, "expected a mapping with 'curves' (and optional 'hop_latency')")
        curves = []
        for key, t in v["curves"].items():
            kind, _, ranks = str(key).partition("@")
            if not ranks.isdigit() or int(ranks) < 2:
                raise fail(f"{path}.curves.{key}", "expected a key 'kind@ranks', e.g. all_reduce@8")
            curves.append((kind, int(ranks), table(t, f"{path}.curves.{key}")))
        curves.sort()
        lc = LinkCurves(tuple(curves), seconds(v.get("hop_latency"), f"{path}.hop_latency", 2e-6))
        lc.curve("all_reduce", 2)   # must resolve
        return lc

    for req in ("gemm", "memory", "links"):
        if req not in d:
            raise fail(req, "missing required field")
    links = d["links"]
    if not isinstance(links, dict) or "intra" not in links:
        raise fail("links", "expected a mapping with 'intra' (and optional 'inter')")
    intra = link(links["intra"], "links.intra")
    inter = link(links["inter"], "links.inter") if "inter" in links else intra
    slow = d.get("overlap_slowdown", 0.0)
    if not isinstance(slow, (int, float)) or not 0 <= slow < 1:
        raise fail("overlap_slowdown", f"got {slow!r}; expected a fraction in [0, 1)")
    def per_rule(key, what):   # a mapping op rule -> positive number, as sorted (rule, value) pairs
        m = d.get(key) or {}
        if not isinstance(m, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in m.values()):
            raise fail(key, f"got {m!r}; expected a mapping op rule -> {what} > 0")
        return tuple(sorted((str(k), float(v)) for k, v in m.items()))
    ratios, rates = per_rule("backward_ratios", "ratio"), per_rule("op_rates", "FLOP/s")
    floors = d.get("op_floors") or {}
    if not isinstance(floors, dict):
        raise fail("op_floors", f"got {floors!r}; expected a mapping op rule -> [forward, backward] seconds")
    floor_rows = []
    for rule, fb in floors.items():
        if not isinstance(fb, (list, tuple)) or len(fb) != 2:
            raise fail(f"op_floors.{rule}", f"got {fb!r}; expected [forward, backward] seconds")
        floor_rows.append((str(rule), seconds(fb[0], f"op_floors.{rule}[0]", 0.0),
                           seconds(fb[1], f"op_floors.{rule}[1]", 0.0)))
    def bandwidth(key):   # optional bytes/s: a positive number or a quantity ("12.5GB/s"); None when absent
        v = d.get(key)
        if v is None:
            return None
        try:
            x = parse_quantity(v, "bandwidth")
        except ValueError:
            x = None
        if x is None or not math.isfinite(x) or x <= 0:
            raise fail(key, f"got {v!r}; expected a bandwidth > 0 in bytes/s (a number or e.g. '12.5GB/s')")
        return x
    host_copy, host_cpu = bandwidth("host_copy_bandwidth"), bandwidth("host_cpu_bandwidth")
    dt = d.get("gemm_dtype", "bf16")
    if dt not in ("bf16", "fp16", "fp32"):
        raise fail("gemm_dtype", f"got {dt!r}; expected bf16, fp16 or fp32")
    return Calibration(name=str(d.get("name", "profile")), gemm=table(d["gemm"], "gemm"),
                       memory=table(d["memory"], "memory"), intra=intra, inter=inter, gemm_dtype=dt,
                       gemm_latency=seconds(d.get("gemm_latency"), "gemm_latency", 0.0),
                       kernel_overhead=seconds(d.get("kernel_overhead"), "kernel_overhead", 5e-6),
                       overlap_slowdown=float(slow), source=str(d.get("source", "")),
                       vector_rate=float(d["vector_rate"]) if d.get("vector_rate") else None,
                       optimizer_overhead=seconds(d.get("optimizer_overhead"), "optimizer_overhead", None),
                       backward_ratio=float(d.get("backward_ratio", 1.0)),
                       view_overhead=seconds(d.get("view_overhead"), "view_overhead", 0.0),
                       backward_ratios=ratios,
                       op_floors=tuple(sorted(floor_rows)),
                       step_overhead=seconds(d.get("step_overhead"), "step_overhead", 0.0),
                       op_rates=rates, host_copy_bandwidth=host_copy, host_cpu_bandwidth=host_cpu)


# ---------------------------------------------------------------------------------------------
# Built-in profiles from public data (docs/cost-model.md lists every figure and its source).
# ---------------------------------------------------------------------------------------------

_AI_GRID = (1, 2, 4, 8, 16, 32, 64, 100, 150, 200, 300, 500, 1000, 2000, 5000, 20000)


def intensity_fit_table(peak: float, max_eff: float, knee: float, exponent: float = 1.47) -> Table:
    """eff(AI) = max_eff · AI^p / (AI^p + knee^p) (meta-pytorch/autoparallel's H100 fit form),
    tabulated as FLOP/s on a log grid of intensities."""
    return tuple((float(a), peak * max_eff * a ** exponent / (a ** exponent + knee ** exponent))
                 for a in _AI_GRID)


# Calculon (Isaev et al., SC'23) A100 HBM efficiency by transfer size: >=100 MB 0.90,
# >=10 MB 0.75, >=1 MB 0.60, smaller 0.30. Tabulated at the step edges (interpolated between).
CALCULON_HBM = ((1e5, 0.30), (1e6, 0.60), (1e7, 0.75), (1e8, 0.90))


def _memory_table(hbm: float) -> Table:
    return tuple((s, e * hbm) for s, e in CALCULON_HBM)


def _busbw(points_gbs) -> Table:
    return tuple((float(s), float(b) * 1e9) for s, b in points_gbs)


KB, MB, GB = 2**10, 2**20, 2**30
# nccl-tests all_reduce bus bandwidth on 8×A100 NVLink (stas00 ml-engineering, network/README.md)
A100_NVLINK_AR8 = _busbw([(32 * KB, 1.3), (1 * MB, 18), (4 * MB, 72), (8 * MB, 110), (64 * MB, 171.5),
                          (512 * MB, 222.7), (1 * GB, 229)])
# H100/H200 node (same source): 1 MB 40, 4 MB 107, 16 MB 220, 64 MB 347 GB/s, ring plateau ~368;
# 32 KB taken from the A100 curve (latency-dominated there on both machines: an assumption).
H100_NVLINK_AR8 = _busbw([(32 * KB, 1.3), (1 * MB, 40), (4 * MB, 107), (16 * MB, 220), (64 * MB, 347),
                          (1 * GB, 368)])


def _scaled(table: Table, plateau: float) -> Table:
    """The same size ramp with a different large-message plateau."""
    top = table[-1][1]
    return tuple((s, b * plateau / top) for s, b in table)


def _a100() -> Calibration:
    # GEMMs: stas00's best-shape maximum 267.9 TF = 85.9% of 312; knee = autoparallel's H100 knee
    # (150 FLOP/B) scaled by machine balance (A100 153 FLOP/B vs H100 295): 77.8. gemm_latency 10 µs
    # fitted to NVIDIA's A100 square-GEMM curve (768 -> ~65, 1280 -> ~150 TF: small GEMMs are
    # wave-limited), see docs/cost-model.md for the check against every point.
    intra = LinkCurves((("all_reduce", 8, A100_NVLINK_AR8),), hop_latency=1.9e-6)   # NCCL LL128 NVLink hop
    # across nodes: DGX A100 8 × HDR 200 Gb/s (25 GB/s per GPU); measured ~85-96 GB/s per node on 4×HDR
    # (~0.9 of line rate): plateau 22.5 GB/s per GPU, ramp shape borrowed from the NVLink curve.
    inter = LinkCurves((("all_reduce", 2, _scaled(A100_NVLINK_AR8, 22.5e9)),), hop_latency=4.0e-6)
    return Calibration("a100-public", intensity_fit_table(312e12, 0.859, 77.8), _memory_table(2.039e12),
                       intra, inter, "bf16", gemm_latency=10e-6, kernel_overhead=5e-6,
                       overlap_slowdown=OVERLAP_SLOWDOWN, source="public data, docs/cost-model.md")


def _h100() -> Calibration:
    # GEMMs: meta-pytorch/autoparallel's H100 bf16 fit (666 GEMMs): 0.742, knee 150, exponent 1.47.
    ag = _scaled(H100_NVLINK_AR8, 361e9)          # all-gather / reduce-scatter plateau ~361 GB/s
    nvls = _scaled(H100_NVLINK_AR8, 480e9)        # NVLink SHARP all-reduce ~480 GB/s (> 4 GPUs only)
    intra = LinkCurves((("all_gather", 8, ag), ("all_reduce", 8, H100_NVLINK_AR8),
                        ("all_reduce_nvls", 8, nvls), ("reduce_scatter", 8, ag)), hop_latency=1.9e-6)
    # DGX H100: 8 × NDR 400 Gb/s, ~46-48 GB/s per NIC measured: plateau 47 GB/s per GPU.
    inter = LinkCurves((("all_reduce", 2, _scaled(H100_NVLINK_AR8, 47e9)),), hop_latency=4.0e-6)
    return Calibration("h100-public", intensity_fit_table(989e12, 0.742, 150.0), _memory_table(3.35e12),
                       intra, inter, "bf16", gemm_latency=10e-6, kernel_overhead=5e-6,
                       overlap_slowdown=OVERLAP_SLOWDOWN, source="public data, docs/cost-model.md")


# Compute overlapped with NCCL runs on fewer SMs: NCCL's ring kernels take one SM per channel
# (8-16 channels on 108/132 SMs, ~7-15%) and compete for HBM. We charge 10% of the hidden
# communication time as extra compute (an estimate, not a measurement: docs/cost-model.md).
OVERLAP_SLOWDOWN = 0.10


def _same_latency(table: Table, plateau: float) -> Table:
    """The ramp of a link that has the same small-message times but a different bandwidth: sizes and
    bus bandwidths both scaled by plateau / top, so every point's time (size / busbw) is unchanged.
    (``_scaled`` keeps the sizes: at a 5.6 GB/s plateau it prices a 2 MB message at 2.4 ms, 41x its
    A100 NVLink time, where the wire alone takes 0.36 ms; this construction gives 0.47 ms.)"""
    r = plateau / table[-1][1]
    return tuple((s * r, b * r) for s, b in table)


def _v100() -> Calibration:
    """TACC Longhorn's V100 nodes (docs/cost-model.md, "V100 (tacc-longhorn)"): no measured curves
    were found, so every shape is the A100's, rescaled to the V100's published rates."""
    # GEMMs: 125 TF fp16 tensor-core peak; maximum efficiency 0.8 (cost.py's MAX_EFFICIENCY, an
    # assumption); knee = the H100 knee (150 FLOP/B) scaled by machine balance (V100 139 FLOP/B
    # vs H100 295): 70.6 FLOP/B.
    knee = 150.0 * (125e12 / 900e9) / (989e12 / 3.35e12)
    # NVLink 2.0 ring (4 GPUs): the A100 ramp's small-message times with a 38 GB/s plateau
    # (0.76 x 50 GB/s, see cluster_presets.py)
    intra = LinkCurves((("all_reduce", 4, _same_latency(A100_NVLINK_AR8, 38e9)),), hop_latency=1.9e-6)
    # EDR InfiniBand: 5.6 GB/s per GPU (two 100 Gb/s ports per 4-GPU node x 0.9), same construction
    inter = LinkCurves((("all_reduce", 2, _same_latency(A100_NVLINK_AR8, 5.6e9)),), hop_latency=4.0e-6)
    return Calibration("v100-public", intensity_fit_table(125e12, 0.8, knee), _memory_table(900e9),
                       intra, inter, "fp16", gemm_latency=10e-6, kernel_overhead=5e-6,
                       overlap_slowdown=OVERLAP_SLOWDOWN, source="public data, docs/cost-model.md (V100)")


def _generic(device) -> Calibration:
    """A device with no profile: the A100 shapes scaled to its own peak and bandwidth."""
    peak, hbm = device.peak("bf16"), device.hbm_bandwidth
    knee = 150.0 * (peak / hbm) / (989e12 / 3.35e12)
    base = _a100()
    return Calibration(f"{device.name}-generic", intensity_fit_table(peak, 0.8, max(knee, 1.0)), _memory_table(hbm),
                       base.intra, base.inter, "bf16", gemm_latency=0.0, kernel_overhead=device.kernel_overhead,
                       overlap_slowdown=OVERLAP_SLOWDOWN, source="generic: A100 curve shapes")


_BUILTIN: dict[str, Calibration] = {}


def builtin_for(device) -> Calibration | None:
    """The public-data profile for a known GPU (by device name), else None."""
    name = device.name.upper()
    key = "A100" if "A100" in name else "H100" if "H100" in name else "V100" if "V100" in name else None
    if key is None:
        return None
    if key not in _BUILTIN:
        _BUILTIN[key] = {"A100": _a100, "H100": _h100, "V100": _v100}[key]()
    return _BUILTIN[key]
