"""The model zoo: plain-PyTorch models (``ZOO``) and Hugging Face ones built from configs
(``HF_ZOO``), plus ``load_factory`` which resolves a CLI model spec.

Every factory is ``name(**kwargs) -> (model, example_inputs)``; ``model(*example_inputs)``
returns the scalar training loss. Common kwargs: ``batch``, ``seq``, sizes, ``dropout``
(default 0.0), ``device="cpu"|"meta"`` and ``seed`` (same seed -> identical weights).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

import torch

from autopar.errors import PlanError

Factory = Callable[..., tuple]


# Shared helpers for the model files (defined before the model modules are imported below).
def build(ctor: Callable[[], torch.nn.Module], device: str, seed: int) -> torch.nn.Module:
    """Construct a model on ``device`` with a deterministic init. The global RNG state is
    restored afterwards so building a model does not perturb the caller's randomness."""
    if device not in ("cpu", "meta"):
        raise PlanError(f"device must be 'cpu' or 'meta', got {device!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            return ctor()


def example_tokens(batch: int, seq: int, vocab: int, device: str, seed: int, n: int = 2) -> tuple:
    """``n`` int64 token tensors of shape (batch, seq). On meta nothing is allocated; each
    tensor is a distinct object (torch.export dedups an input passed twice)."""
    if device == "meta":
        return tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(n))
    g = torch.Generator().manual_seed(seed + 1)
    return tuple(torch.randint(vocab, (batch, seq), generator=g) for _ in range(n))


from autopar.models import bert, gpt2, hf, llama, mlp, vit  # noqa: E402  (needs the helpers above)

ZOO: dict[str, Factory] = {
    "gpt2": gpt2.gpt2, "gpt2_small": gpt2.gpt2_small, "gpt2_medium": gpt2.gpt2_medium,
    "gpt2_large": gpt2.gpt2_large, "gpt2_xl": gpt2.gpt2_xl, "gpt3": gpt2.gpt3,
    "llama": llama.llama, "llama_7b": llama.llama_7b,
    "bert": bert.bert, "bert_large": bert.bert_large,
    "vit": vit.vit, "vit_large": vit.vit_large,
    "mlp": mlp.mlp,
}
HF_ZOO: dict[str, Factory] = {
    "hf_gpt2": hf.hf_gpt2, "hf_llama": hf.hf_llama, "hf_llama_eager": hf.hf_llama_eager, "hf_bert": hf.hf_bert,
    "hf_mistral": hf.hf_mistral, "hf_qwen2": hf.hf_qwen2, "hf_bloom": hf.hf_bloom, "hf_mixtral": hf.hf_mixtral,
    "hf_gpt_neox": hf.hf_gpt_neox, "hf_roberta": hf.hf_roberta, "hf_t5": hf.hf_t5, "hf_bart": hf.hf_bart,
    "hf_vit": hf.hf_vit, "hf_albert": hf.hf_albert, "hf_gemma2": hf.hf_gemma2,
}


def load_factory(spec: str) -> Factory:
    """Resolve ``spec``: a zoo name (``"gpt2_xl"``), ``"package.module:FACTORY"`` or
    ``"path/to/file.py:FACTORY"``. Raises PlanError with the zoo names when it cannot."""
    if spec in ZOO:
        return ZOO[spec]
    if spec in HF_ZOO:
        return HF_ZOO[spec]
    names = ", ".join(sorted(ZOO) + sorted(HF_ZOO))
    if ":" not in spec:
        raise PlanError(f"unknown model {spec!r}: use a zoo name ({names}) "
                        f"or 'package.module:FACTORY' or 'file.py:FACTORY'")
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise PlanError(f"model file {where!r} does not exist (spec {spec!r})")
        name = "autopar_user_model_" + os.path.splitext(os.path.basename(where))[0]
        module_spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise PlanError(f"cannot import module {where!r} of model spec {spec!r}: {e}. "
                            f"Zoo names: {names}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PlanError(f"{where!r} has no callable {attr!r} (spec {spec!r}); zoo names: {names}")
    return factory
