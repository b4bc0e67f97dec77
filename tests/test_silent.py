"""The silent wrong results of issue 71's survey, each now refused with what was expected
and what was given, or computed right against a hand computation: a loader whose `len`
is wrong, a `validation_every` or `log_every` that no step reaches, early stopping inside
an epoch, `eqfit.Mean` weights that sum to 0, `eqfit.Buckets`' dtypes and lengths, the
metrics' labels and `k`, an accumulating metric's statistics, and metrax's mapping.
X is 40 rows, read in batches of 16, 16 and 8, as in the survey.
"""

import jax
import jax.numpy as jnp
import metrax
import numpy as np
import optax
import pytest

import eqfit


N, FEATURES, BATCH = 40, 3, 16
SGD = optax.sgd(0.1)  # one object for the module: fits share their compiled programs


@pytest.fixture(scope="module")
def xy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + rng.normal(size=N) * 0.1).astype(np.float32)
    return x, y


@pytest.fixture(scope="module")
def model():
    return eqfit.models.LinearRegression(FEATURES, key=jax.random.key(0))


class Said:
    """A re-iterable loader of `(x, y)` in batches of 16, 16 and 8 whose `len` says
    `length`, right or not.
    """

    def __init__(self, xy, length):
        self.xy, self.length = xy, length

    def __len__(self):
        return self.length

    def __iter__(self):
        x, y = self.xy
        for i in range(0, len(x), BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]


# A loader whose `len` is wrong.


def test_a_loader_whose_len_is_right_is_read_as_arrays_are(xy, model):
    whole = eqfit.evaluate(model, xy, loss=eqfit.losses.mse, batch_size=BATCH)
    loader = eqfit.evaluate(model, Said(xy, 3), loss=eqfit.losses.mse)
    np.testing.assert_allclose(loader["loss"], whole["loss"], rtol=1e-6)
    assert eqfit.predict(model, Said(xy, 3)).shape == (N,)


@pytest.mark.parametrize(
    "length, yielded",
    [
        (10, r"yielded 3 batches \(40 samples\)\."),
        (40, r"yielded 3 batches \(40 samples\): `len` is its number of samples"),
        (1, r"yielded more batches: its batch 1 \(counted from 0\) came in the same pass"),
        (2, r"yielded more batches: its batch 2"),
    ],
)
def test_a_loader_whose_len_is_wrong_is_refused_by_evaluate_and_predict(xy, model, length, yielded):
    # Before: `len` 10 read 10 batches, starting the loader over (1.4727 for 1.4693), `len`
    # 1 scored the first batch only, and `predict` returned 136 rows (536 for `len` 40).
    said = rf"`len\(data\)` is {length}, but a pass over `data` {yielded}"
    with pytest.raises(ValueError, match=said):
        eqfit.evaluate(model, Said(xy, length), loss=eqfit.losses.mse)
    said = rf"`len\(x\)` is {length}, but a pass over `x` {yielded}"
    with pytest.raises(ValueError, match=said):
        eqfit.predict(model, Said(xy, length))


@pytest.mark.slow
def test_a_validation_loader_whose_len_is_wrong_is_refused_naming_the_set(xy, model):
    kwargs = dict(loss=eqfit.losses.mse, optimizer=SGD, key=jax.random.key(1), progress=False)
    with pytest.raises(ValueError, match=r"`len\(validation_data\)` is 10, but .* yielded 3"):
        eqfit.fit(model, xy, validation_data=Said(xy, 10), batch_size=BATCH, **kwargs)
    sets = eqfit.ValidationSets(whole=xy, cut=Said(xy, 1))
    with pytest.raises(ValueError, match=r"`len\(validation_data\['cut'\]\)` is 1, but .* more"):
        eqfit.fit(model, xy, validation_data=sets, batch_size=BATCH, **kwargs)


def test_a_training_loader_whose_len_is_wrong_is_refused_as_its_pass_shows(xy, model):
    kwargs = dict(loss=eqfit.losses.mse, optimizer=SGD, key=jax.random.key(1), progress=False)
    # Its first epoch would have read the loader three times and a batch (10 steps).
    with pytest.raises(ValueError, match=r"`len\(data\)` is 10, but .* yielded 3 batches") as e:
        eqfit.fit(model, Said(xy, 10), **kwargs)
    trained = e.value.result.history.step_loss  # type: ignore[attr-defined]
    assert np.isfinite(trained).sum() == 3  # the pass's batches, and no more
    # Its second epoch would have gone on with the first pass's last batch.
    with pytest.raises(ValueError, match=r"`len\(data\)` is 2, but .* its batch 2"):
        eqfit.fit(model, Said(xy, 2), epochs=2, **kwargs)
    # With `steps_per_epoch`, the epochs are the run's own, and `len` is not used.
    result = eqfit.fit(model, Said(xy, 10), steps_per_epoch=5, epochs=2, **kwargs)
    assert result.history.step_loss.shape == (2, 5)


