"""Throughput as it happened: each call timed as the device finishes it, and an epoch long
enough to be worth a call of its own timed by itself.
"""

import time

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import regression_data

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
