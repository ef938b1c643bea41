"""Inference plans and the serving runtime, against published figures and against themselves.

    PYTHONPATH=. python benchmarks/bench_inference.py [--part plans|published|compare|serve|continuous|all]
        [--conv-trace splitwise_conv.csv] [--batching continuous|chunked|static] [--prefill-chunk N]
        [--rows 0,4] [--requests N --rate R --tps 1,2]

- ``plans``: the configuration ``plan_inference`` chooses for Llama-2-70B and Llama-3-70B shapes on
  one DGX-A100 and one DGX-H100 node (prompt 2048, 256 new tokens, 8 prompts), without targets and
  under TTFT < 2 s with TPOT < 200 ms or < 50 ms.
- ``published``: first-token latency of TensorRT-LLM v0.5's batch-1 table (A100, fp16), and
  predicted end-to-end latency of vLLM's own latency benchmark configurations (batch
  8, input 32, output 128, bf16; https://buildkite.com/vllm/performance-benchmark/builds/9515, an
  H200) with tp pinned as vLLM ran them, against vLLM's measured mean. autopar has no H200 preset:
  the rows use dgx-h100 with the H200's memory (141 GB) and HBM bandwidth (4.8 TB/s), on the
  roofline path (no calibration profile for that device).
- ``compare``: the configurations Vidur-Search and DistServe report for 70B-class models (``PUBLISHED``,
  with their sources) against the one ``plan_inference`` chooses for the same setting: Llama-2-70B
  and Llama-3-70B shapes on one dgx-a100 / dgx-h100 node, a Poisson trace whose prompt and output
  lengths are resampled from the Splitwise conversation trace shipped in Vidur's repository
  (``--conv-trace``: data/processed_traces/splitwise_conv.csv; the papers' own traces are not
  bundled), under each paper's SLO. The published configuration is priced too (tp and pp pinned),
  at the published operating rate and over a grid of rates (the highest rate each meets the SLO).
  ``--batching``: how every configuration serves the trace in simulation (``plan_inference(batching=)``);
  continuous by default, as Vidur's and DistServe's servers batch (a pp-stage replica then keeps pp
  micro-batches in flight); chunked is continuous with chunked prefill (Sarathi-Serve, as Vidur-Search's
  published configuration runs; ``--prefill-chunk`` tokens an iteration, default 512); static is
  autopar's own server. ``--rows``: the rows of ``COMPARE`` to run (0: Vidur-Search's Llama-2-70B on
  H100s), default all.
- ``serve``: a bounded loopback load test of ``autopar serve`` on the ``cpu`` preset (2 gloo
  ranks, tp=2, a 4-layer Llama of hidden 256), calibrated first (``autopar calibrate``): a fixed
  number of requests at a fixed concurrency; measured TTFT and time per output token (the server's
  /metrics) against the plan's predictions, calibrated and on the plain preset.
- ``continuous``: the same model and calibrated preset, served from a request trace
  (``serve_trace``: a few dozen Poisson arrivals, prompt and output lengths drawn at random):
  planned on that trace with ``batching="continuous"`` and ``"static"`` (batch size pinned alike,
  tp=1 on one process and tp=2 on 2 gloo ranks), each plan served by ``autopar serve`` and the
  trace replayed over loopback at its arrival times (``replay``); the measured TTFT and TPOT
  percentiles (each answer's ``timing``) next to the simulation's for the same trace and plan.
  The plans are priced with the host's Python overhead per decoder layer and per forward and the
  rate of skinny GEMMs over uncached weights measured right before each plan (``--host-overhead``,
  autopar/execution/calibrate_forward.py); ``--batchings``: the policies.
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


VIDUR_SOURCE = ("microsoft/vidur@7d47513363ec447a741ac5e47241580b47724fbf, assets/"
                "llama70b_Chat1M_ttft_tbt_90_99_2.0_0.2.jpeg (the README's Vidur-Search figure, whose title "
                "names the best configuration) and vidur/config_optimizer/analyzer/constants.py (H100 at $4.25 "
                "per GPU-hour)")
DISTSERVE_SOURCE = ("LLMServe/DistServe@82831f1604cc6b10bebd360f6c437a07790dde9f, evaluation/2-benchmark-serving/"
                    "2-start-api-server.py (MODEL_TO_PARALLEL_PARAMS) and evaluation/ae-scripts/e2e/_plot.py "
                    "(SLOs, rates)")
# LLaMA2-70B on Chat-1M (LMSys-Chat-1M, Llama-2 tokenizer, max_seq_len 4096), TTFT P90 < 2 s, TBT P99 < 0.2 s
VIDUR_CHAT = dict(
    # longer requests are shortened to 4096 tokens, prompt and output in proportion, as Vidur's
    # TraceRequestLengthGenerator does
    paper="Vidur-Search, Chat-1M", slo={"ttft": "2s", "tpot": "200ms"}, max_tokens=4096, fit="clip", source="vidur",
    # 0.20 QPS per dollar / ($4.25 per H100-hour) = 0.85 requests/s per GPU (stats_extractor.py:
    # capacity_per_dollar = qps / (num_gpus x GPU_COSTS))
    rate=0.20 * 4.25, grid=(1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0, 1.5, 2.0, 3.0, 4.0),
    pin={"tp": 2, "pp": 2})
# OPT-66B on ShareGPT (prompt + output < 2048), 8 x A100-SXM-80GB, TTFT 0.4 s and TPOT 0.1 s for 90% of requests
DISTSERVE_CHAT = dict(
    # longer requests are dropped, as DistServe's 0-prepare-dataset.py prunes them
    paper="DistServe, ShareGPT (OPT-66B)", slo={"ttft_p90": "0.4s", "tpot_p90": "100ms"}, max_tokens=2047, fit="drop",
    # the plots' per-GPU rates are 0.0625-0.75; the grid extends below and above them
    source="distserve", rate=0.25, grid=(1 / 128, 1 / 64, 1 / 32, 0.0625, 0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0),
    pin={"tp": 4, "pp": 1})
COMPARE = [   # (setting, model, preset, published configuration or None)
    (VIDUR_CHAT, "Llama-2-70B", "dgx-h100", "TP2 x PP2 replicas (4 GPUs), Sarathi-Serve chunk 512, batch cap 256; "
                                            "0.20 QPS/$ = 0.85 req/s per GPU"),
    (VIDUR_CHAT, "Llama-3-70B", "dgx-h100", None),
    (VIDUR_CHAT, "Llama-2-70B", "dgx-a100", None),
    (VIDUR_CHAT, "Llama-3-70B", "dgx-a100", None),
    (DISTSERVE_CHAT, "Llama-2-70B", "dgx-a100", "prefill TP4 PP1 + decode TP2 PP2 (disaggregated, 8 GPUs); "
                                                "vLLM baseline TP4"),
    (DISTSERVE_CHAT, "Llama-3-70B", "dgx-a100", None),
]


def _fit(prompts, outputs, max_tokens: int, how: str):
    """Requests over ``max_tokens`` in all dropped (``drop``), or shortened by the excess, prompt and
    output in proportion, each rounded up and kept at least 1 (``clip``)."""
    import numpy as np
    total = prompts + outputs
    if how == "drop":
        return prompts[total <= max_tokens], outputs[total <= max_tokens]
    excess = np.clip(total - max_tokens, 0, None)
    return (np.maximum(prompts - np.ceil(excess * prompts / total).astype(int), 1),
            np.maximum(outputs - np.ceil(excess * outputs / total).astype(int), 1))


def _served(model, cluster, trace, slo, batching, pin=None, chunk=None):
    """The plan for ``trace`` under ``slo`` (``pin``: constraints), and whether it meets the slo; a
    trace nothing serves within the slo gets the least-P90-latency plan instead."""
    from autopar.errors import PlanError
    how = {"batching": batching, **({"prefill_chunk": chunk} if chunk is not None else {})}
    try:
        return plan_inference(model, None, cluster, trace=trace, slo=slo, constraints=pin, **how), True
    except PlanError:
        return plan_inference(model, None, cluster, trace=trace, constraints=pin, **how), False


def _cfg(p) -> str:
    return f"tp={p.tp} pp={p.pp} dp={p.dp} batch {p.batch_size}"


def _pred(p, meets: bool) -> str:
    pr, pct = p.predictions, p.predictions["percentiles"]
    return (f"{pr['ttft'] * 1e3:,.0f} ms / {pr['tpot'] * 1e3:.1f} ms / {pr['tokens_per_s_per_device']:.0f} "
            f"({'meets' if meets else 'misses'}; TTFT {pct['ttft'].upper()}, TPOT {pct['tpot'].upper()})")


def part_compare(conv_trace: str | None, batching: str = "continuous", requests: int = 1000, chunk=None,
                 rows=None):
    """``compare`` (module doc): per setting, autopar's choice and the published configuration
    pinned, at the published rate, then the highest rate of the grid each meets the SLO."""
    from autopar.inference.trace import load_trace, synthetic_trace
    if not conv_trace or not Path(conv_trace).exists():
        print(f"--part compare needs --conv-trace: the Splitwise conversation trace of Vidur's repository "
              f"(git show 7d47513:data/processed_traces/splitwise_conv.csv), got {conv_trace!r}")
        return
    conv = load_trace(conv_trace)
    print(f"Sources: Vidur-Search {VIDUR_SOURCE}; DistServe {DISTSERVE_SOURCE}. Lengths resampled from "
          f"{Path(conv_trace).name} ({len(conv)} requests), {requests} Poisson requests a trace; "
          f"{batching} batching simulated" + (f", prefill chunk {chunk or 512} tokens" if batching == "chunked" else "")
          + ".\n")
    print("| setting | model | cluster | rate /s per GPU | published configuration | autopar's choice | predicted "
          "TTFT / TPOT / tokens/s per GPU | published configuration priced by autopar | predicted TTFT / TPOT / "
          "tokens/s per GPU |\n|---|---|---|---|---|---|---|---|---|")
    reach = []
    for setting, name, preset, published in (COMPARE if rows is None else [COMPARE[k] for k in rows]):
        t0 = time.perf_counter()
        model, cluster = _model(name), autopar.Cluster.preset(preset)
        n = cluster.num_devices
        prompts, outputs = _fit(conv.prompt_lens, conv.output_lens, setting["max_tokens"], setting["fit"])
        pin = setting["pin"]
        pinned = "tp=" + str(pin["tp"]) + (f" pp={pin['pp']}" if "pp" in pin else "")
        if setting["source"] == "distserve":
            pinned += " (the vLLM baseline's)"

        def trace(per_gpu):
            return synthetic_trace(requests, per_gpu * n, prompts, outputs, seed=0)
        t = trace(setting["rate"])
        free, free_ok = _served(model, cluster, t, setting["slo"], batching, chunk=chunk)
        fixed, fixed_ok = _served(model, cluster, t, setting["slo"], batching, pin, chunk)
        print(f"| {setting['paper']} | {name} | {preset} | {setting['rate']:.3g} | "
              f"{published or 'none published (' + pinned + ' priced for reference)'} | {_cfg(free)} | "
              f"{_pred(free, free_ok)} | {pinned}: {_cfg(fixed)} | {_pred(fixed, fixed_ok)} |", flush=True)
        best = {"free": None, "pinned": None}
        missed = set()   # up the grid, each configuration until the first rate it misses
        for f in setting["grid"]:
            per_gpu = setting["rate"] * f if setting["source"] == "vidur" else f
            t = trace(per_gpu)
            for which, constraints in (("free", None), ("pinned", pin)):
                if which in missed:
                    continue
                p, ok = _served(model, cluster, t, setting["slo"], batching, constraints, chunk)
                if ok:
                    best[which] = (per_gpu, p)
                else:
                    missed.add(which)
        reach.append((setting, name, preset, published, pinned, best, time.perf_counter() - t0))
    print("\nHighest rate of the grid (requests/s per GPU), going up it until the first miss, at which each "
          f"configuration meets the SLO in autopar's simulation ({batching} batching)")
    print("| setting | model | cluster | published | grid | autopar's choice | published configuration pinned "
          "| seconds |\n|---|---|---|---|---|---|---|---|")
    for setting, name, preset, published, pinned, best, secs in reach:
        grid = [setting["rate"] * f if setting["source"] == "vidur" else f for f in setting["grid"]]
        claim = (f"{setting['rate']:.3g} req/s per GPU (Vidur-Search capacity)" if setting["source"] == "vidur"
                 else "rates 0.0625-0.75 per GPU plotted; capacity read from plots only")
        cells = [f"{b[0]:.3g}: {_cfg(b[1])}, {_pred(b[1], True).split(' (')[0]}" if b else "none of the grid"
                 for b in (best["free"], best["pinned"])]
        print(f"| {setting['paper']} | {name} | {preset} | {claim if published else 'none'} | "
              f"{', '.join(f'{g:.3g}' for g in grid)} | {cells[0]} | {pinned}: {cells[1]} | {secs:.0f} |")


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


SERVE_FACTORY = dict(n_layer=4, d_model=256, n_head=8, n_kv_heads=4, ffn_hidden=704, vocab=2048, seq=128)


def serve_trace(requests: int = 32, rate: float = 6.0, seed: int = 0, prompts=(16, 64), outputs=(8, 32)):
    """``requests`` Poisson arrivals at ``rate`` per second, prompt and output lengths uniform in the
    given (inclusive) ranges: a trace where requests arrive while others decode."""
    import numpy as np

    from autopar.inference.trace import RequestTrace
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests))
    return RequestTrace(arrivals - arrivals[0], rng.integers(prompts[0], prompts[1] + 1, requests),
                        rng.integers(outputs[0], outputs[1] + 1, requests))


def plan_for_trace(trace, tp: int, batching: str, batch_size: int, cluster, model=None):
    """The plan of the load-test model (``SERVE_FACTORY``) on ``trace``, tp pinned, dp=1, fp32."""
    from autopar.models.hf import hf_llama
    model = model if model is not None else hf_llama(**SERVE_FACTORY)[0]
    return plan_inference(model, None, cluster, trace=trace, batching=batching, dtype="fp32",
                          constraints={"tp": tp, "pp": 1, "dp": 1, "batch_size": batch_size})


def replay(url: str, trace, seed: int = 0, vocab: int = 2048, timeout: float = 120.0) -> list[dict]:
    """Each request of ``trace`` posted at its arrival time (from now), concurrently; per request its
    answer's token count and ``timing`` (the server's clock) and the client's end-to-end seconds."""
    import httpx
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(n),), generator=gen).tolist() for n in trace.prompt_lens]
    t0 = time.perf_counter() + 0.2

    def one(k):
        time.sleep(max(0.0, t0 + float(trace.arrivals[k]) - time.perf_counter()))
        sent = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[k], "max_tokens": int(trace.output_lens[k])},
                       timeout=timeout)
        took = time.perf_counter() - sent
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return {"tokens": len(choice["token_ids"]), "finish": choice["finish_reason"], **choice["timing"],
                "client_s": took, "late_s": sent - t0 - float(trace.arrivals[k])}
    with ThreadPoolExecutor(len(trace)) as pool:
        return list(pool.map(one, range(len(trace))))


