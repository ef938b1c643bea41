"""autopar.frontend.trace.trace_step: a forward returning several tensors (an inference step
with its state as explicit inputs and outputs) traced with every output kept, its parameters
frozen, and trace's state checks; the training ``trace`` still takes one scalar loss."""
import pytest
import torch
import torch.nn as nn

from autopar.errors import TraceError
from autopar.frontend.trace import trace, trace_step


class Step(nn.Module):
    """logits of x and a state written out of place at ``pos``: (logits, new_state)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x, pos, state):
        h = self.lin(x)
        return h.sum(-1), state.index_copy(1, pos, h[:, None, :])


class InPlace(Step):
    def forward(self, x, pos, state):
        h = self.lin(x)
        state.index_copy_(1, pos, h[:, None, :])
        return h.sum(-1), state


def _inputs():
    return torch.randn(2, 4), torch.tensor([1]), torch.zeros(2, 3, 6)


def run(tg, model, inputs):
    named = dict(model.named_parameters())
    args = [named[tg.param_fqn[n.name]] for n in tg.gm.graph.nodes if n.op == "placeholder" and n.name in tg.param_fqn]
    return tg.gm(*args, *inputs)


def test_trace_step_keeps_every_output_in_order_and_freezes_parameters():
    torch.manual_seed(0)
    model, inputs = Step(), _inputs()
    tg = trace_step(model, inputs)
    assert len(tg.outputs) == 2 and tg.output_name == tg.outputs[0]
    out = next(n for n in tg.gm.graph.nodes if n.op == "output")
    assert [a.name for a in out.args[0]] == tg.outputs
    assert tg.input_names == ["x", "pos", "state"]
    params = set(tg.param_fqn)
    assert params and tg.frozen == params and params <= tg.buffers   # no gradient priced
    assert all(p.requires_grad for p in model.parameters())          # the module itself untouched
    got = run(tg, model, inputs)
    want = model(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert got[1][:, 1].abs().sum() > 0 and got[1][:, 0].abs().sum() == 0


def test_trace_step_refuses_an_in_place_state_write():
    with pytest.raises(TraceError, match="mutates state"):
        trace_step(InPlace(), _inputs())


def test_training_trace_still_takes_one_scalar_loss():
    with pytest.raises(TraceError, match="returns 2 outputs"):
        trace(Step(), _inputs(), frontend="export")
    tg = trace(nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)), (torch.randn(3, 4),),
               loss_fn=lambda out: out.sum())
    assert tg.outputs == [tg.output_name] and not tg.frozen
