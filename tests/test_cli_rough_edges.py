"""What an operator hit with the `simpledbi` command and benchmark.py: each test failed on the code before."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simpledbi(*args: str, cwd: str = ROOT, timeout: float = 100, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simpledbi", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


@pytest.mark.timeout(120)
def test_an_unknown_flag_after_a_command_shows_that_commands_usage_and_names_the_flag():
    # it printed "usage: simpledbi [-h] {serve,status,reload} ...", which lists none of serve's flags
    out = _simpledbi("serve", "--bogus", "x")
    assert out.returncode == 2, out
    assert out.stderr.startswith("usage: simpledbi serve [-h]") and "--max-batch-size" in out.stderr, out.stderr
    assert out.stderr.rstrip().endswith("simpledbi serve: error: unrecognized arguments: --bogus x"), out.stderr
