"""The runtime on one CUDA device (NCCL, world size 1): a compiled Llama-style model trains equal
to the same model trained eagerly on that GPU. Marked ``gpu``: skipped without CUDA; run by
scripts/gpu-check.sh."""
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def nccl_group():
    """One rank, created as autopar.compile creates it under torchrun (cpu:gloo,cuda:nccl)."""
    import autopar
    from autopar.execution.placement import require_process_group
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29531")):
        os.environ.setdefault(k, v)
    require_process_group(autopar.Cluster.preset("dgx-h100", devices=1))
    yield


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_llama_equals_eager_on_cuda(nccl_group, precision):
    import copy

    import autopar
    from autopar.models import llama

    model, batch = llama.llama(n_layer=2, d_model=128, n_head=4, n_kv_heads=2, ffn_hidden=352,
                               vocab=512, seq=64, batch=4)
    ref = copy.deepcopy(model).cuda()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    cluster = autopar.Cluster.preset("dgx-h100", devices=1)
    compiled = autopar.compile(model, cluster, batch, optimizer="sgd", lr=0.05, momentum=0.9,
                               precision=precision)
    assert compiled.device.type == "cuda"
    gb = tuple(t.cuda() for t in batch)
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16, enabled=precision == "bf16"):
            want = ref(*gb).float()
        want.backward()
        opt.step()
        opt.zero_grad()
        got = compiled.step(*gb)
        tol = 1e-4 if precision == "fp32" else 3e-2
        want = want.detach()
        assert abs(got - float(want)) <= tol * max(1.0, abs(float(want))), (got, float(want))
    full = compiled.full_state_dict()
    for name, p in ref.named_parameters():
        tol = 1e-4 if precision == "fp32" else 3e-2
        torch.testing.assert_close(full[name].float().cpu(), p.detach().float().cpu(), atol=tol, rtol=tol)
