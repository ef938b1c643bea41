"""Request batching for the server, one class per batching policy of the plan.

``Batcher`` (static batching): concurrent requests become one ``generate`` call. It owns an asyncio
queue of ``Request`` (token ids, tokens wanted). Its loop takes the
first waiting request, waits at most ``batch_wait`` seconds for more (never more than
``max_batch`` in one batch, never more tokens than the engine's cache holds), left-pads the
prompts into one batch with an attention mask, as Hugging Face ``generate`` takes them, and runs
the engine's ``generate`` in a worker thread (the event loop keeps accepting requests meanwhile).
Each request gets its own new tokens (the batch decodes the most any of them asked for; each is
cut to its own count) and the batch's timings. A failed batch fails its requests only: the loop
goes on with the next one. Its engine is anything with ``generate(input_ids, max_new_tokens,
attention_mask=None)`` returning the prompt followed by the new tokens ([batch, prompt + new]);
``autopar.compile_inference``'s engine is one.

``IterationBatcher`` (continuous batching): requests join and leave the running batch between
iterations of an ``IterationEngine`` (autopar/inference/iteration_engine.py), or of the engines of
every replica behind ``LeaderIterations`` (which picks each request's replica in ``add``); each is
answered when its own output ends.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: dict = field(default_factory=dict)   # {} greedy; else temperature, top_p, seed
    arrived: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.sampling.items()))


@dataclass
class Completion:
    tokens: list[int]             # the new tokens only
    queued_s: float               # from arrival to the start of its batch
    generate_s: float             # the batch's generate call
    batch_size: int               # requests in its batch
    batch_new_tokens: int         # tokens the batch decoded (the most any of its requests asked for)
    timing: dict | None = None    # the engine's measured prefill_s / decode_s / new_tokens, if it keeps them


def pad_left(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one left-padded batch and its attention mask (1 = token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        if p:
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
    return ids, mask


class Batcher:
    def __init__(self, generate, max_batch: int, batch_wait: float = 0.01, pad_id: int = 0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.generate = generate
        self.max_batch = max_batch
        self.batch_wait = batch_wait
        self.pad_id = pad_id
        self.queue: asyncio.Queue[Request] = asyncio.Queue()
        self.held: list[Request] = []   # waiting for a batch of their own sampling options
        self.batches = 0
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    async def submit(self, prompt: list[int], max_new_tokens: int, sampling: dict | None = None) -> Completion:
        req = Request(list(prompt), int(max_new_tokens), dict(sampling or {}),
                      future=asyncio.get_running_loop().create_future())
        await self.queue.put(req)
        return await req.future

    async def take_batch(self) -> list[Request]:
        """The oldest request and, within ``batch_wait``, others with the same sampling options (one
        generate call samples one way); the rest wait for a later batch, oldest first."""
        first = self.held.pop(0) if self.held else await self.queue.get()
        batch, later = [first], []
        for r in self.held:
            (batch if r.key == first.key and len(batch) < self.max_batch else later).append(r)
        self.held = later
        deadline = time.perf_counter() + self.batch_wait
        while len(batch) < self.max_batch:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                r = await asyncio.wait_for(self.queue.get(), left)
            except asyncio.TimeoutError:
                break
            (batch if r.key == first.key else self.held).append(r)
        return batch

    async def run(self) -> None:
        while True:
            batch = await self.take_batch()
            await self.run_batch(batch)

    async def run_batch(self, batch: list[Request]) -> None:
        ids, mask = pad_left([r.prompt for r in batch], self.pad_id)
        new = max(r.max_new_tokens for r in batch)
        start = time.perf_counter()
        try:
            out = await asyncio.to_thread(self.generate, ids, new, mask, batch[0].sampling or None)
        except Exception as e:  # noqa: BLE001 - the batch's requests get the error; the server goes on
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(e)
            return
        took = time.perf_counter() - start
        self.batches += 1
        timing = getattr(getattr(self.generate, "engine", self.generate), "last_timing", None)
        width = ids.shape[1]
        for row, r in enumerate(batch):
            tokens = out[row, width:width + r.max_new_tokens].tolist()
            if not r.future.done():
                r.future.set_result(Completion(tokens, start - r.arrived, took, len(batch), new,
                                               dict(timing) if timing else None))


class IterationBatcher:
    """Continuous batching for the server: requests join and leave an ``IterationEngine``'s running
    batch between iterations (autopar/inference/iteration_engine.py).

    Its loop hands every request that arrived to the engine (``engine.add``; one the engine refuses
    fails alone), runs one ``engine.step()`` in a worker thread (the event loop keeps accepting
    requests meanwhile), and answers the requests that finished in it; with nothing running or
    waiting it sleeps until a request arrives. Requests with different sampling options share
    iterations (each sequence samples on its own). A failed step fails the requests then in the
    engine and empties it; the loop goes on. Same interface as ``Batcher``: ``start``, ``stop``,
    ``submit``, and ``batches`` (here: iterations run)."""

    def __init__(self, engine):
        self.engine = engine
        self.queue: asyncio.Queue[Request] = asyncio.Queue()
        self.batches = 0
        self.task: asyncio.Task | None = None

    start, stop = Batcher.start, Batcher.stop

    async def submit(self, prompt: list[int], max_new_tokens: int, sampling: dict | None = None) -> Completion:
        req = Request(list(prompt), int(max_new_tokens), dict(sampling or {}),
                      future=asyncio.get_running_loop().create_future())
        await self.queue.put(req)
        return await req.future

    def _add(self, req: Request) -> None:
        try:
            self.engine.add(req.prompt, req.max_new_tokens, req.sampling or None, tag=req)
        except Exception as e:  # noqa: BLE001 - a request the engine refuses fails alone
            if not req.future.done():
                req.future.set_exception(e)

    async def run(self) -> None:
        while True:
            if self.engine.idle:
                self._add(await self.queue.get())
            while not self.queue.empty():
                self._add(self.queue.get_nowait())
            if self.engine.idle:
                continue
            try:
                finished = await asyncio.to_thread(self.engine.step)
            except Exception as e:  # noqa: BLE001 - the requests in the engine get the error; the server goes on
                for seq in self.engine.abort():
                    if not seq.tag.future.done():
                        seq.tag.future.set_exception(e)
                continue
            self.batches += 1
            for seq in finished:
                r = seq.tag
                if not r.future.done():
                    r.future.set_result(Completion(list(seq.tokens), seq.admitted - r.arrived, seq.done - seq.admitted,
                                                   seq.running_at_admission, len(seq.tokens), seq.timing()))
