"""Every example runs to the end and prints what it promises."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize(
    "script, expected",
    [
        ("linear_regression.py", "learned weights (true: all 1)"),
        ("digits.py", "test accuracy"),
        ("digits_batchnorm.py", "test accuracy"),
        ("data_parallel.py", "largest parameter difference"),
        ("sweep.py", "wrote sweep.png"),
        ("spirals_gru.py", "final validation accuracy"),
    ],
)
def test_example_runs(script, expected, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert expected in run.stdout
