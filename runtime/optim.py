"""Functional optimizers on flat fp32 buffers (on any device): AdamW, Adam, SGD(momentum), LAMB, LARS.

A ``FlatOptimizer`` updates one flat parameter buffer (or one shard of it) in place from the
matching flat gradient, with its state in plain tensors returned by ``init_state``. It holds no
reference to parameters, which is what lets the ZeRO optimizer (runtime/zero.py) run it on
whatever slice of a chunk a rank owns.

AdamW, Adam and SGD use exactly the formulas of torch.optim's single-tensor (CPU default)
code path, op for op, so a flat update equals torch.optim's per-tensor update element for element.

LAMB and LARS scale the update of each *tensor* by a trust ratio built from per-tensor norms.
On a flat shard one tensor may be split across ranks, so ``step`` takes ``Segments`` (which
element ranges of the buffer belong to which logical tensor) and an optional
``reduce_sq_norms`` callable that sums per-tensor squared norms in place across the shards
holding parts of the same tensors: runtime/zero.py sums them over the data group when ZeRO shards
the chunk and over the model axes that split the tensor, each replicated block counted once, so
the ratios are the whole tensors' under every plan.

Per-tensor settings (parameter groups, runtime/optim_groups.py): ``step`` takes an optional
``hparams`` (``TensorHParams``, one entry per tensor id of ``segments``, or one entry for a buffer
without segments): each tensor's weight decay, learning-rate factor and whether LAMB/LARS adapt
it. Without it every tensor takes the optimizer's own settings. The elementwise optimizers step
each segment with its own settings (the same ops as a whole-buffer step, so with uniform settings
the same bits).

The step on the host (``host_step``, what an offloaded optimizer runs: runtime/offload.py): the
fastest CPU implementation whose numerics match ``step`` within fp32 rounding. AdamW and Adam:
torch's fused CPU kernel (``torch.optim.adam.adam(..., fused=True)``, the public functional form
of ``torch.optim.AdamW(fused=True)``), 5.6x faster than the single-tensor ops on a 50M-element
fp32 shard (0.035 s against 0.197 s per step, 2 cores; differences of about one ulp of the
parameters, tests/runtime/test_cpu_step.py); ``cpu_fused=False`` keeps ``step``'s exact ops there
too. The others: ``step``.

Learning-rate schedule: ``schedule`` (a callable ``t -> multiplier``, runtime/lr_schedule.py) makes
step ``step_no``'s learning rate ``lr * schedule(step_no - 1)`` (``lr_at``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim.adam import adam as adam_functional

from runtime.optim_groups import TensorHParams

ReduceFn = Callable[[Tensor], None]  # sums a [k, num_ids] fp32 tensor in place across shards


@dataclass(frozen=True)
class Segments:
    """Element ranges of a flat buffer and the logical tensor (id) each belongs to.

    ``bounds`` has one more entry than ``ids``: segment i is ``[bounds[i], bounds[i+1])`` and
    belongs to tensor ``ids[i]`` (0 <= id < num_ids). Segments must cover the buffer.
    """

    bounds: tuple[int, ...]
    ids: tuple[int, ...]
    num_ids: int

    @staticmethod
    def from_sizes(sizes: Sequence[int]) -> "Segments":
        """One segment per tensor, laid out back to back (tensor i has id i)."""
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + int(s))
        return Segments(tuple(bounds), tuple(range(len(sizes))), len(sizes))

    def sq_norms(self, *xs: Tensor) -> Tensor:
        """[len(xs), num_ids] squared L2 norms of each x restricted to each logical tensor."""
        out = torch.zeros(len(xs), self.num_ids, dtype=torch.float32, device=xs[0].device)
        for i, tid in enumerate(self.ids):
            a, b = self.bounds[i], self.bounds[i + 1]
            if b > a:
                for k, x in enumerate(xs):
                    seg = x[a:b]
                    # torch's own reduction, not BLAS dot: a CPU BLAS sums by the buffer's alignment,
                    # so a host copy of the same values (offload) could differ in the last bits
                    out[k, tid] += torch.linalg.vector_norm(seg).square()
        return out

    def scale_(self, x: Tensor, per_id: Tensor) -> None:
        """x[segment] *= per_id[id of segment], in place."""
        for i, tid in enumerate(self.ids):
            a, b = self.bounds[i], self.bounds[i + 1]
            if b > a:
                x[a:b].mul_(per_id[tid])


class FlatOptimizer:
    """Base: ``init_state(numel)``, ``step(param, grad, state, step_no, ...)`` (step_no from 1)."""

    name = "base"
    state_names: tuple[str, ...] = ()
    needs_segments = False  # True: per-tensor trust ratios need Segments

    def __init__(self, lr: float):
        self.lr = float(lr)   # the base learning rate; a step's is lr_at(step_no)
        self.schedule: Optional[Callable[[int], float]] = None

    def lr_at(self, step_no: int) -> float:
        """The learning rate of step ``step_no`` (from 1): lr times the schedule's multiplier."""
        return self.lr if self.schedule is None else self.lr * float(self.schedule(int(step_no) - 1))

    @property
    def state_bytes_per_element(self) -> int:
        return 4 * len(self.state_names)  # every state tensor is fp32, one value per element

    def init_state(self, numel: int, device=None) -> dict[str, Tensor]:
        return {n: torch.zeros(numel, dtype=torch.float32, device=device) for n in self.state_names}

    @torch.no_grad()
    def step(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], step_no: int,
             segments: Optional[Segments] = None, reduce_sq_norms: Optional[ReduceFn] = None,
             hparams: Optional[TensorHParams] = None) -> None:
        raise NotImplementedError

    def host_step(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], step_no: int,
                  segments: Optional[Segments] = None, reduce_sq_norms: Optional[ReduceFn] = None,
                  hparams: Optional[TensorHParams] = None) -> None:
        """``step`` as an offloaded optimizer runs it on host tensors (module doc)."""
        self.step(param, grad, state, step_no, segments=segments, reduce_sq_norms=reduce_sq_norms,
                  hparams=hparams)

    def _triton_here(self, param, grad) -> bool:
        """Whether ``fused`` steps run their Triton kernel on these tensors (runtime/kernels)."""
        if not getattr(self, "fused", False):
            return False
        from runtime.kernels.ops import use_triton
        return use_triton(param) and grad.dtype == param.dtype == torch.float32 and grad.is_contiguous() \
            and param.is_contiguous()

    def _per_segment(self, param, grad, state, step_no, segments, hparams, update) -> None:
        """Elementwise optimizers: ``update(param, grad, state, step_no, lr, weight_decay)`` on
        each segment with its tensor's settings (one call for the whole buffer without segments)."""
        lr = self.lr_at(step_no)
        if segments is None:
            update(param, grad, state, step_no, lr * hparams.lr_scale[0], hparams.weight_decay[0])
            return
        for i, tid in enumerate(segments.ids):
            a, b = segments.bounds[i], segments.bounds[i + 1]
            if b > a:
                update(param[a:b], grad[a:b], {k: v[a:b] for k, v in state.items()}, step_no,
                       lr * hparams.lr_scale[tid], hparams.weight_decay[tid])


