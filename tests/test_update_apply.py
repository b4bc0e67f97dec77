"""One update, one path: `eqfit.Update.apply` is the step `fit` runs for the update, so a
hand loop of `Update.apply` calls gives `fit`'s parameters, optimizer state and per-step
values bit for bit (one loss, a `Mean` loss with a batch of weight 0, SAM in opaque mode,
two updates); `eqfit.Update` is final, and `eqfit.Execution` abstract (so neither is a way to
be ignored).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal

import eqfit


class Pair(eqx.Module):
    a: eqx.nn.MLP
    b: eqx.nn.Linear


def pair(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return Pair(eqx.nn.MLP(3, 1, 8, 1, key=k1), eqx.nn.Linear(3, 1, key=k2))


_rng = np.random.default_rng(0)
X = _rng.normal(size=(40, 3)).astype(np.float32)
Y = (X.sum(1, keepdims=True) + 0.5).astype(np.float32)
# Per-sample weights: the third batch of 8 weighs 0 (every target masked).
W = (_rng.uniform(size=40) > 0.3).astype(np.float32)
W[16:24] = 0.0
BATCH = 8


def mse(m, x, y):
    return jnp.mean((jax.vmap(m.a)(x) - y) ** 2), {"b_out": jnp.mean(jax.vmap(m.b)(x))}


def masked(m, x, y, w):
    err = jnp.sum((jax.vmap(m.a)(x) - y) ** 2, axis=1)
    return eqfit.Mean(jnp.sum(w * err), jnp.sum(w))


def follow(m, x, y):
    return jnp.mean((jax.vmap(m.b)(x) - jax.vmap(m.a)(x)) ** 2)


def hand_loop(model, updates, data, epochs=2):
    """`updates` applied in turn to each batch, in order (no shuffle), each step one jitted
    call of their `Update.apply`s: the model, the states by name and the values of each
    step by the history's names (`d_loss`, or `loss` for one unnamed update).
    """
    states = {u.name: u.init(eqx.filter(model, _spec(model, u.trains))) for u in updates}

    @eqx.filter_jit
    def step(model, states, batch):
        values = {}
        for u in updates:
            out = u.apply(model, states[u.name], batch, model_state=None, key=jax.random.key(0))
            model, states = out.model, {**states, u.name: out.state}
            values |= {f"{u.name}_{k}": v for k, v in out.values.items()}
        return model, states, values

    recorded = []
    for _ in range(epochs):
        for i in range(0, len(data[0]), BATCH):
            model, states, values = step(model, states, tuple(a[i : i + BATCH] for a in data))
            recorded.append(values)
    per_step = {k: np.array([v[k] for v in recorded]).reshape(epochs, -1) for k in recorded[0]}
    return model, states, per_step


def _spec(model, trains):
    if trains is None:
        return eqx.is_inexact_array
    nothing = jax.tree.map(lambda _: False, model)
    picked = eqx.tree_at(trains, nothing, replace_fn=lambda p: jax.tree.map(lambda _: True, p))
    return jax.tree.map(lambda s, x: s and eqx.is_inexact_array(x), picked, model)


def fit(model, data, **kwargs):
    return eqfit.fit(
        model,
        data,
        key=jax.random.key(0),
        epochs=2,
        batch_size=BATCH,
        shuffle=False,
        execution=eqfit.PerStep(1),
        **kwargs,
    )


@pytest.mark.slow
def test_one_loss_fit_equals_a_hand_loop_of_update_apply():
    update = eqfit.Update("u", mse, optax.adam(0.01))
    model, states, per_step = hand_loop(pair(), [update], (X, Y))
    result = fit(pair(), (X, Y), loss=mse, optimizer=optax.adam(0.01))
    assert_trees_equal(result.model, model)
    assert_trees_equal(result.opt_state, states["u"])
    np.testing.assert_array_equal(result.history.step_loss, per_step["u_loss"])
    np.testing.assert_array_equal(result.history.step_values["b_out"], per_step["u_b_out"])
    # And through `updates=`, under the update's name.
    result = fit(pair(), (X, Y), updates=[update])
    assert_trees_equal(result.model, model)
    assert_trees_equal(result.opt_state["u"], states["u"])
    for name in ("u_loss", "u_b_out"):
        np.testing.assert_array_equal(result.history.step_values[name], per_step[name])


@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), optax.adam(0.01)])
def test_a_mean_loss_with_a_batch_of_weight_0_trains_on_a_zero_gradient_by_hand_too(optimizer):
    update = eqfit.Update("u", masked, optimizer)
    model, states, per_step = hand_loop(pair(), [update], (X, Y, W))
    assert np.isnan(per_step["u_loss"][:, 2]).all()
    assert np.isfinite(per_step["u_loss"][:, [0, 1, 3, 4]]).all()
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    result = fit(pair(), (X, Y, W), loss=masked, optimizer=optimizer)
    assert_trees_equal(result.model, model)
    assert_trees_equal(result.opt_state, states["u"])
    np.testing.assert_array_equal(result.history.step_loss, per_step["u_loss"])


def test_sam_in_opaque_mode_by_hand_equals_fit():
    def sam():
        return optax.contrib.sam(
            optax.sgd(0.05), optax.sgd(0.01), opaque_mode=True, reset_state=False
        )

    update = eqfit.Update("u", mse, sam())
    model, states, per_step = hand_loop(pair(), [update], (X, Y))
    result = fit(pair(), (X, Y), loss=mse, optimizer=sam())
    assert_trees_equal(result.model, model)
    assert_trees_equal(result.opt_state, states["u"])
    np.testing.assert_array_equal(result.history.step_loss, per_step["u_loss"])


def test_two_updates_by_hand_equal_fit():
    def updates():
        return [
            eqfit.Update("a", mse, optax.adam(0.01), trains=lambda m: m.a),
            eqfit.Update("b", follow, optax.sgd(0.1), trains=lambda m: m.b),
        ]

    model, states, per_step = hand_loop(pair(), updates(), (X, Y))
    result = fit(pair(), (X, Y), updates=updates())
    assert_trees_equal(result.model, model)
    assert_trees_equal(result.opt_state, states)
    assert set(per_step) == set(result.history.step_values)
    for name, values in per_step.items():
        np.testing.assert_array_equal(result.history.step_values[name], values)


def test_a_subclass_of_update_is_refused_naming_abstract_update():
    with pytest.raises(TypeError, match=r"`Unchanged` subclasses `eqfit.Update`.*AbstractUpdate"):

        class Unchanged(eqfit.Update):  # pyright: ignore[reportUnusedClass]
            def apply(self, model, state, batch, *, model_state, key):
                return eqfit.Applied(model, state, model_state, {})


def test_an_update_of_ones_own_runs_its_apply():
    class Unchanged(eqfit.AbstractUpdate):
        name: str = "still"

        def init(self, params):
            return jnp.zeros((), jnp.int32)

        def apply(self, model, state, batch, *, model_state, key):
            return eqfit.Applied(model, state + 1, model_state, {"calls": state + 1.0})

    before = pair()
    result = fit(before, (X, Y), updates=[Unchanged()])
    assert_trees_equal(result.model, before)
    assert int(result.opt_state["still"]) == 10  # 5 steps an epoch, 2 epochs
    calls = np.arange(1.0, 11.0).reshape(2, 5)
    np.testing.assert_array_equal(result.history.step_values["still_calls"], calls)


class Twice(eqfit.AbstractUpdate):
    """An update of one's own whose `apply` runs a built-in update's `apply` inside it, and
    records its loss, doubled too.
    """

    inner: eqfit.Update
    name: str = "w"

    def init(self, params):
        return self.inner.init(params)

    def apply(self, model, state, batch, *, model_state, key):
        out = self.inner.apply(model, state, batch, model_state=model_state, key=key)
        values = {"loss": out.values["loss"], "twice": 2 * out.values["loss"]}
        return eqfit.Applied(out.model, out.state, out.model_state, values)


def test_an_update_apply_inside_ones_own_runs_as_in_a_hand_loop():
    # `fit` gives its options to the update whose turn it is: the built-in update that
    # one's own calls is not it, so it runs as a hand loop's.
    model, states, per_step = hand_loop(pair(), [eqfit.Update("u", mse, optax.adam(0.01))], (X, Y))
    result = fit(pair(), (X, Y), updates=[Twice(eqfit.Update("u", mse, optax.adam(0.01)))])
    assert_trees_equal(result.model, model)
    assert_trees_equal(result.opt_state["w"], states["u"])
    np.testing.assert_array_equal(result.history.step_values["w_loss"], per_step["u_loss"])
    np.testing.assert_array_equal(result.history.step_values["w_twice"], 2 * per_step["u_loss"])


def test_the_loss_validation_computes_is_a_method_of_every_update():
    update = eqfit.Update("u", mse, optax.adam(0.01))
    assert update.validation_loss() is mse
    assert Twice(update).validation_loss() is None  # the default: none

    class Own(Twice):
        def loss(self, model, x, y):
            return mse(model, x, y)

    own = Own(update)
    loss = own.validation_loss()
    assert loss is not None
    np.testing.assert_array_equal(loss(pair(), X, Y)[0], mse(pair(), X, Y)[0])
    assert isinstance(update, eqfit.AbstractUpdate)


def test_the_base_execution_is_abstract():
    with pytest.raises(TypeError, match=r"abstract class Execution"):
        eqfit.Execution()  # pyright: ignore[reportAbstractUsage]
