"""plan_inference (autopar/inference/planner.py): the KV cache formula, the memory budget, pins,
latency targets, and what the memory-bound decode price says about batch, context and tp."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ConstraintError, MemoryBudgetError, PlanError
from autopar.inference.inference_cost import Pricer, in_flight_cycle, stage_layers
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.model_shape import ModelShape
from autopar.inference.planner import plan_inference
from autopar.models.hf import hf_llama
from autopar.models.hf_config import from_hf_config

LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
              "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return hf_llama(n_layer=2, n_head=4, n_kv_heads=2, d_model=64, vocab=64)[0]


@pytest.fixture(scope="module")
def llama70b():
    return from_hf_config(dict(LLAMA3_70B), seq=16, batch=1)


def test_model_shape_counts_the_published_parameters(llama70b):
    m = ModelShape.of(llama70b)
    assert (m.layers, m.heads, m.kv_heads, m.head_dim) == (80, 64, 8, 128)
    assert abs(m.params / 1e9 - 70.55) < 0.01


def test_kv_cache_bytes_follow_the_formula(tiny):
    cl = autopar.Cluster.preset("cpu", devices=2)
    p = plan_inference(tiny, torch.zeros(3, 5, dtype=torch.long), cl, max_new_tokens=4,
                       constraints={"tp": 2, "batch_size": 3}, dtype="fp32")
    # 2 (k, v) x 2 layers x 3 sequences x (5 + 4) positions x 2 / 2 kv heads x 16 head dim x 4 bytes
    assert p.kv_cache_bytes_per_rank == 2 * 2 * 3 * 9 * 1 * 16 * 4
    assert (p.tp, p.dp, p.pp, p.stages) == (2, 1, 1, [[0, 2]])


def test_json_round_trip(tiny, tmp_path):
    cl = autopar.Cluster.preset("cpu", devices=2)
    p = plan_inference(tiny, torch.zeros(2, 5, dtype=torch.long), cl, max_new_tokens=4, dtype="fp32")
    p.save(tmp_path / "p.json")
    assert InferencePlan.load(tmp_path / "p.json") == p
    with pytest.raises(PlanError, match="not an inference plan"):
        InferencePlan.from_json('{"kind": "training"}')


def test_the_budget_is_respected_and_an_impossible_one_is_a_clear_error(llama70b):
    cl = autopar.Cluster.preset("dgx-a100")
    p = plan_inference(llama70b, torch.zeros(8, 2048, dtype=torch.long), cl, max_new_tokens=256)
    assert p.predictions["memory_per_rank"] <= cl.device.memory_bytes
    assert p.tp == 8      # 141 GB of bf16 weights: only tp=8 leaves room on 80 GB devices... and is fastest
    with pytest.raises(MemoryBudgetError, match="fits"):
        plan_inference(llama70b, torch.zeros(8, 2048, dtype=torch.long), cl, max_new_tokens=256,
                       memory_budget="10GB")


def test_pins_are_honoured_and_a_bad_pin_is_a_clear_error(llama70b):
    cl = autopar.Cluster.preset("dgx-h100")
    p = plan_inference(llama70b, torch.zeros(4, 1024, dtype=torch.long), cl, max_new_tokens=64,
                       constraints={"tp": 4})
    assert (p.tp, p.dp) == (4, 2)
    with pytest.raises(ConstraintError, match="divide the attention heads"):
        plan_inference(llama70b, torch.zeros(4, 1024, dtype=torch.long), cl, max_new_tokens=64,
                       constraints={"tp": 3})
    with pytest.raises(ConstraintError, match="not known"):
        plan_inference(llama70b, torch.zeros(4, 1024, dtype=torch.long), cl, max_new_tokens=64,
                       constraints={"zero": 1})


def test_latency_targets_trade_latency_for_throughput(llama70b):
    cl = autopar.Cluster.preset("dgx-h100")
    prompt = torch.zeros(8, 2048, dtype=torch.long)
    fastest = plan_inference(llama70b, prompt, cl, max_new_tokens=256)
    served = plan_inference(llama70b, prompt, cl, max_new_tokens=256, slo={"ttft": "2s", "tpot": "200ms"})
    assert served.predictions["ttft"] <= 2.0 and served.predictions["tpot"] <= 0.2
    assert served.predictions["tokens_per_s_per_device"] > fastest.predictions["tokens_per_s_per_device"]
    assert fastest.predictions["latency"] <= served.predictions["latency"]
    with pytest.raises(PlanError, match="no configuration meets the slo"):
        plan_inference(llama70b, prompt, cl, max_new_tokens=256, slo={"tpot": "1ms"})
    with pytest.raises(PlanError, match="slo key"):
        plan_inference(llama70b, prompt, cl, max_new_tokens=256, slo={"latency": "1s"})


def test_decode_is_memory_bound_in_batch_context_and_tp(llama70b):
    cl = autopar.Cluster.preset("dgx-h100")
    price = Pricer(cl, ModelShape.of(llama70b), "bf16")
    assert price.decode(8, 1, 1, 2048) < price.decode(8, 1, 64, 2048) < price.decode(8, 1, 64, 8192)
    assert price.decode(8, 1, 1, 2048) < price.decode(4, 1, 1, 2048) < price.decode(2, 1, 1, 2048)
    # weights read once a token at most HBM bandwidth: tp=8 reads 1/8 of 141 GB per token
    assert price.decode(8, 1, 1, 2048) > 141e9 / 8 / cl.device.hbm_bandwidth


def test_bad_inputs_are_clear_errors(tiny):
    cl = autopar.Cluster.preset("cpu", devices=2)
    with pytest.raises(PlanError, match="example_prompt"):
        plan_inference(tiny, torch.zeros(5, dtype=torch.long), cl, max_new_tokens=4)
    with pytest.raises(PlanError, match="max_new_tokens"):
        plan_inference(tiny, torch.zeros(1, 5, dtype=torch.long), cl, max_new_tokens=0)
    with pytest.raises(PlanError, match="causal LM"):
        plan_inference(torch.nn.Linear(2, 2), torch.zeros(1, 5, dtype=torch.long), cl, max_new_tokens=4)


def test_stages_in_flight_cost_a_pass_or_pp_turns_of_the_slowest_stage(llama70b):
    # hand values: even stages cost their sum, uneven ones pp turns of the slowest
    assert in_flight_cycle([3.0, 3.0]) == 6.0 and in_flight_cycle([4.0, 2.0]) == 8.0 and in_flight_cycle([5.0]) == 5.0
    assert stage_layers(80, 2) == [[0, 40], [40, 80]] and stage_layers(10, 3) == [[0, 4], [4, 7], [7, 10]]
    price = Pricer(autopar.Cluster.preset("dgx-h100"), ModelShape.of(llama70b), "bf16")
    # pp=1: one stage, the in-flight price is the plain one
    assert price.decode_stages(4, 1, 8, 2048) == [price.decode(4, 1, 8, 2048)]
    assert price.decode_in_flight(4, 1, 8, 2048) == price.decode(4, 1, 8, 2048)
    assert price.prefill_in_flight(4, 1, 1, 1024) == price.prefill(4, 1, 1, 1024)
    # pp=2: each stage has 40 layers, the last the LM head, the first the send; a micro-batch's iteration
    # with another in flight is its own pass within the head's and the send's share
    stages = price.decode_stages(2, 2, 8, 2048)
    assert len(stages) == 2 and sum(stages) == pytest.approx(price.decode(2, 2, 8, 2048))
    cycle = price.decode_in_flight(2, 2, 8, 2048)
    assert price.decode(2, 2, 8, 2048) <= cycle < 1.02 * price.decode(2, 2, 8, 2048)
    assert cycle == pytest.approx(2 * max(stages))
