"""runtime/kernels on a CUDA device: each Triton kernel against its eager torch reference and
torch.compile of that reference, at Llama-1B/8B sizes, forward + backward.

    python -m benchmarks.kernel_bench

Cases: RMSNorm 8192 rows x hidden 2048 and 4096 (bf16, bf16 weight); SwiGLU 8192 x 5632 (bf16);
LayerNorm 8192 x 2048 (bf16, bf16 weight and bias); GeGLU (tanh gelu) 8192 x 5632 (bf16); linear +
cross-entropy N 8192, D 2048, V 128256 (bf16); one AdamW step over 100M fp32 elements (also
torch.optim.AdamW(fused=True)); rotary on q of 4 x 32 heads x 2048 x 128 (bf16, Hugging Face's
transposed layout); softmax over 65536 rows of 1024 (bf16). A time is the median of REPS runs after
WARMUP (CUDA events, synchronised), in ms. "max abs diff" compares the variant's outputs and
gradients with eager's (for AdamW: the parameter after one step from the same state). For linear +
cross-entropy the peak memory above what was allocated before the run
(torch.cuda.max_memory_allocated, reset before each variant) is shown, and the Triton / eager ratio.
Every variant runs in its own try: a failure is that row's note. torch.compile variants are skipped
once COMPILE_BUDGET_S seconds have passed, to keep the whole run near a minute. Without CUDA it says
so and exits 0.
"""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from runtime.kernels.adamw import adamw_step
from runtime.kernels.geglu import geglu, geglu_reference
from runtime.kernels.layer_norm import layer_norm, layer_norm_reference
from runtime.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from runtime.kernels.rms_norm import rms_norm, rms_norm_reference
from runtime.kernels.rotary import rotary, rotary_reference
from runtime.kernels.softmax import softmax, softmax_reference
from runtime.kernels.swiglu import swiglu, swiglu_reference

WARMUP = 3
REPS = 10
COMPILE_BUDGET_S = 45.0

_start = time.monotonic()


def _cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _sync(device) -> None:
    if _cuda(device):
        torch.cuda.synchronize()


def _time_ms(fn, device, reps: int = REPS) -> float:
    for _ in range(WARMUP):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if _cuda(device):
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_bytes(fn, device) -> int | None:
    if not _cuda(device):
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def _max_diff(out, ref) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:100] if text else ''}"


def _compiled(fn):
    """torch.compile(fn), compiled lazily on first call (errors then surface in that row)."""
    return torch.compile(fn, dynamic=False)


def _run_case(kernel: str, shape: str, variants: dict, device, memory: bool = False,
              reps: int = REPS) -> list[dict]:
    """``variants``: name -> zero-argument callable doing forward + backward and returning the
    tensors compared (outputs, then gradients); "eager" first."""
    rows = []
    ref = None
    for name, fn in variants.items():
        row = dict(kernel=kernel, shape=shape, variant=name, ms=None, max_abs_diff=None,
                   peak_mib=None, note="")
        rows.append(row)
        if name.startswith("torch.compile") and time.monotonic() - _start > COMPILE_BUDGET_S:
            row["note"] = "skipped: time budget"
            continue
        try:
            out = fn()
            _sync(device)
            if name == "eager":
                ref = out
                row["max_abs_diff"] = 0.0
            elif ref is not None:
                row["max_abs_diff"] = _max_diff(out, ref)
            del out
            row["ms"] = _time_ms(fn, device, reps)
            peak = _peak_bytes(fn, device) if memory else None
            row["peak_mib"] = None if peak is None else peak / 2**20
        except Exception as e:   # one variant's failure is its row's note
            row["note"] = "failed: " + _short(e)
            if name.startswith("torch.compile"):
                try:
                    torch._dynamo.reset()
                except Exception:
                    pass
    eager_ms = next((r["ms"] for r in rows if r["variant"] == "eager"), None)
    eager_peak = next((r["peak_mib"] for r in rows if r["variant"] == "eager"), None)
    for r in rows:
        if r["ms"] and eager_ms:
            r["speedup"] = eager_ms / r["ms"]
        if memory and r["peak_mib"] and eager_peak:
            r["peak_ratio"] = r["peak_mib"] / eager_peak
    del ref
    _empty_cache(device)
    return rows


def _empty_cache(device) -> None:
    if _cuda(device):
        torch.cuda.empty_cache()


LLAMA_SIZES = dict(rms_norm=[(8192, 2048), (8192, 4096)], swiglu=(8192, 5632), layer_norm=(8192, 2048),
                   geglu=(8192, 5632), linear_cross_entropy=(8192, 2048, 128256), adamw=100_000_000,
                   rotary=(4, 32, 2048, 128), softmax=(4 * 16 * 1024, 1024))


