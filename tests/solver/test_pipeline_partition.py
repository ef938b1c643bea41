"""solver/pipeline.py's stage partition against every split enumerated: the least 1F1B objective
``sum + (m - 1) x max`` over contiguous non-empty ranges within the memory budget, with one
device count per stage (the array DP the pipelined search uses) and with a choice of two."""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.errors import PlanError
from solver.pipeline import partition, pipeline_objective


def _every_split(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [(bounds[i], bounds[i + 1]) for i in range(k)]


def _least(n, k, m, cost, options, total, budget):
    best = math.inf
    for ranges in _every_split(n, k):
        for devices in itertools.product(options, repeat=k):
            if sum(devices) > total:
                continue
            priced = [cost(i, j, d) for (i, j), d in zip(ranges, devices)]
            if any(mem > budget for _t, mem in priced):
                continue
            best = min(best, pipeline_objective([t for t, _ in priced], m))
    return best


@st.composite
def _instances(draw):
    n = draw(st.integers(1, 7))
    k = draw(st.integers(1, n))
    m = draw(st.integers(1, 12))
    work = draw(st.lists(st.sampled_from([0.5, 1.0, 1.25, 2.0, 3.0]), min_size=n, max_size=n))
    mem = draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=n, max_size=n))
    budget = draw(st.sampled_from([math.inf, 4.0, 2.0]))
    two = draw(st.booleans())
    return n, k, m, work, mem, budget, two


@settings(max_examples=150, deadline=None)
@given(_instances())
def test_partition_is_the_least_objective_over_every_split(case):
    n, k, m, work, mem, budget, two = case
    options = (1, 2) if two else (2,)
    total = k * 2 if not two else k + 1   # two options: not every stage can take 2 devices

    def cost(i, j, d):
        return sum(work[i:j]) / d, sum(mem[i:j])

    want = _least(n, k, m, cost, options, total, budget)
    if not math.isfinite(want):
        with pytest.raises(PlanError):
            partition(n, k, m, cost, device_options=options, total_devices=total, memory_budget=budget)
        return
    got = partition(n, k, m, cost, device_options=options, total_devices=total, memory_budget=budget)
    assert got.objective == pytest.approx(want, rel=1e-12)
    assert [s[0] for s in got.stages] == [0] + [s[1] for s in got.stages[:-1]] and got.stages[-1][1] == n
    assert all(i < j for i, j, _ in got.stages) and sum(d for *_, d in got.stages) <= total
    assert all(cost(i, j, d)[1] <= budget for i, j, d in got.stages)
