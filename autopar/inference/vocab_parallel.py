"""The next token from vocabulary-parallel logits: ``VocabShard``, ``next_tokens``, ``GreedyOfSlices``.

Under tensor parallelism an untied LM head is vocabulary-parallel (autopar/inference/tp_shard.py):
rank r of tp holds the head's rows [r V/tp, (r+1) V/tp), so its logits are that slice of every
row's vocabulary. This module owns choosing each row's next token from the slices without
gathering the whole logits; only the last position's logits of each row are used:

- **greedy**: each rank takes its slice's maximum and its argmax (``torch.argmax``: the first
  maximum), made a global index by the rank's offset; the (value, index) pairs are all-gathered
  over the tensor-parallel group (2 numbers per row per rank) and the largest value wins, ties to
  the lowest global index: what ``torch.argmax`` of the whole row returns.
- **sampling with top_k > 0**: each rank's k largest (values and global indices, ties to the
  lowest index), all-gathered (2 k numbers per row per rank); the k largest of those, ties to the
  lowest index, are the candidates. Each row's scores are then a whole-vocabulary row of -inf but
  at its candidates, through Hugging Face's temperature and top-p warpers, a softmax and
  ``torch.multinomial`` with the sequence's seeded generator: the same tensors, hence the same
  draws, whatever the tp. (Hugging Face's top-k keeps every value equal to the k-th; here exactly
  k are kept: the two differ only on a tie at the k-th value.)
- **sampling over the whole vocabulary** (top_k 0): the last position's logits are all-gathered
  whole (V numbers per row), then sampled as above.

The continuous-batching engines (autopar/inference/iteration_engine.py, codegen_iteration.py)
call ``next_tokens`` for every row of a step; the static engine's greedy Hugging Face
``generate`` (autopar/inference/engine.py) picks its tokens through ``GreedyOfSlices``, a logits
processor (its sampling still gathers the whole logits, for Hugging Face's warpers and seeded
stream). The static codegen engine (autopar/inference/codegen_engine.py) takes ``greedy_tokens``,
or ``sample_rows``: a batch step of Hugging Face's sampling from the top-k candidates (2 k
numbers per row per rank; top_k 0: whole rows), the same draws from the same seeded stream.

One process, or a head kept whole on every rank (tied to the embeddings, or a vocabulary tp does
not divide), is a shard of one (``VocabShard()``): the same functions with no collective, so tp
ranks choose what one process chooses by construction. Values cross the group as float64, so the
logits' own dtype (fp32, bf16, fp16) compares exactly. Every rank of the group must call
``next_tokens`` with the same rows and sampling options (the engines' ranks run the same
iterations). ``VocabShard.gathered`` counts the elements all-gathered (what each rank receives,
its own part included).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class VocabShard:
    """This rank's slice of the vocabulary: rank ``rank`` of ``size`` ranks of ``group`` (a
    tensor-parallel group), each ``V / size`` consecutive entries. ``VocabShard()``: the whole
    vocabulary on one process. ``gathered``: elements all-gathered so far (module doc)."""

    def __init__(self, rank: int = 0, size: int = 1, group=None):
        self.rank, self.size, self.group = rank, size, group
        self.gathered = 0

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of every rank of the group, stacked in rank order: [size, *t.shape]."""
        self.gathered += t.numel() * self.size
        if self.size == 1:
            return t[None]
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)


