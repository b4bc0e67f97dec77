"""Runs that end early, for test_early_ends.py, each in a process of its own.

Usage: python early_end_worker.py (raising-loader | slow) [progress]

- `raising-loader`: a generator that raises after 25 batches. Prints "raised <type>
  after <epochs> epochs, <steps> steps" and exits 0 when `fit` raises the loader's error
  with the training so far.
- `slow`: an MLP 512-2048x4-512 at batch 256, a real model whose steps take about a
  second here (no host callback), trained with the bar. Every write to stderr is stamped
  `@<time.monotonic()>`; it prints "@<time> raised <type> <steps> steps" when `fit` raises.
"""

import sys
import time

import jax
import numpy as np
import optax

import eqfit


def raising_loader(progress: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x.sum(axis=1)

    def batches():
        for i in range(25):
            yield x[(i % 4) * 16 : (i % 4 + 1) * 16], y[(i % 4) * 16 : (i % 4 + 1) * 16]
        raise RuntimeError("the loader broke")

    model = eqfit.models.LinearRegression(4, key=jax.random.key(0))
    try:
        eqfit.fit(
            model,
            batches(),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.01),
            key=jax.random.key(1),
            epochs=10,
            steps_per_epoch=4,
            progress=progress,
        )
    except RuntimeError as e:
        history = e.result.history  # type: ignore[attr-defined]
        steps = int((history.batch_sizes > 0).sum())
        print(f"raised {type(e).__name__} after {history.epochs} epochs, {steps} steps")


class Stamped:
    """stderr, each write preceded by the time it was made."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if text:
            self.stream.write(f"\n@{time.monotonic():.3f} {text!r}\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def slow() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 * 40, 512)).astype(np.float32)
    y = rng.normal(size=(256 * 40, 512)).astype(np.float32)
    model = eqfit.models.MLP(512, 512, 2048, 4, key=jax.random.key(0))
    stderr = sys.stderr
    sys.stderr = Stamped(stderr)
    try:
        eqfit.fit(
            model,
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-3),
            key=jax.random.key(1),
            epochs=3,
            batch_size=256,
            progress=True,
        )
    except KeyboardInterrupt as e:
        result = getattr(e, "result", None)
        steps = -1 if result is None else int((result.history.batch_sizes > 0).sum())
        print(f"@{time.monotonic():.3f} raised {type(e).__name__} {steps} steps", file=stderr)


if __name__ == "__main__":
    if sys.argv[1] == "raising-loader":
        raising_loader(progress="progress" in sys.argv[2:])
    else:
        slow()
