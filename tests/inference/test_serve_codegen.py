"""``autopar serve --backend codegen``: the server runs autopar's own generated programs (tp=2 on two
gloo ranks, or two data-parallel replicas): under continuous batching it answers the same greedy
tokens as ``--backend modules`` (tp=2) and Hugging Face's ``generate`` (dp=2), under static batching
Hugging Face's ``generate`` (``/metrics`` naming the backend that ran), under chunked batching (prompts
longer than the chunk prefilled in chunks) ``generate`` too; and
``runtime.context.setup(..., timeout=)`` gives its groups that timeout: a collective whose peer
never joins raises after it rather than waiting for the default group's."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import httpx
import pytest
import torch

from autopar.cli import main
from autopar.inference.serve_process import serve_process
from tests.helpers.serving import assert_served_like_generate
from runtime.launch import run_local

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


def _trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{0.2 * i},{2 + i % 6},{1 + i % 5}\n" for i in range(16)))
    return str(path)


def _plan(tmp_path, batching: str, tp: int = 2, dp: int = 1) -> str:
    out = tmp_path / f"{batching}.json"
    extra = (["--trace", _trace(tmp_path), "--batching", batching] if batching != "static"
             else ["--prompt-len", "8", "--batch", "2", "--max-new-tokens", "4"])
    if batching == "chunked":   # a chunk of 4 tokens: PROMPTS[1] takes two
        extra += ["--prefill-chunk", "4"]
    assert main(["plan-inference", "hf_llama", "--devices", "2", "--constraint", f"tp={tp}", "--constraint", f"dp={dp}",
                 "--constraint", "batch_size=2", *extra, "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert (plan["tp"], plan["pp"], plan["dp"]) == (tp, 1, dp) and plan["predictions"].get("batching", "static") \
        == batching
    return str(out)


def _served(plan: str, backend: str) -> list[list[int]]:
    with serve_process(["hf_llama", "--devices", "2", "--plan", plan, "--backend", backend]) as url:
        answers = [httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 3}, timeout=120)
                   for p in PROMPTS]
        metrics = httpx.get(f"{url}/metrics", timeout=10).json()
    assert metrics["backend"] == backend      # the premise: that engine answered
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.json()["choices"][0]["token_ids"] for a in answers]


@pytest.mark.slow
def test_serve_backend_codegen_answers_what_modules_answers(tmp_path):
    """Continuous batching, two servers on one plan (40-110 s here, as loaded)."""
    plan = _plan(tmp_path, "continuous")
    codegen = _served(plan, "codegen")
    assert all(len(t) == 3 for t in codegen)
    assert codegen == _served(plan, "modules")


def _assert_generate(served):
    """Each prompt's served tokens are Hugging Face's greedy ``generate`` of it (3 new tokens)."""
    from autopar.models.hf import hf_llama
    torch.manual_seed(0)   # the zoo factory's weights: the same seed and config as the server's
    ref = hf_llama()[0].model.eval()
    for p, tokens in zip(PROMPTS, served):
        want = ref.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert tokens == want[0, len(p):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)])
def test_serve_backend_codegen_static_answers_generate(tmp_path, tp, dp):
    """Static batching, tp=2 or two data-parallel replicas: one codegen server, against Hugging
    Face's greedy generate (what the modules server answers: test_serve_cli.py)."""
    codegen = _served(_plan(tmp_path, "static", tp=tp, dp=dp), "codegen")
    _assert_generate(codegen)


@pytest.mark.slow
def test_serve_backend_codegen_chunked_answers_generate(tmp_path):
    """Chunked batching at tp=2 (a chunk of 4 tokens, 2 slots): one codegen server, against Hugging
    Face's greedy generate (the engine's chunk schedule: tests/inference/test_codegen_iteration_chunked.py)."""
    plan = _plan(tmp_path, "chunked")
    assert json.loads(open(plan).read())["predictions"]["prefill_chunk"] == 4
    codegen = _served(plan, "codegen")
    _assert_generate(codegen)


@pytest.mark.slow
def test_serve_backend_codegen_continuous_replicas_answer_generate(tmp_path):
    """Continuous batching on two data-parallel replicas (dp=2, tp=1): concurrent requests, each
    answered with Hugging Face's greedy ``generate`` of its prompt alone (the engine's replicas:
    test_codegen_iteration_dp.py)."""
    plan = _plan(tmp_path, "continuous", tp=1, dp=2)
    prompts = PROMPTS + [[1, 2], [40, 41, 42, 43]]
    with serve_process(["hf_llama", "--devices", "2", "--plan", plan, "--backend", "codegen"]) as url:
        assert_served_like_generate(url, prompts, [3, 2, 4, 1])
        metrics = httpx.get(f"{url}/metrics", timeout=10).json()
    assert metrics["backend"] == "codegen" and metrics["requests"] == len(prompts)   # the premise: codegen answered


def _skip_a_collective(rank, world, seconds):
    from autopar.mesh import Mesh
    from runtime import context as RC
    ctx = RC.setup(Mesh((2,), ("tp",), 2), timeout=timedelta(seconds=seconds))
    torch.distributed.barrier(ctx.groups[0])
    if rank == 1:   # never joins the all-reduce, but stays alive past rank 0's timeout
        time.sleep(4 * seconds)
        return None
    start = time.monotonic()
    try:
        RC.all_reduce(torch.ones(3), axis=0)
    except RuntimeError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, None


def test_setup_groups_take_the_timeout():
    """The default group waits 60 s (run_local's pg_timeout); setup's group 2 s."""
    elapsed, error = run_local(_skip_a_collective, 2, args=(2.0,), timeout=60, pg_timeout=60)[0]
    assert error is not None and "imed out" in error
    assert 1.5 < elapsed < 6