class Adam(FlatOptimizer):
    """torch.optim.Adam (decoupled=False) / AdamW (decoupled=True), amsgrad=False."""

    name = "adam"
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False, fused: bool = False, cpu_fused: bool = True):
        super().__init__(lr)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay, self.decoupled = float(eps), float(weight_decay), decoupled
        self.fused = fused   # AdamW as one Triton kernel (runtime/kernels/adamw.py) where it can run
        self.cpu_fused = cpu_fused   # host_step: torch's fused CPU kernel (module doc)
        if decoupled:
            self.name = "adamw"

    def _fused_here(self, param, grad) -> bool:
        return self.decoupled and self._triton_here(param, grad)

    @torch.no_grad()
    def step(self, param, grad, state, step_no, segments=None, reduce_sq_norms=None, hparams=None):
        if hparams is not None:
            return self._per_segment(param, grad, state, step_no, segments, hparams, self._update)
        self._update(param, grad, state, step_no, self.lr_at(step_no), self.weight_decay)

    @torch.no_grad()
    def host_step(self, param, grad, state, step_no, segments=None, reduce_sq_norms=None, hparams=None):
        if not (self.cpu_fused and param.device.type == "cpu" and param.dtype == grad.dtype == torch.float32):
            return self.step(param, grad, state, step_no, segments=segments, hparams=hparams)
        if hparams is not None:
            return self._per_segment(param, grad, state, step_no, segments, hparams, self._cpu_fused_update)
        self._cpu_fused_update(param, grad, state, step_no, self.lr_at(step_no), self.weight_decay)

    def _cpu_fused_update(self, param, grad, state, step_no, lr, weight_decay):
        """torch's fused CPU Adam(W) kernel on one flat piece (it counts the step up itself)."""
        adam_functional([param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [],
                              [torch.tensor(float(step_no - 1))], fused=True, amsgrad=False,
                              beta1=self.beta1, beta2=self.beta2, lr=lr, weight_decay=weight_decay,
                              eps=self.eps, maximize=False, decoupled_weight_decay=self.decoupled)

    def _update(self, param, grad, state, step_no, lr, weight_decay):
        b1, b2 = self.beta1, self.beta2
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if self._fused_here(param, grad):
            from runtime.kernels.adamw import adamw_step
            adamw_step(param, grad, exp_avg, exp_avg_sq, lr=lr, betas=(b1, b2), eps=self.eps,
                       weight_decay=weight_decay, step=int(step_no))
            return
        # Same op sequence as torch.optim.adam._single_tensor_adam (capturable=False).
        if weight_decay != 0:
            if self.decoupled:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - b1)
        exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        step = float(step_no)
        bias_correction1 = 1 - b1 ** step
        bias_correction2 = 1 - b2 ** step
        step_size = lr / bias_correction1
        # torch: (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps); the same ops, elementwise,
        # in place on one temporary (one allocation fewer, the same bits).
        denom = exp_avg_sq.sqrt().div_(bias_correction2 ** 0.5).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


