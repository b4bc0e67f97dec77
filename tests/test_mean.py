"""Weighted means (`eqfit.Mean`): a masked sequence loss's epoch value, validation value and
`eqfit.evaluate` are the token-weighted mean, a sum over a sum, on one device, on eight
and on a mesh, with a remainder batch and from a loader; so is the gradient across
devices. Checked against the mean computed by hand.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfit


T, V = 7, 5  # positions per sequence, classes
KEY = jax.random.key(0)


def sequences(n, seed=0):
    """Sequences of random lengths, sorted by length (so batches' token counts differ
    widely, as a length-bucketed loader's do), with a mask of the real positions.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, T, 3)).astype(np.float32)
    y = rng.integers(0, V, size=(n, T)).astype(np.int32)
    lengths = np.sort(rng.integers(1, T + 1, size=n))
    mask = np.arange(T)[None] < lengths[:, None]
    return x, y, mask


class Tagger(eqx.Module):
    """Logits for each position of a sequence: `(time, 3) -> (time, classes)`."""

    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, V, key=key)

    def __call__(self, x):
        return jax.vmap(self.linear)(x)


def masked_ce(model, x, y, mask):
    logits = jax.vmap(model)(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    right = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    # An aux value and the loss, each a mean over tokens.
    return eqfit.Mean(jnp.sum(ce * mask), jnp.sum(mask)), {"acc": eqfit.Mean.of(right, mask)}


def tokens_per_sequence(model, x, y, mask):
    return eqfit.Mean(jnp.sum(mask), jnp.asarray(x.shape[0], jnp.float32))


def by_hand(model, x, y, mask):
    """The token-weighted means over all of the data, in float64."""
    logits = np.asarray(jax.vmap(model)(jnp.asarray(x)), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
    right = logits.argmax(-1) == y
    m = mask.astype(np.float64)
    return {
        "loss": (ce * m).sum() / m.sum(),
        "acc": (right * m).sum() / m.sum(),
        "tokens": m.sum() / len(m),
    }


class Loader:
    """Batches in order, as a PyTorch or Grain loader yields them."""

    def __init__(self, arrays, batch_size):
        self.arrays, self.batch_size = arrays, batch_size

    def __iter__(self):
        n = len(self.arrays[0])
        for i in range(0, n, self.batch_size):
            yield tuple(a[i : i + self.batch_size] for a in self.arrays)


# The several-device variants run with the heavy tests (`pytest -m heavy`), as CI does;
# the gradient's test below keeps them in the quick suite.
WAYS = [
    "one device",
    pytest.param("devices=8", marks=pytest.mark.heavy),
    pytest.param("mesh", marks=pytest.mark.heavy),
    "progress",
    "loader",
]


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_a_masked_loss_records_the_token_weighted_mean(way):
    """With the model held still (a learning rate of 0), the epoch's loss, its aux value
    and metric, the validation values and `eqfit.evaluate` each equal the mean over every
    token of the data, computed by hand, to 1e-6: batches of 16 (and a last one of 4) of
    very different token counts, whose mean of means is far off.
    """
    x, y, mask = sequences(100)
    model = Tagger(jax.random.key(0))
    data = (x, y, mask)
    kwargs = dict(
        loss=masked_ce,
        metrics={"tokens": tokens_per_sequence},
        optimizer=optax.sgd(0.0),
        epochs=1,
        batch_size=16,
        shuffle=False,
        validation_data=data,
        key=jax.random.key(0),
    )
    if way == "devices=8":
        kwargs["devices"] = 8
    elif way == "mesh":
        kwargs["mesh"] = jax.make_mesh((8,), ("batch",))
        kwargs["batch_size"] = 32  # a multiple of the mesh's 8 devices
    elif way == "progress":
        kwargs["progress"] = True
    result = eqfit.fit(model, Loader(data, 16) if way == "loader" else data, **kwargs)
    expected = by_hand(model, *data)
    history = result.history
    for name in ("loss", "acc", "tokens"):
        np.testing.assert_allclose(history[name][0], expected[name], rtol=1e-6)
        np.testing.assert_allclose(history[f"val_{name}"][0], expected[name], rtol=1e-6)
    # The mean of the batches' means, which a plain loss gives, is a thousand times
    # further off than the tolerance.
    per_batch = [by_hand(model, *(a[i : i + 16] for a in data))["loss"] for i in range(0, 100, 16)]
    sizes = [min(16, 100 - i) for i in range(0, 100, 16)]
    assert abs(np.average(per_batch, weights=sizes) / expected["loss"] - 1) > 1e-3
    evaluated = eqfit.evaluate(
        model, data, loss=masked_ce, metrics={"tokens": tokens_per_sequence}, batch_size=16
    )
    for name in ("loss", "acc", "tokens"):
        np.testing.assert_allclose(evaluated[name], expected[name], rtol=1e-6)
    # The step weights stay inside: the history names what the user named.
    assert set(history.step_values) == {"acc", "tokens"}


def gradient_step(model, data, lr):
    """One SGD step on the whole batch's token-weighted mean, by hand."""
    grads = jax.grad(lambda m: masked_ce(m, *map(jnp.asarray, data))[0].value)(model)
    return jax.tree.map(lambda p, g: p - lr * g, model, grads)


@pytest.mark.slow
@pytest.mark.parametrize(
    "way",
    ["devices=8", *(pytest.param(w, marks=pytest.mark.heavy) for w in ("one device", "mesh"))],
)
def test_the_gradient_is_of_the_sum_over_the_sum_across_devices(way):
    """One step on a batch split over 8 devices, whose shares hold different numbers of
    tokens: the step follows the gradient of the whole batch's token-weighted mean (the
    devices' totals and weights summed before dividing), not the mean of their means.
    """
    x, y, mask = sequences(64, seed=1)
    model = Tagger(jax.random.key(1))
    kwargs = dict(loss=masked_ce, optimizer=optax.sgd(0.5), epochs=1, batch_size=64, key=KEY)
    if way == "devices=8":
        kwargs["devices"] = 8
    elif way == "mesh":
        kwargs["mesh"] = jax.make_mesh((8,), ("batch",))
    result = eqfit.fit(model, (x, y, mask), shuffle=False, **kwargs)
    expected = gradient_step(model, (x, y, mask), 0.5)
    for got, want in zip(jax.tree.leaves(result.model), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The mean of the 8 shares' means moves the model elsewhere.
    shares = [gradient_step(model, (x[i::8], y[i::8], mask[i::8]), 0.5) for i in range(8)]
    other = jax.tree.map(lambda *p: sum(p) / 8, *shares)
    assert not np.allclose(jax.tree.leaves(other)[0], jax.tree.leaves(expected)[0], atol=1e-4)


@pytest.mark.slow
def test_eqfit_losses_and_metrics_take_weights_and_masks():
    """`(x, y, weights)`: a mask over sequence positions, class weights as
    `class_weights[y]`, per-example weights; the value is the weighted mean, an
    `eqfit.Mean`; without weights, the plain mean as before.
    """
    x, y, mask = sequences(20)
    model = Tagger(jax.random.key(2))
    expected = by_hand(model, x, y, mask)
    value = eqfit.losses.softmax_cross_entropy(model, x, y, mask)
    assert isinstance(value, eqfit.Mean)
    np.testing.assert_allclose(value.value, expected["loss"], rtol=1e-6)
    accuracy = eqfit.metrics.accuracy(model, x, y, mask)
    np.testing.assert_allclose(accuracy.value, expected["acc"], rtol=1e-6)
    every = eqfit.losses.softmax_cross_entropy(model, x, y, np.ones_like(mask))
    plain = eqfit.losses.softmax_cross_entropy(model, x, y)
    np.testing.assert_allclose(every.value, plain, rtol=1e-6)

    # Class weights, in one line.
    class_weights = np.array([1.0, 2.0, 0.5, 0.0, 3.0], np.float32)
    weighted = eqfit.losses.softmax_cross_entropy(model, x, y, class_weights[y])
    logits = jax.vmap(model)(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    w = class_weights[y]
    np.testing.assert_allclose(weighted.value, np.sum(ce * w) / np.sum(w), rtol=1e-6)

    # A weight per example for a regression: its outputs averaged first.
    mlp = eqfit.models.MLP(3, 2, 8, 1, key=jax.random.key(3))
    xs = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    ys = np.random.default_rng(1).normal(size=(10, 2)).astype(np.float32)
    ws = np.arange(10, dtype=np.float32)
    got = eqfit.losses.mse(mlp, xs, ys, ws)
    per = np.mean((np.asarray(jax.vmap(mlp)(xs)) - ys) ** 2, axis=1)
    np.testing.assert_allclose(got.value, np.sum(per * ws) / np.sum(ws), rtol=1e-5)

    # In `fit`, given the batch's third array: the epoch's mean is over tokens.
    result = eqfit.fit(
        model,
        (x, y, mask),
        loss=eqfit.losses.softmax_cross_entropy,
        metrics={"acc": eqfit.metrics.accuracy},
        optimizer=optax.sgd(0.0),
        epochs=1,
        batch_size=8,
        shuffle=False,
        key=KEY,
    )
    np.testing.assert_allclose(result.history.loss[0], expected["loss"], rtol=1e-6)
    np.testing.assert_allclose(result.history["acc"][0], expected["acc"], rtol=1e-6)

    with pytest.raises(ValueError, match=r"`weights` must have shape \(batch,\) or a leading"):
        eqfit.losses.softmax_cross_entropy(model, x, y, mask[:, :3])


def test_a_batch_and_an_epoch_of_weight_zero():
    """A batch whose tokens are all masked trains on a zero gradient and records NaN for
    its step, which the epoch leaves out (the run goes on: no `on_nan` stop); an epoch
    whose weights sum to 0 records NaN, never 0.
    """
    x, y, mask = sequences(48)
    mask = mask.copy()
    mask[:16] = False  # the first batch: nothing to learn
    model = Tagger(jax.random.key(4))
    kwargs = dict(loss=masked_ce, optimizer=optax.sgd(0.0), batch_size=16, shuffle=False, key=KEY)
    result = eqfit.fit(model, (x, y, mask), epochs=1, validation_data=(x, y, mask), **kwargs)
    assert result.history.stop_reason is None  # it ran to its end
    assert (
        np.isnan(result.history.step_loss[0, 0])
        and np.isfinite(result.history.step_loss[0, 1:]).all()
    )
    expected = by_hand(model, x, y, mask)
    np.testing.assert_allclose(result.history.loss[0], expected["loss"], rtol=1e-6)
    np.testing.assert_allclose(result.history.val_loss[0], expected["loss"], rtol=1e-6)

    nothing = np.zeros_like(mask)
    empty = eqfit.fit(model, (x, y, nothing), epochs=1, validation_data=(x, y, nothing), **kwargs)
    assert np.isnan(empty.history.loss[0]) and np.isnan(empty.history.val_loss[0])
    assert np.isnan(eqfit.evaluate(model, (x, y, nothing), loss=masked_ce)["loss"])


def test_a_mean_that_is_not_a_scalar_is_refused_before_the_run():
    x, y, mask = sequences(32)
    model = Tagger(jax.random.key(5))

    def per_sequence_weight(model, x, y, mask):
        ce = optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y)
        return eqfit.Mean(jnp.sum(ce * mask), jnp.sum(mask, axis=1))

    with pytest.raises(
        ValueError,
        match=r"`eqfit.Mean`'s `weight` must be a scalar \(shape \(\)\), but it has shape \(16,\)",
    ):
        eqfit.fit(
            model,
            (x, y, mask),
            loss=per_sequence_weight,
            optimizer=optax.sgd(0.1),
            batch_size=16,
            key=KEY,
        )


class Pair(eqx.Module):
    """Two taggers, each trained by an update of its own."""

    a: Tagger
    b: Tagger


def masked_ce_of(part):
    def loss(model, x, y, mask):
        return masked_ce(getattr(model, part), x, y, mask)

    return loss


@pytest.mark.slow
def test_several_updates_take_weighted_means():
    """Two updates whose losses are token means: each update's loss and aux value, in
    training and validation, is the mean over every token, computed by hand (the model
    held still); one SGD step of each follows the gradient of its batch's token mean.
    """
    x, y, mask = sequences(100, seed=3)
    data = (x, y, mask)
    model = Pair(Tagger(jax.random.key(10)), Tagger(jax.random.key(11)))

    def updates(lr):
        return [
            eqfit.Update("a", masked_ce_of("a"), optax.sgd(lr), trains=lambda m: m.a),
            eqfit.Update("b", masked_ce_of("b"), optax.sgd(lr), trains=lambda m: m.b),
        ]

    kwargs = dict(batch_size=16, shuffle=False, key=KEY)
    still = eqfit.fit(model, data, updates=updates(0.0), validation_data=data, **kwargs)
    for part in ("a", "b"):
        expected = by_hand(getattr(model, part), *data)
        for name in ("loss", "acc"):
            for recorded in (f"{part}_{name}", f"val_{part}_{name}"):
                np.testing.assert_allclose(
                    still.history[recorded][0], expected[name], rtol=1e-6, err_msg=recorded
                )
    assert not any(":" in name for name in still.history.step_values)

    batch = tuple(a[:64] for a in data)
    stepped = eqfit.fit(model, batch, updates=updates(0.5), batch_size=64, key=KEY)
    for part in ("a", "b"):
        want = gradient_step(getattr(model, part), batch, 0.5)
        got = getattr(stepped.model, part)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_mean_of_weights_of_the_wrong_shape_is_refused_naming_weights():
    with pytest.raises(ValueError, match=r"`weights` must have `values`' shape \(4, 3\).*\(4, 2\)"):
        eqfit.Mean.of(jnp.ones((4, 3)), jnp.ones((4, 2)))
    # Per-example weights with a trailing axis of 1 broadcast over the labels.
    mean = eqfit.Mean.of(jnp.ones((4, 3)), jnp.asarray([[1.0], [0.0], [1.0], [0.0]]))
    assert float(mean.total) == 6.0 and float(mean.weight) == 6.0


def weighted_ce(model, x, y, w):
    """Cross-entropy weighted per sequence by `w`, which may be negative."""
    ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y), -1)
    return eqfit.Mean(jnp.sum(w * ce), jnp.sum(w))


def test_negative_weights_are_divided_as_they_are():
    """An epoch of negative weights records the sum of its totals over the sum of its
    weights, as a hand loop does: each step's value counts, whatever its weight's sign.
    """
    x, y, _ = sequences(48, seed=6)
    model = Tagger(jax.random.key(6))
    logits = jax.vmap(model)(jnp.asarray(x))
    per = np.asarray(
        jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), -1), np.float64
    )
    kwargs = dict(loss=weighted_ce, optimizer=optax.sgd(0.0), batch_size=16, shuffle=False, key=KEY)
    for w in (-np.ones(48), np.r_[-np.ones(16), np.ones(32)], np.r_[np.ones(16), 2 * np.ones(32)]):
        w = w.astype(np.float32)
        result = eqfit.fit(model, (x, y, w), epochs=1, **kwargs)
        expected = (w * per).sum() / w.sum()
        np.testing.assert_allclose(result.history.loss[0], expected, rtol=1e-5)
        assert np.isfinite(result.history.step_loss).all()


