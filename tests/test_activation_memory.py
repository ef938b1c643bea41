"""The activation-memory model against measurement: the bytes autograd saves for backward
during a real forward pass (torch.autograd.graph.saved_tensors_hooks, each storage counted once,
parameters excluded) must equal the planner's estimate within 1%, for several models and for
data-parallel layouts (each rank's estimate vs a forward on its share of the batch)."""
from __future__ import annotations

import pytest
import torch

from autopar.search.build import build_problem, chosen
from autopar.rules.candidates import candidates
from autopar.pricing.price import Settings, price
from solver.ilp import solve
from autopar.mesh import Mesh
from autopar.models import ZOO
from autopar.frontend.trace import trace
from autopar.cluster import Cluster


def measured_saved_bytes(model: torch.nn.Module, inputs: tuple) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    loss.backward()
    return sum(seen.values())


def estimated_saved_bytes(model, inputs, mesh: Mesh) -> float:
    graph = trace(model, inputs)
    cands = candidates(graph, mesh)
    settings = Settings(precision="fp32", checkpoint="none")
    P = price(cands, Cluster.preset("cpu", devices=mesh.size), settings)
    problem = build_problem(cands, P, settings)
    sol = solve(problem)
    choice = chosen(problem, sol)
    return sum(float(arr[choice[n]]) for n, arr in P.saved.items() if len(arr))


MODELS = {
    "gpt2": dict(n_layer=2),
    "llama": {},
    "bert": {},
    "vit": {},
    "mlp": {},
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dp", [1, 2])
def test_saved_activation_bytes_match_autograd(name, dp):
    model, inputs = ZOO[name](**MODELS[name])
    mesh = Mesh((dp,), ("dp",), devices_per_node=dp)
    est = estimated_saved_bytes(model, inputs, mesh)
    # one data-parallel rank runs the forward on its rows of the batch
    local = tuple(x[: x.shape[0] // dp].clone() if isinstance(x, torch.Tensor) and x.ndim else x for x in inputs)
    meas = measured_saved_bytes(model, local)
    assert meas > 0
    assert est == pytest.approx(meas, rel=0.01), f"{name} dp={dp}: estimated {est:.0f} B, measured {meas} B"
