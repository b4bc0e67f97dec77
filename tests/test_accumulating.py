"""Metrics that accumulate (`eqfit.metrics.AbstractMetric`, metrax's taken as they are):
an epoch's (a validation set's, `evaluate`'s) value is the metric of all its outputs at
once, not a mean of per-batch values, wherever the run splits the data.

On scikit-learn's digits (1,797 images of 8x8, 10 classes). A learning rate of 0 keeps
the model fixed through an epoch, so that the epoch's outputs are one model's, which
scikit-learn then scores at once. The quick suite splits the data over devices and
microbatches; the heavy one also over a mesh, `PerStep`'s calls, ensemble members and a
resume, and checks `validation_every`, `log_every` and MLflow.
"""

import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import metrax
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits
from sklearn.metrics import (
    confusion_matrix,
    f1_score,
    precision_score,
    recall_score,
    roc_auc_score,
)

import eqfit
from eqfit.metrics import ConfusionMatrix, F1, Metrax, Precision, Recall


FIXED = optax.sgd(0.0)  # the model stays as it is: the epoch's outputs are one model's
ADAM = optax.adam(3e-3)


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int32)


def mlp(key=0, out=10):
    return eqx.nn.MLP(64, out, 32, 1, key=jax.random.key(key))


@pytest.fixture(scope="module")
def trained(digits):
    """A model trained for an epoch: good, not perfect, so that its scores say something."""
    x, y = digits
    return eqfit.fit(
        mlp(), (x, y), loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM, epochs=1,
        batch_size=32, key=jax.random.key(0),
    ).model  # fmt: skip


def metrics():
    return {
        "f1": F1(10, average="macro"),
        "precision": Precision(10, average="macro"),
        "recall": Recall(10, average="macro"),
        "f1_each": F1(10, average=None),
        "cm": ConfusionMatrix(10),
    }


def predicted(model, x):
    return np.asarray(jax.vmap(model)(jnp.asarray(x))).argmax(-1)


