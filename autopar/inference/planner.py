"""``plan_inference``: how to split a model for generation on a cluster, under latency targets.

The search (every configuration priced by autopar/inference/inference_cost.py):

- ``tp``: divisors of the node's devices that divide the attention heads and the key/value
  heads (tensor parallelism stays inside a node);
- ``pp``: under continuous batching (chunked or not) every divisor of the devices a tp group
  leaves (a replica keeps pp micro-batches in flight, below); else 1 unless pinned (the engine runs
  one batch across the stages per step: the stages split the weights and the KV cache but gain no
  latency);
- ``dp``: the devices left, each replica an independent copy decoding its own sequences;
- ``batch_size`` (sequences a replica decodes together): without ``slo``, the example's rows
  shared over the replicas; with ``slo``, every power of two up to what memory holds, and the
  example's share.

With ``trace`` (a RequestTrace or a CSV file of requests: autopar/inference/trace.py) the prompt
length and new tokens are the trace's longest, batch sizes are searched, and each configuration
serves the whole trace in simulation, ``batching="static"`` (batches padded to their longest
prompt and output, as autopar's server runs them) or ``"continuous"`` (requests join and leave the
running batch at each step, as vLLM does: autopar/inference/continuous.py; a replica holds up to
batch_size requests and as many KV-cache tokens as its memory holds, ``_kv_pool``; with pp > 1
it keeps pp micro-batches in flight, one per stage, each of up to batch_size requests and 1/pp of
the KV tokens, each iteration priced with the others in flight: ``Pricer.decode_in_flight``): its TTFT
is the trace's P90 (queueing included), its TPOT the P99, its throughput the output tokens per
second over the trace, its latency the P90 end to end; the plan records the trace's statistics,
these percentiles and the batching simulated. ``batching="chunked"`` is continuous batching with
chunked prefill (Sarathi-Serve, vLLM's ``enable_chunked_prefill``; ``simulate_chunked``): each
iteration runs at most ``prefill_chunk`` tokens (default ``PREFILL_CHUNK``, 512), the running
requests' decodes first and prompt chunks in the rest, priced as one mixed batch
(``Pricer.mixed_in_flight``); batch sizes above the chunk are not searched (each decode takes a
token of the budget), and the plan records the chunk (``predictions["prefill_chunk"]``).

Each configuration must fit: weights + KV cache + prefill working set per rank under the budget
(the device's memory unless ``memory_budget``); under continuous batching the KV cache is a pool of
tokens (what the memory left holds, at most pp x batch_size longest contexts, at least pp times the
trace's longest request) and the prefill's working set is one prompt's (admitted prompts prefill
one by one), under chunked prefill one chunk's. Static batching prices one batch crossing the
stages at a time, as autopar's engine and server run it.

Objective: with ``slo`` (``{"ttft": "2s", "tpot": "50ms"}``), the most tokens/s per device among
the configurations meeting both targets (none: a PlanError naming the best TTFT and TPOT reached);
without, the least time to generate the example batch (TTFT + max_new_tokens x TPOT). Ties go to
the smaller tp, then the fewer stages, then the smaller batch.
"""
from __future__ import annotations

import re
import time

import numpy as np
import torch

from autopar.cluster import Cluster
from autopar.errors import ConstraintError, MemoryBudgetError, PlanError
from autopar.inference.continuous import simulate_chunked, simulate_continuous
from autopar.inference.inference_cost import ITEMSIZE, Pricer, kv_bytes, stage_layers, weight_bytes
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.model_shape import ModelShape
from autopar.inference.trace import RequestTrace, load_trace, simulate
from autopar.units import parse_bytes, parse_seconds

PINS = ("tp", "pp", "dp", "batch_size")
SLO_KEYS = ("ttft", "tpot")
# with a trace the targets bind these percentiles (TTFT P90 under 2 s, time between tokens P99 under
# 200 ms are the usual service targets)
TRACE_PERCENTILE = {"ttft": "p90", "tpot": "p99"}
BATCHING = ("static", "continuous", "chunked")   # how a trace is served in simulation (module doc)
PREFILL_CHUNK = 512   # tokens an iteration runs under chunked prefill, unless prefill_chunk= (vLLM's and
# Sarathi-Serve's max_num_batched_tokens; Vidur-Search's best Llama-2-70B configuration uses 512)


