"""`autopar plan CONFIG` and ``autopar.models.from_hf_config``: published Hugging Face configs
(written here from their public values, benchmarks/hf_configs.py; nothing downloaded) built on the
meta device and planned on dgx-h100 presets through the CLI, and each way the input can be wrong."""
import json
import re

import pytest
import torch

from autopar.cli import main
from autopar.errors import PlanError
from autopar.models import from_hf_config, is_hf_spec
from autopar.plans.plan import Plan
from benchmarks.hf_configs import CONFIGS, PARAMS_B, write_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")   # replicate-fallback warnings of mask ops


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_published_shapes_build_on_meta_with_their_parameter_counts(tmp_path, name):
    built = from_hf_config(write_config(name, tmp_path), seq=4096, batch=8)
    model, inputs = built                      # the factories' (model, example_inputs) contract
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e9 - PARAMS_B[name]) < 0.01, n
    assert all(p.is_meta for p in model.parameters())
    assert [tuple(t.shape) for t in inputs] == [(8, 4096), (8, 4096)] and inputs[0].dtype == torch.long
    assert built.task == "causal-lm"
    assert built.precision == ("fp32" if name == "Gemma-2-9B" else "bf16")   # Gemma 2's config says float32
    assert from_hf_config(write_config(name, tmp_path), seq=16, batch=2, dtype="bf16").precision == "bf16"


def test_config_object_directory_and_path_give_the_same_model(tmp_path):
    path = write_config("Mistral-7B", tmp_path, num_hidden_layers=1)
    a = from_hf_config(path, seq=32, batch=2)
    b = from_hf_config(path.parent, seq=32, batch=2)
    c = from_hf_config(a.config, seq=32, batch=2)
    shapes = [[(k, tuple(v.shape)) for k, v in m.model.state_dict().items()] for m in (a, b, c)]
    assert shapes[0] == shapes[1] == shapes[2]
    assert a.config.sliding_window == 4096


def test_task_comes_from_the_architectures(tmp_path):
    tf = pytest.importorskip("transformers")
    tiny = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=64)
    bert = tf.BertConfig(**tiny, architectures=["BertForMaskedLM"])
    assert from_hf_config(bert, seq=8, batch=2).task == "masked-lm"
    t5 = tf.T5Config(num_layers=1, num_heads=2, d_model=16, d_kv=8, d_ff=32, vocab_size=64,
                     architectures=["T5ForConditionalGeneration"])
    assert from_hf_config(t5, seq=8, batch=2).task == "seq2seq"
    vit = tf.ViTConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                       image_size=8, patch_size=4, num_labels=3, architectures=["ViTForImageClassification"])
    built = from_hf_config(vit, batch=2)
    assert built.task == "image-classification"
    assert [tuple(t.shape) for t in built.inputs] == [(2, 3, 8, 8), (2,)]
    # without architectures a decoder config is a causal LM
    assert from_hf_config(tf.LlamaConfig(**tiny), seq=8, batch=2).task == "causal-lm"


def test_is_hf_spec_dispatch(tmp_path):
    assert not is_hf_spec("gpt2") and not is_hf_spec("hf_llama") and not is_hf_spec("pkg.mod:make")
    assert not is_hf_spec("examples/model.py:make") and not is_hf_spec("model.py")
    assert is_hf_spec("config.json") and is_hf_spec(str(tmp_path)) and is_hf_spec("meta-llama/Meta-Llama-3-8B")


def _plan_cli(capsys, tmp_path, name, *extra):
    path = write_config(name, tmp_path)
    out_file = tmp_path / f"{name}.json"
    code, out, err = run(capsys, "plan", path, "--cluster", "dgx-h100", "-o", out_file, *extra)
    assert code == 0, err
    return Plan.load(out_file), out