class _Bench:
    """One run's settings: device, repeats, whether to try torch.compile."""

    def __init__(self, device, reps: int, compile: bool):
        self.device = device
        self.reps = reps
        self.compile = compile

    def variants(self, eager, triton_fn, compiled_of):
        out = {"eager": eager, "triton": triton_fn}
        if self.compile:
            out["torch.compile"] = compiled_of
        return out

    def case(self, kernel, shape, make, reference, kernel_fn, memory=False, extra=None):
        """``make(f)``: the zero-argument forward + backward of f; torch.compile is applied lazily
        (inside the try of its row)."""
        compiled = {}

        def compiled_run():
            if "run" not in compiled:
                compiled["run"] = make(_compiled(reference))
            return compiled["run"]()
        variants = self.variants(make(reference), make(kernel_fn), compiled_run)
        variants.update(extra or {})
        return _run_case(kernel, shape, variants, self.device, memory=memory, reps=self.reps)


def _rms_case(b: _Bench, rows: int, hidden: int, dtype=torch.bfloat16) -> list[dict]:
    x = torch.randn(rows, hidden, device=b.device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device=b.device)).to(dtype).requires_grad_()
    dy = torch.randn(rows, hidden, device=b.device, dtype=dtype)

    def make(f):
        def run():
            y = f(x, w, 1e-5)
            gx, gw = torch.autograd.grad(y, [x, w], dy)
            return y.detach(), gx, gw
        return run
    return b.case("rms_norm", f"{rows}x{hidden} bf16", make, rms_norm_reference, rms_norm)


def _swiglu_case(b: _Bench, rows: int, inter: int, dtype=torch.bfloat16) -> list[dict]:
    g = torch.randn(rows, inter, device=b.device, dtype=dtype, requires_grad=True)
    u = torch.randn(rows, inter, device=b.device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, inter, device=b.device, dtype=dtype)

    def make(f):
        def run():
            y = f(g, u)
            gg, gu = torch.autograd.grad(y, [g, u], dy)
            return y.detach(), gg, gu
        return run
    return b.case("swiglu", f"{rows}x{inter} bf16", make, swiglu_reference, swiglu)


def _layer_norm_case(b: _Bench, rows: int, hidden: int, dtype=torch.bfloat16) -> list[dict]:
    x = torch.randn(rows, hidden, device=b.device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device=b.device)).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(hidden, device=b.device)).to(dtype).requires_grad_()
    dy = torch.randn(rows, hidden, device=b.device, dtype=dtype)

    def make(f):
        def run():
            y = f(x, w, bias, 1e-5)
            return (y.detach(), *torch.autograd.grad(y, [x, w, bias], dy))
        return run
    return b.case("layer_norm", f"{rows}x{hidden} bf16", make, layer_norm_reference, layer_norm)


def _geglu_case(b: _Bench, rows: int, inter: int, dtype=torch.bfloat16) -> list[dict]:
    g = torch.randn(rows, inter, device=b.device, dtype=dtype, requires_grad=True)
    u = torch.randn(rows, inter, device=b.device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, inter, device=b.device, dtype=dtype)

    def make(f):
        def run():
            y = f(g, u, "tanh")
            return (y.detach(), *torch.autograd.grad(y, [g, u], dy))
        return run
    return b.case("geglu", f"{rows}x{inter} bf16 tanh", make, geglu_reference, geglu)


def _rotary_case(b: _Bench, batch: int, heads: int, seq: int, head_dim: int, dtype=torch.bfloat16) -> list[dict]:
    """q of [batch, heads, seq, head_dim] laid out as Hugging Face's (a transposed [B, S, H, D]),
    the tables [batch, 1, seq, head_dim]."""
    x = torch.randn(batch, seq, heads, head_dim, device=b.device, dtype=dtype).transpose(1, 2).requires_grad_()
    ang = torch.rand(batch, 1, seq, head_dim // 2, device=b.device) * 6.28
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    dy = torch.randn(batch, heads, seq, head_dim, device=b.device, dtype=dtype)

    def make(f):
        def run():
            y = f(x, cos, sin)
            return y.detach(), *torch.autograd.grad(y, [x], dy)
        return run
    return b.case("rotary", f"{batch}x{heads}x{seq}x{head_dim} bf16", make, rotary_reference, rotary)


def _softmax_case(b: _Bench, rows: int, cols: int, dtype=torch.bfloat16) -> list[dict]:
    x = torch.randn(rows, cols, device=b.device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, cols, device=b.device, dtype=dtype)

    def make(f):
        def run():
            y = f(x)
            return y.detach(), *torch.autograd.grad(y, [x], dy)
        return run
    return b.case("softmax", f"{rows}x{cols} bf16", make, softmax_reference, softmax)


def _lce_case(b: _Bench, n: int, d: int, v: int, dtype=torch.bfloat16) -> list[dict]:
    h = torch.randn(n, d, device=b.device, dtype=dtype, requires_grad=True)
    w = (0.02 * torch.randn(v, d, device=b.device)).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=b.device)
    t[::17] = -100

    def make(f):
        def run():
            loss = f(h, w, t)
            gh, gw = torch.autograd.grad(loss, [h, w])
            return loss.detach().reshape(1), gh, gw
        return run
    return b.case("linear_cross_entropy", f"N{n} D{d} V{v} bf16", make, linear_cross_entropy_reference,
                  linear_cross_entropy, memory=True)


