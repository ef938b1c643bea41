"""The README's demo: plan GPT-2 XL on 2 DGX-A100 nodes, then train a small GPT on 4 local CPU
processes under its automatic plan (loss must go down), then print that plan's summary."""
from __future__ import annotations

import argparse
import time


def plan_gpt2_xl(nodes: int = 2) -> None:
    import autopar
    from autopar.models import ZOO
    model, batch = ZOO["gpt2_xl"]()
    cluster = autopar.Cluster.preset("dgx-a100", nodes=nodes)
    t0 = time.perf_counter()
    p = autopar.plan(model, batch, cluster)
    print(p.summary(), end="")
    st = p.stats
    print(f"GPT-2 XL on {nodes} DGX-A100 nodes planned in {time.perf_counter() - t0:.1f} s "
          f"(trace {st['trace_seconds']:.1f} s, search {st['seconds']:.1f} s, {st['configs']} configurations, "
          f"{st['pruned']} pruned)\n")


def train_small_gpt(nprocs: int = 4, steps: int = 30) -> None:
    from autopar.train_demo import train

    train(nprocs=nprocs, steps=steps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args(argv)
    plan_gpt2_xl(args.nodes)
    if not args.skip_train:
        train_small_gpt(args.procs, args.steps)


if __name__ == "__main__":
    main()
