"""The checkpoint presolve (solver/presolve.py) side by side with the ILP it replaces.

For each case: trace a zoo model, build the Problem of one mesh configuration the search solves
(the ``--configs`` largest, by strategy variables), and solve it twice, with the
presolve and without (``solver.ilp.fix_needless_checkpointing`` replaced by the identity), each
under ``--limit`` seconds. Prints both times, the ratio and whether the objectives agree.

    .venv/bin/python -m benchmarks.bench_presolve            # about 6 minutes
"""
from __future__ import annotations

import argparse
import os
import time

import autopar
from autopar.models import HF_ZOO, ZOO
from autopar.frontend.trace import trace
from autopar.search.build import build_problem
from autopar.search.configurations import check_constraints, configurations
from autopar.pricing.price import Settings, price
from autopar.rules.candidates import candidates
from solver import ilp

CASES = [("hf_llama", "dgx-a100", 2), ("gpt2", "dgx-a100", 2), ("llama", "cpu", 4)]


def _cluster(kind: str, n: int):
    return autopar.Cluster.preset("cpu", devices=n) if kind == "cpu" else autopar.Cluster.preset(kind, nodes=n)


def problems(name: str, cluster, count: int):
    """The ``count`` largest Problems (most strategy variables) over the cluster's meshes, one
    per mesh (ZeRO stage and micro-batches change little here): the two-model-axis meshes are the
    ones whose ILPs the checkpoint choice made slow."""
    model, inputs = {**ZOO, **HF_ZOO}[name]()
    g = trace(model, inputs)
    base = Settings(optimizer="adamw", precision="bf16", budget=float(cluster.device.memory_bytes))
    seen, out = set(), []
    for cfg in configurations(g, cluster, base, check_constraints({})):
        if cfg.mesh in seen:
            continue
        seen.add(cfg.mesh)
        c = candidates(g, cfg.mesh)
        out.append((cfg, build_problem(c, price(c, cluster, cfg.settings), cfg.settings)))
    out.sort(key=lambda cp: -cp[1].num_strategy_vars())
    return out[:count]


def timed(problem, limit: float, presolve: bool):
    real = ilp.fix_needless_checkpointing
    if not presolve:
        ilp.fix_needless_checkpointing = lambda p: p
    try:
        t = time.perf_counter()
        try:
            sol = ilp.solve(problem, time_limit=limit)
            return time.perf_counter() - t, sol.objective, sol.status
        except autopar.PlanError:
            return time.perf_counter() - t, float("nan"), "no plan in limit"
    finally:
        ilp.fix_needless_checkpointing = real


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=int, default=2, help="largest meshes per case (default 2)")
    ap.add_argument("--limit", type=float, default=90.0, help="seconds per solve (default 90)")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| model | cluster | mesh | vars | groups | with presolve s | without s (status) | ratio | same objective |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, kind, n in CASES:
        cluster = _cluster(kind, n)
        for cfg, p in problems(name, cluster, args.configs):
            t1, o1, s1 = timed(p, args.limit, True)
            t0, o0, s0 = timed(p, args.limit, False)
            same = "yes" if s0 == "optimal" and abs(o0 - o1) <= 1e-9 * max(abs(o0), 1e-12) else \
                ("n/a" if s0 != "optimal" else f"no ({o1:.6g} vs {o0:.6g})")
            print(f"| {name} | {kind} x{n} | {cfg.mesh.describe()} | {p.num_strategy_vars()} | "
                  f"{len(p.checkpoint_groups)} | {t1:.2f} | {t0:.2f} ({s0}) | {t0 / t1:.1f}x | {same} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