def _adamw_torch(p, g, m, v, decay: float, beta1: float, beta2: float, eps: float, step_size: float,
                 bc2_sqrt: float):
    p.mul_(decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def _adamw_case(b: _Bench, n: int) -> list[dict]:
    lr, betas, eps, wd = 1e-4, (0.9, 0.95), 1e-8, 0.1
    dev = b.device
    gen = torch.Generator(device=dev).manual_seed(0)
    start = [torch.randn(n, device=dev, generator=gen) for _ in range(2)]   # param, grad

    def variant(kind):
        p, g = start[0].clone(), start[1]
        m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        if kind in ("eager", "torch fused"):
            param = torch.nn.Parameter(p)
            param.grad = g
            opt = torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                    foreach=False, fused=True if kind == "torch fused" else None)

            def run():
                opt.step()
                return (param.detach(),)
            return run
        if kind == "triton":
            def run():
                adamw_step(p, g, m, v, lr=lr, betas=betas, eps=eps, weight_decay=wd, step=1)
                return (p,)
            return run
        compiled = _compiled(_adamw_torch)
        step_size = lr / (1 - betas[0])
        bc2_sqrt = math.sqrt(1 - betas[1])

        def run():
            compiled(p, g, m, v, 1 - lr * wd, betas[0], betas[1], eps, step_size, bc2_sqrt)
            return (p,)
        return run

    class Variant:
        """Its first call is one step from the start state (compared); later calls time more steps."""

        def __init__(self, kind):
            self.kind = kind
            self.fn = None

        def __call__(self):
            if self.fn is None:
                self.fn = variant(self.kind)
                return tuple(t.clone() for t in self.fn())
            return self.fn()

    kinds = ["eager", "triton"] + (["torch.compile"] if b.compile else []) + \
        (["torch fused"] if _cuda(dev) else [])
    rows = _run_case("adamw", f"{n / 1e6:.3g}M fp32", {k: Variant(k) for k in kinds}, dev, reps=b.reps)
    start.clear()
    _empty_cache(dev)
    return rows


def bench_kernels(device: str = "cuda", *, sizes: dict | None = None, reps: int = REPS,
                  compile: bool = True) -> list[dict]:
    """Every case's rows (dicts: kernel, shape, variant, ms, speedup, max_abs_diff, peak_mib,
    peak_ratio, note) at ``sizes`` (default LLAMA_SIZES). Needs CUDA, or the Triton interpreter
    with device "cpu" (a smoke run at small sizes: CPU times, no memory peaks)."""
    global _start
    from runtime.kernels import interpreted
    if _cuda(device):
        if not torch.cuda.is_available():
            raise RuntimeError("kernel_bench: needs a CUDA device")
    elif not interpreted():
        raise RuntimeError("kernel_bench: on CPU the kernels need TRITON_INTERPRET=1")
    sizes = dict(LLAMA_SIZES, **(sizes or {}))
    b = _Bench(device, reps, compile)
    _start = time.monotonic()
    cases = [(f"rms_norm {r}x{h}", lambda r=r, h=h: _rms_case(b, r, h)) for r, h in sizes["rms_norm"]]
    cases += [("swiglu", lambda: _swiglu_case(b, *sizes["swiglu"])),
              ("layer_norm", lambda: _layer_norm_case(b, *sizes["layer_norm"])),
              ("geglu", lambda: _geglu_case(b, *sizes["geglu"])),
              ("linear_cross_entropy", lambda: _lce_case(b, *sizes["linear_cross_entropy"])),
              ("adamw", lambda: _adamw_case(b, sizes["adamw"])),
              ("rotary", lambda: _rotary_case(b, *sizes["rotary"])),
              ("softmax", lambda: _softmax_case(b, *sizes["softmax"]))]
    rows = []
    for name, case in cases:
        t0 = time.monotonic()
        try:
            rows += case()
        except Exception as e:   # a case that could not even set up
            rows.append(dict(kernel=name, shape="", variant="", ms=None, max_abs_diff=None,
                             peak_mib=None, note="failed: " + _short(e)))
        _empty_cache(device)
        print(f"kernel_bench: {name} {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return rows


def _fmt(x, spec) -> str:
    return "" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    lines = ["| kernel | shape | variant | fwd+bwd ms | speedup vs eager | max abs diff vs eager "
             "| peak extra MiB | peak / eager | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['variant']} | {_fmt(r.get('ms'), '.3f')} | "
                     f"{_fmt(r.get('speedup'), '.2f')} | {_fmt(r.get('max_abs_diff'), '.3g')} | "
                     f"{_fmt(r.get('peak_mib'), '.0f')} | {_fmt(r.get('peak_ratio'), '.3f')} | {r.get('note', '')} |")
    return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA device; skipped")
        return 0
    t0 = time.monotonic()
    rows = bench_kernels("cuda")
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"median of {REPS} after {WARMUP} warm-up; AdamW 'fwd+bwd' is one optimizer step\n")
    print(table(rows))
    print(f"\ntotal {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
