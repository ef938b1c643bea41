"""The `autopar` command: plan, show, diff, ops, run.

    autopar plan MODULE:FACTORY --cluster PRESET|FILE [--nodes N] [--devices N] [-o plan.json] [--arg k=v ...]
    autopar show plan.json [--ops N] [--code --rank R]
    autopar diff old.json new.json [--threshold 0.02]     # exit 1 on a predicted regression
    autopar ops MODULE:FACTORY [--arg k=v ...]             # which ops hit which rule, which fell back
    autopar run -n N script.py [args...]                   # run a script on N local gloo processes
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from autopar.errors import PlanError


def _kwargs(pairs: list[str]) -> dict:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise PlanError(f"--arg expects name=value, got {p!r}")
        k, v = p.split("=", 1)
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def _cluster(args):
    from autopar.cluster import Cluster
    spec = args.cluster
    if Path(spec).suffix in (".yaml", ".yml") or Path(spec).exists():
        return Cluster.from_yaml(spec)
    kw = {"nodes": args.nodes}
    if args.devices:
        kw["devices"] = args.devices
    return Cluster.preset(spec, **kw)


def _load_model(spec: str, pairs):
    from autopar.models import load_factory
    factory = load_factory(spec)
    out = factory(**_kwargs(pairs))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PlanError(f"{spec} must return (model, example_inputs), got {type(out).__name__}")
    return out


def cmd_plan(args) -> int:
    import autopar
    cluster = _cluster(args)
    model, inputs = _load_model(args.factory, args.arg)
    constraints = _kwargs(args.constraint) if args.constraint else None
    p = autopar.plan(model, inputs, cluster, optimizer=args.optimizer, precision=args.precision,
                     memory_budget=args.memory_budget, constraints=constraints, time_limit=args.time_limit,
                     verbose=args.verbose)
    if args.output:
        p.save(args.output)
    print(p.summary(), end="")
    st = p.stats
    print(f"planned in {st['total_seconds']:.2f} s (trace {st['trace_seconds']:.2f} s, search "
          f"{st['seconds']:.2f} s){'; saved to ' + args.output if args.output else ''}")
    return 0


def cmd_show(args) -> int:
    from autopar.plan import Plan
    from autopar.report import show_text
    p = Plan.load(args.plan)
    if args.code:
        from codegen import per_rank_code
        print(per_rank_code(p, args.rank, factory=args.factory, pairs=args.arg))
        return 0
    print(show_text(p, limit=args.ops), end="")
    return 0


def cmd_diff(args) -> int:
    from autopar.plan import Plan
    from autopar.report import diff
    text, regressed = diff(Plan.load(args.old), Plan.load(args.new), threshold=args.threshold)
    print(text, end="")
    return 1 if regressed else 0


def cmd_ops(args) -> int:
    from collections import Counter

    from autopar.rules import coverage
    from autopar.trace import trace
    model, inputs = _load_model(args.factory, args.arg)
    g = trace(model, inputs)
    rows = coverage(g.gm.graph)
    by = Counter((t, r) for _, t, r in rows)
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"op rules hit by {args.factory}")
    for c in ("op", "rule", "nodes"):
        t.add_column(c)
    for (target, rule), n in sorted(by.items(), key=lambda x: (x[0][1] == "fallback", x[0])):
        t.add_row(target, rule if rule != "fallback" else "fallback (replicated)", str(n))
    Console().print(t)
    fb = sum(n for (_, r), n in by.items() if r == "fallback")
    print(f"{len(rows)} ops, {fb} on the replicate fallback")
    return 0


def cmd_run(args) -> int:
    from runtime.launch import run_script
    return run_script(args.script, args.script_args, nprocs=args.nprocs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar", description="auto-parallel training compiler for PyTorch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="plan a model from a factory")
    p.add_argument("factory", help="module.path:FACTORY, file.py:FACTORY or a zoo name (gpt2_xl, llama, ...)")
    p.add_argument("--cluster", required=True, help="preset (dgx-a100, dgx-h100, cpu) or a YAML file")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices", type=int, default=None, help="devices for the cpu preset")
    p.add_argument("-o", "--output")
    p.add_argument("--arg", action="append", help="factory keyword argument name=value")
    p.add_argument("--constraint", action="append", help="pin a degree, e.g. tp=8")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--memory-budget", type=float, default=None)
    p.add_argument("--time-limit", type=float, default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(fn=cmd_plan)
    s = sub.add_parser("show", help="summary, per-op strategies, memory breakdown of a plan")
    s.add_argument("plan")
    s.add_argument("--ops", type=int, default=60, help="how many per-op rows to show")
    s.add_argument("--code", action="store_true", help="print the generated per-rank program")
    s.add_argument("--rank", type=int, default=0)
    s.add_argument("--factory", help="model factory (needed with --code)")
    s.add_argument("--arg", action="append")
    s.set_defaults(fn=cmd_show)
    d = sub.add_parser("diff", help="what changed between two plans; exit 1 on a predicted regression")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("--threshold", type=float, default=0.02)
    d.set_defaults(fn=cmd_diff)
    o = sub.add_parser("ops", help="which ops hit which rule")
    o.add_argument("factory")
    o.add_argument("--arg", action="append")
    o.set_defaults(fn=cmd_ops)
    r = sub.add_parser("run", help="run a script on N local CPU processes (gloo)")
    r.add_argument("-n", "--nprocs", type=int, default=2)
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except PlanError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
