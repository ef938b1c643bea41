"""Large-batch training: AdamW vs LAMB at a base batch and at 8x and 32x (issue 33).

A 2-layer causal transformer (d 64, 4 heads, pre-LN) learns sequences drawn from a fixed random
second-order Markov chain over V tokens: each pair of previous tokens has ``FANOUT`` possible
successors with Dirichlet weights. The achievable loss is the chain's entropy rate (computed here
from the generating probabilities on the evaluation sequences: the Bayes loss).

Protocol: the base batch B0 trains ``K`` steps with each optimizer's recipe; the TARGET is the
better of the two optimizers' evaluation loss (256 held-out sequences) at B0 after K steps. At 8 B0 and 32 B0 each
optimizer trains with its recipe and a step budget of K/4 resp. K/8, and we report the first
step (evaluated every step) at which the evaluation loss reaches the target, or "-" if it never
does. Recipes (one per optimizer, the same at every batch):

* AdamW (betas 0.9/0.999, weight decay 0.01 with the BERT no-decay group), linear lr scaling
  from B0, warm-up 10% of the budget then linear decay to 0 ("warmup-poly", power 1);
* LAMB (apex FusedLAMB semantics, BERT recipe groups, weight decay 0.01), sqrt lr scaling from B0,
  the same schedule; grad_clip 1.0 for both.

The base lr of each optimizer is swept over ``LRS`` at every batch (the scaled lr times the sweep
factor), and each row reports the best factor (fewest steps to target, then lowest final loss).

The optimizers, groups, schedules and lr scaling are autopar's (runtime/optim.py,
runtime/optim_groups.py, runtime/lr_schedule.py), driven per parameter in one process exactly as
the ZeRO optimizer's stage-0 path drives them (``hparams`` per tensor): this measures optimizer
semantics, not parallelism.

    PYTHONPATH=. python -m benchmarks.bench_large_batch [--quick]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime.clip import clip_grad_norm
from runtime.lr_schedule import make_schedule, scaled_lr
from runtime.optim import make_optimizer
from runtime.optim_groups import TensorHParams, resolve_groups

V, T, D, H, LAYERS = 32, 32, 64, 4, 2
FANOUT = 3
B0, K = 8, 512
LRS = (0.5, 1.0, 2.0, 4.0)
BASE_LR = {"adamw": 4e-3, "lamb": 1e-2}
SCALING = {"adamw": "linear", "lamb": "sqrt"}


# ----------------------------------------------------------------------------- data
class Chain:
    """A fixed random second-order Markov chain over V tokens."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.succ = torch.stack([torch.randperm(V, generator=g)[:FANOUT] for _ in range(V * V)])   # [V*V, F]
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            w = torch.distributions.Dirichlet(torch.full((FANOUT,), 0.5)).sample((V * V,))
        self.prob = torch.zeros(V * V, V)
        self.prob.scatter_(1, self.succ, w)

    def sample(self, n: int, g: torch.Generator) -> torch.Tensor:
        x = torch.empty(n, T + 1, dtype=torch.long)
        x[:, :2] = torch.randint(0, V, (n, 2), generator=g)
        for t in range(2, T + 1):
            ctx = x[:, t - 2] * V + x[:, t - 1]
            x[:, t] = torch.multinomial(self.prob[ctx], 1, generator=g).squeeze(1)
        return x

    def bayes_loss(self, x: torch.Tensor) -> float:
        """The mean -log p(next | two previous) under the chain, over predicted positions >= 2."""
        ctx = x[:, :-1][:, :-1] * V + x[:, 1:-1]
        p = self.prob[ctx.reshape(-1), x[:, 2:].reshape(-1)]
        return float(-p.log().mean())


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x, y):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.ln(h))
        # the first two positions cannot be predicted from a second-order context: not scored
        return F.cross_entropy(logits[:, 1:].reshape(-1, V), y[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------- training
def train(chain, opt_name: str, batch: int, lr_factor: float, budget: int, target: float | None,
          evalx, seed: int = 0):
    """Train ``budget`` steps; return (eval losses per step, steps to ``target`` or None, seconds to it)."""
    torch.manual_seed(seed)
    model = LM()
    named = dict(model.named_parameters())
    opt = make_optimizer(opt_name, lr_factor * scaled_lr(BASE_LR[opt_name], batch, B0, SCALING[opt_name]),
                         weight_decay=0.01)
    opt.schedule = make_schedule("warmup-poly", warmup_steps=max(1, budget // 10), total_steps=budget, power=1.0)
    groups = resolve_groups({n: tuple(p.shape) for n, p in named.items()}, "bert", 0.01)
    hps = {n: TensorHParams.of([groups[n]]) for n in named}
    states = {n: opt.init_state(p.numel()) for n, p in named.items()}
    g = torch.Generator().manual_seed(1000 + seed)
    evals, hit, hit_s, t0 = [], None, None, time.perf_counter()
    for step in range(1, budget + 1):
        x = chain.sample(batch, g)
        loss = model(x[:, :-1], x[:, 1:])
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            grads = [p.grad for p in named.values()]
            clip_grad_norm(grads, 1.0)
            for n, p in named.items():
                opt.step(p.data.view(-1), p.grad.view(-1), states[n], step, hparams=hps[n])
            if target is None and step < budget:   # a base run: only its final loss is read
                continue
            ev = float(model(evalx[:, :-1], evalx[:, 1:]))
        evals.append(ev)
        if target is not None and hit is None and ev <= target:
            hit, hit_s = step, time.perf_counter() - t0
    return evals, hit, hit_s, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="K=128, one lr per optimizer (a smoke run)")
    args = ap.parse_args()
    global K, LRS
    if args.quick:
        K, LRS = 128, (1.0,)
    torch.set_num_threads(1)
    chain = Chain(0)
    evalx = chain.sample(256, torch.Generator().manual_seed(7))
    bayes = chain.bayes_loss(evalx)
    print(f"V={V} T={T} d={D} layers={LAYERS}; chain fan-out {FANOUT}: achievable (Bayes) eval loss {bayes:.4f}, "
          f"uniform {math.log(V):.4f}")
    # base batch: both optimizers, K steps, the lr sweep; the target is the best final loss
    base = {}
    for name in ("adamw", "lamb"):
        for f in LRS:
            ev, _, _, secs = train(chain, name, B0, f, K, None, evalx)
            base[name, f] = (ev, secs)
            print(f"B0={B0} {name} lr x{f}: final eval {ev[-1]:.4f} ({secs:.1f} s)", flush=True)
    target = min(ev[-1] for ev, _ in base.values())
    print(f"TARGET (best base-batch eval loss after K={K} steps): {target:.4f}")
    rows = []
    for name in ("adamw", "lamb"):
        best = min(((f, *base[name, f]) for f in LRS), key=lambda r: r[1][-1])
        ev = best[1]
        rows.append((name, B0, K, best[0], K if ev[-1] <= target else None, best[2] if ev[-1] <= target else None,
                     ev[-1], best[2]))
    for mult, budget in ((8, K // 4), (32, K // 8)):
        for name in ("adamw", "lamb"):
            runs = []
            for f in LRS:
                ev, hit, hit_s, secs = train(chain, name, B0 * mult, f, budget, target, evalx)
                runs.append((hit if hit is not None else math.inf, ev[-1], f, hit, hit_s, secs))
                print(f"B={B0 * mult} {name} lr x{f}: steps to target {hit}, final eval {ev[-1]:.4f} "
                      f"({secs:.1f} s)", flush=True)
            _, final, f, hit, hit_s, secs = min(runs)
            rows.append((name, B0 * mult, budget, f, hit, hit_s, final, secs))
    print()
    print(f"| optimizer | batch | budget (steps) | best lr factor | steps to target | fraction of K={K} | "
          f"seconds to target | final eval loss | run seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, b, budget, f, hit, hit_s, final, secs in rows:
        frac = f"1/{K / hit:.1f}" if hit else "-"
        print(f"| {name} | {b} | {budget} | {f} | {hit or '-'} | {frac} | "
              f"{f'{hit_s:.1f}' if hit_s else '-'} | {final:.4f} | {secs:.1f} |")
    print(f"\nachievable (Bayes) loss {bayes:.4f}; target {target:.4f}")


if __name__ == "__main__":
    main()
