"""Every kernel compiled ahead of time for CUDA sm_80 and sm_90 (runtime/kernels/aot.py), through
the command CI runs: ``autopar kernels --aot sm_80,sm_90``. Skipped where this triton lacks
ASTSource / GPUTarget or ptxas."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("triton")

from runtime.kernels.aot import ARCHS, CASES, build_in_child, parse_archs  # noqa: E402


@pytest.fixture(scope="module")
def compiled() -> dict:
    results = build_in_child(ARCHS)
    if "__skip__" in results:
        pytest.skip(results["__skip__"])
    return results


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_compiles_for_cuda(compiled, case, arch):
    assert compiled[f"{case}-sm{arch}"] == "ok"


def test_the_cli_builds_every_kernel_and_says_so(compiled):
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "kernels", "--aot", "sm_90"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(CASES)} of {len(CASES)} kernel builds ok for sm_90" in proc.stdout


def test_bad_architecture_is_a_clear_error():
    assert parse_archs("sm_80, 90") == (80, 90)
    with pytest.raises(ValueError, match="not a CUDA architecture"):
        parse_archs("ampere")
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "kernels", "--aot", "ampere"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a CUDA architecture" in proc.stderr
