"""Fused linear + cross-entropy: loss = cross_entropy(hidden @ weight.T, targets) without ever
holding the full [N, V] logits, and its vocabulary-parallel form.

The rows are taken in chunks (``chunk_rows``). For each chunk the logits are one torch matmul
(the inputs' dtype, fp32 accumulation); a Triton kernel reduces each row to its max, sum of
exponentials and target logit (fp32); a second kernel turns the chunk's logits, in place, into
the gradient of the loss with respect to them, (softmax - onehot) * scale, where scale is
1 / (number of targets that are not ``ignore_index``) for reduction "mean" and 1 for "sum", and 0
on ignored rows. The chunk's grad_hidden (grad_logits @ weight) and its share of grad_weight
(grad_logits.T @ hidden_chunk, summed in fp32) are computed there and then, in the forward. The
backward only scales the stored gradients by grad_output. Extra memory: one chunk of logits, the
gradients (kept from the forward to the backward), and during the forward an fp32 grad_weight
accumulator (plus one chunk's [V, D] product) when the weight is not fp32.

Vocabulary-parallel (``process_group`` given): ``weight`` is this rank's rows [vocab_start,
vocab_start + V_local) of the full [V, D] weight; ``hidden`` and ``targets`` (global ids) are the
same on every rank. Per chunk the row maxima are all-reduced (MAX), the sums of exponentials,
rescaled to the global max, all-reduced (SUM), and each rank's target-logit contribution (zero
where the target is another rank's) all-reduced (SUM), so every rank gets the full loss. The
grad_hidden, a partial sum over the vocabulary, is all-reduced (SUM) once at the end, so every
rank holds the full gradient of its (replicated) hidden; grad_weight is the gradient of this
rank's weight slice. ``vocab_start`` defaults to the sum of the lower ranks' V_local (one small
all-gather).
"""
from __future__ import annotations

import torch

from runtime.kernels import check_device, record_launch

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None

