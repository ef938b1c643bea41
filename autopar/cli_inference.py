"""The generation commands of `autopar`: ``plan-inference`` (how to split a model for generation,
autopar/inference/planner.py) and ``serve`` (an OpenAI-compatible completions server,
autopar/inference/server.py), and their arguments (``add_parsers``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from autopar.cli_args import byte_size, cluster_from_args, load_factory_model, load_hf, parse_pairs, positive_int
from autopar.errors import ExecutionError, PlanError


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
        model, _, _ = load_hf(shaped, quiet=True)
        return model, None
    model, _ = load_factory_model(spec, args.arg)
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
    constraints = parse_pairs(args.constraint, "--constraint")
    trace = getattr(args, "trace", None)
    if getattr(args, "prefill_chunk", None) and (not trace or args.batching != "chunked"):
        raise PlanError(f"--prefill-chunk {args.prefill_chunk} applies to serving a --trace with --batching chunked "
                        f"(continuous batching with chunked prefill)")
    new = args.max_new_tokens if args.max_new_tokens is not None or trace else 64
    return plan_inference(model, None if trace else torch.zeros(args.batch, args.prompt_len, dtype=torch.long),
                          cluster, max_new_tokens=new, slo=_slo_arg(args.slo),
                          constraints=constraints, dtype=dtype,
                          memory_budget=args.memory_budget, trace=trace,
                          **({"batching": args.batching} if trace else {}),
                          **({"prefill_chunk": args.prefill_chunk} if getattr(args, "prefill_chunk", None) else {}))


def cmd_plan_inference(args) -> int:
    from autopar.inference.inference_plan import summary
    cluster = cluster_from_args(args)
    model, _ = _inference_model(args)
    plan = _inference_plan(args, model, cluster)
    if args.output:
        plan.save(args.output)
    print(summary(plan), end="")
    print(f"planned in {plan.predictions['seconds']:.2f} s ({plan.predictions['configurations']} configurations)"
          f"{'; saved to ' + args.output if args.output else ''}")
    return 0


def _serve_rank(rank, world, model, tokenizer, plan_json, host, port, batch_wait, name, timeout_s,
                backend="modules"):
    from datetime import timedelta

    from autopar.inference.engine import compile_inference
    from autopar.inference.inference_plan import InferencePlan
    from autopar.inference.server import Limits, serve
    plan = InferencePlan.from_json(plan_json)
    timeout = timedelta(seconds=timeout_s)   # the tp / pipeline groups' collectives, as the default group's
    batching = plan.predictions.get("batching", "static")
    if batching in ("continuous", "chunked"):   # a chunked plan's engine prefills in its chunks
        from autopar.inference.iteration_engine import IterationEngine
        engine = IterationEngine.from_plan(model, plan, collective_timeout=timeout, backend=backend)
    else:
        engine = compile_inference(model, plan=plan, collective_timeout=timeout, backend=backend)
    limits = Limits(plan.prompt_len, plan.max_new_tokens, plan.batch_size * plan.dp,
                    vocab_size=plan.model.get("vocab"))
    if rank == 0:
        how = (f"chunked batching ({plan.predictions['prefill_chunk']} tokens an iteration)" if batching == "chunked"
               else f"{batching} batching")
        print(f"autopar serve: http://{host}:{port}/v1/completions ({world} rank(s), tp={plan.tp} pp={plan.pp} "
              f"dp={plan.dp}, {how}, {backend} backend, batch {limits.max_batch}, prompt <= {plan.prompt_len}, "
              f"max_tokens <= {plan.max_new_tokens})", flush=True)
    serve(engine, limits, host=host, port=port, tokenizer=tokenizer, predictions=plan.predictions,
          batch_wait=batch_wait, model_name=name, batching=batching)
    return rank


BATCH_WAIT_MS = 10.0   # serve --batch-wait-ms default (static batching)
DEFAULT_TIMEOUT_S = 120.0   # serve --collective-timeout default


def cmd_serve(args) -> int:
    import os
    cluster = cluster_from_args(args)
    model, tokenizer = _inference_model(args, weights_needed=True)
    plan = _inference_plan(args, model, cluster)
    batching = plan.predictions.get("batching", "static")
    if batching not in ("static", "continuous", "chunked"):
        raise PlanError(f"the plan was made for {batching} batching, which autopar serve does not run; plan with "
                        f"plan-inference --batching static, continuous or chunked")
    if batching != "static" and args.batch_wait_ms is not None:
        raise PlanError(f"--batch-wait-ms {args.batch_wait_ms:g} applies to static batching; under the plan's "
                        f"{batching} batching a request joins the running batch at the next iteration: drop it, or "
                        f"plan with --batching static")
    if args.backend == "codegen":   # what the codegen engines refuse, refused here before any rank starts
        from autopar.inference.codegen_engine import check_codegen_plan
        from autopar.inference.codegen_iteration import check_iteration_plan
        if batching == "static":
            check_codegen_plan(plan)
        else:
            check_iteration_plan(plan)
    wait_ms = BATCH_WAIT_MS if args.batch_wait_ms is None else args.batch_wait_ms
    if args.collective_timeout is not None and not args.collective_timeout > 0:
        raise PlanError(f"--collective-timeout must be a positive number of seconds, got {args.collective_timeout:g}")
    # a collective waits at most this long: a rank that failed mid-forward fails its peers after it
    # (rank 0's jobs, which idle ranks wait for, travel on a group without a timeout: server.py)
    timeout_s = DEFAULT_TIMEOUT_S if args.collective_timeout is None else args.collective_timeout
    run = (model, tokenizer, plan.to_json(), args.host, args.port, wait_ms / 1e3, args.factory, timeout_s, args.backend)
    if plan.world_size == 1 or "RANK" in os.environ:
        import torch.distributed as dist
        if "RANK" in os.environ and not dist.is_initialized():   # torchrun: idle servers wait for requests
            from datetime import timedelta

            from autopar.execution.placement import restart_safe_store   # a restarted torchrun group: issue 30
            dist.init_process_group(cluster.backend, timeout=timedelta(seconds=timeout_s), **restart_safe_store())
        _serve_rank(int(os.environ.get("RANK", 0)), plan.world_size, *run)
        return 0
    from runtime.launch import LocalLaunchError, run_local
    try:
        run_local(_serve_rank, plan.world_size, args=run, timeout=float("inf"), pg_timeout=timeout_s)
    except LocalLaunchError as e:   # a rank failed (e.g. RanksOutOfStep): the server stopped with it
        raise ExecutionError(f"autopar serve stopped: {e}") from e
    return 0


def _inference_args(p) -> None:
    p.add_argument("factory", metavar="MODEL", help="a zoo name, module:FACTORY, or a Hugging Face config / model "
                                                    "directory (serve: a directory with weights)")
    p.add_argument("--cluster", default="cpu", help="preset or YAML file (default cpu)")
    p.add_argument("--nodes", type=positive_int("--nodes"), default=1)
    p.add_argument("--devices", type=positive_int("--devices"), default=None, help="devices for the cpu preset")
    p.add_argument("--prompt-len", type=positive_int("--prompt-len"), default=128, help="longest prompt planned for")
    p.add_argument("--batch", type=positive_int("--batch"), default=1, help="prompts in the example batch")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=None,
                   help="default 64, or a --trace's longest output")
    p.add_argument("--slo", help="latency targets, e.g. ttft=2s,tpot=50ms")
    p.add_argument("--constraint", action="append", help="pin tp, pp, dp or batch_size, e.g. tp=2")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: bf16 on GPUs, fp32 on the cpu preset)")
    p.add_argument("--memory-budget", type=byte_size, default=None)
    p.add_argument("--arg", action="append", help="factory argument or config field name=value")




def add_parsers(sub) -> None:
    """``plan-inference`` and ``serve`` on the `autopar` command's subparsers."""
    pi = sub.add_parser("plan-inference", help="plan generation: tp, dp and batch under latency targets")
    _inference_args(pi)
    pi.add_argument("--trace", metavar="FILE.csv", help="plan on a request trace (arrived_at, num_prefill_tokens, "
                                                        "num_decode_tokens), served in simulation: the slo binds "
                                                        "TTFT at P90 and TPOT at P99 (docs/inference.md)")
    pi.add_argument("--batching", choices=("static", "continuous", "chunked"), default="static",
                    help="how the --trace is served in simulation: static batches padded to their longest prompt "
                         "and output (the default), continuous batching (requests join and leave the running "
                         "batch at each step, as vLLM), or chunked: continuous with chunked prefill (Sarathi-Serve; "
                         "--prefill-chunk tokens an iteration); autopar serve runs all three")
    pi.add_argument("--prefill-chunk", type=positive_int("--prefill-chunk"), default=None, metavar="N",
                    help="with --batching chunked: tokens an iteration runs, decodes first and prompt chunks in "
                         "the rest (default 512)")
    pi.add_argument("-o", "--output")
    pi.set_defaults(fn=cmd_plan_inference)
    sv = sub.add_parser("serve", help="an OpenAI-compatible completions server of a model (loopback by default)")
    _inference_args(sv)
    sv.add_argument("--plan", help="an inference plan file (autopar plan-inference -o); default: plan here")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=positive_int("--port"), default=8000)
    sv.add_argument("--batch-wait-ms", type=float, default=None,
                    help=f"static batching: how long a request waits for others to share its batch (default "
                         f"{BATCH_WAIT_MS:g}; an error under continuous or chunked batching, where requests join at "
                         f"the next iteration)")
    sv.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                    help=f"several ranks: the longest a rank waits in a collective (the process group's "
                         f"timeout, default {DEFAULT_TIMEOUT_S:g}; set it above the slowest step or batch); a rank "
                         f"that fails mid-forward then fails its peers instead of hanging them, and the server "
                         f"answers 503 and stops")
    sv.add_argument("--backend", choices=("modules", "codegen"), default="modules",
                    help="what runs the generation: modules (the model's own modules, sliced; the default) or "
                         "codegen (autopar's own generated per-rank programs: tp, pp and dp, fp32 / bf16 / fp16, "
                         "greedy or sampled, static, continuous or chunked batching; docs/inference.md)")
    sv.set_defaults(fn=cmd_serve)
