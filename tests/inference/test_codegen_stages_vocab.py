"""A vocabulary-parallel LM head on the codegen backend's pipeline stages (autopar/inference/
codegen_stages.py ``StageStepRunner``, ``vocab_shard``): on a tp=2 x pp=2 grid of 4 gloo ranks
(tiny Llama, untied head) the last stage's programs return each tp rank's half of the vocabulary
(the logits [rows, V / 2], not gathered in the program) and the tokens are chosen across that
stage's tp group, then broadcast over the pipeline: the static engine's greedy tokens equal
Hugging Face's ``generate`` while 2 numbers per row per rank cross the group at each step, and
the continuous engine's staggered requests each get ``generate``'s tokens of its prompt alone."""
from __future__ import annotations

import pytest
import torch

from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from runtime.launch import run_local
from tests.helpers.serving import generate_alone
from tests.inference import test_codegen_engine as static
from tests.inference import test_codegen_iteration as rows

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
TP, PP = 2, 2


def _logit_widths(runner) -> list:
    """The widths of the logits the runner's stage returns, recorded forward by forward (last stage)."""
    widths, forward = [], runner.forward

    def recorded(seq, inputs, cache):
        logits, new = forward(seq, inputs, cache)
        if logits is not None:
            widths.append(logits.shape[-1])
        return logits, new

    runner.forward = recorded
    return widths


def _static_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(static._model("hf_llama"), plan=plan, backend="codegen")
    widths, shard = _logit_widths(engine.runner), engine.runner.vocab_shard
    greedy = engine.generate(static.PROMPTS, static.NEW, attention_mask=static.MASK)
    return {"greedy": greedy.tolist(), "widths": sorted(set(widths)), "size": shard.size,
            "gathered": shard.gathered, "last": engine.runner.last, "batch": plan.batch_size}


@pytest.mark.slow
def test_static_tp2_pp2_greedy_equals_hf_generate_from_vocabulary_slices():
    plan = static._plan("hf_llama", TP * PP, tp=TP, pp=PP, dp=1)
    assert (plan.tp, plan.pp) == (TP, PP) and not static._model("hf_llama").config.tie_word_embeddings
    results = run_local(_static_rank, TP * PP, args=(plan.to_json(),), timeout=900)
    want = static._reference("hf_llama").tolist()
    steps = len(want[0]) - static.PROMPTS.shape[1]
    for rank, got in enumerate(results):
        assert got["greedy"] == want and got["size"] == TP and got["last"] == (rank >= TP)
        if got["last"]:
            assert got["widths"] == [64 // TP]   # each tp rank's slice, not gathered whole
            assert got["gathered"] == 2 * TP * got["batch"] * steps   # 2 numbers per row per rank per step
        else:
            assert got["widths"] == [] and got["gathered"] == 0


def _continuous_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(rows._model(), plan, backend="codegen")
    widths, picked, pick = _logit_widths(engine.runner), [], engine._pick

    def counted(logits, seqs):
        picked.append(logits.shape[0])
        return pick(logits, seqs)

    engine._pick = counted
    seqs, _ = rows._serve(engine)
    return {"tokens": [s.tokens for s in seqs], "widths": sorted(set(widths)), "rows": sum(picked),
            "gathered": engine.vocab_shard.gathered, "size": engine.vocab_shard.size, "last": engine.runner.last}


@pytest.mark.slow
def test_continuous_tp2_pp2_equals_generate_alone_from_vocabulary_slices():
    plan = rows._plan(TP * PP, tp=TP, pp=PP)
    assert (plan.tp, plan.pp, plan.dp) == (TP, PP, 1) and not rows._model().config.tie_word_embeddings
    results = run_local(_continuous_rank, TP * PP, args=(plan.to_json(),), timeout=900)
    wants = [generate_alone(rows._model(), p, n) for p, n, _ in rows.REQUESTS]
    vocab = rows._model().config.vocab_size
    for rank, got in enumerate(results):
        assert got["tokens"] == wants and got["size"] == TP and got["last"] == (rank >= TP)
        if got["last"]:
            assert got["widths"] == [vocab // TP] and got["rows"] > 0   # each tp rank's slice
            assert got["gathered"] == 2 * TP * got["rows"]   # greedy: 2 numbers per row per rank
        else:
            assert got["widths"] == [] and got["gathered"] == 0
