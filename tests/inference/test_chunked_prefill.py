"""Chunked prefill in the continuous-batching simulation (autopar/inference/continuous.py,
``simulate_chunked``), the mixed iteration's price (``Pricer.mixed``), and ``batching="chunked"``
through the planner, the CLI and the plan file."""
from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.cli import main
from autopar.errors import ConstraintError, PlanError
from autopar.inference.continuous import simulate_chunked, simulate_continuous
from autopar.inference.inference_cost import Pricer
from autopar.inference.inference_plan import InferencePlan, summary
from autopar.inference.model_shape import ModelShape
from autopar.inference.planner import plan_inference
from autopar.inference.trace import RequestTrace, synthetic_trace
from autopar.models import hf
from autopar.models.hf_config import from_hf_config
from tests.inference.test_inference_planner import LLAMA3_70B


def _linear(chunks, decodes, context):
    """0.1 s an iteration plus 0.01 s per prompt-chunk token."""
    return 0.1 + 0.01 * sum(tokens for tokens, _ in chunks)


def _flat_prefill(chunks, decodes, context):
    """1 s an iteration with a prompt chunk, 0.1 s a decode step (``_flat`` of test_request_traces)."""
    return 1.0 if chunks else 0.1


def _70b():
    model = from_hf_config(dict(LLAMA3_70B), seq=16, batch=1)
    return Pricer(autopar.Cluster.preset("dgx-h100", nodes=1), ModelShape.of(model), "bf16")


def test_a_long_prompt_is_chunked_and_the_running_request_keeps_decoding():
    # chunk 16. Request 0 (prompt 10, output 6) prefills alone to 0.2 and decodes; request 1 (prompt 40)
    # arrives at 0.25 and is admitted at the iteration starting at 0.3: its 40 tokens run as chunks of 15,
    # 15 and 10 beside request 0's decode (0.25, 0.25, 0.2 s), so request 0 gets a token every iteration
    tr = RequestTrace(np.array([0.0, 0.25]), np.array([10, 40]), np.array([6, 2]))
    calls = []

    def price(chunks, decodes, context):
        calls.append((chunks, decodes))
        return _linear(chunks, decodes, context)
    sim = simulate_chunked(tr, price, replicas=1, batch_size=4, chunk=16)
    assert [c for c in calls if c[0]] == [(((10, 0),), 0), (((15, 0),), 1), (((15, 15),), 1), (((10, 30),), 1)]
    # request 0's tokens at 0.2, 0.3, 0.55, 0.8, 1.0, 1.1; request 1's first at 1.0, second at 1.1
    assert sim["arrays"]["ttft"].tolist() == pytest.approx([0.2, 1.0 - 0.25])
    assert sim["arrays"]["latency"].tolist() == pytest.approx([1.1, 1.1 - 0.25])
    assert sim["arrays"]["tpot"].tolist() == pytest.approx([(1.1 - 0.2) / 5, 0.1])


def test_prompts_share_an_iteration_and_one_spans_two():
    # both at 0, chunk 16: request 0's 20 tokens run as 16 (0.26 s) then 4, with request 1's 10 in the same
    # iteration (0.24 s): both first tokens at 0.5; then decode steps of 0.1 s
    tr = RequestTrace(np.zeros(2), np.array([20, 10]), np.array([3, 2]))
    sim = simulate_chunked(tr, _linear, replicas=1, batch_size=4, chunk=16)
    assert sim["arrays"]["ttft"].tolist() == pytest.approx([0.5, 0.5])
    assert sim["arrays"]["latency"].tolist() == pytest.approx([0.7, 0.6])
    # batch 1: request 1 waits for request 0's slot (first token at 0.4, two steps to 0.6), then prefills to 0.8
    one = simulate_chunked(tr, _linear, replicas=1, batch_size=1, chunk=16)
    assert one["arrays"]["ttft"].tolist() == pytest.approx([0.26 + 0.14, 0.8])
    # a one-token output ends with its prefill
    single = simulate_chunked(RequestTrace(np.zeros(1), np.array([40]), np.array([1])), _linear, 1, 4, 16)
    assert single["arrays"]["latency"].tolist() == pytest.approx([0.26 + 0.26 + 0.18])


