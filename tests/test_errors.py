"""Bad input fails at the call, with a message naming the argument and the sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

import eqfit


@pytest.fixture
def setup(getkey):
    model = eqfit.models.LinearRegression(3, key=getkey())
    x, y = jnp.ones((10, 3)), jnp.ones(10)
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=getkey())
    return model, x, y, kwargs


def test_lengths_differ(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`data\[0\]` has 10 samples but `data\[1\]` has 9"):
        eqfit.fit(model, (x, y[:9]), **kwargs)


def test_empty_data(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`data` is empty: its arrays have 0 samples"):
        eqfit.fit(model, (x[:0], y[:0]), **kwargs)
    with pytest.raises(ValueError, match=r"`data` is empty"):
        eqfit.fit(model, (), **kwargs)


@pytest.mark.parametrize("batch_size", [0, -4])
def test_bad_batch_size(setup, batch_size):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=rf"`batch_size` must be at least 1, got {batch_size}"):
        eqfit.fit(model, (x, y), batch_size=batch_size, **kwargs)


def test_batch_larger_than_data_with_drop_remainder(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`batch_size`=32 is larger than the 10 samples"):
        eqfit.fit(model, (x, y), batch_size=32, drop_remainder=True, **kwargs)


def test_negative_epochs(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`epochs` must be an integer of 0 or more, got -1"):
        eqfit.fit(model, (x, y), epochs=-1, **kwargs)


def test_data_not_arrays(setup):
    model, x, y, kwargs = setup
    with pytest.raises(TypeError, match=r"`data\[0\]` must be a numpy or JAX array, got a list"):
        eqfit.fit(model, ([1.0, 2.0], [3.0, 4.0]), **kwargs)
    with pytest.raises(TypeError, match=r"tuple of arrays.*shape \(10, 3\).*pass `\(x,\)`"):
        eqfit.fit(model, x, **kwargs)
    with pytest.raises(TypeError, match=r"`data` must be a tuple of arrays.*got a float"):
        eqfit.fit(model, 3.0, **kwargs)


def test_data_of_strings(setup):
    model, x, _, kwargs = setup
    with pytest.raises(TypeError, match=r"`data\[1\]` has dtype <U1"):
        eqfit.fit(model, (x, np.array(["a"] * 10)), **kwargs)


def test_scalar_data(setup):
    model, x, _, kwargs = setup
    with pytest.raises((TypeError, ValueError), match=r"data"):
        eqfit.fit(model, (x, np.float32(1.0)), **kwargs)


@pytest.mark.parametrize("progress", [False, True])
def test_loss_not_scalar(setup, progress):
    model, x, y, kwargs = setup
    kwargs["loss"] = lambda m, a, b: jax.vmap(m)(a) - b
    with pytest.raises(ValueError, match=r"must return a scalar.*shape \(10,\)"):
        eqfit.fit(model, (x, y), progress=progress, **kwargs)


def test_loss_not_float(setup):
    model, x, y, kwargs = setup
    kwargs["loss"] = lambda m, a, b: jnp.sum(a > 0)
    with pytest.raises(TypeError, match=r"float scalar, got dtype int32"):
        eqfit.fit(model, (x, y), **kwargs)


@pytest.mark.parametrize("key", [jnp.ones(3), 0, jax.random.split(jax.random.key(0))])
def test_not_a_key(setup, key):
    model, x, y, kwargs = setup
    kwargs["key"] = key
    with pytest.raises(TypeCheckError, match=r"parameter 'key'"):
        eqfit.fit(model, (x, y), **kwargs)


def test_optimizer_factory_instead_of_optimizer(setup):
    model, x, y, kwargs = setup
    kwargs["optimizer"] = optax.sgd
    with pytest.raises(TypeCheckError, match=r"parameter 'optimizer'"):
        eqfit.fit(model, (x, y), **kwargs)


def test_features_do_not_fit_the_model(setup):
    model, _, y, kwargs = setup
    with pytest.raises(ValueError, match=r"expects one example `x` of shape \(3,\), got \(4,\)"):
        eqfit.fit(model, (jnp.ones((10, 4)), y), **kwargs)


def test_target_shape_does_not_fit_the_outputs(setup):
    model, x, _, kwargs = setup
    with pytest.raises(ValueError, match=r"outputs have shape \(10,\) but `y` has shape \(10, 1\)"):
        eqfit.fit(model, (x, jnp.ones((10, 1))), **kwargs)


def test_float_labels_for_cross_entropy(getkey):
    model = eqfit.models.MLP(3, 4, 8, 1, key=getkey())
    with pytest.raises(TypeCheckError, match=r"parameter 'y'"):
        eqfit.fit(
            model,
            (jnp.ones((10, 3)), jnp.ones(10)),
            loss=eqfit.losses.softmax_cross_entropy,
            optimizer=optax.sgd(0.1),
            key=getkey(),
        )
