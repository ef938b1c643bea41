"""Pipelined plans executed against their own predictions, across the zoo's and Hugging Face's
architectures: what a stage's plan says it moves and saves, measured on 4 gloo ranks.

For each model and each configuration (pp=2 with Megatron-SP tp=2 under 1F1B, pp=2 with dp=2 and
ZeRO-1, pp=2 with plain tp=2 under GPipe): plan on ``cpu`` x4 (fp32, SGD), train 3 steps on 4
forked ranks and report every difference from the plan —

* losses against one eager process (rel 1e-5);
* bytes per mesh axis and point-to-point on each rank in steps 2-3 against the sum of its
  stages' ``comm_bytes`` / ``p2p_bytes``;
* saved activations alive at the rank's peak (saved_tensors_hooks, runtime/pipeline.py
  ``SavedProbe``) against ``alive_micro_batches x activations_per_micro_batch`` (one stage per
  rank), beyond 0.1%.

    .venv/bin/python -m benchmarks.bench_pipeline_fidelity [--models gpt2,hf_llama] [--configs sp-1f1b]

Not a test: some differences are known and listed in benchmarks/RESULTS-history.md section 12.
"""
from __future__ import annotations

import argparse
import sys

import torch

import autopar
from autopar.models import HF_ZOO, ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

STEPS = 3
LR, MOMENTUM = 0.05, 0.9
CONFIGS = {
    "sp-1f1b": {"pp": 2, "tp": 2, "sp_mode": "megatron", "num_micro_batches": 4, "pp_schedule": "1f1b"},
    "dp-zero1": {"pp": 2, "dp": 2, "zero": 1, "num_micro_batches": 2, "pp_schedule": "1f1b"},
    "tp-gpipe": {"pp": 2, "tp": 2, "num_micro_batches": 2, "pp_schedule": "gpipe"},
}
MODELS = ("gpt2", "llama", "bert", "hf_gpt2", "hf_llama", "hf_mistral", "hf_qwen2", "hf_bloom", "hf_gpt_neox",
          "hf_bert")


def _factory(name):
    return ZOO.get(name) or HF_ZOO[name]


def _eager_losses(name) -> list[float]:
    model, batch = _factory(name)()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


def _run(rank, world, name, plan_json):
    model, batch = _factory(name)()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=LR, momentum=MOMENTUM)
    losses = [float(cm.step(*batch))]   # PyTorch's metadata pass runs here: not measured
    probe = cm.runner.measure_saved()
    cm.reset_comm_stats()
    losses += [float(cm.step(*batch)) for _ in range(STEPS - 1)]
    return {"stage": cm.stage, "losses": losses, "comm": cm.comm_stats(), "peak": probe.peak}


def differences(name: str, constraints: dict) -> tuple[autopar.Plan, list[str]]:
    """(the plan, every way its execution differs from it)."""
    model, batch = _factory(name)()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4), precision="fp32", optimizer="sgd",
                        constraints=constraints)
    ref = _eager_losses(name)
    res = run_local(_run, 4, args=(name, plan.to_json()), timeout=400)
    pp = plan.degrees["pp"]
    out = set()
    for r in res:
        mine = [st for st in plan.data["stages"] if st["index"] % pp == r["stage"]]
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref))
        if worst > 1e-5:
            out.add(f"stage {r['stage']}: losses {r['losses']} against eager {ref}")
        for axis in plan.mesh.names:
            want = (STEPS - 1) * sum(st["comm_bytes"][axis] for st in mine)
            if r["comm"].get(axis, 0) != want:
                out.add(f"stage {r['stage']} {axis}: moved {r['comm'].get(axis, 0)}, planned {want}")
        p2p = (STEPS - 1) * sum(st["p2p_bytes"] for st in mine)
        if r["comm"].get("pp", 0) != p2p:
            out.add(f"stage {r['stage']} point-to-point: moved {r['comm'].get('pp', 0)}, planned {p2p}")
        if len(mine) == 1:
            want = mine[0]["alive_micro_batches"] * mine[0]["activations_per_micro_batch"]
            if abs(r["peak"] - want) > 1e-3 * want:
                out.add(f"stage {r['stage']} saved: {r['peak']}, planned {want} ({r['peak'] / want - 1:+.2%})")
    return plan, sorted(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args(argv)
    print("| model | configuration | plan | differences from the plan |\n|---|---|---|---|", flush=True)
    for name in args.models.split(","):
        for key in args.configs.split(","):
            try:
                plan, diffs = differences(name, CONFIGS[key])
            except Exception as e:   # reported, not hidden: the row says what failed
                print(f"| {name} | {key} | error | {type(e).__name__}: {str(e).splitlines()[0][:200]} |", flush=True)
                continue
            d = plan.degrees
            mode = f" {d['sp_mode']}" if d.get("sp_mode") else ""
            print(f"| {name} | {key} | pp={d['pp']} dp={d['dp']} tp={d['tp']}{mode} | "
                  f"{'; '.join(diffs) if diffs else 'none'} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
