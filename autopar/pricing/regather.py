"""Which edges run ``runtime.regather.linear_keeping_shard``: a linear (its weight trained) reading
its input through one all-gather saves the shard and gathers it again in backward (Korthikanti
et al. 2022, section 4.2.2; runtime/regather.py says why). The three places that must agree use
this module: the edge prices (autopar/pricing/edge_price.py: one more all-gather in backward,
none when a checkpointed block recomputes its forward), the saved storages
(autopar/pricing/saved_copies.py: the shard, not the gathered copy) and the emission
(codegen/per_rank.py)."""
from __future__ import annotations

from autopar.rules.layout import Layout, memory_order


def keeps_shard(rule: str, i: int, weight_trained: bool, val) -> bool:
    """Whether a consumer op of spec ``rule`` reading its input ``i`` (traced value ``val``) through
    a single all-gather runs as a linear keeping the shard: input 0 of a linear whose weight gets
    a gradient (only then does the linear save its input), laid out in its dims' order (a
    permuted value is resharded between two permutes, codegen/reshard_calls.py, and left plain)."""
    return rule == "linear" and i == 0 and weight_trained and memory_order(val) is None


def single_gather(src: Layout, dst: Layout) -> bool:
    """Whether ``dst`` is ``src`` with the innermost mesh axis of one dim gathered: the reshard is
    one all_gather (autopar/pricing/reshard.py's only path for it)."""
    if src.partial != dst.partial or src.ndim != dst.ndim:
        return False
    diff = [(s, d) for s, d in zip(src.dims, dst.dims) if s != d]
    return len(diff) == 1 and len(diff[0][0]) >= 1 and diff[0][1] == diff[0][0][:-1]


def consumer_keeps_shard(c, info, i: int) -> bool:
    """``keeps_shard`` for consumer ``info`` (a Candidates node) reading its input ``i``: its spec's
    rule, whether its weight (input 1) is trained, the input's traced value."""
    ins = c.inputs(info.node)
    return keeps_shard(info.spec.rule if info.spec is not None else "", i,
                       len(ins) > 1 and ins[1].name in c.needs_grad, ins[i].meta.get("val") if i < len(ins) else None)