# `validation_every` and `log_every` that no step reaches.


def test_an_every_longer_than_the_run_is_refused(xy, model):
    # Before: `validation_every=1000` on a run of 12 steps validated nothing, without a word.
    kwargs = dict(loss=eqfit.losses.mse, optimizer=SGD, key=jax.random.key(1), progress=False)
    kwargs |= dict(batch_size=BATCH, epochs=4)  # 3 steps an epoch
    steps = r"this run has 12 steps \(4 epochs of 3 steps, counted from the first ever\)"
    for every in (13, 1000):
        with pytest.raises(ValueError, match=rf"`validation_every={every}`, but {steps}"):
            eqfit.fit(model, xy, validation_data=xy, validation_every=every, **kwargs)
    for every in (2**31, 10**30):  # past what a run's int32 step count can reach
        with pytest.raises(ValueError, match=r"`validation_every` must be .* at most 2147483647"):
            eqfit.fit(model, xy, validation_data=xy, validation_every=every, **kwargs)
    with pytest.raises(ValueError, match=rf"`log_every=1000`, but {steps}: it would never log"):
        eqfit.fit(model, xy, log_every=1000, **kwargs)
    with pytest.raises(ValueError, match=r"`log_every=13`, but this run has 12"):
        eqfit.plan(model, xy, log_every=13, **kwargs)
    result = eqfit.fit(model, xy, validation_data=xy, validation_every=12, **kwargs)
    assert list(result.history.validation_steps) == [12]


# Early stopping inside an epoch.


def mae(model, x, y):
    return jnp.mean(jnp.abs(jax.vmap(model)(x) - y))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in memory", "streamed"])
def test_an_epoch_that_early_stopping_ends_inside_has_its_trained_steps_values(xy, model, where):
    x, y = xy
    val = (x[:16], y[:16]) if where == "in memory" else Said((x[:16], y[:16]), 1)
    result = eqfit.fit(
        model, xy, validation_data=val, loss=eqfit.losses.mse, metrics={"mae": mae},
        optimizer=optax.sgd(0.3), key=jax.random.key(0), progress=False, batch_size=8,
        epochs=4, validation_every=2, early_stopping=eqfit.EarlyStopping(0),
    )  # fmt: skip
    history = result.history
    # 5 steps an epoch; the validation at step 8 is worse than step 6's: epoch 2 stops
    # after 3 of its steps. Before, its loss and its validation values were NaN.
    assert history.stop_reason == "early_stopping" and history.epochs == 2
    trained = history.batch_sizes[1] > 0
    assert trained.sum() == 3
    sizes = history.batch_sizes[1][trained]
    for name, steps in (("loss", history.step_loss), ("mae", history.step_values["mae"])):
        by_hand = np.sum(steps[1][trained] * sizes) / np.sum(sizes)
        np.testing.assert_allclose(history.values[name][1], by_hand, rtol=1e-6)
    assert list(history.validation_steps) == [2, 4, 6, 8]
    # The epoch's validation values are its last validation's, as for a whole epoch.
    assert history.val_loss is not None
    np.testing.assert_array_equal(history.val_loss[1], history.validations["val_loss"][-1])


# `eqfit.Mean` weights that sum to 0.


def signed_loss(model, x, y, w):
    return eqfit.Mean.of((jax.vmap(model)(x) - y) ** 2, w)


def test_mean_weights_that_sum_to_0_give_nan_in_evaluate_and_validation(xy, model):
    x, y = xy
    w = np.where(np.arange(N) % 2 == 0, 1.0, -1.0).astype(np.float32)  # each batch: 0
    # Before: `evaluate` and `val_loss` gave -inf or inf, where the guide promises NaN.
    for execution in ("auto", eqfit.PerStep(1)):
        value = eqfit.evaluate(
            model, (x, y, w), loss=signed_loss, batch_size=BATCH, execution=execution
        )
        assert np.isnan(value["loss"])
    result = eqfit.fit(
        model, (x, y, w), validation_data=(x, y, w), loss=signed_loss, optimizer=SGD,
        key=jax.random.key(1), progress=False, batch_size=BATCH, epochs=2,
    )  # fmt: skip
    assert result.history.val_loss is not None
    assert np.isnan(result.history.val_loss).all() and np.isnan(result.history.loss).all()
    # Weights that do not cancel still divide as they are.
    w = np.where(np.arange(N) < 30, 1.0, -1.0).astype(np.float32)
    by_hand = np.sum(w * (x @ np.asarray(model.weight[0]) + model.bias[0] - y) ** 2) / w.sum()
    value = eqfit.evaluate(model, (x, y, w), loss=signed_loss, batch_size=BATCH)
    np.testing.assert_allclose(value["loss"], by_hand, rtol=1e-5)


