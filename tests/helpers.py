import contextlib
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqfit


def regression_data(key, n=200, features=4):
    """`x` and `y = x . (1, 2, ...) + noise`, drawn by numpy from `key`'s bits: JAX's random
    functions would compile a program for every new shape, and the suite would pay for it.
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = x @ np.arange(1.0, features + 1.0, dtype=np.float32)
    y += 0.1 * rng.normal(size=n).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def normal(key, shape):
    """Standard normal float32s of `shape`, drawn by numpy from `key`'s bits: for inputs of
    many shapes, where `jax.random.normal` would compile a program for each.
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    return jnp.asarray(rng.normal(size=shape).astype(np.float32))


def assert_trees_equal(a, b):
    """Bitwise equality of every array leaf, and equal structure."""
    la, ta = jax.tree.flatten(eqx.filter(a, eqx.is_array))
    lb, tb = jax.tree.flatten(eqx.filter(b, eqx.is_array))
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-5):
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def worker_env(*paths):
    """The environment for a worker process: this one's, with `paths` first on
    `PYTHONPATH`. `XLA_FLAGS` is kept: it holds the suite's optimisation level
    (`conftest.py`), so a worker compiles as the test does and their results compare
    bitwise.
    """
    python_path = os.pathsep.join([*map(str, paths), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": python_path}


# Programs compiled, counted by JAX's compile events.

_COMPILED = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def programs_compiled():
    """The names of the programs JAX compiles meanwhile, in any thread (`"jit(run)"`,
    say). A program loaded from JAX's persistent cache (the suite keeps programs on disk
    too) is named as well: JAX times its load as a compile.
    """
    names = []

    def duration(event, duration_secs, **kwargs):
        if event == _COMPILED:
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(duration)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(duration)


def programs_made(call):
    """How many programs JAX compiled (or loaded from its persistent cache) for `call()`."""
    with programs_compiled() as names:
        jax.block_until_ready(call())
    return len(names)


class Recorder:
    """A callback that keeps what it is told, in order: `("step", n, logs)` of
    `log_every`, `("validation", n, logs)` of `validation_every`, `("epoch", n, logs)`.
    """

    stops_training = False

    def __init__(self):
        self.told = []

    def on_train_batch_end(self, step, logs):
        self.told.append(("step", step, logs))

    def on_validation_end(self, step, logs):
        self.told.append(("validation", step, logs))

    def on_epoch_end(self, epoch, logs):
        self.told.append(("epoch", epoch, logs))

    def steps(self):
        """The n-th steps' training values, `(step, logs)`."""
        return [(step, logs) for kind, step, logs in self.told if kind == "step"]


class Pair(eqx.Module):
    """Two linear layers as one model: the several-updates tests' (one update trains `a`,
    another `b`).
    """

    a: eqx.nn.Linear
    b: eqx.nn.Linear


def pair(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return Pair(eqx.nn.Linear(3, 1, key=k1), eqx.nn.Linear(3, 1, key=k2))


# The several-updates tests' data: 48 rows of 3 features, a linear target.
PAIR_X = np.random.default_rng(0).normal(size=(48, 3)).astype(np.float32)
PAIR_Y = PAIR_X.sum(1, keepdims=True) + 0.5


def fit_stopped_after_two_epochs(model, **kwargs):
    """`fit` of `model` (2 features in, a scalar out) on 32 rows, 10 epochs of 3 steps,
    that early stopping ends after its second epoch (step 6 of 30); `kwargs` add to it.
    """
    x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    return eqfit.fit(
        model,
        (x, x.sum(axis=1)),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.01),
        key=jax.random.key(1),
        epochs=10,
        batch_size=8,
        validation_split=0.25,
        # Never better by this much: stopped after the second epoch.
        early_stopping=eqfit.EarlyStopping(patience=1, min_delta=1e9),
        **kwargs,
    )
