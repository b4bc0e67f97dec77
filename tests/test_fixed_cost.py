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


def test_a_later_fit_copies_its_filled_state_on_the_device(getkey, capfd):
    # Adam's zeros (and the records' fills) are kept on the device once made: a later fit
    # copies them there, where putting them from the host's memory costs an accelerator a
    # transfer as large as the model at every call. JAX's transfer guard logs each
    # transfer from the host (to the process's stderr), naming its shape.
    model = eqfit.models.MLP(5, "scalar", 7, 1, key=getkey())
    x = jax.random.normal(getkey(), (48, 5))
    data = (x, x.sum(axis=1))
    kwargs = dict(
        loss=eqfit.losses.mse, optimizer=optax.adam(1e-2), key=getkey(), epochs=2, batch_size=16
    )
    first = eqfit.fit(model, data, **kwargs)
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log_explicit"):
        later = eqfit.fit(model, data, **kwargs)
        jax.device_put(np.zeros((3, 11), np.float32))  # the log's own check: it is read
    log = capfd.readouterr().err
    assert "float32[3,11]" in log
    for shape in ("[7,5]", "[7]", "[7,7]", "[1,7]"):  # the weights', and Adam's moments'
        assert f"float32{shape}" not in log
    assert_trees_equal(later.model, first.model)
    assert_trees_equal(later.opt_state, first.opt_state)
    eqfit.clear_cache()  # its kept arrays go with its programs: made again, the same
    assert_trees_equal(eqfit.fit(model, data, **kwargs).model, first.model)
