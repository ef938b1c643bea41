"""Shared pieces of the exactness tests of loss conventions and micro-batching (test_losses.py,
test_micro_batching.py): tiny models whose losses are means over targets, an eager one-process
reference trained with SGD + momentum, and a runner that trains a plan on forked gloo ranks."""
from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

STEPS = 3
LR, MOMENTUM = 0.5, 0.9    # a large step: a wrong loss scale or count shows in the parameters at once
B, T, V, D = 8, 6, 32, 16

# Valid (not ignore_index) targets per row of the batch: very uneven, so data-parallel halves,
# micro-batches and their quarters all hold different counts.
MLM_VALID = [1, 0, 2, 0, 5, 6, 3, 1]
PAD_LENGTHS = [6, 2, 1, 4, 6, 3, 5, 1]


class TinyLM(nn.Module):
    """Embedding, one hidden layer, a vocabulary head; mean cross-entropy over the labels
    (ignore_index -100), optionally with class weights (a buffer)."""

    def __init__(self, class_weights: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.hidden = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.class_weights = class_weights
        if class_weights:
            self.register_buffer("weight", torch.linspace(0.5, 2.0, V))

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.hidden(self.emb(ids))))
        w = self.weight if self.class_weights else None
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), weight=w, ignore_index=-100)


def lm_batch(kind: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    keep = torch.zeros(B, T, dtype=torch.bool)
    for r in range(B):
        if kind == "mlm":     # a few masked positions per row, at random places
            keep[r, torch.randperm(T, generator=g)[:MLM_VALID[r]]] = True
        else:                 # padded rows: the tail of each row is padding
            keep[r, :PAD_LENGTHS[r]] = True
    return ids, labels.masked_fill(~keep, -100)


def tiny_lm(kind: str = "mlm", class_weights: bool = False):
    torch.manual_seed(0)
    return TinyLM(class_weights), lm_batch(kind)


def valid_counts(labels, pieces: int) -> list[int]:
    """Valid targets in each of ``pieces`` equal consecutive row blocks."""
    return [int((c != -100).sum()) for c in labels.chunk(pieces, dim=0)]


def train_eagerly(model, batch, opt, steps: int = STEPS):
    """The reference every exactness test compares with: ``steps`` plain PyTorch steps of ``opt``
    on one process; returns (losses, final state_dict)."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_matches_eager(rank_losses, state, ref_losses, ref_sd, param_rtol: float = 1e-4, label: str = ""):
    """The comparison every multi-process exactness test makes: every rank reports the same
    losses, they equal eager's (rel 1e-5), and rank 0's full ``state`` (numpy arrays, as they come
    back from forked ranks) has eager's keys and values (rel ``param_rtol``)."""
    losses0 = rank_losses[0]
    for r, losses in enumerate(rank_losses):
        assert losses == losses0, f"rank {r} reports different losses"
    torch.testing.assert_close(torch.tensor(losses0), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(state) == set(ref_sd)
    for k, want in ref_sd.items():
        torch.testing.assert_close(torch.from_numpy(state[k]), want, rtol=param_rtol, atol=1e-6,
                                   msg=lambda m: f"{label}{k}: {m}")


def sgd(params, lr: float = LR, momentum: float = MOMENTUM):
    """torch.optim.SGD with momentum over the trainable ``params`` (frozen ones left out)."""
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=lr, momentum=momentum)


def eager(factory, steps: int = STEPS):
    """One process, plain PyTorch: (losses, state_dict) after ``steps`` SGD-momentum steps."""
    model, batch = factory()
    return train_eagerly(model, batch, sgd(model.parameters()), steps)


def _train(rank, world, factory, plan_json, steps):
    model, batch = factory()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=LR, momentum=MOMENTUM)
    losses = [cm.step(*batch) for _ in range(steps)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return losses, (sd if rank == 0 else None), cm.comm_stats(), cm.batch_rows()


def run(factory, plan, steps: int = STEPS):
    """Train ``plan`` on ``plan.mesh.size`` forked ranks: per rank (losses, state (rank 0), comm, rows)."""
    return run_local(_train, plan.mesh.size, args=(factory, plan.to_json(), steps), timeout=240)


def check(factory, plan, steps: int = STEPS):
    """Every rank's losses equal eager's (rel 1e-5), rank 0's parameters too (rel 1e-4)."""
    want_losses, want_sd = eager(factory, steps)
    res = run(factory, plan, steps)
    for losses, *_ in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-7)
    sd = res[0][1]
    for k, v in want_sd.items():
        torch.testing.assert_close(torch.from_numpy(sd[k]), v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    return res


def force(plan, model, batch, picks) -> autopar.Plan:
    """A hand-edited plan: ops matched by ``picks`` (predicate(fx node) -> predicate(strategy))
    get the first candidate strategy the second predicate accepts."""
    from autopar.rules import spec_for
    from autopar.rules.strategy import enumerate_strategies
    from autopar.frontend.trace import trace

    data = json.loads(plan.to_json())
    nodes = {n.name: n for n in trace(model, batch).gm.graph.nodes}
    for op in data["ops"]:
        node = nodes[op["node"]]
        for match, want in picks:
            if match(node):
                cands = enumerate_strategies(spec_for(node), plan.mesh)
                st = next(s for s in cands if want(s))
                op.update(strategy=st.name, inputs=[None if l is None else l.to_json() for l in st.inputs],
                          outputs=[l.to_json() for l in st.outputs], splits=list(st.splits),
                          special=list(st.special))
                break
    return autopar.Plan(data)
