"""Fine-tune a pretrained Hugging Face causal LM from a local checkpoint directory, under an
automatic plan, without ever holding the whole model in one process.

The model is built from the checkpoint's ``config.json`` on the meta device (no memory), rank 0
plans, and every rank reads only its own slices of the safetensors files
(``autopar.compile(..., weights=DIR)``). Data: a token file (``--data``, int64 ``.pt`` tensor of
shape (N, seq)) or, without one, one batch of random tokens repeated (a smoke test: the loss
must go down).

    torchrun --nproc_per_node 4 examples/finetune.py --checkpoint ./my-llama --steps 20
    autopar run -n 4 examples/finetune.py --checkpoint ./my-llama --steps 20
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint HOST:29500 \\
        examples/finetune.py --checkpoint /data/llama-7b --cluster dgx-a100 --nodes 2 --batch 64 --seq 2048

``--save DIR`` writes a torch.distributed.checkpoint at the end (loadable onto any plan:
``weights=DIR``).
"""
from __future__ import annotations

import argparse
import os
import time


def build_meta(checkpoint: str):
    """The checkpoint's architecture on the meta device, wrapped so forward(input_ids, labels)
    returns the loss (parameter names: the checkpoint's, prefixed by ``model.``)."""
    import torch
    import transformers

    from autopar.models.hf import LossWrapper

    config = transformers.AutoConfig.from_pretrained(checkpoint)
    config._attn_implementation = "sdpa"   # attention as one traced op
    with torch.device("meta"):
        return LossWrapper(transformers.AutoModelForCausalLM.from_config(config)), config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Fine-tune a local Hugging Face checkpoint under autopar.")
    ap.add_argument("--checkpoint", required=True, help="directory with config.json and model.safetensors[.index.json]")
    ap.add_argument("--cluster", default="cpu", help="preset name (default cpu: these processes)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--data", default=None, help="int64 .pt tensor (N, seq) of tokens")
    ap.add_argument("--save", default=None)
    a = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    import autopar

    model, config = build_meta(a.checkpoint)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cluster = (autopar.Cluster.preset("cpu", devices=world) if a.cluster == "cpu"
               else autopar.Cluster.preset(a.cluster, nodes=a.nodes))
    if a.data:
        tokens = torch.load(a.data)
    else:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(config.vocab_size, (a.batch, a.seq), generator=g)
    example = (torch.zeros(a.batch, a.seq, dtype=torch.long), torch.zeros(a.batch, a.seq, dtype=torch.long))
    t0 = time.perf_counter()
    cm = autopar.compile(model, cluster, example_inputs=example, optimizer=a.optimizer, lr=a.lr,
                         weights=a.checkpoint)
    rank = dist.get_rank()
    if rank == 0:
        print(f"set-up {time.perf_counter() - t0:.1f} s; plan: {cm.plan.degrees}", flush=True)
    for step in range(a.steps):
        start = (step * a.batch) % max(1, len(tokens) - a.batch + 1)
        ids = tokens[start:start + a.batch]
        loss = cm.step(ids, ids.clone())   # HF causal LMs shift the labels themselves
        if rank == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    if a.save:
        cm.save(a.save)
        if rank == 0:
            print(f"checkpoint written to {a.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
