"""Every bad input is refused, or taken, with a word: deleted arrays, a moving average too
slow for its run, reserved and odd aux values, numbers of every kind, the loggers' runs
and a dead tracking server (issue 32, items 5 and 6).
"""

import re
import socket
import threading
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal

import eqfit


SGD = optax.sgd(0.1)  # one object for the module: fits share their compiled programs


@pytest.fixture
def setup(getkey):
    model = eqfit.models.LinearRegression(3, key=getkey())
    x, y = jnp.ones((8, 3)), jnp.ones(8)
    kwargs = dict(loss=eqfit.losses.mse, optimizer=SGD, key=getkey(), batch_size=4)
    return model, x, y, kwargs


def deleted(x):
    """A copy of `x` whose buffer a donating `jit` gave away, as one elsewhere would."""
    copy = jnp.copy(x)
    jax.jit(lambda a: a + 1, donate_argnums=0)(copy)
    assert copy.is_deleted()
    return copy


def with_deleted_bias(model):
    return eqx.tree_at(lambda m: m.bias, model, deleted(model.bias))


# Deleted arrays.


def test_a_deleted_array_is_named_by_its_argument_and_path(setup):
    model, x, y, kwargs = setup
    gone = with_deleted_bias(model)
    message = r"`model\.bias` \(float32\[1\]\) is a deleted array: a `jax\.jit` call that donates"
    with pytest.raises(ValueError, match=message):
        eqfit.fit(gone, (x, y), **kwargs)
    with pytest.raises(ValueError, match=message):
        eqfit.plan(gone, (x, y), **kwargs)
    with pytest.raises(ValueError, match=message):
        eqfit.evaluate(gone, (x, y), loss=eqfit.losses.mse)
    with pytest.raises(ValueError, match=message):
        eqfit.predict(gone, x)
    # The data, the validation data (one set or named ones), the optimizer state.
    with pytest.raises(ValueError, match=r"`data\[1\]` \(float32\[8\]\) is a deleted array"):
        eqfit.fit(model, (x, deleted(y)), **kwargs)
    with pytest.raises(ValueError, match=r"`data\[0\]` \(float32\[8, 3\]\) is a deleted"):
        eqfit.evaluate(model, (deleted(x), y), loss=eqfit.losses.mse)
    with pytest.raises(ValueError, match=r"`x` \(float32\[8, 3\]\) is a deleted array"):
        eqfit.predict(model, deleted(x))
    with pytest.raises(ValueError, match=r"`validation_data\[0\]` .* is a deleted array"):
        eqfit.fit(model, (x, y), validation_data=(deleted(x), y), **kwargs)
    sets = eqfit.ValidationSets(a=(x, y), b=(x, deleted(y)))
    with pytest.raises(ValueError, match=r"`validation_data\['b'\]\[1\]` .* is a deleted"):
        eqfit.fit(model, (x, y), validation_data=sets, **kwargs)
    adam = optax.adam(1e-3)
    state = adam.init(eqx.filter(model, eqx.is_inexact_array))
    state = jax.tree.map(lambda a: deleted(a) if eqx.is_array(a) and a.ndim == 1 else a, state)
    with pytest.raises(ValueError, match=r"`opt_state\[0\]\.mu\.bias` \(float32\[1\]\)"):
        eqfit.fit(model, (x, y), **(kwargs | dict(optimizer=adam)), opt_state=state)


def test_a_deleted_model_state_is_named(getkey):
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    state = jax.tree.map(deleted, state)
    with pytest.raises(ValueError, match=r"`state\[.*\]` \(int32\[\]\) is a deleted array"):
        eqfit.predict(model, jnp.ones((4, 3)), state=state)


# The moving average.


