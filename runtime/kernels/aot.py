"""Ahead-of-time builds of every kernel specialisation to cubin for CUDA targets (sm_80, sm_90),
no GPU needed: catches what Triton's interpreter lets through (types, constexpr use, unsupported
ops) before a GPU ever runs them. ``autopar kernels --aot sm_80,sm_90`` runs ``main`` in a child
process without ``TRITON_INTERPRET`` (under the interpreter triton.language's own helpers, tl.max
say, are interpreted functions and cannot be compiled) and exits non-zero if any build fails.

``CASES``: each kernel with the dtypes and block sizes the runtime launches it with (bf16 and fp32
activations; block = next power of two of the hidden size, 128 to 4096 for the zoo's models).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from runtime.kernels import adamw, geglu, layer_norm, linear_cross_entropy, optimizer_steps, rms_norm, rotary, \
    swiglu

ARCHS = (80, 90)

CE = dict(n_cols="i32", vocab_start="i32", ignore_index="i32")
CASES = {
    "rms_norm_fwd_residual_bf16": (rms_norm._rms_norm_fwd,
        dict(X="*bf16", R="*bf16", W="*fp32", Y="*bf16", H="*bf16", RSTD="*fp32", n_cols="i32", eps="fp32"),
        dict(HAS_RESIDUAL=True, BLOCK=4096)),
    "rms_norm_fwd_fp32": (rms_norm._rms_norm_fwd,
        dict(X="*fp32", R="*fp32", W="*fp32", Y="*fp32", H="*fp32", RSTD="*fp32", n_cols="i32", eps="fp32"),
        dict(HAS_RESIDUAL=False, BLOCK=128)),
    "rms_norm_bwd_bf16": (rms_norm._rms_norm_bwd,
        dict(DY="*bf16", X="*bf16", W="*bf16", RSTD="*fp32", DH="*bf16", DX="*bf16", DW_PART="*fp32",
             n_rows="i32", n_cols="i32", rows_per_program="i32", eps="fp32"),
        dict(HAS_DH=True, RECOMPUTE=False, BLOCK=2048)),
    "rms_norm_bwd_recompute_fp32": (rms_norm._rms_norm_bwd,
        dict(DY="*fp32", X="*fp32", W="*fp32", RSTD="*fp32", DH="*fp32", DX="*fp32", DW_PART="*fp32",
             n_rows="i32", n_cols="i32", rows_per_program="i32", eps="fp32"),
        dict(HAS_DH=False, RECOMPUTE=True, BLOCK=1024)),
    "swiglu_fwd_bf16": (swiglu._swiglu_fwd, dict(G="*bf16", U="*bf16", Y="*bf16", n="i32"), dict(BLOCK=1024)),
    "swiglu_bwd_fp32": (swiglu._swiglu_bwd,
        dict(DY="*fp32", G="*fp32", U="*fp32", DG="*fp32", DU="*fp32", n="i64"), dict(BLOCK=1024)),
    "layer_norm_fwd_bf16": (layer_norm._layer_norm_fwd,
        dict(X="*bf16", W="*fp32", B="*fp32", Y="*bf16", n_cols="i32", eps="fp32"),
        dict(BLOCK=4096)),
    "layer_norm_fwd_fp32": (layer_norm._layer_norm_fwd,
        dict(X="*fp32", W="*fp32", B="*fp32", Y="*fp32", n_cols="i32", eps="fp32"),
        dict(BLOCK=128)),
    "layer_norm_bwd_bf16": (layer_norm._layer_norm_bwd,
        dict(DY="*bf16", X="*bf16", W="*bf16", DX="*bf16", DW_PART="*fp32", DB_PART="*fp32", n_rows="i32",
             n_cols="i32", rows_per_program="i32", eps="fp32"),
        dict(BLOCK=2048)),
    "layer_norm_bwd_fp32": (layer_norm._layer_norm_bwd,
        dict(DY="*fp32", X="*fp32", W="*fp32", DX="*fp32", DW_PART="*fp32", DB_PART="*fp32", n_rows="i32",
             n_cols="i32", rows_per_program="i32", eps="fp32"),
        dict(BLOCK=1024)),
    "geglu_fwd_bf16_erf": (geglu._geglu_fwd, dict(G="*bf16", U="*bf16", Y="*bf16", n="i32"),
                           dict(TANH=False, BLOCK=1024)),
    "geglu_fwd_fp32_tanh": (geglu._geglu_fwd, dict(G="*fp32", U="*fp32", Y="*fp32", n="i32"),
                            dict(TANH=True, BLOCK=1024)),
    "geglu_bwd_bf16_tanh": (geglu._geglu_bwd,
        dict(DY="*bf16", G="*bf16", U="*bf16", DG="*bf16", DU="*bf16", n="i32"), dict(TANH=True, BLOCK=1024)),
    "geglu_bwd_fp32_erf": (geglu._geglu_bwd,
        dict(DY="*fp32", G="*fp32", U="*fp32", DG="*fp32", DU="*fp32", n="i64"), dict(TANH=False, BLOCK=1024)),
    "ce_row_stats_bf16": (linear_cross_entropy._ce_row_stats,
        dict(LOGITS="*bf16", TARGETS="*i64", MAX="*fp32", SUMEXP="*fp32", TLOGIT="*fp32", **CE), dict(BLOCK=4096)),
    "ce_grad_logits_bf16": (linear_cross_entropy._ce_grad_logits,
        dict(LOGITS="*bf16", TARGETS="*i64", LSE="*fp32", SCALE="*fp32", **CE), dict(BLOCK=4096)),
    "ce_grad_logits_fp32": (linear_cross_entropy._ce_grad_logits,
        dict(LOGITS="*fp32", TARGETS="*i64", LSE="*fp32", SCALE="*fp32", **CE), dict(BLOCK=512)),
    "adamw": (adamw._adamw_step,
        dict(P="*fp32", G="*fp32", M="*fp32", V="*fp32", n="i32", lr="fp32", beta1="fp32", beta2="fp32",
             eps="fp32", decay="fp32", step_size="fp32", bias_correction2_sqrt="fp32"), dict(BLOCK=1024)),
    **{f"sgd_{name}": (optimizer_steps._sgd_step,
                       dict(P="*fp32", G="*fp32", B="*fp32", n="i32", lr="fp32", momentum="fp32", dampening="fp32",
                            weight_decay="fp32"),
                       dict(HAS_MOMENTUM=mom, FIRST=first, NESTEROV=nest, BLOCK=1024))
       for name, mom, first, nest in (("plain", False, False, False), ("momentum_first", True, True, False),
                                      ("momentum", True, False, False), ("nesterov", True, False, True))},
    "lamb_direction": (optimizer_steps._lamb_direction,
        dict(P="*fp32", G="*fp32", M="*fp32", V="*fp32", U="*fp32", n="i32", beta1="fp32", beta2="fp32",
             bias_correction1="fp32", bias_correction2="fp32", eps="fp32", weight_decay="fp32"), dict(BLOCK=1024)),
    "lamb_apply": (optimizer_steps._scaled_sub, dict(P="*fp32", U="*fp32", n="i32", scale="fp32"), dict(BLOCK=1024)),
    "lars_step": (optimizer_steps._lars_step,
        dict(P="*fp32", G="*fp32", B="*fp32", n="i32", scale="fp32", momentum="fp32", weight_decay="fp32"),
        dict(BLOCK=1024)),
}


# rotary (Hugging Face's halves and the interleaved pairs): x, cos, sin, y of one dtype (Hugging
# Face casts the tables to x's) or fp32 tables;
# head_dim 64 (BLOCK_H 32) and 128 (BLOCK_H 64), rows per program = ELEMENTS / head_dim
def _rotary_sig(x, tables=None):
    t = tables or x
    strides = {f"s{a}{i}": "i32" for a in "xcsy" for i in range(4)}
    return dict(X=f"*{x}", C=f"*{t}", S=f"*{t}", Y=f"*{x}", n_rows="i32", n1="i32", n2="i32", half="i32",
                **strides)


for _name, _x, _tables, _d, _bwd, _il in (("fwd_bf16_d64", "bf16", None, 64, False, False),
                                          ("fwd_bf16_fp32_tables_d128", "bf16", "fp32", 128, False, False),
                                          ("bwd_bf16_d128", "bf16", None, 128, True, False),
                                          ("fwd_fp32_d128", "fp32", None, 128, False, False),
                                          ("bwd_fp32_d64", "fp32", None, 64, True, False),
                                          ("interleaved_fwd_bf16_d128", "bf16", None, 128, False, True),
                                          ("interleaved_bwd_fp32_d64", "fp32", None, 64, True, True)):
    CASES[f"rotary_{_name}"] = (rotary._rotary, _rotary_sig(_x, _tables),
                                dict(BACKWARD=_bwd, INTERLEAVED=_il, BLOCK_R=rotary.ELEMENTS // _d, BLOCK_H=_d // 2))


# softmax, dropout_add (issue 31)
from runtime.kernels import dropout_add, softmax  # noqa: E402

CASES.update({
    "softmax_fwd_bf16": (softmax._softmax_fwd, dict(X="*bf16", Y="*bf16", n_cols="i32"), dict(BLOCK=2048)),
    "softmax_fwd_fp32": (softmax._softmax_fwd, dict(X="*fp32", Y="*fp32", n_cols="i32"), dict(BLOCK=16)),
    "softmax_bwd_bf16": (softmax._softmax_bwd, dict(DY="*bf16", Y="*bf16", DX="*bf16", n_cols="i32"),
                         dict(BLOCK=2048)),
    "softmax_bwd_fp32": (softmax._softmax_bwd, dict(DY="*fp32", Y="*fp32", DX="*fp32", n_cols="i32"),
                         dict(BLOCK=128)),
    "dropout_add_fwd_bf16": (dropout_add._dropout_add_fwd,
        dict(X="*bf16", R="*bf16", Y="*bf16", SEED="*i64", n="i32", thresh="i32", scale="fp32"), dict(BLOCK=1024)),
    "dropout_add_fwd_fp32": (dropout_add._dropout_add_fwd,
        dict(X="*fp32", R="*fp32", Y="*fp32", SEED="*i64", n="i32", thresh="i32", scale="fp32"), dict(BLOCK=1024)),
    "dropout_add_bwd_bf16": (dropout_add._dropout_add_bwd,
        dict(DY="*bf16", DX="*bf16", SEED="*i64", n="i32", thresh="i32", scale="fp32"), dict(BLOCK=1024)),
    "dropout_add_bwd_fp32": (dropout_add._dropout_add_bwd,
        dict(DY="*fp32", DX="*fp32", SEED="*i64", n="i32", thresh="i32", scale="fp32"), dict(BLOCK=1024)),
})


def _jit(kernel):
    """The compilable function: the kernel itself, or under the interpreter a JITFunction of its source."""
    from triton.runtime.jit import JITFunction
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def compile_all(archs=ARCHS) -> dict:
    """case-arch -> "ok" or the error; {"__skip__": reason} without the API or ptxas. Run it in a
    process without TRITON_INTERPRET (``main`` / ``autopar kernels --aot`` see to it)."""
    import triton
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        return {"__skip__": f"triton {triton.__version__} has no ASTSource/GPUTarget API ({e})"}
    results = {}
    for case, (kernel, signature, constexprs) in sorted(CASES.items()):
        fn = _jit(kernel)
        signature = dict(signature, **{k: "constexpr" for k in constexprs})
        for arch in archs:
            key = f"{case}-sm{arch}"
            if list(signature) != fn.arg_names:
                results[key] = f"signature names {list(signature)} != arguments {fn.arg_names}"
                continue
            try:
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                          target=GPUTarget("cuda", arch, 32))
                results[key] = "ok" if compiled.asm.get("cubin") else "no cubin"
            except Exception as e:   # reported by the test of this case
                text = f"{type(e).__name__}: {e}"
                if "ptxas" in text and ("not found" in text or "No such file" in text):
                    return {"__skip__": f"no ptxas for triton's CUDA backend: {text[:200]}"}
                results[key] = text[-2000:]
    return results


def parse_archs(text: str) -> tuple[int, ...]:
    """"sm_80,sm_90" (or "80,90") -> (80, 90)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower().removeprefix("sm_").removeprefix("sm")
        if not p.isdigit():
            raise ValueError(f"not a CUDA architecture: {part!r} (expected e.g. sm_80,sm_90)")
        out.append(int(p))
    return tuple(out)


def build_in_child(archs=ARCHS, timeout: float = 600) -> dict:
    """``compile_all`` in a fresh Python without TRITON_INTERPRET; its results."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "runtime.kernels.aot", ",".join(map(str, archs))], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the compiling child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(compile_all(parse_archs(sys.argv[1]) if len(sys.argv) > 1 else ARCHS)))
