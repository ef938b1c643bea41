"""The named clusters with published figures (``PRESETS``: dgx-a100, dgx-h100, tacc-longhorn,
dgx2-v100, workstation-4090, cpu) and the source of every figure.

A preset is a function ``(nodes, devices per node or None) -> the Cluster's fields`` (keyword
arguments of ``autopar.cluster.Cluster``); ``preset_fields`` looks one up by name. ``Cluster.preset``
builds the cluster, and a YAML file's ``preset:`` starts from the same fields. Torch-free.
"""
from __future__ import annotations

import dataclasses
import difflib

from autopar.errors import ClusterError
from autopar.hardware import Device, FrozenMap, Host, Link, Nvme

# ---------------------------------------------------------------------------------------------
# Presets. Sources:
#  A100: NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16/fp16 dense, 156 TFLOP/s TF32 dense,
#        2,039 GB/s HBM2e, NVLink 600 GB/s per GPU. We use ~230 GB/s, the all-reduce *bus*
#        bandwidth nccl-tests measures on a DGX A100, as the effective intra-node bandwidth
#        (cost.py's ring formulas expect bus bandwidth). DGX A100: 8 × 200 Gb/s HDR InfiniBand
#        (one NIC per GPU) = 25 GB/s per GPU.
#  H100: NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense, 494.5 TFLOP/s TF32 dense
#        (989 is with sparsity), 3,350 GB/s HBM3, NVLink 900 GB/s; ~370 GB/s ring all-reduce
#        bus bandwidth measured (≈480 with NVLink SHARP, not assumed). DGX H100: 8 × 400 Gb/s
#        NDR, ≈48 GB/s per NIC measured.
#  Latencies (5 µs NVLink, 10 µs InfiniBand) are typical small-message NCCL figures.
#  fp32 matmuls on GPUs are priced at TF32 tensor-core rate (torch's allow_tf32 / "high"
#  matmul precision); pure-fp32 CUDA-core rate would be 19.5 (A100) / 67 (H100) TFLOP/s.
# ---------------------------------------------------------------------------------------------

def _check_count(what: str, v, preset: str) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ClusterError(f"preset {preset!r}: {what}={v!r}; expected an integer >= 1")


def _host(memory: float, copy: float, cpu: float, per_node: int) -> Host:
    return Host(int(memory), copy, cpu, per_node)


def _dgx(name: str, device: Device, intra: Link, inter: Link, host: tuple = None, per_node_max: int = 8,
         what: str = "a DGX node", nvme: tuple = None):
    """A preset whose machines hold ``per_node_max`` GPUs (``devices`` may ask for fewer);
    ``host``: (memory per node, copy bytes/s per device, CPU bytes/s per node); ``nvme``:
    (capacity per node, read bytes/s, write bytes/s of the node's drives)."""
    def make(nodes: int, devices: int | None) -> dict:
        _check_count("nodes", nodes, name)
        per_node = per_node_max if devices is None else devices
        _check_count("devices", per_node, name)
        if per_node > per_node_max:
            raise ClusterError(f"preset {name!r}: devices={per_node} is devices per node and {what} has "
                               f"{per_node_max}; use nodes={-(-per_node // per_node_max)} for more GPUs")
        return dict(name=name, nodes=nodes, devices_per_node=per_node, device=device, intra_link=intra,
                    inter_link=inter, backend="nccl",
                    host=_host(*host, per_node) if host is not None else None,
                    nvme=Nvme(int(nvme[0]), nvme[1], nvme[2], per_node) if nvme is not None else None)
    return make


# autopar/execution/calibrate_forward.py on the 2-core machine of facts.md, 2026-11-29 (medians,
# one thread): the engine's decode step, per decoder layer and per forward (seconds), 0.62 / 1.05
# ms at load ~1 (0.8-2.5 ms per layer at load 4-6: the host's work is what load slows); skinny
# GEMMs over 32 MiB of uncached fp32 weights, 2.4-3.3 GB/s + 9-13 GFLOP/s at load ~4-5.
CPU_HOST_OVERHEAD = (0.65e-3, 1.1e-3)
CPU_SKINNY_GEMM = (2.5e9, 12e9)


def cpu_host_device(device: Device, host=CPU_HOST_OVERHEAD, skinny=CPU_SKINNY_GEMM) -> Device:
    """``device`` with a CPU's host overhead ((per layer, per forward) seconds, added to the
    kernels: synchronous) and skinny-GEMM floor ((bytes/s, FLOP/s)) for the inference pricer;
    by default this machine's figures above."""
    return dataclasses.replace(device, host_layer_overhead=host[0], host_forward_overhead=host[1],
                               host_synchronous=True, skinny_gemm_bandwidth=skinny[0], skinny_gemm_flops=skinny[1])


