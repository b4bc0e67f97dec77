"""What `fit` returns, and how it is read back from the run's record (`_save.py` saves it)."""

import dataclasses
import functools
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any, Generic

import jax
import numpy as np

from ._core._typing import Model, ModelState, OptState
from ._history import History, NonFinite, StopReason
from ._host._drive import Outcome
from ._host._observers import Throughput
from ._keep._directory import CheckpointError
from ._program._loop import Loop
from ._program._schedule import Schedule
from ._program._skeleton import unwrap
from ._program._state import Consts, NON_FINITE_STOPS, Stop, Validations
from ._step._labels import raise_found
from ._step._statistics import ENTRY, grouped
from ._step._validation_steps import EveryNSteps


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["model", "opt_state", "history", "state", "ema_model"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class FitResult(Generic[Model]):
    """What `fit` returns: a PyTree, so `jax.block_until_ready(result)` and the like work.

    **Attributes:**

    - `model`: the trained model, of the same type as the one passed in.
    - `opt_state`: the optimizer state; pass it back as `fit(..., opt_state=)` to go on.
    - `history`: a [`eqfit.History`][] of per-epoch values and per-step losses.
    - `state`: the model state (`eqx.nn.State`) after training, if `state=` was given.
    - `ema_model`: with `fit(..., ema=)`, the moving average of the trained arrays as a
        model of the same type (its frozen arrays are the model's); else `None`.
    """

    # A registered dataclass rather than an `eqx.Module`: it is made once per `fit`
    # after the run has finished, and a Module's checks at construction showed in the
    # host work per call that `benchmarks/fit_speed.py` measures.
    model: Model
    opt_state: OptState
    history: History
    state: ModelState | None = None
    ema_model: Model | None = None


class TrainingInterrupted(KeyboardInterrupt):
    """Training was interrupted by a signal: Ctrl-C (SIGINT), or one of `fit`'s
    `signals` (SIGTERM, SIGUSR1: a scheduler's preemption). It stopped at the step the
    program had reached, wrote a checkpoint there if it had a directory, and `result`
    holds what it had trained.

    **Attributes:**

    - `result`: the [`eqfit.FitResult`][] so far.
    - `signal`: the signal's name, `"SIGINT"`, `"SIGTERM"`, `"SIGUSR1"`, ...
    - `exit_code`: `128 + ` the signal's number (130, 143, 138), the status a shell gives
        a process that the signal ended: `sys.exit(e.exit_code)` tells a batch script
        how the run ended (see the long-runs guide for SLURM's requeue).
    """

    def __init__(self, result: FitResult[Any], signal_name: str = "SIGINT"):
        last = result.history.initial_epoch + result.history.epochs
        steps = int(np.sum(result.history.batch_sizes > 0))
        super().__init__(
            f"Training stopped by {signal_name} in epoch {last}, after {steps} steps of this "
            "run; the result so far is in this exception's `.result`."
        )
        self.result: FitResult[Any] = result
        self.signal: str = signal_name
        self.exit_code: int = 128 + int(signal.Signals[signal_name])


class NonFiniteLossError(FloatingPointError):
    """The loss was NaN or infinite. `result` holds the last finite model; `epoch` and
    `step` (counted from 1) say where, and `found` (an [`eqfit.NonFinite`][]) what made
    it so, found by replaying the step (its operation and line, the parameters whose
    gradient is not finite, the rows of the batch, with several updates the update); a
    replay that found nothing says why in its `not_reproduced`.
    """

    def __init__(
        self,
        message: str,
        result: FitResult[Any],
        epoch: int,
        step: int,
        found: NonFinite | None = None,
    ):
        super().__init__(message)
        self.result: FitResult[Any] = result
        self.epoch: int = epoch
        self.step: int = step
        self.found: NonFinite | None = found


def finish(
    loop: Loop,
    outcome: Outcome,
    consts: Consts,
    began: float,
    find: Callable[[Any, Any, Any, int, int | None], NonFinite] | None = None,
) -> FitResult[Any]:
    """The one place a run ends: makes the result from the final state and the last
    report, then raises what must be raised, each error holding the result as `.result`:
    a checkpoint that could not be written or an error of the data's (raised as it is,
    with `.result` set), a Ctrl-C, a label out of range, a non-finite loss with
    `on_nan="raise"`. It warns if the data ran out. Where a loss was not finite and the
    run stopped there, `find(params, opt_state, model_state, step, member)` replays its step
    (`_nonfinite.find`), for the error or the history.
    """
    result, reasons = _result(loop, outcome, consts, began)
    if outcome.failure is not None:
        outcome.failure.result = result  # type: ignore[attr-defined]
        raise outcome.failure
    if outcome.interrupted:
        raise TrainingInterrupted(result, outcome.signal or "SIGINT")
    try:
        sets = None if loop.validation is None else loop.validation.sets
        raise_found(outcome.read.label_error, loop.members is not None, sets)
    except ValueError as e:
        e.result = result  # type: ignore[attr-defined]
        raise
    schedule = loop.schedule
    if "out_of_data" in reasons:
        warnings.warn(
            f"The data ran out after {max(outcome_epochs(loop, outcome))} of the "
            f"{schedule.epochs - schedule.first_epoch} epochs asked for "
            f"({schedule.steps_per_epoch} steps each); training stopped there. Give an "
            "iterator with enough batches, or fewer `epochs` or `steps_per_epoch`.",
            stacklevel=3,
        )
    _warn_of_nan_monitor(loop, result.history)
    nan_steps = np.asarray(outcome.read.nan_step).reshape(-1).tolist()
    if loop.step.on_nan == "skip" or max(nan_steps) < 0:
        return result
    i = next(i for i, t in enumerate(nan_steps) if t >= 0)
    found = None
    if find is not None:
        state = outcome.state
        arrays = loop.placement.host((state.params, state.opt_state, state.model_state))
        params, opt_state, model_state = arrays
        member = None if loop.members is None else i
        found = find(params, opt_state, model_state, nan_steps[i], member)
    if loop.step.on_nan == "stop":
        history = dataclasses.replace(result.history, non_finite=found)
        return dataclasses.replace(result, history=history)
    epoch, step = schedule.locate(nan_steps[i])
    member = f"member {i}: " if loop.members is not None else ""
    raise NonFiniteLossError(
        f"The loss{' (or its gradient)' if loop.step.norms else ''} was not finite at "
        f"{member}epoch {epoch}, step {step} of "
        f"{schedule.steps_per_epoch} (counted from 1). Training stopped there; the last "
        "finite model, from before that step, is in this error's `.result`. Pass "
        "`on_nan='skip'` to skip such steps, or `on_nan='stop'` to return early without "
        "an error." + ("" if found is None else f"\n{found}"),
        result,
        epoch,
        step,
        found,
    )


def _warn_of_nan_monitor(loop: Loop, history: History) -> None:
    """Warns where early stopping's monitor was NaN at an epoch it looked at: such an
    epoch never improves, so it counts towards the patience, and may stop the run.
    """
    rule = loop.early_stopping
    if rule is None:
        return
    epochs, where = history.epoch, "epoch(s) {} (counted from 1)"
    values = _entry(history.values, rule.monitor)
    looked = epochs > rule.start_from_epoch
    validation, judging = loop.validation, loop.val_steps.judging(rule.monitor, loop.val_names)
    by_epoch = not judging.by_steps
    if not by_epoch:
        # Each validation was judged (`validation_every`), numbered `step // every`.
        epochs, where = history.validation_steps, "the validation(s) after step(s) {}"
        values = _entry(history.validations, rule.monitor)
        looked = judging.number(loop.schedule, epochs) > rule.start_from_epoch
    elif rule.monitor in loop.val_names and validation is not None and validation.freq != 1:
        looked &= epochs % validation.freq == 0
    assert values is not None
    nan = np.isnan(values)
    if values.ndim > 1:  # an ensemble's: a member stopped early has NaN after, as it should
        ran = history.batch_sizes.sum(axis=1) > 0 if by_epoch else True
        nan = (nan & ran).any(axis=-1)
    found = epochs[looked & nan].tolist()
    if not found:
        return
    shown = ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")
    shown = where.format(shown)
    cause = (
        "a non-finite loss, or a validation set whose `eqfit.Mean` weights sum to 0"
        if rule.monitor in loop.val_names
        else "a non-finite loss, or an epoch whose `eqfit.Mean` weights sum to 0"
    )
    warnings.warn(
        f"EarlyStopping's monitor {rule.monitor!r} was NaN at {shown}, which never improves "
        "on the best and so counts towards the patience "
        f"({rule.patience}). A NaN comes from {cause}.",
        RuntimeWarning,
        stacklevel=4,
    )


def _entry(values: dict[str, np.ndarray], name: str) -> np.ndarray | None:
    """The history's values of `name`, or of an array value's entry `name/i/j` (the
    history holds the array, `(epochs, i, j)`); `None` where it has neither.
    """
    if name in values:
        return values[name]
    found = ENTRY.search(name)
    if found is None or name[: found.start()] not in values:
        return None
    index = tuple(int(i) for i in found.group()[1:].split("/"))
    return values[name[: found.start()]][(slice(None), *index)]


def outcome_epochs(loop: Loop, outcome: Outcome) -> list[int]:
    """Epochs of this run that each member had a step in (a cut-short one counts)."""
    steps = np.asarray(outcome.read.step).reshape(-1)
    return [loop.schedule.run_epochs(int(t)) for t in steps.tolist()]


def _validations(
    loop: Loop, table: Validations | None, squeeze: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The history's `validation_steps` and `validations` (`validation_every`): the
    validations any member made, NaN for a member that did not.
    """
    steps = loop.val_steps
    if not isinstance(steps, EveryNSteps) or table is None:
        return np.zeros(0, np.int64), {}
    values, done = np.asarray(table.values), np.asarray(table.done)
    if loop.members is None:
        values, done = values[None], done[None]
    made = done.any(axis=0)
    values = np.where(done[..., None], values, np.nan)[:, made]
    at = steps.steps_of(loop.schedule, np.flatnonzero(made))
    by_name = {name: squeeze(values[..., i]).copy() for i, name in enumerate(loop.val_names)}
    return at.astype(np.int64), grouped(by_name, loop.record.array_values(loop.val_sets))


def _result(
    loop: Loop, outcome: Outcome, consts: Consts, began: float
) -> tuple[FitResult[Any], list[StopReason]]:
    """The result of a run, from its final state and the last call's report, and why
    each member stopped.
    """
    report, state, read, schedule = outcome.report, outcome.state, outcome.read, loop.schedule
    steps, codes, best = (
        np.asarray(x).reshape(-1) for x in (read.step, read.reason, read.best_epoch)
    )
    table, step_loss, step_values, sizes = map(
        np.asarray, (read.epoch_values, read.step_loss, read.step_values, read.batch_sizes)
    )
    wall_time = time.perf_counter() - began  # `began`: when `fit` began
    ensemble = loop.members is not None
    if not ensemble:  # a single model is an ensemble of one here
        table, step_loss, step_values, sizes = (
            table[None],
            step_loss[None],
            step_values[None],
            sizes[None],
        )
    reasons = _stop_reasons(steps, codes, schedule, outcome)
    best_epochs, best_steps = _best(loop, best)
    rows = max(outcome_epochs(loop, outcome))

    def squeeze(x: np.ndarray) -> np.ndarray:  # (members, rows, ...) -> (rows, ..., members)
        return x[0] if not ensemble else np.moveaxis(x, 0, -1)

    # Copies: the transfer's arrays are read-only, and each value gets its own.
    values = squeeze(table[:, :rows])
    history = History(
        grouped(
            {name: values[:, i].copy() for i, name in enumerate(loop.log_names)},
            loop.record.array_values(loop.val_sets),
        ),
        squeeze(step_loss[:, :rows]).copy(),
        squeeze(sizes[:, :rows]).copy(),
        wall_time,
        tuple(best_epochs) if ensemble else best_epochs[0],
        tuple(reasons) if ensemble else reasons[0],
        schedule.first_epoch,
        {
            name: squeeze(step_values[:, :rows, :, i]).copy()
            for i, name in enumerate(loop.record.names)
            if name in loop.record.shown  # a weighted mean's weights are not shown
        },
        _throughput(outcome.epoch_figures, schedule.first_epoch, rows),
        *_validations(loop, read.validations, squeeze),
        tuple(best_steps) if ensemble else best_steps[0],
        microbatches=loop.step.microbatches,
    )
    if report.trained is not None:
        params, model_state, average = report.trained
    else:
        params, model_state, average = state.params, state.model_state, state.average
    params, model_state, opt_state, average = loop.placement.get(
        (params, model_state, state.opt_state, average)
    )
    ema_model = None if average is None else model_from(loop, average, consts)
    return FitResult(
        model_from(loop, params, consts), opt_state, history, model_state, ema_model
    ), reasons


def _stop_reasons(
    steps: np.ndarray, codes: np.ndarray, schedule: Schedule, outcome: Outcome
) -> list[StopReason]:
    """Why each member stopped, from the step it reached and the stop code its state
    holds, else from how the drive ended.
    """
    reasons: list[StopReason] = []
    for step, code in zip(steps.tolist(), codes.tolist()):
        if code in NON_FINITE_STOPS:
            reasons.append("non_finite_loss")
        elif code == Stop.EARLY_STOPPING:
            reasons.append("early_stopping")
        elif step >= schedule.total:
            reasons.append(None)
        elif outcome.interrupted:
            reasons.append("interrupted")
        elif outcome.stopped_by_callback:
            reasons.append("callback")
        elif isinstance(outcome.failure, CheckpointError):
            reasons.append("checkpoint_error")
        elif outcome.failure is not None:
            reasons.append("error")
        else:
            reasons.append("out_of_data")
    return reasons


def _best(loop: Loop, best: np.ndarray) -> tuple[list[int | None], list[int | None]]:
    """Each member's best epoch by early stopping (`None` without it, or with no best
    yet), and its best validation's step where early stopping counted validations.
    """
    rule = loop.early_stopping
    best_epochs = [b if rule is not None and b >= 0 else None for b in best.tolist()]
    if rule is None:
        return best_epochs, [None for _ in best_epochs]
    # Where early stopping counted validations (`validation_every`), its best is one.
    judging = loop.val_steps.judging(rule.monitor, loop.val_names)
    pairs = [judging.best(loop.schedule, b) for b in best_epochs]
    return [e for e, _ in pairs], [t for _, t in pairs]


def _throughput(
    figures: dict[int, dict[str, float]], first_epoch: int, rows: int
) -> dict[str, np.ndarray]:
    """Each epoch's wall seconds, steps and samples per second, as the driver timed them
    (NaN for an epoch it did not time whole: cut short, or begun before a resume), and the
    figures that go with them (FLOP/s, MFU, the checkpoints' blocked seconds).
    """
    epochs = range(first_epoch + 1, first_epoch + rows + 1)
    # FLOP/s and MFU only where the run knew its step's cost; a checkpoint's blocked
    # seconds where it wrote them.
    known = (*Throughput.COSTS, *Throughput.CHECKPOINTS)
    names = [*Throughput.TIMES, *(n for n in known if _any(figures, n))]
    return {
        name: np.array([figures.get(e, {}).get(name, np.nan) for e in epochs]) for name in names
    }


def _any(figures: dict[int, dict[str, float]], name: str) -> bool:
    return any(name in f for f in figures.values())


def model_from(loop: Loop, params: Any, consts: Consts) -> Any:
    """The model with `params` as its trained arrays, each in the model's own dtype. Only
    the trained arrays come back: the frozen ones are the caller's, untouched. (The
    result's model, and the one a callback sees at an epoch's end.)
    """
    trained = jax.tree.leaves(params)
    if loop.trained_dtypes is not None:  # from the master copy's precision
        trained = [x.astype(d) for x, d in zip(trained, loop.trained_dtypes)]
    it, frozen = iter(trained), iter(consts.frozen)
    arrays = [next(it) if t else next(frozen) for t in loop.trains]
    return unwrap(loop.model.fill(arrays))
