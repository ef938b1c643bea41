"""The distributed argmax / top-k over a vocabulary-parallel LM head (autopar/inference/
vocab_parallel.py): on a shard of one it is ``torch.argmax`` (ties to the first maximum); ranks
simulated in one process pick what one process picks, ties across ranks included; on two gloo
ranks (tiny Llama, untied head) the continuous-batching engine's greedy tokens equal Hugging
Face's ``generate`` of each prompt alone, and the static engine's equal ``generate`` of the batch,
while 2 numbers per row per rank cross the group, not the vocabulary; and the continuous engine's
sampled tokens (temperature, top-k, top-p, seeds) equal one process's."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.planner import plan_inference
from autopar.inference.trace import synthetic_trace
from autopar.inference.vocab_parallel import VocabShard, greedy_tokens, next_tokens, top_candidates
from runtime.launch import run_local
from tests.helpers.serving import generate_alone, spread_model

torch.set_num_threads(1)

VOCAB = 64
PROMPTS = [([5, 6, 7], 6), ([9, 10, 11, 12, 13, 14, 15], 3), ([1, 2], 5), ([40, 41, 42, 43], 4)]
SAMPLINGS = [{"temperature": 0.8, "top_k": 10, "top_p": 0.9, "seed": 1},
             {"temperature": 1.2, "top_k": 40, "seed": 2},                  # k above a rank's 32 entries
             {},                                                           # greedy next to them
             {"temperature": 0.7, "top_k": 0, "top_p": 0.95, "seed": 4}]    # the whole vocabulary


def _tied_rows(rows=64, vocab=VOCAB, seed=0):
    """Logits of few distinct values, so rows have several maxima, often on different halves."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (rows, vocab), generator=g).float()


class _SimulatedRanks:
    """``size`` ranks in one process: ``run(fn)`` calls ``fn(shard)`` once per rank to record what
    each gathers, then again with every rank's parts, returning rank 0's result and checking every
    rank's is the same."""

    def __init__(self, size):
        self.size, self.parts = size, None

    def run(self, fn):
        recorded = [[] for _ in range(self.size)]
        for rank in range(self.size):
            fn(_RecordingShard(rank, self.size, recorded[rank]))
        results = [fn(_ReplayShard(rank, self.size, recorded)) for rank in range(self.size)]
        for r in results[1:]:
            assert r == results[0]
        return results[0]


class _RecordingShard(VocabShard):
    def __init__(self, rank, size, log):
        super().__init__(rank, size)
        self.log = log

    def gather(self, t):
        self.log.append(t.clone())
        return torch.stack([t] * self.size)


class _ReplayShard(VocabShard):
    def __init__(self, rank, size, recorded):
        super().__init__(rank, size)
        self.recorded, self.calls = recorded, 0

    def gather(self, t):
        out = torch.stack([self.recorded[r][self.calls] for r in range(self.size)])
        self.calls += 1
        return out


def _slice(logits, rank, size):
    n = logits.shape[-1] // size
    return logits[..., rank * n:(rank + 1) * n]


def test_greedy_on_a_shard_of_one_is_torch_argmax_ties_included():
    logits = _tied_rows()
    shard = VocabShard()
    assert torch.equal(greedy_tokens(logits, shard), logits.argmax(-1))
    assert shard.gathered == 2 * logits.shape[0]              # (value, index) per row
    # ties: torch.argmax returns the first maximum; so does the distributed argmax
    row = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0, 1.0]])
    assert int(torch.argmax(row)) == 1 and int(greedy_tokens(row, VocabShard())) == 1
    assert greedy_tokens(logits.bfloat16(), VocabShard()).tolist() == logits.bfloat16().argmax(-1).tolist()


@pytest.mark.parametrize("size", [2, 4])
def test_simulated_ranks_pick_what_one_process_picks(size):
    logits = _tied_rows(seed=size)
    ranks = _SimulatedRanks(size)

    def greedy(shard):
        return greedy_tokens(_slice(logits, shard.rank, shard.size), shard).tolist()
    assert greedy(VocabShard()) == logits.argmax(-1).tolist()
    assert ranks.run(greedy) == logits.argmax(-1).tolist()   # ties across ranks: the lowest index

    def candidates(shard):
        values, index = top_candidates(_slice(logits, shard.rank, shard.size), 20, shard)
        return values.tolist(), index.tolist()
    assert ranks.run(candidates) == candidates(VocabShard())

    samplings = [SAMPLINGS[r % len(SAMPLINGS)] for r in range(8)]

    def sampled(shard):
        gens = [torch.Generator().manual_seed(s.get("seed", 0)) if s else None for s in samplings]
        return next_tokens(_slice(torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5)),
                                  shard.rank, shard.size), samplings, gens, shard, default_top_k=50)
    assert ranks.run(sampled) == sampled(VocabShard())


