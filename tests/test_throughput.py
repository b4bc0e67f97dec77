"""Throughput as it happened: each call timed as the device finishes it, and an epoch long
enough to be worth a call of its own timed by itself.
"""

import threading
import time
import warnings

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import regression_data
from jax.sharding import AxisType, PartitionSpec as P

import eqfit


ADAM = optax.adam(1e-3)  # one object for the module: fits share their compiled programs


@pytest.mark.heavy
def test_a_validated_epoch_is_timed_by_itself(getkey):
    """Every other epoch validates a set far larger than its training: those epochs take
    longer, each by its own time. (Calls that hold several epochs, their seconds shared
    evenly among their steps, would read every epoch alike.) A training epoch lasts
    many of Python's thread switch intervals: a waiting thread woken that late, on a
    busy machine, finds the next call done too, and times the two as one.
    """
    x, y = regression_data(getkey(), n=4096, features=16)
    val = regression_data(getkey(), n=2**18, features=16)
    model = eqfit.models.MLP(16, "scalar", 256, 2, key=getkey())
    arguments = dict(
        validation_data=val,
        validation_freq=2,
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=8,
        batch_size=32,
    )
    eqfit.fit(model, (x, y), **arguments)  # compiled, and its speed measured
    seconds = eqfit.fit(model, (x, y), **arguments).history.throughput["epoch_seconds"]
    assert (seconds > 0).all()
    trained_only, validated = seconds[2::2], seconds[1::2]  # epochs 3, 5, ... and 2, 4, ...
    assert np.median(validated) > 3 * np.median(trained_only)


@pytest.mark.heavy
def test_epoch_seconds_add_up_to_the_training_and_mfu_stays_below_one(getkey):
    x, y = regression_data(getkey(), n=1024, features=32)
    model = eqfit.models.MLP(32, "scalar", 256, 2, key=getkey())
    arguments = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=12,
        batch_size=64,
        peak_flops=1e15,  # above any CPU's: the MFU is known, and small
    )
    eqfit.fit(model, (x, y), **arguments)  # compiled, and its speed measured: one call next
    start = time.perf_counter()
    history = eqfit.fit(model, (x, y), **arguments).history
    wall = time.perf_counter() - start
    seconds = history.throughput["epoch_seconds"]
    assert (seconds > 0).all()
    assert 0.5 * wall < seconds.sum() <= wall
    mfu = history.throughput["mfu"]
    assert ((0 < mfu) & (mfu < 1)).all()


@pytest.mark.slow
def test_an_ensemble_is_timed_by_its_calls(getkey):
    """No clock inside a vmapped program: each call's seconds are shared among its
    steps, as the history's documentation says.
    """
    x, y = regression_data(getkey(), n=64)
    models = eqx.filter_vmap(lambda k: eqfit.models.MLP(4, "scalar", 8, 1, key=k))(
        jax.random.split(getkey(), 2)
    )
    history = eqfit.fit(
        models,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=16,
        ensemble=True,
    ).history
    seconds = history.throughput["epoch_seconds"]
    assert seconds.shape == (3,) and (seconds > 0).all()
    assert seconds.sum() <= history.wall_time


def first_fit(getkey, loss, callbacks=()):
    """A first fit of its own configuration (its own optimizer object) with a known peak:
    it counts its step's FLOPs.
    """
    x, y = regression_data(getkey(), n=160, features=8)
    model = eqfit.models.MLP(8, "scalar", 16, 1, key=getkey())
    arguments = dict(
        loss=loss,
        optimizer=optax.adam(1e-3),
        key=getkey(),
        epochs=2,
        batch_size=32,
        microbatches=2,  # the run traces the loss on 16 rows, the count on the whole 32
        peak_flops=1e12,
    )
    result = eqfit.fit(model, (x, y), callbacks=list(callbacks), **arguments)
    return result, (model, (x, y), arguments)


def test_a_first_fit_counts_its_flops_once_its_run_is_traced(getkey):
    """The step's FLOPs are counted by tracing it once more, after the run's program is
    traced (while XLA compiles it), not before the run begins.
    """
    traced = []  # the rows of each trace of the loss, and the run's beginning

    def loss(model, x, y):
        traced.append(x.shape[0])  # runs only while JAX traces
        return eqfit.losses.mse(model, x, y)

    class Begins:
        stops_training = False

        def on_train_begin(self, config):
            traced.append("begin")

        def on_epoch_end(self, epoch, logs):
            pass

    result, _ = first_fit(getkey, loss, [Begins()])
    begin = traced.index("begin")
    runs = [i for i, rows in enumerate(traced) if rows == 16]
    counts = [i for i, rows in enumerate(traced) if rows == 32 and i > begin]
    assert runs and min(runs) > begin
    assert len(counts) == 1 and counts[0] > max(runs)
    assert (result.history.throughput["mfu"] > 0).all()