class SGD(FlatOptimizer):
    """torch.optim.SGD: momentum, dampening, nesterov, weight_decay (coupled)."""

    name = "sgd"

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, fused: bool = False):
        super().__init__(lr)
        self.fused = fused   # one Triton kernel (runtime/kernels/optimizer_steps.py) where it can run
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.weight_decay, self.nesterov = float(weight_decay), nesterov
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum requires momentum > 0 and dampening = 0")
        # No momentum: no state at all, like torch.optim.SGD.
        self.state_names = ("momentum_buffer",) if self.momentum != 0 else ()

    @torch.no_grad()
    def step(self, param, grad, state, step_no, segments=None, reduce_sq_norms=None, hparams=None):
        if hparams is not None:
            return self._per_segment(param, grad, state, step_no, segments, hparams, self._update)
        self._update(param, grad, state, step_no, self.lr_at(step_no), self.weight_decay)

    def _update(self, param, grad, state, step_no, lr, weight_decay):
        if self._triton_here(param, grad):
            from runtime.kernels.optimizer_steps import sgd_step
            sgd_step(param, grad, state.get("momentum_buffer"), lr=lr, momentum=self.momentum,
                     dampening=self.dampening, weight_decay=weight_decay, nesterov=self.nesterov,
                     first=step_no == 1)
            return
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if self.momentum != 0:
            buf = state["momentum_buffer"]
            if step_no == 1:  # torch initialises the buffer to the first gradient
                buf.copy_(grad)
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.add_(grad, alpha=-lr)


def _trust(numer: Tensor, denom: Tensor) -> Tensor:
    # Standard convention: ratio 1 where either norm is zero (fresh/zero tensors, padding).
    ok = (numer > 0) & (denom > 0)
    return torch.where(ok, numer / torch.where(ok, denom, torch.ones_like(denom)), torch.ones_like(numer))


def _segments_or_whole(segments: Optional[Segments], numel: int) -> Segments:
    return segments if segments is not None else Segments.from_sizes([numel])


def _settings(hparams: Optional[TensorHParams], segs: Segments, weight_decay: float, always_adapt: bool,
              device) -> tuple[Optional[list], Tensor, Tensor]:
    """Per tensor id: weight decays (None: every tensor the optimizer's), learning-rate factors and
    the adapt mask (float 0/1); a buffer without segments has the single id 0."""
    n = segs.num_ids
    if hparams is None:
        return None, torch.ones(n, device=device), torch.ones(n, device=device)
    if len(hparams) != n:
        raise ValueError(f"{len(hparams)} hparams entries for {n} tensor ids")
    adapt = [1.0 if (a or always_adapt) else 0.0 for a in hparams.adapt]
    wd = list(hparams.weight_decay)
    return (None if all(w == weight_decay for w in wd) else wd,
            torch.tensor(hparams.lr_scale, dtype=torch.float32, device=device),
            torch.tensor(adapt, dtype=torch.float32, device=device))


