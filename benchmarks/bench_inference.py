"""Inference plans and the serving runtime, against published figures and against themselves.

    PYTHONPATH=. python benchmarks/bench_inference.py [--part plans|published|serve|all]

- ``plans``: the configuration ``plan_inference`` chooses for Llama-2-70B and Llama-3-70B shapes on
  one DGX-A100 and one DGX-H100 node (prompt 2048, 256 new tokens, 8 prompts), without targets and
  under TTFT < 2 s with TPOT < 200 ms or < 50 ms.
- ``published``: first-token latency of TensorRT-LLM v0.5's batch-1 table (A100, fp16), and
  predicted end-to-end latency of vLLM's own latency benchmark configurations (batch
  8, input 32, output 128, bf16; https://buildkite.com/vllm/performance-benchmark/builds/9515, an
  H200) with tp pinned as vLLM ran them, against vLLM's measured mean. autopar has no H200 preset:
  the rows use dgx-h100 with the H200's memory (141 GB) and HBM bandwidth (4.8 TB/s), on the
  roofline path (no calibration profile for that device).
- ``serve``: a bounded loopback load test of ``autopar serve`` on the ``cpu`` preset (2 gloo
  ranks, tp=2, a 4-layer Llama of hidden 256), calibrated first (``autopar calibrate``): a fixed
  number of requests at a fixed concurrency; measured TTFT and time per output token (the server's
  /metrics) against the plan's predictions, calibrated and on the plain preset.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import autopar
from autopar.inference.planner import plan_inference
from autopar.inference.serve_process import serve_process
from autopar.models.hf_config import from_hf_config
from benchmarks.hf_configs import CONFIGS

ROOT = Path(__file__).resolve().parents[1]
LLAMA2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
              "num_key_value_heads": 8, "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float16"}   # meta-llama/Llama-2-70b-hf config.json
H200_YAML = """preset: dgx-h100
device: {name: H200-SXM-141GB, memory: 141GB, hbm_bandwidth: 4.8TB/s,
         peak_flops: {bf16: 989T, fp16: 989T, fp32: 494T}, kernel_overhead: 5us}
"""
LLAMA2_7B = dict(LLAMA2_70B, hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=32,
                 num_key_value_heads=32)   # meta-llama/Llama-2-7b-hf config.json
TRTLLM_TTFT = [   # (model, tp, prompt, measured first-token ms): TensorRT-LLM v0.5, A100 FP16, batch 1
    ("Llama-2-7B", 1, 128, 16), ("Llama-2-7B", 1, 2048, 133),
    ("Llama-2-70B", 4, 128, 47), ("Llama-2-70B", 4, 2048, 377)]
TRTLLM_SOURCE = ("https://github.com/NVIDIA/TensorRT-LLM/blob/138f96d45f90b9667426f7c47297d8c06bafac73/"
                 "docs/source/performance.md")
VLLM = [   # (model config, tp, measured mean end-to-end latency ms), vLLM latency tests on one H200
    ("Llama-3-70B", 4, 2077.53), ("Llama-3-8B", 1, 833.421), ("Mixtral-8x7B", 2, 1917.44)]


def _model(name):
    cfg = {"Llama-2-70B": LLAMA2_70B, "Llama-2-7B": LLAMA2_7B}.get(name) or CONFIGS[name]
    return from_hf_config(dict(cfg), seq=16, batch=1, dtype="bf16" if name.startswith("Llama-2") else None)


def part_plans():
    print("| model | cluster | targets | tp | dp | batch/replica | TTFT | TPOT | tokens/s per GPU | memory/GPU | "
          "planned in |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("Llama-2-70B", "Llama-3-70B"):
        model = _model(name)
        for preset in ("dgx-a100", "dgx-h100"):
            cluster = autopar.Cluster.preset(preset)
            for slo in (None, {"ttft": "2s", "tpot": "200ms"}, {"ttft": "2s", "tpot": "50ms"}):
                p = plan_inference(model, torch.zeros(8, 2048, dtype=torch.long), cluster, max_new_tokens=256, slo=slo)
                pr = p.predictions
                targets = "none (latency)" if not slo else f"TTFT<{slo['ttft']}, TPOT<{slo['tpot']}"
                print(f"| {name} | {preset} | {targets} | {p.tp} | {p.dp} | {p.batch_size} | {pr['ttft'] * 1e3:.0f} ms "
                      f"| {pr['tpot'] * 1e3:.1f} ms | {pr['tokens_per_s_per_device']:.0f} | "
                      f"{pr['memory_per_rank'] / 2**30:.1f} GiB | {pr['seconds'] * 1e3:.0f} ms |")


def part_published(tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "h200.yaml").write_text(H200_YAML)
    cluster = autopar.Cluster.from_yaml(tmp / "h200.yaml")
    print("| model | tp | batch x in / out | vLLM measured (H200) | autopar predicted | error |")
    print("|---|---|---|---|---|---|")
    for name, tp, measured in VLLM:
        p = plan_inference(_model(name), torch.zeros(8, 32, dtype=torch.long), cluster, max_new_tokens=128,
                           constraints={"tp": tp, "dp": 8 // tp, "batch_size": 8})
        pred = (p.predictions["ttft"] + 128 * p.predictions["tpot"]) * 1e3
        print(f"| {name} | {tp} | 8 x 32 / 128 | {measured:.0f} ms | {pred:.0f} ms | {pred / measured - 1:+.0%} |")
    print(f"\nFirst-token latency, batch 1, one DGX-A100, fp16, against TensorRT-LLM v0.5 ({TRTLLM_SOURCE})")
    print("| model | tp | prompt | TensorRT-LLM measured | autopar predicted TTFT | error |")
    print("|---|---|---|---|---|---|")
    a100 = autopar.Cluster.preset("dgx-a100")
    for name, tp, prompt, measured in TRTLLM_TTFT:
        p = plan_inference(_model(name), torch.zeros(1, prompt, dtype=torch.long), a100, max_new_tokens=1,
                           constraints={"tp": tp, "dp": 8 // tp, "batch_size": 1}, dtype="fp16")
        pred = p.predictions["ttft"] * 1e3
        print(f"| {name} | {tp} | {prompt} | {measured} ms | {pred:.1f} ms | {pred / measured - 1:+.0%} |")


SERVE_MODEL = ["hf_llama", "--arg", "n_layer=4", "--arg", "d_model=256", "--arg", "n_head=8", "--arg", "n_kv_heads=4",
               "--arg", "ffn_hidden=704", "--arg", "vocab=2048", "--arg", "seq=128"]


def _uncalibrated(concurrency: int) -> dict:
    """The same plan's predictions on the plain cpu preset (no calibration profile)."""
    from autopar.models.hf import hf_llama
    model = hf_llama(n_layer=4, d_model=256, n_head=8, n_kv_heads=4, ffn_hidden=704, vocab=2048, seq=128)[0]
    return plan_inference(model, torch.zeros(concurrency, 64, dtype=torch.long),
                          autopar.Cluster.preset("cpu", devices=2), max_new_tokens=32,
                          constraints={"tp": 2}, dtype="fp32").predictions