@pytest.mark.slow
def test_an_average_that_keeps_most_of_the_initial_weights_is_warned_of(setup):
    model, x, y, kwargs = setup
    # 4 epochs of 2 steps: 0.999**8 of the average is the initial weights.
    with pytest.warns(UserWarning) as caught:
        eqfit.fit(model, (x, y), epochs=4, ema=0.999, **kwargs)
    (warning,) = caught
    message = str(warning.message)
    assert "`ema=0.999` over this run's 8 steps leaves 99.2% of the moving average" in message
    assert "0.999**8 = 0.992" in message and "693 or more" in message
    assert warning.filename == __file__  # it points at the call of `fit`
    # Taking the advice: no warning (warnings are errors in the suite).
    suggested = float(re.search(r"`ema=([\d.]+)` leaves 1%", message).group(1))
    eqfit.fit(model, (x, y), epochs=4, ema=suggested, **kwargs)
    # Less than half left (0.7**2) is not warned of; `plan` warns as `fit` does.
    eqfit.fit(model, (x, y), epochs=1, ema=0.7, **kwargs)
    with pytest.warns(UserWarning, match=r"`ema=0.9` over this run's 2 steps"):
        eqfit.plan(model, (x, y), ema=0.9, **kwargs)


# Numbers of every kind.


@pytest.mark.slow
@pytest.mark.parametrize(
    "given, plain",
    [
        (dict(ema=np.float32(0.5)), dict(ema=float(np.float32(0.5)))),
        (dict(ema=jnp.asarray(0.25)), dict(ema=0.25)),
        (dict(norms=np.bool_(True)), dict(norms=True)),
        (dict(peak_flops=10**15), dict(peak_flops=1e15)),
        (dict(peak_flops=np.float32(1e15)), dict(peak_flops=float(np.float32(1e15)))),
        (dict(peak_flops=jnp.asarray(1e15)), dict(peak_flops=float(jnp.asarray(1e15)))),
    ],
)
def test_numpy_and_jax_scalars_are_taken_as_python_numbers(setup, given, plain):
    model, x, y, kwargs = setup
    got = eqfit.fit(model, (x, y), **given, **kwargs)
    want = eqfit.fit(model, (x, y), **plain, **kwargs)
    assert_trees_equal((got.model, got.ema_model), (want.model, want.ema_model))
    assert set(got.history.values) == set(want.history.values)


@pytest.mark.parametrize(
    "peak, error, match",
    [
        (float("inf"), ValueError, r"a finite number above 0 .*got inf"),
        (float("nan"), ValueError, r"a finite number above 0 .*got nan"),
        (0, ValueError, r"a finite number above 0 .*got 0"),
        (-1e12, ValueError, r"a finite number above 0"),
        (True, TypeError, r"`peak_flops` must be one device's peak FLOP/s, a number"),
        # A unit slip: TFLOP/s for FLOP/s.
        (989.0, ValueError, r"in FLOP/s, not TFLOP/s.*For 989 TFLOP/s give `peak_flops=989e12`"),
        (1.0, ValueError, r"no device computes below 1e\+09 FLOP/s"),
    ],
)
def test_implausible_peak_flops_are_refused(setup, peak, error, match):
    model, x, y, kwargs = setup
    with pytest.raises(error, match=match):
        eqfit.fit(model, (x, y), peak_flops=peak, **kwargs)


def test_bad_precisions_are_refused():
    for scale in (float("inf"), float("nan"), 0.0, -1.0, 1e39):
        with pytest.raises(ValueError, match=r"`Precision.initial_scale` must be a finite"):
            eqfit.Precision(jnp.float16, initial_scale=scale)
    # (Under the suite's runtime checks, beartype refuses it first, naming it too.)
    with pytest.raises(TypeError, match=r"initial_scale"):
        eqfit.Precision(jnp.float16, initial_scale="big")
    # None is float64 to NumPy, which JAX would truncate to float32 with a warning.
    with pytest.raises(TypeError, match=r"`Precision.compute` must be a floating dtype .*got None"):
        eqfit.Precision(compute=None)
    with pytest.raises(TypeError, match=r"`Precision.params` must be a floating dtype .*got None"):
        eqfit.Precision(params=None)


# Aux values.


def with_aux(name, value=lambda loss: loss):
    def loss(model, x, y):
        value_ = eqfit.losses.mse(model, x, y)
        return value_, {name: value(value_)}

    return loss


