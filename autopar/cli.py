"""The `autopar` command: plan, show, diff, ops, run, plan-inference, serve.

    autopar plan MODULE:FACTORY --cluster PRESET|FILE [--nodes N] [--devices N] [-o plan.json] [--arg k=v ...]
    autopar plan CONFIG --seq S --batch B --cluster ... [--task T] [--dtype D] [--arg field=v ...]
        CONFIG: a Hugging Face config.json, a model directory holding one, or a model name in the
        local Hugging Face cache (never downloaded); built on the meta device (autopar/models/hf_config.py)
    autopar show plan.json [--ops N] [--code --rank R --factory F] [--timeline t.png]
    autopar report plan.json -o plan.html [--compare other.json]  # one self-contained HTML page
    autopar diff old.json new.json [--threshold 0.02] [--fail-on step_time=+2%,peak_memory=+5%] [--force]
                                                           # exit 1 on a predicted regression
    autopar ops MODULE:FACTORY [--arg k=v ...]             # which ops hit which rule, which fell back
    autopar run -n N script.py [args...]                   # run a script on N local gloo processes
    autopar plan-inference MODEL --prompt-len P --batch B --max-new-tokens T --cluster ... [--slo ttft=2s,tpot=50ms]
                                                           # how to split a model for generation
    autopar serve MODEL [--plan inference.json] [--port 8000]  # OpenAI-compatible completions on loopback

Errors: every failure prints ONE line ``autopar: error: <what, where, what to do>`` on stderr, no
traceback unless ``-v``/``--verbose`` is given (before or after the command). Exit codes:

    0  success                       2  bad input (model, cluster, plan file, arguments, constraints)
    1  diff: a predicted regression  3  running failed (ExecutionError)
    4  internal error (a bug in autopar: please report it with the -v traceback)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar import cli_inference
from autopar.cli_args import (byte_size, cluster_from_args, factory_shape, load_factory_model, load_hf,
                              model_shape_args, parse_pairs, positive_int, seconds)
from autopar.errors import ExecutionError, PlanError

EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_EXECUTION, EXIT_INTERNAL = 0, 1, 2, 3, 4


def cmd_plan(args) -> int:
    import autopar
    cluster = cluster_from_args(args)
    constraints = autopar.Constraints.from_dict(parse_pairs(args.constraint, "--constraint"))   # before the model loads
    from autopar.models import is_hf_spec
    if args.precision is not None and args.dtype is not None:
        raise PlanError(f"--precision {args.precision} and --dtype {args.dtype} both set the precision: give one")
    if is_hf_spec(args.factory):
        model, inputs, precision = load_hf(args)
    else:
        if args.task is not None:
            raise PlanError(f"--task is for Hugging Face configs; {args.factory} is a model factory")
        extra = {k: v for k, v in (("seq", args.seq), ("batch", args.batch)) if v is not None}
        model, inputs = load_factory_model(args.factory, args.arg, extra)
        precision = "bf16"
        if args.dtype is not None:
            from autopar.models.hf_config import DTYPES
            if args.dtype.lower() not in DTYPES:
                raise PlanError(f"--dtype {args.dtype}: use one of {', '.join(sorted(DTYPES))}")
            precision = DTYPES[args.dtype.lower()][1]
    precision = args.precision or precision
    p = autopar.plan(model, inputs, cluster, optimizer=args.optimizer, precision=precision,
                     memory_budget=args.memory_budget, constraints=constraints, time_limit=args.time_limit,
                     verbose=args.verbose)
    if args.output:
        p.save(args.output)
    print(p.summary(), end="")
    st = p.stats
    print(f"planned in {st['total_seconds']:.2f} s (trace {st['trace_seconds']:.2f} s, search "
          f"{st['seconds']:.2f} s){'; saved to ' + args.output if args.output else ''}")
    return 0


def _is_inference_plan(path: str) -> bool:
    import json
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False   # Plan.load says what is wrong with the file
    return isinstance(data, dict) and data.get("kind") == "inference"


def cmd_show(args) -> int:
    from autopar.plans.plan import Plan
    from autopar.plans.report import show_text
    if _is_inference_plan(args.plan):
        from autopar.inference.inference_plan import InferencePlan, summary
        print(summary(InferencePlan.load(args.plan)), end="")
        return 0
    p = Plan.load(args.plan)
    if args.code:
        from codegen import per_rank_code
        if not args.factory:
            raise PlanError("show --code needs the model the plan was made for: add --factory MODULE:FACTORY "
                            "(or a zoo name) and the same --arg values used with `autopar plan`")
        if not 0 <= args.rank < p.mesh.size:
            raise PlanError(f"--rank {args.rank} is outside the plan's mesh {p.mesh.describe()}: "
                            f"give a rank from 0 to {p.mesh.size - 1}")
        from autopar.models import is_hf_spec
        if is_hf_spec(args.factory):   # the Hugging Face config the plan was made from (autopar plan CONFIG)
            model, inputs, _ = load_hf(args, quiet=True)
            print(per_rank_code(p, args.rank, factory=lambda: (model, inputs)))
            return 0
        extra = factory_shape(args, "show --code")
        pairs = list(args.arg or []) + [f"{k}={v}" for k, v in extra.items()]
        print(per_rank_code(p, args.rank, factory=args.factory, pairs=pairs))
        return 0
    print(show_text(p, limit=args.ops), end="")
    if args.timeline:
        if p.degrees.get("pp", 1) <= 1:
            raise PlanError(f"--timeline draws a pipeline schedule, but {args.plan} has pp=1: plan with "
                            f"--constraint pp=N (and num_micro_batches) or let the search choose pp")
        from autopar.search.stage_plan import simulate_plan
        from autopar.plans.timeline import draw_timeline
        d = p.degrees
        out = draw_timeline(simulate_plan(p.data), args.timeline,
                            title=f"predicted {d['pp_schedule']} schedule: pp={d['pp']}, "
                                  f"{d['num_micro_batches']} micro-batches")
        print(f"timeline saved to {out}")
    return 0


def _schedule(p):
    """The simulated pipeline schedule of a pipelined plan (None for pp=1)."""
    if p.degrees.get("pp", 1) <= 1:
        return None
    from autopar.search.stage_plan import simulate_plan
    return simulate_plan(p.data)


def cmd_report(args) -> int:
    from autopar.plans.plan import Plan
    from autopar.plans.report_html import ReportEntry, render_report
    out = Path(args.output)
    if out.is_dir():
        raise PlanError(f"-o {out} is a directory: give the path of the .html file to write")
    if not out.parent.exists():
        raise PlanError(f"-o {out}: the directory {out.parent} does not exist")
    entries = []
    for path in [args.plan] + ([args.compare] if args.compare else []):
        p = Plan.load(path)
        entries.append(ReportEntry(p, Path(path).name, _schedule(p)))
    if len(entries) == 2 and entries[0].plan.fingerprint != entries[1].plan.fingerprint:
        print(f"note: {args.plan} and {args.compare} are plans of different models; their ops do not correspond",
              file=sys.stderr)
    page = render_report(entries)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        raise PlanError(f"cannot write {out}: {e}") from None
    print(f"report saved to {out} ({len(page) / 1024:.0f} KiB)")
    return 0


def cmd_diff(args) -> int:
    from autopar.plans.plan import Plan
    from autopar.plans.report import diff, parse_fail_on
    fail_on = parse_fail_on(args.fail_on) if args.fail_on is not None else None   # before loading: bad syntax first
    if fail_on is not None and args.threshold is not None:
        raise PlanError("give --threshold or --fail-on, not both: --fail-on sets a limit per metric "
                        "(e.g. --fail-on step_time=+2%,peak_memory=+2% is --threshold 0.02)")
    old, new = Plan.load(args.old), Plan.load(args.new)
    if old.fingerprint != new.fingerprint and not args.force:
        raise PlanError(f"{args.old} and {args.new} are plans of different models (graph fingerprints "
                        f"{old.fingerprint[:12]} and {new.fingerprint[:12]}): their ops do not correspond. "
                        f"Compare them anyway with --force")
    text, regressed = diff(old, new, threshold=0.02 if args.threshold is None else args.threshold, fail_on=fail_on)
    print(text, end="")
    return 1 if regressed else 0


def cmd_ops(args) -> int:
    from collections import Counter

    from autopar.rules import coverage
    from autopar.frontend.trace import trace
    from autopar.models import is_hf_spec
    if is_hf_spec(args.factory):
        model, inputs, _ = load_hf(args)
    else:
        model, inputs = load_factory_model(args.factory, args.arg, factory_shape(args, "ops"))
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


def cmd_calibrate(args) -> int:
    from autopar.execution.calibrate import calibrate
    cal = calibrate(nprocs=args.nprocs, sweep=args.sweep, repeats=args.repeats, output=args.output)
    if cal is not None:
        print(f"wrote {args.output}: {cal.source}")
        print(f"  GEMM {min(r for _, r in cal.gemm) / 1e9:.1f}-{max(r for _, r in cal.gemm) / 1e9:.1f} GFLOP/s, "
              f"memory {max(r for _, r in cal.memory) / 1e9:.1f} GB/s peak, "
              f"kernel {cal.kernel_overhead * 1e6:.1f} us, overlap slowdown {cal.overlap_slowdown:.2f}")
        if cal.host_copy_bandwidth and cal.host_cpu_bandwidth:
            print(f"  host (offload): copy {cal.host_copy_bandwidth / 1e9:.1f} GB/s per process, "
                  f"optimizer step {cal.host_cpu_bandwidth / 1e9:.1f} GB/s per process")
        print(f"  use it: a cluster file with `calibration: {args.output}`")
    return 0


def cmd_kernels(args) -> int:
    """Build every Triton kernel for the CUDA targets in ``--aot`` (no GPU needed); exit 1 if any fails."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise PlanError("autopar kernels needs triton: pip install triton") from None
    from runtime.kernels.aot import build_in_child, parse_archs
    try:
        archs = parse_archs(args.aot)
    except ValueError as e:
        raise PlanError(str(e)) from None
    results = build_in_child(archs)
    if "__skip__" in results:
        raise PlanError(f"cannot build ahead of time here: {results['__skip__']}")
    failed = {k: v for k, v in results.items() if v != "ok"}
    for arch in archs:
        mine = [k for k in results if k.endswith(f"-sm{arch}")]
        ok = sum(results[k] == "ok" for k in mine)
        print(f"{ok} of {len(mine)} kernel builds ok for sm_{arch}")
    for k, v in sorted(failed.items()):
        print(f"FAILED {k}: {v.splitlines()[-1] if v else v}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar", description="auto-parallel training compiler for PyTorch",
                                 epilog="exit codes: 0 ok, 1 diff found a regression, 2 bad input, "
                                        "3 running failed, 4 internal error")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks on errors; log the search")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="plan a model from a factory or a Hugging Face config")
    p.add_argument("factory", metavar="MODEL",
                   help="module.path:FACTORY, file.py:FACTORY, a zoo name (gpt2_xl, llama, ...), or a Hugging Face "
                        "config.json, model directory or cached model name (any other name without ':')")
    model_shape_args(p)
    p.add_argument("--cluster", required=True, help="preset (dgx-a100, dgx-h100, tacc-longhorn, cpu) or a YAML file")
    p.add_argument("--nodes", type=positive_int("--nodes"), default=1)
    p.add_argument("--devices", type=positive_int("--devices"), default=None, help="devices for the cpu preset")
    p.add_argument("-o", "--output")
    p.add_argument("--arg", action="append",
                   help="factory keyword argument name=value (a Hugging Face config: a config field to override)")
    p.add_argument("--constraint", action="append", help="pin a degree, e.g. tp=8 (keys: docs/constraints.md)")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--precision", default=None, help="bf16 (default) or fp32; a Hugging Face config's dtype otherwise")
    p.add_argument("--memory-budget", type=byte_size, default=None, help="bytes per device, e.g. 40GB, 40GiB")
    p.add_argument("--time-limit", type=seconds, default=None, help="search time limit, e.g. 30, 30s, 2min")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_plan)
    s = sub.add_parser("show", help="summary, per-op strategies, memory breakdown of a plan")
    s.add_argument("plan")
    s.add_argument("--ops", type=int, default=60, help="how many per-op rows to show")
    s.add_argument("--code", action="store_true", help="print the generated per-rank program")
    s.add_argument("--rank", type=int, default=0)
    s.add_argument("--factory", help="the plan's model (needed with --code): a factory, a zoo name or the "
                                      "Hugging Face config it was planned from, with the same --arg / --seq / --batch")
    s.add_argument("--arg", action="append")
    model_shape_args(s)
    s.add_argument("--timeline", help="draw the predicted pipeline schedule to this image (e.g. t.png)")
    s.set_defaults(fn=cmd_show)
    rp = sub.add_parser("report", help="one self-contained HTML page of a plan (summary, memory, timeline, "
                                       "communication, searchable per-op table)")
    rp.add_argument("plan")
    rp.add_argument("-o", "--output", required=True, help="the .html file to write")
    rp.add_argument("--compare", metavar="OTHER.json", help="a second plan shown side by side (and diffed)")
    rp.set_defaults(fn=cmd_report)
    d = sub.add_parser("diff", help="what changed between two plans; exit 1 on a predicted regression")
    d.add_argument("old")
    d.add_argument("new")
    d.add_argument("--threshold", type=float, default=None,
                   help="relative growth of step time or peak memory that counts as a regression (default 0.02)")
    d.add_argument("--fail-on", metavar="METRIC=LIMIT,...",
                   help="exit 1 when a named metric gets worse beyond its limit, e.g. step_time=+2%%,peak_memory=+5%%; "
                        "metrics: step_time, peak_memory, comm_bytes, mfu (replaces --threshold's rule)")
    d.add_argument("--force", action="store_true", help="compare plans of different models anyway")
    d.set_defaults(fn=cmd_diff)
    o = sub.add_parser("ops", help="which ops hit which rule")
    o.add_argument("factory", metavar="MODEL", help="a factory, a zoo name or a Hugging Face config (as for plan)")
    o.add_argument("--arg", action="append")
    model_shape_args(o)
    o.set_defaults(fn=cmd_ops)
    r = sub.add_parser("run", help="run a script on N local CPU processes (gloo)")
    r.add_argument("-n", "--nprocs", type=positive_int("-n"), default=2)
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser("calibrate", help="measure GEMMs, memory-bound ops and collectives; write a profile")
    c.add_argument("-n", "--nprocs", type=positive_int("-n"), default=2,
                   help="local gloo processes to fork (ignored under torchrun / autopar run)")
    c.add_argument("-o", "--output", default="calibration.yaml")
    c.add_argument("--sweep", choices=("tiny", "cpu", "gpu"), default="cpu")
    c.add_argument("--repeats", type=positive_int("--repeats"), default=5)
    c.set_defaults(fn=cmd_calibrate)
    k = sub.add_parser("kernels", help="build the runtime's Triton kernels ahead of time for CUDA targets")
    k.add_argument("--aot", required=True, metavar="sm_80,sm_90", help="comma-separated CUDA architectures")
    k.set_defaults(fn=cmd_kernels)
    cli_inference.add_parsers(sub)
    try:
        args = ap.parse_args(argv)   # argparse reports usage errors itself: one message, exit 2
    except SystemExit as e:          # returned, not raised, so callers of main() get the code
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_BAD_INPUT
    try:
        return args.fn(args)
    except (PlanError, ExecutionError) as e:
        if args.verbose:
            import traceback
            traceback.print_exc()
        print(f"autopar: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(e, PlanError) else EXIT_EXECUTION
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except Exception as e:   # a bug: one line by default, the traceback with -v
        if args.verbose:
            import traceback
            traceback.print_exc()
        print(f"autopar: internal error: {type(e).__name__}: {e} (run with -v for the traceback and "
              f"please report it)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
