"""What watches a run from the host: the observers the driver tells as it goes.

The driver (`_drive.drive`) calls the compiled run piece by piece; each observer meets
it through one small protocol, `Observer`: it may bound the next call, ask that reports be
read before training goes past a position, see each call's (future) state, and read the
reports. The bar or a log's lines (`_progress.py`), the user's callbacks, the checkpoints
(`_checkpointing.py`), the profile (`_profiling.py`) and Ctrl-C are observers, and so are
the throughput figures each epoch's values carry.
"""

import collections
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast, NamedTuple, Protocol, runtime_checkable, TypeVar

import jax
from jaxtyping import PyTree

from .._program._schedule import Schedule
from .._program._state import TrainState
from .._step._record import CHECKPOINT_BLOCKED, THROUGHPUT_COSTS, THROUGHPUT_TIMES


@runtime_checkable
class Callback(Protocol):
    """Called on the host after each epoch: any object with this method.

    It may also have `on_train_begin(config)`, called once before the first step with
    the run's arguments as plain JSON-able values (`train_config`'s: epochs,
    initial_epoch, batch_size, steps_per_epoch, shuffle, drop_remainder, on_nan, metrics,
    validation, validation_split, early_stopping, precision, ema, validate_ema, norms,
    microbatches, remat, ensemble_members, devices, checkpoint, checkpoint_every,
    checkpoint_every_steps, checkpoint_every_seconds, signals, schedules, profile,
    log_every, validation_every); `on_train_batch_end(step, logs)`, called with
    `fit(..., log_every=n)` after every n-th step with the step's global number (the
    steps done since the first ever) and the n steps' training values (Keras's hook of
    that name gets the batch's index in its epoch, and every batch);
    `on_validation_end(step, logs)`, called with `fit(..., validation_every=n)` after
    each validation with its step's global number and its values (`val_loss`, ...),
    after that step's `on_train_batch_end`; `on_train_end(logs)`,
    called once when training ends (however it ends, `on_train_begin` called or not) with
    the last epoch's values; and a class attribute `stops_training = False` if it never
    returns `True`: then the device is not held up for it, nor is the run cut into a call
    an epoch for it: it sees the epochs (and n-th steps) each call of the program reached,
    in order, once that call is done and the next is queued (calls of about half a
    second, or an epoch each where epochs are longer than about 50 ms). One with
    `on_epoch_model(epoch, model, ema_model)` also sees the model at each epoch's end
    ([`eqfit.ModelCallback`][]).
    """

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> bool | None:
        """`epoch` is counted from 1 and `logs` holds its values by name. Return `True` to
        stop training.
        """
        ...


_Model_contra = TypeVar("_Model_contra", contravariant=True)


