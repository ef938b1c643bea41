"""The model zoo: plain-PyTorch models (``ZOO``) and Hugging Face ones built from configs
(``HF_ZOO``), plus ``load_factory`` which resolves a CLI model spec, and ``from_hf_config`` (any
Hugging Face config.json, directory, config object or cached model name: autopar/models/hf_config.py).

Every factory is ``name(**kwargs) -> (model, example_inputs)``; ``model(*example_inputs)``
returns the scalar training loss. Common kwargs: ``batch``, ``seq``, sizes, ``dropout``
(default 0.0), ``device="cpu"|"meta"`` and ``seed`` (same seed -> identical weights).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

from autopar.errors import PlanError
from autopar.models import bert, gpt2, hf, llama, mlp, vit
from autopar.models.hf_config import from_hf_config  # noqa: F401  (public: any HF config.json)
from autopar.models.common import build, example_tokens  # noqa: F401  (public: the model files' helpers)

Factory = Callable[..., tuple]

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


def is_hf_spec(spec: str) -> bool:
    """Whether the CLI reads ``spec`` as a Hugging Face config (``from_hf_config``) rather than a
    factory: not a zoo name, and a path ending in .json, a directory, or a name without ':'
    (a model name in the local Hugging Face cache, e.g. ``meta-llama/Meta-Llama-3-8B``)."""
    if spec in ZOO or spec in HF_ZOO or spec.endswith(".py"):   # model.py: a factory spec missing ':FACTORY'
        return False
    return spec.endswith(".json") or os.path.isdir(spec) or ":" not in spec


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
