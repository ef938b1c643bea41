"""The inference plan: how a model is split for generation, and what the planner predicts for it.

An ``InferencePlan`` is what ``autopar.plan_inference`` returns and what ``autopar.compile_inference``
runs: degrees (``tp`` heads and linears split Megatron-style, ``pp`` stages of consecutive layers,
``dp`` independent replicas), the batch and lengths it was planned for, the layers of each stage, the
KV cache bytes per rank, and the predictions (TTFT, time per output token, throughput, memory per
rank). It is deterministic JSON, like a training plan (``to_json`` / ``from_json`` / ``save`` /
``load``); ``kind`` is ``"inference"`` so readers tell the two apart.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field

from autopar.errors import PlanError

INFERENCE_PLAN_VERSION = 1


@dataclass
class InferencePlan:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    batch_size: int = 1                   # sequences decoded together per replica
    prompt_len: int = 1                   # the longest prompt planned for
    max_new_tokens: int = 1
    stages: list = field(default_factory=lambda: [])   # per pp stage: [first_layer, end_layer)
    kv_cache_bytes_per_rank: int = 0      # the preallocated cache of the largest stage's ranks: 2 (k, v) x
    # batch_size x kv_heads / tp x head_dim x dtype bytes x the positions each layer keeps (prompt_len +
    # max_new_tokens, or its sliding window), summed over the stage's layers
    cluster: dict = field(default_factory=dict)        # name, nodes, devices_per_node, device
    model: dict = field(default_factory=dict)          # layers, heads, kv heads, head dim, hidden, vocab, params
    dtype: str = "bf16"
    predictions: dict = field(default_factory=dict)    # ttft, tpot, tokens_per_s, memory_per_rank, ...; on a
    # trace batching ("static", "continuous", "chunked") and, chunked, prefill_chunk (tokens an iteration)
    slo: dict = field(default_factory=dict)
    version: int = INFERENCE_PLAN_VERSION
    kind: str = "inference"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> InferencePlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{source}: not JSON ({e})") from None
        if not isinstance(data, dict) or data.get("kind") != "inference":
            raise PlanError(f"{source}: not an inference plan (its 'kind' is not \"inference\")")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path) -> None:
        pathlib.Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> InferencePlan:
        p = pathlib.Path(path)
        if not p.exists():
            raise PlanError(f"{p}: no such inference plan file")
        return cls.from_json(p.read_text(), str(p))


def summary(plan: InferencePlan) -> str:
    """The plan as a short text table (``autopar show`` of an inference plan)."""
    pr = plan.predictions
    gib = 2 ** 30
    in_flight = plan.pp > 1 and pr.get("batching") in ("continuous", "chunked")   # pipeline stages in flight
    rows = [
        ("cluster", f"{plan.cluster.get('name', '?')}: {plan.cluster.get('nodes', '?')} node(s) x "
                    f"{plan.cluster.get('devices_per_node', '?')} {plan.cluster.get('device', '')}"),
        ("model", f"{plan.model.get('params', 0) / 1e9:.2f} B parameters, {plan.model.get('layers', '?')} layers, "
                  f"{plan.dtype}"),
        ("degrees", f"tp={plan.tp} pp={plan.pp} dp={plan.dp} ({plan.world_size} ranks)"),
        ("batch", f"{plan.batch_size} sequences per "
                  + (f"micro-batch, {plan.pp} in flight per replica" if in_flight else "replica")
                  + f", prompt {plan.prompt_len}, "
                  f"{plan.max_new_tokens} new tokens"),
        ("stages", ", ".join(f"[{a}, {b})" for a, b in plan.stages)),
        ("KV cache", f"{plan.kv_cache_bytes_per_rank / gib:.3f} GiB per rank"),
    ]
    if pr:
        rows += [
            ("TTFT", f"{pr['ttft'] * 1e3:.1f} ms" + (f" (target {plan.slo['ttft'] * 1e3:.0f} ms)"
                                                     if "ttft" in plan.slo else "")),
            ("time per output token", f"{pr['tpot'] * 1e3:.2f} ms" + (f" (target {plan.slo['tpot'] * 1e3:.0f} ms)"
                                                                      if "tpot" in plan.slo else "")),
            ("throughput", f"{pr['tokens_per_s']:.0f} tokens/s, {pr['tokens_per_s_per_device']:.1f} per device"),
            ("memory per rank", f"{pr['memory_per_rank'] / gib:.2f} GiB of {pr['memory_budget'] / gib:.2f} GiB "
                                f"(weights {pr['weights_per_rank'] / gib:.2f} GiB)"),
        ]
    if "trace" in pr:   # planned on a request trace: TTFT is its P90, TPOT its P99 (autopar/inference/trace.py)
        t, sv = pr["trace"], pr["served"]
        rows += [
            ("trace", f"{t['requests']} requests over {t['seconds']:.0f} s ({t['rate']:.2f}/s), prompt p50 "
                      f"{t['prompt']['p50']:.0f} max {t['prompt']['max']}, output p50 {t['output']['p50']:.0f} "
                      f"max {t['output']['max']}"),
            ("served (simulated)", (f"{pr['batching']} batching, " if "batching" in pr else "")
                                   + (f"prefill chunk {pr['prefill_chunk']} tokens, " if "prefill_chunk" in pr else "")
                                   + "TTFT p50/p90/p99 " + "/".join(f"{sv['ttft'][q] * 1e3:.0f}" for q in
                                                                    ("p50", "p90", "p99")) + " ms, TPOT p99 "
                                   f"{sv['tpot']['p99'] * 1e3:.1f} ms, latency p90 {sv['latency']['p90']:.2f} s"),
        ]
        if "percentiles" in pr:   # which percentile the ttft/tpot rows above are
            q = pr["percentiles"]
            rows.append(("slo binds", f"TTFT {q['ttft'].upper()}, TPOT {q['tpot'].upper()}"))
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)
