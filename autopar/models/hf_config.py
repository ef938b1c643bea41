"""Any Hugging Face model from its ``config.json`` (no weights, nothing downloaded), built on the
meta device and wrapped so ``forward`` returns the training loss: what ``autopar plan CONFIG`` and
``autopar.models.from_hf_config`` plan.

``config`` is a path to a ``config.json``, a model directory holding one, a
``transformers.PretrainedConfig``, or a model name already in the local Hugging Face cache (read
with ``local_files_only=True``; never downloaded). The task (which ``AutoModelFor...`` class) comes
from ``config.architectures`` unless given: "causal-lm" (the default), "masked-lm", "seq2seq" or
"image-classification". The result unpacks as ``model, example_inputs`` (the zoo factories'
contract, autopar/models/__init__.py) and also carries ``config``, ``task``, ``dtype`` and
``precision`` (the plan precision the dtype maps to: bfloat16/float16 -> "bf16", float32 -> "fp32").
``transformers`` is imported only when this is called.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import torch

from autopar.errors import PlanError
from autopar.models.common import build, example_tokens
from autopar.models.hf import ImageLossWrapper, LossWrapper

# task -> the transformers auto class that builds it
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}
# the suffix of an architecture name (config.architectures) -> the task it trains
ARCHITECTURE_SUFFIXES = (
    ("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
    ("ForConditionalGeneration", "seq2seq"), ("ForImageClassification", "image-classification"),
)
# dtype names accepted by ``dtype=`` / ``--dtype`` -> (torch dtype, plan precision)
DTYPES = {
    "bf16": (torch.bfloat16, "bf16"), "bfloat16": (torch.bfloat16, "bf16"),
    "fp16": (torch.float16, "bf16"), "float16": (torch.float16, "bf16"), "half": (torch.float16, "bf16"),
    "fp32": (torch.float32, "fp32"), "float32": (torch.float32, "fp32"), "float": (torch.float32, "fp32"),
}
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


class HFModel(tuple):
    """``(model, example_inputs)`` plus what the config said: ``config``, ``task``, ``dtype``
    (a torch dtype) and ``precision`` ("bf16" or "fp32", for autopar.plan)."""

    def __new__(cls, model, inputs, *, config, task, dtype, precision):
        self = super().__new__(cls, (model, inputs))
        self.config, self.task, self.dtype, self.precision = config, task, dtype, precision
        return self

    @property
    def model(self):
        return self[0]

    @property
    def inputs(self):
        return self[1]


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise PlanError("planning a Hugging Face config needs transformers: `pip install transformers` "
                        "(or `pip install autopar[hf]`)") from e
    return transformers


def _known_types(tf) -> list[str]:
    return sorted(tf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)


def _from_dict(data: dict, source: str):
    tf = _transformers()
    if not isinstance(data, dict):
        raise PlanError(f"{source} is not a Hugging Face config: it holds a JSON {type(data).__name__}, "
                        f"not an object with a model_type")
    model_type = data.get("model_type")
    if not model_type:
        raise PlanError(f"{source} has no \"model_type\": a Hugging Face config.json names its model_type "
                        f"(e.g. \"llama\", \"mistral\", \"qwen2\")")
    mapping = tf.models.auto.configuration_auto.CONFIG_MAPPING
    if model_type not in mapping:
        known = _known_types(tf)
        near = [k for k in known if k.startswith(model_type[:3])][:8] or ["llama", "mistral", "qwen2", "gemma2"]
        raise PlanError(f"{source}: model_type {model_type!r} is unknown to transformers {tf.__version__} "
                        f"({len(known)} known, e.g. {', '.join(near)}); a model with remote code (auto_map) "
                        f"is not run: upgrade transformers or use a model_type it knows")
    try:
        return mapping[model_type].from_dict(data)
    except Exception as e:
        raise PlanError(f"{source}: transformers cannot read this {model_type} config: {type(e).__name__}: {e}") from e


def load_config(config):
    """A ``transformers.PretrainedConfig`` from a config.json path, a directory holding one, a
    config object, or a model name in the local Hugging Face cache (never downloaded)."""
    tf = _transformers()
    if isinstance(config, tf.PretrainedConfig):
        return config
    if isinstance(config, dict):
        return _from_dict(config, "the config dict")
    if not isinstance(config, (str, os.PathLike)):
        raise PlanError(f"config must be a path to config.json, a model directory, a model name or a "
                        f"transformers.PretrainedConfig, got {type(config).__name__}")
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlanError(f"the directory {config} has no config.json: give the path of a Hugging Face "
                            f"model directory (save_pretrained) or of its config.json")
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read {path} as JSON: {e}") from e
        return _from_dict(data, str(path))
    text = str(config)
    if text.endswith(".json") or text.startswith((".", "/", "~")):
        raise PlanError(f"config file {text} does not exist")
    return _cached(text, tf)


def _cached(name: str, tf):
    """``name`` from the local Hugging Face cache only."""
    try:
        return tf.AutoConfig.from_pretrained(name, local_files_only=True)
    except ValueError as e:   # a cached config whose model_type transformers does not know
        raise PlanError(f"the cached config of {name!r}: {e}".split("\n")[0]) from e
    except OSError as e:
        hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        raise PlanError(f"{name!r} is neither a config file, a model directory nor a model in the local Hugging "
                        f"Face cache ({hub}); autopar never downloads: fetch its config first "
                        f"(`hf download {name} config.json`) or pass the path of a config.json") from e


def default_task(config) -> str:
    """The task ``config.architectures`` names; without one, "seq2seq" for an encoder-decoder, else
    the first of causal-lm, masked-lm, image-classification that transformers has for the config."""
    for arch in getattr(config, "architectures", None) or ():
        for suffix, task in ARCHITECTURE_SUFFIXES:
            if arch.endswith(suffix):
                if task == "seq2seq" and not getattr(config, "is_encoder_decoder", False):
                    continue   # e.g. a vision-language "...ForConditionalGeneration": not an encoder-decoder LM
                return task
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    ok = supported_tasks(config)
    return next((t for t in ("causal-lm", "masked-lm", "image-classification") if t in ok), "causal-lm")


def supported_tasks(config) -> list[str]:
    tf = _transformers()
    return [t for t, cls in TASKS.items() if type(config) in getattr(tf, cls)._model_mapping]


def resolve_dtype(config, dtype=None) -> tuple[torch.dtype, str]:
    """(torch dtype, plan precision) from ``dtype`` or else the config's ``dtype`` /
    ``torch_dtype`` (bfloat16 when it says nothing)."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise PlanError(f"dtype {dtype!r} is not supported for planning: use one of "
                        f"{', '.join(sorted(DTYPES))} (16-bit types plan as bf16 mixed precision)")
    return DTYPES[key]


