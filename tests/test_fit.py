"""The compiled fit and its progress path: same numbers, every sample, no recompiles."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, programs_made, regression_data

import eqfit


ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs


def linear(getkey, features=4):
    return eqfit.models.LinearRegression(features, key=getkey())


@pytest.mark.parametrize(
    "n, batch_size, drop_remainder",
    # A remainder batch, none, only a remainder (fewer samples than a batch), dropped.
    # (203 and 256 samples: test_parallel's one-device runs, the same programs.)
    [(203, 32, False), (256, 32, False), (7, 32, False), (203, 32, True)],
)
def test_progress_is_bitwise_equal_to_compiled(getkey, n, batch_size, drop_remainder):
    data = regression_data(getkey(), n)
    model = eqfit.models.MLP(4, "scalar", 16, 2, key=getkey())
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=batch_size,
        drop_remainder=drop_remainder,
    )
    compiled = eqfit.fit(model, data, progress=False, **kwargs)
    bar = eqfit.fit(model, data, progress="bar", **kwargs)
    assert_trees_equal(compiled.model, bar.model)
    assert_trees_equal(compiled.opt_state, bar.opt_state)
    np.testing.assert_array_equal(compiled.history.step_loss, bar.history.step_loss)
    np.testing.assert_array_equal(compiled.history.loss, bar.history.loss)


def test_progress_with_per_step_keys_is_bitwise_equal(getkey):
    # The problem of test_ensemble's dropout test, whose single-model run is this program.
    data = regression_data(getkey(), 64)
    model = eqfit.models.MLP(4, "scalar", 16, 1, dropout=0.5, key=getkey())

    def loss(model, x, y, *, key):
        keys = jax.random.split(key, x.shape[0])
        pred = jax.vmap(lambda a, k: model(a, key=k))(x, keys)
        return jnp.mean((pred - y) ** 2)

    kwargs = dict(loss=loss, optimizer=optax.sgd(1e-2), key=getkey(), epochs=2, batch_size=16)
    compiled = eqfit.fit(model, data, **kwargs)
    bar = eqfit.fit(model, data, progress="bar", **kwargs)
    assert_trees_equal(compiled.model, bar.model)
    # Dropout is live: another key gives another model.
    other = eqfit.fit(model, data, **{**kwargs, "key": getkey()})
    assert not np.array_equal(other.model.layers[0].weight, compiled.model.layers[0].weight)


@pytest.mark.parametrize("progress", [False, True])
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_every_sample_used_once_per_epoch(getkey, progress, drop_remainder):
    # A "model" of one weight per sample, a loss that sums the weights of its batch and
    # SGD with learning rate 1: each visit to sample i lowers weights[i] by exactly 1.
    n, batch_size, epochs = 103, 10, 3
    index = jnp.arange(n)

    def loss(weights, i):
        return jnp.sum(weights[i])

    result = eqfit.fit(
        jnp.zeros(n),
        (index,),
        loss=loss,
        optimizer=optax.sgd(1.0),
        key=getkey(),
        epochs=epochs,
        batch_size=batch_size,
        drop_remainder=drop_remainder,
        progress=progress,
    )
    visits = -np.asarray(result.model)
    if drop_remainder:
        # Each epoch skips a different random 3 samples.
        assert visits.sum() == epochs * (n - n % batch_size)
        assert set(np.unique(visits)) <= set(range(epochs + 1))
        assert np.any(visits < epochs)
    else:
        np.testing.assert_array_equal(visits, np.full(n, epochs, dtype=visits.dtype))
    assert result.history.step_loss.shape == (epochs, n // batch_size + (not drop_remainder))


def test_shuffle_changes_order_each_epoch(getkey):
    n = 64

    def loss(weights, i):
        # Weighted by position in the batch, so the order inside a batch shows up.
        return jnp.sum(weights[i] * jnp.arange(1.0, i.shape[0] + 1.0))

    common = dict(loss=loss, optimizer=optax.sgd(1.0), batch_size=8, epochs=1)
    a = eqfit.fit(jnp.zeros(n), (jnp.arange(n),), key=getkey(), **common).model
    b = eqfit.fit(jnp.zeros(n), (jnp.arange(n),), key=getkey(), **common).model
    fixed = eqfit.fit(jnp.zeros(n), (jnp.arange(n),), key=getkey(), shuffle=False, **common)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(-fixed.model, np.tile(np.arange(1.0, 9.0), 8))


def test_matches_hand_written_minibatch_sgd(getkey):
    x, y = regression_data(getkey(), 50)
    model = linear(getkey)
    batch_size, lr = 16, 0.05
    result = eqfit.fit(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(lr),
        key=getkey(),
        epochs=2,
        batch_size=batch_size,
        shuffle=False,
    )
    expected_losses = []
    for _ in range(2):
        for start in range(0, 50, batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            value, grads = eqx.filter_value_and_grad(eqfit.losses.mse)(model, xb, yb)
            model = jax.tree.map(lambda p, g: p - lr * g, model, grads)
            expected_losses.append(value)
    np.testing.assert_allclose(result.model.weight, model.weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.model.bias, model.bias, rtol=1e-5, atol=1e-6)
    step_loss = np.asarray(expected_losses).reshape(2, 4)
    np.testing.assert_allclose(result.history.step_loss, step_loss, rtol=1e-5)
    # The epoch loss weights each step by its batch size: 16, 16, 16 and 2.
    weights = np.array([16, 16, 16, 2]) / 50
    np.testing.assert_allclose(result.history.loss, step_loss @ weights, rtol=1e-5)
    np.testing.assert_array_equal(result.history.batch_sizes, [[16, 16, 16, 2]] * 2)


def test_learns_the_seed_example(getkey):
    x, y = regression_data(getkey(), 1000, features=10)
    y = jnp.sum(x, axis=1)
    result = eqfit.fit(
        linear(getkey, 10),
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.01),
        key=getkey(),
        epochs=10,
        batch_size=32,
    )
    np.testing.assert_allclose(result.model.weight, np.ones((1, 10)), atol=0.02)
    assert result.history.loss[-1] < 1e-3 < result.history.loss[0]
    assert result.history.epochs == 10
    assert result.history.wall_time > 0


@pytest.mark.parametrize("progress", [False, True])
def test_second_call_does_not_recompile(getkey, progress):
    traces = []

    def loss(model, x, y):
        traces.append(1)  # runs only while JAX traces
        return eqfit.losses.mse(model, x, y)

    data = regression_data(getkey(), 100)
    optimizer = optax.adam(1e-3)
    kwargs = dict(loss=loss, optimizer=optimizer, epochs=2, batch_size=32, progress=progress)
    eqfit.fit(linear(getkey), data, key=getkey(), **kwargs)
    first = len(traces)
    assert first > 0
    # A new model of the same structure, new data of the same shapes, a new key.
    eqfit.fit(linear(getkey), regression_data(getkey(), 100), key=getkey(), **kwargs)
    assert len(traces) == first
    # Another number of epochs, or a first epoch, is the same program: it is compiled
    # for the record's rows, the epochs rounded up to a power of two (8 at least).
    eqfit.fit(linear(getkey), data, key=getkey(), **{**kwargs, "epochs": 3})
    eqfit.fit(linear(getkey), data, key=getkey(), **{**kwargs, "epochs": 8, "initial_epoch": 5})
    assert len(traces) == first
    # A run of more epochs than the record holds is another program.
    eqfit.fit(linear(getkey), data, key=getkey(), **{**kwargs, "epochs": 9})
    assert len(traces) > first


def _kept_state(init):
    """An optimizer of plain gradient descent whose state is `init(params)`, kept as is."""

    def update(grads, state, params=None):
        return jax.tree.map(lambda g: -0.01 * g, grads), state

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("computes", [False, True])
def test_a_state_of_copies_and_fills_is_made_without_compiling(getkey, computes):
    # Adam's state is zeros and a count: `start` only copies and fills arrays, which
    # `fit` does without compiling it. A state computed from the parameters is compiled,
    # as `jax.jit` of `init` computes it.
    def copies_and_fills(params):
        fill = jnp.full((3,), 7.0, jnp.float32)  # weakly typed without its dtype: compiled
        return (jax.tree.map(jnp.copy, params), fill, jnp.zeros((), jnp.int32))

    def computed(params):
        return jax.tree.map(lambda p: jnp.sin(p) * 3.0 + 0.1, params)

    init = computed if computes else copies_and_fills
    model, data = linear(getkey), regression_data(getkey(), 64)
    params = eqx.filter(model, eqx.is_inexact_array)
    expected = jax.jit(init)(params)
    results, optimizer, key = [], _kept_state(init), getkey()

    def fit():
        results.append(
            eqfit.fit(
                model,
                data,
                loss=eqfit.losses.mse,
                optimizer=optimizer,
                key=key,
                epochs=1,
                batch_size=16,
            )
        )
        return results[-1]

    # The run's program, and where the state is computed, `start`'s.
    assert programs_made(fit) == (2 if computes else 1)
    assert_trees_equal(results[0].opt_state, expected)
    assert not eqx.tree_equal(results[0].model, model)  # it trained
    # A second fit compiles nothing: `start`, compiled by the first, is queued at once.
    assert programs_made(fit) == 0
    assert_trees_equal(results[1].opt_state, expected)
    assert_trees_equal(results[1].model, results[0].model)


def test_a_state_made_with_an_effect_is_compiled_and_the_effect_runs(getkey):
    # An `init` that fills arrays but also calls the host: made without compiling, the
    # callback would be dropped with the unused equations.
    calls = []

    def init(params):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.zeros((), jnp.int32)

    def fit():
        return eqfit.fit(
            linear(getkey),
            regression_data(getkey(), 64),
            loss=eqfit.losses.mse,
            optimizer=_kept_state(init),
            key=getkey(),
            epochs=1,
            batch_size=16,
        )

    assert programs_made(fit) == 2
    jax.effects_barrier()
    assert len(calls) == 1


@pytest.mark.parametrize("progress", [False, True])
def test_callers_model_is_left_intact(getkey, progress):
    data = regression_data(getkey(), 64)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    before = jax.tree.map(np.array, eqx.filter(model, eqx.is_array))
    result = eqfit.fit(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=2,
        batch_size=16,
        progress=progress,
    )
    assert_trees_equal(eqx.filter(model, eqx.is_array), before)  # still readable, unchanged
    assert not np.array_equal(result.model.layers[0].weight, model.layers[0].weight)
    assert type(result.model) is type(model)
    # The input data are still usable, too.
    assert np.isfinite(np.asarray(data[0])).all()


def test_numpy_and_jax_inputs_agree(getkey):
    x, y = regression_data(getkey(), 64)
    model, key = linear(getkey), getkey()
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), epochs=2, batch_size=16)
    from_jax = eqfit.fit(model, (x, y), key=key, **kwargs)
    from_numpy = eqfit.fit(model, (np.asarray(x), np.asarray(y)), key=key, **kwargs)
    assert_trees_equal(from_jax.model, from_numpy.model)


def test_raw_uint32_key_is_accepted(getkey):
    data = regression_data(getkey(), 64)
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), epochs=2, batch_size=16)
    raw = jax.random.key_data(jax.random.key(3))
    a = eqfit.fit(linear(getkey), data, key=raw, **kwargs)
    assert np.isfinite(a.history.loss).all()


def test_filter_spec_freezes_the_rest(getkey):
    data = regression_data(getkey(), 64)
    model = linear(getkey)
    only_bias = jax.tree.map(lambda _: False, model)
    only_bias = eqx.tree_at(lambda m: m.bias, only_bias, True)
    result = eqfit.fit(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.1),
        key=getkey(),
        epochs=2,
        batch_size=16,
        filter_spec=only_bias,
    )
    np.testing.assert_array_equal(result.model.weight, model.weight)
    assert not np.array_equal(result.model.bias, model.bias)


def test_integer_leaves_ride_along(getkey):
    class Counted(eqx.Module):
        weight: jax.Array
        table: jax.Array  # an integer array: never trained, still usable

        def __call__(self, x):
            return self.weight @ x + self.table[0]

    model = Counted(jnp.zeros(4), jnp.array([1], dtype=jnp.int32))
    result = eqfit.fit(
        model,
        regression_data(getkey(), 32),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.01),
        key=getkey(),
        epochs=1,
        batch_size=8,
    )
    assert result.model.table.dtype == jnp.int32
    np.testing.assert_array_equal(result.model.table, model.table)


def test_continue_from_opt_state(getkey):
    data = regression_data(getkey(), 64)
    optimizer = ADAM
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optimizer, batch_size=16, shuffle=False)
    first = eqfit.fit(linear(getkey), data, key=getkey(), epochs=1, **kwargs)
    second = eqfit.fit(
        first.model, data, key=getkey(), epochs=1, opt_state=first.opt_state, **kwargs
    )
    both = eqfit.fit(first.model, data, key=getkey(), epochs=1, **kwargs)
    # Adam's step count carried over: the continued run differs from a cold restart.
    assert int(second.opt_state[0].count) == 8
    assert not np.array_equal(second.model.weight, both.model.weight)


def test_zero_epochs_returns_the_model(getkey):
    # The shapes and optimizer of test_usability's quick results: the same program.
    model = linear(getkey, 3)
    result = eqfit.fit(
        model,
        regression_data(getkey(), 8, features=3),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(1e-2),
        key=getkey(),
        epochs=0,
    )
    assert_trees_equal(result.model, model)
    assert result.history.loss.shape == (0,)
    assert result.history.step_loss.shape == (0, 1)
    assert result.history.stop_reason is None  # nothing stopped it: it was asked for none


def test_history_to_dict(getkey):
    result = eqfit.fit(
        linear(getkey),
        regression_data(getkey(), 20),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.1),
        key=getkey(),
        epochs=3,
        batch_size=8,
    )
    d = result.history.to_dict()
    assert d["epoch"] == [1, 2, 3]  # counted from 1
    assert d["loss"] == pytest.approx(result.history.loss.tolist())
    assert all(isinstance(v, float) for v in d["loss"])


def test_progress_bar_shows_epoch_step_and_loss(getkey, capsys):
    eqfit.fit(
        linear(getkey),
        regression_data(getkey(), 64),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.1),
        key=getkey(),
        epochs=2,
        batch_size=16,
        progress="bar",  # stderr is captured, no terminal: the bar, as asked
    )
    err = capsys.readouterr().err
    assert "epoch 2/2" in err
    assert "8/8" in err
    assert "loss=" in err
    # The rate of samples over the last calls, not tqdm's, as a person reads it: "879k".
    assert re.search(r", \d+(\.\d+)?[kMG]? samples/s", err), err


def test_progress_from_inside_an_epoch_is_bitwise_equal(getkey):
    """An epoch longer than the bar's first call (8 steps): calls stop inside epochs."""
    data = regression_data(getkey(), 150)
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=2,  # 75 steps an epoch
        validation_data=regression_data(getkey(), 20),
    )
    compiled = eqfit.fit(model, data, **kwargs)
    bar = eqfit.fit(model, data, progress="bar", **kwargs)
    assert_trees_equal(compiled.model, bar.model)
    np.testing.assert_array_equal(compiled.history.step_loss, bar.history.step_loss)
    np.testing.assert_array_equal(compiled.history.val_loss, bar.history.val_loss)


