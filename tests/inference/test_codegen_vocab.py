"""A vocabulary-parallel LM head in the codegen backend, chosen by the planner (a step's outputs
are planned as no partial sums: autopar/rules/candidates.py; autopar/inference/codegen_step.py
``logits_split``, autopar/inference/vocab_parallel.py): on two gloo ranks (tiny Llama, untied
head, tp=2) the static engine's and the continuous engine's programs return each rank's half of
the vocabulary (the logits output [rows, V / 2], not gathered in the program), and the tokens are
chosen across the group: greedy tokens equal Hugging Face's ``generate`` while 2 numbers per row
per rank cross it at each step, and sampled tokens (top_k 10: 2 x 10 per row per rank) equal the
modules backend's for the same seeds."""
from __future__ import annotations

import pytest
import torch

from autopar.inference.codegen_step import CacheStep, logits_split, plan_cache_step
from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from runtime.launch import run_local
from tests.inference import test_codegen_engine as static
from tests.inference import test_codegen_iteration as rows

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
TP, K = 2, 10
SAMPLING = {"temperature": 0.8, "top_k": K, "seed": 3}


def _logit_widths(engine) -> list:
    """The logits widths the engine's runner returns, recorded run by run."""
    widths, run = [], engine.runner.run

    def recorded(seq, *inputs):
        out = run(seq, *inputs)
        widths.append(out[0].shape[-1])
        return out

    engine.runner.run = recorded
    return widths


def _static_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(static._model("hf_llama"), plan=plan, backend="codegen")
    widths, shard = _logit_widths(engine), engine.runner.vocab_shard
    greedy = engine.generate(static.PROMPTS, static.NEW, attention_mask=static.MASK)
    greedy_gathered = shard.gathered
    sampled = engine.generate(static.PROMPTS, static.NEW, attention_mask=static.MASK, sampling=SAMPLING)
    modules = compile_inference(static._model("hf_llama"), plan=plan)
    want = modules.generate(static.PROMPTS, static.NEW, attention_mask=static.MASK, sampling=SAMPLING)
    return {"greedy": greedy.tolist(), "sampled": sampled.tolist(), "modules_sampled": want.tolist(),
            "widths": sorted(set(widths)), "size": shard.size, "greedy_gathered": greedy_gathered,
            "sampled_gathered": shard.gathered - greedy_gathered, "batch": plan.batch_size}


@pytest.fixture(scope="module")
def static_ranks():
    plan = static._plan("hf_llama", TP, tp=TP, dp=1)
    assert (plan.tp, plan.pp) == (TP, 1) and not static._model("hf_llama").config.tie_word_embeddings
    return run_local(_static_rank, TP, args=(plan.to_json(),), timeout=900)


@pytest.mark.slow
def test_static_tp2_greedy_equals_hf_generate_from_vocabulary_slices(static_ranks):
    want = static._reference("hf_llama").tolist()
    prompt = static.PROMPTS.shape[1]
    for got in static_ranks:
        assert got["greedy"] == want
        assert got["widths"] == [64 // TP] and got["size"] == TP   # each rank's slice, not gathered whole
        steps = len(want[0]) - prompt
        assert got["greedy_gathered"] == 2 * TP * got["batch"] * steps   # 2 numbers per row per rank per step


@pytest.mark.slow
def test_static_tp2_sampling_equals_the_modules_backend(static_ranks):
    for got in static_ranks:
        assert got["sampled"] == got["modules_sampled"] != got["greedy"]
        steps = len(got["sampled"][0]) - static.PROMPTS.shape[1]
        assert got["sampled_gathered"] == 2 * K * TP * got["batch"] * steps   # top-k: 2 k per row per rank


def _serve_recorded(engine, sampling=None):
    """``rows._serve`` (every request with ``sampling``): the tokens, and per decode step
    (rows decoded, elements gathered by that step's token choice)."""
    decodes, decode = [], engine._decode

    def recorded():
        n, before = len(engine.running), engine.vocab_shard.gathered
        decode()
        decodes.append((n, engine.vocab_shard.gathered - before))

    engine._decode = recorded
    if sampling is None:
        seqs, _ = rows._serve(engine)
    else:
        seqs = [engine.add(p, n, dict(sampling, seed=i)) for i, (p, n, _) in enumerate(rows.REQUESTS)]
        engine.run_until_idle()
    del engine._decode   # the class's again
    return [s.tokens for s in seqs], decodes


def _iteration_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(rows._model(), plan, backend="codegen")
    widths = _logit_widths(engine)
    greedy, greedy_decodes = _serve_recorded(engine)
    sampled, sampled_decodes = _serve_recorded(engine, SAMPLING)
    modules = IterationEngine.from_plan(rows._model(), plan)
    seqs = [modules.add(p, n, dict(SAMPLING, seed=i)) for i, (p, n, _) in enumerate(rows.REQUESTS)]
    modules.run_until_idle()
    return {"greedy": greedy, "greedy_decodes": greedy_decodes, "sampled": sampled, "sampled_decodes": sampled_decodes,
            "modules_sampled": [s.tokens for s in seqs], "widths": sorted(set(widths)),
            "size": engine.vocab_shard.size}


@pytest.fixture(scope="module")
def iteration_ranks():
    plan = rows._plan(TP, tp=TP)
    assert (plan.tp, plan.pp, plan.dp) == (TP, 1, 1) and not rows._model().config.tie_word_embeddings
    return run_local(_iteration_rank, TP, args=(plan.to_json(),), timeout=900)


@pytest.mark.slow
def test_continuous_tp2_greedy_equals_generate_alone_from_vocabulary_slices(iteration_ranks):
    wants = [rows._alone(rows._model(), p, n) for p, n, _ in rows.REQUESTS]
    for got in iteration_ranks:
        assert got["greedy"] == wants
        assert got["widths"] == [64 // TP] and got["size"] == TP
        assert got["greedy_decodes"] and all(g == 2 * TP * n for n, g in got["greedy_decodes"])


@pytest.mark.slow
def test_continuous_tp2_sampling_equals_the_modules_engine(iteration_ranks):
    for got in iteration_ranks:
        assert got["sampled"] == got["modules_sampled"] != got["greedy"]
        assert got["sampled_decodes"] and all(g == 2 * K * TP * n for n, g in got["sampled_decodes"])


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
@pytest.mark.parametrize("seq", [1, 6])
def test_the_plan_itself_splits_the_vocabulary(name, seq):
    """Under tp the planned step's LM head is column-parallel on its replicated input (no
    communication) and returns each rank's vocabulary slice, never partial sums: a row-parallel
    head's reduction is priced, not left to run after the step. GPT-2's head is tied to the
    token embeddings: the same."""
    import autopar
    model = static._model(name)
    ps = plan_cache_step(CacheStep(model), 3, seq, 11, autopar.Cluster.preset("cpu", devices=TP),
                         constraints={"tp": TP, "dp": 1}, policy="megatron")
    assert logits_split(ps)
    head = next(op for op in ps.plan.ops if op["rule"] == "linear" and op["node"] in
                {a for o in ps.plan.ops if o["node"] == ps.traced.outputs[0] for a in o["args"]})
    assert head["strategy"] == "S(n)@tp" and not any(lay["partial"] for lay in head["outputs"])
