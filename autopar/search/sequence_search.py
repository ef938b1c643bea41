"""Sequence axes in the free search: when the search adds Ulysses / ring meshes on its
own, with neither ``sp`` nor ``sp_mode`` pinned (autopar/search/pipeline_search.py step 3):

(a) nothing fits memory without them (``search_with_sp``: one rerun per sequence-axis size, the ILP
    choosing Ulysses, ring or the K/V all-gather per attention op; the error then reports the
    smallest peak over all);
(b) some attention's sequence is at least ``SP_UPFRONT_RATIO`` times its hidden size
    (``fastest_with_sp``: the same reruns, kept when faster).

Each size is also tried as the Ulysses x ring hybrid (two sequence axes, ``sp_mode="hybrid"``)
where that can pay: the sequence axis spans more than one node, or some attention's heads do not
divide by sp (``hybrid_sequence.free_search_pins``); otherwise the search stays as it was.

In both cases pipelined candidates with a sequence axis in every stage follow
(autopar/search/pipeline_search.py step 3, sizes from ``stage_sp_sizes``).
``constraints={"sp": 1}`` rules both out (tensor parallelism only). What a sequence axis does to
the strategies is autopar/rules/sequence.py's.
"""
from __future__ import annotations

import math

from autopar.errors import MemoryBudgetError, PlanError
from autopar.frontend.batching import graph_batch_dims
from autopar.rules.attention_core import is_anchor, op_name
from autopar.rules.hybrid_sequence import free_search_pins
from autopar.rules.sequence import input_seq_dims
from autopar.rules.table import shape
from autopar.search.context import CutOff
from autopar.search.outer import format_bytes
from codegen.grid_layout import GRID_MODES


def sp_free(constraints: dict) -> bool:
    """Whether the search may add sequence axes on its own: neither ``sp`` nor ``sp_mode`` pinned
    (``sp=1`` is how a caller asks for no sequence axis), and no grid tensor mode."""
    return ("sp" not in constraints and constraints.get("sp_mode") is None
            and constraints.get("tp_mode") not in GRID_MODES)


def has_sequence_attention(graph) -> bool:
    """An attention op (softmax or fused SDPA, attention_core.is_anchor) in a model whose user
    inputs carry a sequence dim (``input_seq_dims``): what a sequence axis can split."""
    if not any(input_seq_dims(graph, graph_batch_dims(graph)).values()):
        return False
    return any(is_anchor(n) for n in graph.gm.graph.nodes)


def sp_sizes(cluster) -> list[int]:
    """The sequence-axis sizes the free search retries with: every divisor > 1 of the devices."""
    n = cluster.num_devices
    return [k for k in range(2, n + 1) if n % k == 0]


def search_with_sp(planner, constraints: dict, err):
    """The free search's retry when nothing fits memory (module doc of pipeline_search, step 3):
    ``planner.search`` (autopar/search/context.py ``Planner``: the pp=1 search) with each
    sequence-axis size ``sp_sizes`` pinned and the attention mode left to the ILP
    (``"auto"``: Ulysses, ring or the K/V all-gather per attention op). The fastest result, or,
    when none fits either, a MemoryBudgetError with the smallest peak over ``err`` and every
    retry. ``err`` (the free search's MemoryBudgetError, or its ConstraintError when no
    configuration without a sequence axis exists: a batch smaller than the nodes) is raised as it
    is when the retry does not apply (sp pinned, or no attention over a sequence) or finds nothing."""
    if not sp_free(constraints) or not has_sequence_attention(planner.graph):
        raise err
    floors = [getattr(err, "min_peak_bytes", None)]
    budgets: list = []
    best = fastest_over_sp(planner, constraints, floors, budgets)
    if best is not None:
        return best
    floors = [f for f in floors if f is not None]
    budget = getattr(err, "budget_bytes", None) or (budgets[0] if budgets else None)
    if not floors or budget is None:
        raise err
    raise no_fit_error(budget, min(floors))


def no_fit_error(budget: int, floor: float) -> MemoryBudgetError:
    """The free search's error when no plan fits, with or without sequence axes (and pipelining)."""
    return MemoryBudgetError(
        f"no plan fits in the memory budget of {format_bytes(budget)} per device, with or without a "
        f"sequence-parallel axis (Ulysses / ring attention): the smallest peak memory any plan reaches is "
        f"{format_bytes(floor)}. Raise memory_budget to at least that, add devices, use a smaller batch or "
        f"a shorter sequence, or relax constraints.",
        min_peak_bytes=int(math.ceil(floor)), budget_bytes=budget)   # the least budget that fits: rounded up


