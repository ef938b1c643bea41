"""``autopar serve`` end to end on loopback: the CLI plans a tiny Llama for 2 gloo ranks (tp=2),
starts the server, answers concurrent completions equal to Hugging Face's generate, rejects a
prompt too long for its plan, keeps serving, and stops on SIGINT; ``plan-inference`` and ``show``
of an inference plan."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from autopar.cli import main
from autopar.errors import ExecutionError
from autopar.inference.serve_process import serve_process
from autopar.models.hf import hf_llama


def test_plan_inference_and_show(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan-inference", "hf_llama", "--devices", "2", "--prompt-len", "12", "--batch", "2",
                 "--max-new-tokens", "4", "--constraint", "tp=2", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["kind"] == "inference" and plan["tp"] == 2 and plan["prompt_len"] == 12
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "tp=2 pp=1 dp=1" in shown and "time per output token" in shown
    assert main(["plan-inference", "hf_llama", "--devices", "2", "--constraint", "tp=3"]) == 2
    assert "divide the attention heads" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_answers_concurrent_requests_on_two_ranks():
    args = ["hf_llama", "--devices", "2", "--constraint", "tp=2", "--prompt-len", "8", "--batch", "4",
            "--max-new-tokens", "6", "--batch-wait-ms", "200"]
    with serve_process(args) as url:
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [1, 2]]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 4},
                                                         timeout=60).json(), prompts))
        torch.manual_seed(0)   # the zoo factory's weights: the same seed and config as the server's
        model = hf_llama()[0].model.eval()
        for p, a in zip(prompts, answers):
            ref = model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert a["choices"][0]["token_ids"] == ref[0, len(p):].tolist()
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(1, 10)), "max_tokens": 2}, timeout=30)
        assert bad.status_code == 400 and "prompt length 8" in bad.json()["error"]["message"]
        again = httpx.post(f"{url}/v1/completions", json={"prompt": [3, 4], "max_tokens": 2}, timeout=60)
        assert again.status_code == 200
        metrics = httpx.get(f"{url}/metrics", timeout=10).json()
        assert metrics["requests"] == 4 and metrics["rejected"] == 1 and metrics["batches"] <= 3
        assert metrics["measured"]["requests_timed"] == 4 and metrics["measured"]["tpot"] > 0
        assert metrics["predicted"]["tpot"] > 0


def test_a_server_that_cannot_start_is_a_clear_error():
    with pytest.raises(ExecutionError, match="exited with code 2"):
        with serve_process(["hf_llama", "--devices", "2", "--constraint", "tp=3"], start_timeout=120):
            pass
