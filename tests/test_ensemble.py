"""Many models in one program, and batched predict/evaluate."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, normal, regression_data

import eqfit


MEMBERS = 3
ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs


def member(tree, i):
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, tree)


def stacked_mlps(key, members=MEMBERS, **kwargs):
    make = lambda k: eqfit.models.MLP(4, "scalar", 16, 1, key=k, **kwargs)  # noqa: E731
    return eqx.filter_vmap(make)(jax.random.split(key, members))


@pytest.fixture(scope="module")
def ensemble():
    """An ensemble problem, and each member trained alone: the reference."""
    # The sizes of test_features' problem: each member alone is its validation test's program.
    key = jax.random.key(10)
    data = regression_data(jax.random.fold_in(key, 1), 120)
    val = regression_data(jax.random.fold_in(key, 2), 37)
    models = stacked_mlps(jax.random.fold_in(key, 3))
    fit_key = jax.random.fold_in(key, 4)
    kwargs = dict(
        loss=eqfit.losses.mse, optimizer=ADAM, epochs=3, batch_size=16, validation_data=val
    )
    alone = [
        eqfit.fit(member(models, i), data, key=k, **kwargs)
        for i, k in enumerate(jax.random.split(fit_key, MEMBERS))
    ]
    return models, data, fit_key, kwargs, alone


@pytest.mark.parametrize("progress", [False, True])
def test_each_member_trains_as_it_would_alone(ensemble, progress):
    models, data, key, kwargs, alone = ensemble
    result = eqfit.fit(models, data, key=key, ensemble=True, progress=progress, **kwargs)
    assert result.history.loss.shape == (3, MEMBERS)
    assert result.history.val_loss is not None and result.history.val_loss.shape == (3, MEMBERS)
    assert result.history.step_loss.shape == (3, 8, MEMBERS)  # 7 batches of 16 and one of 8
    for i, one in enumerate(alone):
        assert_trees_close(member(result.model, i), one.model)
        np.testing.assert_allclose(result.history.loss[:, i], one.history.loss, rtol=1e-5)
        np.testing.assert_allclose(result.history.val_loss[:, i], one.history.val_loss, rtol=1e-5)
    # Members differ: their own initialisation, shuffle and keys.
    assert not np.allclose(result.history.loss[:, 0], result.history.loss[:, 1])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [pytest.param("devices", marks=pytest.mark.heavy), "mesh"])
def test_ensemble_over_devices(ensemble, parallel):
    models, data, key, kwargs, alone = ensemble
    extra = {"devices": 8} if parallel == "devices" else {"mesh": jax.make_mesh((8,), ("b",))}
    many = eqfit.fit(models, data, key=key, ensemble=True, progress="bar", **extra, **kwargs)
    for i, one in enumerate(alone):
        assert_trees_close(member(many.model, i), one.model)


@pytest.mark.slow
def test_members_have_their_own_dropout_keys(getkey):
    data = regression_data(getkey(), 64)
    # Identical members: only the keys can tell them apart.
    one = eqfit.models.MLP(4, "scalar", 16, 1, dropout=0.5, key=getkey())
    models = jax.tree.map(lambda a: jnp.stack([a, a]) if eqx.is_array(a) else a, one)

    def loss(model, x, y, *, key):
        keys = jax.random.split(key, x.shape[0])
        return jnp.mean((jax.vmap(lambda a, k: model(a, key=k))(x, keys) - y) ** 2)

    key = getkey()
    kwargs = dict(loss=loss, optimizer=optax.sgd(0.01), epochs=2, batch_size=16)
    result = eqfit.fit(models, data, key=key, ensemble=True, **kwargs)
    alone = eqfit.fit(one, data, key=jax.random.split(key, 2)[1], **kwargs)
    assert_trees_close(member(result.model, 1), alone.model)
    assert not np.allclose(result.model.layers[0].weight[0], result.model.layers[0].weight[1])


class Scaled(eqx.Module):
    """A member with an array that trains (`w`), one that `filter_spec` freezes (`scale`)
    and an integer one (`shift`): each member's own.
    """

    w: jax.Array
    scale: jax.Array
    shift: jax.Array

    def __call__(self, x):
        return x @ self.w * self.scale + self.shift


@pytest.mark.slow
@pytest.mark.parametrize("execution", ["auto", eqfit.PerStep(2)])
def test_members_keep_their_own_arrays_that_do_not_train(getkey, execution):
    """An ensemble's frozen and integer arrays are stacked too: each member trains with its
    own, as it would alone (it got the whole stack once).
    """
    data, val = regression_data(getkey(), 48), regression_data(getkey(), 16)
    ones = [Scaled(jnp.full(4, 0.1 * i), jnp.asarray(1.0 + i), jnp.asarray(i)) for i in (0, 1)]
    models = jax.tree.map(lambda *a: jnp.stack(a), *ones)
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.05),
        epochs=3,
        batch_size=16,
        validation_data=val,
        filter_spec=Scaled(True, False, False),
        execution=execution,
    )
    key = getkey()
    result = eqfit.fit(models, data, key=key, ensemble=True, **kwargs)
    for i, k in enumerate(jax.random.split(key, 2)):
        alone = eqfit.fit(ones[i], data, key=k, **kwargs)
        assert_trees_close(member(result.model, i), alone.model)
        np.testing.assert_allclose(result.history.loss[:, i], alone.history.loss, rtol=1e-5)
        np.testing.assert_allclose(result.history.val_loss[:, i], alone.history.val_loss, rtol=1e-5)
    # What does not train comes back as it went in, each member's own.
    np.testing.assert_array_equal(result.model.scale, models.scale)
    np.testing.assert_array_equal(result.model.shift, models.shift)
    # `plan` traces each member's step with its own arrays too.
    assert eqfit.plan(models, data, key=key, ensemble=True, **kwargs).flops_per_step > 0


@pytest.mark.heavy
def test_ensemble_with_state_and_early_stopping(getkey):
    from test_features import batchnorm_loss, BatchNormNet

    data, val = regression_data(getkey(), 64), regression_data(getkey(), 16)
    make = eqx.filter_vmap(lambda k: eqx.nn.make_with_state(BatchNormNet)(k))
    models, states = make(jax.random.split(getkey(), 3))
    key = getkey()
    kwargs = dict(
        loss=batchnorm_loss,
        optimizer=ADAM,
        epochs=6,
        batch_size=16,
        validation_data=val,
        early_stopping=eqfit.EarlyStopping(2),
    )
    result = eqfit.fit(models, data, state=states, key=key, ensemble=True, **kwargs)
    assert isinstance(result.history.best_epoch, tuple) and len(result.history.best_epoch) == 3
    for i, k in enumerate(jax.random.split(key, 3)):
        alone = eqfit.fit(member(models, i), data, state=member(states, i), key=k, **kwargs)
        assert_trees_close(member(result.model, i), alone.model, rtol=1e-4, atol=1e-5)
        assert_trees_close(member(result.state, i), alone.state, rtol=1e-4, atol=1e-5)
        assert result.history.best_epoch[i] == alone.history.best_epoch
        ran = alone.history.epochs
        np.testing.assert_allclose(
            result.history.val_loss[:ran, i], alone.history.val_loss, rtol=1e-4
        )
        assert np.isnan(result.history.val_loss[ran:, i]).all()


@pytest.mark.slow
def test_learning_rate_sweep_through_inject_hyperparams(getkey):
    """Each member its own learning rate, in one program: stack the optimizer states."""
    data = regression_data(getkey(), 64)
    models = stacked_mlps(getkey(), members=3)
    rates = jnp.array([0.001, 0.01, 0.1])
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    params = eqx.filter(models, eqx.is_inexact_array)
    opt_state = jax.vmap(optimizer.init)(params)
    opt_state.hyperparams["learning_rate"] = rates
    key = getkey()
    kwargs = dict(loss=eqfit.losses.mse, epochs=2, batch_size=16)
    result = eqfit.fit(
        models, data, key=key, ensemble=True, optimizer=optimizer, opt_state=opt_state, **kwargs
    )
    for i, k in enumerate(jax.random.split(key, 3)):
        # SGD at this member's rate; as an injected hyperparameter, all three alone runs
        # are one program (a rate written into the program would make three).
        alone_sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=rates[i])
        alone = eqfit.fit(member(models, i), data, key=k, optimizer=alone_sgd, **kwargs)
        assert_trees_close(member(result.model, i), alone.model)
    np.testing.assert_array_equal(result.opt_state.hyperparams["learning_rate"], rates)
    # The history records each member's rate, every step.
    np.testing.assert_array_equal(result.history["learning_rate"], np.stack([rates] * 2))
    assert result.history.step_values["learning_rate"].shape == (2, 4, 3)


def test_ensemble_needs_a_stacked_model(getkey):
    data = regression_data(getkey(), 32)
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=getkey(), ensemble=True)
    with pytest.raises(ValueError, match=r"leading member axis"):
        eqfit.fit(Scalarish(jnp.asarray(1.0)), data, **kwargs)
    uneven = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())  # leading sizes 8, 8, 1, 1
    with pytest.raises(ValueError, match=r"leading sizes are \[1, 8\]; is it a single model"):
        eqfit.fit(uneven, data, **kwargs)
    with pytest.raises(ValueError, match=r"validation_split"):
        eqfit.fit(stacked_mlps(getkey()), data, validation_split=0.2, **kwargs)


class Scalarish(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return self.w * jnp.sum(x)


def test_predict_equals_vmap(getkey):
    model = eqfit.models.MLP(4, 3, 16, 1, key=getkey())
    x = normal(getkey(), (103, 4))
    expected = jax.vmap(model)(x)
    # Batches of another size multiply in another order: float32 rounding apart, near 0
    # too (hence `atol`; seen on AMD EPYC CPUs).
    for batch_size in (10, 103, 500):
        np.testing.assert_allclose(
            eqfit.predict(model, x, batch_size=batch_size), expected, rtol=1e-6, atol=1e-6
        )
    np.testing.assert_allclose(
        eqfit.predict(model, np.asarray(x), batch_size=32), expected, rtol=1e-6, atol=1e-6
    )


def test_predict_uses_inference_mode(getkey):
    model = eqfit.models.MLP(4, 3, 16, 1, dropout=0.9, key=getkey())
    x = normal(getkey(), (20, 4))
    expected = jax.vmap(eqx.nn.inference_mode(model))(x)
    np.testing.assert_allclose(
        eqfit.predict(model, x, batch_size=8), expected, rtol=1e-6, atol=1e-6
    )


def test_predict_ensemble(getkey):
    models = stacked_mlps(getkey())
    x = normal(getkey(), (37, 4))
    out = eqfit.predict(models, x, batch_size=16, ensemble=True)
    assert out.shape == (MEMBERS, 37)
    for i in range(MEMBERS):
        np.testing.assert_allclose(out[i], jax.vmap(member(models, i))(x), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"leading member axis"):
        eqfit.predict(Scalarish(jnp.asarray(1.0)), x, batch_size=4, ensemble=True)


def test_evaluate_equals_full_batch(getkey):
    model = eqfit.models.MLP(4, 3, 16, 1, key=getkey())
    x = normal(getkey(), (103, 4))
    y = jnp.arange(103) % 3
    metrics = {"accuracy": eqfit.metrics.accuracy}
    got = eqfit.evaluate(
        model, (x, y), loss=eqfit.losses.softmax_cross_entropy, metrics=metrics, batch_size=10
    )
    assert set(got) == {"loss", "accuracy"} and all(isinstance(v, float) for v in got.values())
    full = eqfit.losses.softmax_cross_entropy(model, x, y)
    np.testing.assert_allclose(got["loss"], full, rtol=1e-6)
    np.testing.assert_allclose(got["accuracy"], eqfit.metrics.accuracy(model, x, y), rtol=1e-6)


def test_evaluate_with_state(getkey):
    from test_features import batchnorm_loss, BatchNormNet

    model, state = eqx.nn.make_with_state(BatchNormNet)(getkey())
    x, y = regression_data(getkey(), 50)
    got = eqfit.evaluate(model, (x, y), loss=batchnorm_loss, state=state, batch_size=16)
    expected, _ = batchnorm_loss(eqx.nn.inference_mode(model), state, x, y)
    np.testing.assert_allclose(got["loss"], expected, rtol=1e-5)


def test_predict_and_evaluate_check_their_inputs(getkey):
    model = eqfit.models.MLP(4, 3, 16, 1, key=getkey())
    x = jnp.ones((10, 4))
    with pytest.raises(ValueError, match=r"`batch_size` must be at least 1, got 0"):
        eqfit.predict(model, x, batch_size=0)
    with pytest.raises(ValueError, match=r"`data` is empty"):
        eqfit.evaluate(model, (x[:0], x[:0]), loss=eqfit.losses.mse, batch_size=4)
    with pytest.raises(ValueError, match=r"`data\[0\]` has 10 samples but `data\[1\]` has 9"):
        eqfit.evaluate(model, (x, x[:9]), loss=eqfit.losses.mse, batch_size=4)