# Sequence axes up front (module doc, (b)): when some attention's sequence is at least this many
# times its hidden size (heads x head dim); at the hidden size itself a sequence axis did not pay.
SP_UPFRONT_RATIO = 2


def _attention_shape(n) -> tuple[int, int] | None:
    """(key sequence length, hidden = heads x head dim) of an attention anchor, or None."""
    try:
        if "scaled_dot_product" in op_name(n):
            q, k = shape(n.args[0]), shape(n.args[1])
            return (k[-2], q[-3] * q[-1]) if len(q) >= 3 else None
        scores = shape(n.args[0])            # softmax over (b, heads, s_q, s_k)
        if len(scores) < 4:
            return None
        frontier = [n.args[0]]
        for _ in range(6):                   # up to the q @ k^T contraction (scale and mask between)
            nxt = []
            for m in frontier:
                if getattr(m, "op", None) != "call_function":
                    continue
                if op_name(m) in ("matmul", "bmm", "einsum") and hasattr(m.args[0], "meta"):
                    qs = shape(m.args[0])
                    return scores[-1], scores[-3] * qs[-1]
                nxt += [a for a in m.args if hasattr(a, "meta")]
            frontier = nxt
    except (AttributeError, IndexError, TypeError):
        return None
    return None


def long_sequence(graph) -> bool:
    """Some attention's sequence is at least ``SP_UPFRONT_RATIO`` times its hidden size."""
    for n in graph.gm.graph.nodes:
        if is_anchor(n):
            sh = _attention_shape(n)
            if sh is not None and sh[0] >= SP_UPFRONT_RATIO * sh[1]:
                return True
    return False


def upfront(graph, constraints: dict) -> bool:
    """Whether the free search offers sequence axes next to the rest even when a plan fits."""
    return sp_free(constraints) and has_sequence_attention(graph) and long_sequence(graph)


def fastest_with_sp(planner, constraints: dict, **options):
    """The fastest ``planner.search(constraints + sp, **options)`` over ``sp_sizes``, or None (none
    found, or the search does not offer sequence axes up front: ``upfront``)."""
    if not upfront(planner.graph, constraints):
        return None
    return fastest_over_sp(planner, constraints, **options)


def stage_sp_sizes(stage_cluster, preferred: int | None = None) -> list[int]:
    """The sequence-axis sizes pinned in pipelined candidates whose stages run on ``stage_cluster``
    (autopar/search/pipeline_search.py step 3): with ``preferred`` (the best pp=1 plan's sp) the
    largest size up to it that divides a stage's devices, else every size ``sp_sizes`` gives."""
    sizes = sp_sizes(stage_cluster)
    if preferred is None:
        return sizes
    fit = [k for k in sizes if k <= preferred]
    return fit[-1:]


def fastest_over_sp(planner, constraints: dict, floors: list | None = None, budgets: list | None = None,
                    **options):
    """The fastest ``planner.search(constraints + sp, **options)`` over ``sp_sizes``, each size also as the Ulysses x
    ring hybrid where that can pay (``hybrid_sequence.free_search_pins``: the axis spans nodes,
    or the heads do not divide by sp), or None; a run that does not fit adds its smallest peak to
    ``floors`` (and its budget to ``budgets``), one with no such mesh (batch / heads do not
    divide) or cut off is skipped."""
    best = None
    tries = []
    for sp in sp_sizes(planner.cluster):
        tries.append(dict(constraints, sp=sp))
        hybrid = free_search_pins(planner.graph, planner.cluster, sp)
        if hybrid is not None:
            tries.append(dict(constraints, sp=sp, **hybrid))
    for pins in tries:
        try:
            out = planner.search(pins, **options)
        except MemoryBudgetError as e:
            if floors is not None:
                floors.append(e.min_peak_bytes)
            if budgets is not None:
                budgets.append(e.budget_bytes)
            continue
        except (PlanError, CutOff):   # ConstraintError, a sequence mode the model cannot run, cut off
            continue
        if best is None or out[0].prediction["step_time"] < best[0].prediction["step_time"]:
            best = out
    return best
