"""The History record: arrays in, plain numbers and plots out."""

import csv
import dataclasses
import os
from typing import Any, Literal

import numpy as np

from ._step._statistics import entry_names


StopReason = (
    Literal[
        "early_stopping",
        "non_finite_loss",
        "callback",
        "interrupted",
        "checkpoint_error",
        "error",
        "out_of_data",
    ]
    | None
)


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """What made a step's loss not finite, found by replaying the step: eqfit's runs are
    deterministic, so the step runs again from the state it began from (the one `fit`
    returns), on its batch and key, outside the compiled run, under JAX's checks for NaNs
    (`jax.debug_nans`) and, where none is made, for infinities (`jax.debug_infs`). In
    [`eqfit.NonFiniteLossError`][]'s `.found`, and with `on_nan="stop"` in
    `history.non_finite`.

    Where the run applied that step (no guard in its compiled step: see `fit`'s
    `on_nan`), the state it began from was first replayed itself, from the newest
    checkpoint or the run's start (`replayed_from`).

    **Attributes:**

    - `epoch`, `step`: the step, counted from 1 (the step within its epoch).
    - `member`: the ensemble member (counted from 0), or `None`.
    - `seconds`: how long the replay took, the run's replay up to the step included.
    - `not_reproduced`: why the replay found nothing, or `None`: the step's batch could
        not be read again (a generator), or the replayed loss was finite (a precision
        policy, or XLA's fusion of the compiled step, computed it otherwise); or, with no
        guard, the run's replay did not reach the step (a loader that raised, a signal),
        and it says which model `fit` returns then: the one after the step, or the
        replay's where it stopped.
    - `operation`: the first operation that made a NaN (or an infinity), as JAX names it
        (`"invalid value (nan) encountered in log"`).
    - `source`: the line of your code it came from, `"path:line: code"`.
    - `pass_`: `"forward"`, or `"backward"` for an operation of the gradient (`source` is
        then the line whose operation it differentiates).
    - `update`: with several updates, the one whose loss (or gradient) is not finite:
        the replay runs the step's updates in turn, each `eqfit.Update`'s loss checked on
        the model the ones before it left (as `Update.apply`, at `fit`'s default
        options), until it finds it; `None` with one loss.
    - `parameters`: the trained arrays whose gradient is not finite, by their paths in
        the model (as `jax.tree_util.keystr` writes them: `".layers[0].weight"`).
    - `rows`: the rows of the batch whose loss, each taken alone as a batch of one, is not
        finite, by their index in the data given (for arrays and memmaps, with
        `validation_split`'s held-out rows counted; for a loader, the row's place in its
        epoch: the batches before its batch in the epoch times the batch size, plus its
        place in its batch); `None` where no row alone is (a loss that is no mean over
        its rows).
    - `replayed_from`: where the run applied the step, the steps done (since the first
        epoch ever) at the state its replay began from: the newest checkpoint's, or the
        run's start; `None` where the run kept its last finite state itself (`on_nan=`'s
        guard: asked for, or kept under `devices=`, a precision policy, an ensemble, a
        one-shot iterator).
    - `began_non_finite`: the trained arrays already not finite when the step began, by
        path: an earlier step's gradient was not finite though its loss was, which a run
        without `norms=True` does not check (it stops at the next step, whose every row
        is then not finite).
    """

    epoch: int
    step: int
    member: int | None
    seconds: float
    not_reproduced: str | None = None
    operation: str | None = None
    source: str | None = None
    pass_: Literal["forward", "backward"] | None = None
    parameters: tuple[str, ...] = ()
    rows: tuple[int, ...] | None = None
    update: str | None = None
    replayed_from: int | None = None
    began_non_finite: tuple[str, ...] = ()

    def __str__(self) -> str:
        member = "" if self.member is None else f" of member {self.member}"
        update = "" if self.update is None else f", update {self.update!r}"
        head = f"Replayed step {self.step} of epoch {self.epoch}{member}{update}"
        if self.replayed_from is not None:
            start = "the start" if self.replayed_from == 0 else f"step {self.replayed_from}"
            head += f" (the run replayed from {start})"
        if self.not_reproduced is not None:
            return f"{head}: not reproduced; {self.not_reproduced}."
        lines = [f"{head}:"]
        if self.operation is not None:
            lines.append(f"- first non-finite value ({self.pass_} pass): {self.operation}")
            lines.append(f"  at {self.source or 'a line JAX did not name'}")
        if self.parameters:
            lines.append(f"- non-finite gradients: {', '.join(self.parameters)}")
        if self.rows is not None:
            lines.append(f"- rows whose loss is not finite: {', '.join(map(str, self.rows))}")
        if self.began_non_finite:
            lines.append(
                f"- not finite before the step: {', '.join(self.began_non_finite)}. An "
                "earlier step's gradient was not finite though its loss was: without "
                "`norms=True` a run checks only the loss, and so stops a step late, every "
                "row's loss not finite. Run with `norms=True` to stop at the step whose "
                "gradient is not finite, and to replay that one."
            )
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class History:
    """What happened during `fit`, as numpy arrays and plain numbers.

    Epochs are counted from 1 everywhere in eqfit: `epoch`, `best_epoch`, the CSV and the
    plot, the bar, callbacks and errors. Row `i` of every array is epoch `epoch[i]`.

    **Attributes:**

    - `values`: per-epoch values by name: `"loss"`, each metric's name, and with
        validation `"val_loss"` and `"val_<metric>"` (with named sets,
        [`eqfit.ValidationSets`][], `"val_<set>_loss"` and `"val_<set>_<metric>"`; NaN
        for an epoch not validated, `fit(..., validation_freq=)`). Each has one entry per
        epoch that ran (a trailing member axis for ensembles). Also readable as `history["name"]`.
        With `fit(..., norms=True)`, `"grad_norm"` and `"update_norm"` (means over the
        steps whose update was applied); each aux value the loss returns, by its name;
        with loss scaling, `"loss_scale"` (the epoch's last step's) and `"skipped_steps"`
        (how many of its steps were skipped for a non-finite gradient); the optimizer's
        hyperparameters (the epoch's last step's, see `step_values`).
    - `step_loss`: the loss of every step, shape `(epochs, steps_per_epoch)`: the loss of
        the parameters *before* that step's update; NaN for steps that did not run. The
        per-step records (this, `batch_sizes` and `step_values`) stay on the device while
        the run trains, in arrays as long as the run, each step writing its own cell in
        place, so that no step costs more in a longer run; they are read to the host
        once, at the end. They take 4 bytes a step for the loss, the batch size and each
        value (`eqfit.plan` counts them in the program's arguments).
    - `batch_sizes`: the size of every step's batch, shape `(epochs, steps_per_epoch)`;
        0 for steps that did not run.
    - `wall_time`: seconds spent in `fit`, compilation included.
    - `best_epoch`: the number of the best epoch by the early-stopping monitor, if any.
    - `stop_reason`: why training ended before its last epoch, or `None`:
        `"early_stopping"`, `"non_finite_loss"` (a label out of range makes the loss
        non-finite too), `"callback"`, `"interrupted"` (Ctrl-C), `"checkpoint_error"` (a
        checkpoint could not be written), `"error"` (the data raised an error, which
        `fit` raises with this history in its `.result`), or `"out_of_data"` (an
        iterator ran out before the last step).
    - `initial_epoch`: epochs done before this run (`fit`'s `initial_epoch`).
    - `throughput`: each epoch's `"epoch_seconds"` (its wall seconds, from the first call
        of the program on: the compilation before it is not counted, the host's work
        between calls is), `"steps_per_second"` and `"samples_per_second"` (the batch's
        rows, or the samples its updates say they process, `eqfit.AbstractUpdate`'s
        `samples`: a rollout's environment steps); NaN for an
        epoch not timed whole (cut short, or begun before a resume). Each call of the
        program is timed as the device finishes it (a thread waits on it from when it is
        queued), from the end of the call before it. An epoch that lasts about 50 ms or
        more gets a call of its own and so its own time, whatever it holds (a validation
        every other epoch shows). Shorter epochs share a call (of about half a second),
        and each gets its share of the call's seconds by its steps: its own time where
        the epochs do the same work, their mean where they do not. No clock is read
        inside the program: a host callback there slows all of it on a CPU. (The first
        epoch of a configuration not run before in the process also holds the short
        calls that measure its speed, and is slower for them.) Where the step's FLOPs
        are known (after [`eqfit.plan`][], with `progress=True`, or where the MFU can be
        told: a GPU or TPU in eqfit's table, or `fit(..., peak_flops=)`), also
        `"flops_per_second"` (achieved, every device together) and, with a peak, `"mfu"`
        (that over the devices' peak FLOP/s; both left out, with a `RuntimeWarning`, where
        the step's FLOPs could not be counted). With checkpoints,
        `"checkpoint_blocked_seconds"`: the seconds the training waited at the epoch's
        checkpoints (0 in an epoch without one): in the background (a GPU's or TPU's
        default) the copy queued on the device, and a wait for the last write where it was
        still going; in the training thread (the CPU's default) the state's file written
        too; with `Checkpoint(background=False)` the whole write. (A checkpoint at an
        epoch's end holds up the next call, so its cost shows in the next epoch's
        `"epoch_seconds"`, if anywhere.) Callbacks see them in each epoch's `logs` too.
        They are not in `values`: they are not the same bits run to run.
    - `step_values`: the values recorded at every step besides its loss, by name, each
        shaped as `step_loss`: the metrics and the loss's aux values on the step's batch
        (before its update), `"grad_norm"` and `"update_norm"` with `norms=True`, and with
        loss scaling `"loss_scale"` (the scale the step used) and `"skipped_steps"` (1
        where the step's gradient was not finite and its update was skipped). And the
        optimizer's hyperparameters: each numeric one of an `optax.inject_hyperparams`
        state in its state, by its name (`"learning_rate"`), the value the step's update
        used (where two states hold one name, the second is named by its path in the
        optimizer's state, `"inner_states/b/inner_state/learning_rate"`); and each of
        `fit(..., schedules=)` at the count the update used.

    - `validation_steps`, `validations`: with `fit(..., validation_every=n)`, the global
        step (counted from the first ever) of each validation the run made, and its
        values by name (`"val_loss"`, ...), one entry per validation. The epoch's
        validation values in `values` are its last validation's (NaN for an epoch with
        none); empty without `validation_every`.
    - `best_step`: with `validation_every` and early stopping on a validation value, the
        step of the best validation (`best_epoch` is the epoch it fell in); else `None`.
    - `non_finite`: with `on_nan="stop"`, what made the loss not finite where it stopped
        the run (an [`eqfit.NonFinite`][], found by replaying the step); else `None`.
    - `microbatches`: the number of microbatches each batch was computed in: as given,
        or as `microbatches="auto"` chose it (`eqfit.plan(...).microbatches_why` says
        why).

    For an ensemble every per-epoch value has a last axis of members, `step_loss` and
    `batch_sizes` are `(epochs, steps, members)`, `best_epoch` and `stop_reason` are
    tuples with one entry per member, and a member that stopped early has NaN for the
    epochs it did not run.

    Training values weight each step by its batch size, so with a remainder batch they are
    the mean over samples, as one full-batch pass would average a mean loss.
    """

    values: dict[str, np.ndarray]
    step_loss: np.ndarray
    batch_sizes: np.ndarray
    wall_time: float
    best_epoch: int | None | tuple[int | None, ...] = None
    stop_reason: StopReason | tuple[StopReason, ...] = None
    initial_epoch: int = 0
    step_values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    throughput: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    validation_steps: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    validations: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    best_step: int | None | tuple[int | None, ...] = None
    non_finite: NonFinite | None = None
    microbatches: int = 1

    @property
    def loss(self) -> np.ndarray:
        """The mean training loss of each epoch."""
        return self.values["loss"]

    @property
    def val_loss(self) -> np.ndarray | None:
        """The validation loss after each epoch, or `None` without validation (or with
        named sets: `history["val_<set>_loss"]`).
        """
        return self.values.get("val_loss")

    @property
    def metrics(self) -> dict[str, np.ndarray]:
        """Every per-epoch value except the losses."""
        return {k: v for k, v in self.values.items() if k not in ("loss", "val_loss")}

    @property
    def epochs(self) -> int:
        """How many epochs ran."""
        return int(self.loss.shape[0])

    @property
    def epoch(self) -> np.ndarray:
        """The number of each row's epoch, counted from 1."""
        return np.arange(self.initial_epoch + 1, self.initial_epoch + 1 + self.epochs)

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"No {name!r} in the history; it has {sorted(self.values)}.") from None

    @property
    def _members(self) -> int:
        """1 for an ensemble's history (a trailing member axis), else 0."""
        return int(isinstance(self.stop_reason, tuple))

    def _is_array(self, name: str) -> bool:
        """Whether `name`'s value is an array each epoch (a confusion matrix)."""
        return np.ndim(self.values[name]) > 1 + self._members

    def to_dict(self) -> dict[str, Any]:
        """The per-epoch values as lists of plain floats, keyed by name, with `"epoch"`."""
        return {"epoch": self.epoch.tolist()} | {
            name: value.tolist() for name, value in self.values.items()
        }

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Writes one row per epoch, one column per value, with the epoch's number. A
        value that is an array each epoch (a confusion matrix) gets a column per entry,
        `cm/0/1`, as the loggers name them.
        """
        rows: dict[str, Any] = {"epoch": self.epoch.tolist()}
        for name, value in self.values.items():
            if not self._is_array(name):
                rows[name] = value.tolist()
                continue
            shape = value.shape[1 : value.ndim - self._members]
            flat = value.reshape(len(value), -1, *value.shape[value.ndim - self._members :])
            for j, entry in enumerate(entry_names(name, shape)):
                rows[entry] = flat[:, j].tolist()
        names = list(rows)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(names)
            for i in range(self.epochs):
                writer.writerow([rows[name][i] for name in names])

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        """Draws the loss (and validation loss) per epoch, and each metric beside it.

        Needs matplotlib: `pip install "eqfit[plot]"`. Saves a PNG at `path` if given.

        **Returns:**

        The matplotlib `Figure`.
        """
        try:
            import matplotlib

            matplotlib.use("Agg") if path is not None else None
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError('History.plot needs matplotlib: pip install "eqfit[plot]"') from e
        groups = ["loss"] + [
            m for m in self.metrics if not m.startswith("val_") and not self._is_array(m)
        ]
        # Named validation sets each have a `val_<set>_loss`.
        sets = [k[4:-5] for k in self.values if k.startswith("val_") and k.endswith("_loss")]
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.5), squeeze=False)
        for ax, name in zip(axes[0], groups):
            ax.plot(self.epoch, self.values[name], label=f"train {name}")
            shown = [(f"val_{name}", "validation")]
            shown += [(f"val_{s}_{name}", f"validation {s}") for s in sets if s]
            for key, label in shown:
                if key not in self.values:
                    continue
                # Only the validated epochs (`validation_freq`): a line breaks at NaN.
                values = self.values[key]
                validated = ~np.isnan(values.reshape(len(values), -1)).all(axis=1)
                ax.plot(self.epoch[validated], values[validated], label=f"{label} {name}")
            if isinstance(self.best_epoch, int):
                ax.axvline(self.best_epoch, color="grey", linestyle=":", label="best")
            ax.set_xlabel("epoch")
            ax.set_title(name)
            ax.legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig
