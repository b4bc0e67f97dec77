"""What watches a run from the host: the observers the driver tells as it goes.

The driver (`_drive.drive`) calls the compiled run piece by piece; each observer meets
it through one small protocol, `Observer`: it may bound the next call, ask that reports be
read before training goes past a position, see each call's (future) state, and read the
reports. The bar, the user's callbacks, the checkpoints and Ctrl-C are observers, and so
are the throughput figures each epoch's values carry.
"""

import collections
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np
from jaxtyping import PyTree

from ._checkpoint import Checkpoints, Interrupt
from ._loop import learned_config, TrainState
from ._schedule import Schedule


# The bar redraws about this often: its calls last at most this long.
SECONDS_PER_BAR_CALL = 0.2


@runtime_checkable
class Callback(Protocol):
    """Called on the host after each epoch: any object with this method.

    It may also have `on_train_begin(config)`, called once before the first step with
    the run's arguments as plain JSON-able values (`train_config`'s: epochs,
    initial_epoch, batch_size, steps_per_epoch, shuffle, drop_remainder, on_nan, metrics,
    validation, validation_split, early_stopping, precision, ema, validate_ema, norms,
    ensemble_members, devices, checkpoint, checkpoint_every); `on_train_end(logs)`,
    called once when training ends (however it ends, `on_train_begin` called or not) with
    the last epoch's values; and a class attribute `stops_training = False` if it never
    returns `True`: then the device is not held up for it, and it sees each epoch once the
    next one is queued.
    """

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> bool | None:
        """`epoch` is counted from 1 and `logs` holds its values by name. Return `True` to
        stop training.
        """
        ...


class Progress(NamedTuple):
    """What the host read of the calls done so far: the device's report, on the host."""

    position: int  # the global step reached
    stopped: bool  # the program stopped the run (every member of an ensemble)
    epoch: int  # the epoch (from 1) that the last step was in
    epoch_loss: float  # that epoch's mean loss so far (the epoch's own, once it ended)
    ended: tuple[tuple[int, dict[str, float]], ...]  # epochs that ended, with their values
    samples_per_second: float | None = None  # over the last few calls read


