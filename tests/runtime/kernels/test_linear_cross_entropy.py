"""Fused linear + cross-entropy against F.cross_entropy(hidden @ weight.T, targets): loss and both
gradients, fp32 and bf16, mean and sum, ignored targets, several chunks (the last one short),
vocabulary blocks, a non-contiguous hidden, and the vocabulary-parallel form on 2 gloo ranks.

Tolerances: fp32 rel 1e-5 of the largest reference value; bf16 inputs are compared with the
fp32 reference on the same (bf16) values, rel 2e-2 for the loss and the gradients (the kernel
stores the logits' gradient in bf16; the interpreter rounds fp32 -> bf16 by truncation)."""
from __future__ import annotations

import pytest
import torch

import runtime.kernels.linear_cross_entropy as lce_mod
from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _close(a, b, rel, what):
    a, b = a.float(), b.float()
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= rel * scale + 1e-7, f"{what}: max abs diff {err} > {rel} * {scale}"


def _data(device, dtype, n=100, d=67, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).to(device, dtype)
    weight = (0.2 * torch.randn(v, d, generator=g)).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = -100
    return hidden, weight, targets.to(device)


def _check(hidden, weight, targets, reduction="mean", chunk_rows=32, grad_scale=2.5, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, reduction=reduction, chunk_rows=chunk_rows, **kw)
    (loss * grad_scale).backward()
    hr = hidden.detach().float().requires_grad_()
    wr = weight.detach().float().requires_grad_()
    ref = linear_cross_entropy_reference(hr, wr, targets, reduction=reduction)
    (ref * grad_scale).backward()
    rel = REL[hidden.dtype]
    assert loss.dtype == hidden.dtype and loss.dim() == 0
    _close(loss, ref, rel, "loss")
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    _close(h.grad, hr.grad, rel, "grad_hidden")
    _close(w.grad, wr.grad, rel, "grad_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_matches_reference(device, dtype, reduction):
    hidden, weight, targets = _data(device, dtype)
    reset_kernel_stats()
    _check(hidden, weight, targets, reduction=reduction, chunk_rows=32)
    assert kernel_stats()["linear_cross_entropy"] == 2 * 4   # 4 chunks (32, 32, 32, 4 rows), 2 kernels each


def test_linear_cross_entropy_several_vocabulary_blocks(device, monkeypatch):
    monkeypatch.setattr(lce_mod, "MAX_BLOCK_V", 128)   # 300 columns: blocks of 128, 128, 44
    hidden, weight, targets = _data(device, torch.float32, n=40)
    _check(hidden, weight, targets, chunk_rows=None)


def test_linear_cross_entropy_non_contiguous_hidden(device):
    hidden, weight, targets = _data(device, torch.float32)
    strided = hidden.t().contiguous().t()   # same values, column-major
    assert not strided.is_contiguous()
    _check(strided, weight, targets, chunk_rows=64)


def test_linear_cross_entropy_without_gradients_runs_one_kernel_per_chunk(device):
    hidden, weight, targets = _data(device, torch.float32)
    reset_kernel_stats()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, chunk_rows=50)
    _close(loss, linear_cross_entropy_reference(hidden, weight, targets), 1e-5, "loss")
    assert kernel_stats()["linear_cross_entropy"] == 2


def test_linear_cross_entropy_rejects_reduction_none(device):
    hidden, weight, targets = _data(device, torch.float32, n=8)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, targets, reduction="none")


def _vocab_parallel_rank(rank, world, hidden, weight, targets):
    torch.set_num_threads(1)
    import torch.distributed as dist
    v = weight.shape[0]
    bounds = [0, 130, v]   # uneven slices: vocab_start comes from the all-gather of the sizes
    w = weight[bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, chunk_rows=32, process_group=dist.group.WORLD)
    (loss * 2.5).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="forked CPU ranks under the interpreter; with CUDA the "
                    "kernels are compiled for CUDA tensors and a CUDA parent cannot fork")
def test_linear_cross_entropy_vocabulary_parallel_two_ranks():
    from runtime.launch import run_local
    hidden, weight, targets = _data("cpu", torch.float32)
    results = run_local(_vocab_parallel_rank, 2, args=(hidden, weight, targets), timeout=240)
    hr = hidden.clone().requires_grad_()
    wr = weight.clone().requires_grad_()
    ref = linear_cross_entropy_reference(hr, wr, targets)
    (ref * 2.5).backward()
    for rank in (0, 1):
        loss, gh, gw = results[rank]
        _close(loss, ref, 1e-5, f"rank {rank} loss")
        _close(gh, hr.grad, 1e-5, f"rank {rank} grad_hidden")
    _close(torch.cat([results[0][2], results[1][2]]), wr.grad, 1e-5, "grad_weight slices")
