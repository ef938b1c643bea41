"""Per-row cache slots for autopar's own per-rank step programs: the building block continuous
batching needs on the codegen backend (rows join and leave between decode steps, each at its own
length), where ``CacheStep`` (autopar/inference/codegen_step.py) writes the same slots in every row.

- ``RowCacheStep(lm)``: one step whose cache write is per row::

      forward(input_ids [B, S], position_ids [B, S], cache_position [B, S], attention_mask [B, max_len],
              write [B] (bool), k_0, v_0, ...)  ->  (logits of the last position [B, V], k_0', v_0', ...)

  row ``b`` writes its new k/v at its own slots ``cache_position[b]`` (an out-of-place
  ``aten.scatter``, rule: autopar/rules/ops_cache.py, so the cache stays split by kv heads), and
  only where ``write[b]``: a row not written keeps its cache as it was (a prefill admitting some
  rows while the others are mid-decode). Query ``s`` of row ``b`` attends to the slots
  ``attention_mask[b]`` marks that are at most ``cache_position[b, s]``, and always to its own slot
  (so a padding query is never fully masked).
- ``row_step_inputs`` / ``plan_row_step``: a step's example inputs and its trace and plan
  (``PlannedStep``) for one (batch, length) shape.
- ``row_chunk``: one row's inputs of a step writing a prompt, or a chunk of one, at its own slots
  from a given start (no slot wasted on padding: the padding writes slots the row's next tokens
  overwrite), so a prompt may be prefilled in chunks.
- ``RowRequest`` / ``serve_rows``: a minimal continuous loop over a fixed number of rows: requests
  arrive at given iterations, are admitted into free rows by one prefill step (padded to the
  shortest planned prefill length that holds them; the other rows are not written), every
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

N_ROW_INPUTS = 5   # input_ids, position_ids, cache_position, attention_mask, write; then the cache tensors


def row_update(layer, key_states, value_states, *args, **kwargs):
    """StaticLayer.update writing row ``b``'s new keys and values at its own slots
    ``layer.row_slots[b]`` (``scatter``, out of place), kept only in the rows ``layer.row_write``
    marks."""
    slots = layer.row_slots[:, None, :, None]
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
        self.lm = lm
        self.n_layers = lm.config.num_hidden_layers

    def forward(self, input_ids, position_ids, cache_position, attention_mask, write, *kv):
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
            layer.row_slots, layer.row_write = cache_position, write
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


def row_step_inputs(lm: nn.Module, batch: int, seq: int, max_len: int) -> tuple:
    """Example inputs of a (batch, seq) RowCacheStep over a ``max_len`` cache (any values: the
    traced program depends on the shapes only)."""
    mask = torch.zeros(batch, max_len, dtype=torch.long)
    mask[:, :seq] = 1
    slots = torch.arange(seq).expand(batch, seq).contiguous()
    return (torch.ones(batch, seq, dtype=torch.long), slots.clone(), slots, mask,
            torch.ones(batch, dtype=torch.bool), *empty_cache(lm, batch, max_len))


def plan_row_step(step: RowCacheStep, batch: int, seq: int, max_len: int, cluster, traced: TracedGraph | None = None,
                  **plan_kwargs) -> PlannedStep:
    """Trace ``step`` at (batch, seq) over a ``max_len`` cache (or take ``traced``) and plan it
    (``autopar.plan``'s keyword arguments); the batch dim of every input is dim 0."""
    inputs = row_step_inputs(step.lm, batch, seq, max_len)
    traced = traced if traced is not None else trace_step(step, inputs)
    plan = make_plan(step, inputs, cluster, traced=traced, batch_dims=(0,) * len(inputs), **plan_kwargs)
    return PlannedStep(traced, plan, N_ROW_INPUTS)


def row_chunk(tokens: torch.Tensor, start: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row's (input_ids, position_ids, cache_position), each [seq], of a step that writes
    ``tokens`` (n <= seq of them: a prompt, or a chunk of one) at slots and positions ``start`` ..
    ``start + n - 1``: the tokens last (so the step's last-position logits are the last token's),
    the ``seq - n`` padding before them writing the slots after them (``start + n`` .. ``start +
    seq - 1``, which must lie in the cache: left unmasked they are never attended to, and the row's
    next tokens overwrite them). Its ``attention_mask`` row marks slots 0 .. ``start + n - 1``."""
    n = len(tokens)
    if n > seq:
        raise ValueError(f"{n} tokens do not fit a step of {seq}")
    ids = torch.zeros(seq, dtype=torch.long)
    ids[seq - n:] = tokens
    real = torch.arange(start, start + n)
    pos = torch.cat([torch.zeros(seq - n, dtype=torch.long), real])
    slots = torch.cat([torch.arange(start + n, start + seq), real])
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
               pick=None, log: list | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Greedy tokens (or ``pick(logits [B, V]) -> [B]``) of every request, rid -> list of ids,
    and the final cache.

    ``run(seq, input_ids, position_ids, cache_position, attention_mask, write, *cache)`` runs the
    length-``seq`` step (1: decode) and returns (logits [B, V], *new cache); ``cache`` is the
    initial cache (zeros). Each iteration admits the requests that have arrived into free rows
    (one prefill step of the shortest length in ``prefill_lengths`` that holds them all, writing
    only their rows), then decodes every occupied row one token at its own next slot. ``log``
    (a list) gets (iteration, "prefill" or "decode", {row: rid}) per step run."""
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
            ids = torch.zeros(batch, S, dtype=torch.long)
            pos = torch.zeros(batch, S, dtype=torch.long)
            write = torch.zeros(batch, dtype=torch.bool)
            slots = torch.arange(S).expand(batch, S).contiguous()
            if S > max_len:
                raise ValueError(f"a prefill of {S} slots exceeds the cache's {max_len}")
            for b, req in zip(free, due):
                n = len(req.prompt)
                if n + req.max_new - 1 > max_len:
                    raise ValueError(f"request {req.rid!r}: {n} prompt tokens + {req.max_new} new tokens exceed the "
                                     f"cache's {max_len}")
                pending.remove(req)
                owner[b], write[b] = req, True
                ids[b], pos[b], slots[b] = row_chunk(req.prompt, 0, S)
                mask[b] = 0
                mask[b, :n] = 1
                next_slot[b] = next_pos[b] = n
            logits, *cache = run(S, ids, pos, slots, mask, write, *cache)
            tok = pick(logits)
            if log is not None:
                log.append((it, "prefill", {b: owner[b].rid for b in free[:len(due)]}))
            for b in free[:len(due)]:
                add(b, int(tok[b]))
        rows = [b for b in range(batch) if owner[b] is not None]
        if rows:
            write = torch.zeros(batch, dtype=torch.bool)
            write[rows] = True
            slots = torch.where(write, next_slot, 0)
            mask[rows, next_slot[rows]] = 1
            logits, *cache = run(1, last[:, None].clone(), torch.where(write, next_pos, 0)[:, None],
                                 slots[:, None], mask, write, *cache)
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
    the plans say; ``runtime.context.setup(plan.mesh)`` must have run."""

    def serve(self, requests, eos: tuple = (), pick=None, log: list | None = None) -> dict:
        """``serve_rows`` on this rank's programs from a zero cache; the final cache blocks are
        left in ``self.cache``."""
        tokens, self.cache = serve_rows(self.run, self.new_cache(), [s for s in self.programs if s > 1],
                                        self.batch, self.max_len, requests, eos, pick, log)
        return tokens