def from_hf_config(config, *, seq: int | None = None, batch: int, task: str | None = None,
                   dtype=None, attn: str | None = None, overrides: dict | None = None, seed: int = 0,
                   device: str = "meta") -> HFModel:
    """Build the model ``config`` describes (meta device, no weights) for ``task``, wrapped so
    ``model(*example_inputs)`` is the loss, with example inputs of shape ``[batch, seq]`` (token
    ids and labels; for "image-classification" pixel values of the config's image size and one
    label per image, and no ``seq``). ``attn``: transformers' attention implementation ("sdpa",
    or "eager" for models that soft-cap attention logits, e.g. Gemma 2). ``overrides``: config
    fields to change first (e.g. ``{"num_hidden_layers": 2}``); a field the config lacks is an error."""
    tf = _transformers()
    cfg = copy.deepcopy(load_config(config))   # the caller's config object is left as it was
    if overrides:
        for k, v in overrides.items():
            if not hasattr(cfg, k):
                raise PlanError(f"the {cfg.model_type} config has no field {k!r} to override")
            setattr(cfg, k, v)
    if task is None:
        task = default_task(cfg)
    if task not in TASKS:
        raise PlanError(f"task {task!r} is not one of {', '.join(TASKS)}")
    ok = supported_tasks(cfg)
    if task not in ok:
        raise PlanError(f"task {task!r} is not supported by a {cfg.model_type} config (transformers has no "
                        f"{TASKS[task].removeprefix('AutoModelFor')} model for it); "
                        + (f"it supports: {', '.join(ok)}" if ok else
                           f"it supports none of {', '.join(TASKS)}"))
    for what, v in (("batch", batch), ("seq", seq)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise PlanError(f"{what} must be a positive whole number, got {v!r}")
    image = task == "image-classification"
    if image and seq is not None:
        raise PlanError(f"an image-classification model takes no seq (got seq={seq}): its input size is the "
                        f"config's image_size ({getattr(cfg, 'image_size', '?')})")
    if not image and seq is None:
        raise PlanError(f"a {task} model needs seq (the sequence length of a training sample)")
    torch_dtype, precision = resolve_dtype(cfg, dtype)
    limit = getattr(cfg, "max_position_embeddings", None)
    if seq is not None and isinstance(limit, int) and seq > limit:
        warnings.warn(f"seq {seq} exceeds the config's max_position_embeddings {limit}", stacklevel=2)
    if attn is None:
        attn = "eager" if getattr(cfg, "attn_logit_softcapping", None) else "sdpa"
    cfg._attn_implementation = attn
    if any(getattr(cfg, k, None) for k in MOE_KEYS):
        from runtime.moe import register_transformers
        register_transformers()
        cfg._experts_implementation = "autopar"   # one op, static output shape (runtime/moe.py)
    auto = getattr(tf, TASKS[task])
    wrapper = ImageLossWrapper if image else LossWrapper

    def make():
        try:
            return wrapper(auto.from_config(cfg, dtype=torch.float32))
        except Exception as e:
            raise PlanError(f"transformers could not build {type(cfg).__name__} as {TASKS[task]}: "
                            f"{type(e).__name__}: {e}") from e

    model = build(make, device, seed)
    if image:
        if getattr(cfg, "problem_type", None) is None:
            cfg.problem_type = "single_label_classification"
        size, channels = cfg.image_size, getattr(cfg, "num_channels", 3)
        inputs = (torch.empty(batch, channels, size, size, device="meta"),
                  torch.empty(batch, dtype=torch.long, device="meta"))
        if device != "meta":
            g = torch.Generator().manual_seed(seed + 1)
            inputs = (torch.randn(batch, channels, size, size, generator=g),
                      torch.randint(cfg.num_labels, (batch,), generator=g))
    else:
        inputs = example_tokens(batch, seq, cfg.vocab_size, device, seed, n=2)
    return HFModel(model, inputs, config=cfg, task=task, dtype=torch_dtype, precision=precision)