RESERVED = [
    "loss",
    "grad_norm",
    "skipped_steps",
    "epoch",
    "epoch_seconds",
    "steps_per_second",
    "samples_per_second",
    "flops_per_second",
    "mfu",
    "checkpoint_blocked_seconds",
    "val_loss",
]


@pytest.mark.parametrize("name", RESERVED)
def test_reserved_names_are_refused_for_aux_values_metrics_and_schedules(setup, name):
    model, x, y, kwargs = setup
    reserved = (
        r"Reserved: 'loss', .*'epoch', .*'mfu', 'checkpoint_blocked_seconds' and every name "
        r"beginning 'val_'"
    )
    kwargs = kwargs | dict(loss=with_aux(name))
    with pytest.raises(ValueError, match=rf"aux value '{name}', a name the run gives to .*"):
        eqfit.fit(model, (x, y), **kwargs)
    with pytest.raises(ValueError, match=reserved):
        eqfit.fit(model, (x, y), **kwargs)
    kwargs["loss"] = eqfit.losses.mse
    with pytest.raises(ValueError, match=rf"`metrics` has a metric '{name}'.*{reserved}"):
        eqfit.fit(model, (x, y), metrics={name: eqfit.metrics.mae}, **kwargs)
    schedules = {name: optax.constant_schedule(0.1)}
    with pytest.raises(ValueError, match=rf"`schedules` has a schedule '{name}'.*{reserved}"):
        eqfit.fit(model, (x, y), schedules=schedules, **kwargs)


def test_every_name_the_logs_hold_is_reserved():
    from eqfit._host._observers import Throughput
    from eqfit._step._record import BUILT_IN, RESERVED

    assert {*BUILT_IN, *Throughput.NAMES, *Throughput.CHECKPOINTS, "epoch"} <= set(RESERVED)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (lambda v: v + 1j, TypeError, r"aux value 'a' is complex \(complex64\[\]\).*imaginary"),
        (lambda v: v > 0, TypeError, r"aux value 'a' is an array of bools \(bool\[\]\)"),
        (lambda v: jax.random.key(0), TypeError, r"aux value 'a' is a PRNG key \(key<fry>\[\]\)"),
        (lambda v: True, TypeError, r"aux value 'a' must be an array of numbers.*got a bool"),
        (lambda v: "high", TypeError, r"aux value 'a' must be an array of numbers.*got a str"),
    ],
)
def test_aux_values_that_are_not_real_numbers_are_refused(setup, value, error, match):
    model, x, y, kwargs = setup
    kwargs = kwargs | dict(loss=with_aux("a", value))
    with pytest.raises(error, match=match):
        eqfit.fit(model, (x, y), **kwargs)
    with pytest.raises(error, match=match):
        eqfit.evaluate(model, (x, y), loss=kwargs["loss"])


def test_numpy_and_python_aux_values_are_recorded(setup):
    model, x, y, kwargs = setup
    for value in (np.float32(2.5), 2.5, np.array([2.0, 3.0])):
        loss = with_aux("a", lambda v, value=value: value)
        result = eqfit.fit(model, (x, y), **(kwargs | dict(loss=loss)))
        np.testing.assert_array_equal(result.history["a"], [2.5])
        assert eqfit.evaluate(model, (x, y), loss=loss)["a"] == 2.5


def test_a_loss_returning_a_list_is_told_to_return_a_tuple(setup):
    model, x, y, kwargs = setup

    def loss(model, x, y):
        value = eqfit.losses.mse(model, x, y)
        return [value, {"half": value / 2}]

    with pytest.raises(TypeError, match=r"returned a list of 2 \(\[float32\[\], dict\]\)") as info:
        eqfit.fit(model, (x, y), **(kwargs | dict(loss=loss)))
    assert "`return value, aux` (a tuple)" in str(info.value)
    assert "Reduce it over the batch" not in str(info.value)


# Several validation sets in a list: the advice works as written, for any number of them.


