"""Continuous batching in the request-trace simulation: ``simulate_continuous`` serves a trace the
way vLLM's default (non-chunked) scheduler does, with the same inputs and result as the static
``simulate`` of autopar/inference/trace.py.

The model. Each of ``replicas`` runs iterations, taking requests from one queue shared by all
replicas, in arrival order. An iteration starting at time t:

1. admits the waiting requests that arrived by t, in order, while the replica holds fewer than
   ``batch_size`` requests and, with ``kv_tokens``, while the KV-cache tokens its requests hold stay
   within that budget (a request holds its prompt plus its whole output from admission: the
   simulation knows the output lengths, so it never preempts; the first request that does not fit
   blocks the ones behind it);
2. runs the admitted requests' prefills, each priced at its own prompt (``prefill(1, prompt)``, no
   padding), one after the other while the running requests' decoding pauses; an admitted
   request's first token comes at the end of the prefills (a one-token output ends there);
3. runs one decode step of every running request, ``decode(batch, context)`` seconds at the number
   of running requests and their mean context (prompt plus the tokens generated so far). A request
   leaves after its own output length, freeing its slot and KV tokens for the next iteration.

**Pipeline stages in flight** (``stages`` > 1, a pp-stage replica): the replica keeps ``stages``
micro-batches in flight, one per stage, as vLLM's pipeline parallelism does: each micro-batch is
a virtual engine with its own scheduler holding up to ``batch_size`` requests (vLLM's
``max_num_seqs`` is per virtual engine) and ``kv_tokens // stages`` KV-cache tokens (vLLM divides
the cache blocks by the pipeline size), and runs the iterations above on its own. So a replica of
``stages`` stages is simulated as ``stages`` engines taking requests from the shared queue, and
``prefill``/``decode`` are then a micro-batch's iteration with the others in flight
(``Pricer.prefill_in_flight``/``decode_in_flight`` of autopar/inference/inference_cost.py: its
pass through the stages, so a request's time per token is its own pass, while the replica
completes an iteration every slowest stage's time). This is the stages' time shared out evenly:
the engines do not wait for each other, so a long prefill in one micro-batch does not hold back
another's decode at a stage (in a real pipeline it does, for up to that prefill's stage time), and
a lone request is priced as if the pipeline were full. Vidur instead caps a replica's running
requests at its batch size and each micro-batch at batch size // stages, over one shared cache: a
Vidur batch cap of B is ``batch_size`` B / stages here.

Iterations in which no request can join or leave are run as one segment of steps priced at the
segment's mean context; a segment is at most ``BUCKET`` steps, and ends at the first step boundary
after the next arrival when that request would fit. Prompts and contexts are priced rounded up to
``BUCKET`` tokens, as in ``simulate``. Time per output token is a request's mean time between
tokens (the pauses for others' prefills included).

**Chunked prefill** (``simulate_chunked``, Sarathi-Serve's stall-free batching and vLLM's
``enable_chunked_prefill``): an iteration has a budget of ``chunk`` tokens. The running requests'
decode steps take one token each, first; the rest of the budget goes to prompt chunks in arrival
order: first the prompt part-way through its prefill, then waiting requests admitted (under the
same ``batch_size`` and KV-token limits as above) while budget is left, each taking as many of its
prompt's tokens as remain in the budget. A prompt may so span several iterations; its first token
comes at the end of the iteration that runs its last chunk, and it decodes from the next
iteration. An iteration with chunks is priced as one mixed batch, ``iteration(chunks, decodes,
context)`` (chunks: (tokens, tokens of the prompt already prefilled) of each; autopar/inference/
inference_cost.py, ``Pricer.mixed``: the weights read once for the chunk tokens and the decodes
together); iterations with no chunk are decode steps, run in segments as above and priced as
``iteration((), decodes, context)``. Running decodes never pause for a whole prompt: a decode step
waits at most one iteration of ``chunk`` tokens. Each iteration's decodes take their token out of the
budget, so ``batch_size`` may not exceed ``chunk`` (vLLM's ``max_num_batched_tokens >=
max_num_seqs``): then a chunk always has a token left while a prompt is part-way. Chunk tokens and
their past are priced exactly (a chunk's size is set by the budget), decode contexts rounded up to
``BUCKET``. With stages in flight each micro-batch has its own budget of ``chunk`` tokens (a vLLM
virtual engine schedules its own batches).
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache

import numpy as np

from autopar.errors import PlanError
from autopar.inference.trace import BUCKET, RequestTrace, bucket, served


def _kv_budget(trace: RequestTrace, kv_tokens: int | None, stages: int) -> tuple[list, float]:
    """Each request's KV tokens at its end, and a micro-batch's budget of them (a PlanError where
    one request alone does not fit)."""
    p, o = trace.prompt_lens.tolist(), trace.output_lens.tolist()
    need = [s + t for s, t in zip(p, o)]   # KV tokens a request holds at its end
    budget = math.inf if kv_tokens is None else kv_tokens // stages   # per micro-batch
    if max(need) > budget:
        k = need.index(max(need))
        raise PlanError(f"request {k} needs {need[k]} KV-cache tokens (prompt {p[k]} + output {o[k]}), more "
                        f"than a replica's kv_tokens={kv_tokens}"
                        + (f" shared by its {stages} micro-batches in flight" if stages > 1 else ""))
    return need, budget


def simulate_continuous(trace: RequestTrace, prefill, decode, replicas: int, batch_size: int,
                        kv_tokens: int | None = None, stages: int = 1) -> dict:
    """Serve ``trace`` with continuous batching (module doc). ``prefill(batch, prompt)`` and
    ``decode(batch, context)`` are seconds (with ``stages`` > 1: a micro-batch's, with the others in
    flight); ``kv_tokens``: the KV-cache tokens a replica holds (None: only ``batch_size`` limits a
    batch); ``stages``: the micro-batches a replica keeps in flight, each of up to ``batch_size``
    requests and ``kv_tokens // stages`` tokens. Returns what ``simulate`` returns."""
    prefill, decode = lru_cache(maxsize=None)(prefill), lru_cache(maxsize=None)(decode)
    n = len(trace)
    a, p, o = trace.arrivals.tolist(), trace.prompt_lens.tolist(), trace.output_lens.tolist()
    need, budget = _kv_budget(trace, kv_tokens, stages)
    engines = replicas * stages   # each micro-batch in flight runs on its own (module doc)
    first, done = [0.0] * n, [0.0] * n
    # per engine: its running requests as a heap of (the engine's step count at which each ends,
    # request), decode steps run so far, the sum of the running requests' contexts, the KV tokens held
    running: list[list] = [[] for _ in range(engines)]
    steps_run, contexts, held = [0] * engines, [0] * engines, [0] * engines
    boundaries = [(0.0, r) for r in range(engines)]   # (next iteration at, engine)
    i = 0   # the first request not yet admitted
    while boundaries:
        t, r = heapq.heappop(boundaries)
        run = running[r]
        admitted = []
        while i < n and a[i] <= t and len(run) + len(admitted) < batch_size and held[r] + need[i] <= budget:
            admitted.append(i)   # in order: the first that does not fit blocks the ones behind it
            held[r] += need[i]
            i += 1
        if admitted:
            t += sum(prefill(1, bucket(p[k])) for k in admitted)
            for k in admitted:
                _start(run, k, steps_run[r], t, first, done, held, contexts, r, need, p, o)
        if not run:
            if i < n:   # idle until the next arrival
                heapq.heappush(boundaries, (max(t, a[i]), r))
            continue
        b = len(run)
        steps = min(run[0][0] - steps_run[r], BUCKET)
        step = decode(b, bucket(contexts[r] / b + (steps - 1) / 2))
        if i < n and b < batch_size and held[r] + need[i] <= budget:   # the next arrival would join
            cut = max(1, math.ceil((a[i] - t) / step))
            if cut < steps:
                steps = cut
                step = decode(b, bucket(contexts[r] / b + (steps - 1) / 2))
        t += steps * step
        steps_run[r] += steps
        contexts[r] += steps * b
        while run and run[0][0] == steps_run[r]:
            _, k = heapq.heappop(run)
            done[k] = t
            held[r] -= need[k]
            contexts[r] -= p[k] + o[k]
        heapq.heappush(boundaries, (t, r))
    return _served(trace, first, done)


