"""Per-row cache slots for autopar's own per-rank step programs: the building block continuous
batching needs on the codegen backend (rows join and leave between decode steps, each at its own
length), where ``CacheStep`` (autopar/inference/codegen_step.py) writes the same slots in every row.

- ``RowCacheStep(lm)``: one step whose cache write is per row::

      forward(input_ids [A, S], position_ids [A, S], cache_position [A, S], attention_mask [A, max_len],
              rows [A], k_0, v_0, ...)  ->  (logits of the last position [A, V], k_0', v_0', ...)

  over a cache of B >= A rows (each cache tensor [B, kv_heads, max_len, head_dim]). Step row ``a``
  writes its new k/v at its own slots ``cache_position[a]`` (an out-of-place ``aten.scatter``,
  rule: autopar/rules/ops_cache.py, so the cache stays split by kv heads) of cache row
  ``rows[a]``. With A = B, ``rows[b]`` is ``b`` or -1: row ``b`` is written only where it is not
  -1 (a ``where`` over the cache), and a row not written keeps its cache as it was (a prefill
  admitting some rows while the others are mid-decode). With A < B (a prefill over the admitted
  rows only), ``rows`` are the cache rows the step's rows are: selected (``index_select``),
  written and put back (``index_copy``); the other rows are not touched. Query ``s`` of row ``a`` attends to the slots
  ``attention_mask[b]`` marks that are at most ``cache_position[b, s]``, and always to its own slot
  (so a padding query is never fully masked).
- ``row_step_inputs`` / ``trace_row_step`` / ``plan_row_step``: a step's example inputs, its trace,
  and its trace and plan (``PlannedStep``) for one (batch, length) shape. GPT-2's fused qkv
  projection is split by heads for them (autopar/inference/fused_qkv.py), as ``CacheStep``'s.
- ``row_chunk``: one row's inputs of a step writing a prompt, or a chunk of one, at its own slots
  from a given start (no slot wasted on padding: the padding writes slots the row's next tokens
  overwrite), so a prompt may be prefilled in chunks.
- ``RowRequest`` / ``serve_rows``: a minimal continuous loop over a fixed number of rows: requests
  arrive at given iterations, are admitted into free rows by one prefill step over all rows (the
  others not written) or steps over a fixed number of rows (padded to the shortest planned
  prefill length that holds them), every
  occupied row decodes one token per iteration at its own slot, and a row retires (its row freed
  for the next request) at its ``max_new`` tokens, an end-of-sequence token or the cache's end.
- ``RowRunner``: one rank's programs of a RowCacheStep (a ``StepRunner``: the prefill lengths and
  the decode step, parameter and cache blocks); ``serve`` runs ``serve_rows`` on them. Every rank
  of the plans' mesh calls it with the same requests (the programs run collectives).
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.api import plan as make_plan
from autopar.frontend.trace import TracedGraph, trace_step
from autopar.inference.codegen_step import PlannedStep, StepRunner, empty_cache, full_cache_config
from autopar.inference.fused_qkv import fold_cat_split, split_fused_qkv
from autopar.inference.vocab_parallel import greedy_tokens

N_ROW_INPUTS = 5   # input_ids, position_ids, cache_position, attention_mask, rows; then the cache tensors


def row_update(layer, key_states, value_states, *args, **kwargs):
    """StaticLayer.update writing row ``b``'s new keys and values at its own slots
    ``layer.row_slots[b]`` (``scatter``, out of place), kept only in the rows ``layer.row_write``
    marks; with fewer step rows than cache rows, into the cache rows ``layer.row_index`` (an
    ``index_select`` of those rows, written, ``index_copy``-ed back): the step's rows' keys and
    values are returned for attention, the whole cache kept in ``layer.keys`` / ``layer.values``."""
    slots = layer.row_slots[:, None, :, None]
    if layer.row_index is not None:
        keys = layer.keys.index_select(0, layer.row_index).scatter(2, slots.expand(key_states.shape), key_states)
        values = layer.values.index_select(0, layer.row_index).scatter(2, slots.expand(value_states.shape),
                                                                       value_states)
        layer.keys = layer.keys.index_copy(0, layer.row_index, keys)
        layer.values = layer.values.index_copy(0, layer.row_index, values)
        return keys, values
    keep = layer.row_write[:, None, None, None]
    keys = layer.keys.scatter(2, slots.expand(key_states.shape), key_states)
    values = layer.values.scatter(2, slots.expand(value_states.shape), value_states)
    layer.keys = torch.where(keep, keys, layer.keys)
    layer.values = torch.where(keep, values, layer.values)
    return layer.keys, layer.values


class RowCacheStep(nn.Module):
    """One prefill or decode step of a Hugging Face causal LM over a preallocated KV cache whose
    rows each write their own slots (module docstring). The model gets a 4-D additive mask built
    here from ``attention_mask`` and ``cache_position``, so its own mask construction (which takes
    one ``cache_position`` for the batch) is bypassed; ``position_ids`` are each row's positions."""

    n_inputs = N_ROW_INPUTS

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm, self.qkv_columns = split_fused_qkv(lm)   # GPT-2's fused qkv as q, k, v (fused_qkv.py)
        self.n_layers = lm.config.num_hidden_layers

    def forward(self, input_ids, position_ids, cache_position, attention_mask, rows, *kv):
        from transformers import StaticCache

        max_len = kv[0].shape[2]
        try:
            config = full_cache_config(self.lm.config, max_len)
        except NotImplementedError as e:
            raise NotImplementedError(f"{type(self.lm).__name__}: {e}") from None
        cache = StaticCache(config=config, max_cache_len=max_len)
        for i, layer in enumerate(cache.layers):
            layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
            layer.batch_size, layer.num_heads = kv[2 * i].shape[:2]
            layer.k_head_dim, layer.v_head_dim = kv[2 * i].shape[-1], kv[2 * i + 1].shape[-1]
            layer.device = kv[2 * i].device
            layer.cumulative_length = cache_position[0, 0]
            layer.is_initialized = True
            layer.row_slots = cache_position
            if input_ids.shape[0] == kv[0].shape[0]:
                layer.row_write, layer.row_index = rows >= 0, None
            else:
                layer.row_write, layer.row_index = None, rows
            layer.update = types.MethodType(row_update, layer)
        slot = torch.arange(max_len, device=cache_position.device)
        here = cache_position[:, :, None]
        hidden = ((attention_mask[:, None, :] == 0) | (slot > here)) & (slot != here)   # [B, S, max_len]
        mask = hidden[:, None].to(kv[0].dtype) * torch.finfo(kv[0].dtype).min   # additive: 0 or the minimum
        out = self.lm(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                      past_key_values=cache, cache_position=cache_position[0], use_cache=True)
        news = []
        for layer in cache.layers:
            news += [layer.keys, layer.values]
        return (out.logits[:, -1], *news)


