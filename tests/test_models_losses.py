"""The ready models and losses against direct computation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal

import eqfit


def test_linear_regression(getkey):
    model = eqfit.models.LinearRegression(5, key=getkey())
    x = normal(getkey(), (5,))
    np.testing.assert_allclose(model(x), model.weight[0] @ x + model.bias[0], rtol=1e-6)
    assert model(x).shape == ()
    wide = eqfit.models.LinearRegression(5, 3, key=getkey())
    assert wide(x).shape == (3,)


def test_mlp(getkey):
    model = eqfit.models.MLP(3, 2, 8, 2, key=getkey())
    x = normal(getkey(), (3,))
    h = x
    for layer in model.layers[:-1]:
        h = jax.nn.relu(layer.weight @ h + layer.bias)
    expected = model.layers[-1].weight @ h + model.layers[-1].bias
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-6)
    assert len(model.layers) == 3


@pytest.mark.heavy
def test_ready_models_have_equinox_initial_parameters():
    # The layers are made in one compiled program; their parameters must be those that
    # Equinox's layers give, made one operation at a time, from the same keys.
    key = jax.random.key(7)
    mlp = eqfit.models.MLP(4, "scalar", 16, 2, key=key)
    keys = jax.random.split(key, 3)
    expected = (
        eqx.nn.Linear(4, 16, key=keys[0]),
        eqx.nn.Linear(16, 16, key=keys[1]),
        eqx.nn.Linear(16, "scalar", key=keys[2]),
    )
    cnn = eqfit.models.CNN(1, (8, 8), 10, channels=(4, 6), key=key)
    k1, k2, k3 = jax.random.split(key, 3)
    expected_cnn = (
        eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1),
        eqx.nn.Conv2d(4, 6, 3, padding=1, key=k2),
        eqx.nn.Linear(6 * 4 * 4, 10, key=k3),
    )
    got = (mlp.layers, (cnn.conv1, cnn.conv2, cnn.head))
    assert bool(eqx.tree_equal(got, (expected, expected_cnn)))


def test_mlp_dropout_needs_key_and_respects_inference_mode(getkey):
    model = eqfit.models.MLP(4, 3, 16, 1, dropout=0.5, key=getkey())
    x = normal(getkey(), (4,))
    a, b = model(x, key=getkey()), model(x, key=getkey())
    assert not np.array_equal(a, b)
    inference = eqx.nn.inference_mode(model)
    h = jax.nn.relu(model.layers[0].weight @ x + model.layers[0].bias)
    expected = model.layers[1].weight @ h + model.layers[1].bias
    np.testing.assert_allclose(inference(x), expected, rtol=1e-5, atol=1e-6)


def test_cnn(getkey):
    model = eqfit.models.CNN(1, (8, 8), 10, channels=(4, 6), key=getkey())
    x = normal(getkey(), (1, 8, 8))
    h = jax.nn.relu(model.conv1(x))
    h = jax.nn.relu(model.conv2(h))
    pooled = h.reshape(6, 4, 2, 4, 2).mean(axis=(2, 4))
    expected = model.head.weight @ pooled.ravel() + model.head.bias
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"shape \(1, 8, 8\), got \(2, 8, 8\)"):
        model(jnp.ones((2, 8, 8)))


def test_mse(getkey):
    model = eqfit.models.LinearRegression(3, key=getkey())
    x, y = normal(getkey(), (6, 3)), normal(getkey(), (6,))
    pred = x @ model.weight[0] + model.bias[0]
    np.testing.assert_allclose(eqfit.losses.mse(model, x, y), np.mean((pred - y) ** 2), rtol=1e-6)


def test_softmax_cross_entropy(getkey):
    model = eqfit.models.MLP(3, 4, 8, 1, key=getkey())
    x, y = normal(getkey(), (6, 3)), jnp.array([0, 1, 2, 3, 0, 1])
    logits = jax.vmap(model)(x)
    expected = -np.mean(np.asarray(jax.nn.log_softmax(logits))[np.arange(6), np.asarray(y)])
    np.testing.assert_allclose(eqfit.losses.softmax_cross_entropy(model, x, y), expected, rtol=1e-6)


def test_binary_cross_entropy(getkey):
    model = eqfit.models.LinearRegression(3, key=getkey())
    x = normal(getkey(), (6, 3))
    y = jnp.array([0, 1, 1, 0, 1, 0])
    logits = np.asarray(jax.vmap(model)(x), dtype=np.float64)
    p = 1 / (1 + np.exp(-logits))
    expected = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    np.testing.assert_allclose(eqfit.losses.binary_cross_entropy(model, x, y), expected, rtol=1e-5)
    as_bool = eqfit.losses.binary_cross_entropy(model, x, y.astype(bool))
    np.testing.assert_allclose(as_bool, expected, rtol=1e-5)