def _cpu(nodes: int, devices: int | None) -> dict:
    _check_count("nodes", nodes, "cpu")
    if nodes != 1:
        raise ClusterError(f"preset 'cpu' describes local processes on one machine (nodes=1), got nodes={nodes}; "
                           "describe a multi-machine CPU cluster in a YAML file")
    per_node = 2 if devices is None else devices
    _check_count("devices", per_node, "cpu")
    # Rough figures for local gloo processes (tests and demos, not performance predictions):
    # ~50 GFLOP/s per process for any dtype, 4 GiB per process, ~10 GB/s memory bandwidth.
    # Link: facts.md measured a 4 MB gloo all_reduce at 5 ms on 2 processes (2 shared cores),
    # i.e. ~1 GB/s effective; latency ~50 µs per ring step.
    # The inference pricer's host overhead and skinny-GEMM floor: this machine's (above).
    device = cpu_host_device(Device("cpu", FrozenMap({"bf16": 50e9, "fp16": 50e9, "fp32": 50e9}), 4 * 2**30, 10e9,
                                    kernel_overhead=1e-6))
    link = Link(1e9, 5e-5)
    # Host: the same machine's memory (16 GiB assumed for the node) and its ~10 GB/s memory
    # bandwidth, both for "copies" between the two pools and for the CPU optimizer step. NVMe:
    # the machine's local disk (64 GiB for offloaded state, ~1 GB/s each way assumed).
    return dict(name="cpu", nodes=1, devices_per_node=per_node, device=device, intra_link=link, inter_link=link,
                backend="gloo", host=_host(16 * 2**30, 10e9, 10e9, per_node), nvme=Nvme(64 * 2**30, 1e9, 1e9, per_node))


# TACC Longhorn (the V100 machine of the 2D/2.5D/3D tensor-parallelism papers' 64-GPU runs).
# Every figure and its source: docs/cost-model.md, section "V100 (tacc-longhorn)". In short:
#  - node: IBM POWER9 with 4 × Tesla V100 (Cornell Virtual Workshop, "GPUs on Frontera": Longhorn,
#    Frontera's V100 subsystem until 2022, "100+ IBM nodes, each equipped with 4 NVIDIA Tesla V100s").
#  - V100 SXM2 16 GB: 125 TFLOP/s fp16 tensor cores (NVIDIA, "Programming Tensor Cores in CUDA 9"),
#    15.7 TFLOP/s fp32 CUDA cores (no TF32 on Volta), 16 GB HBM2 at 900 GB/s (OLCF Summit V100 guide).
#    Volta has no bf16: the schema needs a bf16 entry and it mirrors fp16 (price plans in fp16 terms).
#  - NVLink 2.0: 25 GB/s per brick per direction, two bricks between processors = 50 GB/s (OLCF);
#    effective ring bus bandwidth 0.76 × 50 = 38 GB/s, 0.76 being the A100's measured/nominal ratio
#    (229 / 300 GB/s). An estimate: no published nccl-tests curve for this node was found.
#  - InfiniBand EDR 100 Gb/s = 12.5 GB/s per port; two ports per 4-GPU AC922 node assumed (as on
#    Bede's AC922 GPU nodes: one per POWER9 socket, needed for GPUDirect RDMA) = 6.25 GB/s per GPU,
#    × 0.9 of line rate (the A100 preset's ratio) = 5.6 GB/s.
V100_SXM2_16GB = Device("V100-SXM2-16GB", FrozenMap({"bf16": 125e12, "fp16": 125e12, "fp32": 15.7e12}),
                        16_000_000_000, 900e9)


