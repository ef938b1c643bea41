"""Pipelined generation: each stage's ranks keep their plan's decoder layers (``plan.stages``:
[first, end) per stage) and pass hidden states to the next stage, point to point.

Every rank still runs the model's own forward and ``generate`` loop, so the embeddings, masks,
positions, cache bookkeeping and sampling are the model's; only the layers differ per stage:

* a layer of another stage is a ``Skip`` (no parameters, no KV cache: the static cache fills a
  layer only when its attention writes to it), which returns its input; the cache's entries of
  those layers point at one of the stage's own (``share_cache_layers``), so the sequence length
  and mask sizes the model reads from the cache are right on every stage;
* the first layer of stage s > 0 takes its input from stage s - 1 (``recv`` from the rank of the
  same tensor-parallel index), and the last layer of stage s < pp - 1 sends its output on;
* the last stage computes the logits and broadcasts them to the other stages of its pipeline,
  whose output head is a ``ReceivedLogits`` (no parameters): every rank then picks the same
  next token, as ``generate`` needs.

So a step costs one pass of every layer in stage order; one batch per step, no micro-batching
across stages yet (a stage waits while the others run: the latency of pp=1 plus the transfers,
memory split by pp).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError


class Skip(nn.Module):
    """A decoder layer held by another stage: its input, unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class ReceivedLogits(nn.Module):
    """The output head of a stage before the last: the logits the last stage broadcasts."""

    def __init__(self, vocab: int, src: int, group):
        super().__init__()
        self.vocab, self.src, self.group = vocab, src, group

    def forward(self, hidden):
        out = hidden.new_empty((*hidden.shape[:-1], self.vocab))
        dist.broadcast(out, src=self.src, group=self.group)
        return out


def decoder_layers(model) -> nn.ModuleList:
    """The causal LM's list of decoder layers: the ModuleList of ``num_hidden_layers`` blocks."""
    n = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", None)
    found = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(found) != 1:
        raise PlanError(f"{type(model).__name__}: cannot tell its {n} decoder layers apart for pipelined "
                        f"generation; plan with constraints={{'pp': 1}}")
    return found[0]


def keep_stage_layers(model, bounds: tuple[int, int]) -> None:
    """Replace the layers outside ``bounds`` ([first, end)) by ``Skip`` (before loading weights:
    the stage never holds the others)."""
    layers = decoder_layers(model)
    for i in range(len(layers)):
        if not bounds[0] <= i < bounds[1]:
            layers[i] = Skip()


def connect_stages(model, stage: int, stages: list, pipe_ranks: list[int], group) -> None:
    """Hooks that move hidden states between stages and the logits from the last stage (module
    doc). ``pipe_ranks``: this rank's pipeline, one rank per stage; ``group``: their process group."""
    layers = decoder_layers(model)
    first, end = stages[stage]
    last = len(stages) - 1
    if stage > 0:
        def receive(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            got = torch.empty_like(hidden)
            dist.recv(got, src=pipe_ranks[stage - 1])
            if args:
                return (got, *args[1:]), kwargs
            return args, dict(kwargs, hidden_states=got)
        layers[first].register_forward_pre_hook(receive, with_kwargs=True)
    if stage < last:
        def send(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            dist.send(hidden.contiguous(), dst=pipe_ranks[stage + 1])
        layers[end - 1].register_forward_hook(send)
    head = model.get_output_embeddings()
    if stage < last:
        vocab = model.config.vocab_size
        _set_output_embeddings(model, ReceivedLogits(vocab, pipe_ranks[last], group))
    else:
        def share(module, args, output):
            dist.broadcast(output.contiguous(), src=pipe_ranks[last], group=group)
        head.register_forward_hook(share)


def share_cache_layers(cache, model, bounds: tuple[int, int]) -> None:
    """Point the static cache's entries of the layers outside ``bounds`` at one of this stage's
    own layers of the same attention kind. Those layers never write to the cache, but the model
    asks the cache how long the sequence is (``get_seq_length``: layer 0) and how large the mask
    is (the first layer of each kind): a stage must answer with a layer it fills."""
    kinds = list(getattr(model.config, "layer_types", None) or ["full_attention"] * len(cache.layers))
    first, end = bounds
    own = {}
    for i in range(first, end):
        own.setdefault(kinds[i], i)
    for i in range(len(cache.layers)):
        if not first <= i < end:
            cache.layers[i] = cache.layers[own.get(kinds[i], first)]


def _set_output_embeddings(model, module) -> None:
    for name, child in model.named_modules():
        for attr, sub in child.named_children():
            if sub is model.get_output_embeddings():
                setattr(child, attr, module)
                return
    raise PlanError(f"{type(model).__name__}: no output head found for pipelined generation")
