"""The W&B and MLflow loggers: what they logged, read back through each library's own
reader (MLflow's client, wandb's reader of an offline run's file), equals the history, and
the run ends however training does.
"""

import json
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import eqfit


SGD = optax.sgd(0.05)  # one object for the module: fits share their compiled programs


@pytest.fixture(scope="module")
def problem():
    keys = jax.random.split(jax.random.key(0), 4)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    x = np.asarray(jax.random.normal(keys[0], (64, 3)))
    x_val = np.asarray(jax.random.normal(keys[1], (16, 3)))
    model = eqfit.models.LinearRegression(3, key=keys[2])

    def fit(callbacks, **kwargs):
        return eqfit.fit(
            model,
            (x, x @ w),
            validation_data=(x_val, x_val @ w),
            loss=eqfit.losses.mse,
            metrics={"mae": eqfit.metrics.mae},
            key=keys[3],
            batch_size=16,
            callbacks=callbacks,
            **({"epochs": 3, "optimizer": SGD} | kwargs),
        )

    return fit


def logged_values(result):
    """Each epoch's values as callbacks saw them: the history's values and throughput."""
    history = result.history
    return {name: list(values) for name, values in (history.values | history.throughput).items()}


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local file store (MLflow refuses one unless allowed: a database backend needs
    SQLAlchemy, which `mlflow-skinny` leaves out).
    """
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # nothing reaches the network
    return (tmp_path / "mlruns").as_uri()


@pytest.mark.parametrize("scheme", ["sqlite", "file"])
def test_mlflow_logger_names_a_tracking_uri_under_a_file(tmp_path, monkeypatch, scheme):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    (tmp_path / "notes").write_text("a file, not a folder")
    under = tmp_path / "notes" / "runs"
    uri = f"sqlite:///{under}/mlflow.db" if scheme == "sqlite" else under.as_uri()
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=uri)
    with pytest.raises(ValueError, match=r"`tracking_uri`.*'[^']*notes' is a file, not a folder"):
        logger.on_train_begin({})


def metric_history(client, run_id, name):
    """[(step, value)] of a metric, by step."""
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def test_mlflow_logger_logs_each_epoch_and_the_arguments(problem, mlflow_store):
    import mlflow

    logger = eqfit.callbacks.MLflowLogger(
        experiment_name="eqfit-test", run_name="linear", tracking_uri=mlflow_store
    )
    result = problem([logger])
    client = mlflow.MlflowClient(mlflow_store)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "linear"
    assert client.get_experiment(run.info.experiment_id).name == "eqfit-test"
    expected = logged_values(result)
    assert set(run.data.metrics) == set(expected)
    assert {"val_loss", "mae", "val_mae", "samples_per_second"} <= set(expected)
    for name, values in expected.items():
        assert metric_history(client, logger.run_id, name) == list(zip([1, 2, 3], values))
    params = run.data.params
    assert params["epochs"] == "3" and params["batch_size"] == "16"
    assert params["steps_per_epoch"] == "4" and params["metrics"] == "['mae']"
    assert params["validation"] == "True" and params["devices"] == "1"


def test_mlflow_logger_continues_a_run_and_logs_into_an_active_one(problem, mlflow_store):
    import mlflow

    client = mlflow.MlflowClient(mlflow_store)
    first = eqfit.callbacks.MLflowLogger(tracking_uri=mlflow_store)
    problem([first])
    # `run_id` continues the run: its params stay, the metrics add steps 4 to 6.
    again = eqfit.callbacks.MLflowLogger(run_id=first.run_id, tracking_uri=mlflow_store)
    result = problem([again], epochs=6, initial_epoch=3)
    assert client.get_run(first.run_id).info.status == "FINISHED"
    steps = [step for step, _ in metric_history(client, first.run_id, "loss")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert client.get_run(first.run_id).data.params["initial_epoch"] == "0"
    assert [v for _, v in metric_history(client, first.run_id, "loss")][3:] == list(
        result.history.loss
    )
    # A run the user started is logged into and left open.
    mlflow.set_tracking_uri(mlflow_store)
    try:
        with mlflow.start_run() as active:
            problem([eqfit.callbacks.MLflowLogger()])
            assert client.get_run(active.info.run_id).info.status == "RUNNING"
        run = client.get_run(active.info.run_id)
        assert run.info.status == "FINISHED" and run.data.params["epochs"] == "3"
        assert len(metric_history(client, active.info.run_id, "val_mae")) == 3
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.heavy
def test_mlflow_run_ends_however_training_ends(problem, mlflow_store):
    import mlflow

    client = mlflow.MlflowClient(mlflow_store)
    # Early stopping after epoch 2 (the loss falls, and "max" wants it to rise); `fit`
    # called while an error is handled still ends the run as FINISHED.
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=mlflow_store)
    stop = eqfit.EarlyStopping(0, monitor="loss", mode="max", restore_best=False)
    try:
        raise LookupError("handled before fit")
    except LookupError:
        result = problem([logger], early_stopping=stop)
    assert result.history.stop_reason == "early_stopping" and result.history.epochs == 2
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert len(metric_history(client, logger.run_id, "loss")) == 2

    class Stop:
        """Stops training at epoch 2, or raises there: Ctrl-C-like, or a user's error."""

        def __init__(self, error=None):
            self.error = error

        def on_epoch_end(self, epoch, logs):
            if epoch == 2 and self.error is not None:
                raise self.error
            return epoch == 2

    # A callback stops training.
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=mlflow_store)
    assert problem([logger, Stop()]).history.stop_reason == "callback"
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert len(metric_history(client, logger.run_id, "val_mae")) == 2
    # Ctrl-C: `fit` stops, with the result so far; the run has its 2 epochs, and was
    # killed.
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=mlflow_store)
    with pytest.raises(eqfit.TrainingInterrupted) as interrupted:
        problem([logger, Stop(KeyboardInterrupt())])
    assert interrupted.value.result.history.epochs == 2
    assert client.get_run(logger.run_id).info.status == "KILLED"
    assert len(metric_history(client, logger.run_id, "val_loss")) == 2
    # A non-finite loss (raised once the result is made): FAILED.
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=mlflow_store)
    with pytest.raises(eqfit.NonFiniteLossError):
        problem([logger], optimizer=optax.sgd(1e30))
    assert client.get_run(logger.run_id).info.status == "FAILED"
    # An error: the run is marked FAILED.
    logger = eqfit.callbacks.MLflowLogger(tracking_uri=mlflow_store)
    with pytest.raises(RuntimeError, match="the user's"):
        problem([logger, Stop(RuntimeError("the user's"))])
    assert client.get_run(logger.run_id).info.status == "FAILED"
    assert len(metric_history(client, logger.run_id, "loss")) == 2


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, in `tmp_path`: nothing reaches the network (its telemetry too is off
    once `WANDB_MODE` says offline), and its service is stopped afterwards.
    """
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    yield tmp_path
    wandb.teardown()


def wandb_records(run_dir):
    """The records of an offline run's `.wandb` file, by wandb's own reader."""
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.heavy
def test_wandb_logger_logs_each_epoch_and_the_arguments(problem, offline_wandb):
    logger = eqfit.callbacks.WandbLogger(
        project="eqfit-test", name="linear", dir=offline_wandb, config={"lr": 0.05}
    )
    result = problem([logger])
    (run_dir,) = (offline_wandb / "wandb").glob("offline-run-*")
    records = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [row["_step"] for row in history] == [1, 2, 3]
    for name, values in logged_values(result).items():
        assert [row[name] for row in history] == values, name
    config = {}  # as `wandb.init` set it, then as updated
    for record in records:
        if record["type"] == "run":
            config |= record["run"]["config"]["update"]
        elif record["type"] == "config":
            config |= record["config"]["update"]
    assert config["lr"] == 0.05 and config["epochs"] == 3 and config["batch_size"] == 16
    assert config["metrics"] == ["mae"] and config["precision"] is None
    (exit_record,) = [r for r in records if r["type"] == "exit"]
    assert exit_record["exit"].get("exit_code", 0) == 0


@pytest.mark.heavy
def test_wandb_logger_logs_every_n_steps_at_the_global_step(problem, offline_wandb):
    # With `log_every`, every value goes at the global step (W&B's steps only go up):
    # the n steps' as `step/<name>`, an epoch's at the step that ends it, with `epoch`.
    logger = eqfit.callbacks.WandbLogger(project="eqfit-test", name="steps", dir=offline_wandb)
    result = problem([logger], log_every=2)  # 4 steps an epoch
    (run_dir,) = (offline_wandb / "wandb").glob("offline-run-*")
    history = [r["history"]["item"] for r in wandb_records(run_dir) if r["type"] == "history"]
    assert [row["_step"] for row in history] == [2, 4, 6, 8, 10, 12]
    assert [row.get("epoch") for row in history] == [None, 1, None, 2, None, 3]
    loss = result.history.step_loss.reshape(-1)  # batches of one size: plain means
    expected = [loss[i : i + 2].mean() for i in range(0, 12, 2)]
    np.testing.assert_allclose([row["step/loss"] for row in history], expected, rtol=1e-5)
    assert [row["loss"] for row in history if "loss" in row] == list(result.history["loss"])