def assert_scores(values, y, pred, suffix=""):
    """`values` (by name, `metrics()`' names) equal scikit-learn's on `pred` at once."""
    for name, score in (("f1", f1_score), ("precision", precision_score), ("recall", recall_score)):
        expected = score(y, pred, average="macro", zero_division=0)
        np.testing.assert_allclose(values[name + suffix], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        values["f1_each" + suffix], f1_score(y, pred, average=None), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_array_equal(
        values["cm" + suffix], confusion_matrix(y, pred, labels=range(10))
    )


def epoch(history, i):
    return {name: np.asarray(v)[i] for name, v in history.values.items()}


@pytest.mark.slow
def test_an_epochs_values_are_the_metric_of_all_its_outputs_not_a_mean_of_batches(digits, trained):
    x, y = digits
    model = trained
    f1 = F1(10, average="macro")
    # The same arithmetic as a function of each batch: a mean of per-batch F1s.
    per_batch = lambda m, x, y: f1.compute(f1.statistics(m, x, y))  # noqa: E731
    result = eqfit.fit(
        model,
        (x, y),
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=FIXED,
        metrics={**metrics(), "batch_f1": per_batch},
        epochs=1,
        batch_size=64,
        key=jax.random.key(1),
    )
    history = result.history
    assert history["cm"].shape == (1, 10, 10)
    assert history["f1_each"].shape == (1, 10)
    assert_scores(epoch(history, 0), y, predicted(model, x))
    assert history["cm"][0].sum() == len(y)  # every example once: the smaller last batch too
    # Where the mean of per-batch F1s is not the F1: it must differ.
    assert abs(history["batch_f1"][0] - history["f1"][0]) > 0.01
    # Arrays stay out of the per-epoch lines and the logs shown; the history has them.
    assert set(history.values) == {"loss", *metrics(), "batch_f1"}


@pytest.mark.slow
def test_validation_and_evaluate_score_the_whole_set(digits):
    x, y = digits
    train, val = (x[:1200], y[:1200]), (x[1200:], y[1200:])
    kwargs = dict(loss=eqfit.losses.softmax_cross_entropy, metrics=metrics())
    result = eqfit.fit(
        mlp(), train, optimizer=ADAM, epochs=2, batch_size=50, validation_data=val,
        key=jax.random.key(2), **kwargs,
    )  # fmt: skip
    pred = predicted(result.model, val[0])
    values = result.history.values
    last = {k.removeprefix("val_"): v[-1] for k, v in values.items() if k.startswith("val_")}
    assert_scores(last, val[1], pred)
    for execution in ("auto", eqfit.PerStep(2)):
        found = eqfit.evaluate(result.model, val, batch_size=37, execution=execution, **kwargs)
        assert_scores(found, val[1], pred)
        assert found["cm"].shape == (10, 10)
        assert isinstance(found["f1"], float)


def fixed_run(digits, model, **options):
    x, y = digits
    return eqfit.fit(
        model,
        (x[:1024], y[:1024]),
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=FIXED,
        metrics=metrics(),
        validation_data=(x[1024:], y[1024:]),
        epochs=2,
        batch_size=64,
        key=jax.random.key(3),
        **options,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        dict(devices=8),
        pytest.param(dict(mesh="8"), marks=pytest.mark.heavy),
        dict(microbatches=4),
        pytest.param(dict(execution=eqfit.PerStep(3)), marks=pytest.mark.heavy),
        pytest.param(dict(devices=2, microbatches=2), marks=pytest.mark.heavy),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_statistics_are_summed_wherever_the_run_splits_the_data(digits, trained, options):
    """The statistics of each device's share, each microbatch, each call are summed: the
    values equal one device's, and scikit-learn's on the whole epoch."""
    if options.get("mesh") == "8":
        options = dict(mesh=jax.make_mesh((8,), ("batch",)))
    one = fixed_run(digits, trained, shuffle=False).history
    split = fixed_run(digits, trained, shuffle=False, **options).history
    x, y = digits
    pred = predicted(trained, x[:1024])
    for history in (one, split):
        assert_scores(epoch(history, 1), y[:1024], pred)
        val = {k.removeprefix("val_"): v[1] for k, v in history.values.items() if "val_" in k}
        assert_scores(val, y[1024:], predicted(trained, x[1024:]))


@pytest.mark.heavy
def test_ensemble_members_each_get_their_own_statistics(digits):
    x, y = digits
    data, val = (x[:600], y[:600]), (x[600:900], y[600:900])
    keys = jax.random.split(jax.random.key(4), 2)
    models = eqx.filter_vmap(lambda k: eqx.nn.MLP(64, 10, 16, 1, key=k))(keys)
    kwargs = dict(
        loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM, metrics=metrics(), epochs=2,
        batch_size=50, validation_data=val,
    )  # fmt: skip
    many = eqfit.fit(models, data, key=jax.random.key(5), ensemble=True, **kwargs).history
    assert many["cm"].shape == (2, 10, 10, 2)  # epochs, the matrix, members last
    for i, k in enumerate(jax.random.split(jax.random.key(5), 2)):
        member = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, models)
        alone = eqfit.fit(member, data, key=k, **kwargs).history
        for name in metrics():
            for prefix in ("", "val_"):
                np.testing.assert_allclose(
                    many[prefix + name][..., i], alone[prefix + name], rtol=1e-6, atol=1e-6
                )


@pytest.mark.heavy
def test_a_resume_inside_an_epoch_continues_its_statistics_bit_for_bit(digits, tmp_path):
    x, y = digits
    kwargs = dict(
        loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM, metrics=metrics(), epochs=2,
        batch_size=100, key=jax.random.key(6), validation_data=(x[1500:], y[1500:]),
    )  # fmt: skip
    data = (x[:1500], y[:1500])  # 15 steps an epoch
    whole = eqfit.fit(mlp(), data, **kwargs)
    policy = eqfit.Checkpoint(tmp_path / "all", every_epochs=None, every_steps=5, keep=100)
    eqfit.fit(mlp(), data, checkpoint=policy, **kwargs)
    name = "ckpt-000001-000005"  # after step 20: inside the second epoch
    assert (tmp_path / "all" / name).is_dir()
    shutil.copytree(tmp_path / "all" / name, tmp_path / "alone" / name)
    again = eqfit.Checkpoint(tmp_path / "alone", every_epochs=None, every_steps=5)
    resumed = eqfit.fit(mlp(), data, checkpoint=again, **kwargs)
    for name, value in whole.history.values.items():
        np.testing.assert_array_equal(value, resumed.history[name], err_msg=name)


@pytest.fixture(scope="module")
def binary(digits):
    x, y = digits
    return x, (y >= 5).astype(np.int32)


@pytest.mark.slow
def test_metrax_metrics_are_taken_as_they_are(binary):
    x, y = binary
    model = eqx.nn.MLP(64, "scalar", 32, 1, key=jax.random.key(7))
    probabilities = lambda logits, y: {"predictions": jax.nn.sigmoid(logits), "labels": y}  # noqa: E731
    given = {
        "auc": Metrax(metrax.AUCROC, probabilities, num_thresholds=2000),
        "precision": Metrax(metrax.Precision, probabilities),
        "recall": Metrax(metrax.Recall, probabilities),
        "f1": F1(),  # eqfit's: metrax's F-beta does not merge
    }
    train, val = (x[:1200], y[:1200]), (x[1200:], y[1200:])
    result = eqfit.fit(
        model, train, loss=eqfit.losses.binary_cross_entropy, optimizer=ADAM, metrics=given,
        epochs=2, batch_size=64, validation_data=val, key=jax.random.key(8),
    )  # fmt: skip
    logits = np.asarray(jax.vmap(result.model)(jnp.asarray(val[0])))
    p = 1 / (1 + np.exp(-logits))
    h = result.history
    # Thresholds 1/2000 apart: the trapezoids' AUC is within that of the exact one.
    np.testing.assert_allclose(h["val_auc"][-1], roc_auc_score(val[1], p), atol=2e-3)
    np.testing.assert_allclose(h["val_precision"][-1], precision_score(val[1], p >= 0.5), rtol=1e-6)
    np.testing.assert_allclose(h["val_recall"][-1], recall_score(val[1], p >= 0.5), rtol=1e-6)
    np.testing.assert_allclose(h["val_f1"][-1], f1_score(val[1], logits > 0), rtol=1e-6)
    # A metrax class given itself: predictions are the model's outputs (here probabilities).
    prob_model = eqx.nn.MLP(
        64, "scalar", 32, 1, final_activation=jax.nn.sigmoid, key=jax.random.key(9)
    )
    found = eqfit.evaluate(
        prob_model,
        val,
        loss=lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2),
        metrics={"auc": metrax.AUCROC},
        batch_size=50,
    )
    p = np.asarray(jax.vmap(prob_model)(jnp.asarray(val[0])))
    np.testing.assert_allclose(found["auc"], roc_auc_score(val[1], p), atol=1e-2)