def _constraints(constraints) -> dict:
    pins = dict(constraints or {})
    for k, v in pins.items():
        if k not in PINS:
            raise ConstraintError(f"inference constraint {k!r} is not known; use {', '.join(PINS)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConstraintError(f"inference constraint {k}={v!r} must be a positive integer")
    return pins


def _slo(slo, traced: bool = False) -> tuple[dict, dict]:
    """Targets in seconds by ttft/tpot, and (with a trace) the percentile each binds: ``ttft_p50``
    names the P50, plain ``ttft`` the default of TRACE_PERCENTILE."""
    out, pct = {}, dict(TRACE_PERCENTILE)
    for k, v in (slo or {}).items():
        m = re.fullmatch(r"(ttft|tpot)(?:_p(\d{1,2}(?:\.\d+)?))?", str(k))
        if m is None:
            raise PlanError(f"slo key {k!r} is not known; use ttft (time to first token) and/or tpot "
                            f"(time per output token), e.g. {{'ttft': '2s', 'tpot': '50ms'}}, or with a trace "
                            f"a percentile such as ttft_p90, tpot_p99")
        if m.group(2) is not None:
            if not traced:
                raise PlanError(f"slo key {k!r}: a percentile applies to a trace's requests; pass trace= or "
                                f"use {m.group(1)!r}")
            pct[m.group(1)] = f"p{m.group(2)}"
        if m.group(1) in out:
            raise PlanError(f"slo: two targets for {m.group(1)}")
        out[m.group(1)] = parse_seconds(v, f"slo {k}")
    return out, pct


def plan_inference(model, example_prompt, cluster: Cluster, *, max_new_tokens: int | None = None, slo=None,
                   constraints=None, dtype: str = "bf16", memory_budget=None, trace=None,
                   batching: str = "static", prefill_chunk: int | None = None) -> InferencePlan:
    """The fastest way to generate with ``model`` on ``cluster`` (module doc). ``example_prompt``:
    token ids [batch, prompt_len]. ``trace`` (a RequestTrace or a CSV file, autopar/inference/
    trace.py) replaces the example: every configuration serves it in simulation, batching
    ``"static"``, ``"continuous"`` or ``"chunked"`` (continuous with chunked prefill,
    ``prefill_chunk`` tokens an iteration, default ``PREFILL_CHUNK``; module doc)."""
    t0 = time.perf_counter()
    if batching not in BATCHING:
        raise ValueError(f"batching={batching!r} is not known; use one of {', '.join(map(repr, BATCHING))}")
    if prefill_chunk is not None and batching != "chunked":
        raise ValueError(f"prefill_chunk={prefill_chunk!r} applies to batching='chunked' (continuous batching with "
                         f"chunked prefill); got batching={batching!r}")
    if batching == "chunked":
        prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk!r} must be a positive integer (tokens an iteration runs, "
                             f"e.g. {PREFILL_CHUNK})")
    if batching != "static" and trace is None:
        raise PlanError(f"batching={batching!r} applies to serving a trace in simulation; pass trace=")
    if not isinstance(cluster, Cluster):
        raise PlanError(f"cluster must be an autopar.Cluster, got {type(cluster).__name__}")
    if trace is not None:
        trace = trace if isinstance(trace, RequestTrace) else load_trace(trace)
        if max_new_tokens is None:
            max_new_tokens = int(trace.output_lens.max())
        if max_new_tokens < int(trace.output_lens.max()):
            raise PlanError(f"max_new_tokens={max_new_tokens} is less than the trace's longest output "
                            f"({int(trace.output_lens.max())} tokens)")
        example_prompt = torch.zeros(1, int(trace.prompt_lens.max()), dtype=torch.long)
    if not isinstance(example_prompt, torch.Tensor) or example_prompt.dim() != 2 or example_prompt.numel() == 0:
        raise PlanError("example_prompt must be a non-empty [batch, prompt_len] tensor of token ids")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise PlanError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if dtype not in ITEMSIZE:
        raise PlanError(f"dtype {dtype!r}: use one of {', '.join(ITEMSIZE)}")
    pins, (targets, pct) = _constraints(constraints), _slo(slo, trace is not None)
    if batching == "chunked" and pins.get("batch_size", 0) > prefill_chunk:
        raise ConstraintError(f"batch_size={pins['batch_size']} is more than prefill_chunk={prefill_chunk}: each "
                              f"running request's decode takes a token of an iteration's budget; pin a batch of at "
                              f"most {prefill_chunk} or pass a larger prefill_chunk")
    rows, prompt = int(example_prompt.shape[0]), int(example_prompt.shape[1])
    m = ModelShape.of(model)
    budget = float(parse_bytes(memory_budget, "memory_budget") if memory_budget is not None
                   else cluster.device.memory_bytes)
    n = cluster.num_devices
    price = Pricer(cluster, m, dtype)
    context = prompt + max_new_tokens
    best, tried, smallest, closest = None, 0, None, None
    for tp in _tp_choices(m, cluster, pins):
        for pp in _pp_choices(m.layers, n // tp, pins, batching):
            if n % (tp * pp) or m.layers < pp:
                continue
            dp = n // (tp * pp)
            if "dp" in pins and pins["dp"] != dp:
                continue
            for batch in _batches(rows, dp, pins, bool(targets) or trace is not None):
                if batching == "chunked" and batch > prefill_chunk:
                    continue   # an iteration's budget holds every running request's decode
                tried += 1
                kv_tokens = None
                if batching != "static":   # a pool of KV tokens; one prompt (or chunk) prefills at a time
                    ahead = prompt if batching == "continuous" else min(prompt, prefill_chunk)
                    fixed = weight_bytes(m, tp, pp, dtype) + price.workspace(tp, 1, ahead)
                    kv, kv_tokens, per_token = _kv_pool(m, tp, pp, batch, context, dtype, budget - fixed)
                    longest = int((trace.prompt_lens + trace.output_lens).max())
                    # over the budget when a micro-batch's share of the pool does not hold the longest
                    mem = fixed + max(kv, pp * longest * per_token)
                else:
                    kv = max(kv_bytes(m, tp, range(a, b), batch, context, dtype) for a, b in stage_layers(m.layers, pp))
                    mem = weight_bytes(m, tp, pp, dtype) + kv + price.workspace(tp, batch, prompt)
                if mem > budget:
                    smallest = mem if smallest is None else min(smallest, mem)
                    continue
                ttft = price.prefill(tp, pp, batch, prompt)
                tpot = price.decode(tp, pp, batch, prompt + max_new_tokens / 2)
                tokens_s = dp * batch / tpot
                cand = dict(tp=tp, pp=pp, dp=dp, batch=batch, kv=kv, kv_tokens=kv_tokens, mem=mem, ttft=ttft,
                            tpot=tpot, tokens_s=tokens_s, latency=ttft + max_new_tokens * tpot)
                if trace is not None:   # served in simulation: percentiles replace the batch's figures
                    if batching == "continuous":   # pp micro-batches in flight in each replica
                        served = simulate_continuous(
                            trace, lambda b, s, tp=tp, pp=pp: price.prefill_in_flight(tp, pp, b, s),
                            lambda b, c, tp=tp, pp=pp: price.decode_in_flight(tp, pp, b, c), dp, batch,
                            kv_tokens=kv_tokens, stages=pp)
                    elif batching == "chunked":   # mixed iterations of prompt chunks and decodes
                        served = simulate_chunked(
                            trace, lambda ch, d, c, tp=tp, pp=pp: price.mixed_in_flight(tp, pp, ch, d, c), dp,
                            batch, prefill_chunk, kv_tokens=kv_tokens, stages=pp)
                    else:   # static batches, one crossing the stages at a time
                        served = simulate(trace, lambda b, s, tp=tp, pp=pp: price.prefill(tp, pp, b, s),
                                          lambda b, c, tp=tp, pp=pp: price.decode(tp, pp, b, c), dp, batch)
                    cand.update(ttft=_percentile(served, "ttft", pct["ttft"]),
                                tpot=_percentile(served, "tpot", pct["tpot"]), tokens_s=served["tokens_per_s"],
                                latency=served["latency"]["p90"], served=served)
                if trace is not None and (closest is None or cand["ttft"] < closest["ttft"]):
                    closest = cand
                if any(cand[k] > v for k, v in targets.items()):
                    continue
                tie = (cand["latency"],) if trace is not None else ()   # a served trace: tokens/s tie often
                key = ((-cand["tokens_s"] / n, *tie, tp, pp, batch) if targets else (cand["latency"], tp, pp, batch))
                if best is None or key < best[0]:
                    best = (key, cand)
    if best is None and closest is not None:   # a trace no configuration serves within the targets
        c = closest
        wanted = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in targets.items())
        raise PlanError(f"no configuration serves the trace within the slo ({wanted}; TTFT at "
                        f"{pct['ttft'].upper()}, TPOT at {pct['tpot'].upper()}): the closest, "
                        f"tp={c['tp']} pp={c['pp']} dp={c['dp']} batch {c['batch']}, reaches "
                        f"TTFT {c['ttft'] * 1e3:.1f} ms and TPOT {c['tpot'] * 1e3:.2f} ms; relax the targets or "
                        f"use more devices")
    if best is None:
        _no_plan(m, cluster, pins, targets, smallest, budget, price, rows, prompt, max_new_tokens)
    c = best[1]
    return InferencePlan(
        tp=c["tp"], pp=c["pp"], dp=c["dp"], batch_size=c["batch"], prompt_len=prompt, max_new_tokens=max_new_tokens,
        stages=stage_layers(m.layers, c["pp"]), kv_cache_bytes_per_rank=int(c["kv"]),
        cluster={"name": cluster.name, "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
                 "device": cluster.device.name},
        model=m.to_json(), dtype=dtype, slo={k: v for k, v in targets.items()},
        predictions={"ttft": c["ttft"], "tpot": c["tpot"], "tokens_per_s": c["tokens_s"],
                     "tokens_per_s_per_device": c["tokens_s"] / n, "latency": c["latency"],
                     "memory_per_rank": c["mem"], "memory_budget": budget,
                     "weights_per_rank": weight_bytes(m, c["tp"], c["pp"], dtype),
                     "configurations": tried, "seconds": time.perf_counter() - t0,
                     **({"kv_cache_tokens_per_replica": c["kv_tokens"]} if c["kv_tokens"] is not None else {}),
                     **({"prefill_chunk": prefill_chunk} if batching == "chunked" else {}),
                     **({"trace": trace.stats(), "percentiles": pct, "batching": batching,
                         "served": {k: c["served"][k] for k in ("ttft", "tpot", "latency")}}
                        if trace is not None else {})})


