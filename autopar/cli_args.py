"""What the `autopar` commands share: parsing of name=value pairs, sizes, times and whole numbers;
the cluster from --cluster / --nodes / --devices; and the model a command names (a factory, a zoo
name or a Hugging Face config, with --seq / --batch / --task / --dtype / --arg).
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

from autopar.errors import PlanError


def parse_pairs(pairs: list[str], flag: str = "--arg") -> dict:
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


def positive_int(what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{what} must be at least 1, got {v}")
        return v
    return parse


def byte_size(text: str) -> float:
    from autopar.units import parse_bytes
    try:
        return parse_bytes(text, "--memory-budget")
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seconds(text: str) -> float:
    from autopar.units import parse_seconds
    try:
        return parse_seconds(text, "--time-limit")
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cluster_from_args(args):
    from autopar.cluster import Cluster
    spec = args.cluster
    if Path(spec).suffix in (".yaml", ".yml") or Path(spec).exists():
        return Cluster.from_yaml(spec)
    kw = {"nodes": args.nodes}
    if args.devices:
        kw["devices"] = args.devices
    return Cluster.preset(spec, **kw)


def load_hf(args, quiet: bool = False):
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
                         overrides=parse_pairs(args.arg))
    cfg = out.config
    n = sum(p.numel() for p in out.model.parameters())
    arch = type(out.model.model).__name__
    shape = f"seq {args.seq}, " if args.seq else ""
    if not quiet:
        print(f"{spec}: {arch} ({cfg.model_type}, {out.task}), {n / 1e9:.2f} B parameters, {shape}global batch "
              f"{args.batch}, {str(out.dtype).removeprefix('torch.')} -> precision {out.precision}")
    return out.model, out.inputs, out.precision


def load_factory_model(spec: str, pairs, extra: dict | None = None):
    """(model, inputs) of a factory spec; ``extra`` are keyword arguments from flags (--seq, --batch)."""
    import inspect

    from autopar.models import load_factory
    factory = load_factory(spec)
    kwargs = parse_pairs(pairs)
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


def factory_shape(args, command: str) -> dict:
    """--seq / --batch for a factory (its seq and batch arguments); --task and --dtype are for
    Hugging Face configs only, an error with a factory."""
    for flag in ("task", "dtype"):
        if getattr(args, flag) is not None:
            raise PlanError(f"{command}: --{flag} is for Hugging Face configs; {args.factory} is a model factory")
    return {k: v for k, v in (("seq", args.seq), ("batch", args.batch)) if v is not None}


def model_shape_args(p) -> None:
    """--seq, --batch, --task and --dtype: what a Hugging Face config needs to become a model
    (``load_hf``), on every command that builds one (plan, show --code, ops)."""
    p.add_argument("--seq", type=positive_int("--seq"), default=None,
                   help="sequence length (Hugging Face configs; a factory's seq argument)")
    p.add_argument("--batch", type=positive_int("--batch"), default=None,
                   help="global batch in samples (sequences) per step "
                        "(Hugging Face configs; a factory's batch argument)")
    p.add_argument("--task", choices=("causal-lm", "masked-lm", "seq2seq", "image-classification"), default=None,
                   help="Hugging Face configs: the model head (default: from the config's architectures)")
    p.add_argument("--dtype", default=None,
                   help="bf16/bfloat16, fp16/float16 (planned as bf16) or fp32/float32; default: the config's dtype")