@pytest.mark.slow
def test_early_stopping_monitors_a_scalar_one_and_refuses_an_array(digits):
    x, y = digits
    kwargs = dict(
        loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM, metrics=metrics(), epochs=3,
        batch_size=100, validation_data=(x[1500:], y[1500:]), key=jax.random.key(10),
    )  # fmt: skip
    result = eqfit.fit(
        mlp(), (x[:1500], y[:1500]), early_stopping=eqfit.EarlyStopping(monitor="val_f1"), **kwargs
    )
    f1 = result.history["val_f1"]
    assert result.history.best_epoch == int(np.argmax(f1)) + 1  # larger is better
    with pytest.raises(ValueError, match="val_cm"):
        eqfit.fit(
            mlp(),
            (x[:1500], y[:1500]),
            early_stopping=eqfit.EarlyStopping(monitor="val_cm"),
            **kwargs,
        )


def test_wrong_metrics_are_refused_naming_them(digits):
    x, y = digits
    with pytest.raises(ValueError, match="`classes` is 3"):
        eqfit.evaluate(
            mlp(), (x, y), loss=eqfit.losses.softmax_cross_entropy,
            metrics={"cm": ConfusionMatrix(3)},
        )  # fmt: skip
    with pytest.raises(ValueError, match="average='binary'"):
        F1(10)
    bad = y.copy()
    bad[7] = 12

    def loss(model, x, y):  # checks no label: the metric does
        return jnp.mean(jax.vmap(model)(x) ** 2)

    with pytest.raises(ValueError, match="ConfusionMatrix.*label 12"):
        eqfit.evaluate(mlp(), (x, bad), loss=loss, metrics={"cm": ConfusionMatrix(10)})


