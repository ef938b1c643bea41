"""The GPU check: what autopar does on one real CUDA device, in one markdown table.

Run by ``scripts/gpu-check.sh`` on a machine with one GPU (it brings the wheels it needs); each
section runs on its own, so one failure leaves the others' rows. Sections:

1. ``env``: the card, torch, triton.
2. ``train``: a Llama-style model (~1B parameters at full size) trained by ``autopar.compile`` on
   one GPU (world size 1, NCCL) with ``kernels="torch"`` and ``kernels="triton"``, against a
   hand-written eager loop (autocast bf16 + fused AdamW): step time,
   ``torch.cuda.max_memory_allocated``, and the plan's predicted step time and peak.
3. ``kernels``: each Triton kernel against eager torch and torch.compile (benchmarks/kernel_bench.py).
4. ``tests``: the tests marked ``gpu`` (pytest -m gpu).
5. ``calibrate``: ``autopar calibrate --sweep gpu`` on the GPU, then the model re-planned with
   that profile and trained again: predicted against measured.
6. ``offload``: full fine-tuning (AdamW) of a model whose states do not fit the device under the
   check's memory budget without offload (the plan without it is refused), trained with the
   optimizer on the host (docs/offload.md): step time, device peak and host bytes against the
   plan's. The budget stands in for a smaller card: the machine's 128 GiB of host memory holds
   the states of a ~5B model (the check trains 2.8B: ~47 GiB on the host), not of one that
   overflows a whole H100/H200.

On a machine without CUDA it says so and exits 0 after the sections that need no GPU.
``--quick`` shrinks every size (a smoke run); ``--out FILE`` writes the table there too.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback

ROWS: list[str] = []


OUT: list[str] = []   # the --out file, rewritten after every row (a run cut short keeps its rows)


def _table() -> str:
    return "| section | what | result |\n|---|---|---|\n" + "\n".join(ROWS) + "\n"


def row(section: str, what: str, value: str) -> None:
    line = f"| {section} | {what} | {value} |"
    ROWS.append(line)
    print(line, flush=True)
    if OUT:
        with open(OUT[0], "w") as f:
            f.write(_table())


def section(name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    print(f"\n== {name}", flush=True)
    try:
        fn(*args)
    except Exception as e:   # one section's failure must not cost the others
        traceback.print_exc()
        row(name, "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    print(f"== {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def env() -> None:
    import torch
    row("env", "torch", torch.__version__)
    row("env", "cuda",
        f"{torch.cuda.is_available()} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
    try:
        import triton
        row("env", "triton", triton.__version__)
    except ImportError as e:
        row("env", "triton", f"missing ({e})")


def tests() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider",
                        "--timeout=300", "-x", "--tb=short", "tests"], capture_output=True, text=True, timeout=150,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                            "MASTER_ADDR", "MASTER_PORT")})
    print(r.stdout[-6000:], r.stderr[-2000:])
    summary = [ln.strip("= ") for ln in r.stdout.splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    row("tests", "pytest -m gpu", f"rc {r.returncode}: {summary[-1] if summary else r.stderr[-300:]}")


def kernels() -> None:
    try:
        from benchmarks import kernel_bench
    except ImportError as e:
        row("kernels", "kernel_bench", f"not in this tree ({e})")
        return
    for r in kernel_bench.bench_kernels("cuda"):
        row("kernels", r.get("kernel", "?"), ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                    for k, v in r.items() if k != "kernel" and v not in (None, "")))


def _llama(quick: bool, device: str):
    from autopar.models import llama
    if quick:
        return llama.llama(n_layer=2, n_head=8, n_kv_heads=4, d_model=512, ffn_hidden=1408, vocab=8000,
                           seq=512, batch=4, device=device)
    # ~0.9B parameters: 16 layers, d 2048, 16 query / 8 kv heads, SwiGLU 5632, vocab 32000; 4 x 2048 tokens
    return llama.llama(n_layer=16, n_head=16, n_kv_heads=8, d_model=2048, ffn_hidden=5632, vocab=32000,
                       seq=2048, batch=4, device=device)


def _timed_steps(step, warm: int, n: int) -> tuple[float, list[float]]:
    import torch
    losses = [step() for _ in range(warm)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    losses += [step() for _ in range(n)]
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n, losses


def _eager(quick: bool) -> None:
    """The hand-written baseline: fp32 weights, autocast bf16, fused AdamW."""
    import torch
    model, batch = _llama(quick, "cpu")
    model, batch = model.cuda(), tuple(t.cuda() for t in batch)
    n = sum(p.numel() for p in model.parameters())
    row("train", "model", f"Llama-style, {n / 1e9:.3f} B parameters, batch {tuple(batch[0].shape)}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    torch.cuda.reset_peak_memory_stats()
    t, losses = _timed_steps(step, 3, 5 if not quick else 3)
    row("train", "eager autocast bf16 + fused AdamW", f"{t * 1e3:.1f} ms/step, peak "
        f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    model = opt = None   # freed before the next run
    torch.cuda.empty_cache()


def _cluster(calibration=None):
    import autopar
    c = autopar.Cluster.preset("dgx-h100", devices=1)
    return c.with_calibration(calibration) if calibration else c


def _autopar(quick: bool, label: str, kernels: str, calibration=None) -> None:
    import torch
    import autopar
    model, batch = _llama(quick, "cpu")
    t0 = time.perf_counter()
    compiled = autopar.compile(model, _cluster(calibration), batch, optimizer="adamw", lr=1e-4, kernels=kernels)
    plan = compiled.plan
    deg = {k: v for k, v in plan.degrees.items() if v not in (None, 1, False, 0, [], "1d")}
    row("train", f"autopar {label}: plan", f"{deg}, kernels {plan.kernels} {plan.fused}; set-up "
        f"{time.perf_counter() - t0:.1f} s")
    import runtime.kernels as K
    K.reset_kernel_stats()
    gb = [t.cuda() for t in batch]
    torch.cuda.reset_peak_memory_stats()
    t, losses = _timed_steps(lambda: compiled.step(*gb), 3, 5 if not quick else 3)
    peak = torch.cuda.max_memory_allocated()
    row("train", f"autopar {label}", f"{t * 1e3:.1f} ms/step (predicted {plan.step_time * 1e3:.1f}, "
        f"measured/predicted {t / plan.step_time:.2f}), peak {peak / 2**30:.2f} GiB (predicted "
        f"{plan.peak_memory / 2**30:.2f}, ratio {peak / plan.peak_memory:.2f}), "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"launches {dict((k, v) for k, v in K.kernel_stats().items() if v)}")
    compiled = model = None   # freed before the next run
    torch.cuda.empty_cache()


def _init_pg() -> None:
    """One rank, created the way autopar.compile creates it under torchrun."""
    from autopar.execution.placement import require_process_group
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29517")):
        os.environ.setdefault(k, v)
    require_process_group(_cluster())


def train(quick: bool) -> None:
    _init_pg()
    section("train/eager", _eager, quick)
    section("train/autopar-torch", _autopar, quick, "kernels=torch", "torch")
    section("train/autopar-triton", _autopar, quick, "kernels=triton", "triton")


def calibrate(quick: bool, out_dir: str) -> None:
    _init_pg()
    from autopar.execution.calibrate import calibrate as run
    path = os.path.join(out_dir, "calibration_gpu.yaml")
    t0 = time.perf_counter()
    cal = run(sweep="tiny" if quick else "gpu", repeats=3, output=path)
    row("calibrate", "autopar calibrate --sweep gpu", f"{time.perf_counter() - t0:.1f} s; GEMM peak "
        f"{max(r for _, r in cal.gemm) / 1e12:.0f} TFLOP/s, memory {max(r for _, r in cal.memory) / 1e9:.0f} GB/s, "
        f"kernel {cal.kernel_overhead * 1e6:.1f} us -> {path}")
    section("train/autopar-calibrated-torch", _autopar, quick, "kernels=torch, calibrated", "torch", path)
    section("train/autopar-calibrated-triton", _autopar, quick, "kernels=triton, calibrated", "triton", path)


def _offload_model(quick: bool, device: str):
    from autopar.models import llama
    if quick:   # ~0.2B
        return llama.llama(n_layer=4, n_head=16, n_kv_heads=8, d_model=2048, ffn_hidden=5632, vocab=32000,
                           seq=512, batch=2, device=device)
    # ~2.8B parameters: 26 layers, d 3072, 24 query / 8 kv heads, SwiGLU 8192, vocab 32000; 2 x 2048 tokens
    return llama.llama(n_layer=26, n_head=24, n_kv_heads=8, d_model=3072, ffn_hidden=8192, vocab=32000,
                       seq=2048, batch=2, device=device)


def offload(quick: bool) -> None:
    """Section 6 (module doc)."""
    import torch
    import autopar
    from autopar.hardware import Host
    from autopar.errors import MemoryBudgetError
    import dataclasses
    _init_pg()
    # The lent machines: 128 GiB of host memory, 16 cores; copy and CPU rates are guesses that
    # this section measures (PCIe 5.0 x16 ~50 GB/s; DDR5 at ~100 GB/s for an AdamW step).
    cluster = dataclasses.replace(_cluster(), host=Host(128 * 2**30, 50e9, 100e9, 1))
    model, batch = _offload_model(quick, "meta")
    n = sum(p.numel() for p in model.parameters())
    budget = int(n * 16 * 0.75)   # AdamW's 16 bytes per parameter do not fit
    try:
        autopar.plan(model, batch, cluster, memory_budget=budget, constraints={"offload": "none"})
        row("offload", "premise", "FAILED: the plan without offload fits the budget")
    except MemoryBudgetError as e:
        row("offload", "premise", f"{n / 1e9:.2f} B parameters, budget {budget / 2**30:.1f} GiB: no plan without "
            f"offload (least peak {e.min_peak_bytes / 2**30:.1f} GiB)")
    model, batch = _offload_model(quick, "cpu")
    t0 = time.perf_counter()
    compiled = autopar.compile(model, cluster, batch, optimizer="adamw", lr=1e-5,
                               plan_options={"memory_budget": budget})
    plan = compiled.plan
    off = plan.predictions.get("offload", {})
    row("offload", "plan", f"offload {plan.degrees['offload']}, zero {plan.degrees['zero']}, micro-batches "
        f"{plan.degrees['num_micro_batches']}, checkpoint {plan.degrees['checkpoint']}; host "
        f"{off.get('host_bytes', 0) / 2**30:.1f} GiB predicted; set-up {time.perf_counter() - t0:.1f} s")
    gb = [t.cuda() for t in batch]
    torch.cuda.reset_peak_memory_stats()
    t, losses = _timed_steps(lambda: compiled.step(*gb), 1, 2 if quick else 3)
    peak = torch.cuda.max_memory_allocated()
    stats = compiled.offload_stats()
    row("offload", "AdamW, optimizer on the host", f"{t:.2f} s/step (predicted {plan.step_time:.2f}, "
        f"measured/predicted {t / plan.step_time:.2f}; CPU step predicted "
        f"{plan.predictions['time_breakdown']['optimizer']:.2f} s), "
        f"peak {peak / 2**30:.2f} GiB (predicted {plan.peak_memory / 2**30:.2f}, ratio {peak / plan.peak_memory:.2f}), "
        f"host {stats['host'] / 2**30:.1f} GiB (predicted {off.get('host_bytes', 0) / 2**30:.1f}), d2h "
        f"{stats['d2h'] / 2**30:.2f} GiB / h2d {stats['h2d'] / 2**30:.2f} GiB per step, loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f}")
    compiled = model = None
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    ap.add_argument("--only", default="env,train,kernels,tests,calibrate,offload")
    args = ap.parse_args(argv)
    import torch
    only = set(args.only.split(","))
    out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else "."
    if args.out:
        OUT.append(args.out)
    t0 = time.perf_counter()
    if "env" in only:
        section("env", env)
    if not torch.cuda.is_available():
        row("gpu-check", "stopped", "no CUDA device here: the remaining sections (tests -m gpu, kernels, "
            "training, calibrate) need one; run scripts/gpu-check.sh on a GPU machine")
    else:
        for name, fn, a in (("train", train, (args.quick,)), ("kernels", kernels, ()), ("tests", tests, ()),
                            ("calibrate", calibrate, (args.quick, out_dir)), ("offload", offload, (args.quick,))):
            if name in only:
                section(name, fn, *a)
    row("gpu-check", "total", f"{time.perf_counter() - t0:.0f} s")
    print("\n" + _table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
