"""Continuous batching with pipeline stages in flight (autopar/inference/iteration_engine.py, pp >
1): every rank of a pipeline runs the same ticks (rank 0 leading, the others following its
broadcasts), each stage holds its layers and the cache entries of its own layers only, the two
virtual engines' turns overlap (in a tick stage 0 and stage 1 each work on its own virtual engine),
and staggered requests with different prompt and output lengths each get Hugging Face's
``generate`` of its prompt alone: pp=2 on two gloo ranks (tiny Llama and GPT-2), tp=2 x pp=2 on
four; sampled requests draw what one process draws with their seeds; ``autopar serve`` on a pp=2
continuous plan answers requests through the CLI."""
from __future__ import annotations

import json

import pytest
import torch

from autopar.cli import main
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.iteration_ranks import LeaderIterations, follow_iterations
from runtime.launch import run_local
from tests.helpers.serving import assert_served_like_generate, fail_a_tick_after_admitting

torch.set_num_threads(1)

from test_iteration_engine import REQUESTS, _alone, _continuous_plan, _model, _serve_staggered  # noqa: E402


# each request's sampling: greedy, temperature with top-p, temperature with top-k; seeded
SAMPLINGS = [[{}, {"temperature": 0.9, "top_p": 0.95, "seed": i},
              {"temperature": 1.2, "top_k": 10, "seed": i}][i % 3] for i in range(len(REQUESTS))]


class _Sampled:
    """An engine whose ``add`` gives each request its sampling of ``samplings``, in order."""

    def __init__(self, engine, samplings):
        self.engine, self.samplings = engine, iter(samplings)

    def add(self, prompt, new):
        return self.engine.add(prompt, new, next(self.samplings))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _worked(engine):
    """Record, per tick, the virtual engine this rank's stage worked on: [(tick, index)]."""
    log, work = [], engine._work

    def logged(ve):
        log.append((engine.ticks - 1, engine.flights.index(ve)))
        return work(ve)
    engine._work = logged
    return log


def _pp_rank(rank, world, plan_json, name, samplings=None):
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(_model(name), plan)
    pool = plan.predictions.get("kv_cache_tokens_per_replica")
    assert engine.kv_tokens == (None if pool is None else pool // plan.pp)   # each virtual engine's share
    assert engine.slots == plan.batch_size and len(engine.flights) == plan.pp
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = 3, 9, 7, None
    skips = sum(type(m).__name__ == "Skip" for m in engine.model.modules())
    worked = _worked(engine)
    if rank > 0:
        return follow_iterations(engine), engine.stage, skips, worked
    leader = LeaderIterations(engine)
    seqs, log = _serve_staggered(_Sampled(leader, samplings or [{}] * len(REQUESTS)), REQUESTS)
    leader.stop()
    turns = [ve.turns for ve in engine.flights]
    return ([s.tokens for s in seqs], engine.iterations, max(r for r, _ in log), engine.stage, skips, worked,
            engine.overlaps, turns)


def _check(results, name, ranks):
    model = _model(name)
    tokens, iterations, most, stage, skips, worked, overlaps, turns = results[0]
    assert tokens == [_alone(model, p, n) for p, n in REQUESTS]
    assert stage == 0 and skips > 0                     # stage 0 holds some layers only
    assert most > 3 and overlaps > 0 and min(turns) > 0  # more requests ran than one virtual engine's 3 slots
    for r in range(1, ranks):
        assert results[r][0] == iterations and results[r][2] > 0   # every rank ran every tick
    # the premise: in some tick stage 0 and the last stage each worked on its own virtual engine
    first, last = dict(worked), dict(results[ranks - 1][3])
    assert any(t in last and last[t] != v for t, v in first.items())


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_pp2_stages_run_the_same_iterations_and_equal_generate_alone(name):
    plan = _continuous_plan(2, name, tp=1, pp=2)
    assert (plan.tp, plan.pp, plan.dp) == (1, 2, 1)
    results = run_local(_pp_rank, 2, args=(plan.to_json(), name), timeout=300)
    _check(results, name, 2)
    assert results[1][1] == 1


def test_pp2_sampling_draws_what_one_process_draws():
    plan = _continuous_plan(2, "hf_llama", tp=1, pp=2)
    results = run_local(_pp_rank, 2, args=(plan.to_json(), "hf_llama", SAMPLINGS), timeout=300)
    one = IterationEngine(_model("hf_llama"), slots=3, prompt_len=9, max_new_tokens=7)
    seqs, _ = _serve_staggered(_Sampled(one, SAMPLINGS), REQUESTS)
    tokens, overlaps = results[0][0], results[0][6]
    assert tokens == [s.tokens for s in seqs] and overlaps > 0
    greedy = [_alone(_model("hf_llama"), p, n) for p, n in REQUESTS]
    assert any(t != g for t, g, s in zip(tokens, greedy, SAMPLINGS) if s)   # it really sampled
    assert all(t == g for t, g, s in zip(tokens, greedy, SAMPLINGS) if not s)


def test_tp2_pp2_equal_generate_alone():   # about 17 s on 2 cores
    plan = _continuous_plan(4, "hf_llama", tp=2, pp=2)
    assert (plan.tp, plan.pp, plan.dp) == (2, 2, 1)
    results = run_local(_pp_rank, 4, args=(plan.to_json(), "hf_llama"), timeout=600)
    _check(results, "hf_llama", 4)
    assert [r[1] for r in results[1:]] == [0, 1, 1]       # stage-major: ranks 0, 1 | 2, 3


def _trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{0.2 * i},{2 + i % 6},{1 + i % 5}\n" for i in range(16)))
    return str(path)


def test_autopar_serve_runs_a_pp2_continuous_plan(tmp_path):
    from autopar.inference.serve_process import serve_process
    out = tmp_path / "p.json"
    assert main(["plan-inference", "hf_llama", "--devices", "2", "--constraint", "tp=1", "--constraint", "pp=2",
                 "--constraint", "batch_size=4", "--trace", _trace(tmp_path), "--batching", "continuous",
                 "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert (plan["tp"], plan["pp"], plan["dp"]) == (1, 2, 1) and plan["predictions"]["batching"] == "continuous"
    with serve_process(["hf_llama", "--devices", "2", "--plan", str(out)]) as url:
        assert_served_like_generate(url, [[5, 6, 7], [9, 10, 11, 12, 13], [1, 2], [4]], [4, 2, 3, 1])


def _abort_rank(rank, world, plan_json):
    """Both stages run two ticks of one request, then a second request is added and the next
    tick fails on every rank in its stage's work, after its turn admitted the newcomer; returns the
    prompts the abort hands back."""
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(_model("hf_llama"), plan)
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = 3, 9, 7, None
    return fail_a_tick_after_admitting(engine)


def test_a_tick_failing_after_its_turn_admitted_a_newcomer_hands_it_back_on_abort():
    """A server answers every request an abort hands back (503 after a rank failed): one admitted
    in the failing tick was lost before (its client waited until its own timeout)."""
    plan = _continuous_plan(2, "hf_llama", tp=1, pp=2)
    for admitted, dropped, first, second, idle in run_local(_abort_rank, 2, args=(plan.to_json(),), timeout=120):
        assert second in admitted                      # the premise: the failing tick admitted it
        assert sorted(dropped) == sorted([first, second]) and idle
