"""`log_every=n`: the callbacks and the loggers get the training values of every n steps
as training goes, each the n steps' values reduced as an epoch's are, at the step's
global number; on every way of running, and equal to the history's steps.
"""

import csv

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import Recorder
from jax.sharding import AxisType, Mesh
from test_steps import read_tensorboard

import eqfit


N, BATCH, EVERY = 100, 16, 5  # 7 steps an epoch, the last of 4 rows: windows cross epochs


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    return x, (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def mae(model, x, y):
    return abs(jax.vmap(model)(x) - y).mean()


def kwargs(**more):
    return (
        dict(
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-2),
            key=jax.random.key(2),
            epochs=3,
            batch_size=BATCH,
            metrics={"mae": mae},
            log_every=EVERY,
        )
        | more
    )


def expected_logs(history, every=EVERY, member=None):
    """Each n-th step's values from the history's steps: means weighted by batch size."""
    pick = (lambda a: a) if member is None else (lambda a: a[..., member])
    loss = pick(history.step_loss).reshape(-1)
    sizes = pick(history.batch_sizes).reshape(-1).astype(np.float64)
    metric = pick(history.step_values["mae"]).reshape(-1)
    out = []
    for end in range(every, len(loss) + 1, every):
        window = slice(end - every, end)
        weights = sizes[window] / sizes[window].sum()
        out.append((end, {"loss": weights @ loss[window], "mae": weights @ metric[window]}))
    return out


def assert_logs(got, expected):
    assert [step for step, _ in got] == [step for step, _ in expected]
    for (_, logs), (_, want) in zip(got, expected):
        assert set(logs) == set(want)
        for name in want:
            np.testing.assert_allclose(logs[name], want[name], rtol=1e-5)


def mesh():
    return Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,))


WAYS = {
    "whole run": {},
    "bar": dict(progress=True),
    "per step": dict(execution=eqfit.PerStep(2)),
    "devices": dict(devices=4),
    "mesh": {},  # made in the test
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "way",
    [pytest.param(w, marks=pytest.mark.heavy) if w in ("devices", "mesh") else w for w in WAYS],
)
def test_the_callbacks_get_every_n_steps_values(way, data, capsys):
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    recorder = Recorder()
    more = WAYS[way] | ({"mesh": mesh()} if way == "mesh" else {})
    result = eqfit.fit(model, data, callbacks=[recorder], **kwargs(**more))
    # 21 steps: the 5th, 10th, 15th and 20th; a window of a remainder batch counts its rows.
    assert_logs(recorder.steps(), expected_logs(result.history))
    assert [s for s, _ in recorder.steps()] == [5, 10, 15, 20]
    # In order: each n-th step before the epoch that holds it ends.
    order = [(kind, n) for kind, n, _ in recorder.told]
    assert order == [
        ("step", 5),
        ("epoch", 1),
        ("step", 10),
        ("epoch", 2),
        ("step", 15),
        ("step", 20),
        ("epoch", 3),
    ]
    capsys.readouterr()


def test_the_values_are_the_same_however_the_run_is_cut(data, capsys):
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    told = []
    for extra in ({}, dict(progress=True)):
        recorder = Recorder()
        eqfit.fit(model, data, callbacks=[recorder], **kwargs(**extra))
        told.append(recorder.steps())
    assert told[0] == told[1]  # bit for bit: the same record, reduced by the same program
    capsys.readouterr()


@pytest.mark.slow
def test_an_ensemble_logs_its_members_mean(data):
    keys = jax.random.split(jax.random.key(1), 3)
    stack = eqx.filter_vmap(lambda k: eqfit.models.MLP(3, "scalar", 8, 1, key=k))(keys)
    recorder = Recorder()
    result = eqfit.fit(stack, data, ensemble=True, callbacks=[recorder], **kwargs())
    members = [expected_logs(result.history, member=m) for m in range(3)]
    mean = [
        (step, {name: np.mean([m[i][1][name] for m in members]) for name in ("loss", "mae")})
        for i, (step, _) in enumerate(members[0])
    ]
    assert_logs(recorder.steps(), mean)