def part_serve(tmp: Path, requests: int = 24, concurrency: int = 4):
    """Calibrates the machine first (``autopar calibrate``, 2 processes): the served plan is priced
    with the measured profile; the plain cpu preset's predictions are shown beside it."""
    import httpx
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "autopar.cli", "calibrate", "-n", "2", "--sweep", "tiny", "--repeats", "3",
                    "-o", str(tmp / "cal.yaml")], env=env, cwd=ROOT, check=True, capture_output=True)
    (tmp / "cpu.yaml").write_text(f"preset: cpu\ndevices: 2\ncalibration: {tmp / 'cal.yaml'}\n")
    args = [*SERVE_MODEL, "--cluster", str(tmp / "cpu.yaml"), "--constraint", "tp=2", "--prompt-len", "64",
            "--batch", str(concurrency), "--max-new-tokens", "32"]
    with serve_process(args) as url:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 2048, (int(n),), generator=gen).tolist()
                   for n in torch.randint(16, 65, (requests,), generator=gen)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 32},
                                                         timeout=300).json(), prompts))
        wall = time.perf_counter() - t0
        m = httpx.get(f"{url}/metrics", timeout=10).json()
    tokens = sum(len(a["choices"][0]["token_ids"]) for a in answers)
    pred = m["predicted"]
    print(f"{requests} requests, concurrency {concurrency}, {m['batches']} batches, {tokens} tokens in "
          f"{wall:.1f} s = {tokens / wall:.0f} tokens/s (plan: {pred['tokens_per_s']:.0f} at full batches)")
    plain = _uncalibrated(concurrency)
    print("| quantity | measured | predicted, calibrated | measured / predicted | predicted, plain cpu preset "
          "| measured / predicted |")
    print("|---|---|---|---|---|---|")
    for k, label, p in (("prefill", "first token of a batch (engine)", "ttft"),
                        ("ttft", "TTFT (queue + first token)", "ttft"), ("tpot", "time per output token", "tpot")):
        print(f"| {label} | {m['measured'][k] * 1e3:.2f} ms | {pred[p] * 1e3:.2f} ms | "
              f"{m['measured'][k] / pred[p]:.2f}x | {plain[p] * 1e3:.2f} ms | {m['measured'][k] / plain[p]:.1f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("plans", "published", "serve", "all"), default="all")
    ap.add_argument("--tmp", default="/tmp/autopar_bench_inference")
    args = ap.parse_args()
    if args.part in ("plans", "all"):
        part_plans()
    if args.part in ("published", "all"):
        part_published(Path(args.tmp))
    if args.part in ("serve", "all"):
        part_serve(Path(args.tmp))


if __name__ == "__main__":
    main()
