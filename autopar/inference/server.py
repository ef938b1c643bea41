"""The HTTP server: an OpenAI-compatible completions endpoint in front of a generation engine.

``make_app(engine, ...)`` is a FastAPI application with

- ``POST /v1/completions``: OpenAI's completions request. ``prompt`` is text (needs a tokenizer),
  a list of token ids, or a list of either (one choice per prompt); ``max_tokens`` (default 16, or
  the plan's most if fewer); greedy by default, sampled with ``temperature`` > 0 (``top_p``,
  ``seed``: under static batching requests with the same options share a batch); ``n`` 1, no ``stream``. The answer is
  OpenAI's ``text_completion`` object; each choice also carries ``token_ids`` (the new tokens) and
  ``timing``: its measured ``ttft_s`` (queue + the engine's time to its first new token),
  ``tpot_s`` (time per further token; null for one token) and ``queued_s``, for load tests'
  percentiles; ``usage`` the token counts. Concurrent requests are batched (autopar/inference/batcher.py) as
  the plan's ``batching`` says: ``"static"`` (the default) runs them as one padded ``generate``
  call; ``"continuous"`` runs an iteration loop where requests join and leave the running batch
  between decode steps (autopar/inference/iteration_engine.py; tp ranks and dp replicas, each
  replica its own slots, rank 0 assigning each request to the replica with the fewest running or
  waiting requests; pipeline stages with one micro-batch in flight per stage); ``"chunked"`` is
  that loop with chunked prefill: each iteration runs at most the plan's ``prefill_chunk`` tokens,
  decodes first and prompt chunks in the rest (the engine built with the plan's chunk).
  ``finish_reason`` is ``"stop"`` when the output ended at an end-of-sequence token before
  ``max_tokens``.
- ``GET /v1/models`` (the one model) and ``GET /health``; ``GET /metrics``: requests, batches,
  tokens, the mean queue and generate times, and the measured TTFT (queue + the engine's time to
  the first new token) and time per output token next to the plan's predictions, and the engine's
  ``backend`` (``"modules"`` or ``"codegen"``).

Bad requests get HTTP 400 with OpenAI's error object (``{"error": {"message", "type", "param"}}``),
never a stack trace: a prompt longer than the plan's prompt length, more tokens than its cache
holds, sampling parameters out of range, malformed JSON. A failed generate answers 500 for the
requests of that batch; the server keeps serving. On several ranks (static or continuous), a
batch or step that fails where the ranks may be out of step (a rank of a multi-rank replica failed mid-forward,
or a collective failed or timed out: the process group's timeout, ``autopar serve
--collective-timeout``) is a 503 (``service_unavailable``, naming the failure) for the requests in
flight and every later one, and ``/health`` answers 503: nothing more is broadcast to the other ranks,
which stop (``autopar serve`` then exits). Rank 0's jobs travel on a group without a timeout, so
idle ranks wait for the next one however long.

``serve(engine, host, port)`` runs it with uvicorn on rank 0 while every other rank follows rank
0's batches (autopar/inference/rank_jobs.py), or under continuous batching its iterations
(``follow_iterations``, autopar/inference/iteration_engine.py). ``autopar serve`` (cli.py) builds the engine first.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from autopar.errors import PlanError
from autopar.inference.batcher import Batcher, IterationBatcher

BATCHING = ("static", "continuous", "chunked")


@dataclass
class Limits:
    prompt_len: int           # the longest prompt the plan's programs take
    max_new_tokens: int       # the most new tokens its cache holds after the longest prompt
    max_batch: int            # sequences one generate call decodes (the plan's batch)
    vocab_size: int | None = None


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def prompts_of(body: dict, tokenizer) -> list[list[int]]:
    """The request's prompts as token ids: text, ids, or a list of either."""
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required: text, a list of token ids, or a list of those", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("'prompt' must be text, a list of token ids, or a non-empty list of those", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise BadRequest("this server has no tokenizer: send 'prompt' as a list of token ids", "prompt")
            out.append(list(tokenizer(p)["input_ids"]))
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append(list(p))
        else:
            raise BadRequest("each prompt must be text or a list of integer token ids", "prompt")
        if not out[-1]:
            raise BadRequest("a prompt is empty: give at least one token", "prompt")
    return out


def sampling_of(body: dict) -> dict:
    """The engine's sampling options of a checked request: {} for greedy (temperature 0)."""
    t = body.get("temperature", 0) or 0
    if t == 0:
        return {}
    return {"temperature": float(t), "top_p": float(body.get("top_p", 1)), "seed": int(body.get("seed", 0))}


