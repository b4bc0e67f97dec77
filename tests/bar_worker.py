"""Runs with `progress`, for test_bar.py, in a process of its own.

Usage: python bar_worker.py FD[:PROGRESS] [FD[:PROGRESS] ...]

Trains a small MLP once for each FD (a pseudo-terminal's slave, whose window size the
test set, a file or a pipe), with that FD as the process's stdout and stderr, as
`python train.py > run.log 2>&1` has them: validation data, two metrics, an aux value and
`norms=True`, so that an epoch has many values to show; `progress=PROGRESS` (`bar` or
`lines`; `True` where not given). Later runs compile nothing new. Prints, as one JSON
object on the stdout it was given, each run's values by name (`history.values`).
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqfit


def loss_with_aux(model, x, y):
    """The mean squared error, and the largest error beside it (an aux value)."""
    err = jax.vmap(model)(x) - y
    return jnp.mean(err**2), {"max_err": jnp.max(jnp.abs(err))}


def bias(model, x, y):
    """A second metric: the mean error."""
    return jnp.mean(jax.vmap(model)(x) - y)


def main(runs: list[tuple[int, bool | str]]) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    y = x @ np.arange(1.0, 5.0, dtype=np.float32)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=jax.random.key(0))
    optimizer = optax.adam(1e-2)
    shown = []
    out = os.fdopen(os.dup(1), "w")
    for fd, progress in runs:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)  # stderr is the terminal: tqdm reads its width there
        result = eqfit.fit(
            model,
            (x[:64], y[:64]),
            loss=loss_with_aux,
            optimizer=optimizer,
            key=jax.random.key(1),
            epochs=3,
            batch_size=16,
            validation_data=(x[64:], y[64:]),
            metrics={"mae": eqfit.metrics.mae, "bias": bias},
            norms=True,
            progress=progress,  # type: ignore[arg-type]
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(fd)  # a pipe ends when its last writer closes it
        shown.append({k: v.tolist() for k, v in result.history.values.items()})
    print(json.dumps(shown), file=out)


if __name__ == "__main__":
    cache = os.environ.get("EQFIT_TESTS_COMPILATION_CACHE")
    if cache:  # the suite's: the programs the tests compiled
        eqfit.enable_compilation_cache(cache)
    runs = [(arg + ":").split(":")[:2] for arg in sys.argv[1:]]
    main([(int(fd), progress or True) for fd, progress in runs])