def measured_percentiles(answers: list[dict]) -> dict:
    """TTFT and TPOT (requests with more than one token) percentiles of ``replay``'s answers, s."""
    import numpy as np

    def pct(x):
        return {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)}
    return {"ttft": pct([a["ttft_s"] for a in answers]),
            "tpot": pct([a["tpot_s"] for a in answers if a["tpot_s"] is not None])}


def host_overhead(tmp: Path, how: str = "measure", tag: str = "") -> tuple[float, float, float, float]:
    """(seconds per layer, per forward, skinny-GEMM bytes/s, FLOP/s) the served plans are priced
    with: measured here (autopar/execution/calibrate_forward.py), once per ``tag`` (kept in
    ``tmp``/host{tag}.json), the cpu preset's figures, or none (``off``: the prices before these
    terms). These figures move with the machine's load (2-4x between load 1 and 5 here), so
    ``part_continuous`` measures them right before it plans each served configuration."""
    import json

    from autopar.cluster_presets import CPU_HOST_OVERHEAD, CPU_SKINNY_GEMM
    from autopar.execution.calibrate_forward import measure_forward_overhead, measure_skinny_gemm
    if how == "off":
        return 0.0, 0.0, 0.0, 0.0
    if how == "preset":
        return (*CPU_HOST_OVERHEAD, *CPU_SKINNY_GEMM)
    path = tmp / f"host{tag}.json"
    if not path.exists():
        path.write_text(json.dumps([*measure_forward_overhead(), *measure_skinny_gemm()]))
    return tuple(json.loads(path.read_text()))


