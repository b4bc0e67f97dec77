import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def regression_data(key, n=200, features=4):
    kx, kn = jax.random.split(key)
    x = jax.random.normal(kx, (n, features))
    y = x @ jnp.arange(1.0, features + 1.0) + 0.1 * jax.random.normal(kn, (n,))
    return x, y


def assert_trees_equal(a, b):
    """Bitwise equality of every array leaf, and equal structure."""
    la, ta = jax.tree.flatten(eqx.filter(a, eqx.is_array))
    lb, tb = jax.tree.flatten(eqx.filter(b, eqx.is_array))
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-5):
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
