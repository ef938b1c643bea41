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
import ast
import sys
from pathlib import Path

from autopar.errors import ExecutionError, PlanError

EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_EXECUTION, EXIT_INTERNAL = 0, 1, 2, 3, 4


def _kwargs(pairs: list[str], flag: str = "--arg") -> dict:
    """name=value pairs (values parsed as Python literals); a repeated name is an error, never a
    silent last-one-wins."""
    out = {}
    for p in pairs or []:
        if "=" not in p:
            example = "tp=2" if flag == "--constraint" else "n_layer=4"
            raise PlanError(f"{flag} expects name=value (e.g. {flag} {example}), got {p!r}")
        k, v = p.split("=", 1)
        k = k.strip()
        if not k:
            raise PlanError(f"{flag} {p!r}: the name before '=' is empty")
        if k in out:
            raise PlanError(f"{flag} {k} is given twice ({k}={out[k]!r} and {p!r}): give each name once")
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def _positive_int(what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{what} must be at least 1, got {v}")
        return v
    return parse


def _bytes(text: str) -> float:
    from autopar.units import parse_bytes
    try:
        return parse_bytes(text, "--memory-budget")
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    from autopar.units import parse_seconds
    try:
        return parse_seconds(text, "--time-limit")
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cluster(args):
    from autopar.cluster import Cluster
    spec = args.cluster
    if Path(spec).suffix in (".yaml", ".yml") or Path(spec).exists():
        return Cluster.from_yaml(spec)
    kw = {"nodes": args.nodes}
    if args.devices:
        kw["devices"] = args.devices
    return Cluster.preset(spec, **kw)


def _load_hf(args, quiet: bool = False):
    """(model, inputs, precision) of the Hugging Face config ``args.factory`` (--seq, --batch,
    --task, --dtype; --arg overrides config fields). ``quiet``: no line saying what was built."""
    from autopar.models import HF_ZOO, ZOO
    from autopar.models.hf_config import from_hf_config, load_config
    spec = args.factory
    config = spec
    if not spec.endswith(".json") and not Path(spec).exists():   # a name: a zoo typo, or a cached HF model
        try:
            config = load_config(spec)
        except PlanError as e:
            names = ", ".join(sorted(ZOO) + sorted(HF_ZOO))
            raise PlanError(f"unknown model {spec!r}: not a zoo name ({names}), 'package.module:FACTORY' or "
                            f"'file.py:FACTORY', and as a Hugging Face model: {e}") from e
    if args.batch is None:
        raise PlanError(f"{spec} is read as a Hugging Face config: give the global batch in samples, "
                        f"--batch N (and the sequence length, --seq S)")
    out = from_hf_config(config, seq=args.seq, batch=args.batch, task=args.task, dtype=args.dtype,
                         overrides=_kwargs(args.arg))
    cfg = out.config
    n = sum(p.numel() for p in out.model.parameters())
    arch = type(out.model.model).__name__
    shape = f"seq {args.seq}, " if args.seq else ""
    if not quiet:
        print(f"{spec}: {arch} ({cfg.model_type}, {out.task}), {n / 1e9:.2f} B parameters, {shape}global batch "
              f"{args.batch}, {str(out.dtype).removeprefix('torch.')} -> precision {out.precision}")
    return out.model, out.inputs, out.precision


def _load_model(spec: str, pairs, extra: dict | None = None):
    """(model, inputs) of a factory spec; ``extra`` are keyword arguments from flags (--seq, --batch)."""
    import inspect

    from autopar.models import load_factory
    factory = load_factory(spec)
    kwargs = _kwargs(pairs)
    for k, v in (extra or {}).items():
        if k in kwargs:
            raise PlanError(f"--{k} and --arg {k}={kwargs[k]!r} both give {k}: give it once")
        kwargs[k] = v
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        unknown = [k for k in kwargs if k not in sig.parameters]
        flag = [k for k in unknown if k in (extra or {})]
        if flag:
            raise PlanError(f"--{flag[0]}: the factory {spec} takes no {flag[0]!r} argument; its arguments: "
                            f"{', '.join(sig.parameters) or 'none'}")
        if unknown:
            known = ", ".join(p for p in sig.parameters) or "none"
            raise PlanError(f"--arg {unknown[0]}: {spec} takes no argument {unknown[0]!r}; its arguments: {known}")
    try:
        out = factory(**kwargs)
    except PlanError:
        raise
    except Exception as e:   # the user's (or the zoo's) factory rejected the values
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise PlanError(f"the model factory {spec}({shown}) failed: {type(e).__name__}: {e}; "
                        f"check the --arg values") from e
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PlanError(f"{spec} must return (model, example_inputs), got {type(out).__name__}")
    return out


def cmd_plan(args) -> int:
    import autopar
    cluster = _cluster(args)
    constraints = autopar.Constraints.from_dict(_kwargs(args.constraint, "--constraint"))   # before the model loads
    from autopar.models import is_hf_spec
    if args.precision is not None and args.dtype is not None:
        raise PlanError(f"--precision {args.precision} and --dtype {args.dtype} both set the precision: give one")
    if is_hf_spec(args.factory):
        model, inputs, precision = _load_hf(args)
    else:
        if args.task is not None:
            raise PlanError(f"--task is for Hugging Face configs; {args.factory} is a model factory")
        extra = {k: v for k, v in (("seq", args.seq), ("batch", args.batch)) if v is not None}
        model, inputs = _load_model(args.factory, args.arg, extra)
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
            model, inputs, _ = _load_hf(args, quiet=True)
            print(per_rank_code(p, args.rank, factory=lambda: (model, inputs)))
            return 0
        extra = _factory_shape(args, "show --code")
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
        model, inputs, _ = _load_hf(args)
    else:
        model, inputs = _load_model(args.factory, args.arg, _factory_shape(args, "ops"))
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


def _factory_shape(args, command: str) -> dict:
    """--seq / --batch for a factory (its seq and batch arguments); --task and --dtype are for
    Hugging Face configs only, an error with a factory."""
    for flag in ("task", "dtype"):
        if getattr(args, flag) is not None:
            raise PlanError(f"{command}: --{flag} is for Hugging Face configs; {args.factory} is a model factory")
    return {k: v for k, v in (("seq", args.seq), ("batch", args.batch)) if v is not None}


def _model_shape_args(p) -> None:
    """--seq, --batch, --task and --dtype: what a Hugging Face config needs to become a model
    (``_load_hf``), on every command that builds one (plan, show --code, ops)."""
    p.add_argument("--seq", type=_positive_int("--seq"), default=None,
                   help="sequence length (Hugging Face configs; a factory's seq argument)")
    p.add_argument("--batch", type=_positive_int("--batch"), default=None,
                   help="global batch in samples (sequences) per step "
                        "(Hugging Face configs; a factory's batch argument)")
    p.add_argument("--task", choices=("causal-lm", "masked-lm", "seq2seq", "image-classification"), default=None,
                   help="Hugging Face configs: the model head (default: from the config's architectures)")
    p.add_argument("--dtype", default=None,
                   help="bf16/bfloat16, fp16/float16 (planned as bf16) or fp32/float32; default: the config's dtype")


def _inference_model(args, weights_needed: bool = False):
    """The causal LM of ``plan-inference`` / ``serve``: a zoo name or factory (its Hugging Face model),
    a Hugging Face model directory holding weights (loaded for serving), or a config (on meta: shapes
    only, enough to plan). Returns (model, tokenizer or None)."""
    from autopar.models import is_hf_spec
    spec = args.factory
    if is_hf_spec(spec):
        d = Path(spec)
        if weights_needed and d.is_dir() and (any(d.glob("*.safetensors")) or any(d.glob("*.bin"))):
            from transformers import AutoModelForCausalLM, AutoTokenizer
            model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
            try:
                tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
            except Exception:   # a model directory without tokenizer files: prompts come as token ids
                tokenizer = None
            return model, tokenizer
        shaped = argparse.Namespace(factory=spec, seq=1, batch=1, task=None, dtype=getattr(args, "dtype", None),
                                    arg=args.arg)
        model, _, _ = _load_hf(shaped, quiet=True)
        return model, None
    model, _ = _load_model(spec, args.arg)
    return model, None


def _slo_arg(text: str | None) -> dict | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        if "=" not in part:
            raise PlanError(f"--slo expects name=value pairs, e.g. ttft=2s,tpot=50ms; got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _inference_plan(args, model, cluster):
    from autopar.inference.inference_plan import InferencePlan
    from autopar.inference.planner import plan_inference
    import torch
    if getattr(args, "plan", None):
        return InferencePlan.load(args.plan)
    dtype = args.dtype or ("fp32" if cluster.backend == "gloo" else "bf16")
    return plan_inference(model, torch.zeros(args.batch, args.prompt_len, dtype=torch.long), cluster,
                          max_new_tokens=args.max_new_tokens, slo=_slo_arg(args.slo),
                          constraints=_kwargs(args.constraint, "--constraint"), dtype=dtype,
                          memory_budget=args.memory_budget)


def cmd_plan_inference(args) -> int:
    from autopar.inference.inference_plan import summary
    cluster = _cluster(args)
    model, _ = _inference_model(args)
    plan = _inference_plan(args, model, cluster)
    if args.output:
        plan.save(args.output)
    print(summary(plan), end="")
    print(f"planned in {plan.predictions['seconds']:.2f} s ({plan.predictions['configurations']} configurations)"
          f"{'; saved to ' + args.output if args.output else ''}")
    return 0


def _serve_rank(rank, world, model, tokenizer, plan_json, host, port, batch_wait, name):
    from autopar.inference.engine import compile_inference
    from autopar.inference.inference_plan import InferencePlan
    from autopar.inference.server import Limits, serve
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(model, plan=plan)
    limits = Limits(plan.prompt_len, plan.max_new_tokens, plan.batch_size * plan.dp,
                    vocab_size=plan.model.get("vocab"))
    if rank == 0:
        print(f"autopar serve: http://{host}:{port}/v1/completions ({world} rank(s), tp={plan.tp} dp={plan.dp}, "
              f"batch {limits.max_batch}, prompt <= {plan.prompt_len}, max_tokens <= {plan.max_new_tokens})",
              flush=True)
    serve(engine, limits, host=host, port=port, tokenizer=tokenizer, predictions=plan.predictions,
          batch_wait=batch_wait, model_name=name)
    return rank


def cmd_serve(args) -> int:
    import os
    cluster = _cluster(args)
    model, tokenizer = _inference_model(args, weights_needed=True)
    plan = _inference_plan(args, model, cluster)
    run = (model, tokenizer, plan.to_json(), args.host, args.port, args.batch_wait_ms / 1e3, args.factory)
    if plan.world_size == 1 or "RANK" in os.environ:
        import torch.distributed as dist
        if "RANK" in os.environ and not dist.is_initialized():   # torchrun: idle servers wait for requests
            from datetime import timedelta
            dist.init_process_group(cluster.backend, timeout=timedelta(days=1))
        _serve_rank(int(os.environ.get("RANK", 0)), plan.world_size, *run)
        return 0
    from runtime.launch import run_local
    run_local(_serve_rank, plan.world_size, args=run, timeout=float("inf"), pg_timeout=24 * 3600)
    return 0


def _inference_args(p) -> None:
    p.add_argument("factory", metavar="MODEL", help="a zoo name, module:FACTORY, or a Hugging Face config / model "
                                                    "directory (serve: a directory with weights)")
    p.add_argument("--cluster", default="cpu", help="preset or YAML file (default cpu)")
    p.add_argument("--nodes", type=_positive_int("--nodes"), default=1)
    p.add_argument("--devices", type=_positive_int("--devices"), default=None, help="devices for the cpu preset")
    p.add_argument("--prompt-len", type=_positive_int("--prompt-len"), default=128, help="longest prompt planned for")
    p.add_argument("--batch", type=_positive_int("--batch"), default=1, help="prompts in the example batch")
    p.add_argument("--max-new-tokens", type=_positive_int("--max-new-tokens"), default=64)
    p.add_argument("--slo", help="latency targets, e.g. ttft=2s,tpot=50ms")
    p.add_argument("--constraint", action="append", help="pin tp, pp, dp or batch_size, e.g. tp=2")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: bf16 on GPUs, fp32 on the cpu preset)")
    p.add_argument("--memory-budget", type=_bytes, default=None)
    p.add_argument("--arg", action="append", help="factory argument or config field name=value")


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
    _model_shape_args(p)
    p.add_argument("--cluster", required=True, help="preset (dgx-a100, dgx-h100, tacc-longhorn, cpu) or a YAML file")
    p.add_argument("--nodes", type=_positive_int("--nodes"), default=1)
    p.add_argument("--devices", type=_positive_int("--devices"), default=None, help="devices for the cpu preset")
    p.add_argument("-o", "--output")
    p.add_argument("--arg", action="append",
                   help="factory keyword argument name=value (a Hugging Face config: a config field to override)")
    p.add_argument("--constraint", action="append", help="pin a degree, e.g. tp=8 (keys: docs/constraints.md)")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--precision", default=None, help="bf16 (default) or fp32; a Hugging Face config's dtype otherwise")
    p.add_argument("--memory-budget", type=_bytes, default=None, help="bytes per device, e.g. 40GB, 40GiB")
    p.add_argument("--time-limit", type=_seconds, default=None, help="search time limit, e.g. 30, 30s, 2min")
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
    _model_shape_args(s)
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
    _model_shape_args(o)
    o.set_defaults(fn=cmd_ops)
    r = sub.add_parser("run", help="run a script on N local CPU processes (gloo)")
    r.add_argument("-n", "--nprocs", type=_positive_int("-n"), default=2)
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser("calibrate", help="measure GEMMs, memory-bound ops and collectives; write a profile")
    c.add_argument("-n", "--nprocs", type=_positive_int("-n"), default=2,
                   help="local gloo processes to fork (ignored under torchrun / autopar run)")
    c.add_argument("-o", "--output", default="calibration.yaml")
    c.add_argument("--sweep", choices=("tiny", "cpu", "gpu"), default="cpu")
    c.add_argument("--repeats", type=_positive_int("--repeats"), default=5)
    c.set_defaults(fn=cmd_calibrate)
    k = sub.add_parser("kernels", help="build the runtime's Triton kernels ahead of time for CUDA targets")
    k.add_argument("--aot", required=True, metavar="sm_80,sm_90", help="comma-separated CUDA architectures")
    k.set_defaults(fn=cmd_kernels)
    pi = sub.add_parser("plan-inference", help="plan generation: tp, dp and batch under latency targets")
    _inference_args(pi)
    pi.add_argument("-o", "--output")
    pi.set_defaults(fn=cmd_plan_inference)
    sv = sub.add_parser("serve", help="an OpenAI-compatible completions server of a model (loopback by default)")
    _inference_args(sv)
    sv.add_argument("--plan", help="an inference plan file (autopar plan-inference -o); default: plan here")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_positive_int("--port"), default=8000)
    sv.add_argument("--batch-wait-ms", type=float, default=10.0,
                    help="how long a request waits for others to share its batch")
    sv.set_defaults(fn=cmd_serve)
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