# `eqfit.Buckets`: a field of mixed dtypes, lengths that are not whole.


def test_buckets_refuse_a_field_of_mixed_dtypes_and_lengths_not_whole():
    rng = np.random.default_rng(2)
    xs = [rng.normal(size=(n, 2)).astype(np.float32) for n in (5, 9, 14, 3)]
    ys = np.arange(4, dtype=np.float32)
    # Before: each batch took its first sample's dtype, cutting floats to ints.
    mixed = [xs[0].astype(np.int32), *xs[1:]]
    message = r"field 0: sample 1 is float32, sample 0 int32"
    with pytest.raises(TypeError, match=message):
        eqfit.Buckets((mixed, ys), lengths=(8, 16), batch_size=2, shuffle=False)
    with pytest.raises(TypeError, match=r"field 1: sample 2 is int64, sample 0 float32"):
        eqfit.Buckets((xs, [*xs[:2], *(np.ones((len(x), 2), np.int64) for x in xs[2:])]),
                      lengths=(8, 16), batch_size=2, shuffle=False)  # fmt: skip
    # Before: (7.9, 16.5, 32.2) became (7, 16, 32).
    message = r"`Buckets`'s `lengths` must be a sequence of bucket lengths, increasing whole"
    for lengths in (np.array([7.9, 16.5, 32.2]), np.array([8.0, 16.0]), np.array([True])):
        with pytest.raises(TypeError, match=message):
            eqfit.Buckets((xs, ys), lengths=lengths, batch_size=2, shuffle=False)
    # (A tuple is refused by this suite's type checks first, naming `lengths` as well.)
    for lengths in ((7.9, 16.5, 32.2), 16, ("a", 16)):
        with pytest.raises(TypeError, match=r"lengths"):
            eqfit.Buckets((xs, ys), lengths=lengths, batch_size=2, shuffle=False)
    buckets = eqfit.Buckets((xs, ys), lengths=np.array([8, 16]), batch_size=2, shuffle=False)
    assert buckets.bucket_lengths == (8, 16)
    # Every batch holds the samples as they were.
    for (b, samples), (x, _, mask) in zip(buckets.order(), buckets):
        assert x.shape[1] == buckets.bucket_lengths[b]
        for row, i in enumerate(samples):
            np.testing.assert_array_equal(x[row, : len(xs[i])], xs[i])
            assert mask[row].sum() == len(xs[i])


# Fractional float labels, and `TopKAccuracy`'s `k`.


@pytest.fixture(scope="module")
def classified():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = rng.integers(0, 3, N).astype(np.int32)
    return x, y, eqfit.models.MLP(FEATURES, 3, 8, 1, key=jax.random.key(4))


def output_mean(model, x, y):
    """A loss that takes labels of any dtype, so that the metric alone judges them."""
    return jnp.mean(jax.vmap(model)(x))


@pytest.mark.parametrize(
    "metric",
    [
        eqfit.metrics.ConfusionMatrix(3),
        eqfit.metrics.F1(3, average="macro"),
        eqfit.metrics.Precision(3, average=None),
        eqfit.metrics.TopKAccuracy(2),
    ],
    ids=lambda m: type(m).__name__,
)
def test_float_labels_are_refused_by_the_class_metrics(classified, metric):
    x, y, model = classified
    name = type(metric).__name__
    message = rf"`{name}`: the labels `y` must be integer class indices, from 0 to 2"
    message += r", as `accuracy`'s .* are; got dtype float32"
    # Before: `y + 0.7` was floored (0.7 counted as class 0), or matched no class.
    for labels in (y + np.float32(0.7), y.astype(np.float32)):
        with pytest.raises(TypeError, match=message):
            eqfit.evaluate(model, (x, labels), loss=output_mean, metrics={"m": metric})
    kwargs = dict(loss=output_mean, optimizer=SGD, key=jax.random.key(1), progress=False)
    with pytest.raises(TypeError, match=message):
        eqfit.fit(model, (x, y + np.float32(0.7)), metrics={"m": metric}, **kwargs)


