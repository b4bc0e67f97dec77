"""Gradient accumulation (`fit(..., microbatches=k)`): a step computed as k microbatches,
one after another, is the step of the whole batch: a masked token mean's gradient and
values over 4 microbatches equal one batch of 4 times their size, on one device, on
eight, on a mesh and from a loader, with a smaller last batch. Checked against a hand
loop of whole-batch steps, and shown apart from `optax.MultiSteps`' mean of means.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_features import batchnorm_loss, BatchNormNet
from test_mean import gradient_step, KEY, Loader, masked_ce, sequences, Tagger

import eqfit


def token_accuracy(model, x, y, mask):
    right = jnp.argmax(jax.vmap(model)(x), -1) == y
    return eqfit.Mean.of(right.astype(jnp.float32), mask)


def largest_gap(a, b):
    return max(
        float(jnp.max(jnp.abs(p - q))) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


# The several-device and loader variants run with the heavy tests (`pytest -m heavy`), as
# CI does.
WAYS = [
    "one device",
    pytest.param("loader", marks=pytest.mark.heavy),
    pytest.param("devices=8", marks=pytest.mark.heavy),
    pytest.param("mesh", marks=pytest.mark.heavy),
]


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_four_microbatches_step_as_one_batch_four_times_their_size(way):
    """Batches of 64 (the last of 22) in 4 microbatches: every step is the SGD step on
    the whole batch's token mean, computed by hand; the history's loss, aux value and
    metric are those of the run without microbatches. `optax.MultiSteps` over batches of
    16, the same effective batch, averages the microbatches' token means instead, and
    trains elsewhere.
    """
    x, y, mask = sequences(150, seed=2)
    data = (x, y, mask)
    model = Tagger(jax.random.key(6))
    kwargs = dict(
        loss=masked_ce,
        metrics={"right": token_accuracy},
        optimizer=optax.sgd(0.5),
        epochs=2,
        batch_size=64,
        shuffle=False,
        key=KEY,
    )
    if way == "devices=8":
        kwargs["devices"] = 8
    elif way == "mesh":
        kwargs["mesh"] = jax.make_mesh((8,), ("batch",))
    source = Loader(data, 64) if way == "loader" else data
    result = eqfit.fit(model, source, microbatches=4, **kwargs)
    whole = eqfit.fit(model, source, **kwargs)

    expected = model
    for _ in range(2):
        for i in range(0, 150, 64):
            expected = gradient_step(expected, tuple(a[i : i + 64] for a in data), 0.5)
    assert largest_gap(result.model, expected) < 1e-5
    for name in ("loss", "acc", "right"):
        np.testing.assert_allclose(result.history[name], whole.history[name], rtol=1e-6)
    np.testing.assert_allclose(result.history.step_loss, whole.history.step_loss, rtol=1e-5)
    if way != "one device":
        return
    # One update over the first 64 rows, as 4 microbatches of 16 both ways: MultiSteps
    # averages their token means, and lands away from the whole batch's step.
    first = tuple(a[:64] for a in data)
    one = dict(loss=masked_ce, epochs=1, shuffle=False, key=KEY)
    multi = eqfit.fit(
        model,
        first,
        optimizer=optax.MultiSteps(optax.sgd(0.5), every_k_schedule=4),
        batch_size=16,
        **one,
    )
    split = eqfit.fit(model, first, optimizer=optax.sgd(0.5), batch_size=64, microbatches=4, **one)
    assert largest_gap(split.model, gradient_step(model, first, 0.5)) < 1e-6
    assert largest_gap(multi.model, split.model) > 1e-3


@pytest.mark.slow
def test_the_model_state_passes_from_each_microbatch_to_the_next():
    """A BatchNorm model (batch statistics in training) in 2 microbatches: each
    microbatch normalises by its own statistics, the step takes the mean of their
    gradients, and the running statistics are updated by the first microbatch, then by
    the second, as a hand loop does. Microbatch `j` of a batch holds rows `j, j + 2, ...`.
    """
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = rng.normal(size=(32,)).astype(np.float32)
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(7))
    result = eqfit.fit(
        model,
        (x, y),
        state=state,
        loss=batchnorm_loss,
        optimizer=optax.sgd(0.1),
        epochs=1,
        batch_size=32,
        microbatches=2,
        shuffle=False,
        key=KEY,
    )

    params, static = eqx.partition(model, eqx.is_inexact_array)
    grads, losses, s = [], [], state
    for j in range(2):
        loss_fn = lambda p, s: batchnorm_loss(eqx.combine(p, static), s, x[j::2], y[j::2])  # noqa: E731
        (loss, s), g = jax.value_and_grad(loss_fn, has_aux=True)(params, s)
        grads.append(g)
        losses.append(loss)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
    expected = eqx.combine(jax.tree.map(lambda p, g: p - 0.1 * g, params, mean), static)
    assert (
        largest_gap(eqx.filter(result.model, eqx.is_array), eqx.filter(expected, eqx.is_array))
        < 1e-6
    )
    assert largest_gap(result.state, s) < 1e-6
    np.testing.assert_allclose(result.history.loss[0], np.mean(losses), rtol=1e-6)
    # The first microbatch's statistics alone leave the state elsewhere.
    _, first = batchnorm_loss(model, state, x[0::2], y[0::2])
    assert largest_gap(result.state, first) > 1e-4


@pytest.mark.slow
def test_several_updates_and_sam_accumulate_as_one_batch():
    """Each loss's update of `updates=` is computed in microbatches as `loss=` is, and
    SAM's opaque mode gets a `grad_fn` that accumulates too: both train as without
    microbatches.
    """
    rng = np.random.default_rng(4)
    x = rng.normal(size=(96, 3)).astype(np.float32)
    y = rng.normal(size=(96, 2)).astype(np.float32)
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(8))

    def first_layer_loss(model, x, y):
        return eqfit.losses.mse(model, x, y)

    updates = [
        eqfit.Update("a", first_layer_loss, optax.adam(1e-2), trains=lambda m: m.layers[0]),
        eqfit.Update("b", eqfit.losses.mse, optax.sgd(0.1), trains=lambda m: m.layers[1], every=2),
    ]
    sam = optax.contrib.sam(optax.sgd(0.05), optax.sgd(0.02), sync_period=3, opaque_mode=True)
    for kwargs in (dict(updates=updates), dict(loss=eqfit.losses.mse, optimizer=sam)):
        common = dict(epochs=2, batch_size=32, key=KEY, **kwargs)
        split = eqfit.fit(model, (x, y), microbatches=4, **common)
        whole = eqfit.fit(model, (x, y), **common)
        assert (
            largest_gap(
                eqx.filter(split.model, eqx.is_array), eqx.filter(whole.model, eqx.is_array)
            )
            < 1e-6
        )
        moved = largest_gap(eqx.filter(whole.model, eqx.is_array), eqx.filter(model, eqx.is_array))
        assert moved > 1e-3
        for name, values in whole.history.values.items():
            np.testing.assert_allclose(split.history[name], values, rtol=1e-5, err_msg=name)


def test_microbatches_that_do_not_split_the_batch_are_refused():
    x, y, mask = sequences(64)
    model = Tagger(jax.random.key(9))
    kwargs = dict(loss=masked_ce, optimizer=optax.sgd(0.1), key=KEY)
    with pytest.raises(ValueError, match=r"`microbatches` must be an integer of 1 or more, got 0"):
        eqfit.fit(model, (x, y, mask), microbatches=0, **kwargs)
    with pytest.raises(
        ValueError,
        match=r"`microbatches`=3 does not split `batch_size`=32 evenly; use a batch size "
        r"that is a multiple of 3, such as 30 or 33",
    ):
        eqfit.fit(model, (x, y, mask), batch_size=32, microbatches=3, **kwargs)
    with pytest.raises(
        ValueError,
        match=r"`microbatches`=4 does not split `batch_size`=16 evenly on each of 8 devices; "
        r"use a batch size that is a multiple of 32",
    ):
        eqfit.fit(model, (x, y, mask), batch_size=16, microbatches=4, devices=8, **kwargs)
