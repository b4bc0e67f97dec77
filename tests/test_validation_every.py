"""`validation_every=n`: validation after every n-th step, counted across epochs, inside
the compiled run; each validation equal to `eqfit.evaluate` of that step's model, in the
history at its step, told to the callbacks and the loggers at its step, and judged by
early stopping and `keep_best`; the same on every way of running.
"""

import csv
import json

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import Recorder
from jax.sharding import AxisType, Mesh
from test_steps import read_tensorboard

import eqfit


N, VAL, BATCH, EVERY = 100, 37, 16, 5  # 7 steps an epoch: validations cross epochs


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    rng = np.random.default_rng(11)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    xv = rng.normal(size=(VAL, 3)).astype(np.float32)
    y, yv = np.sin(x @ w).astype(np.float32), np.sin(xv @ w).astype(np.float32)
    folder = tmp_path_factory.mktemp("every")
    np.save(folder / "xv.npy", xv)
    np.save(folder / "yv.npy", yv)
    memmaps = tuple(np.load(folder / f"{n}.npy", mmap_mode="r") for n in ("xv", "yv"))
    return (x, y), (xv, yv), memmaps


class Loader:
    """A re-iterable loader of the validation set, in order."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return -(-len(self.data[0]) // BATCH)

    def __iter__(self):
        for i in range(0, len(self.data[0]), BATCH):
            yield tuple(a[i : i + BATCH] for a in self.data)


def mae(model, x, y):
    return abs(jax.vmap(model)(x) - y).mean()


def model_of(key=0):
    return eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(key))


def kwargs(**more):
    return (
        dict(
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-2),
            key=jax.random.key(2),
            epochs=3,
            batch_size=BATCH,
            metrics={"mae": mae},
            validation_every=EVERY,
        )
        | more
    )


@pytest.mark.slow
def test_each_validation_equals_evaluate_of_that_steps_model(problem):
    train, val, _ = problem
    result = eqfit.fit(model_of(), train, validation_data=val, **kwargs())
    history = result.history
    # 21 steps: validations after the 5th, 10th, 15th and 20th, across epochs' ends.
    np.testing.assert_array_equal(history.validation_steps, [5, 10, 15, 20])
    assert set(history.validations) == {"val_loss", "val_mae"}
    for i, k in enumerate(history.validation_steps.tolist()):
        # The same first k steps: one epoch of k steps (the shuffle is keyed by the pass).
        upto = eqfit.fit(
            model_of(), train, **kwargs(epochs=1, steps_per_epoch=k, validation_every=None)
        )
        expected = eqfit.evaluate(
            upto.model, val, loss=eqfit.losses.mse, metrics={"mae": mae}, batch_size=BATCH
        )
        np.testing.assert_allclose(history.validations["val_loss"][i], expected["loss"], rtol=1e-6)
        np.testing.assert_allclose(history.validations["val_mae"][i], expected["mae"], rtol=1e-6)
    # An epoch's validation values are its last validation's (epoch 1: steps 1-7, the 5th).
    np.testing.assert_array_equal(history.val_loss, history.validations["val_loss"][[0, 1, 3]])


def test_an_epoch_without_a_validation_has_nan(problem):
    train, val, _ = problem
    history = eqfit.fit(
        model_of(), train, validation_data=val, **kwargs(validation_every=10)
    ).history
    np.testing.assert_array_equal(history.validation_steps, [10, 20])
    assert np.isnan(history.val_loss[0])  # steps 1-7: none
    np.testing.assert_array_equal(history.val_loss[1:], history.validations["val_loss"])


def mesh():
    return Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,))


WAYS = {
    "bar": dict(progress=True),
    "per step": dict(execution=eqfit.PerStep(2)),
    "devices": dict(devices=4),
    "per step on devices": dict(devices=4, execution=eqfit.PerStep(3)),
    "mesh": {},  # made in the test
    "memmaps": {},
    "loader": {},
    "loader per step": dict(execution=eqfit.PerStep(2)),
}


# Several devices with the heavy tests: the README's command runs one device's ways
# (and a loader's with the whole run's program only).
HEAVY = ("devices", "per step on devices", "mesh", "loader per step")


@pytest.mark.slow
@pytest.mark.parametrize(
    "way", [pytest.param(w, marks=pytest.mark.heavy) if w in HEAVY else w for w in WAYS]
)
def test_every_way_of_running_validates_the_same(way, problem):
    train, val, memmaps = problem
    more = dict(WAYS[way])
    if way == "mesh":
        more["mesh"] = mesh()
    given = {"memmaps": memmaps, "loader": Loader(val), "loader per step": Loader(val)}
    whole = eqfit.fit(model_of(), train, validation_data=val, **kwargs())
    recorder = Recorder()
    other = eqfit.fit(
        model_of(),
        train,
        validation_data=given.get(way, val),
        callbacks=[recorder],
        **kwargs(**more),
    )
    exact = way in ("bar", "memmaps", "loader")  # the same program, or the same sums
    close = dict(rtol=0, atol=0) if exact else dict(rtol=2e-5, atol=1e-7)
    np.testing.assert_array_equal(other.history.validation_steps, whole.history.validation_steps)
    for name, values in whole.history.validations.items():
        np.testing.assert_allclose(other.history.validations[name], values, **close)
    told = [(step, logs["val_loss"]) for kind, step, logs in recorder.told if kind == "validation"]
    assert [s for s, _ in told] == [5, 10, 15, 20]
    np.testing.assert_allclose(
        [v for _, v in told], other.history.validations["val_loss"], rtol=1e-6
    )


@pytest.mark.heavy  # a member's run each besides the ensemble's
def test_an_ensemble_validates_each_member(problem):
    train, val, _ = problem
    keys = jax.random.split(jax.random.key(1), 3)
    stack = eqx.filter_vmap(lambda k: eqfit.models.MLP(3, "scalar", 8, 1, key=k))(keys)
    result = eqfit.fit(stack, train, validation_data=val, ensemble=True, **kwargs())
    assert result.history.validations["val_loss"].shape == (4, 3)
    for m in range(3):
        alone = eqfit.fit(
            eqfit.models.MLP(3, "scalar", 8, 1, key=keys[m]),
            train,
            validation_data=val,
            **kwargs(key=jax.random.split(jax.random.key(2), 3)[m]),
        )
        np.testing.assert_allclose(
            result.history.validations["val_loss"][:, m],
            alone.history.validations["val_loss"],
            rtol=2e-5,
        )


def test_the_callbacks_are_told_in_order(problem):
    train, val, _ = problem
    recorder = Recorder()
    eqfit.fit(model_of(), train, validation_data=val, callbacks=[recorder], **kwargs(log_every=5))
    order = [(kind, n) for kind, n, _ in recorder.told]
    # A step's training values, then its validation's; both before its epoch's end.
    assert order == [
        ("step", 5),
        ("validation", 5),
        ("epoch", 1),
        ("step", 10),
        ("validation", 10),
        ("epoch", 2),
        ("step", 15),
        ("validation", 15),
        ("step", 20),
        ("validation", 20),
        ("epoch", 3),
    ]


def logged_run(problem, logger):
    """A streamed run that validates every few steps, told to `logger`: its history."""
    train, val, _ = problem
    result = eqfit.fit(
        model_of(), Loader(train), validation_data=Loader(val), callbacks=[logger],
        **kwargs(batch_size=None),
    )  # fmt: skip
    return result.history


def test_the_csv_logger_writes_each_validation_at_its_step(problem, tmp_path):
    history = logged_run(problem, eqfit.callbacks.CSVLogger(tmp_path / "log.csv"))
    with open(tmp_path / "log.validations.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == history.validation_steps.tolist()
    np.testing.assert_allclose(
        [float(r["val_loss"]) for r in rows], history.validations["val_loss"], rtol=1e-6
    )


def test_tensorboard_writes_each_validation_at_its_step(problem, tmp_path):
    pytest.importorskip("tensorboardX")  # the extra `eqfit[tensorboard]`
    history = logged_run(problem, eqfit.callbacks.TensorBoard(tmp_path / "tb"))
    scalars = read_tensorboard(tmp_path / "tb")
    assert [s for s, _ in scalars["step/val_mae"]] == history.validation_steps.tolist()
    np.testing.assert_allclose(
        [v for _, v in scalars["step/val_mae"]], history.validations["val_mae"], rtol=1e-6
    )
    assert [s for s, _ in scalars["val_loss"]] == [1, 2, 3]  # the epochs' as before


def test_early_stopping_judges_each_validation(problem):
    train, val, _ = problem
    # A rate that overshoots, so the validation loss stops falling.
    stopping = eqfit.EarlyStopping(patience=2, monitor="val_loss")
    result = eqfit.fit(
        model_of(),
        train,
        validation_data=val,
        early_stopping=stopping,
        **kwargs(optimizer=optax.adam(0.1), epochs=20, validation_every=3),
    )
    history = result.history
    losses = history.validations["val_loss"]
    best = int(np.nanargmin(losses))
    # Patience counts validations: the run stops at the second after the best.
    assert history.stop_reason == "early_stopping"
    assert len(losses) == best + 3
    assert history.best_step == history.validation_steps[best]
    assert history.best_epoch == (history.best_step - 1) // 7 + 1
    # The model returned is the best validation's.
    again = eqfit.evaluate(result.model, val, loss=eqfit.losses.mse, batch_size=BATCH)
    np.testing.assert_allclose(again["loss"], losses[best], rtol=1e-6)


def test_keep_best_keeps_the_best_validation(problem, tmp_path):
    train, val, _ = problem
    policy = eqfit.Checkpoint(tmp_path, keep=1, keep_best="val_loss")
    result = eqfit.fit(
        model_of(),
        train,
        validation_data=val,
        checkpoint=policy,
        **kwargs(optimizer=optax.adam(0.1), epochs=4, validation_every=3),
    )
    history = result.history
    best = int(np.nanargmin(history.validations["val_loss"]))
    step = int(history.validation_steps[best])
    name = f"ckpt-{step // 7:06d}-{step % 7:06d}"
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    expected = float(history.validations["val_loss"][best])
    assert manifest["monitor"] == {"name": "val_loss", "value": expected}


@pytest.mark.slow
def test_a_resumed_run_validates_as_one_never_stopped(problem, tmp_path):
    train, val, _ = problem
    whole = eqfit.fit(model_of(), train, validation_data=val, **kwargs())

    class StopAfterFirst:
        def on_epoch_end(self, epoch, logs):
            return epoch == 1

    policy = eqfit.Checkpoint(tmp_path, every_epochs=None, every_steps=4, keep=10)
    first = eqfit.fit(
        model_of(), train, validation_data=val, checkpoint=policy, callbacks=[StopAfterFirst()],
        **kwargs(),
    )  # fmt: skip
    assert first.history.stop_reason == "callback"
    resumed = eqfit.fit(model_of(), train, validation_data=val, checkpoint=policy, **kwargs())
    np.testing.assert_array_equal(resumed.history.validation_steps, [5, 10, 15, 20])
    for name, values in whole.history.validations.items():
        np.testing.assert_array_equal(resumed.history.validations[name], values)


def test_validation_every_is_checked(problem):
    train, val, _ = problem
    model = model_of()
    for bad in (0, -3, 2.5):
        with pytest.raises((ValueError, TypeError), match=r"`validation_every`"):
            eqfit.fit(model, train, validation_data=val, **kwargs(validation_every=bad))
    with pytest.raises(ValueError, match=r"validates nothing"):
        eqfit.fit(model, train, **kwargs())
    with pytest.raises(ValueError, match=r"not both"):
        eqfit.fit(model, train, validation_data=val, **kwargs(validation_freq=2))

    def generator():
        yield val

    with pytest.raises(ValueError, match=r"after every 5-th step"):
        eqfit.fit(model, train, validation_data=generator(), **kwargs())

    class Unsized:
        def __iter__(self):
            for i in range(0, N, BATCH):
                yield train[0][i : i + BATCH], train[1][i : i + BATCH]

    with pytest.raises(ValueError, match=r"`validation_every=5` with a loader that does not"):
        eqfit.fit(model, Unsized(), validation_data=val, **kwargs(batch_size=None))
    # With `steps_per_epoch` it is known: an endless loader validated every n steps.
    history = eqfit.fit(
        model, Unsized(), validation_data=val, **kwargs(batch_size=None, steps_per_epoch=7)
    ).history
    np.testing.assert_array_equal(history.validation_steps, [5, 10, 15, 20])


def test_a_plan_counts_the_validations(problem):
    train, val, _ = problem
    plan = eqfit.plan(model_of(), train, validation_data=val, **kwargs())
    assert plan.validations == 4


def test_a_log_shows_each_validation_before_its_epoch(problem, capsys):
    train, val, _ = problem
    result = eqfit.fit(model_of(), train, validation_data=val, progress="lines", **kwargs())
    lines = capsys.readouterr().err.splitlines()
    shown = [line.split(":")[0] for line in lines if line.startswith(("step", "epoch"))]
    assert shown == [
        "step 5",
        "epoch 1/3",
        "step 10",
        "epoch 2/3",
        "step 15",
        "step 20",
        "epoch 3/3",
    ]
    first = result.history.validations["val_loss"][0]
    assert any(line.startswith(f"step 5: val_loss={first:.4g} ") for line in lines)


@pytest.mark.slow
def test_mlflow_logs_each_validation_at_its_step(problem, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    train, val, _ = problem
    store = (tmp_path / "mlruns").as_uri()
    logger = eqfit.callbacks.MLflowLogger(experiment_name="validations", tracking_uri=store)
    result = eqfit.fit(model_of(), train, validation_data=val, callbacks=[logger], **kwargs())
    client = mlflow.MlflowClient(store)
    logged = client.get_metric_history(logger.run_id, "step/val_loss")
    history = result.history
    assert [m.step for m in logged] == history.validation_steps.tolist()
    np.testing.assert_allclose(
        [m.value for m in logged], history.validations["val_loss"], rtol=1e-6
    )
