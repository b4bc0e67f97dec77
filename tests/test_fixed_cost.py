"""A `fit` of a configuration compiled before: what it does at every call, and what once."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import assert_trees_equal, programs_made, regression_data

import eqfit


def test_a_configuration_reads_how_to_make_its_state_once(getkey):
    # Adam's state is zeros and a count: `fit` makes it without compiling `start`, as its
    # trace says, traced once for the configuration (kept with its programs), not at
    # every fit, nor once JAX's own caches are cleared.
    traced = []
    adam = optax.adam(1e-2)

    def init(params):
        traced.append(1)  # runs only while JAX traces
        return adam.init(params)

    optimizer = optax.GradientTransformation(init, adam.update)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    before = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
    data, key, results = regression_data(getkey(), 48), getkey(), []

    def fit():
        results.append(
            eqfit.fit(
                model,
                data,
                loss=eqfit.losses.mse,
                optimizer=optimizer,
                key=key,
                epochs=2,
                batch_size=16,
                progress=False,
            )
        )
        return results[-1]

    assert programs_made(fit) == 1  # the run's: `start` is not compiled
    first = len(traced)
    jax.clear_caches()
    fit()
    fit()
    assert len(traced) == first
    # Each fit's state is new arrays, none the caller's (the run donates the state), and
    # every fit gives the same bits.
    assert_trees_equal(model, before)
    assert not eqx.tree_equal(results[0].model, model)
    for result in results[1:]:
        assert_trees_equal(result.model, results[0].model)
        assert_trees_equal(result.opt_state, results[0].opt_state)
        assert_trees_equal(result.history.step_loss, results[0].history.step_loss)


class _Bias(eqx.Module):
    """A model whose array's shape is not in its structure: of any size, one configuration."""

    b: jax.Array

    def __call__(self, x):
        return x.sum() + self.b.sum()


def _bias_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def test_a_configuration_given_arrays_of_other_shapes_makes_their_state(getkey):
    # One configuration, fitted with a bias of three, then five, then three entries: each
    # fit's state is made for its own arrays, not as an earlier fit's was.
    x, y = regression_data(getkey(), 32)
    optimizer, key, results = optax.adam(1e-2), getkey(), []
    for size in (3, 5, 3):
        model = _Bias(jnp.arange(size, dtype=jnp.float32))
        results.append(
            eqfit.fit(
                model,
                (x, y),
                loss=_bias_loss,
                optimizer=optimizer,
                key=key,
                epochs=1,
                batch_size=16,
                progress=False,
            )
        )
    for result, size in zip(results, (3, 5, 3)):
        adam, _ = result.opt_state
        assert result.model.b.shape == adam.mu.b.shape == adam.nu.b.shape == (size,)
        assert np.all(np.isfinite(result.history.loss))
    assert_trees_equal(results[2].model, results[0].model)
    assert_trees_equal(results[2].opt_state, results[0].opt_state)