def test_a_first_fits_flops_are_those_of_the_plan(getkey):
    result, (model, data, arguments) = first_fit(getkey, eqfit.losses.mse)
    eqfit.clear_cache()  # the plan counts the step anew
    plan = eqfit.plan(model, data, **arguments)
    history = result.history
    figures = history.throughput
    samples = history.batch_sizes.sum(axis=1)
    flops = plan.flops_per_step * samples / 32
    np.testing.assert_allclose(figures["flops_per_second"] * figures["epoch_seconds"], flops)
    np.testing.assert_allclose(figures["mfu"], figures["flops_per_second"] / 1e12)


def test_a_count_that_fails_in_its_thread_is_made_again_in_the_callers(getkey):
    # The count traces the step in a thread of its own, where this loss refuses to be
    # traced (as JAX's context, `jax.set_mesh` say, is the thread's own): it is made again
    # in the training thread, and the figures are there.
    def loss(model, x, y):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("traced off the main thread")
        return eqfit.losses.mse(model, x, y)

    result, (model, data, arguments) = first_fit(getkey, loss)
    planned = eqfit.plan(model, data, **arguments)
    throughput = result.history.throughput
    seconds = np.asarray(throughput["epoch_seconds"])
    steps = seconds * np.asarray(throughput["steps_per_second"])
    np.testing.assert_allclose(
        np.asarray(throughput["flops_per_second"]) * seconds, steps * planned.flops_per_step
    )


class Begun:
    """A callback that marks the run's beginning (after the trace that finds the loss's
    outputs, before the run's trace and the count's).
    """

    stops_training = False

    def __init__(self) -> None:
        self.begun = False

    def on_train_begin(self, config):
        self.begun = True

    def on_epoch_end(self, epoch, logs):
        pass


def refusing_the_count(begun, nan=False):
    """A loss that refuses the whole batch once the run has begun: the count traces it so
    (the run's microbatches are half of it), in its thread and again in the training
    thread.
    """

    def loss(model, x, y):
        if begun.begun and x.shape[0] == 32:
            raise RuntimeError("the whole batch at once")
        value = eqfit.losses.mse(model, x, y)
        return value * jax.numpy.nan if nan else value

    return loss


def test_a_count_of_the_flops_that_fails_is_a_warning(getkey):
    # The run trains on, without the figures the count gives.
    begun = Begun()
    match = "could not count the FLOPs of a step.*RuntimeError: the whole batch at once"
    with pytest.warns(RuntimeWarning, match=match):
        result, _ = first_fit(getkey, refusing_the_count(begun), [begun])
    history = result.history
    assert set(history.throughput) == {"epoch_seconds", "steps_per_second", "samples_per_second"}
    assert history.epochs == 2 and np.isfinite(history.loss).all()


def test_a_failed_count_leaves_the_fits_own_error_to_raise(getkey):
    # Where the fit raises (a loss not finite at its first step), the count's failure is
    # not told: a warning then, an error under `-W error`, would hide the fit's.
    begun = Begun()
    with pytest.raises(eqfit.NonFiniteLossError):
        first_fit(getkey, refusing_the_count(begun, nan=True), [begun])


def test_a_first_fit_under_a_mesh_counts_its_flops(getkey):
    # A loss that constrains its arrays' sharding traces only inside a mesh: the count,
    # in its own thread, traces under the caller's.
    def loss(model, x, y):
        predicted = jax.lax.with_sharding_constraint(jax.vmap(model)(x), P())
        return jax.numpy.mean((predicted - y) ** 2)

    with jax.set_mesh(jax.make_mesh((1,), ("b",), axis_types=(AxisType.Auto,))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            result, (model, data, arguments) = first_fit(getkey, loss)
        eqfit.clear_cache()
        planned = eqfit.plan(model, data, **arguments)  # counted in a thread of its own too
    assert np.all(np.asarray(result.history.throughput["flops_per_second"]) > 0)
    assert planned.flops_per_step > 0
