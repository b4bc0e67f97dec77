"""Ready callbacks for experiment logs: `fit(..., callbacks=[...])`.

A callback is any object with `on_epoch_end(epoch, logs) -> bool | None` (epochs counted
from 1), called on the host after each epoch; it may also have `on_train_begin(config)`,
called once as training starts with the run's arguments, `on_train_batch_end(step, logs)`,
called with `fit(..., log_every=n)` after every n-th step with its global number and the
n steps' values (each logger here writes them), `on_validation_end(step, logs)`, called
with `fit(..., validation_every=n)` after each validation with its step's global number
and its values (each logger here writes them too), and `on_train_end(logs)`, called once
training ends (however it ends), with the last epoch's values. One whose
class says `stops_training = False` (these do) never stops training, so the device need
not wait for it, nor is the run cut at each epoch's end for it: it sees the epochs each
call of the program (about half a second of steps) reached once the call is done, the
next already queued.
"""

import csv
import importlib
import importlib.util
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


class CSVLogger:
    """Writes each epoch's values to a CSV file as training goes: a row per epoch, a
    column per value, the first one `epoch`. The file is flushed after each row, so it
    can be read while training runs. With `fit(..., log_every=n)`, the values of every n
    steps go to a second file beside it, `<name>.steps.csv` (`log.steps.csv` for
    `log.csv`): a row per n-th step, the first column `step`, its global number. With
    `fit(..., validation_every=n)`, each validation's values go to a third,
    `<name>.validations.csv`, a row per validation, the first column `step`.

    **Arguments:**

    - `path`: the file.
    - `append`: add rows to an existing file (continuing a run) rather than start anew.
    - `separator`: the column separator.
    """

    stops_training: bool = False

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False, separator: str = ","):
        self.path: Path = Path(path)
        self.append: bool = append
        self.separator: str = separator
        self.steps_path: Path = self.path.with_name(f"{self.path.stem}.steps{self.path.suffix}")
        name = f"{self.path.stem}.validations{self.path.suffix}"
        self.validations_path: Path = self.path.with_name(name)
        self._tables: dict[Path, _CsvTable] = {}

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """Writes epoch `epoch`'s row."""
        self._table(self.path, "epoch", logs).write(epoch, logs)

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        """Writes step `step`'s row (`log_every`) to `steps_path`."""
        self._table(self.steps_path, "step", logs).write(step, logs)

    def on_validation_end(self, step: int, logs: dict[str, float]) -> None:
        """Writes the validation at step `step` (`validation_every`) to `validations_path`."""
        self._table(self.validations_path, "step", logs).write(step, logs)

    def _table(self, path: Path, first: str, logs: dict[str, float]) -> "_CsvTable":
        if path not in self._tables:
            self._tables[path] = _CsvTable(path, self.append, self.separator, [first, *logs])
        return self._tables[path]

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Closes the files."""
        del logs
        for table in self._tables.values():
            table.file.close()
        self._tables.clear()


class _CsvTable:
    """One CSV file of `CSVLogger`'s, open: its rows written as they come, and flushed."""

    def __init__(self, path: Path, append: bool, separator: str, columns: list[str]):
        exists = append and path.exists() and path.stat().st_size > 0
        self.file: Any = open(path, "a" if append else "w", newline="")  # noqa: SIM115
        self.writer: Any = csv.writer(self.file, delimiter=separator)
        self.columns = columns
        if not exists:
            self.writer.writerow(columns)

    def write(self, first: int, logs: dict[str, float]) -> None:
        self.writer.writerow([first, *(logs.get(name) for name in self.columns[1:])])
        self.file.flush()


