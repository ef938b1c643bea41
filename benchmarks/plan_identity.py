"""Plan identity check for planner speed work: the JSON plans of the small zoo models on the
default cpu cluster (4 devices) and of gpt2 / llama on 2 DGX-A100 nodes (16 devices), written
to a directory, or compared with a directory written by another tree.

    PYTHONPATH=. python benchmarks/plan_identity.py write OUT_DIR
    PYTHONPATH=. python benchmarks/plan_identity.py compare BASE_DIR OUT_DIR

``compare`` writes OUT_DIR from this tree, then compares file by file, ignoring timing fields
(``TIMING_KEYS`` anywhere in the JSON: planning wall times, the solver's seconds), and exits 1
on any difference, printing the first differing paths.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

CPU_MODELS = ("hf_llama", "hf_gpt2", "hf_bert", "gpt2", "llama", "bert", "vit", "mlp")
GPU_MODELS = ("gpt2", "llama")
TIMING_KEYS = ("seconds", "solve_seconds", "trace_seconds", "total_seconds", "wall_seconds", "time_seconds")


def cases():
    import autopar
    yield from ((m, f"{m}_cpu4", lambda: autopar.Cluster.preset("cpu", devices=4)) for m in CPU_MODELS)
    yield from ((m, f"{m}_dgx16", lambda: autopar.Cluster.preset("dgx-a100", nodes=2)) for m in GPU_MODELS)


def write(out: Path) -> None:
    import autopar
    from autopar.models import HF_ZOO, ZOO
    warnings.simplefilter("ignore")
    out.mkdir(parents=True, exist_ok=True)
    for model_name, key, cluster in cases():
        model, batch = (ZOO.get(model_name) or HF_ZOO[model_name])()
        plan = autopar.plan(model, batch, cluster())
        (out / f"{key}.json").write_text(plan.to_json())
        print(f"{key}: step {plan.step_time:.6g} s, degrees {plan.degrees}", flush=True)


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in TIMING_KEYS}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _diff(a, b, path="$"):
    if type(a) is not type(b):
        yield path
    elif isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                yield f"{path}.{k}"
            else:
                yield from _diff(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        if len(a) != len(b):
            yield f"{path}[len]"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _diff(x, y, f"{path}[{i}]")
    elif a != b:
        yield path


def compare(base: Path, out: Path) -> int:
    write(out)
    bad = 0
    for f in sorted(base.glob("*.json")):
        g = out / f.name
        a, b = _strip(json.loads(f.read_text())), _strip(json.loads(g.read_text()))
        diffs = list(_diff(a, b))
        print(f"{f.stem:16} {'identical' if not diffs else 'DIFFERS: ' + ', '.join(diffs[:8])}")
        bad += bool(diffs)
    print("all plans identical" if not bad else f"{bad} plan(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(Path(sys.argv[2]))
    elif sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