def test_the_confusion_matrix_of_integer_labels_is_counted_by_hand(classified):
    x, y, model = classified
    got = eqfit.evaluate(
        model, (x, y), loss=output_mean, batch_size=BATCH,
        metrics={"cm": eqfit.metrics.ConfusionMatrix(3), "top2": eqfit.metrics.TopKAccuracy(2)},
    )  # fmt: skip
    logits = np.asarray(jax.vmap(model)(x))
    by_hand = np.zeros((3, 3))
    np.add.at(by_hand, (y, logits.argmax(axis=1)), 1)
    np.testing.assert_array_equal(got["cm"], by_hand)
    top2 = np.argsort(-logits, axis=1)[:, :2]
    np.testing.assert_allclose(got["top2"], np.mean((top2 == y[:, None]).any(axis=1)))


def test_top_k_accuracy_refuses_a_k_below_1_or_above_the_classes(classified):
    x, y, model = classified
    # Before: `TopKAccuracy(0)` was always 0.
    for k, error in ((0, ValueError), (-1, ValueError), (True, TypeError)):
        message = rf"`TopKAccuracy`'s `k` must be a whole number, 1 or more.* got {k!r}"
        with pytest.raises(error, match=message):
            eqfit.metrics.TopKAccuracy(k)
    with pytest.raises(TypeError, match=r"(?s)2\.5"):  # this suite's type checks, or eqfit's
        eqfit.metrics.TopKAccuracy(2.5)  # type: ignore[arg-type]
    message = r"`TopKAccuracy`'s `k` is 9, but the model gives 3 logits per example .* at most 3"
    with pytest.raises(ValueError, match=message):
        eqfit.evaluate(
            model, (x, y), loss=output_mean, metrics={"top": eqfit.metrics.TopKAccuracy(9)}
        )


# An `AbstractMetric`'s statistics, checked once before the run.


def hits(model, x, y):
    return jnp.argmax(jax.vmap(model)(x), axis=-1) == y


class Counted(eqfit.metrics.AbstractMetric):
    """The accuracy, as hits and a count whose form `count` says."""

    count: str

    def statistics(self, model, x, y):
        hit = hits(model, x, y)
        count = {
            "python int": y.shape[0],  # before: kept as configuration, not summed (0.75)
            "array": jnp.asarray(y.shape[0]),
        }[self.count]
        return {"hits": jnp.sum(hit), "count": count}

    def compute(self, statistics):
        return statistics["hits"] / statistics["count"]


class Wrong(eqfit.metrics.AbstractMetric):
    """A statistic the run cannot sum, of the kind `kind` says."""

    kind: str

    def statistics(self, model, x, y):
        hit = hits(model, x, y)
        return {
            "max": {"largest": jnp.max(y)},  # before: 11 for 3
            "mean": {"share": jnp.mean(hit)},  # before: 0.75 for 0.15
            "bool": {"any": jnp.any(hit)},  # before: summed as an OR, 1 for 5
            "complex": {"z": jnp.sum(hit) * (1 + 1j)},  # before: recorded as 0.0
            "per row": {"each": hit.astype(jnp.float32)},
        }[self.kind]

    def compute(self, statistics):
        return jnp.abs(jnp.sum(next(iter(statistics.values()))))


@pytest.mark.parametrize(
    "metric, error, message",
    [
        (
            Counted("python int"),
            TypeError,
            r"metric 'm': its statistic `\['count'\]` is a Python int \(\d+\), which the run "
            r"would keep as it is, as configuration, and not sum over the batches: .*jnp\.asarray",
        ),
        (
            Wrong("max"),
            ValueError,
            r"metric 'm': its statistic `\['largest'\]` does not add under a batch split: on 8 "
            r"rows of the data it is 2, but the sum of its halves' is 3\. .* not a mean or a "
            r"maximum",
        ),
        (Wrong("mean"), ValueError, r"`\['share'\]` does not add under a batch split: on 8 rows"),
        (Wrong("bool"), TypeError, r"`\['any'\]` is an array of bools, which add as an OR"),
        (Wrong("complex"), TypeError, r"`\['z'\]` is complex \(complex64\): .* imaginary part"),
        (
            Wrong("per row"),
            ValueError,
            r"`statistics\['each'\]` have shape \(\d+,\) on a batch and \(\d+,\) on a "
            r"batch of a row less",
        ),
    ],
    ids=["python int", "max", "mean", "bool", "complex", "per row"],
)
def test_statistics_the_run_cannot_sum_are_refused_before_it(classified, metric, error, message):
    x, y, model = classified
    y = y.copy()
    y[:8] = [0, 1, 2, 2, 0, 1, 1, 0]  # a max of 2 on the 8 rows tried, 2 + 1 on its halves
    with pytest.raises(error, match=message):
        eqfit.evaluate(model, (x, y), loss=output_mean, metrics={"m": metric})
    kwargs = dict(loss=output_mean, optimizer=SGD, key=jax.random.key(1), progress=False)
    with pytest.raises(error, match=message) as e:
        eqfit.fit(model, (x, y), metrics={"m": metric}, batch_size=BATCH, **kwargs)
    assert not hasattr(e.value, "result")  # refused before the run, nothing trained