def _model():
    """A tiny Llama with an untied head, weights spread (tests/helpers/serving.py)."""
    m = spread_model("hf_llama", VOCAB)
    assert m.config.tie_word_embeddings is False
    return m


_alone = generate_alone


def _tp2_plan():
    trace = synthetic_trace(16, rate=4.0, prompt_lens=(2, 8), output_lens=(1, 6), seed=0)
    plan = plan_inference(_model(), None, autopar.Cluster.preset("cpu", devices=2), trace=trace,
                          batching="continuous", constraints={"tp": 2}, dtype="fp32")
    assert (plan.tp, plan.pp, plan.dp) == (2, 1, 1)
    return plan


def _run(engine, samplings):
    """Every prompt added at once; per step without admissions: (rows decoded, elements gathered)."""
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = len(PROMPTS), 9, 7, None
    seqs = [engine.add(p, n, s) for (p, n), s in zip(PROMPTS, samplings)]
    decodes = []
    while not engine.idle:
        rows, before, waiting = len(engine.running), engine.vocab_shard.gathered, len(engine.waiting)
        engine.step()
        if rows and not waiting:
            decodes.append((rows, engine.vocab_shard.gathered - before))
    return [s.tokens for s in seqs], decodes


def _tp2_rank(rank, world, plan_json, samplings):
    engine = IterationEngine.from_plan(_model(), InferencePlan.from_json(plan_json))
    head = engine.model.get_output_embeddings().weight.shape[0]
    tokens, decodes = _run(engine, samplings)
    return tokens, decodes, engine.vocab_shard.size, head


@pytest.mark.slow
def test_tp2_greedy_equals_generate_alone_and_gathers_two_numbers_per_row_per_rank():
    plan = _tp2_plan()
    results = run_local(_tp2_rank, 2, args=(plan.to_json(), [{}] * len(PROMPTS)), timeout=300)
    model = _model()
    wants = [_alone(model, p, n) for p, n in PROMPTS]
    for tokens, decodes, size, head in results:
        assert tokens == wants
        assert size == 2 and head == VOCAB // 2          # each rank its half of the vocabulary, not gathered
        assert decodes and all(got == 2 * 2 * rows for rows, got in decodes)   # 2 x tp per row, not V


@pytest.mark.slow
def test_tp2_sampling_draws_what_one_process_draws():
    plan = _tp2_plan()
    results = run_local(_tp2_rank, 2, args=(plan.to_json(), SAMPLINGS), timeout=300)
    one, _ = _run(IterationEngine(_model(), slots=1, prompt_len=9, max_new_tokens=7), SAMPLINGS)
    assert results[0][0] == results[1][0] == one
    greedy, _ = _run(IterationEngine(_model(), slots=1, prompt_len=9, max_new_tokens=7), [{}] * len(PROMPTS))
    assert one[0] != greedy[0] or one[3] != greedy[3]    # it really sampled


BATCH = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14], [0, 40, 41, 42, 43, 44]])   # left-padded
NEW = 5


def _static_rank(rank, world, plan_json):
    from autopar.inference.engine import compile_inference
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(_model(), plan=plan)
    out = engine.generate(BATCH, NEW, attention_mask=(BATCH != 0).long())
    return out.tolist(), engine.vocab_shard.gathered, plan.batch_size


@pytest.mark.slow
def test_tp2_static_generate_equals_hf_generate_with_the_distributed_argmax():
    plan = plan_inference(_model(), BATCH, autopar.Cluster.preset("cpu", devices=2), max_new_tokens=NEW,
                          constraints={"tp": 2}, dtype="fp32")
    assert plan.tp == 2
    results = run_local(_static_rank, 2, args=(plan.to_json(),), timeout=300)
    with torch.no_grad():
        want = _model().generate(BATCH, attention_mask=(BATCH != 0).long(), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
    for out, gathered, batch in results:
        assert out == want.tolist()
        assert gathered == 2 * 2 * batch * NEW     # one argmax per new token: 2 x tp per row, not V


def test_static_greedy_gathers_whole_rows_when_the_generation_config_processes_them():
    """A generation config asking greedy ``generate`` for processors over whole rows (repetition
    penalty, suppressed tokens, ...) would misread a split head's slices: the static engine then
    gathers the logits whole instead of the distributed argmax."""
    from types import SimpleNamespace

    from autopar.inference.engine import InferenceEngine
    from transformers import GenerationConfig
    engine = SimpleNamespace(model=SimpleNamespace(generation_config=GenerationConfig()),
                             WHOLE_ROW_SETTINGS=InferenceEngine.WHOLE_ROW_SETTINGS)
    assert not InferenceEngine._processed_scores(engine)
    for setting in ({"repetition_penalty": 1.3}, {"suppress_tokens": [3]}, {"min_new_tokens": 2}):
        engine.model.generation_config = GenerationConfig(**setting)
        assert InferenceEngine._processed_scores(engine), setting
