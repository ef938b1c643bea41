"""The fused SGD, LAMB and LARS steps (runtime/kernels/optimizer_steps.py) against runtime/optim.py's
torch ops on the same flat buffers, over three steps: odd sizes (not multiples of the block),
several tensors per buffer (segments), per-tensor decays and adaptation, clipped trust ratios.
Tolerance rel 1e-5 / abs 1e-6 (fp32; the kernels fuse the elementwise ops)."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.optimizer_steps import BLOCK
from runtime.optim import Segments, make_optimizer
from runtime.optim_groups import TensorHParams

SIZES = (1000, 37, 2049)


def _run(device, name, fused, hparams=None, **kw):
    torch.manual_seed(0)
    n = sum(SIZES)
    opt = make_optimizer(name, kw.pop("lr", 0.05), fused=fused, **kw)
    param = torch.randn(n, device=device)
    state = opt.init_state(n, device=device)
    segs = Segments.from_sizes(SIZES)
    reset_kernel_stats()
    for step in (1, 2, 3):
        grad = torch.randn(n, device=device)
        opt.step(param, grad, state, step, segments=segs, hparams=hparams)
    return param, state, kernel_stats()


CASES = [
    ("sgd", {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {}),
    ("lamb", {"lr": 1e-2, "weight_decay": 0.01}),
    ("lamb", {"lr": 1e-2, "weight_decay": 0.01, "trust_clip": True, "bias_correction": False}),
    ("lars", {"lr": 0.1, "weight_decay": 1e-4}),
    ("lars", {"lr": 0.1, "weight_decay": 1e-4, "trust_clip": True}),
]


@pytest.mark.parametrize("name, kw", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_fused_step_equals_the_torch_ops(device, name, kw):
    assert sum(SIZES) % BLOCK and SIZES[1] < BLOCK
    ref_p, ref_s, ref_stats = _run(device, name, False, **dict(kw))
    p, s, stats = _run(device, name, True, **dict(kw))
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-6)
    for k in ref_s:
        torch.testing.assert_close(s[k], ref_s[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert stats[name] > 0 and ref_stats[name] == 0   # the kernels ran; the reference did not


@pytest.mark.parametrize("name", ["sgd", "lamb", "lars"])
def test_per_tensor_settings_are_honoured(device, name):
    """Parameter groups: each tensor its decay, learning-rate factor and (LAMB/LARS) adaptation."""
    hp = TensorHParams.of([(0.1, 1.0, True), (0.0, 0.5, False), (0.01, 2.0, True)])
    kw = {"momentum": 0.9} if name == "sgd" else {}
    ref_p, _, _ = _run(device, name, False, hparams=hp, **dict(kw))
    p, _, stats = _run(device, name, True, hparams=hp, **dict(kw))
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-6)
    assert stats[name] > 0


def test_bad_tensors_are_clear_errors(device):
    from runtime.kernels.optimizer_steps import lars_step, sgd_step
    p = torch.zeros(8, device=device)
    with pytest.raises(ValueError, match="contiguous fp32"):
        sgd_step(p, torch.zeros(16, device=device)[::2], p.clone(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="contiguous fp32"):
        lars_step(p, p.bfloat16(), p.clone(), scale=0.1, momentum=0.9, weight_decay=0.0)
