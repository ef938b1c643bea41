"""The host figures offload is priced with, as calibration measures them: a host<->device copy's
bytes/s and the bytes/s of an offloaded optimizer step on the host (``measure_host_rates``).
"""
from __future__ import annotations

# the host figures' buffers: large enough that per-call costs vanish and (mostly) past the
# caches, small enough to time in well under a second on a CPU core (a 16 Mi-element AdamW step:
# ~0.1 s, 320 MB with its temporary; a 256 MiB copy: ~40 ms, measured here)
HOST_COPY_BYTES = 256 << 20
HOST_OPT_NUMEL = 16 << 20


def measure_host_rates(device, together) -> tuple[float, float]:
    """(host_copy_bandwidth, host_cpu_bandwidth) of the profile: bytes/s of one host<->device copy
    of ``HOST_COPY_BYTES`` (GPU: pinned host memory, each direction, the slower kept; CPU: host
    buffer to host buffer, which is what the "device" and "host" pools are there), and bytes/s of
    the step an offloaded AdamW runs on the host (runtime/optim.py ``host_step``: torch's fused
    CPU kernel, fp32) over ``HOST_OPT_NUMEL`` elements, counted as the bytes offload prices it
    with (pricing/offload.py ``host_step_bytes_per_element("adamw", "fp32")``).
    ``together(fn)``: seconds of one call of ``fn`` timed on every rank at once (a barrier
    around each call), fastest of 3, the slowest rank's: each process sees the others
    copying and stepping, so the CPU figure is one rank's share of the node's (each call lasts
    tens of milliseconds or more: processes time-sharing a core are seen sharing it)."""
    import torch

    from autopar.pricing.offload import host_step_bytes_per_element
    from runtime.optim import make_optimizer

    gpu = device.type == "cuda"
    host = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, pin_memory=gpu).fill_(1)
    other = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, device=device)
    if gpu:
        t = max(together(lambda: other.copy_(host, non_blocking=True)),
                together(lambda: host.copy_(other, non_blocking=True)))
    else:
        t = together(lambda: other.copy_(host))
    copy = HOST_COPY_BYTES / t
    host = other = None   # freed before the optimizer's buffers are made
    opt = make_optimizer("adamw", 1e-3)
    param = torch.full((HOST_OPT_NUMEL,), 0.5)   # (the step's time does not depend on the values;
    grad = torch.full((HOST_OPT_NUMEL,), 1e-3)   # randn took longer than the timing)
    state = opt.init_state(HOST_OPT_NUMEL)
    t = together(lambda: opt.host_step(param, grad, state, 1))
    return copy, HOST_OPT_NUMEL * host_step_bytes_per_element("adamw", "fp32") / t