# Hosts (what offload is priced with: autopar/pricing/offload.py). CPU memory bandwidth is taken
# as 70% of the sockets' nominal DRAM bandwidth (a STREAM-like sustained share; an estimate), and
# host<->device copies at the measured 25 GB/s of a PCIe 4.0 x16 link (50 for 5.0; facts.md),
# divided by the GPUs that share one switch uplink. Sources per preset:
#  DGX A100 (80 GB): 2 TB host memory; 2 × AMD EPYC 7742, 8 channels DDR4-3200 = 204.8 GB/s per
#        socket nominal -> 290 GB/s; four PCIe 4.0 switches, two GPUs on each -> 12.5 GB/s per GPU.
#  DGX H100: 2 TB; 2 × Xeon Platinum 8480C, 8 channels DDR5-4800 = 307.2 GB/s per socket -> 430
#        GB/s; PCIe 5.0, two GPUs per switch uplink assumed -> 25 GB/s per GPU.
#  Longhorn AC922: 256 GB per node; NVLink 2.0 between POWER9 and V100 (two bricks, 50 GB/s per
#        direction nominal, x0.76 as the links above, two GPUs per socket -> 19 GB/s per GPU);
#        2 × POWER9, 8 channels DDR4-2666 = 170 GB/s per socket -> 240 GB/s.
#  DGX-2 (the ZeRO-Offload paper's machine: 16 × V100 32 GB, 1.5 TB host memory, 2 × Xeon
#        Platinum 8168): 6 channels DDR4-2666 = 128 GB/s per socket -> 179 GB/s; PCIe 3.0 x16
#        measured ~12 GB/s, two GPUs per switch uplink -> 6 GB/s per GPU; NVSwitch 150 GB/s per
#        direction x0.76 = 114 GB/s bus bandwidth; 8 × EDR 100 Gb/s for 16 GPUs x0.9 = 5.6 GB/s.
# NVMe (what offload="optimizer-nvme" is priced with), only where the drives are published:
#  DGX A100: 4 × 3.84 TB U.2 NVMe internal storage = 15.36 TB (NVIDIA DGX A100 datasheet and user
#        guide, "Internal Storage: 15 TB (4x 3.84 TB) U.2 NVMe drives"; Microway's DGX A100 review:
#        "15TB high-speed NVMe SSD Scratch Space"), PCIe 4.0 drives in RAID 0: ~25 GB/s aggregate
#        sequential read (about 7 GB/s per Gen4 U.2 drive of that class, x4, less RAID overhead; the
#        figure ZeRO-Infinity quotes for a node's aggregate NVMe read) and 12 GB/s write (about
#        3.5 GB/s per drive, x4, x0.85). Estimates from drive data sheets, not measured.
#  Other presets: no NVMe (none published that we could source; describe it in the YAML).
#  Workstation: one RTX 4090 (GeForce RTX 4090 data sheet / Ada whitepaper: 165 TFLOP/s dense
#        bf16 with fp32 accumulate, 82.6 TFLOP/s fp32, 24 GB GDDR6X at 1,008 GB/s) in a PCIe 4.0
#        x16 slot (25 GB/s), 128 GB of dual-channel DDR5-5600 (89.6 GB/s -> 63 GB/s).
V100_SXM3_32GB = Device("V100-SXM3-32GB", FrozenMap({"bf16": 125e12, "fp16": 125e12, "fp32": 15.7e12}),
                        32_000_000_000, 900e9)
RTX_4090 = Device("RTX-4090-24GB", FrozenMap({"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}),
                  24_000_000_000, 1008e9)

PRESETS = {
    "dgx-a100": _dgx("dgx-a100",
                     Device("A100-SXM4-80GB", FrozenMap({"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
                            80_000_000_000, 2.039e12),
                     Link(230e9, 5e-6), Link(25e9, 1e-5), host=(2e12, 12.5e9, 290e9),
                     nvme=(15.36e12, 25e9, 12e9)),
    "dgx-h100": _dgx("dgx-h100",
                     Device("H100-SXM5-80GB", FrozenMap({"bf16": 989e12, "fp16": 989e12, "fp32": 494.5e12}),
                            80_000_000_000, 3.35e12),
                     Link(370e9, 5e-6), Link(48e9, 1e-5), host=(2e12, 25e9, 430e9)),
    "tacc-longhorn": _dgx("tacc-longhorn", V100_SXM2_16GB, Link(38e9, 5e-6), Link(5.6e9, 1e-5),
                          host=(256e9, 19e9, 240e9), per_node_max=4, what="a Longhorn (IBM AC922) node"),
    "dgx2-v100": _dgx("dgx2-v100", V100_SXM3_32GB, Link(114e9, 5e-6), Link(5.6e9, 1e-5),
                      host=(1.5e12, 6e9, 179e9), per_node_max=16, what="a DGX-2"),
    "workstation-4090": _dgx("workstation-4090", RTX_4090, Link(25e9, 1e-5), Link(25e9, 1e-5),
                             host=(128e9, 25e9, 63e9), per_node_max=1, what="the workstation"),
    "cpu": _cpu,
}


def preset_fields(name: str, nodes: int = 1, devices: int | None = None) -> dict:
    """The Cluster fields of preset ``name`` for ``nodes`` machines of ``devices`` devices each
    (default: the whole node for DGX presets, 2 local processes for ``cpu``)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ClusterError(f"unknown cluster preset {name!r}{hint}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name](nodes, devices)
