"""``autopar serve`` end to end on loopback: the CLI plans a tiny Llama for 2 gloo ranks (tp=2),
starts the server, answers concurrent completions equal to Hugging Face's generate, rejects a
prompt too long for its plan, keeps serving, and stops on SIGINT; ``plan-inference`` and ``show``
of an inference plan."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from autopar.cli import main
from autopar.models.hf import hf_llama

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def test_serve_answers_concurrent_requests_on_two_ranks(tmp_path):
    port = _port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "autopar.cli", "serve", "hf_llama", "--devices", "2", "--constraint", "tp=2",
           "--prompt-len", "8", "--batch", "4", "--max-new-tokens", "6", "--port", str(port), "--batch-wait-ms", "200"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the server did not come up in 120 s"
            time.sleep(0.5)
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
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
