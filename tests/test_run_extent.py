"""A run's extent (its `epochs`, its `initial_epoch`) is not a constant of its programs:
they are compiled for the record's rows, the run's epochs rounded up to a power of two (8
at least), and read where the run begins from the training state. A `fit` that changes
only the extent compiles nothing, and trains as a run whose programs were compiled for
another record. Compiles counted by JAX's compile events, in any thread.
"""

import pathlib
import shutil

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, programs_compiled, Recorder

import eqfit


N, BATCH = 40, 8  # 5 steps an epoch
OPTIMIZER = optax.adam(1e-2)  # one object for the module: fits share their programs


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + np.sin(x[:, 0])).astype(np.float32)
    return x, y


def mse_aux(model, x, y):
    error = jax.vmap(model)(x) - y
    return (error**2).mean(), {"abs": abs(error).mean()}


def mlp(key=jax.random.key(0)):
    return eqfit.models.MLP(3, "scalar", 8, 1, key=key)


# A run that validates after every third step: `plan`'s and the earlier checkpoint's.
VALIDATED = dict(
    loss=eqfit.losses.mse,
    optimizer=OPTIMIZER,
    key=jax.random.key(1),
    batch_size=BATCH,
    validation_data=arrays(1),
    validation_every=3,
)


class Batches:
    """A loader with a length, in order."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __iter__(self):
        for i in range(0, len(self.x), BATCH):
            yield self.x[i : i + BATCH], self.y[i : i + BATCH]


CASES = {
    "loss": {},
    "aux value and metric": {"loss": mse_aux, "metrics": {"mae": eqfit.metrics.mae}},
    "log_every": {"log_every": 3},
    "validation at epochs' ends": {"validation_data": arrays(1), "validation_freq": 2},
    "validation_every": {"validation_data": arrays(1), "validation_every": 3},
    "per step": {"execution": eqfit.PerStep()},
    "ensemble": {"ensemble": True, "validation_data": arrays(1), "validation_every": 4},
    "bar": {"progress": True, "log_every": 2},
    "loader": {"loader": True},
}


def fit(case, **extent):
    kwargs = dict(CASES[case])
    recorder = Recorder()
    model = mlp()
    if kwargs.get("ensemble"):
        model = eqx.filter_vmap(mlp)(jax.random.split(jax.random.key(0), 3))
    data = arrays()
    if kwargs.pop("loader", False):
        data = Batches(*data)
    else:
        kwargs["batch_size"] = BATCH
    kwargs.setdefault("loss", eqfit.losses.mse)
    result = eqfit.fit(
        model,
        data,
        optimizer=OPTIMIZER,
        key=jax.random.key(1),
        callbacks=[recorder],
        **kwargs,
        **extent,
    )
    return result, recorder


@pytest.mark.parametrize("case", list(CASES))
def test_another_extent_compiles_nothing_and_trains_as_its_own(case):
    fit(case, epochs=2)  # compiles the configuration's programs: a record of 8 rows
    with programs_compiled() as names:
        fit(case, epochs=5)
        result, told = fit(case, epochs=7, initial_epoch=4)  # epochs 5 to 7
    assert names == []
    # The same run asked for more epochs: compiled for a record of 16 rows (and it is
    # another program), the epochs it shares trained alike.
    with programs_compiled() as names:
        longer, told_longer = fit(case, epochs=14, initial_epoch=4)
    assert names
    history, whole = result.history, longer.history
    assert history.initial_epoch == whole.initial_epoch == 4
    assert history.loss.shape[0] == 3
    np.testing.assert_array_equal(history.loss, whole.loss[:3])
    np.testing.assert_array_equal(history.step_loss, whole.step_loss[:3])
    np.testing.assert_array_equal(history.batch_sizes, whole.batch_sizes[:3])
    for name, values in history.values.items():
        np.testing.assert_array_equal(values, whole.values[name][:3], err_msg=name)
    for name, values in history.step_values.items():
        np.testing.assert_array_equal(values, whole.step_values[name][:3], err_msg=name)
    last = 7 * N // BATCH  # the shorter run's last step
    made = len(history.validation_steps)
    assert made == np.sum(whole.validation_steps <= last)
    assert made > 0 or "validation_every" not in CASES[case]
    np.testing.assert_array_equal(history.validation_steps, whole.validation_steps[:made])
    for name, values in history.validations.items():
        np.testing.assert_array_equal(values, whole.validations[name][:made], err_msg=name)
    # The callbacks told of the same steps, validations and epochs, with the same values.
    shared = [t for t in values_told(told_longer) if t[1] <= (7 if t[0] == "epoch" else last)]
    np.testing.assert_equal(values_told(told), shared)  # NaN equal to NaN
    assert len(shared) >= 3


def values_told(recorder):
    """What a `Recorder` was told, the figures of speed left out."""

    def trained(name):
        return not (name.endswith(("_second", "_seconds")) or name == "mfu")

    return [(*t[:2], {k: v for k, v in t[2].items() if trained(k)}) for t in recorder.told]


def test_a_plan_of_another_extent_counts_its_own_steps():
    """`eqfit.plan` of a run of other epochs compiles nothing (its programs are the first
    run's) and counts that run's steps, validations and FLOPs, not the first's.
    """
    model = mlp()
    first = eqfit.plan(model, arrays(), epochs=2, **VALIDATED)
    assert (first.steps, first.validations) == (10, 3)
    with programs_compiled() as names:
        plan = eqfit.plan(model, arrays(), epochs=7, initial_epoch=4, **VALIDATED)
    assert names == []
    # Steps 21 to 35; validations after steps 21, 24, ..., 33.
    assert (plan.steps, plan.validations) == (15, 5)
    assert plan.flops == plan.flops_per_step * 15 + plan.validation_flops * 5
    assert plan.memory == first.memory  # the same programs


# A checkpoint of 3 epochs written by eqfit before the training state held the run's first
# step (`92d75b0`, 2026-12-07): its record's rows the run's own (3, and 5 validations).
BEFORE_FIRST = pathlib.Path(__file__).parent / "checkpoints" / "before_first"


@pytest.mark.parametrize("epochs", [3, 5])
def test_a_checkpoint_of_the_earlier_state_is_continued(tmp_path, epochs):
    """A checkpoint of the state's earlier layout is continued, by the same run (nothing
    more to train) or one of more epochs, as the run trained whole.
    """
    shutil.copytree(BEFORE_FIRST, tmp_path / "run")
    model, kwargs = mlp(), dict(VALIDATED, epochs=epochs)
    policy = eqfit.Checkpoint(tmp_path / "run", keep=1)
    resumed = eqfit.fit(model, arrays(), checkpoint=policy, **kwargs)
    whole = eqfit.fit(model, arrays(), **kwargs)
    # The checkpoint was written by another process, whose XLA options are not the
    # suite's (`conftest.py`): the same run, to float rounding.
    assert_trees_close(resumed.model, whole.model, rtol=1e-5, atol=1e-6)
    assert_trees_close(resumed.opt_state, whole.opt_state, rtol=1e-5, atol=1e-6)
    history, expected = resumed.history, whole.history
    assert history.loss.shape == (epochs,) and history.step_loss.shape == (epochs, 5)
    np.testing.assert_allclose(history.loss, expected.loss, rtol=1e-5)
    np.testing.assert_allclose(history.step_loss, expected.step_loss, rtol=1e-5)
    np.testing.assert_array_equal(history.batch_sizes, expected.batch_sizes)
    np.testing.assert_array_equal(history.validation_steps, expected.validation_steps)
    val = history.validations["val_loss"]
    np.testing.assert_allclose(val, expected.validations["val_loss"], rtol=1e-5)