@pytest.mark.slow   # 60-110 s each on a loaded 2-core machine: the dgx-h100 search, not the model's size
@pytest.mark.parametrize("name, seq, batch", [("Llama-3-8B", 256, 16), ("Mixtral-8x7B", 256, 16)])
def test_cli_plans_a_config_json_cut_to_two_layers(capsys, tmp_path, name, seq, batch):
    """The published widths, two layers (``--arg`` overrides config fields), short sequences. Mixtral's
    experts run as one ``autopar::moe_experts`` op (runtime/moe.py): its activations are O(tokens ×
    hidden), so it plans the same tokens as Llama (transformers' static "batched_mm" copied each token's
    expert weights and only seq 16 × batch 8 fitted)."""
    p, out = _plan_cli(capsys, tmp_path, name, "--seq", seq, "--batch", batch, "--arg", "num_hidden_layers=2")
    assert f"{name}/config.json:" in out and "causal-lm" in out and "-> precision bf16" in out
    assert p.data["settings"]["precision"] == "bf16"
    assert p.data["cluster"]["name"] == "dgx-h100" and p.world_size == 8
    d = p.degrees
    assert d["dp"] * d["num_micro_batches"] * d["micro_batch_size"] == batch


@pytest.mark.slow
@pytest.mark.parametrize("name, nodes, batch", [("Llama-3-8B", 2, 512)])
def test_cli_plans_published_configs_full_size(capsys, tmp_path, name, nodes, batch):
    """Minutes each (benchmarks/RESULTS.md, Hugging Face configs), so CI plans one at full size;
    benchmarks/bench_hf_configs.py plans all six (Mixtral 8x7B included, with runtime/moe.py's
    experts operator: benchmarks/RESULTS.md §18)."""
    p, _ = _plan_cli(capsys, tmp_path, name, "--seq", 4096, "--batch", batch, "--nodes", nodes, "--dtype", "bf16")
    assert p.world_size == 8 * nodes
    assert p.peak_memory <= 80e9


def test_precision_flags(capsys, tmp_path):
    path = write_config("Gemma-2-9B", tmp_path, num_hidden_layers=1)
    for flags, want in ((["--dtype", "bfloat16"], "bf16"), (["--precision", "bf16"], "bf16")):
        code, out, err = run(capsys, "plan", path, "--seq", 64, "--batch", 8, "--cluster", "cpu", "--devices", 2,
                             "--arg", "vocab_size=1024", *flags, "-o", tmp_path / "p.json")
        assert code == 0, err
        assert Plan.load(tmp_path / "p.json").data["settings"]["precision"] == want


def _error(capsys, *argv):
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert err.startswith("autopar: error: ") and "Traceback" not in err
    return err


def test_errors(capsys, tmp_path, monkeypatch):
    cluster = ("--cluster", "dgx-h100")
    llama = write_config("Llama-3-8B", tmp_path)
    err = _error(capsys, "plan", tmp_path / "nowhere" / "config.json", "--seq", 8, "--batch", 8, *cluster)
    assert "does not exist" in err
    (tmp_path / "empty").mkdir()
    err = _error(capsys, "plan", tmp_path / "empty", "--seq", 8, "--batch", 8, *cluster)
    assert "has no config.json" in err
    bad = tmp_path / "bad" / "config.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({**CONFIGS["Llama-3-8B"], "model_type": "llamaa"}))
    err = _error(capsys, "plan", bad, "--seq", 8, "--batch", 8, *cluster)
    assert "'llamaa' is unknown to transformers" in err and "llama" in err
    (tmp_path / "broken.json").write_text("{not json")
    assert "as JSON" in _error(capsys, "plan", tmp_path / "broken.json", "--seq", 8, "--batch", 8, *cluster)
    err = _error(capsys, "plan", llama, "--seq", 8, "--batch", 8, "--task", "masked-lm", *cluster)
    assert "task 'masked-lm' is not supported by a llama config" in err and "causal-lm" in err
    assert "--batch" in _error(capsys, "plan", llama, "--seq", 8, *cluster)
    assert "needs seq" in _error(capsys, "plan", llama, "--batch", 8, *cluster)
    assert "no field 'n_layer'" in _error(capsys, "plan", llama, "--seq", 8, "--batch", 8, "--arg", "n_layer=2",
                                          *cluster)
    assert "not supported" in _error(capsys, "plan", llama, "--seq", 8, "--batch", 8, "--dtype", "int8", *cluster)
    assert "give one" in _error(capsys, "plan", llama, "--seq", 8, "--batch", 8, "--dtype", "bf16",
                                "--precision", "fp32", *cluster)
    # a name: neither a zoo model nor in the (empty) local Hugging Face cache; never downloaded
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    err = _error(capsys, "plan", "acme/NoSuchModel-7B", "--seq", 8, "--batch", 8, *cluster)
    assert "unknown model 'acme/NoSuchModel-7B'" in err and "local Hugging Face cache" in err and "gpt2" in err
    # factories: --seq/--batch reach a factory that takes them, and are an error for one that does not
    assert "takes no 'seq'" in _error(capsys, "plan", "mlp", "--seq", 8, "--cluster", "cpu", "--devices", 2)
    assert "--task is for Hugging Face configs" in _error(capsys, "plan", "gpt2", "--task", "causal-lm",
                                                          "--cluster", "cpu", "--devices", 2)
    assert "give it once" in _error(capsys, "plan", "gpt2", "--seq", 8, "--arg", "seq=8", "--cluster", "cpu",
                                    "--devices", 2)