def row_step_inputs(lm: nn.Module, batch: int, seq: int, max_len: int, cache_rows: int | None = None) -> tuple:
    """Example inputs of a (batch, seq) RowCacheStep over a ``max_len`` cache of ``cache_rows``
    rows (default ``batch``; any values: the traced program depends on the shapes only)."""
    mask = torch.zeros(batch, max_len, dtype=torch.long)
    mask[:, :seq] = 1
    slots = torch.arange(seq).expand(batch, seq).contiguous()
    return (torch.ones(batch, seq, dtype=torch.long), slots.clone(), slots, mask,
            torch.arange(batch), *empty_cache(lm, cache_rows or batch, max_len))


def trace_row_step(step: RowCacheStep, batch: int, seq: int, max_len: int,
                   cache_rows: int | None = None) -> TracedGraph:
    """``step`` traced at (batch, seq) over a ``max_len`` cache of ``cache_rows`` rows (default
    ``batch``), a split of a concatenation into its own pieces folded (``fused_qkv.fold_cat_split``)."""
    return fold_cat_split(trace_step(step, row_step_inputs(step.lm, batch, seq, max_len, cache_rows)), step)


def plan_row_step(step: RowCacheStep, batch: int, seq: int, max_len: int, cluster, traced: TracedGraph | None = None,
                  cache_rows: int | None = None, **plan_kwargs) -> PlannedStep:
    """Trace ``step`` at (batch, seq) over a ``max_len`` cache of ``cache_rows`` rows (default
    ``batch``; more: a step over some rows of the cache) or take ``traced``, and plan it
    (``autopar.plan``'s keyword arguments); the batch dim of every input is dim 0 (of the cache,
    none when it has other rows than the step)."""
    inputs = row_step_inputs(step.lm, batch, seq, max_len, cache_rows)
    traced = traced if traced is not None else trace_row_step(step, batch, seq, max_len, cache_rows)
    cache_dim = 0 if (cache_rows or batch) == batch else None   # a cache of other rows: no batch dim of the step's
    dims = (0,) * N_ROW_INPUTS + (cache_dim,) * (len(inputs) - N_ROW_INPUTS)
    plan = make_plan(step, inputs, cluster, traced=traced, batch_dims=dims, **plan_kwargs)
    return PlannedStep(traced, plan, N_ROW_INPUTS)


