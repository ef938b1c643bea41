"""Issue 34: inference weights from a training checkpoint. A tiny zoo model is trained with autopar
(SGD, a few steps, so its weights are not its initialization) and written with ``compiled.save``
(torch.distributed.checkpoint, each rank its pieces); ``compile_inference(model, plan=...,
weights=DIR)`` then reads that directory (autopar/inference/engine_inputs.py ``checkpoint_reader``
through autopar/execution/weights.py ``open_weights``: ``DcpWeights``, the zoo wrapper's ``model.``
prefix mapped to the Hugging Face model that generates). The model given to ``compile_inference``
is built on the meta device or freshly initialized (other values than the trained ones): greedy
tokens equal Hugging Face ``generate`` of the trained model (its gathered state dict loaded into a
plain model), on the modules backend (one process, tp=2 on gloo ranks) and the codegen backend
(one process, tp=2), the modules backend also pp=2; the values read are the trained ones, and each
rank reads only its blocks (``read.elements``). A directory that is neither format is a clear error naming both."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ExecutionError
from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.planner import plan_inference
from autopar.models import hf
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14], [0, 40, 41, 42, 43, 44]])
MASK = (PROMPTS != 0).long()
NEW = 5
VOCAB = 64
STEPS = 3
SGD = {"optimizer": "sgd", "lr": 0.5, "momentum": 0.9}
TRAIN = {"hf_llama": {"tp": 2}, "hf_gpt2": {"dp": 2}}   # how each is trained (2 gloo ranks)


def _wrapper(name, device="cpu", seed=0):
    """The zoo's (LossWrapper around the Hugging Face model, batch)."""
    return getattr(hf, name)(vocab=VOCAB, device=device, seed=seed)


def _train_and_save(rank, world, name, constraints, directory):
    model, batch = _wrapper(name)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch,
                         plan_options={"constraints": {"num_micro_batches": 1, **constraints}}, **SGD)
    for _ in range(STEPS):
        cm.step(*batch)
    cm.save(directory)
    full = {k: v.clone() for k, v in cm.full_state_dict().items()}   # collective: every rank
    return full if rank == 0 else None


_TRAINED: dict = {}


def trained(name, tmp_path_factory):
    """(checkpoint directory, the trained Hugging Face model): trained once per module."""
    if name not in _TRAINED:
        directory = str(tmp_path_factory.mktemp(f"ck-{name}") / "ck")
        sd = run_local(_train_and_save, 2, args=(name, TRAIN[name], directory), timeout=400)[0]
        model = _wrapper(name)[0]
        init = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(sd)
        changed = [k for k in sd if not torch.equal(sd[k], init[k])]
        assert len(changed) > len(sd) // 2, "training left the weights at their initialization"
        assert _reference(model.model.eval()) != _reference(_wrapper(name)[0].model.eval()), \
            "the trained model generates what its initialization does: the tokens would not tell them apart"
        _TRAINED[name] = (directory, model.model.eval())
    return _TRAINED[name]


def _reference(lm):
    with torch.no_grad():
        return lm.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, pad_token_id=0).tolist()


def _plan(name, world, **pins):
    lm = _wrapper(name, device="meta")[0].model
    return plan_inference(lm, PROMPTS, autopar.Cluster.preset("cpu", devices=world), max_new_tokens=NEW,
                          constraints=pins, dtype="fp32")


def _params(lm) -> int:
    return sum(p.numel() for p in lm.parameters())   # tied aliases once


def _fresh_lm(name, meta: bool):
    """The architecture without the trained values: on meta, or a fresh init of another seed."""
    return _wrapper(name, device="meta" if meta else "cpu", seed=123)[0].model


def _blocks_are_trained(local: dict, full: dict, rank: int, tp: int) -> list[str]:
    """Names of ``local`` (this rank's parameters) that are not the trained tensor, or its rank's
    chunk along the one dim the shard splits."""
    wrong = []
    for k, t in local.items():
        want = full[k]
        if t.shape != want.shape:
            dims = [d for d in range(t.dim()) if t.shape[d] != want.shape[d]]
            want = want.chunk(tp, dims[0])[rank] if len(dims) == 1 else None
        if want is None or not torch.equal(t.float(), want.float()):
            wrong.append(k)
    return wrong


