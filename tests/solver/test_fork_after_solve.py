"""A process that solved with HiGHS's threads and then forks (run_local's ranks, the planner's
workers): the child's own solve finishes (solver/backends.py releases the threads before a fork;
without that, a rank planning after its parent's solve hung past 100 s in CI)."""
from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

highspy = pytest.importorskip("highspy")


def _threaded_mip(n: int = 300) -> float:
    """A small knapsack-like MIP solved with two threads: the scheduler's workers start."""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 2)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, 1
    rng = np.random.default_rng(0)
    lp.col_cost_ = rng.random(n)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
    lp.row_lower_, lp.row_upper_ = np.array([3.0]), np.array([1e30])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.arange(n + 1).astype(np.int32)
    lp.a_matrix_.index_ = np.zeros(n, dtype=np.int32)
    lp.a_matrix_.value_ = rng.random(n) + 0.5
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    h.passModel(lp)
    h.run()
    value = h.getInfo().objective_function_value
    del h
    return value


def _child(queue) -> None:
    queue.put(_threaded_mip())


def test_a_forked_child_solves_after_its_parent_solved_with_threads():
    import solver  # noqa: F401  (registers the release before fork)
    expected = _threaded_mip()   # the parent's scheduler now has live worker threads
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,), daemon=True)
    proc.start()
    proc.join(timeout=60)
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join()
    assert not hung, "the forked child's HiGHS solve hung on the parent's copied thread pool"
    assert queue.get(timeout=5) == pytest.approx(expected)
