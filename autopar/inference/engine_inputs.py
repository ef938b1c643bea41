"""What the static engines (engine.py, codegen_engine.py) take from their caller, checked the same
way: ``check_sampling`` (the sampling options ``generate`` accepts), ``WHOLE_ROW_SETTINGS`` (the
generation-config settings under which greedy generation processes whole rows of logits) and
``checkpoint_reader`` (a Hugging Face safetensors directory or a ``compiled.save`` training
checkpoint, read block by block; ``drop_parameters``); and for the continuous-batching engines
(iteration_engine.py, codegen_iteration.py) ``check_sequence`` and ``RequestQueue``, their
``check`` and ``add``.
"""
from __future__ import annotations

import torch

from autopar.errors import PlanError
from autopar.inference.sequence import Sequence

SAMPLING = ("temperature", "top_p", "top_k", "seed")


def check_sampling(sampling: dict | None) -> dict:
    """The sampling options ``generate`` passes on: {} for greedy (no options, or temperature 0)."""
    out = dict(sampling or {})
    unknown = sorted(set(out) - set(SAMPLING))
    if unknown:
        raise PlanError(f"sampling option(s) {unknown} are not known; use {', '.join(SAMPLING)}")
    t = out.get("temperature", 0.0) or 0.0
    if not isinstance(t, (int, float)) or t < 0:
        raise PlanError(f"temperature must be a number >= 0, got {t!r}")
    if t == 0:
        return {}
    if not 0 < out.get("top_p", 1.0) <= 1:
        raise PlanError(f"top_p must be in (0, 1], got {out['top_p']!r}")
    if not isinstance(out.get("top_k", 0), int) or out.get("top_k", 0) < 0:
        raise PlanError(f"top_k must be a whole number >= 0, got {out['top_k']!r}")
    if not isinstance(out.get("seed", 0), int):
        raise PlanError(f"seed must be an integer, got {out['seed']!r}")
    return out


def plan_ranks(plan) -> tuple[int, int]:
    """(world size, this rank) of the running process group (1, 0 without one), checked against
    the processes ``plan`` (an InferencePlan) runs on."""
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if plan.world_size != world:
        raise PlanError(f"the plan runs on {plan.world_size} processes (tp={plan.tp} x pp={plan.pp} x "
                        f"dp={plan.dp}) but {world} are running: launch {plan.world_size}")
    return world, (dist.get_rank() if world > 1 else 0)


def pipeline_group(plan, replica: int, tp_rank: int, timeout=None):
    """The pipeline group of tp position ``tp_rank`` in data-parallel replica ``replica`` of
    ``plan`` (an InferencePlan laid out as replicas of tp x pp ranks, stage-major): every
    replica's group of every tp position is created on every rank in one order, since
    ``dist.new_group`` is collective; this rank's is returned."""
    import torch.distributed as dist
    tp, pp, mine = plan.tp, plan.pp, None
    for r in range(plan.dp):
        for t in range(tp):
            g = dist.new_group([r * tp * pp + s * tp + t for s in range(pp)], timeout=timeout)
            if (r, t) == (replica, tp_rank):
                mine = g
    return mine