def check_request(body: dict, prompts: list[list[int]], limits: Limits) -> int:
    """The tokens wanted, after checking what the plan can do; BadRequest otherwise."""
    new = body.get("max_tokens", min(16, limits.max_new_tokens))
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {new!r}", "max_tokens")
    if new > limits.max_new_tokens:
        raise BadRequest(f"'max_tokens' {new} is more than this plan's KV cache holds after a prompt "
                         f"({limits.max_new_tokens}); plan with a larger max_new_tokens", "max_tokens")
    temperature = body.get("temperature", 0) or 0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
        raise BadRequest(f"'temperature' must be a number in [0, 2], got {temperature!r}", "temperature")
    top_p = body.get("top_p", 1)
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be a number in (0, 1], got {top_p!r}", "top_p")
    seed = body.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}", "seed")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise BadRequest("'n' and 'best_of' must be 1: one greedy completion per prompt", "n")
    if body.get("stream"):
        raise BadRequest("'stream' is not supported: ask without streaming", "stream")
    for p in prompts:
        if len(p) > limits.prompt_len:
            raise BadRequest(f"the prompt has {len(p)} tokens, more than this plan's prompt length "
                             f"{limits.prompt_len}; shorten it or plan for longer prompts", "prompt")
        if limits.vocab_size is not None and any(t < 0 or t >= limits.vocab_size for t in p):
            raise BadRequest(f"a token id is outside the vocabulary [0, {limits.vocab_size})", "prompt")
    return new


def timing_of(done) -> dict:
    """One request's measured times (s), from the engine's clock: what ``Stats`` averages."""
    t = done.timing or {}
    ttft = done.queued_s + t["prefill_s"] if "prefill_s" in t else None
    tpot = t["decode_s"] / (t["new_tokens"] - 1) if t.get("new_tokens", 0) > 1 else None
    return {"queued_s": done.queued_s, "ttft_s": ttft, "tpot_s": tpot}


class Stats:
    def __init__(self):
        self.requests = self.failed = self.rejected = self.tokens = 0
        self.queued_s = self.generate_s = 0.0
        self.per_token_s = 0.0
        self.timed = 0
        self.ttft_s = self.tpot_s = self.prefill_s = 0.0

    def record(self, done) -> None:
        self.requests += 1
        self.tokens += len(done.tokens)
        self.queued_s += done.queued_s
        self.generate_s += done.generate_s
        self.per_token_s += done.generate_s / max(done.batch_new_tokens, 1)
        t = done.timing
        if t and t.get("new_tokens", 0) > 1:   # the engine's own clock: first token, then each next one
            self.timed += 1
            self.ttft_s += done.queued_s + t["prefill_s"]
            self.prefill_s += t["prefill_s"]
            self.tpot_s += t["decode_s"] / (t["new_tokens"] - 1)


