"""Self-attention on head-split activations (2D, 2.5D and 3D tensor parallelism): no
communication at all, once two layouts line up.

* Tokens: each rank's row block of the [batch*seq, ...] activation must hold whole sequences
  (its block of the batch): the token split is then a batch split, and attention stays inside a
  rank's rows. ``check_sequences`` says so clearly when it does not hold.
* Heads: the QKV projection's output is split into column blocks (q blocks over the grid's row
  group in 2D/2.5D, over the output axis in 3D). With the usual [Q | K | V] column order a block
  would hold Q of some heads and not their K and V, so the QKV weight and bias are stored with
  their columns in ``qkv_column_order``: block j holds Q, K and V of heads j*nh/q .. (j+1)*nh/q - 1.
  The attention output then has heads - hence its columns - in the usual order, and the output
  projection's weight needs no permutation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.grid import check_divisible


def qkv_column_order(hidden: int, n_heads: int, blocks: int) -> list[int]:
    """Column permutation of a [hidden, 3*hidden] QKV weight (and of its bias) so that each of
    ``blocks`` contiguous column blocks holds the Q, K and V columns of its own heads."""
    check_divisible("attention heads", n_heads, blocks, "heads per column block of the grid")
    check_divisible("hidden", hidden, n_heads, "head dim = hidden / heads")
    hd, per = hidden // n_heads, n_heads // blocks
    order: list[int] = []
    for j in range(blocks):
        for part in range(3):                      # Q, K, V
            for h in range(j * per, (j + 1) * per):
                base = part * hidden + h * hd
                order.extend(range(base, base + hd))
    return order


def check_sequences(tokens_local: int, seq_len: int) -> None:
    if tokens_local % seq_len:
        raise ValueError(f"attention on a grid needs whole sequences per rank: {tokens_local} local tokens "
                         f"are not a multiple of the sequence length {seq_len}; the batch must divide by the "
                         "grid's token split (q in 2D, d*q in 2.5D, q*q in 3D)")


def local_attention(qkv: torch.Tensor, seq_len: int, head_dim: int, causal: bool = True) -> torch.Tensor:
    """Attention of my sequences and heads: ``qkv`` [my tokens, 3 * my hidden] in
    ``qkv_column_order`` layout; returns [my tokens, my hidden] (heads in the usual order)."""
    t, c = qkv.shape[-2], qkv.shape[-1]
    check_sequences(t, seq_len)
    h_local = c // 3
    x = qkv.reshape(t // seq_len, seq_len, 3, h_local // head_dim, head_dim).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=causal)   # [b, heads, s, hd]
    return out.transpose(1, 2).reshape(t, h_local)
