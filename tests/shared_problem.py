"""The training problem shared by the two-process test and its single-process reference."""

import jax
import numpy as np
import optax

import eqfit


def problem():
    key = jax.random.key(42)
    kx, km, kf = jax.random.split(key, 3)
    # 2 processes x 2 devices; 64 rows per process; batch 16 splits over 4 devices.
    x = np.asarray(jax.random.normal(kx, (128, 4)))
    y = x @ np.arange(1.0, 5.0, dtype=np.float32) + np.sin(x[:, 0])
    model = eqfit.models.MLP(4, "scalar", 16, 2, key=km)
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-2),
        key=kf,
        epochs=3,
        batch_size=16,
    )
    return model, (x, y), kwargs


def checkpoint_problem(epochs=200):
    """A run long enough to be interrupted: 4096 samples in batches of 16, many epochs."""
    key = jax.random.key(7)
    kx, km, kf = jax.random.split(key, 3)
    x = np.asarray(jax.random.normal(kx, (4096, 4)))
    y = x @ np.arange(1.0, 5.0, dtype=np.float32) + np.sin(x[:, 0])
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=km)
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=kf,
        epochs=epochs,
        batch_size=16,
        validation_data=(x[:100], y[:100]),
    )
    return model, (x, y), kwargs