class Observer:
    """What watches the run from the host. Each method has a default that does nothing.

    - `seconds_per_call`: calls last at most about this long while it watches.
    - `open()`: the run starts (before its first call); `close()` follows, however the
        run ends.
    - `boundary(position)`: a position the next call must not pass (`None`: any).
    - `waits(position)`: whether the reports up to `position` must be read before
        training goes past it (a callback that may stop training there).
    - `after_call(position, state)`: the call to `position` is queued; `state` is its
        (future) training state.
    - `on_progress(progress)`: reports were read; returns `True` to stop training.
    - `learned(schedule)`: the first epoch showed the epoch's length (a loader without
        `len`); `schedule` is the run's from now on.
    - `close()`: the run is over, however it ended.
    """

    seconds_per_call: float | None = None
    schedule: Schedule

    def open(self) -> None:
        pass

    def learned(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def boundary(self, position: int) -> int | None:
        return None

    def waits(self, position: int) -> bool:
        return False

    def after_call(self, position: int, state: TrainState) -> None:
        pass

    def on_progress(self, progress: Progress) -> bool:
        return False

    def close(self) -> None:
        pass


class Bar(Observer):
    """The tqdm bar. It starts when the first call is queued (after compilation, so its
    rate is the training's), names the epoch the last step was in, and shows that epoch's
    mean loss (at its end, `history.loss`'s value) and the other values of the last epoch
    that ended (validation, aux values, norms).
    """

    seconds_per_call = SECONDS_PER_BAR_CALL

    def __init__(self, schedule: Schedule, begin: int, summary: str | None = None):
        self.schedule, self.begin = schedule, begin
        self.summary = summary  # the plan's line, printed above the bar
        self.made: Any = None
        self.shown = begin
        self.last: dict[str, str] = {}  # the last ended epoch's values, but its loss

    def after_call(self, position: int, state: TrainState) -> None:
        if self.made is None:
            from tqdm.auto import tqdm

            schedule = self.schedule
            if self.summary is not None:
                tqdm.write(self.summary, file=sys.stderr)
            # No tqdm rate: a step's rate means little, and tqdm's is of the last
            # redraw alone. The postfix shows samples per second over the last calls.
            self.made = tqdm(
                total=None if schedule.learning else schedule.total - schedule.begin,
                initial=self.begin - schedule.begin,
                unit="step",
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
            )

    def learned(self, schedule: Schedule) -> None:
        self.schedule = schedule
        if self.made is not None:
            self.made.total = schedule.total - schedule.begin
            self.made.refresh()

    def on_progress(self, progress: Progress) -> bool:
        if self.made is None or progress.position <= self.shown:
            return False
        epoch = min(progress.epoch, self.schedule.epochs)
        self.made.set_description(f"epoch {epoch}/{self.schedule.epochs}", refresh=False)
        for _, logs in progress.ended[-1:]:
            shown = (k for k in logs if k != "loss" and k not in Throughput.NAMES)
            self.last = {k: f"{logs[k]:.4g}" for k in shown}
        values = {"loss": f"{progress.epoch_loss:.4g}", **self.last}
        if progress.samples_per_second is not None:
            values["samples/s"] = f"{progress.samples_per_second:.4g}"
        self.made.set_postfix(values, refresh=False)
        self.made.update(progress.position - self.shown)
        self.shown = progress.position
        return False

    def close(self) -> None:
        if self.made is not None:
            self.made.close()


class Callbacks(Observer):
    """The user's callbacks: each sees every epoch's values, and may stop training."""

    def __init__(self, callbacks: Sequence[Callback], schedule: Schedule, config: dict[str, Any]):
        self.callbacks, self.schedule, self.config = callbacks, schedule, config
        # Unless every callback says it never stops training, the driver waits at each
        # epoch's end for them before training on.
        self.may_stop = any(getattr(c, "stops_training", True) for c in callbacks)
        self.last_logs: dict[str, float] = {}
        self.stopped = False

    def boundary(self, position: int) -> int:
        return self.schedule.next_epoch_end(position)  # calls end at each epoch's end

    def waits(self, position: int) -> bool:
        return self.may_stop and self.schedule.is_epoch_end(position)

    def open(self) -> None:
        for callback in self.callbacks:
            begin = getattr(callback, "on_train_begin", None)
            if callable(begin):
                begin(dict(self.config))

    def on_progress(self, progress: Progress) -> bool:
        for epoch, logs in progress.ended:
            self.last_logs = logs
            for callback in self.callbacks:
                if callback.on_epoch_end(epoch, dict(logs)):
                    self.stopped = True
            if self.stopped:
                break
        return self.stopped

    def close(self) -> None:
        for callback in self.callbacks:
            end = getattr(callback, "on_train_end", None)
            if callable(end):
                end(dict(self.last_logs))


class Checkpointing(Observer):
    """Writes a checkpoint every `every` epochs, at the run's end, and where a Ctrl-C
    stops it.
    """

    def __init__(
        self,
        store: Checkpoints,
        every: int,
        schedule: Schedule,
        save: Callable[[TrainState], PyTree],
        interrupt: Interrupt,
    ):
        self.store, self.save, self.schedule = store, save, schedule
        self.every = every  # epochs between checkpoints
        self.interrupt = interrupt
        self.relearned = False  # the epoch's length learned, the store not yet told

    def learned(self, schedule: Schedule) -> None:
        self.schedule, self.relearned = schedule, True

    def boundary(self, position: int) -> int:
        return self.schedule.next_epoch_end(position, self.every)

    def after_call(self, position: int, state: TrainState) -> None:
        # Also where a Ctrl-C stops the run: at an epoch's end.
        schedule = self.schedule
        if self.relearned:  # before the first checkpoint: none is written while learning
            config = learned_config(self.store.config, schedule, state)
            self.store.learned(config, schedule.steps_per_epoch)
            self.relearned = False
        stops = self.interrupt.requested and schedule.is_epoch_end(position)
        due = schedule.is_epoch_end(position, self.every) or position >= schedule.total
        if due or stops:
            self.store.save(self.save(state))


class Interrupting(Observer):
    """Ctrl-C: once asked, calls end at the epoch's end, and training stops there."""

    def __init__(self, interrupt: Interrupt, schedule: Schedule):
        self.interrupt, self.schedule = interrupt, schedule

    def boundary(self, position: int) -> int | None:
        if not self.interrupt.requested:
            return None
        return self.schedule.next_epoch_end(position)


class Costs(NamedTuple):
    """What a step costs, where it is known (the run's plan): for FLOP/s and MFU."""

    flops_per_step: float  # over the whole batch, every device's share together
    peak_flops: float | None  # of every device together; `None` if unknown


class Throughput:
    """Wall seconds of the steps, from when the host read each call's report: a call's
    seconds are shared evenly among its steps, and an epoch's are those of its steps.
    The clock starts when the first call is queued (its compilation is not counted) and
    runs on from there. With the step's `Costs`, the FLOP/s achieved, and their fraction
    of the devices' peak (MFU).
    """

    # Names of what it adds to each epoch's values: always, and with `Costs`.
    TIMES = ("epoch_seconds", "steps_per_second", "samples_per_second")
    COSTS = ("flops_per_second", "mfu")
    NAMES = TIMES + COSTS

    def __init__(self, schedule: Schedule, costs: Costs | None = None):
        self.schedule, self.costs = schedule, costs
        self.calls: list[tuple[int, int, float]] = []  # steps begin, end, and seconds
        self.last: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=5)

    def record(self, begin: int, end: int, seconds: float) -> None:
        if end > begin:
            self.calls.append((begin, end, seconds))
            self.last.append((begin, end, seconds))

    def recent(self) -> float | None:
        """Samples per second over the last few calls."""
        last = self.last
        seconds = sum(s for _, _, s in last)
        if not last or seconds <= 0:
            return None
        return sum(self.schedule.samples(b, e) for b, e, _ in last) / seconds

    def epoch(self, epoch: int) -> dict[str, float]:
        """The figures of epoch `epoch` (counted from 1), once its steps are all read;
        none for an epoch trained partly before this run (a resume).
        """
        length = self.schedule.steps_per_epoch
        start, stop = (epoch - 1) * length, epoch * length
        seconds = covered = 0.0
        for begin, end, took in self.calls:
            overlap = min(end, stop) - max(begin, start)
            if overlap > 0:
                covered += overlap
                seconds += took * overlap / (end - begin)
        self.calls = [c for c in self.calls if c[1] > stop]  # what later epochs need
        if covered < stop - start or seconds <= 0:
            return {}
        samples = self.schedule.samples(start, stop)
        figures = {
            "epoch_seconds": seconds,
            "steps_per_second": (stop - start) / seconds,
            "samples_per_second": samples / seconds,
        }
        costs = self.costs
        if costs is not None:
            # A smaller last batch costs less: each step's FLOPs go by its samples.
            full = (stop - start) * self.schedule.batch_size
            flops = costs.flops_per_step * (stop - start) * samples / full
            figures["flops_per_second"] = flops / seconds
            if costs.peak_flops is not None:
                figures["mfu"] = figures["flops_per_second"] / costs.peak_flops
        return figures


