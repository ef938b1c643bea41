"""The lint configuration (pyproject.toml, [tool.ruff]) holds on the whole tree: ruff runs in CI
through this test (it is in the test extra)."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install ruff, or the test extra)")
    proc = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