class WeightedMSE(eqx.Module):
    """A loss that is a Module holding an array: it is traced, not hashed."""

    weights: jax.Array

    def __call__(self, model, x, y):
        return jnp.mean(self.weights[0] * (jax.vmap(model)(x) - y) ** 2)


class ScaledMSE(eqx.Module):
    """A loss that is a Module with a list field: it cannot be hashed."""

    scales: list

    def __call__(self, model, x, y):
        return jnp.mean(self.scales[0] * (jax.vmap(model)(x) - y) ** 2)


class Stack(eqx.Module):
    """A model with a list field, as in Equinox's own examples: it cannot be hashed."""

    layers: list

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


CASES = ["frozen_by_callable", "frozen_by_tree", "loss_module", "list_loss", "list_model"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_frozen_arrays_losses_with_arrays_and_unhashable_fields(getkey, case, tmp_path):
    """Arrays that do not train (frozen by `filter_spec`, or held by the loss) are inputs
    of the program, and fields that cannot be hashed are compared by identity: each case
    trains as it should, alike on every path.
    """
    data = regression_data(getkey(), 64)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), epochs=2, batch_size=16)
    if case == "frozen_by_callable":  # biases train, weights are frozen floats
        kwargs["filter_spec"] = lambda x: eqx.is_inexact_array(x) and x.ndim == 1
    elif case == "frozen_by_tree":
        spec = jax.tree.map(lambda _: True, model)
        kwargs["filter_spec"] = eqx.tree_at(lambda m: m.layers[0].weight, spec, False)
    elif case == "loss_module":
        kwargs["loss"] = WeightedMSE(jnp.asarray([2.0]))
    elif case == "list_loss":
        kwargs["loss"] = ScaledMSE([2.0])
    else:
        k1, k2 = jax.random.split(getkey())
        model = Stack([eqx.nn.Linear(4, 8, key=k1), eqx.nn.Linear(8, "scalar", key=k2)])
    compiled = eqfit.fit(model, data, **kwargs)
    chunked = eqfit.fit(model, data, progress="bar", **kwargs)
    saved = eqfit.fit(model, data, checkpoint=tmp_path / "run", **kwargs)
    for other in (chunked, saved):
        assert_trees_equal(compiled.model, other.model)
        np.testing.assert_array_equal(compiled.history.step_loss, other.history.step_loss)
    if case in ("loss_module", "list_loss"):
        plain = eqfit.fit(model, data, **{**kwargs, "loss": eqfit.losses.mse})
        np.testing.assert_allclose(compiled.history.loss, 2 * plain.history.loss, rtol=1e-5)
    elif case == "list_model":
        assert not np.array_equal(compiled.model.layers[0].weight, model.layers[0].weight)
    else:
        frozen = model.layers[0].weight
        np.testing.assert_array_equal(compiled.model.layers[0].weight, frozen)
        assert compiled.model.layers[0].weight is frozen  # the caller's own, not a copy
        assert not np.array_equal(compiled.model.layers[0].bias, model.layers[0].bias)