def _served(trace: RequestTrace, first: list, done: list) -> dict:
    first, done = np.array(first), np.array(done)
    o = trace.output_lens
    tpot = np.where(o > 1, (done - first) / np.maximum(o - 1, 1), 0.0)
    return served(trace, first - trace.arrivals, tpot, done)


def simulate_chunked(trace: RequestTrace, iteration, replicas: int, batch_size: int, chunk: int,
                     kv_tokens: int | None = None, stages: int = 1) -> dict:
    """Serve ``trace`` with continuous batching and chunked prefill (module doc): each iteration
    has a budget of ``chunk`` tokens. ``iteration(chunks, decodes, context)`` is the seconds of one
    iteration running the prompt chunks ``chunks`` (a tuple of (tokens, tokens of that prompt
    already prefilled)) and ``decodes`` decode steps at mean ``context`` (with ``stages`` > 1: a
    micro-batch's, with the others in flight). The other arguments and the result are
    ``simulate_continuous``'s."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise PlanError(f"prefill chunk={chunk!r} must be a positive integer (tokens an iteration runs)")
    if batch_size > chunk:
        raise PlanError(f"batch_size={batch_size} is more than the prefill chunk of {chunk} tokens: each running "
                        f"request's decode takes a token of an iteration's budget (vLLM requires "
                        f"max_num_batched_tokens >= max_num_seqs); use a chunk of at least {batch_size} tokens or a "
                        f"smaller batch")
    iteration = lru_cache(maxsize=None)(iteration)
    n = len(trace)
    a, p, o = trace.arrivals.tolist(), trace.prompt_lens.tolist(), trace.output_lens.tolist()
    need, budget = _kv_budget(trace, kv_tokens, stages)
    engines = replicas * stages
    first, done = [0.0] * n, [0.0] * n
    running: list[list] = [[] for _ in range(engines)]   # decoding requests, as in simulate_continuous
    steps_run, contexts, held = [0] * engines, [0] * engines, [0] * engines
    filling: list = [None] * engines   # per engine: (request, tokens prefilled) of a prompt part-way, or None
    boundaries = [(0.0, r) for r in range(engines)]
    i = 0
    while boundaries:
        t, r = heapq.heappop(boundaries)
        run = running[r]
        b = len(run)
        left = chunk - b   # the decodes take their tokens first
        chunks, prefilled = [], []
        if filling[r] is not None:   # the prompt part-way: its next chunk
            k, did = filling[r]
            take = min(p[k] - did, left)
            chunks.append((take, did))
            left -= take
            filling[r] = (k, did + take) if did + take < p[k] else None
            if filling[r] is None:
                prefilled.append(k)
        slots = b + len(prefilled) + (filling[r] is not None)
        while left > 0 and i < n and a[i] <= t and slots < batch_size and held[r] + need[i] <= budget:
            k = i   # admitted in order while budget is left; the first that does not fit blocks the others
            i += 1
            held[r] += need[k]
            slots += 1
            take = min(p[k], left)
            chunks.append((take, 0))
            left -= take
            if take < p[k]:
                filling[r] = (k, take)
            else:
                prefilled.append(k)
        if chunks:   # one mixed iteration: the chunks and a decode step of every running request
            t += iteration(tuple(chunks), b, bucket(contexts[r] / b) if b else 0)
            steps_run[r] += 1
            contexts[r] += b
            _leave(run, steps_run[r], t, done, held, contexts, r, need, p, o)
            for k in prefilled:
                _start(run, k, steps_run[r], t, first, done, held, contexts, r, need, p, o)
            heapq.heappush(boundaries, (t, r))
            continue
        if not run:
            if i < n:   # idle until the next arrival
                heapq.heappush(boundaries, (max(t, a[i]), r))
            continue
        # decode steps alone, in segments as simulate_continuous runs them
        steps = min(run[0][0] - steps_run[r], BUCKET)
        step = iteration((), b, bucket(contexts[r] / b + (steps - 1) / 2))
        if i < n and b < batch_size and held[r] + need[i] <= budget:   # the next arrival would join
            cut = max(1, math.ceil((a[i] - t) / step))
            if cut < steps:
                steps = cut
                step = iteration((), b, bucket(contexts[r] / b + (steps - 1) / 2))
        t += steps * step
        steps_run[r] += steps
        contexts[r] += steps * b
        _leave(run, steps_run[r], t, done, held, contexts, r, need, p, o)
        heapq.heappush(boundaries, (t, r))
    return _served(trace, first, done)


def _start(run: list, k: int, steps: int, t: float, first: list, done: list, held: list, contexts: list, r: int,
           need, p, o) -> None:
    """Request ``k``'s prefill ended at ``t`` (the engine at step ``steps``): its first token; it
    leaves there if that was its whole output, else it decodes from the next step."""
    first[k] = t
    if o[k] == 1:   # the prefill's token was the whole output
        done[k] = t
        held[r] -= need[k]
    else:
        heapq.heappush(run, (steps + o[k] - 1, k))
        contexts[r] += p[k] + 1


def _leave(run: list, steps: int, t: float, done: list, held: list, contexts: list, r: int, need, p, o) -> None:
    """The running requests whose output ends at the engine's step ``steps`` leave at ``t``."""
    while run and run[0][0] == steps:
        _, k = heapq.heappop(run)
        done[k] = t
        held[r] -= need[k]
        contexts[r] -= p[k] + o[k]


__all__ = ["simulate_chunked", "simulate_continuous"]