def _calibrated_cluster(tmp: Path, devices: int, host: str = "measure", tag: str = ""):
    import dataclasses
    cal = tmp / "cal.yaml"
    if not cal.exists():
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "autopar.cli", "calibrate", "-n", "2", "--sweep", "tiny", "--repeats",
                        "3", "-o", str(cal)], env=env, cwd=ROOT, check=True, capture_output=True)
    (tmp / f"cpu{devices}.yaml").write_text(f"preset: cpu\ndevices: {devices}\ncalibration: {cal}\n")
    cluster = autopar.Cluster.from_yaml(tmp / f"cpu{devices}.yaml")
    from autopar.cluster_presets import cpu_host_device
    layer, forward, bw, rate = host_overhead(tmp, host, tag)   # measured now: they move with load
    return dataclasses.replace(cluster, device=cpu_host_device(cluster.device, (layer, forward), (bw, rate)))


def serve_and_replay(plan, path: Path, trace, devices: int) -> list[dict]:
    """``autopar serve`` of the saved ``plan`` (the load-test model), warmed by two requests, then
    ``replay`` of ``trace``."""
    import httpx
    plan.save(path)
    args = [*SERVE_MODEL, "--devices", str(devices), "--plan", str(path)]
    with serve_process(args) as url:
        for _ in range(2):   # the first forwards pay one-time costs
            httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 4}, timeout=60)
        return replay(url, trace)


