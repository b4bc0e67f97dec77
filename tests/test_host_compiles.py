"""A fit compiles its run's programs and no program of its own beside them: the host's
code takes the data's rows (a checkpoint's fingerprint of them, those held out for
validation), moves arrays to the devices, copies the models the callbacks see and reads
a checkpoint back without JAX operations on arrays, each of which JAX would compile as a
program of its own (on an accelerator, one more program on the chip). Counted by JAX's
compile events, in any thread.
"""

import jax
import numpy as np
import optax
from helpers import assert_trees_equal, programs_compiled
from test_observers import Sees

import eqfit


# The run's own programs: its steps, and its starting state where that is compiled.
RUN = ("jit(run)", "jit(start)")


def data(rows, on_device):
    """`rows` rows of 5 features and a linear target, as numpy arrays or on the device.
    Each test has rows of its own, so that no program JAX compiled for another test's
    arrays stands in for one of its own.
    """
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    y = x @ np.arange(1.0, 6.0, dtype=np.float32)
    return (jax.device_put(x), jax.device_put(y)) if on_device else (x, y)


def others(names):
    """The programs compiled that are not the run's own."""
    return [name for name in names if name not in RUN]


def settings(rows, **more):
    model = eqfit.models.MLP(5, "scalar", 8, 1, key=jax.random.key(rows))
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adamw(3e-4),
        key=jax.random.key(2),
        batch_size=8,
        shuffle=False,
        epochs=3,
    )
    return model, kwargs | more


def test_a_checkpointed_fit_of_device_arrays_compiles_its_run_alone(tmp_path):
    # Rows held out for validation, a callback shown the model, a checkpoint each epoch
    # (its data's fingerprint): each once made a program of its own.
    model, kwargs = settings(37, validation_split=0.25, checkpoint_every=1)
    train = data(37, on_device=True)
    seen = Sees(stops_training=False)
    with programs_compiled() as first:
        result = eqfit.fit(model, train, callbacks=[seen], checkpoint=tmp_path / "a", **kwargs)
    assert "jit(run)" in first and others(first) == []
    # The model each epoch ended with, copied from the state before the next call took it.
    assert sorted(seen.models) == [1, 2, 3]
    assert_trees_equal(seen.models[3][0], result.model)
    assert np.isfinite(result.history["val_loss"]).all()
    # The same run again, checkpointed elsewhere: its programs were all compiled.
    with programs_compiled() as again:
        twice = eqfit.fit(
            model,
            train,
            callbacks=[Sees(stops_training=False)],
            checkpoint=tmp_path / "b",
            **kwargs,
        )
    assert again == []
    assert_trees_equal(twice.model, result.model)


def test_a_checkpointed_fit_of_numpy_arrays_and_its_resume_compile_its_run_alone(tmp_path):
    # The training and validation arrays moved to the device, and a checkpoint read back.
    model, kwargs = settings(43, validation_data=data(11, on_device=False))
    train = data(43, on_device=False)
    with programs_compiled() as first:
        result = eqfit.fit(model, train, checkpoint=tmp_path, **kwargs)
    assert "jit(run)" in first and others(first) == []
    # Resumed from its last checkpoint, at its end: read back, nothing left to train.
    with programs_compiled() as resumed:
        again = eqfit.fit(model, train, checkpoint=tmp_path, **kwargs)
    assert resumed == []
    assert_trees_equal(again.model, result.model)
    np.testing.assert_array_equal(again.history.loss, result.history.loss)
