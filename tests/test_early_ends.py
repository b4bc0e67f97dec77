"""Every early end keeps the process alive and the work: a loader that raises, a second
Ctrl-C on a real model's slow steps. Each run is a process of its own, which must exit
cleanly (an abort at exit, rc -6, is a crash to the user).
"""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import worker_env

import eqfit


HERE = Path(__file__).parent
WORKER = HERE / "early_end_worker.py"


def test_a_loader_that_raises_raises_with_the_training_so_far():
    x = np.ones((16, 3), np.float32)

    def batches():
        for _ in range(6):
            yield x, x.sum(axis=1)
        raise RuntimeError("the loader broke")

    model = eqfit.models.LinearRegression(3, key=jax.random.key(0))
    with pytest.raises(RuntimeError, match="the loader broke") as caught:
        eqfit.fit(
            model,
            batches(),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.01),
            key=jax.random.key(1),
            epochs=5,
            steps_per_epoch=2,
        )
    result = caught.value.result  # type: ignore[attr-defined]
    assert isinstance(result.model, eqfit.models.LinearRegression)
    assert result.history.stop_reason == "error"
    assert int((result.history.batch_sizes > 0).sum()) == 6  # every batch it gave trained
    assert not np.array_equal(result.model.weight, model.weight)


@pytest.mark.heavy
@pytest.mark.parametrize("progress", [False, True])
def test_a_raising_loader_leaves_the_process_alive(progress):
    args = [sys.executable, str(WORKER), "raising-loader"] + (["progress"] if progress else [])
    for _ in range(4):  # it aborted at exit in 7 runs of 8
        run = subprocess.run(
            args, capture_output=True, text=True, env=worker_env(HERE), timeout=120
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert "raised RuntimeError after 7 epochs, 25 steps" in run.stdout


@pytest.mark.heavy
def test_slow_steps_move_the_bar_soon_and_two_ctrl_cs_end_cleanly():
    for _ in range(2):
        process = subprocess.Popen(
            [sys.executable, str(WORKER), "slow"],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=worker_env(HERE),
        )
        lines: list[str] = []
        assert process.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
        reader.start()
        drawn = moved = None
        began = time.monotonic()
        while moved is None and time.monotonic() - began < 180 and process.poll() is None:
            time.sleep(0.02)
            for line in list(lines):
                stamp, _, text = line[1:].strip().partition(" ")
                if line.startswith("@") and "/120" in text:
                    if "0/120" in text and drawn is None:
                        drawn = float(stamp)
                    elif drawn is not None and "0/120" not in text:
                        moved = float(stamp)
                        break
        assert drawn is not None and moved is not None, "".join(lines)[-2000:]
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        second = time.monotonic()
        process.wait(timeout=60)
        reader.join(timeout=10)  # the pipe ends with the process
        process.stderr.close()
        raised = [line for line in lines if " raised " in line]
        assert raised, "".join(lines)[-2000:]
        stamp, _, text = raised[-1][1:].strip().partition(" ")
        steps = int(text.split()[2])
        assert text.startswith("raised TrainingInterrupted") and steps >= 1
        step_time = (float(stamp) - drawn) / steps  # an upper bound: it includes waits
        assert moved - drawn < 1.0 + step_time
        assert float(stamp) - second < step_time + 1.5
        assert process.returncode == 0
