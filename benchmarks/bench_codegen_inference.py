"""Generation on autopar's own programs against the model's modules and the plan's prediction.

    PYTHONPATH=. python benchmarks/bench_codegen_inference.py [--tps 1,2] [--batch 4] [--prompt 64] [--new 32]

The load test's model (a 4-layer Llama, hidden 256, 8 heads / 4 kv heads, vocabulary 2048; the
``SERVE_MODEL`` of bench_inference.py) is planned for one static batch with ``plan_inference`` on
the calibrated ``cpu`` preset (``autopar calibrate``, then the host figures measured now, as
bench_inference.py ``--part continuous`` prices its plans), tp pinned. On ``tp`` gloo ranks each
backend of ``compile_inference`` (``"modules"``: the model's own modules, sliced; ``"codegen"``:
the planned prefill and decode steps lowered to per-rank programs) generates the same greedy batch,
twice to warm up, then ``--repeats`` times; the fastest prefill (time to the first new token) and
the fastest mean time per later token are kept, against the plan's TTFT and TPOT. The tokens of the
two backends are checked equal. Prints one table: measured, predicted, and the ratios
codegen / modules and measured / predicted.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_inference import _calibrated_cluster  # noqa: E402
from runtime.launch import run_local  # noqa: E402


def _model():
    from autopar.models import hf
    torch.manual_seed(0)
    return hf.hf_llama(n_layer=4, d_model=256, n_head=8, n_kv_heads=4, ffn_hidden=704, vocab=2048,
                       seq=128)[0].model.eval()


def _prompts(batch: int, prompt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(1, 2048, (batch, prompt), generator=gen)


def _rank(rank, world, plan_json, batch, prompt, new, repeats):
    """Both backends on this rank: (backend, fastest prefill s, fastest s per later token, tokens)."""
    from autopar.inference.engine import compile_inference
    from autopar.inference.inference_plan import InferencePlan
    torch.set_num_threads(1)
    plan = InferencePlan.from_json(plan_json)
    ids = _prompts(batch, prompt)
    out = []
    for backend in ("modules", "codegen"):
        engine = compile_inference(_model(), plan=plan, backend=backend)
        prefill, per_token, tokens = [], [], None
        for k in range(2 + repeats):
            tokens = engine.generate(ids, new).tolist()
            t = engine.last_timing
            if k >= 2:
                prefill.append(t["prefill_s"])
                per_token.append(t["decode_s"] / max(t["new_tokens"] - 1, 1))
        out.append((backend, min(prefill), min(per_token), tokens))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tps", default="1,2", help="tensor-parallel degrees, one gloo rank each")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--host-overhead", choices=("measure", "preset", "off"), default="measure")
    ap.add_argument("--tmp", default="/tmp/autopar_bench_codegen")
    args = ap.parse_args()
    from autopar.inference.planner import plan_inference
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for tp in (int(x) for x in args.tps.split(",")):
        start = time.perf_counter()
        cluster = _calibrated_cluster(tmp, tp, args.host_overhead)
        plan = plan_inference(_model(), _prompts(args.batch, args.prompt), cluster, max_new_tokens=args.new,
                              constraints={"tp": tp, "pp": 1, "dp": 1}, dtype="fp32")
        results = run_local(_rank, tp, args=(plan.to_json(), args.batch, args.prompt, args.new, args.repeats),
                            timeout=1800)
        (_, m_pre, m_tok, m_ids), (_, c_pre, c_tok, c_ids) = results[0]
        if m_ids != c_ids:
            raise SystemExit(f"tp={tp}: the codegen backend's tokens differ from the modules backend's")
        p = plan.predictions
        rows.append((tp, m_pre, c_pre, p["ttft"], m_tok, c_tok, p["tpot"]))
        print(f"tp={tp}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(f"\nbatch {args.batch} x prompt {args.prompt}, {args.new} new tokens, fp32, fastest of {args.repeats}\n")
    print("| tp | prefill modules | prefill codegen | TTFT predicted | codegen / modules | codegen / predicted "
          "| per token modules | per token codegen | TPOT predicted | codegen / modules | codegen / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tp, m_pre, c_pre, ttft, m_tok, c_tok, tpot in rows:
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        print(f"| {tp} | {ms(m_pre)} | {ms(c_pre)} | {ms(ttft)} | {c_pre / m_pre:.2f}x | {c_pre / ttft:.2f}x "
              f"| {ms(m_tok)} | {ms(c_tok)} | {ms(tpot)} | {c_tok / m_tok:.2f}x | {c_tok / tpot:.2f}x |")


if __name__ == "__main__":
    main()