def test_a_run_of_one_long_epoch_logs_a_curve(data, tmp_path):
    # An endless loader with `steps_per_epoch`: one epoch of 40 steps, logged every 10.
    x, y = data

    def batches():
        while True:
            for i in range(0, N - BATCH + 1, BATCH):
                yield x[i : i + BATCH], y[i : i + BATCH]

    logger = eqfit.callbacks.CSVLogger(tmp_path / "log.csv")
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    result = eqfit.fit(
        model, batches(), callbacks=[logger], **kwargs(epochs=1, steps_per_epoch=40, log_every=10)
    )
    with open(tmp_path / "log.steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40]
    expected = expected_logs(result.history, every=10)
    np.testing.assert_allclose(
        [float(r["loss"]) for r in rows], [e["loss"] for _, e in expected], rtol=1e-5
    )
    with open(tmp_path / "log.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1]


def test_tensorboard_writes_each_n_steps_at_its_global_step(data, tmp_path):
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    board = eqfit.callbacks.TensorBoard(tmp_path / "tb")
    result = eqfit.fit(model, data, callbacks=[board], **kwargs())
    scalars = read_tensorboard(tmp_path / "tb")
    expected = expected_logs(result.history)
    assert [step for step, _ in scalars["step/loss"]] == [5, 10, 15, 20]
    np.testing.assert_allclose(
        [v for _, v in scalars["step/mae"]], [e["mae"] for _, e in expected], rtol=1e-5
    )
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3]  # the epochs as before


def test_mlflow_logs_each_n_steps_at_its_global_step(data, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    store = (tmp_path / "mlruns").as_uri()
    logger = eqfit.callbacks.MLflowLogger(experiment_name="steps", tracking_uri=store)
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    result = eqfit.fit(model, data, callbacks=[logger], **kwargs())
    client = mlflow.MlflowClient(store)
    history = client.get_metric_history(logger.run_id, "step/loss")
    expected = expected_logs(result.history)
    assert [m.step for m in history] == [5, 10, 15, 20]
    np.testing.assert_allclose(
        [m.value for m in history], [e["loss"] for _, e in expected], rtol=1e-5
    )
    assert [m.step for m in client.get_metric_history(logger.run_id, "loss")] == [1, 2, 3]


def test_log_every_is_checked(data):
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    for bad in (0, -3, 2.5):
        with pytest.raises((ValueError, TypeError), match=r"`log_every`"):
            eqfit.fit(model, data, **kwargs(log_every=bad))
    x, y = data

    class Unsized:
        def __iter__(self):
            for i in range(0, N, BATCH):
                yield x[i : i + BATCH], y[i : i + BATCH]

    with pytest.raises(ValueError, match=r"`log_every=5` with a loader that does not say"):
        eqfit.fit(model, Unsized(), **kwargs())


@pytest.mark.slow
@pytest.mark.parametrize("way", ["per step on devices", "streamed validation"])
def test_the_host_made_epoch_ends_report_the_same_values(way, data):
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    x, y = data
    val = (x[:40], y[:40])

    class Loader:
        def __iter__(self):
            for i in range(0, 40, BATCH):
                yield x[i : i + BATCH], y[i : i + BATCH]

    if way == "per step on devices":
        more = dict(execution=eqfit.PerStep(2), devices=4)
        streamed = more
    else:
        more, streamed = dict(validation_data=val), dict(validation_data=Loader())
    told = []
    for extra in (more, streamed):
        recorder = Recorder()
        result = eqfit.fit(model, data, callbacks=[recorder], **kwargs(**extra))
        assert_logs(recorder.steps(), expected_logs(result.history))
        told.append(recorder.steps())
    assert [s for s, _ in told[0]] == [s for s, _ in told[1]] == [5, 10, 15, 20]


@pytest.mark.slow
def test_a_callback_that_never_stops_training_does_not_cut_the_run_at_epoch_ends(data):
    """A callback that never stops training and takes no model is told of every epoch and
    n-th step a call reached once the call is read, as the history is: the run is not cut
    into a call an epoch, each a dispatch and a report. The loss counts the steps the
    device ran (a host callback, which XLA's CPU client runs inside the call): epochs told
    at one count were ended by one call. Epochs of one step each, so that none is long
    enough to get a call of its own (about 50 ms), however busy the machine.
    """
    ran = []

    def loss(model, x, y):
        jax.debug.callback(lambda: ran.append(None))
        return eqfit.losses.mse(model, x, y)

    class Counts:
        stops_training = False

        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, step, logs):
            self.seen.append(("step", len(ran)))

        def on_epoch_end(self, epoch, logs):
            self.seen.append(("epoch", len(ran)))

    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(0))
    counts = Counts()
    more = dict(loss=loss, epochs=40, batch_size=N, log_every=2)
    eqfit.fit(model, data, callbacks=[counts], **kwargs(**more))
    epochs = [n for kind, n in counts.seen if kind == "epoch"]
    steps = [n for kind, n in counts.seen if kind == "step"]
    assert len(epochs) == 40 and len(steps) == 20
    # One call an epoch: each epoch told at its own count. In calls of several epochs,
    # several epochs (and their n-th steps) are told at one.
    assert len(set(epochs)) < len(epochs), epochs
    assert len(set(steps)) < len(steps), steps
