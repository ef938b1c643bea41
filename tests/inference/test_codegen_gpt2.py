"""GPT-2 (one fused qkv Conv1D per attention) on the codegen inference backend at tp=2, split by
heads (autopar/inference/fused_qkv.py): the static engine's greedy tokens equal Hugging Face's
``generate`` and the modules backend's with each rank holding half the heads of the cache (as
many bytes as the InferencePlan priced), also with the weights read from a checkpoint directory
(the split q, k, v blocks read from the fused tensor); the continuous engine's tokens for
staggered requests equal ``generate`` on each prompt alone. Units: the cat / split folding, the
split view leaving the model as it was, and the checkpoint reads at the column offsets."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.frontend.trace import trace_step
from autopar.inference.codegen_step import CacheStep
from autopar.inference.fused_qkv import Columns, fold_cat_split, mapped_read, split_fused_qkv, unsplit
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.planner import plan_inference
from runtime.launch import run_local
from tests.helpers.serving import generate_alone, spread_model
from tests.inference.test_codegen_engine import _check, _model, _plan, _reference, _run, check_from_dir
from tests.inference.test_codegen_iteration import MAX_NEW, PROMPT_LEN, REQUESTS, SLOTS, _serve

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops


class _CatSplit(nn.Module):
    """cat of three projections split back along the last dim (lined up), and along another split
    (not lined up: kept)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x):
        y = torch.cat([self.a(x), self.b(x), self.c(x)], -1)
        p, q, r = y.split([3, 3, 2], dim=2)
        s, t = y.split(4, dim=-1)
        return p * 2, q + r.sum(-1, keepdim=True), s - t


def _splits(traced):
    return [n for n in traced.gm.graph.nodes if n.op == "call_function" and "split" in str(n.target)]


def test_a_split_of_a_cat_into_its_pieces_is_folded():
    torch.manual_seed(0)
    m = _CatSplit().eval()
    x = torch.randn(2, 5, 4)
    traced = trace_step(m, (x,))
    assert len(_splits(traced)) == 2
    fold_cat_split(traced, m)
    left = _splits(traced)
    assert len(left) == 1 and all(u.target is operator.getitem for u in left[0].users)   # the 4 + 4 split kept
    names = [traced.param_fqn[n.name] for n in traced.gm.graph.nodes if n.op == "placeholder"
             and n.name in traced.param_fqn]
    params = dict(m.named_parameters())
    got = traced.gm(*[params[f] for f in names], x)
    want = m(x)
    assert all(torch.allclose(g, w) for g, w in zip(got, want))


def test_the_split_view_leaves_the_model_and_reads_the_fused_columns():
    lm = _model("hf_gpt2")
    before = {n: p for n, p in lm.named_parameters()}
    step = CacheStep(lm)
    assert dict(lm.named_parameters()) == before and type(lm.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    h = lm.config.hidden_size
    assert step.qkv_columns["transformer.h.1.attn.c_attn.k.weight"] == Columns("transformer.h.1.attn.c_attn.weight",
                                                                               1, h, 2 * h, True)
    view = dict(step.lm.named_parameters())
    for new, col in step.qkv_columns.items():   # the view's parameters are the model's columns (transposed)
        part = before[col.fqn].narrow(col.dim, col.start, col.stop - col.start)
        assert torch.equal(view[new], part.t() if col.transposed else part)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(step.lm(ids).logits, lm(ids).logits, atol=1e-5)
    read = mapped_read(lambda fqn, sl: before[fqn][sl], step.qkv_columns)
    for name, sl in [("transformer.h.0.attn.c_attn.v.weight", (slice(0, h // 2), slice(None))),
                     ("transformer.h.0.attn.c_attn.v.bias", (slice(h // 2, None),)),
                     ("transformer.h.1.mlp.c_proj.weight", (slice(None), slice(8, 24))),
                     ("transformer.h.1.attn.c_proj.bias", (slice(0, h // 2),))]:
        assert torch.equal(read(name, sl), view[name][sl]), name


def test_an_attention_it_cannot_prove_stays_fused():
    lm = _model("hf_gpt2")
    lm.transformer.h[0].attn.split_size = 7
    view, columns = split_fused_qkv(lm)
    assert list(unsplit(lm)) == ["transformer.h.0.attn"]
    assert all(".h.1." in k for k in columns if ".c_attn." in k)
    assert type(view.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    assert type(view.transformer.h[1].attn.c_attn).__name__ == "SplitQKV"


@pytest.mark.slow
def test_tp2_static_equals_hf_generate_and_the_modules_backend_split_by_heads():
    plan = _plan("hf_gpt2", 2, tp=2, pp=1, dp=1)
    assert plan.tp == 2 and plan.world_size == 2
    results = run_local(_run, 2, args=("hf_gpt2", plan.to_json(), {}), timeout=600)
    _check(results, plan, _reference("hf_gpt2").tolist(), _model("hf_gpt2").config.num_attention_heads)


@pytest.mark.slow
def test_tp2_weights_from_a_checkpoint_directory(tmp_path):
    check_from_dir("hf_gpt2", tmp_path, tp=2, pp=1)


def _iteration_plan():
    from autopar.inference.trace import synthetic_trace
    trace = synthetic_trace(16, rate=4.0, prompt_lens=(2, 6), output_lens=(1, 6), seed=0)
    plan = plan_inference(spread_model("hf_gpt2"), None, autopar.Cluster.preset("cpu", devices=2), trace=trace,
                          batching="continuous", constraints={"tp": 2, "pp": 1, "dp": 1}, dtype="fp32")
    plan.batch_size, plan.prompt_len, plan.max_new_tokens = SLOTS, PROMPT_LEN, MAX_NEW   # small programs
    plan.predictions["kv_cache_tokens_per_replica"] = None
    return plan


def _continuous_rank(rank, world, plan_json):
    model = spread_model("hf_gpt2")
    engine = IterationEngine.from_plan(model, InferencePlan.from_json(plan_json), backend="codegen")
    fired = []
    for block in model.transformer.h:
        block.register_forward_hook(lambda *a: fired.append(1))
    seqs, most = _serve(engine)
    heads = sorted({c.shape[1] for c in engine.cache})
    return [s.tokens for s in seqs], most, engine.calls, len(fired), engine.kv_cache_bytes(), heads


@pytest.mark.slow
def test_tp2_continuous_equals_generate_alone():
    plan = _iteration_plan()
    assert (plan.tp, plan.pp, plan.dp) == (2, 1, 1)
    results = run_local(_continuous_rank, 2, args=(plan.to_json(),), timeout=600)
    wants = [generate_alone(spread_model("hf_gpt2"), p, n) for p, n, _ in REQUESTS]
    cfg = spread_model("hf_gpt2").config
    whole = 2 * cfg.num_hidden_layers * SLOTS * cfg.num_attention_heads * (PROMPT_LEN + MAX_NEW) \
        * (cfg.hidden_size // cfg.num_attention_heads) * 4
    for tokens, most, calls, fired, held, heads in results:
        assert tokens == wants and most >= 2
        assert fired == 0 and calls[1] > 0 and calls[PROMPT_LEN] == len(REQUESTS)   # premise: the programs ran
        assert held == whole // 2 and heads == [cfg.num_attention_heads // 2]   # each rank half the heads
    assert results[0] == results[1]