def test_statistics_that_add_give_the_metric_of_the_whole_data(classified):
    x, y, model = classified
    got = eqfit.evaluate(model, (x, y), loss=output_mean, batch_size=BATCH,
                         metrics={"m": Counted("array")})  # fmt: skip
    np.testing.assert_allclose(got["m"], np.mean(np.asarray(hits(model, x, y))), rtol=1e-6)


# metrax's default mapping: shapes that broadcast, logits where probabilities are meant.


@pytest.fixture(scope="module")
def binary(xy):
    x, _ = xy
    rng = np.random.default_rng(5)
    y = (x[:, 0] + rng.normal(size=N) > 0).astype(np.float32)
    return x, y


def logistic(model, x, y):
    return jnp.mean(optax.sigmoid_binary_cross_entropy(jax.vmap(model)(x), y))


def test_metrax_shapes_that_broadcast_are_refused(xy):
    x, y = xy
    model = eqfit.models.MLP(FEATURES, 1, 8, 1, key=jax.random.key(6))  # outputs (n, 1)

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)

    # Before: (n, 1) against (n,) was a (n, n) of every pair: 14.58 for 0.41.
    message = (
        r"`Metrax\(MSE\)`: its `predictions` have shape \(16, 1\) and its `labels` \(16,\) "
        r"\(by default, the model's outputs and `y`\): metrax would broadcast them into "
        r"\(16, 16\)"
    )
    with pytest.raises(ValueError, match=message):
        eqfit.evaluate(model, xy, loss=loss, metrics={"mse": metrax.MSE}, batch_size=BATCH)
    kwargs = dict(loss=loss, optimizer=SGD, key=jax.random.key(1), progress=False)
    with pytest.raises(ValueError, match=message):
        eqfit.fit(model, xy, metrics={"mse": metrax.MSE}, batch_size=BATCH, **kwargs)
    squeezed = eqfit.metrics.Metrax(
        metrax.MSE, lambda out, y: {"predictions": out[:, 0], "labels": y}
    )
    got = eqfit.evaluate(model, xy, loss=loss, metrics={"mse": squeezed}, batch_size=BATCH)
    by_hand = np.mean((np.asarray(jax.vmap(model)(x))[:, 0] - y) ** 2)
    np.testing.assert_allclose(got["mse"], by_hand, rtol=1e-5)


@pytest.mark.slow
def test_metrax_metrics_of_probabilities_refuse_logits(binary, model):
    x, y = binary
    # Before: `metrax.AUCROC` given logits gave 0.247 for 0.281, without a word.
    for metric in ("AUCROC", "Precision"):
        message = (
            rf"`Metrax\({metric}\)`: prediction -?[\d.]+ \(at \(\d+,\) of a batch\) is outside "
            rf"\[0, 1\]: `Metrax\({metric}\)` takes probabilities .* jax\.nn\.sigmoid"
        )
        metrics = {"m": getattr(metrax, metric)}
        with pytest.raises(ValueError, match=message):
            eqfit.evaluate(model, binary, loss=logistic, metrics=metrics, batch_size=BATCH)
        kwargs = dict(loss=logistic, optimizer=SGD, key=jax.random.key(1), progress=False)
        with pytest.raises(ValueError, match=message + r".* \(Found at step \d+ of the run"):
            eqfit.fit(model, binary, metrics=metrics, batch_size=BATCH, **kwargs)
    probabilities = eqfit.metrics.Metrax(
        metrax.AUCROC, lambda out, y: {"predictions": jax.nn.sigmoid(out), "labels": y}
    )
    got = eqfit.evaluate(model, binary, loss=logistic, metrics={"auc": probabilities})
    p = jax.nn.sigmoid(jax.vmap(model)(x))
    whole = metrax.AUCROC.from_model_output(predictions=p, labels=jnp.asarray(y)).compute()
    np.testing.assert_allclose(got["auc"], whole, rtol=1e-5)