def make_app(engine_generate, limits: Limits, *, model_name: str = "autopar", tokenizer=None,
             predictions: dict | None = None, batch_wait: float = 0.01, pad_id: int = 0,
             batching: str = "static", backend: str = "modules") -> FastAPI:
    """The application. ``batching="static"``: ``engine_generate(input_ids, max_new_tokens,
    attention_mask)`` runs one batch (``LeaderGenerate(engine)`` on several ranks, ``engine.generate``
    on one); ``batching="continuous"`` or ``"chunked"``: ``engine_generate`` is an ``IterationEngine``
    (``add`` / ``step``; chunked: built with the plan's prefill chunk), and ``batch_wait`` does not
    apply (a request joins at the next iteration). ``backend``: what runs the engine ("modules" or
    "codegen", ``autopar serve --backend``), reported by ``/metrics``."""
    if batching not in BATCHING:
        raise PlanError(f"batching={batching!r} is not served; use one of {', '.join(map(repr, BATCHING))}")
    if batching != "static":   # continuous, or chunked: the IterationEngine prefills in its chunks
        if not hasattr(engine_generate, "step"):
            raise PlanError(f"{batching} batching needs an IterationEngine (autopar/inference/iteration_engine.py), "
                            f"got {type(engine_generate).__name__}")
        batcher = IterationBatcher(engine_generate)
    else:
        batcher = Batcher(engine_generate, limits.max_batch, batch_wait, pad_id)
    stats = Stats()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="autopar", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.batcher, app.state.stats = batcher, stats

    @app.exception_handler(RequestValidationError)
    async def bad_json(request: Request, exc: RequestValidationError):
        stats.rejected += 1
        return JSONResponse(error_body(f"the request body is not valid: {exc.errors()[0].get('msg', exc)}"), 400)

    @app.get("/health")
    async def health():
        broken = getattr(getattr(batcher, "engine", None) or getattr(batcher, "generate", None), "broken", None)
        if broken is not None:   # the ranks are out of step: nothing more can be served
            return JSONResponse({"status": "failed", **error_body(str(broken), "service_unavailable")}, 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "autopar"}]}

    @app.get("/metrics")
    async def metrics():
        n = max(stats.requests, 1)
        return {"requests": stats.requests, "failed": stats.failed, "rejected": stats.rejected,
                "batches": batcher.batches, "tokens": stats.tokens,
                "mean_queued_s": stats.queued_s / n, "mean_generate_s": stats.generate_s / n,
                "mean_time_per_output_token_s": stats.per_token_s / n,
                "measured": {"ttft": stats.ttft_s / max(stats.timed, 1), "tpot": stats.tpot_s / max(stats.timed, 1),
                             "prefill": stats.prefill_s / max(stats.timed, 1), "requests_timed": stats.timed},
                "predicted": predictions or {}, "backend": backend}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            stats.rejected += 1
            return JSONResponse(error_body("the request body is not JSON"), 400)
        if not isinstance(body, dict):
            stats.rejected += 1
            return JSONResponse(error_body("the request body must be a JSON object"), 400)
        try:
            prompts = prompts_of(body, tokenizer)
            new = check_request(body, prompts, limits)
        except BadRequest as e:
            stats.rejected += 1
            return JSONResponse(error_body(str(e), param=e.param), 400)
        sampling = sampling_of(body)
        results = await asyncio.gather(*(batcher.submit(p, new, sampling) for p in prompts), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:   # one failed batch is a 500 for its requests, not a dead server
            stats.failed += 1
            e = failed[0]
            status = getattr(e, "http_status", 500)   # 503: the ranks are out of step (RanksOutOfStep)
            return JSONResponse(error_body(f"generation failed: {type(e).__name__}: {e}",
                                           "service_unavailable" if status == 503 else "server_error"), status)
        choices, prompt_tokens = [], 0
        for index, (prompt, done) in enumerate(zip(prompts, results)):
            stats.record(done)
            text = tokenizer.decode(done.tokens) if tokenizer is not None else ""
            choices.append({"index": index, "text": text, "token_ids": done.tokens, "logprobs": None,
                            "finish_reason": "stop" if len(done.tokens) < new else "length",
                            "timing": timing_of(done)})
            prompt_tokens += len(prompt)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    return app


def serve(engine, limits: Limits, host: str = "127.0.0.1", port: int = 8000, batching: str = "static",
          **app_options) -> None:
    """Rank 0 serves HTTP until interrupted, then tells the other ranks to stop; every other rank
    runs rank 0's batches. ``batching="continuous"`` or ``"chunked"``: ``engine`` is this rank's IterationEngine
    (``IterationEngine.from_plan``: tp ranks, pp stages and dp replicas), rank 0 leading each iteration
    (``LeaderIterations``: it assigns each request a replica and gathers the finished ones) and the
    others following it (``follow_iterations``)."""
    import torch.distributed as dist
    import uvicorn

    from autopar.inference.rank_jobs import LeaderGenerate, follow
    app_options.setdefault("backend", getattr(engine, "backend", "modules"))   # /metrics: what ran

    if batching != "static":   # rank 0 decides each iteration's admissions, the others follow
        from autopar.inference.iteration_ranks import LeaderIterations, follow_iterations
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            follow_iterations(engine)
            return
        leader = LeaderIterations(engine)
        try:
            uvicorn.run(make_app(leader, limits, batching=batching, **app_options), host=host, port=port,
                        log_level="warning")
        finally:
            leader.stop()
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # rank 0's batches on a group without a timeout (idle ranks wait there); a failure that may
        # leave the ranks out of step: RanksOutOfStep (503 here, the other ranks stop)
        from autopar.inference.sequence import IDLE_TIMEOUT
        jobs = dist.new_group(timeout=IDLE_TIMEOUT)
        several = engine.plan.tp * engine.plan.pp > 1
        if dist.get_rank() != 0:
            follow(engine, jobs, several)
            return
        leader = LeaderGenerate(engine, jobs, several)
    else:
        leader = LeaderGenerate(engine)
    try:
        uvicorn.run(make_app(leader, limits, **app_options), host=host, port=port, log_level="warning")
    finally:
        leader.stop()