# ------------------------------------------------------------------ modules backend


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_modules_one_process_reads_the_trained_weights(name, tmp_path_factory):
    """A freshly initialized model (other values) given weights=DIR generates with the trained ones;
    GPT-2's tied head reads its embedding once."""
    directory, ref = trained(name, tmp_path_factory)
    lm = _fresh_lm(name, meta=False)
    assert not torch.equal(lm.get_input_embeddings().weight, ref.get_input_embeddings().weight)
    engine = compile_inference(lm, plan=_plan(name, 1), weights=directory)
    assert engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist() == _reference(ref)
    want = dict(ref.named_parameters())
    assert _blocks_are_trained(dict(engine.model.named_parameters()), want, 0, 1) == []
    assert engine.read.elements == _params(ref)
    if name == "hf_gpt2":
        assert engine.model.lm_head.weight is engine.model.transformer.wte.weight   # still tied


def _modules_tp(rank, world, name, plan_json, directory):
    lm = _fresh_lm(name, meta=True)
    engine = compile_inference(lm, plan=InferencePlan.from_json(plan_json), weights=directory)
    out = engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist()
    local = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    return out, engine.read.elements, local, _params(engine.model)


@pytest.mark.slow
@pytest.mark.parametrize("pins", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_modules_tp2_or_pp2_each_rank_reads_its_blocks(pins, tmp_path_factory):
    """tp=2 (each rank its column / row blocks) or pp=2 (each stage its layers)."""
    name = "hf_llama"
    directory, ref = trained(name, tmp_path_factory)
    plan = _plan(name, 2, **pins)
    assert (plan.tp, plan.pp) == (pins.get("tp", 1), pins.get("pp", 1))
    results = run_local(_modules_tp, 2, args=(name, plan.to_json(), directory), timeout=400)
    want, full = _reference(ref), dict(ref.named_parameters())
    for rank, (out, elements, local, held) in enumerate(results):
        assert out == want
        assert _blocks_are_trained(local, full, rank if plan.tp > 1 else 0, plan.tp) == []
        if plan.pp == 1:
            assert elements == held < _params(ref)   # exactly what it holds: its blocks, not the whole tensors
        else:   # its stage's layers (the stage's ends swap the embedding or head for pass-throughs after reading)
            assert held <= elements < _params(ref)
    assert sum(r[1] for r in results) < 2 * _params(ref)


# ------------------------------------------------------------------ codegen backend


@pytest.mark.slow
def test_codegen_one_process_reads_the_trained_weights(tmp_path_factory):
    name = "hf_llama"
    directory, ref = trained(name, tmp_path_factory)
    engine = compile_inference(_fresh_lm(name, meta=True), plan=_plan(name, 1), weights=directory,
                               backend="codegen")
    assert engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist() == _reference(ref)
    assert engine.read.elements == _params(ref)


def _codegen_tp(rank, world, name, plan_json, directory):
    engine = compile_inference(_fresh_lm(name, meta=True), plan=InferencePlan.from_json(plan_json),
                               weights=directory, backend="codegen")
    return engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist(), engine.read.elements


@pytest.mark.slow
def test_codegen_tp2_reads_fused_qkv_blocks_of_a_trained_gpt2(tmp_path_factory):
    """GPT-2's q, k and v blocks come out of the trained fused ``c_attn`` (``mapped_read``); its head
    is tied to the embeddings."""
    name = "hf_gpt2"
    directory, ref = trained(name, tmp_path_factory)
    plan = _plan(name, 2, tp=2, dp=1)
    results = run_local(_codegen_tp, 2, args=(name, plan.to_json(), directory), timeout=600)
    for out, elements in results:
        assert out == _reference(ref)
        assert 0 < elements < _params(ref)


# ------------------------------------------------------------------ errors


def test_a_directory_of_neither_format_is_a_clear_error(tmp_path):
    lm = _wrapper("hf_llama")[0].model
    plan = _plan("hf_llama", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExecutionError, match=r"neither a Hugging Face checkpoint.*nor a compiled\.save\(\) "
                                             r"directory.*safetensors.*compiled\.save\(DIR\)"):
        compile_inference(lm, plan=plan, weights=str(tmp_path / "empty"))
    with pytest.raises(ExecutionError, match="no such directory.*safetensors.*compiled.save"):
        compile_inference(lm, plan=plan, weights=str(tmp_path / "absent"), backend="codegen")
