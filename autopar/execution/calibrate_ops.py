"""Per-rule figures calibration measures: each rule's backward / forward time ratio
(``measure_backward_ratios``), on a CPU each rule's forward rate in the FLOPs its rule counts
(``measure_op_rates``, timed on cold inputs) and the fixed cost of a tiny op per rule
(``measure_op_floors``); ``rule_ops`` is one call of each measured rule.
"""
from __future__ import annotations

from autopar.rules.table import spec_for

# ops whose backward / forward ratio and forward rate are measured (autopar rule name -> (forward
# function, its arguments) on representative activation shapes); the rest use the median ratio


def rule_ops(dtype, device, large: bool = False) -> dict:
    """One call of each measured rule; ``large``: a GPU's sizes (launch-bound otherwise)."""
    import torch
    import torch.nn.functional as F
    b, s, h, heads = (8, 1024, 2048, 16) if large else (8, 128, 256, 4)
    kw = dict(dtype=dtype, device=device)

    def leaf(*shape):
        return torch.randn(*shape, **kw, requires_grad=True)
    x, y = leaf(b, s, h), leaf(b, s, h)
    w, bias = leaf(h), leaf(h)
    q, k, v = (leaf(b, heads, s, h // heads) for _ in range(3))
    logits = leaf(b * s, 1024)
    target = torch.randint(0, 1024, (b * s,), device=device)
    table = leaf(1024, h)
    idx = torch.randint(0, 1024, (b, s), device=device)
    return {
        "gelu": (F.gelu, (x,)),
        "layer_norm": (lambda x, w, b_: F.layer_norm(x, (h,), w, b_), (x, w, bias)),
        "softmax": (lambda x: torch.softmax(x, -1), (x,)),
        "dropout": (lambda x: F.dropout(x, 0.1, training=True), (x,)),
        "add": (lambda x, y: x + y, (x, y)),
        "mul": (lambda x, y: x * y, (x, y)),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)),
        "cross_entropy": (F.cross_entropy, (logits, target)),
        "embedding": (lambda i, t: F.embedding(i, t), (idx, table)),
    }


def measure_backward_ratios(ratio, dtype, device, large: bool = False) -> dict:
    import torch
    out = {}
    for rule, (f, args) in rule_ops(dtype, device, large).items():
        g = torch.ones_like(f(*args))

        def fw(f=f, args=args):   # with autograd recording, as a training forward runs (SDPA on a
            f(*args)              # CPU takes another kernel under no_grad)

        def fb(f=f, args=args, g=g):
            f(*args).backward(g)
        out[rule] = max(0.1, ratio(fw, fb))
    return out


def measure_op_rates(timed, dtype, device) -> dict:
    """FLOP/s of each rule's forward as the planner counts its FLOPs: the op traced as the planner
    traces a model (torch.export), its rule's OpSpec FLOPs over the timed forward (with autograd
    recording). Rules whose FLOPs are not what bounds them (memory-bound: add, mul, dropout,
    embedding) still get one; pricing takes the larger of the FLOP and byte times."""
    import torch

    class _Op(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, *args):
            return self.f(*args)
    out = {}
    for rule, (f, args) in rule_ops(dtype, device).items():
        try:
            ep = torch.export.export(_Op(f), tuple(a.detach() for a in args))
            specs = [spec_for(n) for n in ep.graph.nodes if n.op == "call_function"]
        except Exception:   # an op the exporter or the rules cannot take here: no rate, the default
            continue
        flops = sum(sp.flops for sp in specs if sp is not None and sp.rule == rule)
        if flops > 0:
            sets = _cold_copies(args)
            at = [0]

            def call(f=f, sets=sets):   # each call on the next copy: its inputs are not in cache
                at[0] = (at[0] + 1) % len(sets)
                f(*sets[at[0]])
            out[rule] = flops / timed(call)
    return out


# A training step's working set is larger than the CPU's caches: an op meets inputs another op
# wrote a while ago. Timed on one input again and again, a 1 MB GELU runs from cache 2.5x faster
# than in the bench gpt2's step (0.05 ms against 0.13 ms cold, 0.2 ms in the step; measured
# on these CPUs), and every memory-bound rule was priced that much too fast. Cycling through copies
# whose bytes together exceed the last-level cache times each call cold.
COLD_BYTES = 64 << 20


def _cold_copies(args) -> list:
    """Copies of ``args`` (tensors cloned, others shared) totalling at least ``COLD_BYTES``."""
    import torch
    size = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)) or 1
    n = max(2, min(256, -(-COLD_BYTES // size)))
    return [tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for a in args) for _ in range(n)]


# a tiny activation: every op on it is all fixed cost (dispatch, autograd bookkeeping, set-up)
FLOOR_SHAPE = (16, 64)
FLOOR_CHAIN = 16


def measure_op_floors(timed, dtype, device) -> dict:
    """Least (forward, backward) seconds of one op per rule on a tiny activation, as training runs
    it: a chain of ``FLOOR_CHAIN`` such ops through autograd, each with its own parameters (one
    AccumulateGrad each, as a model's layers), forward alone and forward + backward; the
    backward engine's start is shared by the chain."""
    import torch
    import torch.nn.functional as F
    n, h = FLOOR_SHAPE
    kw = dict(dtype=dtype, device=device)

    def leaves(*shape):
        return [torch.randn(*shape, **kw, requires_grad=True) for _ in range(FLOOR_CHAIN)]
    x0 = torch.randn(n, h, **kw, requires_grad=True)
    ws, bs, zs = leaves(h, h), leaves(h), leaves(n, h)
    ones = [torch.ones(h, **kw, requires_grad=True) for _ in range(FLOOR_CHAIN)]
    steps = {
        "linear": lambda y, i: F.linear(y, ws[i], bs[i]),
        "gelu": lambda y, i: F.gelu(y),
        "add": lambda y, i: y + zs[i],
        "mul": lambda y, i: y * zs[i],
        "layer_norm": lambda y, i: F.layer_norm(y, (h,), ones[i], bs[i]),
        "softmax": lambda y, i: torch.softmax(y, -1),
    }
    out = {}
    for rule, f in steps.items():
        def fw(f=f):
            y = x0
            for i in range(FLOOR_CHAIN):
                y = f(y, i)
            return y

        def fb(fw=fw):
            fw().sum().backward()
        t_f = timed(fw)
        t_fb = timed(fb)
        out[rule] = [t_f / FLOOR_CHAIN, max(0.0, t_fb - t_f) / FLOOR_CHAIN]
    return out
