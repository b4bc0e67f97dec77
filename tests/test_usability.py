"""Small usability fixes: keys of both kinds, Keras's early-stopping defaults, a cache that
`clear_cache` empties, notes on errors raised in the user's loss, and clear errors for
`predict(ensemble=True)`, `save` and `load` misused.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, programs_made
from jaxtyping import TypeCheckError

import eqfit


# Keys


@pytest.mark.parametrize(
    "make",
    [
        lambda key: eqfit.models.MLP(3, 2, 8, 2, dropout=0.5, key=key),
        lambda key: eqfit.models.CNN(1, (8, 8), 10, channels=(4, 6), key=key),
        lambda key: eqfit.models.LinearRegression(3, 2, key=key),
    ],
    ids=["MLP", "CNN", "LinearRegression"],
)
def test_ready_models_take_raw_keys(make):
    # JAX's default (threefry) typed key wraps the raw key's bits, so both give the same
    # parameters, as they do for Equinox's own layers.
    raw, typed = make(jax.random.PRNGKey(0)), make(jax.random.key(0))
    assert_trees_equal(raw, typed)
    assert not np.array_equal(
        jax.tree.leaves(eqx.filter(raw, eqx.is_array))[0],
        jax.tree.leaves(eqx.filter(make(jax.random.PRNGKey(1)), eqx.is_array))[0],
    )


def test_mlp_dropout_takes_a_raw_key():
    model = eqfit.models.MLP(3, 2, 8, 2, dropout=0.5, key=jax.random.key(0))
    x = jnp.ones(3)
    raw = model(x, key=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(raw, model(x, key=jax.random.key(1)))
    assert not np.array_equal(raw, model(x, key=jax.random.PRNGKey(2)))


def test_bad_key_error_names_both_kinds():
    with pytest.raises(TypeCheckError, match=r"`MLP`'s argument `key`.*random\.PRNGKey\(0\)"):
        eqfit.models.MLP(3, 2, 8, 2, key=0)  # type: ignore[arg-type]


# Early stopping


def test_early_stopping_has_keras_defaults_but_restore_best():
    early = eqfit.EarlyStopping()
    assert (early.monitor, early.patience, early.min_delta) == ("val_loss", 0, 0.0)
    assert (early.mode, early.baseline, early.start_from_epoch) == ("auto", None, 0)
    assert early.restore_best is True  # Keras's `restore_best_weights=False`, on purpose
    assert eqfit.EarlyStopping(3).patience == 3  # still the first positional argument


# `clear_cache`


@pytest.mark.parametrize("which", ["predict", "evaluate"])
def test_clear_cache_frees_predict_and_evaluate_programs(which, getkey):
    model = eqfit.models.LinearRegression(5, key=getkey())
    x, y = np.ones((7, 5), np.float32), np.ones(7, np.float32)
    if which == "predict":
        call = lambda: eqfit.predict(model, x, batch_size=3)  # noqa: E731
    else:
        call = lambda: eqfit.evaluate(model, (x, y), loss=eqfit.losses.mse, batch_size=3)  # noqa: E731
    call()
    assert programs_made(call) == 0  # cached
    eqfit.clear_cache()
    assert programs_made(call) > 0  # freed, so compiled (or loaded from disk) again
    assert programs_made(call) == 0


# Notes on errors raised in the user's loss


@pytest.fixture
def linear_problem(getkey):
    model = eqx.nn.Linear(16, "scalar", key=getkey())
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 16)).astype(np.float32), rng.normal(size=64).astype(np.float32)
    kwargs = dict(optimizer=optax.sgd(0.1), key=getkey(), epochs=1, batch_size=32)
    return model, (x, y), kwargs


def test_loss_without_vmap_gets_a_note_with_shapes_and_the_vmap_hint(linear_problem):
    model, data, kwargs = linear_problem
    with pytest.raises(TypeError, match="dot_general") as info:
        eqfit.fit(model, data, loss=lambda model, x, y: jnp.mean((model(x) - y) ** 2), **kwargs)
    notes = info.value.__notes__
    assert (
        "while eqfit traced `loss(model, x, y)` with x: float32[32, 16], y: float32[32] (one batch)"
    ) in notes
    assert any("one example" in n and "`jax.vmap(model)(x)`" in n for n in notes)


def test_metric_without_vmap_is_named(linear_problem):
    model, data, kwargs = linear_problem
    metrics = {"mean_output": lambda m, inputs, targets: jnp.mean(m(inputs))}
    with pytest.raises(TypeError) as info:
        eqfit.fit(model, data, loss=eqfit.losses.mse, metrics=metrics, **kwargs)
    notes = info.value.__notes__
    assert any(
        n.startswith("while eqfit traced `metrics['mean_output'](model, inputs, targets)`")
        for n in notes
    )
    assert any("jax.vmap" in n for n in notes)


def test_other_errors_get_the_call_but_no_vmap_hint(linear_problem):
    model, data, kwargs = linear_problem

    def loss(model, *batch):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as info:
        eqfit.evaluate(model, data, loss=loss, batch_size=64)
    notes = info.value.__notes__
    assert (
        "while eqfit traced `loss(model, *batch)` with batch[0]: float32[64, 16], "
        "batch[1]: float32[64] (one batch)"
    ) in notes
    assert not any("jax.vmap" in n for n in notes)


# Clear errors for misused `predict`, `save` and `load`


def test_predict_ensemble_of_a_single_model(getkey):
    x = np.ones((4, 3), np.float32)
    mlp = eqfit.models.MLP(3, 2, 8, 2, key=getkey())  # arrays of several leading sizes
    with pytest.raises(ValueError, match=r"`ensemble=True`, `model` must be a stack"):
        eqfit.predict(mlp, x, ensemble=True)
    # Every array leads with 1: it passes for a stack of one, and fails when called.
    linear = eqfit.models.LinearRegression(3, key=getkey())
    with pytest.raises(ValueError) as info:
        eqfit.predict(linear, x, ensemble=True)
    assert "`ensemble=True`" in str(info.value) and "single model" in str(info.value)


@pytest.fixture(scope="module")
def results():
    model = eqfit.models.LinearRegression(3, key=jax.random.key(0))
    data = (np.ones((8, 3), np.float32), np.ones(8, np.float32))
    kwargs = dict(loss=eqfit.losses.mse, key=jax.random.key(1), epochs=0)  # quick
    adam = eqfit.fit(model, data, optimizer=optax.adam(1e-2), **kwargs)
    sgd = eqfit.fit(model, data, optimizer=optax.sgd(1e-2), **kwargs)
    return adam, sgd


def test_save_to_a_missing_directory_or_a_directory(results, tmp_path):
    adam, _ = results
    with pytest.raises(FileNotFoundError, match=r"`path` must be in a directory that exists"):
        eqfit.save(tmp_path / "missing" / "result.eqx", adam)
    with pytest.raises(IsADirectoryError, match=r"`path` must be a file to write.*directory"):
        eqfit.save(tmp_path, adam)
    assert list(tmp_path.iterdir()) == []  # not even a temporary file left behind


@pytest.mark.parametrize("saved", ["adam", "sgd"])
def test_load_like_a_result_of_another_optimizer(results, tmp_path, saved):
    adam, sgd = results
    result, other = (adam, sgd) if saved == "adam" else (sgd, adam)
    eqfit.save(tmp_path / "result.eqx", result)
    with pytest.raises(ValueError, match=r"`like`'s optimizer state differs.*another optimizer"):
        eqfit.load(tmp_path / "result.eqx", like=other)
    # The right `like` still reads it back, and a model alone needs no optimizer.
    loaded = eqfit.load(tmp_path / "result.eqx", like=result)
    assert_trees_equal((loaded.model, loaded.opt_state), (result.model, result.opt_state))
    assert_trees_equal(eqfit.load(tmp_path / "result.eqx", like=other.model), result.model)