@pytest.mark.parametrize("n", [2, 5])
def test_the_advice_for_a_list_of_validation_sets_works_when_followed(setup, n):
    model, x, y, kwargs = setup
    given = [(x + i, y) for i in range(n)]
    with pytest.raises(TypeError, match=rf"list of {n} datasets") as info:
        eqfit.fit(model, (x, y), validation_data=given, **kwargs)
    call = re.search(r"`validation_data=(eqfit\.ValidationSets\(.*?\))`", str(info.value))
    sets = eval(call.group(1), {"eqfit": eqfit, "sets": given})
    followed = eqfit.fit(model, (x, y), validation_data=sets, **kwargs)
    names = [f"val_{chr(ord('a') + i)}_loss" for i in range(n)]
    assert set(names) <= set(followed.history.values)
    # A tuple of them is told the same, working, call.
    with pytest.raises(ValueError, match=rf"a tuple of {n} datasets") as info:
        eqfit.fit(model, (x, y), validation_data=tuple(given), **kwargs)
    call = re.search(r"`validation_data=(eqfit\.ValidationSets\(.*?\))`", str(info.value))
    assert tuple(eval(call.group(1), {"eqfit": eqfit, "sets": given})) == tuple(sets)


def test_the_advice_names_many_sets_by_number():
    from eqfit._step._validation import naming_advice

    advice = naming_advice(30, "list")
    call = re.search(r"`validation_data=(eqfit\.ValidationSets\(.*?\))`", advice).group(1)
    sets = eval(call, {"eqfit": eqfit, "sets": [(np.zeros(1),)] * 30})
    assert list(sets)[:2] == ["set1", "set2"] and len(sets) == 30


# The loggers.


def test_a_logger_given_a_string_for_its_run_says_what_a_run_is():
    pytest.importorskip("wandb")
    with pytest.raises(TypeError, match=r"`WandbLogger`'s `run` must be a W&B run .*got a str"):
        eqfit.callbacks.WandbLogger(run="my-run")
    # Checked before MLflow is looked for: refused whether or not it is installed.
    with pytest.raises(TypeError, match=r"`MLflowLogger`'s `run` must be an MLflow run"):
        eqfit.callbacks.MLflowLogger(run="my-run")
    with pytest.raises(TypeError, match=r"give `run_id=`"):
        eqfit.callbacks.MLflowLogger(run="0123abcd")


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_tracking_server_is_named_at_once():
    from eqfit.callbacks import _check_server

    uri = f"http://127.0.0.1:{closed_port()}"
    began = time.perf_counter()
    with pytest.raises(ConnectionError, match=rf"tracking server at {uri} cannot be reached"):
        _check_server(uri)
    assert time.perf_counter() - began < 5
    # One that takes the connection but never answers: refused after the timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ConnectionError, match=r"timed out; eqfit waits 0.2 s"):
            _check_server(uri, timeout=0.2)
    # A file store or a database is not a server to reach.
    _check_server("file:///tmp/mlruns")
    _check_server("sqlite:///mlflow.db")


def test_a_server_that_answers_at_all_is_reached():
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from eqfit.callbacks import _check_server

    class Refusing(BaseHTTPRequestHandler):  # an answer, if not a welcome one
        def do_GET(self):
            self.send_error(401)

        def log_message(self, *args):
            pass

    with HTTPServer(("127.0.0.1", 0), Refusing) as server:
        thread = threading.Thread(target=server.handle_request, daemon=True)
        thread.start()
        _check_server(f"http://127.0.0.1:{server.server_address[1]}", timeout=5.0)
        thread.join(timeout=5.0)


def test_fit_with_a_dead_mlflow_server_fails_fast(setup, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    model, x, y, kwargs = setup
    uri = f"http://127.0.0.1:{closed_port()}"
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=uri)
    began = time.perf_counter()
    with pytest.raises(ConnectionError, match=rf"tracking server at {uri}"):
        eqfit.fit(model, (x, y), callbacks=[logger], **kwargs)
    assert time.perf_counter() - began < 30  # MLflow's own retries: minutes