def _add_decay(x: Tensor, param: Tensor, segs: Segments, wd: Optional[list], weight_decay: float) -> Tensor:
    """x + wd * param, each segment with its tensor's decay (``wd`` None: ``weight_decay`` on all)."""
    if wd is None:
        return x.add_(param, alpha=weight_decay) if weight_decay != 0 else x
    for i, tid in enumerate(segs.ids):
        a, b = segs.bounds[i], segs.bounds[i + 1]
        if b > a and wd[tid] != 0:
            x[a:b].add_(param[a:b], alpha=wd[tid])
    return x


def _pieces(segs: Segments, wd: Optional[list]):
    """(start, end, tensor id) of the pieces one decay covers: the whole buffer when every tensor
    has the optimizer's decay (``wd`` None), else each segment."""
    if wd is None:
        return [(0, segs.bounds[-1], segs.ids[0] if segs.ids else 0)]
    return [(segs.bounds[i], segs.bounds[i + 1], tid) for i, tid in enumerate(segs.ids)]


def _wd_norm_term(p_norm: Tensor, wd: Optional[list], weight_decay: float) -> Tensor:
    return p_norm * (weight_decay if wd is None else torch.tensor(wd, dtype=p_norm.dtype, device=p_norm.device))


class LAMB(FlatOptimizer):
    """LAMB (You et al. 2019) as NVIDIA apex FusedLAMB (adam_w_mode, grad averaging): the Adam
    direction plus decoupled decay, ``u = m_hat / (sqrt(v_hat) + eps) + wd * p``, scaled per tensor
    by the trust ratio ||p||/||u|| (1 where either norm is 0); ``p -= lr * ratio * u``.
    ``trust_clip`` (timm): the ratio clipped to at most 1. Tensors a group does not adapt
    (runtime/optim_groups.py: ``adapt`` False, e.g. biases and norm weights under the BERT recipe)
    take ratio 1 unless ``always_adapt``."""

    name = "lamb"
    state_names = ("exp_avg", "exp_avg_sq")
    needs_segments = True

    def __init__(self, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, trust_clip: bool = False,
                 always_adapt: bool = False, fused: bool = False):
        super().__init__(lr)
        self.fused = fused   # Triton kernels (runtime/kernels/optimizer_steps.py) where they can run
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.eps, self.weight_decay, self.bias_correction = float(eps), float(weight_decay), bias_correction
        self.trust_clip, self.always_adapt = bool(trust_clip), bool(always_adapt)

    @torch.no_grad()
    def step(self, param, grad, state, step_no, segments=None, reduce_sq_norms=None, hparams=None):
        segs = _segments_or_whole(segments, param.numel())
        wd, scale, adapt = _settings(hparams, segs, self.weight_decay, self.always_adapt, param.device)
        b1, b2 = self.beta1, self.beta2
        m, v = state["exp_avg"], state["exp_avg_sq"]
        bc1 = 1 - b1 ** step_no if self.bias_correction else 1.0
        bc2 = 1 - b2 ** step_no if self.bias_correction else 1.0
        fused = self._triton_here(param, grad)
        if fused:   # moments and direction in one kernel per tensor's decay (module doc of the kernels)
            from runtime.kernels.optimizer_steps import lamb_apply, lamb_direction
            update = torch.empty_like(param)
            for a, b, tid in _pieces(segs, wd):
                lamb_direction(param[a:b], grad[a:b], m[a:b], v[a:b], update[a:b], betas=(b1, b2), eps=self.eps,
                               weight_decay=self.weight_decay if wd is None else wd[tid],
                               bias_correction1=bc1, bias_correction2=bc2)
        else:
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            update = (m / bc1) / ((v / bc2).sqrt().add_(self.eps))
            update = _add_decay(update, param, segs, wd, self.weight_decay)
        norms = segs.sq_norms(param, update)  # [2, num_ids]: ||p||^2, ||u||^2 of the local parts
        if reduce_sq_norms is not None:
            reduce_sq_norms(norms)
        ratio = _trust(norms[0].sqrt(), norms[1].sqrt())
        if self.trust_clip:
            ratio = ratio.clamp(max=1.0)
        ratio = torch.where(adapt > 0, ratio, torch.ones_like(ratio)) * scale
        if fused:
            lr, ratios = self.lr_at(step_no), ratio.tolist()
            for i, tid in enumerate(segs.ids):
                a, b = segs.bounds[i], segs.bounds[i + 1]
                lamb_apply(param[a:b], update[a:b], lr * ratios[tid])
            return
        segs.scale_(update, ratio)
        param.add_(update, alpha=-self.lr_at(step_no))