def eos_token_ids(model) -> tuple[int, ...]:
    """The end-of-sequence token ids of ``model``'s generation config (none: ())."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


class RequestQueue:
    """``check`` and ``add`` of a continuous-batching engine (either backend): a request checked
    against the plan (``check_sequence``: ``prompt_len``, ``max_new_tokens``, ``kv_tokens``, per
    micro-batch in flight when ``pp`` > 1) and queued in ``waiting`` as a ``Sequence`` numbered by
    ``ids``, sampling with its own generator on ``device`` (cpu when the engine has none); and
    ``_admissions``, the waiting sequences that join a batch."""

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        check_sequence(prompt, max_new_tokens, self.prompt_len, self.max_new_tokens, self.kv_tokens,
                       " per micro-batch in flight" if self.pp > 1 else "")

    def add(self, prompt, max_new_tokens: int, sampling: dict | None = None, tag=None) -> Sequence:
        """Queue a request; it joins at a later ``step`` with room. PlanError for what the plan cannot run."""
        prompt = [int(t) for t in prompt]
        self.check(prompt, max_new_tokens)
        seq = Sequence.queued(prompt, max_new_tokens, check_sampling(sampling), tag, next(self.ids),
                              getattr(self, "device", "cpu"))
        self.waiting.append(seq)
        return seq

    def _admissions(self, running: list[Sequence], budget: int | None = None) -> list[Sequence]:
        """The waiting sequences that join a batch of ``running`` ones (``slots`` rows; with pp > 1
        a virtual engine's): oldest first, while a row is free and, with ``kv_tokens``, the pool
        allows (each sequence's ``need``), the first that does not fit blocking the ones behind
        it; with a ``budget`` of prompt tokens (chunked prefill), only while some of it is left."""
        held = sum(s.need for s in running)
        out = []
        while self.waiting and len(running) + len(out) < self.slots and (budget is None or budget > 0):
            seq = self.waiting[0]
            if self.kv_tokens is not None and held + seq.need > self.kv_tokens:
                break   # in order: the first that does not fit blocks the ones behind it
            held += seq.need
            out.append(self.waiting.pop(0))
            if budget is not None:
                budget -= len(seq.prompt)
        return out


# generation-config settings under which Hugging Face's greedy generate runs logits processors
# over whole rows (indices are the vocabulary's): the split head's slices would be misread
def check_request(plan, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    """A ``generate`` request against what ``plan`` (an InferencePlan) was planned for: the
    prompts' shape and length, the new tokens its KV cache holds, and how many rows it decodes at
    once (its batch on each of its dp replicas)."""
    if input_ids.dim() != 2:
        raise PlanError(f"input_ids must be [batch, prompt] token ids, got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] > plan.prompt_len:
        raise PlanError(f"the prompts are {input_ids.shape[1]} tokens, more than the plan's prompt length "
                        f"{plan.prompt_len}: plan for longer prompts")
    if max_new_tokens > plan.max_new_tokens:
        raise PlanError(f"max_new_tokens={max_new_tokens} is more than the plan's {plan.max_new_tokens} "
                        f"(its KV cache holds no more)")
    if input_ids.shape[0] > plan.batch_size * plan.dp:
        at_once = (f"{plan.batch_size} per replica x {plan.dp} replicas" if plan.dp > 1 else str(plan.batch_size))
        raise PlanError(f"{input_ids.shape[0]} prompts are more than the plan decodes at once ({at_once})")


def check_sequence(prompt: list[int], max_new_tokens, prompt_len: int, plan_new_tokens: int,
                   kv_tokens: int | None, pool: str = "") -> None:
    """One request of a continuous-batching engine (either backend) against its plan: a prompt of
    at most ``prompt_len`` tokens, 1 to ``plan_new_tokens`` new ones, and with a KV-token pool
    (``kv_tokens``; ``pool`` qualifies it in the message) room for both."""
    if not prompt:
        raise PlanError("a prompt is empty: give at least one token")
    if len(prompt) > prompt_len:
        raise PlanError(f"the prompt is {len(prompt)} tokens, more than the plan's prompt length "
                        f"{prompt_len}: plan for longer prompts")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise PlanError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if max_new_tokens > plan_new_tokens:
        raise PlanError(f"max_new_tokens={max_new_tokens} is more than the plan's {plan_new_tokens} "
                        f"(its KV cache holds no more)")
    if kv_tokens is not None and len(prompt) + max_new_tokens > kv_tokens:
        raise PlanError(f"the request needs {len(prompt) + max_new_tokens} KV-cache tokens, more than the "
                        f"plan's pool of {kv_tokens}" + pool)


WHOLE_ROW_SETTINGS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                      "min_length": 0, "min_new_tokens": None, "suppress_tokens": None,
                      "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                      "sequence_bias": None, "encoder_repetition_penalty": 1.0}


WEIGHTS = ("weights=None (the model's own tensors) or weights=DIR: a Hugging Face safetensors checkpoint "
           "directory (model.safetensors or model.safetensors.index.json) or a training checkpoint written by "
           "compiled.save(DIR) (torch.distributed.checkpoint: .metadata, or its committed generation)")


def checkpoint_reader(model, directory: str):
    """``read(fqn, pieces, dim)`` of a checkpoint directory, either a Hugging Face safetensors one or
    a training checkpoint written by ``compiled.save`` (autopar/execution/weights.py ``open_weights``:
    ``SafetensorsWeights`` or ``DcpWeights``, names mapped across a training wrapper's prefix, tied
    aliases resolved): each rank reads only its blocks; counts what it read (``read.elements``).
    ExecutionError naming both formats for a directory that is neither."""
    from types import SimpleNamespace

    from autopar.execution.weights import open_weights
    if not isinstance(directory, (str, bytes)) and not hasattr(directory, "__fspath__"):
        from autopar.errors import ExecutionError
        raise ExecutionError(f"weights={directory!r}: options are {WEIGHTS}")
    aliases: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(fqn)
    tied = {fqn: names for names in aliases.values() if len(names) > 1 for fqn in names}
    source = open_weights(directory, SimpleNamespace(tied=tied), model, options=WEIGHTS)
    dtypes = dict((n, p.dtype) for n, p in model.named_parameters(remove_duplicate=False))

    def read(fqn: str, pieces: list[tuple], dim: int) -> torch.Tensor:
        blocks = [source.block(fqn, idx, "cpu") for idx in pieces]
        read.elements += sum(b.numel() for b in blocks)
        out = torch.cat(blocks, dim=dim) if len(blocks) > 1 else blocks[0]
        return out.to(dtypes.get(fqn, out.dtype))
    read.elements = 0
    read.source = source
    return read


def drop_parameters(model) -> None:
    """Every parameter of ``model`` moved to the meta device (tied aliases stay one tensor), so that
    with ``weights=DIR`` each value comes from the checkpoint, not from the model's own tensors."""
    import torch.nn as nn
    on_meta: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.is_meta:
                if id(p) not in on_meta:
                    on_meta[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                module._parameters[name] = on_meta[id(p)]


def fill_buffers(model, values: dict | None = None) -> None:
    """Buffers left on the meta device (rotary tables of a model built without weights) given
    their computed values: ``values`` (FQN -> tensor, from ``fill_meta_buffers`` before the model
    was moved off the meta device), else computed now."""
    if values is None:
        from autopar.execution.weights import fill_meta_buffers
        values = fill_meta_buffers(model)
    for fqn, value in values.items():
        owner, _, name = fqn.rpartition(".")
        model.get_submodule(owner)._buffers[name] = value
