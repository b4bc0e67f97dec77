"""What trains, said plainly: `fit(..., trains=lambda m: m.student)`, and the errors that
say what to use for several optimizers or losses.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, regression_data

import eqfit


class Distilled(eqx.Module):
    """A student trained to match a frozen teacher."""

    teacher: eqfit.models.MLP
    student: eqfit.models.MLP


def distill(model, x, y):
    target = jax.vmap(model.teacher)(x)
    return jnp.mean((jax.vmap(model.student)(x) - target) ** 2) + 0.0 * jnp.mean(y)


def problem():
    x, y = regression_data(jax.random.key(0), 64)
    keys = jax.random.split(jax.random.key(1))
    model = Distilled(
        teacher=eqfit.models.MLP(4, "scalar", 8, 1, key=keys[0]),
        student=eqfit.models.MLP(4, "scalar", 4, 1, key=keys[1]),
    )
    settings = dict(
        loss=distill, optimizer=optax.adam(1e-2), key=jax.random.key(2), epochs=2, batch_size=16
    )
    return model, (x, y), settings


def test_trains_picks_the_parts_that_train_and_freezes_the_rest():
    model, data, settings = problem()
    result = eqfit.fit(model, data, trains=lambda m: m.student, **settings)
    assert_trees_equal(result.model.teacher, model.teacher)  # frozen, bit for bit
    trained = jax.tree.leaves(eqx.filter(result.model.student, eqx.is_inexact_array))
    before = jax.tree.leaves(eqx.filter(model.student, eqx.is_inexact_array))
    assert all(not np.array_equal(a, b) for a, b in zip(trained, before))
    # The same run as the filter spec it stands for.
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m.student, spec, jax.tree.map(lambda _: True, model.student))
    by_spec = eqfit.fit(model, data, filter_spec=spec, **settings)
    assert_trees_equal(result.model, by_spec.model)
    # Several parts, and a single array.
    both = eqfit.fit(model, data, trains=lambda m: (m.student, m.teacher.layers[0]), **settings)
    assert not np.array_equal(both.model.teacher.layers[0].weight, model.teacher.layers[0].weight)
    assert_trees_equal(both.model.teacher.layers[1], model.teacher.layers[1])


def test_trains_that_cannot_be_followed_is_refused_naming_it():
    model, data, settings = problem()
    with pytest.raises(ValueError, match="`trains` and `filter_spec` both say what trains"):
        eqfit.fit(model, data, trains=lambda m: m.student, filter_spec=eqx.is_array, **settings)
    with pytest.raises(ValueError, match="`trains` must pick parts of the model.*AttributeError"):
        eqfit.fit(model, data, trains=lambda m: m.pupil, **settings)
    with pytest.raises(ValueError, match="`trains` picks no floating-point array"):
        eqfit.fit(model, data, trains=lambda m: m.student.dropout, **settings)
    with pytest.raises(TypeError, match="`trains`"):
        eqfit.fit(model, data, trains="student", **settings)


def test_several_optimizers_or_losses_are_refused_with_what_to_use_instead():
    model, data, settings = problem()
    adam = optax.adam(1e-3)
    with pytest.raises(
        TypeError, match=r"`optimizer`.*optax.multi_transform.*GAN.*updates=\[eqfit.Update"
    ):
        eqfit.fit(model, data, **{**settings, "optimizer": (adam, adam)})
    with pytest.raises(TypeError, match=r"`optimizer`.*optax.multi_transform"):
        eqfit.fit(model, data, **{**settings, "optimizer": {"d": adam, "g": adam}})
    with pytest.raises(TypeError, match=r"`loss`.*return their sum.*aux values"):
        eqfit.fit(model, data, **{**settings, "loss": (distill, distill)})
