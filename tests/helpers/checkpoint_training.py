"""Training under activation-checkpointing plans and measuring what it saves, shared by
tests/execution/test_checkpointing.py and tests/execution/test_selective_recompute.py: a two-stack GPT
(two block groups), the eager reference (SGD with momentum), one rank's compile-measure-train run,
and one process's gradients of a generated program."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.models import ZOO, build, example_tokens
from autopar.models.gpt2 import Block, GPTConfig
from helpers.exactness import train_eagerly
from runtime import checkpoint as RCK
from runtime import rng

STEPS = 3


LR = 0.05


MOMENTUM = 0.9


class TwoStacks(nn.Module):
    """Embeddings, two lower GPT blocks (MLP 4x), two upper ones (MLP 2x), head: two block groups."""

    def __init__(self, d=32, heads=2, vocab=64, seq=8, dropout=0.0):
        super().__init__()
        lo = GPTConfig(n_head=heads, d_model=d, vocab=vocab, seq=seq, dropout=dropout, mlp_ratio=4)
        hi = GPTConfig(n_head=heads, d_model=d, vocab=vocab, seq=seq, dropout=dropout, mlp_ratio=2)
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.lower = nn.ModuleList(Block(lo) for _ in range(2))
        self.upper = nn.ModuleList(Block(hi) for _ in range(2))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in (*self.lower, *self.upper):
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def two_stacks(batch=8, seq=8, vocab=64, dropout=0.0, seed=0):
    model = build(lambda: TwoStacks(seq=seq, vocab=vocab, dropout=dropout), "cpu", seed)
    return model, example_tokens(batch, seq, vocab, "cpu", seed)


FACTORIES = {"gpt2": ZOO["gpt2"], "two_stacks": two_stacks}


def reference(name, steps=STEPS, **kw):
    """Eager single-process training with torch.optim.SGD(momentum): (losses, state_dict)."""
    model, batch = FACTORIES[name](**kw)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    return train_eagerly(model, batch, opt, steps)


def measured_activation_bytes(cm, batch) -> dict:
    """Saved-activation bytes of one forward of this rank's program (module doc)."""
    prog = cm.program
    inputs = cm._local_micro_batches(batch)[0]
    params = {t.untyped_storage()._cdata for t in cm.local}
    for c in cm.opt.chunks:   # ZeRO keeps parameters as views of flat buffers
        params.add(c.flat.untyped_storage()._cdata)

    def hooks(into: dict):
        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in params:
                into[st._cdata] = st.nbytes()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    outside: dict = {}
    cm._set_denominators([inputs])   # mean losses divide by the step's global count (runtime/loss.py)
    with torch.random.fork_rng(devices=[]):   # leave the training run's dropout masks alone
        with RCK.record_regions() as log, hooks(outside):
            loss = prog.gm(*cm.local, *inputs)
        kept = {}
        for _name, _body, args in log:
            for a in args:
                if isinstance(a, torch.Tensor) and a.untyped_storage()._cdata not in params:
                    kept[a.untyped_storage()._cdata] = a.untyped_storage().nbytes()
        held = {**outside, **kept}
        recompute = 0
        for _name, body, args in log:   # every rank runs the bodies in the same order: collectives match
            region: dict = {}
            with hooks(region), torch.enable_grad():
                body(*args)
            recompute = max(recompute, sum(nb for cd, nb in region.items() if cd not in held))
        del loss
    return {"outside": sum(outside.values()), "kept": sum(kept.values()), "recompute": recompute,
            "total": sum(held.values()) + recompute, "regions": len(log)}


def train_measured(rank, world, model, batch, plan_json, steps, measure):
    """Compile ``plan_json`` (SGD with momentum), measure saved activations if asked, train
    ``steps`` steps; returns the compiled model and what the checkpointing tests compare."""
    plan = autopar.Plan.from_json(plan_json)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch, plan=plan,
                         optimizer="sgd", lr=LR, momentum=MOMENTUM)
    measured = measured_activation_bytes(cm, batch) if measure else None
    RCK.STATS.reset()
    losses = [cm.step(*batch)]
    cm.reset_comm_stats()      # bytes of one whole step (the second), recomputation included
    losses.append(cm.step(*batch))
    comm = cm.comm_stats()
    losses += [cm.step(*batch) for _ in range(steps - 2)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return cm, dict(losses=losses, sd=sd if rank == 0 else None, measured=measured, comm=comm,
                    regions=list(cm.program.checkpoint_regions))


def program_grads(prog, model, batch, seed=0):
    def value(fqn):
        obj = model
        for part in fqn.split("."):
            obj = getattr(obj, part)
        return obj

    params = [value(prog.param_fqn[n]).detach().clone().requires_grad_(n not in prog.buffers)
              for n in prog.param_names]
    rng.set_seed(seed)   # the random ops' base seed and position (runtime/rng.py): each call draws alike
    loss = prog.gm(*params, *batch)
    loss.backward()
    return loss.detach(), [p.grad for p in params if p.requires_grad]
