"""Every example runs to the end and prints what it promises."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
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


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpt2_tiny_trains_and_reports(tmp_path):
    """`examples/gpt2.py --size tiny` on the CPU: it trains on a text's bytes (whose loss
    falls, as random tokens' does not) and prints and writes its figures. It imports no
    splash attention (Pallas's TPU kernel) where it takes XLA's attention (`-X importtime`
    lists every module imported).
    """
    figures = tmp_path / "gpt2.json"
    command = [sys.executable, "-X", "importtime", str(EXAMPLES / "gpt2.py"), "--size", "tiny"]
    command += ["--text", str(EXAMPLES.parent / "README.md"), "--steps", "8", "--epochs", "2"]
    command += ["--peak-tflops", "1", "--json", str(figures)]
    # With the suite's XLA flags (compiled for the compiler's speed), to keep it quick.
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "splash_attention" not in run.stderr
    written = json.loads(figures.read_text())
    assert written["attention"] == "xla" and written["steps"] == 16
    assert all(math.isfinite(x) for x in written["epoch_loss"])
    # From log(256) = 5.55 nats a byte, the initial model's.
    assert written["first_loss"] == pytest.approx(math.log(256), abs=0.2)
    assert written["final_loss"] < written["first_loss"] - 0.5
    assert written["seconds_per_step"] > 0
    tokens = 4 * 64 / written["seconds_per_step"]
    assert written["tokens_per_second"] == pytest.approx(tokens)
    assert 0 < written["mfu"] < 1
    assert written["mfu"] == pytest.approx(written["flops_per_second"] / 1e12)
    line = run.stdout.splitlines()[-1]
    assert line.startswith("16 steps: ") and "tokens/s" in line
    assert f"MFU {written['mfu']:.1%}" in line


@pytest.mark.slow
def test_gpt2_splash_attention_matches_xla():
    """The example's splash attention (its causal mask per head, block sizes, layout and
    scale), run in Pallas's interpreter on the CPU, against XLA's causal attention: the
    values and each gradient. 384 positions make 3 x 3 blocks of 128: blocks the mask
    hides, blocks on its diagonal and blocks it keeps whole.
    """
    example = load_example("gpt2")
    q, k, v, weights = jax.random.normal(jax.random.key(0), (4, 2, 384, 2, 64))

    def total(q, k, v, kernel):
        return (example.attention(q, k, v, kernel) * weights).sum()

    def values_and_gradients(kernel):
        out = example.attention(q, k, v, kernel)
        return out, jax.grad(total, argnums=(0, 1, 2))(q, k, v, kernel)

    splash, splash_grads = jax.jit(values_and_gradients, static_argnums=0)("splash")
    xla, xla_grads = jax.jit(values_and_gradients, static_argnums=0)("xla")
    np.testing.assert_allclose(splash, xla, atol=1e-4)
    for splash_grad, xla_grad in zip(splash_grads, xla_grads):
        np.testing.assert_allclose(splash_grad, xla_grad, atol=1e-3)

    short = jax.numpy.zeros((1, 64, 2, 64))
    with pytest.raises(ValueError, match="multiple of 128 positions, got 64"):
        example.attention(short, short, short, "splash")
