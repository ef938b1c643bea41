"""The printed code of one rank's program, for ``autopar show plan.json --code --rank R --factory F``.

``per_rank_code(plan, rank, factory, pairs)`` builds the model from its factory, traces it (one
micro-batch when the plan runs several), checks the plan's fingerprint, generates the rank's
program (codegen/per_rank.py) and returns its code with a header, followed by the count program
of the mean losses' denominators when it has one (codegen/loss_counts.py).
"""
from __future__ import annotations

from codegen.per_rank import generate
from autopar.errors import ExecutionError
from autopar.frontend.batching import plan_batch_dims
from autopar.frontend.trace import trace
from autopar.models import load_factory
from autopar.rules.microbatch import batch_carrying


def per_rank_code(plan, rank: int, factory, pairs=()) -> str:
    """Printed code of ``rank``'s program for ``autopar show plan.json --code --rank R --factory F``.
    ``factory`` is a zoo name / "module:FN" / a callable returning (model, example_inputs);
    ``pairs`` are "name=value" keyword arguments for it (values parsed as Python literals)."""
    import ast

    fn = load_factory(factory) if isinstance(factory, str) else factory
    kwargs = {}
    for pair in pairs or ():
        k, _, v = pair.partition("=")
        try:
            kwargs[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            kwargs[k] = v
    model, inputs = fn(**kwargs)
    nm = plan.data["degrees"].get("num_micro_batches", 1) or 1
    traced = trace(model, inputs)
    if traced.fingerprint != plan.fingerprint:
        raise ExecutionError(f"plan made for a different model: plan fingerprint {plan.fingerprint[:12]}, "
                             f"{factory} traces to {traced.fingerprint[:12]}")
    carrying = None
    if nm > 1:   # the program runs one micro-batch: cut every input along its batch dim
        dims = plan_batch_dims(plan.data, len(inputs))
        micro = trace(model, tuple(x if d is None else x.narrow(d, 0, x.shape[d] // nm) for x, d in zip(inputs, dims)))
        carrying, traced = batch_carrying(traced, micro), micro
    prog = generate(traced, plan, rank, batch_carrying=carrying)
    header = (f"# rank {rank} of mesh {plan.mesh.describe()}, coords {prog.coords}\n"
              f"# loss layout: {prog.loss_layout.describe(plan.mesh.names)}\n")
    code = header + prog.code
    if prog.count_gm is not None:   # what step runs first: this rank's share of the mean losses' denominators
        axes = ", ".join(f"{n} over {[plan.mesh.names[a] for a in ax]}" for n, ax in prog.mean_losses)
        code += f"\n# global denominators of mean losses (summed over micro-batches, all-reduced: {axes}):\n" \
            + prog.count_gm.code
    return code
