"""autopar.inference.codegen_stages: a tiny Llama's prefill and decode steps run as pipeline stages
of autopar's per-rank programs on gloo ranks (pp=2, and pp=2 x tp=2), for left-padded prompts of
different lengths: every rank returns the greedy tokens of Hugging Face's ``generate``; each rank
holds only its layers' parameters and cache blocks (count and bytes, and equal to the one-process
cache's block); and the hidden states went from each stage rank to its counterpart on the next
stage by point-to-point send / recv, nothing else of the model crossing."""
from __future__ import annotations

import pytest
import torch

import autopar

from autopar.inference.codegen_stages import StageStepRunner, plan_stage_steps, unit_stages_of
from autopar.inference.codegen_step import CacheStep, plan_cache_step
from autopar.models import hf
from codegen.rank_program import block_slices
from runtime.launch import run_local
from tests.helpers.cache_steps import reference_checked_against_hf

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14]])   # left-padded
MASK = (PROMPTS != 0).long()
MAX_LEN, NEW, PREFILL, LAYERS = 16, 4, 8, 4


def _lm(name="hf_llama"):
    torch.manual_seed(0)
    return getattr(hf, name)(seq=32, n_layer=LAYERS)[0].model.eval()


def _rank(rank, world, step, steps, pp, unit_stage):
    import torch.distributed as dist

    from runtime import context as RC

    RC.setup(steps[1].plan.mesh, pp=pp)
    runner = StageStepRunner(step, steps, rank, pp, unit_stage)
    log = []   # every point-to-point message this rank sent or received: (op, peer, shape)
    send, recv = dist.send, dist.recv

    def logged_send(t, dst, *a, **k):
        log.append(("send", dst, tuple(t.shape)))
        return send(t, dst, *a, **k)

    def logged_recv(t, src=None, *a, **k):
        log.append(("recv", src, tuple(t.shape)))
        return recv(t, src, *a, **k)

    dist.send, dist.recv = logged_send, logged_recv
    try:
        tokens = runner.generate(PROMPTS, MASK, NEW)
    finally:
        dist.send, dist.recv = send, recv
    prog = runner.programs[1]
    slices = [block_slices(lay, shape, prog.mesh_shape, prog.coords)
              for lay, shape in zip(runner.cache_layouts, runner.cache_shapes)]
    fqns = sorted({f for s in runner.programs for f in runner.param_fqns(s)})   # every program's
    return dict(tokens=tokens, cache=runner.cache, names=runner.cache_names, slices=slices,
                plan_bytes=runner.cache_bytes(), fqns=fqns, log=log, stage=runner.stage, unit_stage=runner.unit_stage,
                param_bytes=runner.param_bytes())


def _layer_of(fqn):
    parts = fqn.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def _check(pp, tp, planner_cut, name="hf_llama"):
    lm = _lm(name)
    step = CacheStep(lm)
    B, P = PROMPTS.shape
    ref_tokens, ref_cache = reference_checked_against_hf(lm, step, PROMPTS, MASK, PREFILL, MAX_LEN, NEW)
    steps = plan_stage_steps(step, B, (PREFILL,), MAX_LEN, tp=tp, policy="megatron")
    unit_stage = None   # an even cut by layers
    if planner_cut:   # the cut of the step planned with pp (and the micro-batches the planner asks for)
        pipelined = plan_cache_step(step, B, 1, MAX_LEN, autopar.Cluster.preset("cpu", devices=pp * tp),
                                    constraints={"pp": pp, "pp_schedule": "gpipe", "dp": 1, "tp": tp})
        unit_stage = unit_stages_of(pipelined.plan)
    out = run_local(_rank, pp * tp, args=(step, steps, pp, unit_stage), timeout=900)
    hidden = lm.config.hidden_size
    whole = dict(step.named_parameters()) | dict(step.named_buffers())
    for rank in range(pp * tp):
        r = out[rank]
        stage = r["stage"]
        assert stage == rank // tp
        assert r["tokens"].tolist() == ref_tokens.tolist()   # = HF generate's
        # only its layers' cache: 2 tensors per layer, its tp share of their bytes, equal to the
        # one-process cache's block
        assert r["unit_stage"] == (unit_stage or [u * pp // LAYERS for u in range(LAYERS)])
        mine = [u for u in range(LAYERS) if r["unit_stage"][u] == stage]
        assert mine
        assert r["names"] == [f"kv_{2 * u + j}" for u in mine for j in (0, 1)]
        want = [ref_cache[2 * u + j] for u in mine for j in (0, 1)]
        layer_bytes = sum(c.numel() * c.element_size() for c in want)
        assert r["plan_bytes"] == layer_bytes // tp
        assert sum(c.numel() * c.element_size() for c in r["cache"]) == r["plan_bytes"]
        for got, w, sl in zip(r["cache"], want, r["slices"]):
            torch.testing.assert_close(got, w[sl], atol=1e-5, rtol=1e-5)
        # only its layers' parameters (the embedding on the first stage, final norm and head on the last)
        layers = {_layer_of(f) for f in r["fqns"]} - {None}
        assert layers == set(mine)
        tied = lm.config.tie_word_embeddings   # the table is the head too: on the first and last stage
        assert ("lm.model.embed_tokens.weight" in r["fqns"]) == (stage == 0 or (tied and stage == pp - 1))
        assert ("lm.lm_head.weight" in r["fqns"]) == (stage == pp - 1 and not tied)
        held = sum(whole[f].numel() * whole[f].element_size() for f in r["fqns"])   # these tensors whole
        assert r["param_bytes"] == held if tp == 1 else held // tp <= r["param_bytes"] < held
        # point to point: this rank's block of the hidden states [B, S, hidden] (whole, or its rows
        # where the plan splits the batch over tp between blocks) to the same tp position of the
        # next stage, once per step (prefill then NEW - 1 decodes), after one header per program
        data = [(op, peer, shape) for op, peer, shape in r["log"] if shape != (8,)]
        lengths = [PREFILL] + [1] * (NEW - 1)
        sends = [(peer, shape) for op, peer, shape in data if op == "send"]
        recvs = [(peer, shape) for op, peer, shape in data if op == "recv"]
        assert len(data) == len(sends) + len(recvs)
        for got, peer in ((sends, rank + tp), (recvs, rank - tp)):
            if got:
                assert [p for p, _ in got] == [peer] * NEW
                assert [shape[1:] for _, shape in got] == [(n, hidden) for n in lengths]
                assert all(shape[0] in (B, B // tp) for _, shape in got)
        assert bool(sends) == (stage < pp - 1) and bool(recvs) == (stage > 0)
        assert len(r["log"]) - len(data) == 2 * (stage < pp - 1) + 2 * (stage > 0)   # headers: 2 programs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_pp2_greedy_generation_equals_hf_each_stage_holding_its_layers(name):
    _check(pp=2, tp=1, planner_cut=True, name=name)


@pytest.mark.slow
def test_pp2_tp2_greedy_generation_equals_hf_each_rank_holding_its_block_of_its_layers():
    _check(pp=2, tp=2, planner_cut=False)