def observers_for(
    options: Any,
    schedule: Schedule,
    begin: int,
    store: Checkpoints | None,
    interrupt: Interrupt,
    placement: Any,
    summary: str | None = None,
) -> list[Observer]:
    """The run's observers, as its options ask: the bar (with the plan's `summary` above
    it), the callbacks, the checkpoints (which take the state off the devices to write
    it), and Ctrl-C.
    """
    observers: list[Observer] = []
    if options.progress:
        observers.append(Bar(schedule, begin, summary))
    if options.callbacks:
        observers.append(Callbacks(options.callbacks, schedule, train_config(options, schedule)))
    if store is not None:

        def save(state: TrainState) -> PyTree:
            if store.collective:  # every process writes its own shards
                return state
            return jax.device_get(placement.get(state))

        every = options.checkpoint_every
        observers.append(Checkpointing(store, every, schedule, save, interrupt))
    observers.append(Interrupting(interrupt, schedule))
    return observers


def train_config(options: Any, schedule: Schedule) -> dict[str, Any]:
    """The run's arguments as plain JSON-able values, for the callbacks' `on_train_begin`
    (the loggers' run config): what `fit` was asked, not the model or the data.
    """
    policy, average, placement = options.precision, options.average, options.placement
    mesh = getattr(placement, "mesh", None)
    if mesh is not None:
        devices = int(mesh.devices.size)
    else:
        devices = len(getattr(placement, "devices", ())) or 1
    checkpoint, precision = options.checkpoint, None
    if policy is not None:  # by its dtypes' names
        compute, params = np.dtype(policy.compute_dtype), np.dtype(policy.params_dtype)
        precision = {"compute": compute.name, "params": params.name}
    return {
        "epochs": schedule.epochs,
        "initial_epoch": options.initial_epoch,
        "batch_size": schedule.batch_size,
        "steps_per_epoch": None if schedule.learning else schedule.steps_per_epoch,
        "shuffle": options.shuffle,
        "drop_remainder": options.drop_remainder,
        "on_nan": options.on_nan,
        "metrics": list(options.metric_names),
        "validation": options.validates,
        "validation_split": options.validation_split,
        "early_stopping": None if options.early_stopping is None else repr(options.early_stopping),
        "precision": precision,
        "ema": None if average is None else average.momentum,
        "validate_ema": options.validate_ema,
        "norms": options.norms,
        "ensemble_members": options.members,
        "devices": devices,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "checkpoint_every": options.checkpoint_every,
    }