def _kv_pool(m: ModelShape, tp: int, pp: int, batch: int, context: int, dtype: str,
             room: float) -> tuple[float, int, float]:
    """Continuous batching's KV cache per rank: the tokens ``room`` bytes hold on the stage holding
    the most layers, priced at every layer's full rate per token (a sliding window's saving is not
    counted), at most ``batch`` contexts of ``context`` for each of the ``pp`` micro-batches in flight.
    Returns (bytes, tokens, bytes per token)."""
    per_token = max(kv_bytes(m, tp, range(a, b), 1, 1, dtype) for a, b in stage_layers(m.layers, pp))
    tokens = max(0, min(int(room // per_token), pp * batch * context))
    return tokens * per_token, tokens, per_token


def _percentile(served: dict, what: str, p: str) -> float:
    if p in served[what]:
        return served[what][p]
    x = served["arrays"][what]
    if what == "tpot" and (x > 0).any():
        x = x[x > 0]   # one-token outputs have no time between tokens
    return float(np.percentile(x, float(p[1:])))


def _pp_choices(layers: int, per_tp: int, pins: dict, batching: str) -> list[int]:
    """Pipeline stages to try: the pin; under continuous batching, chunked or not (stages in
    flight), every divisor of the ``per_tp`` devices a tp group leaves, up to the layers; else 1
    (the engine runs one batch across the stages: pp only splits the memory)."""
    if "pp" in pins:
        return [pins["pp"]]
    if batching == "static":
        return [1]
    return [d for d in range(1, min(per_tp, layers) + 1) if per_tp % d == 0]


def _tp_choices(m: ModelShape, cluster: Cluster, pins: dict) -> list[int]:
    if "tp" in pins:
        tp = pins["tp"]
        if m.heads % tp or m.kv_heads % tp:
            both = [d for d in range(1, m.kv_heads + 1) if m.kv_heads % d == 0 and m.heads % d == 0]
            raise ConstraintError(f"tp={tp} must divide the attention heads ({m.heads}) and the key/value heads "
                                  f"({m.kv_heads}); divisors of both: {both}")
        if cluster.num_devices % tp:
            raise ConstraintError(f"tp={tp} does not divide the cluster's {cluster.num_devices} devices")
        return [tp]
    return [t for t in range(1, cluster.devices_per_node + 1)
            if cluster.devices_per_node % t == 0 and m.heads % t == 0 and m.kv_heads % t == 0]


def _batches(rows: int, dp: int, pins: dict, free: bool) -> list[int]:
    if "batch_size" in pins:
        return [pins["batch_size"]]
    share = max(1, -(-rows // dp))
    if not free:
        return [share]
    return sorted({share} | {2 ** k for k in range(0, 13)})


def _no_plan(m, cluster, pins, targets, smallest, budget, price, rows, prompt, new) -> None:
    if targets:
        # what the fastest fitting configuration reaches, to say how far the targets are
        reach = []
        for tp in _tp_choices(m, cluster, {k: v for k, v in pins.items() if k == "tp"}):
            pp = pins.get("pp", 1)
            if cluster.num_devices % (tp * pp):
                continue
            reach.append((price.prefill(tp, pp, 1, prompt), price.decode(tp, pp, 1, prompt + new / 2), tp))
        if reach:
            ttft, tpot, tp = min(reach)
            wanted = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in targets.items())
            raise PlanError(f"no configuration meets the slo ({wanted}): "
                            f"the fastest reaches ttft {ttft * 1e3:.1f} ms and tpot {tpot * 1e3:.1f} ms (tp={tp}, "
                            f"batch 1); relax the targets or use more or faster devices")
    need = f"; the smallest configuration needs {smallest / 2**30:.2f} GiB" if smallest else ""
    raise MemoryBudgetError(f"no inference configuration of {m.params / 1e9:.2f} B parameters fits "
                            f"{budget / 2**30:.2f} GiB per device on {cluster.num_devices} devices{need}: use more "
                            f"devices, a shorter prompt or fewer new tokens, or a smaller batch",
                            min_peak_bytes=int(smallest) if smallest else None, budget_bytes=int(budget))