def greedy_tokens(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Each row's global argmax ([rows] int64) from this rank's [rows, V / size] slice; ties to
    the lowest global index, as ``torch.argmax`` of the whole row (module doc)."""
    local = logits.argmax(-1)
    values = logits.gather(-1, local[:, None])[:, 0]
    offset = shard.rank * logits.shape[-1]
    got = shard.gather(torch.stack([values.double(), (local + offset).double()], -1))   # [size, rows, 2]
    best = got[..., 0].argmax(0)   # the first maximum: the lowest rank, hence the lowest index
    return got[..., 1].gather(0, best[None])[0].long()


def top_candidates(logits: torch.Tensor, k: int, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits over the whole vocabulary, from this rank's [rows, V / size]
    slice: (values float64, global indices int64), each [rows, k], largest first, ties to the
    lowest index."""
    rows, local_size = logits.shape
    k = min(k, local_size * shard.size)
    values, local = torch.sort(logits, dim=-1, descending=True, stable=True)
    mine = min(k, local_size)
    pairs = torch.stack([values[:, :mine].double(), (local[:, :mine] + shard.rank * local_size).double()], -1)
    got = shard.gather(pairs)                                           # [size, rows, mine, 2]
    cand = got.permute(1, 0, 2, 3).reshape(rows, shard.size * mine, 2)  # rank-major: indices ascending on ties
    order = torch.sort(cand[..., 0], dim=-1, descending=True, stable=True).indices[:, :k]
    picked = cand.gather(1, order[..., None].expand(-1, -1, 2))
    return picked[..., 0], picked[..., 1].long()


def sample_token(values: torch.Tensor, index: torch.Tensor, vocab: int, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> int:
    """One token drawn from candidate logits ``values`` at global vocabulary ``index`` (1-D): a
    row of ``vocab`` scores, -inf off the candidates, through Hugging Face's temperature and
    top-p warpers, softmax and ``torch.multinomial`` with ``generator``."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
    scores = torch.full((1, vocab), float("-inf"), dtype=torch.float32, device=values.device)
    scores[0, index] = values.float()
    scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])


def next_tokens(logits: torch.Tensor, samplings: list[dict], generators: list, shard: VocabShard,
                default_top_k: int = 0, default_top_p: float = 1.0) -> list[int]:
    """The next token of each row of ``logits`` ([rows, V / size]: this rank's slice of each
    row's last position): greedy where the row's ``samplings`` entry is empty, else sampled with
    its ``temperature``, ``top_k`` and ``top_p`` (unset: ``default_top_k`` / ``default_top_p``)
    and its ``generators`` entry. At most three all-gathers, in a fixed order: the greedy rows'
    (value, index) pairs, the top-k rows' candidates (k: the largest of theirs; each row then
    keeps its own k of them) and the whole-vocabulary rows' logits (module doc)."""
    rows = logits.shape[0]
    vocab = logits.shape[-1] * shard.size
    out: list[int | None] = [None] * rows
    greedy = [r for r in range(rows) if not samplings[r]]
    top_k = {r: min(samplings[r].get("top_k", default_top_k), vocab) for r in range(rows) if samplings[r]}
    if greedy:
        for r, token in zip(greedy, greedy_tokens(logits[greedy], shard).tolist()):
            out[r] = token
    some = [r for r, k in top_k.items() if k > 0]
    if some:
        values, index = top_candidates(logits[some], max(top_k[r] for r in some), shard)
        for i, r in enumerate(some):
            k = top_k[r]
            out[r] = _sample(values[i, :k], index[i, :k], vocab, samplings[r], generators[r], default_top_p)
    whole = [r for r, k in top_k.items() if k == 0]
    if whole:
        got = shard.gather(logits[whole])                       # [size, rows, V / size]
        full = got.permute(1, 0, 2).reshape(len(whole), vocab)  # rank order is vocabulary order
        everything = torch.arange(vocab, device=logits.device)
        for i, r in enumerate(whole):
            out[r] = _sample(full[i], everything, vocab, samplings[r], generators[r], default_top_p)
    return out


def sample_rows(logits: torch.Tensor, shard: VocabShard, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row ([rows] int64) of this rank's slices ``logits`` [rows, V / size], drawn
    as Hugging Face's sampled ``generate`` draws a batch step: the rows' scores [rows, V] (the
    top-k candidates, ``top_candidates``, -inf elsewhere; with ``top_k`` 0 the logits gathered
    whole) through the temperature and top-p warpers, a softmax and one ``torch.multinomial`` of
    the batch with ``generator``. Exactly k are kept (module doc), so the scores are Hugging Face's
    top-k warped tensor and the draws the same, whatever the tp."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper
    rows, vocab = logits.shape[0], logits.shape[-1] * shard.size
    if top_k:
        values, index = top_candidates(logits, top_k, shard)
        scores = torch.full((rows, vocab), float("-inf"), dtype=torch.float32, device=logits.device)
        scores.scatter_(1, index, values.float())
    else:
        scores = shard.gather(logits).permute(1, 0, 2).reshape(rows, vocab).float()   # rank order: vocabulary order
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1)(None, scores)
    return torch.multinomial(torch.softmax(scores, -1), num_samples=1, generator=generator).squeeze(1)


class GreedyOfSlices:
    """A Hugging Face logits processor for greedy ``generate`` over a vocabulary-parallel head: from
    this rank's slice of the last position's logits [rows, V / size], a row of V scores, -inf but
    0 at the global argmax (``greedy_tokens``), so ``generate``'s own argmax picks that token. It
    must be the only processor that reads the scores: the static engine uses it only when the
    model's generation config asks for no whole-row processor (autopar/inference/engine.py
    ``WHOLE_ROW_SETTINGS``), else it gathers the logits whole."""

    def __init__(self, shard: VocabShard):
        self.shard = shard

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        tokens = greedy_tokens(scores, self.shard)
        out = torch.full((scores.shape[0], scores.shape[-1] * self.shard.size), float("-inf"),
                         dtype=scores.dtype, device=scores.device)
        return out.scatter_(1, tokens[:, None].to(scores.device), 0.0)


def _sample(values, index, vocab, sampling, generator, default_top_p) -> int:
    return sample_token(values, index, vocab, sampling["temperature"], sampling.get("top_p", default_top_p),
                        generator)


__all__ = ["GreedyOfSlices", "VocabShard", "greedy_tokens", "next_tokens", "sample_rows", "sample_token",
           "top_candidates"]
