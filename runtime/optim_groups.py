"""Per-tensor optimizer hyperparameters: parameter groups and the BERT / FusedLAMB recipe.

A *group* gives a set of parameters their own ``weight_decay``, ``lr_scale`` (a factor on the
learning rate) and ``adapt`` (LAMB: apply the trust ratio ||w||/||u||; LARS: apply the layer
adaptation; ignored by AdamW, Adam and SGD). ``resolve_groups`` turns a group specification into
one ``TensorHParams`` entry per parameter, deciding from the parameter's FULL name and shape (a
tensor-parallel block or a flat ZeRO shard of a matrix is still a matrix), and ``chunk_hparams``
lays those entries out along a flat chunk's tensors (runtime/zero.py: one id per tensor, plus
the padding's).

Specifications (``compile(param_groups=...)``):

* ``"bert"``: the recipe of NVIDIA's BERT LAMB (apex FusedLAMB with its no-decay group) and of
  timm's ``param_groups_weight_decay``: parameters with at most one dimension (biases,
  normalisation weights) get no weight decay and no trust ratio; every other tensor gets the
  optimizer's weight decay and the trust ratio. The default for LAMB and LARS.
* ``"all"``: every tensor alike (the optimizer's weight decay, trust ratio everywhere). The
  default for AdamW, Adam and SGD, which then equal torch.optim's update exactly.
* a list of dicts ``{"params": regex | callable(name, shape) -> bool, "weight_decay": float,
  "lr_scale": float, "adapt": bool}`` (every key but ``params`` optional): a parameter takes the
  FIRST group whose regex matches its name (``re.search``) or whose callable returns true;
  unmatched parameters, and keys a group leaves out, take the optimizer's weight decay,
  ``lr_scale`` 1 and ``adapt`` True. (Put the recipe's group first to keep it:
  ``{"params": lambda name, shape: len(shape) <= 1, "weight_decay": 0.0, "adapt": False}``.)

``always_adapt`` (LAMB, LARS; timm's name) applies the trust ratio to every tensor, the excluded
ones too. timm and apex decide it by ``weight_decay != 0``; here a group says it with ``adapt``,
which the recipe sets exactly where it sets ``weight_decay`` to 0 (the same tensors whenever the
optimizer's weight decay is not 0; with weight decay 0 the matrices still adapt here, where apex
without ``use_nvlamb`` would run plain Adam on them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

GroupSpec = Union[str, Sequence[Mapping], None]
_KEYS = {"params", "weight_decay", "lr_scale", "adapt"}


@dataclass(frozen=True)
class TensorHParams:
    """One entry per logical tensor id of a buffer (runtime/optim.py Segments)."""

    weight_decay: tuple[float, ...]
    lr_scale: tuple[float, ...]
    adapt: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.weight_decay)

    def entry(self, i: int) -> "TensorHParams":
        return TensorHParams((self.weight_decay[i],), (self.lr_scale[i],), (self.adapt[i],))

    @staticmethod
    def of(entries: Sequence[tuple[float, float, bool]]) -> "TensorHParams":
        wd, sc, ad = zip(*entries) if entries else ((), (), ())
        return TensorHParams(tuple(map(float, wd)), tuple(map(float, sc)), tuple(map(bool, ad)))


def default_spec(optimizer: str) -> str:
    """The groups an optimizer gets when ``param_groups`` is not given (module doc)."""
    return "bert" if optimizer.lower() in ("lamb", "lars") else "all"


def _matcher(params) -> Callable[[str, tuple], bool]:
    if callable(params):
        return lambda name, shape: bool(params(name, shape))
    if isinstance(params, str):
        pattern = re.compile(params)
        return lambda name, shape: pattern.search(name) is not None
    raise ValueError(f"param_groups: 'params' must be a regex string or a callable(name, shape), "
                     f"got {type(params).__name__}")


def check_spec(spec: GroupSpec) -> None:
    """Raise ValueError on a malformed specification (before any rank sets anything up)."""
    if spec is None or spec in ("bert", "all"):
        return
    if isinstance(spec, str) or not isinstance(spec, (list, tuple)):
        raise ValueError(f"param_groups must be 'bert', 'all' or a list of dicts, got {spec!r}")
    for g in spec:
        if not isinstance(g, Mapping) or "params" not in g:
            raise ValueError(f"param_groups: every group is a dict with a 'params' key, got {g!r}")
        extra = set(g) - _KEYS
        if extra:
            raise ValueError(f"param_groups: unknown keys {sorted(extra)} (allowed: {sorted(_KEYS)})")
        _matcher(g["params"])


def resolve_groups(shapes: Mapping[str, Sequence[int]], spec: GroupSpec, weight_decay: float,
                   always_adapt: bool = False) -> dict[str, tuple[float, float, bool]]:
    """name -> (weight_decay, lr_scale, adapt) for every parameter, from its FULL shape."""
    check_spec(spec)
    wd = float(weight_decay)
    out = {}
    for name, shape in shapes.items():
        shape = tuple(int(s) for s in shape)
        entry = (wd, 1.0, True)
        if spec == "bert":
            if len(shape) <= 1:
                entry = (0.0, 1.0, False)
        elif spec not in (None, "all"):
            for g in spec:
                if _matcher(g["params"])(name, shape):
                    entry = (float(g.get("weight_decay", wd)), float(g.get("lr_scale", 1.0)),
                             bool(g.get("adapt", True)))
                    break
        if always_adapt:
            entry = (entry[0], entry[1], True)
        out[name] = entry
    return out


def is_uniform(entries: Mapping[str, tuple[float, float, bool]], weight_decay: float) -> bool:
    """Every tensor has the optimizer's own settings (no groups needed)."""
    return all(e == (float(weight_decay), 1.0, True) for e in entries.values())


def chunk_hparams(entries: Sequence[Optional[tuple[float, float, bool]]], default) -> TensorHParams:
    """The entries of a chunk's tensors in order, then the padding's (no decay, scale 1, no
    ratio: padding is zeros). ``None`` entries take ``default``."""
    rows = [e if e is not None else default for e in entries]
    return TensorHParams.of(rows + [(0.0, 1.0, False)])


__all__ = ["TensorHParams", "GroupSpec", "default_spec", "check_spec", "resolve_groups", "is_uniform",
           "chunk_hparams"]