class LARS(FlatOptimizer):
    """LARS (You et al. 2017) with momentum: ``buf = momentum * buf + lr * local_lr * (g + wd p)``,
    ``p -= buf``, local_lr = coef*||p|| / (||g|| + wd*||p|| + eps) (1 where either norm is 0).
    ``trust_clip`` (timm's LARC clipping): local_lr becomes min(local_lr / lr, 1). Tensors a group
    does not adapt take local_lr 1 unless ``always_adapt`` (timm's names)."""

    name = "lars"
    state_names = ("momentum_buffer",)
    needs_segments = True

    def __init__(self, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, trust_clip: bool = False,
                 always_adapt: bool = False, fused: bool = False):
        super().__init__(lr)
        self.fused = fused   # one Triton kernel per tensor (runtime/kernels/optimizer_steps.py) where it can run
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.trust_coefficient, self.eps = float(trust_coefficient), float(eps)
        self.trust_clip, self.always_adapt = bool(trust_clip), bool(always_adapt)

    @torch.no_grad()
    def step(self, param, grad, state, step_no, segments=None, reduce_sq_norms=None, hparams=None):
        segs = _segments_or_whole(segments, param.numel())
        wd, scale, adapt = _settings(hparams, segs, self.weight_decay, self.always_adapt, param.device)
        lr = self.lr_at(step_no)
        norms = segs.sq_norms(param, grad)
        if reduce_sq_norms is not None:
            reduce_sq_norms(norms)
        p_norm, g_norm = norms[0].sqrt(), norms[1].sqrt()
        local_lr = _trust(self.trust_coefficient * p_norm, g_norm + _wd_norm_term(p_norm, wd, self.weight_decay)
                          + self.eps)
        if self.trust_clip:
            local_lr = (local_lr / lr).clamp(max=1.0) if lr > 0 else torch.ones_like(local_lr)
        local_lr = torch.where(adapt > 0, local_lr, torch.ones_like(local_lr)) * scale
        if self._triton_here(param, grad):
            from runtime.kernels.optimizer_steps import lars_step
            buf, scales = state["momentum_buffer"], (local_lr * lr).tolist()
            for i, tid in enumerate(segs.ids):
                a, b = segs.bounds[i], segs.bounds[i + 1]
                lars_step(param[a:b], grad[a:b], buf[a:b], scale=scales[tid], momentum=self.momentum,
                          weight_decay=self.weight_decay if wd is None else wd[tid])
            return
        d = _add_decay(grad.clone(), param, segs, wd, self.weight_decay)
        segs.scale_(d, local_lr * lr)
        buf = state["momentum_buffer"]
        buf.mul_(self.momentum).add_(d)
        param.sub_(buf)


def make_optimizer(name: str, lr: float, fused: bool = False, **hparams) -> FlatOptimizer:
    """``name`` in adamw | adam | sgd | lamb | lars; hparams as in the matching class. ``fused``:
    the step's Triton kernels where they can run (AdamW, SGD, LAMB, LARS; Adam has none)."""
    key = name.lower()
    if key == "adamw":
        hparams.setdefault("weight_decay", 1e-2)  # torch.optim.AdamW's default
        return Adam(lr, decoupled=True, fused=fused, **hparams)
    if key == "adam":
        return Adam(lr, decoupled=False, **hparams)
    if key == "sgd":
        return SGD(lr, fused=fused, **hparams)
    if key == "lamb":
        return LAMB(lr, fused=fused, **hparams)
    if key == "lars":
        return LARS(lr, fused=fused, **hparams)
    raise ValueError(f"unknown optimizer {name!r}: expected adamw, adam, sgd, lamb or lars")


__all__ = ["FlatOptimizer", "Adam", "SGD", "LAMB", "LARS", "Segments", "make_optimizer"]