def test_stages_in_flight_each_run_their_own_budget():
    # as test_continuous_two_stages_in_flight_serve_twice_the_tokens_at_the_same_time_per_token: 4 requests,
    # prompt 10 (one chunk of 16), output 11, batch 1; two micro-batches in flight serve two at a time
    tr = RequestTrace(np.zeros(4), np.full(4, 10), np.full(4, 11))
    one = simulate_chunked(tr, _flat_prefill, replicas=1, batch_size=1, chunk=16)
    assert one["arrays"]["ttft"].tolist() == pytest.approx([1.0, 3.0, 5.0, 7.0])
    two = simulate_chunked(tr, _flat_prefill, replicas=1, batch_size=1, chunk=16, stages=2)
    assert two["arrays"]["ttft"].tolist() == pytest.approx([1.0, 1.0, 3.0, 3.0])
    assert two["tokens_per_s"] == pytest.approx(2 * one["tokens_per_s"])
    with pytest.raises(PlanError, match="shared by its 2 micro-batches"):
        simulate_chunked(tr, _flat_prefill, 1, 1, 16, kv_tokens=41, stages=2)


def test_mixed_price_is_the_prefill_and_decode_terms_with_the_weights_read_once():
    price = _70b()
    for tp, pp in ((8, 1), (2, 2)):
        for s in (64, 512, 2048):   # a whole prompt, no decodes: the prefill
            assert price.mixed(tp, pp, ((s, 0),), 0, 0) == pytest.approx(price.prefill(tp, pp, 1, s), rel=1e-12)
        for d, c in ((1, 128), (64, 1024)):   # no chunk: the decode step
            assert price.mixed(tp, pp, (), d, c) == pytest.approx(price.decode(tp, pp, d, c), rel=1e-12)
            assert price.mixed_in_flight(tp, pp, (), d, c) == pytest.approx(price.decode_in_flight(tp, pp, d, c))
        # a chunk with decodes: more than either alone, less than both (their sum reads the weights twice)
        both = price.prefill(tp, pp, 1, 448) + price.decode(tp, pp, 64, 1024)
        mixed = price.mixed(tp, pp, ((448, 0),), 64, 1024)
        assert max(price.prefill(tp, pp, 1, 448), price.decode(tp, pp, 64, 1024)) < mixed < 0.85 * both
        # a later chunk of a prompt attends to its past: dearer than the first
        assert price.mixed(tp, pp, ((512, 3072),), 0, 0) > price.mixed(tp, pp, ((512, 0),), 0, 0)


def test_a_chunk_above_every_prompt_serves_as_non_chunked_when_requests_do_not_overlap():
    # one request at a time (each done before the next arrives), prompts multiples of 64 (the non-chunked
    # simulation prices prompts rounded up to 64 tokens): the mixed iterations are the prefill and the decode
    # steps, so the two simulations agree
    price = _70b()
    tr = RequestTrace(np.array([0.0, 10.0, 20.0]), np.array([512, 64, 1024]), np.array([20, 1, 100]))
    cont = simulate_continuous(tr, lambda b, s: price.prefill(8, 1, b, s), lambda b, c: price.decode(8, 1, b, c),
                               1, 8)
    chunked = simulate_chunked(tr, lambda ch, d, c: price.mixed(8, 1, ch, d, c), 1, 8, chunk=4096)
    for k in ("ttft", "tpot", "latency"):
        assert chunked["arrays"][k].tolist() == pytest.approx(cont["arrays"][k].tolist(), rel=1e-9)
    # arriving together, the non-chunked scheduler prefills the two prompts one after the other; one chunked
    # iteration runs both, the weights read once: both first tokens come sooner
    two = RequestTrace(np.zeros(2), np.array([512, 512]), np.array([8, 8]))
    cont = simulate_continuous(two, lambda b, s: price.prefill(8, 1, b, s), lambda b, c: price.decode(8, 1, b, c),
                               1, 8)
    chunked = simulate_chunked(two, lambda ch, d, c: price.mixed(8, 1, ch, d, c), 1, 8, chunk=4096)
    assert chunked["arrays"]["ttft"].tolist() == pytest.approx([price.mixed(8, 1, ((512, 0), (512, 0)), 0, 0)] * 2)
    assert (chunked["arrays"]["ttft"] < cont["arrays"]["ttft"]).all()
    assert cont["arrays"]["ttft"][0] == pytest.approx(2 * price.prefill(8, 1, 1, 512))