class ModelCallback(Callback, Protocol[_Model_contra]):
    """A callback that also sees the model at each epoch's end: one with this method
    besides `on_epoch_end` (to generate a sample, say, or to evaluate it its own way).

    The model is the one `fit` would return after that epoch, of the caller's class and
    dtypes (`fit(..., epochs=epoch)`'s `result.model`, bit for bit): an ensemble's
    stacked members, one replica under `devices=`, laid out as trained under `shard=`.
    It is taken on the device when the epoch ends, a copy that later steps leave alone,
    so the device does not wait for the callback (with `stops_training = False`, it
    trains on meanwhile).

    !!! example

        ```python
        class Sample(eqfit.ModelCallback[MyModel]):
            def on_epoch_end(self, epoch, logs):
                pass

            def on_epoch_model(self, epoch, model, ema_model):
                print(epoch, generate(model, prompt))
        ```
    """

    def on_epoch_model(
        self, epoch: int, model: _Model_contra, ema_model: _Model_contra | None
    ) -> None:
        """Called after `on_epoch_end(epoch, logs)`, with the model at epoch `epoch`'s
        end, and with `fit(..., ema=)` the moving average as a model too (else `None`).
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
    # With `log_every=n`: each n-th step reached (its global count), with the training
    # values of the n steps before it.
    logged: tuple[tuple[int, dict[str, float]], ...] = ()
    # With `validation_every=n`: each validation made (its step), with its values.
    validated: tuple[tuple[int, dict[str, float]], ...] = ()


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
    - `epoch_figures(begin, end)`: what it adds to the throughput figures of the epoch of
        the steps after `begin` up to `end`, once its reports are read (the checkpoints'
        blocked seconds).
    - `end(position, state)`: the drive is over, not by an error, at `position` with
        `state`; what it raises (a `CheckpointError`) is the run's failure.
    - `finished()`: `fit` has made its result, or is raising its error: called inside
        the `except` clause then, so that `sys.exc_info()` tells how the run ended (a
        logger marks its run FINISHED, FAILED or KILLED by it).
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

    def epoch_figures(self, begin: int, end: int) -> dict[str, float]:
        return {}

    def end(self, position: int, state: TrainState) -> None:
        pass

    def close(self) -> None:
        pass

    def finished(self) -> None:
        pass


class Callbacks(Observer):
    """The user's callbacks: each sees every epoch's values, and may stop training.
    Those with `on_epoch_model` see the model too: at each epoch's end its trained arrays
    (and their average) are copied on the device (`take`), queued behind the call, and
    made into models (`make`) once the epoch's report is read.
    """

    def __init__(
        self,
        callbacks: Sequence[Callback],
        schedule: Schedule,
        config: dict[str, Any],
        models: "EpochModels | None" = None,
    ):
        self.callbacks, self.schedule, self.config = callbacks, schedule, config
        # Unless every callback says it never stops training, the driver waits at each
        # epoch's end for them before training on.
        self.may_stop = any(getattr(c, "stops_training", True) for c in callbacks)
        self.last_logs: dict[str, float] = {}
        self.stopped = False
        self.watch = [callable(getattr(c, "on_epoch_model", None)) for c in callbacks]
        hooks = [getattr(c, "on_train_batch_end", None) for c in callbacks]
        self.batch_ends = [hook for hook in hooks if callable(hook)]  # `log_every`'s
        hooks = [getattr(c, "on_validation_end", None) for c in callbacks]
        self.validation_ends = [hook for hook in hooks if callable(hook)]  # `validation_every`'s
        self.models = models if any(self.watch) else None
        # Copies of the trained arrays at epoch ends, by position, until their epoch's
        # report is read; while the epoch's length is learned, the last call's.
        self.taken: dict[int, PyTree] = {}

    def boundary(self, position: int) -> int | None:
        # Calls end at each epoch's end only where a callback acts there: one that may
        # stop training (the run stops at that end) or sees the model (taken there).
        # Others are told of every epoch and n-th step a call reached once it is read, as
        # the history is: a call an epoch would cost a dispatch and a report each.
        if self.may_stop or self.models is not None:
            return self.schedule.next_epoch_end(position)
        return None

    def waits(self, position: int) -> bool:
        return self.may_stop and self.schedule.is_epoch_end(position)

    def open(self) -> None:
        for callback in self.callbacks:
            begin = getattr(callback, "on_train_begin", None)
            if callable(begin):
                begin(dict(self.config))

    def after_call(self, position: int, state: TrainState) -> None:
        if self.models is None:
            return
        if self.schedule.learning:  # this call may end the first epoch: none knows yet
            self.taken = {position: self.models.take(state)}
        elif self.schedule.is_epoch_end(position):  # before the next call donates it
            self.taken[position] = self.models.take(state)

    def learned(self, schedule: Schedule) -> None:
        self.schedule = schedule
        # The first epoch ended where the last call before this ended.
        self.taken = {p: x for p, x in self.taken.items() if p == schedule.steps_per_epoch}

    def on_progress(self, progress: Progress) -> bool:
        # By step, a step's training values before its validation's (as Lightning
        # validates after the batch's end).
        # A deque: a call of many epochs tells each of its rows in turn, in O(1) each.
        logged = collections.deque(
            sorted(
                [(step, 0, logs) for step, logs in progress.logged]
                + [(step, 1, logs) for step, logs in progress.validated],
                key=lambda event: event[:2],
            )
        )
        for epoch, logs in progress.ended:
            # The n-th steps up to the epoch's end first (a step at its end too), as
            # Keras calls `on_train_batch_end` before `on_epoch_end`.
            end = epoch * self.schedule.steps_per_epoch
            while logged and logged[0][0] <= end:
                self.tell(*logged.popleft())
            self.last_logs = logs
            taken = self.taken.pop(epoch * self.schedule.steps_per_epoch, None)
            models = None
            for callback, watches in zip(self.callbacks, self.watch):
                if callback.on_epoch_end(epoch, dict(logs)):
                    self.stopped = True
                if watches and taken is not None:
                    assert self.models is not None
                    models = self.models.make(taken) if models is None else models
                    cast(ModelCallback[Any], callback).on_epoch_model(epoch, *models)
            if self.stopped:
                break
        if not self.stopped:
            for event in logged:
                self.tell(*event)
        return self.stopped

    def tell(self, step: int, validation: int, logs: dict[str, float]) -> None:
        """The callbacks told of step `step`: its training values (`log_every`, with
        `on_train_batch_end`), or where `validation` its validation's (`validation_every`,
        with `on_validation_end`).
        """
        for hook in self.validation_ends if validation else self.batch_ends:
            hook(step, dict(logs))

    def close(self) -> None:
        self.taken.clear()

    def finished(self) -> None:
        for callback in self.callbacks:
            end = getattr(callback, "on_train_end", None)
            if callable(end):
                end(dict(self.last_logs))


class EpochModels(NamedTuple):
    """How `Callbacks` gets the model at an epoch's end: `take(state)` copies its trained
    arrays and their average on the device (one replica of each, with several), and
    `make(taken)` turns the copies into the caller's models, `(model, ema_model)`.
    """

    take: Callable[[TrainState], PyTree]
    make: Callable[[PyTree], tuple[Any, Any]]


def copy_taken(tree: PyTree) -> PyTree:
    """New buffers holding `tree`'s arrays, laid out as they are: the devices' copies,
    queued behind the call that made them, with no program compiled (the models a
    callback sees, a checkpoint's state written beside the training).
    """
    return jax.device_put(tree, may_alias=False)


class Costs:
    """What a step costs, for FLOP/s and MFU: its FLOPs over the whole batch (every
    device's share together), and the peak FLOP/s of every device together (`None` if
    unknown).

    The FLOPs are known (the run's plan's, or an earlier fit's), or `count()` counts them,
    tracing the step once more: seconds for a large model. That count runs in a thread of
    its own (under the caller's mesh: `in_thread`), begun (`start`) once the run's program
    is traced, so that it traces while XLA compiles the run rather than ahead of it; the
    first epoch's figures wait for it (`flops_per_step`), and `fit` for its end (`join`).
    A count that fails there is made again in the training thread, in the caller's whole
    context; an error of that one is a warning, and the figures are left out.
    """

    def __init__(
        self,
        flops_per_step: float | None,
        peak_flops: float | None,
        count: Callable[[], float] | None = None,
        in_thread: Callable[[Callable[[], float]], Callable[[], float]] = lambda count: count,
    ):
        self.counted, self.peak_flops, self.count = flops_per_step, peak_flops, count
        self.in_thread = in_thread
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, lower: Callable[..., Any], *args: Any) -> None:
        """Begins the count, where there is one to make and it has not begun, once
        `lower(*args)` has lowered the run's program for its first call: JAX keeps the
        lowering, and the call then only compiles, while the count traces (XLA compiles
        without Python's lock; tracing holds it). An error of `lower`'s is left to the
        call, which raises it with eqfit's notes.
        """
        if self.count is None or self.thread is not None:
            return
        try:
            lower(*args)
        except Exception:
            return  # the call raises it; nothing is counted
        # Not a daemon: Python waits for it before it exits (`join` does, before `fit`
        # returns), so that no exit leaves JAX tracing in the process.
        self.thread = threading.Thread(target=self._count, args=(self.in_thread(self.count),))
        self.thread.start()

    def _count(self, count: Callable[[], float]) -> None:
        try:
            self.counted = count()
        except BaseException as error:  # counted again by `flops_per_step`, or told
            self.error = error

    def flops_per_step(self) -> float | None:
        """The step's FLOPs, once counted (here, in the training thread, if the count has
        not begun or failed in its own); `None` where it failed here too.
        """
        if self.thread is not None:
            self.thread.join()
        if self.counted is None and self.count is not None:
            self.thread, self.error = None, None
            self._count(self.count)
            self.count = None  # counted once more at most
        self.join()
        return self.counted

    def join(self, warn: bool = True) -> None:
        """Waits for the count, if it began; warns of its error, once (with `warn`: not
        where `fit` is raising an error of its own, which a warning would hide under
        `-W error`).
        """
        if self.thread is not None:
            self.thread.join()
        error, self.error = self.error, None
        if error is not None and warn:
            warnings.warn(
                "eqfit could not count the FLOPs of a step, so the history has no "
                f"`flops_per_second` or `mfu`: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=2,
            )


class Throughput:
    """Wall seconds of the steps: a call's (from the end of the one before it to when the
    device finished it, `_drive.Stamp`) are shared evenly among its steps, and an epoch's
    are those of its steps; an epoch of a call of its own has its own. The clock starts
    when the first call is queued (its compilation is not counted) and runs on from
    there. With the step's `Costs`, the FLOP/s achieved, and their fraction
    of the devices' peak (MFU).
    """

    # Names of what it adds to each epoch's values: always, and with `Costs`; and what
    # the checkpoints' observer adds (`Observer.epoch_figures`).
    TIMES = THROUGHPUT_TIMES
    COSTS = THROUGHPUT_COSTS
    NAMES = TIMES + COSTS
    CHECKPOINTS = (CHECKPOINT_BLOCKED,)

    def __init__(
        self, schedule: Schedule, costs: Costs | None = None, samples_per_step: int | None = None
    ):
        self.schedule, self.costs = schedule, costs
        # The samples a step processes where the run's updates say (a rollout's
        # environment steps); else the batch's rows, by the schedule.
        self.samples_per_step = samples_per_step
        self.calls: list[tuple[int, int, float]] = []  # steps begin, end, and seconds
        self.last: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=5)

    def before_call(self, lower: Callable[..., Any], *args: Any) -> None:
        """Before each call of the run, with `args`: the first begins the count of the
        step's FLOPs, where they are to be counted, once `lower(*args)` has traced the
        call's program (`Costs.start`): the count then traces while XLA compiles it.
        """
        if self.costs is not None:
            self.costs.start(lower, *args)

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
        return sum(self.samples(b, e) for b, e, _ in last) / seconds

    def samples(self, begin: int, end: int) -> int:
        """The samples of the steps from `begin` to `end`."""
        if self.samples_per_step is not None:
            return (end - begin) * self.samples_per_step
        return self.schedule.samples(begin, end)

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
        figures = {
            "epoch_seconds": seconds,
            "steps_per_second": (stop - start) / seconds,
            "samples_per_second": self.samples(start, stop) / seconds,
        }
        costs = self.costs
        per_step = None if costs is None else costs.flops_per_step()
        if costs is not None and per_step is not None:
            # A smaller last batch costs less: each step's FLOPs go by its rows.
            full = (stop - start) * self.schedule.batch_size
            rows = self.schedule.samples(start, stop)
            flops = per_step * (stop - start) * rows / full
            figures["flops_per_second"] = flops / seconds
            if costs.peak_flops is not None:
                figures["mfu"] = figures["flops_per_second"] / costs.peak_flops
        return figures
