"""Pipelined generation: each stage's ranks keep their plan's decoder layers (``plan.stages``:
[first, end) per stage) and pass hidden states to the next stage, point to point.

Every rank still runs the model's own forward, so the embeddings, masks, positions, cache
bookkeeping and sampling are the model's; only the layers differ per stage:

* a layer of another stage is a ``Skip`` (no parameters, no KV cache: the static cache fills a
  layer only when its attention writes to it), which returns its input; the cache's entries of
  those layers point at one of the stage's own (``share_cache_layers``), so the sequence length
  and mask sizes the model reads from the cache are right on every stage;
* the first layer of stage s > 0 takes its input from stage s - 1 (``recv`` from the rank of the
  same tensor-parallel index), and the last layer of stage s < pp - 1 sends its output on;
* the last stage computes the logits; the other stages' output head is a ``ReceivedLogits`` (no
  parameters).

``connect_stages`` returns the ``StageLink`` the hooks share, in one of two modes:

* **one pass at a time** (the static engine, autopar/inference/engine.py, under Hugging Face's
  ``generate``): every forward is one pass through the stages in order; the sends block, and the
  last stage broadcasts each forward's logits to the other stages of its pipeline (its head's hook,
  and ``ReceivedLogits`` on the others), so every rank picks the same next token. One batch per
  step: a stage waits while the others run (the latency of pp=1 plus the transfers, memory split
  by pp).
* **in flight** (``in_flight``: the continuous engine's ticks, autopar/inference/
  iteration_engine.py): in a tick each stage works on its own micro-batch. A stage's sends are
  ``isend``s, waited on at the end of the next tick (``wait_sends``, after the next stage has
  received them: a stage never waits on the next one within a tick); the receives block on data
  sent in the previous tick; the heads broadcast nothing, and at the end of the tick the engine
  broadcasts the last stage's logits of the micro-batch it finished (``share_logits``).
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


class StageLink:
    """This rank's place in its pipeline (``pipe_ranks``: one rank per stage, ``group``: theirs)
    and the mode its hooks run in (module doc)."""

    def __init__(self, stage: int, pipe_ranks: list[int], group):
        self.stage, self.pipe_ranks, self.group = stage, pipe_ranks, group
        self.last = len(pipe_ranks) - 1
        self.in_flight = False
        self.sends: list = []      # in flight: this tick's (work, tensor) isends
        self.sending: list = []    # in flight: the previous tick's, waited on by ``wait_sends``

    def send(self, hidden: torch.Tensor) -> None:
        hidden = hidden.contiguous()
        dst = self.pipe_ranks[self.stage + 1]
        if self.in_flight:
            self.sends.append((dist.isend(hidden, dst=dst), hidden))
        else:
            dist.send(hidden, dst=dst)

    def wait_sends(self) -> None:
        """The end of a tick: wait for the previous tick's sends (the next stage has received them
        in this tick); this tick's are waited on at the end of the next."""
        for work, _ in self.sending:
            work.wait()
        self.sending, self.sends = self.sends, []

    def share_logits(self, logits: torch.Tensor | None, rows: int, vocab: int, dtype, device) -> torch.Tensor:
        """The last stage's ``logits`` ([rows, vocab]) on every stage of the pipeline (the others
        pass None)."""
        if self.stage == self.last:
            out = logits.to(dtype).contiguous()
        else:
            out = torch.empty(rows, vocab, dtype=dtype, device=device)
        dist.broadcast(out, src=self.pipe_ranks[self.last], group=self.group)
        return out

    def drop(self) -> None:
        """Forget the sends in flight (after a failed step: the pipeline is out of step)."""
        self.sends, self.sending = [], []


class ReceivedLogits(nn.Module):
    """The output head of a stage before the last: the logits the last stage broadcasts (in
    flight: zeros, which the engine does not read)."""

    def __init__(self, vocab: int, link: StageLink):
        super().__init__()
        self.vocab, self.link = vocab, link

    def forward(self, hidden):
        out = hidden.new_empty((*hidden.shape[:-1], self.vocab))
        if self.link.in_flight:
            return out.zero_()
        dist.broadcast(out, src=self.link.pipe_ranks[self.link.last], group=self.link.group)
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


def connect_stages(model, stage: int, stages: list, pipe_ranks: list[int], group) -> StageLink:
    """Hooks that move hidden states between stages and the logits from the last stage (module
    doc). ``pipe_ranks``: this rank's pipeline, one rank per stage; ``group``: their process group.
    Returns the hooks' ``StageLink`` (one pass at a time until its ``in_flight`` is set)."""
    layers = decoder_layers(model)
    first, end = stages[stage]
    last = len(stages) - 1
    link = StageLink(stage, pipe_ranks, group)
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
            link.send(output[0] if isinstance(output, tuple) else output)
        layers[end - 1].register_forward_hook(send)
    head = model.get_output_embeddings()
    if stage < last:
        vocab = model.config.vocab_size
        _set_output_embeddings(model, ReceivedLogits(vocab, link))
    else:
        def share(module, args, output):
            if not link.in_flight:
                dist.broadcast(output.contiguous(), src=pipe_ranks[last], group=group)
        head.register_forward_hook(share)
    return link


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
