"""Large-batch training: AdamW vs LAMB at a base batch and at 8x and 32x (issue 33).

A 2-layer causal transformer (d 64, 4 heads, pre-LN) learns sequences drawn from a fixed random
second-order Markov chain over V tokens: each pair of previous tokens has ``FANOUT`` possible
successors with Dirichlet weights. The achievable loss is the chain's entropy rate (computed here
from the generating probabilities on the evaluation sequences: the Bayes loss).

Protocol: the base batch B0 trains ``K`` steps with each optimizer's recipe, giving each
optimizer its OWN target (its best evaluation loss on 256 held-out sequences at B0 after K steps)
and a COMMON target (the better of the two). At 8 B0 and 32 B0 each optimizer trains with its
recipe and a step budget of K/4 resp. K/8, and we report the first step (evaluated every step) at
which the evaluation loss reaches each target, or "-" if it never does; seconds are training
seconds (evaluation excluded) to the own target. Recipes (one per optimizer, the same at every batch):

* AdamW (betas 0.9/0.999, weight decay 0.01 with the BERT no-decay group), linear lr scaling
  from B0, warm-up 10% of the budget then linear decay to 0 ("warmup-poly", power 1);
* LAMB (apex FusedLAMB semantics, BERT recipe groups, weight decay 0.01), sqrt lr scaling from B0,
  the same schedule; grad_clip 1.0 for both.

The base lr of each optimizer is swept over ``LRS`` at every batch (the scaled lr times the sweep
factor), and each row reports the best factor (fewest steps to the common target, then to the
own target, then lowest final loss).

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
LRS = (0.5, 1.0, 2.0, 4.0, 8.0)
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
        # N(0, 1) like nn.Embedding's default: at GPT-2's 0.02 LAMB's steps, relative to ||w||,
        # leave the positions ~unused and it plateaus at ~2.4 at every batch (RESULTS.md §17)
        nn.init.normal_(self.pos, std=1.0)

    def forward(self, x, y):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.ln(h))
        # the first two positions cannot be predicted from a second-order context: not scored
        return F.cross_entropy(logits[:, 1:].reshape(-1, V), y[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------- training
def train(chain, opt_name: str, batch: int, lr_factor: float, budget: int, evalx, every_step: bool, seed: int = 0):
    """Train ``budget`` steps; return (eval loss after each step, or only the last unless
    ``every_step``; seconds of training (evaluation excluded) up to each of them)."""
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
    evals, secs, train_s = [], [], 0.0
    for step in range(1, budget + 1):
        t0 = time.perf_counter()
        x = chain.sample(batch, g)
        loss = model(x[:, :-1], x[:, 1:])
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            clip_grad_norm([p.grad for p in named.values()], 1.0)
            for n, p in named.items():
                opt.step(p.data.view(-1), p.grad.view(-1), states[n], step, hparams=hps[n])
        train_s += time.perf_counter() - t0
        if every_step or step == budget:
            with torch.no_grad():
                evals.append(float(model(evalx[:, :-1], evalx[:, 1:])))
            secs.append(train_s)
    return evals, secs


def first_hit(evals, secs, target):
    """(step, seconds) of the first evaluation at or under ``target``, or (None, None)."""
    for i, e in enumerate(evals):
        if e <= target:
            return i + 1, secs[i]
    return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="K=128, one lr per optimizer (a smoke run)")
    ap.add_argument("--only", nargs=3, metavar=("OPT", "MULT", "BUDGET"),
                    help="one extra sweep: optimizer, batch multiple of B0, step budget (needs --target)")
    ap.add_argument("--lrs", type=float, nargs="+", help="lr factors of the sweep (default: LRS)")
    ap.add_argument("--target", type=float, help="--only: the target loss (a main run's)")
    args = ap.parse_args()
    global K, LRS
    if args.quick:
        K, LRS = 128, (1.0,)
    if args.lrs:
        LRS = tuple(args.lrs)
    torch.set_num_threads(1)
    chain = Chain(0)
    evalx = chain.sample(256, torch.Generator().manual_seed(7))
    bayes = chain.bayes_loss(evalx)
    if args.only:
        name, mult, budget = args.only[0], int(args.only[1]), int(args.only[2])
        for f in LRS:
            ev, secs = train(chain, name, B0 * mult, f, budget, evalx, every_step=True)
            hit, hs = first_hit(ev, secs, args.target)
            print(f"B={B0 * mult} {name} budget {budget} lr x{f}: steps to {args.target} {hit} "
                  f"({f'{hs:.1f} s' if hs else '-'}), best eval {min(ev):.4f}, final eval {ev[-1]:.4f}", flush=True)
        return
    print(f"V={V} T={T} d={D} layers={LAYERS}; chain fan-out {FANOUT}: achievable (Bayes) eval loss {bayes:.4f}, "
          f"uniform {math.log(V):.4f}")
    base = {}
    for name in ("adamw", "lamb"):
        for f in LRS:
            ev, secs = train(chain, name, B0, f, K, evalx, every_step=False)
            base[name] = min(base.get(name, (math.inf,)), (ev[-1], f, secs[-1]))
            print(f"B0={B0} {name} lr x{f}: final eval {ev[-1]:.4f} ({secs[-1]:.1f} s)", flush=True)
    own = {name: base[name][0] for name in base}
    common = min(own.values())
    print(f"targets after K={K} steps at B0={B0}: adamw {own['adamw']:.4f}, lamb {own['lamb']:.4f}; "
          f"common (the better) {common:.4f}")
    rows = [(name, B0, K, base[name][1], (K if base[name][0] <= common else None), K, base[name][2],
             base[name][0]) for name in ("adamw", "lamb")]
    for mult, budget in ((8, K // 4), (32, K // 8)):
        for name in ("adamw", "lamb"):
            runs = []
            for f in LRS:
                ev, secs = train(chain, name, B0 * mult, f, budget, evalx, every_step=True)
                hc, sc = first_hit(ev, secs, common)
                ho, so = first_hit(ev, secs, own[name])
                runs.append(((hc or math.inf, ho or math.inf, ev[-1]), f, hc, sc, ho, so, ev[-1]))
                print(f"B={B0 * mult} {name} lr x{f}: steps to common target {hc}, to own target {ho}, "
                      f"final eval {ev[-1]:.4f} ({secs[-1]:.1f} s)", flush=True)
            _, f, hc, sc, ho, so, final = min(runs)
            rows.append((name, B0 * mult, budget, f, hc, ho, so, final))
    print()
    print(f"| optimizer | batch | budget | best lr factor | steps to common target {common:.3f} | steps to own "
          f"B0 target | fraction of K={K} (own) | train seconds to own target | final eval loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, b, budget, f, hc, ho, so, final in rows:
        frac = f"1/{K / ho:.1f}" if ho else "-"
        print(f"| {name} | {b} | {budget} | {f} | {hc or '-'} | {ho or '-'} | {frac} | "
              f"{f'{so:.1f}' if so else '-'} | {final:.4f} |")
    print(f"\nachievable (Bayes) loss {bayes:.4f}; own targets adamw {own['adamw']:.4f}, lamb {own['lamb']:.4f}")


if __name__ == "__main__":
    main()
