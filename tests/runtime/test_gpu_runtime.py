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
    import socket
    with socket.socket() as s:   # a free port: another process of the GPU check may hold one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


def test_triton_kernels_train_equal_to_torch_ops_on_cuda(nccl_group):
    """The fused kernels compiled for the GPU (not the interpreter) train like torch ops."""
    import autopar
    import runtime.kernels as K
    from autopar.models import llama

    cluster = autopar.Cluster.preset("dgx-h100", devices=1)
    runs = {}
    for kernels in ("torch", "triton"):
        model, batch = llama.llama(n_layer=2, d_model=128, n_head=4, n_kv_heads=2, ffn_hidden=352,
                                   vocab=512, seq=64, batch=4)
        compiled = autopar.compile(model, cluster, batch, optimizer="sgd", lr=0.05, momentum=0.9,
                                   precision="fp32", kernels=kernels)
        K.reset_kernel_stats()
        gb = tuple(t.cuda() for t in batch)
        runs[kernels] = ([compiled.step(*gb) for _ in range(3)], compiled.kernel_stats(), compiled.plan.kernels)
    assert runs["triton"][2] == "triton" and runs["torch"][2] == "torch"
    assert runs["triton"][1]["rms_norm"] > 0 and runs["triton"][1]["swiglu"] > 0
    assert runs["torch"][1]["rms_norm"] == 0
    for a, b in zip(runs["triton"][0], runs["torch"][0]):
        assert abs(a - b) < 1e-3 * max(1.0, abs(b)), (runs["triton"][0], runs["torch"][0])