def test_chunking_lowers_tpot_p99_on_long_prompts():
    # one long prompt in ten (8k tokens): without chunks every running request pauses for its whole prefill
    price = _70b()
    tr = synthetic_trace(400, rate=3.0, prompt_lens=[256] * 9 + [8192], output_lens=[64, 256], seed=0)
    cont = simulate_continuous(tr, lambda b, s: price.prefill(8, 1, b, s), lambda b, c: price.decode(8, 1, b, c),
                               1, 64)
    chunked = simulate_chunked(tr, lambda ch, d, c: price.mixed(8, 1, ch, d, c), 1, 64, chunk=512)
    assert chunked["tpot"]["p99"] < 0.85 * cont["tpot"]["p99"]   # 20.2 ms against 26.6 ms
    assert chunked["tokens_per_s"] == pytest.approx(cont["tokens_per_s"], rel=0.05)   # both keep up


def test_bad_options_are_refused():
    tr = RequestTrace(np.zeros(2), np.array([20, 10]), np.array([3, 2]))
    with pytest.raises(PlanError, match="max_num_batched_tokens >= max_num_seqs"):
        simulate_chunked(tr, _linear, replicas=1, batch_size=32, chunk=16)
    with pytest.raises(PlanError, match="positive integer"):
        simulate_chunked(tr, _linear, replicas=1, batch_size=1, chunk=0)
    model, cl = hf.hf_llama(vocab=64)[0].model, autopar.Cluster.preset("dgx-a100", nodes=1)
    trace = synthetic_trace(50, rate=2.0, prompt_lens=[64, 256], output_lens=[16, 64], seed=0)
    with pytest.raises(ValueError, match="'static', 'continuous', 'chunked'"):
        plan_inference(model, None, cl, trace=trace, batching="sarathi")
    with pytest.raises(ValueError, match="applies to batching='chunked'"):
        plan_inference(model, None, cl, trace=trace, batching="continuous", prefill_chunk=256)
    with pytest.raises(ValueError, match="positive integer"):
        plan_inference(model, None, cl, trace=trace, batching="chunked", prefill_chunk=0)
    with pytest.raises(ConstraintError, match="batch of at most 64"):
        plan_inference(model, None, cl, trace=trace, batching="chunked", prefill_chunk=64,
                       constraints={"batch_size": 128})


def test_chunked_plan_through_the_planner_the_cli_and_the_plan_file(tmp_path, capsys):
    model, cl = hf.hf_llama(vocab=64)[0].model, autopar.Cluster.preset("dgx-a100", nodes=1)
    trace = synthetic_trace(200, rate=2.0, prompt_lens=[64, 256], output_lens=[16, 64], seed=0)
    slo = {"ttft": "2s", "tpot": "200ms"}
    p = plan_inference(model, None, cl, trace=trace, slo=slo, batching="chunked", prefill_chunk=128)
    assert p.predictions["batching"] == "chunked" and p.predictions["prefill_chunk"] == 128
    assert p.batch_size <= 128 and p.predictions["ttft"] <= 2.0
    assert "chunked batching, prefill chunk 128 tokens" in summary(p)
    default = plan_inference(model, None, cl, trace=trace, slo=slo, batching="chunked")
    assert default.predictions["prefill_chunk"] == 512
    assert "prefill_chunk" not in plan_inference(model, None, cl, trace=trace, batching="continuous").predictions
    staged = plan_inference(model, None, cl, trace=trace, batching="chunked", constraints={"tp": 1, "pp": 2})
    assert staged.pp == 2 and "per micro-batch, 2 in flight per replica" in summary(staged)   # stages in flight
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{0.1 * i},{32 + 20 * i},8\n" for i in range(20)))
    out = tmp_path / "p.json"
    assert main(["plan-inference", "hf_llama", "--cluster", "dgx-a100", "--trace", str(path),
                 "--batching", "chunked", "--prefill-chunk", "64", "-o", str(out)]) == 0
    assert "chunked batching, prefill chunk 64 tokens" in capsys.readouterr().out
    loaded = InferencePlan.load(out)
    assert loaded.predictions["batching"] == "chunked" and loaded.predictions["prefill_chunk"] == 64
    assert main(["plan-inference", "hf_llama", "--cluster", "dgx-a100", "--trace", str(path),
                 "--prefill-chunk", "64"]) != 0
    assert "--prefill-chunk 64 applies to serving a --trace with --batching chunked" in capsys.readouterr().err
    # autopar serve runs chunked plans (tests/inference/test_server_continuous.py); as under continuous
    # batching, a request joins at the next iteration, so --batch-wait-ms is refused
    assert main(["serve", "hf_llama", "--cluster", "dgx-a100", "--plan", str(out), "--batch-wait-ms", "5"]) != 0
    assert "under the plan's chunked batching a request joins" in capsys.readouterr().err
