"""Is an SDPA's explicit ``attn_mask`` the causal mask? (ring / Ulysses attention under
Hugging Face models, which build the mask themselves and pass it instead of ``is_causal=True``.)

``mask_is_causal(sdpa_node)`` answers from the traced graph alone, so the answer holds for every
step, not just the example batch:

1. The mask must be a CONSTANT of the graph: none of its ancestors is a placeholder (user input,
   parameter or buffer) and none draws random numbers. Hugging Face Llama's mask is such a value:
   with no ``attention_mask`` given it is built from ``arange`` position ids (``kv_pos <= q_pos``,
   the packed-sequence test ``cumsum(diff(pos) != 1)`` equal on both sides, and'ed with a ``True``
   padding term). The graph is specialised to the traced shapes (``step`` refuses other shapes,
   autopar/execution/batch_check.py), so such a mask is the same tensor on every call.
2. Its value is computed once at plan time by running those ancestor nodes on the CPU (the
   traced graph may live on meta: ``device=`` arguments are rewritten), each intermediate at
   most ``MAX_ELEMENTS`` elements.
3. The value must broadcast over (batch, heads) to the lower-triangular pattern on the (query,
   key) dims with query length = key length: a bool mask True exactly on and below the diagonal,
   or an additive float mask 0 there and ``-inf`` (or at most half the dtype's lowest value, as
   Hugging Face's ``finfo.min`` masks are) above it. Adding such a value to a finite score makes
   its softmax weight exactly 0, as ``is_causal=True`` does.

A mask that depends on a user input (a padding ``attention_mask``) is NOT treated as causal, even
when the example batch's is: the planner sees the traced graph, not the example's values (the
trace may be on meta), and nothing in the per-rank program would stop a later batch with padding
from being attended to wrongly. Such attention keeps the priced all-gathered-K/V fallback
(autopar/rules/sequence.py) and the warning says why.
"""
from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

MAX_ELEMENTS = 1 << 26          # largest intermediate evaluated at plan time (64 Mi elements)
_KEY = "autopar_causal_mask"    # node.meta cache: (bool, reason)


def mask_is_causal(sdpa_node) -> tuple[bool, str]:
    """(True, "") when the SDPA node's ``attn_mask`` is provably the causal mask, else (False,
    why not). Cached on the mask node (every layer's SDPA shares one mask)."""
    mask = _arg(sdpa_node, 3, "attn_mask")
    if not isinstance(mask, torch.fx.Node):
        return False, "no attn_mask node"
    q, k = sdpa_node.args[:2]
    s, t = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
    cache = mask.meta.setdefault(_KEY, {})
    if (s, t) not in cache:
        cache[(s, t)] = _decide(mask, s, t)
    return cache[(s, t)]


def _arg(node, i, name, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _decide(mask, s: int, t: int) -> tuple[bool, str]:
    if s != t:
        return False, f"query length {s} != key length {t}"
    value, why = constant_value(mask)
    if value is None:
        return False, why
    return is_causal_value(value, s, t)


def _random(n) -> bool:
    tags = getattr(n.target, "tags", ()) or ()
    return torch.Tag.nondeterministic_seeded in tags


def constant_value(node) -> tuple[torch.Tensor | None, str]:
    """The value of ``node`` computed from its ancestors when they are all constant ops, else
    (None, the reason)."""
    need, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        if n.op == "placeholder":
            return None, (f"the mask depends on the graph input {n.name!r} (a user input, parameter or buffer), so "
                          f"its value can change between steps")
        if n.op != "call_function":
            return None, f"the mask is computed by {n.op} {n.target} (not a plain op)"
        if _random(n):
            return None, f"the mask depends on the random op {n.name}"
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.numel() > MAX_ELEMENTS:
            return None, f"the mask's ancestor {n.name} has {v.numel()} elements, too many to evaluate at plan time"
        stack.extend(a for a in n.all_input_nodes)
    env: dict = {}

    def cpu(x):
        return torch.device("cpu") if isinstance(x, torch.device) else x

    for n in node.graph.nodes:        # topological order
        if n not in need:
            continue
        args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: env[a], (n.args, n.kwargs))
        kwargs = {k: cpu(v) for k, v in kwargs.items()}
        args = tuple(cpu(a) for a in args)
        try:
            env[n] = n.target(*args, **kwargs)
        except Exception as e:   # an op that cannot run on the CPU at plan time: not provable
            return None, f"evaluating the mask's ancestor {n.name} failed ({type(e).__name__}: {e})"
    out = env[node]
    if not isinstance(out, torch.Tensor):
        return None, "the mask is not a tensor"
    return out, ""


def is_causal_value(m: torch.Tensor, s: int, t: int) -> tuple[bool, str]:
    """Whether mask value ``m`` (broadcastable to (..., s, t)) is the causal mask."""
    if s != t or m.dim() < 2 or tuple(m.shape[-2:]) != (s, t):
        return False, f"the mask's last two dims {tuple(m.shape[-2:])} are not ({s}, {t})"
    tril = torch.ones(s, t, dtype=torch.bool).tril()
    if m.dtype == torch.bool:
        ok = bool((m == tril).all())
    elif m.is_floating_point():
        low = torch.finfo(m.dtype).min / 2
        visible = m == 0
        blocked = (m == -math.inf) | (m <= low)
        ok = bool((visible == tril).all()) and bool((blocked == ~tril).all())
    else:
        return False, f"the mask's dtype {m.dtype} is neither bool nor floating"
    return (True, "") if ok else (False, "the mask's values are not the causal pattern (e.g. padding, a sliding "
                                         "window or a general mask)")