def test_factory_takes_seq_and_batch_flags(capsys, tmp_path):
    code, out, err = run(capsys, "plan", "gpt2", "--seq", 32, "--batch", 4, "--cluster", "cpu", "--devices", 2,
                         "-o", tmp_path / "p.json")
    assert code == 0, err
    d = Plan.load(tmp_path / "p.json").degrees
    assert d["dp"] * d["num_micro_batches"] * d["micro_batch_size"] == 4


def test_python_api_errors(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        from_hf_config(tmp_path / "x.json", seq=8, batch=2)
    with pytest.raises(PlanError, match="takes no seq"):
        tf = pytest.importorskip("transformers")
        from_hf_config(tf.ViTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                    intermediate_size=32, image_size=8, patch_size=4), seq=8, batch=2)
    with pytest.raises(PlanError, match="positive whole number"):
        from_hf_config(write_config("Llama-3-8B", tmp_path), seq=0, batch=2)


def test_cli_plans_a_model_name_from_the_local_cache(tmp_path):
    """A name without ':' is read from the Hugging Face cache (local_files_only; here a cache laid
    out as huggingface_hub does, in a subprocess since the hub reads HF_HUB_CACHE at import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = tmp_path / "hub" / "models--acme--Tiny"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps(
        {**CONFIGS["Mistral-7B"], "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "plan", "acme/Tiny", "--seq", "16", "--batch", "4",
                          "--cluster", "cpu", "--devices", "2", "-o", str(tmp_path / "p.json")],
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "acme/Tiny: MistralForCausalLM (mistral, causal-lm)" in out.stdout
    assert Plan.load(tmp_path / "p.json").world_size == 2


def test_show_code_and_ops_take_the_config_a_plan_was_made_from(capsys, tmp_path):
    path = write_config("Mistral-7B", tmp_path, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    shape = ["--seq", 16, "--batch", 4]
    code, out, err = run(capsys, "plan", path, *shape, "--cluster", "cpu", "--devices", 2, "--dtype", "fp32",
                         "-o", tmp_path / "p.json")
    assert code == 0, err
    code, out, err = run(capsys, "show", tmp_path / "p.json", "--code", "--rank", 1, "--factory", path, *shape,
                         "--dtype", "fp32")
    assert code == 0, err
    assert out.startswith("# rank 1 of mesh") and "def forward" in out
    code, out, err = run(capsys, "ops", path, *shape)
    assert code == 0, err
    assert re.search(r"\n\d+ ops, \d+ on the replicate fallback\n$", out) and "MistralForCausalLM" in out
    # another shape is another model: the plan's fingerprint says so
    code, out, err = run(capsys, "show", tmp_path / "p.json", "--code", "--factory", path, "--seq", 8, "--batch", 4,
                         "--dtype", "fp32")
    assert code != 0 and "different model" in (out + err)
    code, out, err = run(capsys, "ops", "gpt2", "--task", "causal-lm")
    assert code == 2 and "--task is for Hugging Face configs" in err