def test_a_history_with_arrays_saves_loads_and_writes_its_csv(digits, tmp_path):
    x, y = digits
    result = eqfit.fit(
        mlp(), (x[:500], y[:500]), loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM,
        metrics={"cm": ConfusionMatrix(10), "f1": F1(10, average="macro")}, epochs=2,
        batch_size=100, key=jax.random.key(11),
    )  # fmt: skip
    eqfit.save(tmp_path / "run.eqx", result)
    loaded = eqfit.load(tmp_path / "run.eqx", like=result)
    np.testing.assert_array_equal(loaded.history["cm"], result.history["cm"])
    result.history.to_csv(tmp_path / "h.csv")
    header = (tmp_path / "h.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["epoch", "loss", "cm/0/0"] and "cm/9/9" in header and "f1" in header


class TopKRecall(eqfit.metrics.AbstractMetric):
    """The validation guide's: of the examples of `label`, those whose label is among
    the top k, as statistics in a dict.
    """

    k: int
    label: int

    def statistics(self, model, x, y):
        top = jax.lax.top_k(jax.vmap(model)(x), self.k)[1]
        hit = jnp.any(top == y[:, None], axis=-1) & (y == self.label)
        return {"hits": jnp.sum(hit), "count": jnp.sum(y == self.label)}

    def compute(self, s):
        return s["hits"] / s["count"]


def test_a_metric_of_ones_own_accumulates_its_statistics(digits, trained):
    x, y = digits
    found = eqfit.evaluate(
        trained, (x, y), loss=eqfit.losses.softmax_cross_entropy,
        metrics={"top2_recall_3": TopKRecall(2, 3)}, batch_size=64,
    )  # fmt: skip
    top = np.argsort(-np.asarray(jax.vmap(trained)(jnp.asarray(x))), axis=-1)[:, :2]
    threes = y == 3
    expected = np.mean((top[threes] == 3).any(axis=-1))
    np.testing.assert_allclose(found["top2_recall_3"], expected, rtol=1e-6)


@pytest.mark.heavy
def test_validation_every_n_steps_and_log_every_take_them_too(digits, tmp_path):
    x, y = digits
    logger = eqfit.callbacks.CSVLogger(tmp_path / "log.csv")
    result = eqfit.fit(
        mlp(), (x[:1500], y[:1500]), loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM,
        metrics=metrics(), epochs=2, batch_size=50, validation_data=(x[1500:], y[1500:]),
        validation_every=10, log_every=10, key=jax.random.key(12), callbacks=[logger],
    )  # fmt: skip
    h = result.history
    assert h.validations["val_cm"].shape == (6, 10, 10)
    assert h.validations["val_cm"][-1].sum() == len(y) - 1500
    last = {k.removeprefix("val_"): v[-1] for k, v in h.validations.items()}
    assert_scores(last, y[1500:], predicted(result.model, x[1500:]))
    # The loggers get an array's entries as scalars, `cm/row/column`.
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert "cm/3/5" in header and "val_cm/9/9" in header and "f1" in header


def test_top_k_accuracy_counts_the_whole_set(digits, trained):
    x, y = digits
    weights = (np.arange(len(y)) % 3).astype(np.float32)  # 0, 1, 2, 0, ...
    found = eqfit.evaluate(
        trained, (x, y, weights), loss=eqfit.losses.softmax_cross_entropy,
        metrics={"top3": eqfit.metrics.TopKAccuracy(3), "top1": eqfit.metrics.TopKAccuracy(1),
                 "accuracy": eqfit.metrics.accuracy},
        batch_size=64,
    )  # fmt: skip
    top = np.argsort(-np.asarray(jax.vmap(trained)(jnp.asarray(x))), axis=-1)
    hit3 = (top[:, :3] == y[:, None]).any(axis=-1)
    np.testing.assert_allclose(found["top3"], np.sum(weights * hit3) / np.sum(weights), rtol=1e-6)
    np.testing.assert_allclose(found["top1"], found["accuracy"], rtol=1e-6)


@pytest.mark.heavy
def test_mlflow_gets_an_arrays_entries_as_scalars(digits, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # nothing reaches the network
    store = (tmp_path / "mlruns").as_uri()
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=store)
    x, y = digits
    result = eqfit.fit(
        mlp(), (x[:500], y[:500]), loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM,
        metrics={"cm": ConfusionMatrix(10)}, epochs=2, batch_size=100,
        key=jax.random.key(13), callbacks=[logger],
    )  # fmt: skip
    client = mlflow.MlflowClient(store)
    logged = client.get_run(logger.run_id).data.metrics
    assert {"cm/0/0", "cm/9/9", "cm/3/5"} <= set(logged) and "cm" not in logged
    history = sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, "cm/3/5"))
    assert [v for _, v in history] == result.history["cm"][:, 3, 5].tolist()


def test_a_metrax_metric_whose_merge_is_not_a_sum_is_refused(binary):
    from clu import metrics as clu_metrics

    x, y = binary
    model = eqx.nn.MLP(64, "scalar", 8, 1, key=jax.random.key(14))

    def loss(m, x, y):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    last = Metrax(clu_metrics.LastValue, lambda out, y: {"value": jnp.mean(out)})
    with pytest.raises(ValueError, match="'last': LastValue.merge does not add"):
        eqfit.evaluate(model, (x, y), loss=loss, metrics={"last": last})