MAX_BLOCK_V = 4096
CHUNK_LOGITS_BYTES = 256 * 2**20   # the default chunk_rows keeps one chunk's logits about this size


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Plain torch: F.cross_entropy(hidden @ weight.T, targets) (full logits)."""
    return torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, ignore_index=ignore_index,
                                             reduction=reduction)


if triton is not None:
    @triton.jit
    def _ce_row_stats(LOGITS, TARGETS, MAX, SUMEXP, TLOGIT, n_cols, vocab_start, ignore_index,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * n_cols
        target = tl.load(TARGETS + row)
        local_t = tl.where(target == ignore_index, -1, target - vocab_start)
        m = float("-inf")
        s = 0.0
        t = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(x - m_new), 0.0), axis=0)
            m = m_new
            t += tl.sum(tl.where((cols == local_t) & mask, x, 0.0), axis=0)
        tl.store(MAX + row, m)
        tl.store(SUMEXP + row, s)
        tl.store(TLOGIT + row, t)

    @triton.jit
    def _ce_grad_logits(LOGITS, TARGETS, LSE, SCALE, n_cols, vocab_start, ignore_index,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * n_cols
        target = tl.load(TARGETS + row)
        ignored = target == ignore_index
        local_t = tl.where(ignored, -1, target - vocab_start)
        scale = tl.where(ignored, 0.0, tl.load(SCALE))
        lse = tl.load(LSE + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse) - tl.where(cols == local_t, 1.0, 0.0)
            tl.store(base + cols, (p * scale).to(LOGITS.dtype.element_ty), mask=mask)


def _vocab_start(weight: torch.Tensor, process_group) -> int:
    import torch.distributed as dist
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    mine = torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=process_group)
    return int(sum(int(s) for s in sizes[:rank]))


def default_chunk_rows(n_rows: int, vocab: int, element_size: int) -> int:
    """Rows per chunk keeping one chunk of logits near CHUNK_LOGITS_BYTES (at least 16 rows)."""
    rows = max(16, CHUNK_LOGITS_BYTES // max(1, vocab * element_size))
    return max(1, min(n_rows, rows))


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Loss and both gradients in the forward; the backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, chunk_rows, process_group,
                vocab_start, reduce_grad_hidden=True):
        check_device(hidden, weight)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"linear_cross_entropy: reduction {reduction!r} not supported (mean, sum)")
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight "
                             f"{tuple(weight.shape)} are not [N, D] and [V, D]")
        if targets.shape != (hidden.shape[0],):
            raise ValueError(f"linear_cross_entropy: targets {tuple(targets.shape)} != ({hidden.shape[0]},)")
        if weight.dtype != hidden.dtype:
            weight_c = weight.to(hidden.dtype)
        else:
            weight_c = weight
        hidden = hidden.contiguous()
        weight_c = weight_c.contiguous()
        targets = targets.contiguous().to(torch.int64)
        n_rows, _ = hidden.shape
        n_cols = weight_c.shape[0]
        dev = hidden.device
        if process_group is not None:
            import torch.distributed as dist
            if vocab_start is None:
                vocab_start = _vocab_start(weight_c, process_group)
        else:
            vocab_start = 0 if vocab_start is None else vocab_start
        chunk = chunk_rows or default_chunk_rows(n_rows, n_cols, hidden.element_size())
        need_dh = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        valid = targets != ignore_index
        if reduction == "mean":
            scale = (1.0 / valid.sum().to(torch.float32)).reshape(1)
        else:
            scale = torch.ones(1, dtype=torch.float32, device=dev)
        losses = torch.empty(n_rows, dtype=torch.float32, device=dev)
        grad_hidden = torch.empty_like(hidden) if need_dh else None
        if need_dw:
            grad_weight = torch.zeros(weight_c.shape, dtype=torch.float32, device=dev)
        else:
            grad_weight = None
        block = min(MAX_BLOCK_V, triton.next_power_of_2(max(1, n_cols)))
        warps = 8 if block >= 2048 else 4
        for start in range(0, n_rows, chunk):
            end = min(n_rows, start + chunk)
            rows = end - start
            h = hidden[start:end]
            t = targets[start:end]
            logits = h @ weight_c.t()
            row_max = torch.empty(rows, dtype=torch.float32, device=dev)
            sumexp = torch.empty_like(row_max)
            tlogit = torch.empty_like(row_max)
            _ce_row_stats[(rows,)](logits, t, row_max, sumexp, tlogit, n_cols, vocab_start,
                                   ignore_index, BLOCK=block, num_warps=warps)
            record_launch("linear_cross_entropy")
            if process_group is not None:
                global_max = row_max.clone()
                dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=process_group)
                sumexp = sumexp * torch.exp(row_max - global_max)
                dist.all_reduce(sumexp, op=dist.ReduceOp.SUM, group=process_group)
                dist.all_reduce(tlogit, op=dist.ReduceOp.SUM, group=process_group)
                row_max = global_max
            lse = row_max + torch.log(sumexp)
            losses[start:end] = torch.where(valid[start:end], lse - tlogit, 0.0)
            if need_dh or need_dw:
                _ce_grad_logits[(rows,)](logits, t, lse, scale, n_cols, vocab_start, ignore_index,
                                         BLOCK=block, num_warps=warps)
                record_launch("linear_cross_entropy")
                if need_dh:
                    torch.matmul(logits, weight_c, out=grad_hidden[start:end])
                if need_dw:
                    if grad_weight.dtype == logits.dtype:
                        grad_weight.addmm_(logits.t(), h)
                    else:
                        grad_weight += logits.t() @ h
            del logits
        if need_dh and process_group is not None and reduce_grad_hidden:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=process_group)
        if need_dw:
            grad_weight = grad_weight.to(weight.dtype)   # frees the fp32 accumulator
        loss = losses.sum() * scale[0] if reduction == "mean" else losses.sum()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = None if grad_hidden is None else grad_hidden * grad_output.to(grad_hidden.dtype)
        dw = None if grad_weight is None else grad_weight * grad_output.to(grad_weight.dtype)
        return dh, dw, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean",
                         chunk_rows: int | None = None, process_group=None,
                         vocab_start: int | None = None, reduce_grad_hidden: bool = True) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, targets) of hidden [N, D], weight [V, D], targets [N]
    (class ids; ``ignore_index`` rows count for nothing) without the full logits; reduction
    "mean" (over the targets that are not ignored) or "sum". ``chunk_rows`` rows of logits at a
    time (default: about CHUNK_LOGITS_BYTES of them). With ``process_group``, ``weight`` is this
    rank's vocabulary slice starting at ``vocab_start`` (module docstring). The loss is a 0-d
    tensor in hidden's dtype. ``reduce_grad_hidden`` False leaves grad_hidden a partial sum over
    ``process_group`` (a generated program's conjugate all-reduces it in backward)."""
    return LinearCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, reduction,
                                            chunk_rows, process_group, vocab_start, reduce_grad_hidden)