def test_bfloat16_inputs_train(getkey):
    x, y = regression_data(getkey(), 64)
    result = eqfit.fit(
        linear(getkey),
        (x.astype(jnp.bfloat16), y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.05),
        key=getkey(),
        epochs=3,
        batch_size=16,
    )
    assert result.history.loss[-1] < result.history.loss[0]


@pytest.mark.heavy
def test_wall_time_covers_the_training(getkey):
    """The run is dispatched asynchronously; the wall time must still include it."""
    import time

    data = regression_data(getkey(), 4096)
    model = eqfit.models.MLP(4, "scalar", 16, 2, key=getkey())
    kwargs = dict(
        loss=eqfit.losses.mse, optimizer=optax.adam(1e-3), key=getkey(), epochs=30, batch_size=8
    )
    eqfit.fit(model, data, **kwargs)  # compiles
    start = time.perf_counter()
    result = eqfit.fit(model, data, **kwargs)
    elapsed = time.perf_counter() - start
    assert 0.5 * elapsed <= result.history.wall_time <= elapsed


def test_a_new_filter_function_each_call_does_not_recompile(getkey):
    """What a callable `filter_spec` chose is part of the program, not the function."""
    traces = []

    def loss(model, x, y):
        traces.append(1)  # runs only while JAX traces
        return eqfit.losses.mse(model, x, y)

    data = regression_data(getkey(), 64)
    kwargs = dict(loss=loss, optimizer=optax.sgd(0.1), epochs=1, batch_size=16)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    only_biases = eqfit.fit(model, data, key=getkey(), filter_spec=lambda x: x.ndim == 1, **kwargs)
    first = len(traces)
    again = eqfit.fit(model, data, key=getkey(), filter_spec=lambda x: x.ndim == 1, **kwargs)
    assert len(traces) == first
    np.testing.assert_array_equal(again.model.layers[0].weight, model.layers[0].weight)
    assert not np.array_equal(only_biases.model.layers[0].bias, model.layers[0].bias)
    # Choosing other leaves is another program.
    eqfit.fit(model, data, key=getkey(), filter_spec=lambda x: x.ndim == 2, **kwargs)
    assert len(traces) > first
