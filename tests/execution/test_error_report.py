"""Errors under several processes appear once (autopar/execution/error_report.py), through a real launcher."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from autopar.execution.error_report import format_error
from autopar.errors import ExecutionError, PlanError


def test_collective_errors_are_reported_by_rank_0_only():
    e = ExecutionError("step() got 1 inputs", collective=True)
    assert format_error(e, 0) == "autopar: error: ExecutionError: step() got 1 inputs"
    assert format_error(e, 3) is None
    assert format_error(PlanError("no plan fits"), 2) is None
    one = ExecutionError("training step failed: peer gone")
    assert format_error(one, 2) == "autopar: error: (rank 2) ExecutionError: training step failed: peer gone"


@pytest.mark.slow
def test_a_wrong_batch_under_autopar_run_prints_one_line(tmp_path):
    script = tmp_path / "wrong_batch.py"
    script.write_text(textwrap.dedent("""
        import autopar
        from autopar.models import ZOO
        model, batch = ZOO["mlp"]()
        cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=2), example_inputs=batch,
                             plan_options={"constraints": {"dp": 2, "tp": 1, "num_micro_batches": 1}})
        cm.step(batch[0])     # forgot the targets
    """))
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if "autopar: error:" in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    assert "step() got 1 inputs" in lines[0] and "Traceback" not in out.stderr, out.stderr[-3000:]