class TensorBoard:
    """Writes each epoch's values as TensorBoard scalars, one per name, at the epoch's
    number. With `fit(..., log_every=n)`, the values of every n steps too, as
    `step/<name>` at the step's global number, and with `fit(..., validation_every=n)`
    each validation's, as `step/val_<name>` at its step's. Needs tensorboardX: `pip install
    "eqfit[tensorboard]"` (imported only when the first values are written).

    **Arguments:**

    - `logdir`: the directory for the event files (`tensorboard --logdir` it).
    """

    stops_training: bool = False

    def __init__(self, logdir: str | os.PathLike[str]):
        self.logdir: Path = Path(logdir)
        self._writer: Any = None

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """Writes epoch `epoch`'s values."""
        self._write(logs, epoch, "")

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        """Writes step `step`'s values (`log_every`), as `step/<name>`."""
        self._write(logs, step, "step/")

    def on_validation_end(self, step: int, logs: dict[str, float]) -> None:
        """Writes the validation at step `step` (`validation_every`), as `step/val_<name>`."""
        self._write(logs, step, "step/")

    def _write(self, logs: dict[str, float], at: int, prefix: str) -> None:
        if self._writer is None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                hint = 'pip install "eqfit[tensorboard]"'
                raise ImportError(f"eqfit.callbacks.TensorBoard needs tensorboardX: {hint}") from e
            self._writer = SummaryWriter(str(self.logdir))
        for name, value in logs.items():
            self._writer.add_scalar(prefix + name, value, at)
        self._writer.flush()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Closes the event file."""
        del logs
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbLogger:
    """Logs each epoch's values to a Weights & Biases run, at the epoch's number as the
    run's step, and the run's arguments (`fit`'s epochs, batch size, precision, ...) to
    its config. Needs wandb: `pip install "eqfit[wandb]"` (imported once training starts).

    With `fit(..., log_every=n)`, the values of every n steps too, as `step/<name>`
    (with `fit(..., validation_every=n)`, each validation's, as `step/val_<name>`), and
    then every value at the global step number as the run's step (W&B's steps only go
    up): an epoch's at the step that ends it, with its number as `epoch`.

    The run is `run` if given, else the active one (`wandb.run`) if no argument asks for a
    new one: either is left open. Else the logger starts one with `wandb.init` as training
    starts, and finishes it however training ends: with exit code 1 if an error ended it.

    **Arguments:**

    - `run`: a run to log into (what `wandb.init` returned), left open.
    - `project`, `name`, `mode` (`"online"`, `"offline"` or `"disabled"`), `dir`: for
        `wandb.init`.
    - `config`: your own values for the run's config; `fit`'s arguments join them.
    - `init_kwargs`: the rest of `wandb.init`'s (`entity`, `group`, `tags`, and `id` with
        `resume="allow"` to continue a run, ...).
    """

    stops_training: bool = False

    def __init__(
        self,
        run: Any = None,
        *,
        project: str | None = None,
        name: str | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        config: dict[str, Any] | None = None,
        **init_kwargs: Any,
    ):
        if run is not None and not (callable(getattr(run, "log", None)) and hasattr(run, "config")):
            raise TypeError(
                "`WandbLogger`'s `run` must be a W&B run (what `wandb.init()` returns, or "
                f"`wandb.run`), or None for the active run or a new one, got {_given(run)}. "
                'To name a new run give `name=`; to continue one, `id=` with `resume="allow"`.'
            )
        _require("wandb", "WandbLogger", "wandb")
        self.run: Any = run
        given = dict(project=project, name=name, mode=mode, dir=dir, config=config)
        self.init_kwargs: dict[str, Any] = {
            **{k: v for k, v in given.items() if v is not None},
            **init_kwargs,
        }
        self._run: Any = None
        self._started = False  # the run is the logger's own, to finish
        self._error: BaseException | None = None  # being handled when training began
        self._steps_per_epoch: int | None = None  # with `log_every`: epochs at their steps

    def on_train_begin(self, config: dict[str, Any]) -> None:
        """Starts the run, or takes the given or active one, and adds `config` to its
        config.
        """
        wandb: Any = importlib.import_module("wandb")
        self._error = sys.exc_info()[1]
        run = self.run
        if run is None and not self.init_kwargs:
            run = wandb.run
        self._started = run is None
        if run is None:
            run = wandb.init(**self.init_kwargs)
        self._run = run
        run.config.update(config, allow_val_change=True)
        if config.get("log_every") is not None or config.get("validation_every") is not None:
            self._steps_per_epoch = config.get("steps_per_epoch")

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """Logs epoch `epoch`'s values at step `epoch` (with `log_every`, at the global
        step that ends it, with `epoch`).
        """
        if self._run is None:  # called outside `fit`
            self.on_train_begin({})
        run: Any = self._run
        if self._steps_per_epoch is None:
            run.log(dict(logs), step=epoch)
        else:
            run.log({"epoch": epoch, **logs}, step=epoch * self._steps_per_epoch)

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        """Logs step `step`'s values (`log_every`) as `step/<name>`, at step `step`."""
        if self._run is None:  # called outside `fit`
            self.on_train_begin({})
        run: Any = self._run
        run.log({f"step/{name}": value for name, value in logs.items()}, step=step)

    def on_validation_end(self, step: int, logs: dict[str, float]) -> None:
        """Logs the validation at step `step` (`validation_every`) as `step/val_<name>`,
        at step `step`.
        """
        self.on_train_batch_end(step, logs)

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Finishes the run if the logger started it."""
        del logs
        run, self._run = self._run, None
        if run is not None and self._started:
            run.finish(exit_code=1 if _failed(self._error) else 0)


class MLflowLogger:
    """Logs each epoch's values to an MLflow run as metrics, at the epoch's number as
    their step, and the run's arguments (`fit`'s epochs, batch size, precision, ...) as
    its params (nested ones by dotted names). With `fit(..., log_every=n)`, the values of
    every n steps too, as metrics `step/<name>` at the step's global number, and with
    `fit(..., validation_every=n)` each validation's, as `step/val_<name>`. Needs
    MLflow: `pip install "eqfit[mlflow]"` (imported once training starts).

    The run is `run` if given, else the active one (`mlflow.start_run()`'s) if no argument
    asks for another: either is left open. Else the logger starts one (or continues
    `run_id`'s) as training starts, and ends it however training ends: `FINISHED`, or
    `FAILED` if an error ended training (`KILLED` for a `KeyboardInterrupt`). Params the
    run has already (a continued run's) keep their values: MLflow does not change them.
    `run_id` is the run's id once training starts.

    **Arguments:**

    - `run`: a run to log into (an `mlflow.entities.Run`, such as `mlflow.active_run()`),
        left open.
    - `experiment_name`: the experiment of a new run, made if there is none of this name;
        by default, `MLFLOW_EXPERIMENT_NAME`'s, else MLflow's default experiment.
    - `run_name`: the new run's name.
    - `run_id`: a run to continue.
    - `tracking_uri`: where runs are kept (`"sqlite:///mlflow.db"`, a server's URL); by
        default MLflow's (`MLFLOW_TRACKING_URI`, `mlflow.set_tracking_uri`).
    - `tags`: the new run's tags.
    """

    stops_training: bool = False

    def __init__(
        self,
        run: Any = None,
        *,
        experiment_name: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, str] | None = None,
    ):
        if run is not None and not isinstance(
            getattr(getattr(run, "info", None), "run_id", None), str
        ):
            raise TypeError(
                "`MLflowLogger`'s `run` must be an MLflow run (an `mlflow.entities.Run`, such "
                f"as `mlflow.active_run()`), or None for the active run or a new one, got "
                f"{_given(run)}. To continue a run by its id give `run_id=`; to name a new "
                "one, `run_name=`."
            )
        _require("mlflow", "MLflowLogger", "mlflow")
        self.run: Any = run
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.run_id: str | None = run_id
        self.tracking_uri = tracking_uri
        self._continues = run_id  # the run to continue, of the arguments
        self.tags: dict[str, str] = dict(tags or {})
        self._client: Any = None  # while a run is logged to
        self._started = False  # the run is the logger's own, to end
        self._error: BaseException | None = None  # being handled when training began

    def on_train_begin(self, config: dict[str, Any]) -> None:
        """Starts or continues the run, or takes the given or active one, and logs
        `config` as its params.
        """
        mlflow: Any = importlib.import_module("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking.context.registry import resolve_tags

        self._error = sys.exc_info()[1]
        _check_server(self.tracking_uri or mlflow.get_tracking_uri())
        _check_store_path(self.tracking_uri or mlflow.get_tracking_uri())
        client = mlflow.MlflowClient(self.tracking_uri)
        run, asks = (
            self.run,
            (self.experiment_name, self.run_name, self._continues, self.tracking_uri),
        )
        if run is None and all(a is None for a in asks):
            run = mlflow.active_run()
        self._started = run is None
        if run is not None:
            self.run_id = run.info.run_id
        elif self._continues is not None:
            self.run_id = self._continues
            client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self._experiment_id(client)
            made = client.create_run(
                experiment, tags=resolve_tags(self.tags), run_name=self.run_name
            )
            self.run_id = made.info.run_id
        self._client = client
        kept = client.get_run(self.run_id).data.params
        params = [Param(k, str(v)) for k, v in _flat(config).items() if k not in kept]
        if params:
            client.log_batch(self.run_id, params=params)

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """Logs epoch `epoch`'s values at step `epoch`."""
        self._log(logs, epoch, "")

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        """Logs step `step`'s values (`log_every`) as `step/<name>`, at step `step`."""
        self._log(logs, step, "step/")

    def on_validation_end(self, step: int, logs: dict[str, float]) -> None:
        """Logs the validation at step `step` (`validation_every`) as `step/val_<name>`,
        at step `step`.
        """
        self._log(logs, step, "step/")

    def _log(self, logs: dict[str, float], at: int, prefix: str) -> None:
        from mlflow.entities import Metric

        if self._client is None:  # called outside `fit`
            self.on_train_begin({})
        client: Any = self._client
        stamp = int(time.time() * 1000)
        metrics = [Metric(prefix + k, float(v), stamp, at) for k, v in logs.items()]
        client.log_batch(self.run_id, metrics=metrics)

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Ends the run if the logger started or continued it."""
        del logs
        client, self._client = self._client, None
        if client is None or not self._started:
            return
        error = sys.exc_info()[1]
        if not _failed(self._error):
            status = "FINISHED"
        elif isinstance(error, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        client.set_terminated(self.run_id, status)

    def _experiment_id(self, client: Any) -> str:
        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name is None:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return client.create_experiment(name)


# How long the MLflow logger waits for its tracking server to answer as training starts.
_SERVER_TIMEOUT = 10.0


def _check_server(uri: str, timeout: float = _SERVER_TIMEOUT) -> None:
    """Refuses an MLflow tracking server (an `http(s)://` tracking URI) that does not
    answer within `timeout` seconds, naming its address. Without it a dead server holds
    `fit` for minutes as training starts: MLflow retries each request with backoff (its
    `MLFLOW_HTTP_REQUEST_MAX_RETRIES` and `MLFLOW_HTTP_REQUEST_TIMEOUT`). Any answer,
    an HTTP error or a TLS failure too, shows the server is there, and MLflow takes it
    from there. Other URIs (a file store, a database, `databricks`) are not checked.
    """
    if urllib.parse.urlparse(uri).scheme not in ("http", "https"):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLError):
            return  # it answered; MLflow's own TLS settings decide
        raise ConnectionError(
            f"`MLflowLogger`: the MLflow tracking server at {uri} cannot be reached "
            f"({reason}; eqfit waits {timeout:g} s for it). Start it, or check `tracking_uri` (or "
            "`MLFLOW_TRACKING_URI`). eqfit asks it once as training starts, rather than "
            "wait out MLflow's retries of every request (minutes)."
        ) from None


def _check_store_path(uri: str) -> None:
    """Refuses a local tracking URI (`sqlite:///`, `file:`, a path) whose folder cannot
    be made because a file stands where a folder of its path should be, naming it:
    MLflow's own error (`FileExistsError`, `NotADirectoryError`) names neither the
    argument nor the file.
    """
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "sqlite":
        # `sqlite:///relative.db`, `sqlite:////absolute.db`: the database file's folder.
        folder = Path(uri[len("sqlite:///") :]).parent
    elif parsed.scheme in ("", "file"):
        folder = Path(urllib.request.url2pathname(parsed.path) if parsed.scheme else uri)
    else:
        return
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                raise ValueError(
                    f"`MLflowLogger`'s `tracking_uri` (or `MLFLOW_TRACKING_URI`) is {uri!r}, "
                    f"which keeps its runs in {str(folder)!r}, but {str(path)!r} is a "
                    "file, not a folder. Give a path whose folders are folders, or can be "
                    "made."
                )
            return


def _given(value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"a {type(value).__name__} ({shown})"


def _require(module: str, logger: str, extra: str) -> None:
    """Refuses, with what to install, when `module` is not there (found, not imported:
    the logger imports it once training starts).
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:  # none, or a folder (wandb's `./wandb` runs)
        hint = f'pip install "eqfit[{extra}]"'
        raise ImportError(f"eqfit.callbacks.{logger} needs {module}: {hint}")


def _failed(before: BaseException | None) -> bool:
    """Whether training is ending by an error: one being raised now, other than the one
    that was being handled as it began (`fit` called in an `except` block).
    """
    error = sys.exc_info()[1]
    return error is not None and error is not before


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`config` with nested dicts' values by dotted names."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
