"""2D / 2.5D / 3D tensor parallelism on any model: for every zoo and Hugging Face suite model,
how many of its ops each grid mode runs replicated (codegen/grid_replicated.py: whole on every
rank, conversions priced) and which; then a Llama-7B-shaped model on one DGX-A100 node, the grid
modes pinned against Megatron 1D (predicted step, peak memory, bytes per axis).

    PYTHONPATH=. .venv/bin/python benchmarks/grid_any_model.py          # both parts
    PYTHONPATH=. .venv/bin/python benchmarks/grid_any_model.py --quick  # the zoo only, no Llama-7B
"""
from __future__ import annotations

import argparse
import time
import warnings
from collections import Counter

import autopar
from autopar.models import HF_ZOO, ZOO

SMALL_ZOO = ["gpt2", "llama", "bert", "vit", "mlp"]
MODES = {"2d": 4, "2.5d": 8, "3d": 8}


def replicated_ops(plan) -> list[str]:
    return [op["node"] for op in plan.data["ops"] if op["strategy"].endswith(": replicated")]


def survey(names) -> None:
    print(f"{'model':<16}" + "".join(f"{m + ' (' + str(n) + ')':>30}" for m, n in MODES.items()))
    for name in names:
        model, batch = (ZOO.get(name) or HF_ZOO[name])()
        cells = []
        for mode, n in MODES.items():
            try:
                plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=n),
                                    constraints={"tp": n, "tp_mode": mode})
                rep = replicated_ops(plan)
                kinds = Counter(op.rstrip("_0123456789") for op in rep)
                cells.append(f"{len(rep)}/{len(plan.data['ops'])} " + ",".join(f"{k}" for k in sorted(kinds))[:18])
            except Exception as e:   # noqa: BLE001 - the survey reports every outcome
                cells.append(f"{type(e).__name__}")
        print(f"{name:<16}" + "".join(f"{c:>30}" for c in cells), flush=True)


def llama_7b() -> None:
    model, batch = ZOO["llama_7b"]()
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    print(f"\nllama_7b on {cluster.describe() if hasattr(cluster, 'describe') else 'dgx-a100 x 1 node'}")
    for cons in ({"tp": 4, "dp": 2, "tp_mode": "1d"}, {"tp": 4, "dp": 2, "tp_mode": "2d"},
                 {"tp": 8, "tp_mode": "2.5d"}, {"tp": 8, "tp_mode": "3d"}):
        t = time.time()
        try:
            p = autopar.plan(model, batch, cluster, constraints=cons)
            gib = {k: round(v / 2 ** 30, 1) for k, v in p.comm_bytes.items()}
            print(f"  {str(cons):<44} step {p.step_time:.4f} s  peak {p.peak_memory / 2 ** 30:5.1f} GiB  "
                  f"replicated ops {len(replicated_ops(p))}  GiB/axis {gib}  ({time.time() - t:.1f} s to plan)")
        except Exception as e:   # noqa: BLE001
            print(f"  {str(cons):<44} {type(e).__name__}: {str(e)[:160]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small zoo models only, no Llama-7B")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    survey(SMALL_ZOO if args.quick else SMALL_ZOO + sorted(HF_ZOO))
    if not args.quick:
        llama_7b()


if __name__ == "__main__":
    main()
