"""Every example runs to the end and prints what it promises."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


EXAMPLES = Path(__file__).parent.parent / "examples"


# With the heavy tests, each a few seconds to a quarter of a minute of CPU: the README's
# first command runs the main example itself.
@pytest.mark.parametrize(
    "script, expected",
    [
        pytest.param(
            "linear_regression.py", "learned weights (true: all 1)", marks=pytest.mark.heavy
        ),
        pytest.param("spirals_gru.py", "final validation accuracy", marks=pytest.mark.heavy),
        pytest.param("digits.py", "test accuracy", marks=pytest.mark.heavy),
        pytest.param("digits_batchnorm.py", "test accuracy", marks=pytest.mark.heavy),
        pytest.param("data_parallel.py", "largest parameter difference", marks=pytest.mark.heavy),
        pytest.param("sweep.py", "wrote sweep.png", marks=pytest.mark.heavy),
        pytest.param("transformer_lm.py", "sample:", marks=pytest.mark.heavy),
        pytest.param("gan.py", "generated after epoch 10", marks=pytest.mark.heavy),
        pytest.param("ppo.py", "final mean return", marks=pytest.mark.heavy),
        pytest.param(
            "packed_sequences.py", "unpacked loss after training", marks=pytest.mark.heavy
        ),
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