@pytest.mark.slow
def test_weights_that_cancel_train_on_a_zero_gradient():
    """A batch whose weights sum to 0 while its total does not records NaN and trains on
    a zero gradient (what its docs promise for a batch of weight 0), whole and in
    microbatches whose weights cancel across them.
    """
    x, y, _ = sequences(16, seed=7)
    w = np.r_[np.ones(8), -np.ones(8)].astype(np.float32)  # sums to 0; the total does not
    model = Tagger(jax.random.key(7))
    assert abs(float(weighted_ce(model, x, y, w).total)) > 1e-3
    for microbatches in (1, 2):
        result = eqfit.fit(
            model,
            (x, y, w),
            loss=weighted_ce,
            optimizer=optax.sgd(1.0),
            batch_size=16,
            epochs=2,
            shuffle=False,
            microbatches=microbatches,
            key=KEY,
        )
        assert np.isnan(result.history.step_loss).all() and result.history.stop_reason is None
        for got, was in zip(jax.tree.leaves(result.model), jax.tree.leaves(model)):
            np.testing.assert_array_equal(got, was)


def test_one_updates_batch_of_weight_zero_leaves_the_others_values():
    """With two updates, a batch of weight 0 in one (its loss NaN for that step) leaves
    the other update's values of that step in its epoch mean and in `history.loss`.
    """
    x, y, mask = sequences(64, seed=8)
    mask = mask.copy()
    mask[:16] = False  # the first batch: nothing for update "a"
    full = np.ones_like(mask)
    model = Pair(Tagger(jax.random.key(12)), Tagger(jax.random.key(13)))

    def loss_b(model, x, y, mask):
        return masked_ce(model.b, x, y, full[: x.shape[0]])

    result = eqfit.fit(
        model,
        (x, y, mask),
        updates=[
            eqfit.Update("a", masked_ce_of("a"), optax.sgd(0.0), trains=lambda m: m.a),
            eqfit.Update("b", loss_b, optax.sgd(0.0), trains=lambda m: m.b),
        ],
        batch_size=16,
        shuffle=False,
        key=KEY,
    )
    h = result.history
    assert np.isnan(h.step_values["a_loss"][0, 0]) and np.isfinite(h.step_values["b_loss"][0]).all()
    b = by_hand(model.b, x, y, full)["loss"]
    a = by_hand(model.a, x, y, mask)["loss"]
    np.testing.assert_allclose(h["b_loss"][0], b, rtol=1e-6)  # over all 4 steps
    np.testing.assert_allclose(h["a_loss"][0], a, rtol=1e-6)  # over its 48 sequences' tokens
    assert np.isfinite(h.step_loss).all()  # the step counts: its loss is b's alone
    np.testing.assert_allclose(
        h.loss[0],
        np.mean(np.nan_to_num(h.step_values["a_loss"][0]) + h.step_values["b_loss"][0]),
        rtol=1e-6,
    )
