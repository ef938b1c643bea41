"""runtime/special.py's algorithms on one process: each "rank" of a vocabulary split is emulated
by patching the block lookup, and the partial sums over the blocks must equal the unsplit op."""
from __future__ import annotations

import pytest
import torch

from runtime import special as SP


@pytest.mark.parametrize("padding_idx", [-1, 0, 5])
def test_vocab_parallel_embedding_matches_aten_embedding(monkeypatch, padding_idx):
    """padding_idx keeps aten.embedding's meaning: the padding row is READ in forward (it is
    nonzero once a tied decoder updated it: BERT's / RoBERTa's pad row) and gets no gradient.
    Zeroing the output instead drifted every parameter of a BERT trained with a vocab-split
    embedding (the tied decoder and the head's transform first)."""
    torch.manual_seed(0)
    vocab, hidden, blocks = 8, 4, 2
    weight = torch.randn(vocab, hidden)            # the padding row is nonzero on purpose
    idx = torch.tensor([[0, 5, 3, 0], [7, 5, 1, 2]])
    w = weight.clone().requires_grad_(True)
    want = torch.ops.aten.embedding(w, idx, padding_idx)
    upstream = torch.randn_like(want)
    (want * upstream).sum().backward()

    total, grads = 0, []
    v_local = vocab // blocks
    for b in range(blocks):
        monkeypatch.setattr(SP, "_block", lambda axes, b=b: (b, blocks))
        wb = weight[b * v_local:(b + 1) * v_local].clone().requires_grad_(True)
        out = SP.vocab_parallel_embedding(wb, idx, padding_idx, axes=(1,))
        (out * upstream).sum().backward()
        total = total + out.detach()
        grads.append(wb.grad)
    torch.testing.assert_close(total, want.detach())
    torch.testing.assert_close(torch.cat(grads), w.grad)