def part_continuous(tmp: Path, requests: int = 32, rate: float = 6.0, tps: str = "1,2", batch_size: int = 4,
                    host: str = "measure", batchings: str = "continuous,static"):
    """``continuous`` (module doc): per tp, the continuous and the static plan of one trace served and
    replayed; measured percentiles against the plan's simulation of the same trace."""
    tmp.mkdir(parents=True, exist_ok=True)
    trace = serve_trace(requests, rate)
    st = trace.stats()
    print(f"trace: {requests} Poisson requests at {rate:g}/s over {st['seconds']:.1f} s, prompts 16-64 (p50 "
          f"{st['prompt']['p50']:.0f}), outputs 8-32 (p50 {st['output']['p50']:.0f}); batch_size {batch_size} "
          f"pinned, fp32, calibrated cpu preset (autopar calibrate -n 2 --sweep tiny); host figures: {host}")
    rows = []
    for tp in (int(t) for t in tps.split(",")):
        for batching in batchings.split(","):
            cluster = _calibrated_cluster(tmp, tp, host, f"_{batching}_tp{tp}")
            d = cluster.device
            print(f"tp={tp} {batching}: host {d.host_layer_overhead * 1e3:.2f} ms per layer + "
                  f"{d.host_forward_overhead * 1e3:.2f} ms per forward, skinny GEMMs "
                  f"{d.skinny_gemm_bandwidth / 1e9:.2f} GB/s + {d.skinny_gemm_flops / 1e9:.1f} GFLOP/s", flush=True)
            plan = plan_for_trace(trace, tp, batching, batch_size, cluster)
            t0 = time.perf_counter()
            answers = serve_and_replay(plan, tmp / f"plan_{batching}_tp{tp}.json", trace, tp)
            wall = time.perf_counter() - t0
            short = sum(a["tokens"] != int(o) for a, o in zip(answers, trace.output_lens))
            rows.append((tp, batching, measured_percentiles(answers), plan.predictions["served"], short, wall,
                         max(a["late_s"] for a in answers)))
    print("\n| tp | batching | quantity | measured p50 / p90 / p99 | simulated p50 / p90 / p99 | "
          "measured / simulated (p50, p90, p99) |\n|---|---|---|---|---|---|")
    for tp, batching, meas, pred, short, wall, late in rows:
        for q in ("ttft", "tpot"):
            m, p = meas[q], pred[q]
            cells = [" / ".join(f"{d[k] * 1e3:.1f}" for k in ("p50", "p90", "p99")) + " ms" for d in (m, p)]
            ratio = ", ".join(f"{m[k] / p[k]:.2f}x" for k in ("p50", "p90", "p99"))
            print(f"| {tp} | {batching} | {q.upper()} | {cells[0]} | {cells[1]} | {ratio} |")
    for tp, batching, meas, pred, short, wall, late in rows:
        print(f"tp={tp} {batching}: {requests - short}/{requests} answered with their output length (the rest "
              f"stopped at an end-of-sequence token), server up and replay {wall:.0f} s, latest send "
              f"{late * 1e3:.0f} ms after its arrival time")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("plans", "published", "compare", "serve", "continuous", "all"), default="all")
    ap.add_argument("--conv-trace", help="Vidur's data/processed_traces/splitwise_conv.csv, for --part compare")
    ap.add_argument("--batching", choices=("continuous", "chunked", "static"), default="continuous",
                    help="--part compare: how the trace is served in simulation (plan_inference(batching=))")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="--part compare with --batching chunked: tokens an iteration runs (default 512)")
    ap.add_argument("--rows", default=None, help="--part compare: the rows of COMPARE to run, e.g. 0,4 (default all)")
    ap.add_argument("--tmp", default="/tmp/autopar_bench_inference")
    ap.add_argument("--requests", type=int, default=32, help="--part continuous: requests in the trace")
    ap.add_argument("--rate", type=float, default=6.0, help="--part continuous: Poisson arrivals per second")
    ap.add_argument("--tps", default="1,2", help="--part continuous: the tp degrees served (1: one process)")
    ap.add_argument("--batchings", default="continuous,static", help="--part continuous: the policies served")
    ap.add_argument("--host-overhead", choices=("measure", "preset", "off"), default="measure",
                    help="--part continuous: the host figures the plans are priced with (measure: "
                         "calibrate_forward.py here, once per --tmp; preset: the cpu preset's; off: none)")
    args = ap.parse_args()
    if args.part in ("plans", "all"):
        part_plans()
    if args.part in ("published", "all"):
        part_published(Path(args.tmp))
    if args.part in ("compare", "all"):
        part_compare(args.conv_trace, args.batching, chunk=args.prefill_chunk,
                     rows=[int(k) for k in args.rows.split(",")] if args.rows else None)
    if args.part in ("serve", "all"):
        part_serve(Path(args.tmp))
    if args.part in ("continuous", "all"):
        part_continuous(Path(args.tmp), args.requests, args.rate, args.tps, host=args.host_overhead,
                        batchings=args.batchings)


if __name__ == "__main__":
    main()