def row_chunk(tokens: torch.Tensor, start: int, seq: int,
              limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row's (input_ids, position_ids, cache_position), each [seq], of a step that writes
    ``tokens`` (n <= seq of them: a prompt, or a chunk of one) at slots and positions ``start`` ..
    ``start + n - 1``: the tokens last (so the step's last-position logits are the last token's),
    the ``seq - n`` padding before them writing the slots after them (``start + n`` .. ``start +
    seq - 1``, which must lie in the cache: left unmasked they are never attended to, and the row's
    next tokens overwrite them). With ``limit`` (the cache's slots), padding slots past it write its
    last slot instead (several pads at one slot: a late chunk of a prompt near the cache's end),
    which must lie after the tokens. Its ``attention_mask`` row marks slots 0 .. ``start + n - 1``."""
    n = len(tokens)
    if n > seq:
        raise ValueError(f"{n} tokens do not fit a step of {seq}")
    if limit is not None and start + n >= limit and n < seq:
        raise ValueError(f"no slot after tokens {start} .. {start + n - 1} in a cache of {limit} for the padding")
    ids = torch.zeros(seq, dtype=torch.long)
    ids[seq - n:] = tokens
    real = torch.arange(start, start + n)
    pos = torch.cat([torch.zeros(seq - n, dtype=torch.long), real])
    pads = torch.arange(start + n, start + seq)
    slots = torch.cat([pads if limit is None else pads.clamp(max=limit - 1), real])
    return ids, pos, slots


@dataclass
class RowRequest:
    """One request of ``serve_rows``: ``prompt`` (1-D token ids), admitted at iteration ``arrive``
    or the first one after with a free row; generates up to ``max_new`` tokens."""
    rid: object
    prompt: torch.Tensor
    max_new: int
    arrive: int = 0


@torch.no_grad()
def serve_rows(run, cache: list[torch.Tensor], prefill_lengths, batch: int, max_len: int, requests, eos: tuple = (),
               pick=None, log: list | None = None, prefill_rows: int | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Greedy tokens (or ``pick(logits [B, V]) -> [B]``) of every request, rid -> list of ids,
    and the final cache.

    ``run(seq, input_ids, position_ids, cache_position, attention_mask, rows, *cache)`` runs the
    length-``seq`` step (1: decode) and returns (logits, *new cache); ``cache`` is the initial
    cache (zeros). Each iteration admits the requests that have arrived into free rows (prefill
    steps of the shortest length in ``prefill_lengths`` that holds them all: one over all
    ``batch`` rows writing only theirs, or, with ``prefill_rows`` < ``batch``, one per
    ``prefill_rows`` of them over those rows only), then decodes every occupied row one token at
    its own next slot. ``log`` (a list) gets (iteration, "prefill" or "decode", {row: rid}) per
    step run."""
    pick = pick if pick is not None else (lambda logits: logits.argmax(-1))
    eos_ids = set(eos)
    pending = sorted(requests, key=lambda r: r.arrive)
    owner: list = [None] * batch                       # row -> request occupying it
    mask = torch.zeros(batch, max_len, dtype=torch.long)
    next_slot = torch.zeros(batch, dtype=torch.long)
    next_pos = torch.zeros(batch, dtype=torch.long)
    last = torch.zeros(batch, dtype=torch.long)
    out: dict = {r.rid: [] for r in requests}

    def add(b, tok):
        req = owner[b]
        out[req.rid].append(tok)
        last[b] = tok
        if len(out[req.rid]) >= req.max_new or tok in eos_ids or int(next_slot[b]) >= max_len:
            owner[b] = None

    it = 0
    while pending or any(o is not None for o in owner):
        free = [b for b in range(batch) if owner[b] is None]
        due = [r for r in pending if r.arrive <= it][:len(free)]
        if due:
            P = max(len(r.prompt) for r in due)
            fits = sorted(s for s in prefill_lengths if s >= P)
            if not fits:
                raise ValueError(f"no prefill step holds a prompt of {P} tokens (planned: {sorted(prefill_lengths)})")
            S = fits[0]
            if S > max_len:
                raise ValueError(f"a prefill of {S} slots exceeds the cache's {max_len}")
            admitted = free[:len(due)]
            for b, req in zip(admitted, due):
                n = len(req.prompt)
                if n + req.max_new - 1 > max_len:
                    raise ValueError(f"request {req.rid!r}: {n} prompt tokens + {req.max_new} new tokens exceed the "
                                     f"cache's {max_len}")
                pending.remove(req)
                owner[b] = req
                mask[b] = 0
                mask[b, :n] = 1
                next_slot[b] = next_pos[b] = n
            A = prefill_rows or batch
            # one step over all rows (those not admitted not written), or steps over A rows each,
            # the last one's spare rows repeating its last admitted row (the same writes twice)
            groups = [admitted] if A == batch else [admitted[i:i + A] for i in range(0, len(admitted), A)]
            for group in groups:
                rows = torch.tensor(group + [group[-1]] * (A - len(group))) if A < batch else \
                    torch.where(torch.isin(torch.arange(batch), torch.tensor(group)), torch.arange(batch), -1)
                ids = torch.zeros(A, S, dtype=torch.long)
                pos = torch.zeros(A, S, dtype=torch.long)
                slots = torch.arange(S).expand(A, S).contiguous()
                for a, b in enumerate(rows.tolist()):
                    if b >= 0:
                        ids[a], pos[a], slots[a] = row_chunk(owner[b].prompt, 0, S)
                logits, *cache = run(S, ids, pos, slots, mask if A == batch else mask[rows], rows, *cache)
                tok = pick(logits)
                if log is not None:
                    log.append((it, "prefill", {b: owner[b].rid for b in group}))
                at = {b: a for a, b in reversed(list(enumerate(rows.tolist())))}   # step row of cache row b
                for b in group:
                    add(b, int(tok[at[b]]))
        rows = [b for b in range(batch) if owner[b] is not None]
        if rows:
            write = torch.zeros(batch, dtype=torch.bool)
            write[rows] = True
            slots = torch.where(write, next_slot, 0)
            mask[rows, next_slot[rows]] = 1
            logits, *cache = run(1, last[:, None].clone(), torch.where(write, next_pos, 0)[:, None],
                                 slots[:, None], mask, torch.where(write, torch.arange(batch), -1), *cache)
            tok = pick(logits)
            if log is not None:
                log.append((it, "decode", {b: owner[b].rid for b in rows}))
            next_slot[rows] += 1
            next_pos[rows] += 1
            for b in rows:
                add(b, int(tok[b]))
        it += 1
    return out, cache


class RowRunner(StepRunner):
    """One rank's prefill and decode programs of a RowCacheStep (``steps``: sequence length ->
    ``plan_row_step``'s PlannedStep, 1 the decode step) and the cache blocks they share, split as
    the plans say; the prefill steps may be planned over fewer rows than the cache's
    (``plan_row_step``'s ``cache_rows``), all over as many. ``runtime.context.setup(plan.mesh)``
    must have run."""

    def serve(self, requests, eos: tuple = (), pick=None, log: list | None = None) -> dict:
        """``serve_rows`` on this rank's programs from a zero cache (``pick`` by default the argmax
        over ``vocab_shard``; a given ``pick`` gets this rank's logits); the final cache blocks are
        left in ``self.cache``."""
        prefills = [s for s in self.programs if s > 1]
        rows = {self.programs[s].input_shapes[0][0] for s in prefills}
        if len(rows) != 1:
            raise ValueError(f"the prefill steps are planned over different numbers of rows: {sorted(rows)}")
        if pick is None:   # the argmax over this rank's vocabulary slice (``StepRunner.vocab_shard``)
            pick = lambda logits: greedy_tokens(logits, self.vocab_shard)   # noqa: E731
        tokens, self.cache = serve_rows(self.run, self.new_cache(), prefills, self.batch, self.max_len, requests,
                                        eos, pick, log, prefill_rows=rows.pop())
        return tokens
