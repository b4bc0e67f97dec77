"""The one host driver: calls the compiled run piece by piece, and does everything that
happens between pieces: the bar, callbacks, checkpoints, the interrupt and resuming.

Its two producers of data are the in-memory source, one feed covering the whole run, and
the streamed ones (memmaps, loaders), a feed per chunk of batches. Whatever the feed, the
driver picks where each call stops: at the run's end on the compiled path, at checkpoint
boundaries, at each epoch's end when callbacks must see it before training goes on, and
every fraction of a second for the bar.
"""

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
from jaxtyping import PyTree

from ._checkpoint import CheckpointError, Checkpoints, Interrupt
from ._compile import PROGRAM_CACHE
from ._loop import Inputs, Loop, Report, run_key, TrainState
from ._parallel import Placement


@runtime_checkable
class Callback(Protocol):
    """Called on the host after each epoch: any object with this method.

    It may also have `on_train_end(logs)`, called once when training ends (however it
    ends) with the last epoch's values, and a class attribute `stops_training = False`
    if it never returns `True`: then the device is not held up for it, and it sees each
    epoch once the next one is queued.
    """

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> bool | None:
        """`epoch` is counted from 1 and `logs` holds its values by name. Return `True` to
        stop training.
        """
        ...


class Feed(NamedTuple):
    """Data for the steps before the global step `end`, as the program takes it."""

    inputs: Inputs
    end: int
    batch_size: int | None = None  # streamed: the size of the batches in this piece


@dataclasses.dataclass
class Plan:
    """Where the calls stop."""

    begin: int  # the global step the run starts from (after a resume, inside an epoch)
    total: int  # the run's last step
    steps_per_epoch: int
    seconds_per_call: float  # calls of about this long (measured as training goes)
    whole_epochs: bool = False  # calls end at epochs' ends (the compiled path)
    checkpoint_every: int | None = None  # epochs between checkpoints
    epoch_calls: bool = False  # a call per epoch at most (callbacks see each epoch)
    sync_epochs: bool = False  # read each epoch's values before training on (callbacks)


@dataclasses.dataclass
class Outcome:
    """How the drive ended: the final state, the last report, and why it stopped early."""

    state: TrainState
    report: Report
    stopped_by_callback: bool
    interrupted: bool
    failure: Exception | None = None  # a checkpoint that could not be written


class _Reader:
    """Reads the reports of calls in flight, in order, and tells the bar and the
    callbacks what they say. It reads a report only once the next call is queued, so the
    host never waits with the device idle.
    """

    def __init__(
        self,
        placement: Placement,
        names: tuple[str, ...],
        steps_per_epoch: int,
        first_epoch: int,
        begin: int,
        bar: "Bar | None",
        callbacks: Sequence[Callback],
    ):
        self.placement, self.names, self.per_epoch = placement, names, steps_per_epoch
        self.first_epoch = first_epoch
        self.bar, self.callbacks = bar, callbacks
        # Each call's report and the steps it was asked for.
        self.in_flight: list[tuple[Report, int]] = []
        self.finished = False  # stopped early, or a callback asked to stop
        # The step the last report read had reached (the run's start before any). Reads
        # count from it, not from where a call was asked to begin: after an early stop,
        # calls already queued report the step the run stopped at, behind their begin.
        self.done = begin
        self.by_callback = False
        self.last_logs: dict[str, float] = {}
        self.clock = time.perf_counter()

    def queued(self, report: Report, begin: int, stop: int) -> None:
        if not self.in_flight:  # the device starts on it now (its compilation is done)
            self.clock = time.perf_counter()
        self.in_flight.append((report, stop - begin))

    def read(self, keep: int = 0) -> float | None:
        """Reads every report in flight but the last `keep`; returns the seconds per step
        of the calls read (each read waits for its call to finish), if any.
        """
        steps = 0
        while len(self.in_flight) > keep:
            report, count = self.in_flight.pop(0)
            self._take(report)
            steps += count
        if not steps:
            return None
        now = time.perf_counter()
        seconds = (now - self.clock) / steps
        self.clock = now
        return seconds

    def _take(self, report: Report) -> None:
        WAITER.wait(report.step)
        host = self.placement.host(
            (report.step, report.stopped, report.loss_sum, report.epoch_values)
        )
        step, stopped, loss_sum, table = (np.asarray(x) for x in host)
        done = int(step.max())  # an ensemble's members stopped early are behind
        begin = self.done
        self.done = max(done, begin)
        if self.bar is not None and done > begin:
            # The epoch the run is in, or the one it stopped at.
            epoch = -(-done // self.per_epoch) if stopped.all() else done // self.per_epoch + 1
            self.bar.steps(done - begin, float(loss_sum.mean()), epoch)
        # Epochs are numbered from 1: epoch e ends at step e * steps_per_epoch.
        for epoch in range(begin // self.per_epoch + 1, done // self.per_epoch + 1):
            # An ensemble's values are its members' mean.
            row = table.reshape(-1, *table.shape[-2:])[:, epoch - 1 - self.first_epoch]
            logs = dict(zip(self.names, _mean_of_finished(row).tolist()))
            self.last_logs = logs
            if self.bar is not None:
                self.bar.epoch(epoch, logs)
            for callback in self.callbacks:
                if callback.on_epoch_end(epoch, dict(logs)):
                    self.finished = self.by_callback = True
            if self.finished:
                break
        if bool(stopped.all()):
            self.finished = True


def _mean_of_finished(rows: np.ndarray) -> np.ndarray:
    """The mean over members of each value, leaving out members that had stopped (NaN)."""
    finished = ~np.isnan(rows)
    total = np.where(finished, rows, 0.0).sum(axis=0)
    return total / np.maximum(finished.sum(axis=0), 1)


class Bar:
    """The tqdm bar. It is made at the first report, when the device already has work
    queued, and shows the epoch (counted from 1), the running loss and the last finished
    epoch's validation values, labelled with that epoch.
    """

    def __init__(
        self, total_steps: int, initial: int, steps_per_epoch: int, first_epoch: int, epochs: int
    ):
        self.total, self.initial = total_steps, initial
        self.per_epoch, self.first_epoch, self.epochs = steps_per_epoch, first_epoch, epochs
        self.made: Any = None
        self.shown, self.loss_sum, self.loss_steps = -1, 0.0, 0
        self.last: dict[str, str] = {}

    def _bar(self) -> Any:
        if self.made is None:
            from tqdm.auto import tqdm

            self.made = tqdm(
                total=self.total, initial=self.initial, unit="step", dynamic_ncols=True
            )
        return self.made

    def steps(self, count: int, loss_sum: float, epoch: int) -> None:
        """`count` more steps, their losses summing to `loss_sum`; now in `epoch`."""
        bar = self._bar()
        shown = min(epoch, self.epochs)
        if shown != self.shown:
            self.shown, self.loss_sum, self.loss_steps = shown, 0.0, 0
            bar.set_description(f"epoch {shown}/{self.epochs}", refresh=False)
        self.loss_sum += loss_sum
        self.loss_steps += count
        self._show()
        bar.update(count)

    def epoch(self, epoch: int, logs: dict[str, float]) -> None:
        """Epoch `epoch` ended with these values."""
        values = {k: f"{v:.4g}" for k, v in logs.items() if k.startswith("val_")}
        self.last = {"epoch": str(epoch), **values} if values else {}
        self._show()

    def _show(self) -> None:
        """The running loss of this epoch's steps, and the last finished epoch's values
        (named by its number, which may be the epoch before the one the bar is in).
        """
        loss = self.loss_sum / max(self.loss_steps, 1)
        self._bar().set_postfix({"loss": f"{loss:.4g}", **self.last}, refresh=False)

    def close(self) -> None:
        if self.made is not None:
            self.made.close()


class _Waiter:
    """Waits for device arrays in a thread of its own. The main thread then waits on a
    lock, which a signal interrupts, so that a second Ctrl-C gets through at once; a
    blocking wait for the device in the main thread would hold it until the device is
    done.
    """

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[tuple[Any, threading.Event]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def wait(self, array: Any) -> None:
        if array.is_ready():
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()
        done = threading.Event()
        self.requests.put((array, done))
        done.wait()

    def _serve(self) -> None:
        while True:
            array, done = self.requests.get()
            try:
                array.block_until_ready()
            except Exception:  # the main thread reads the array and meets the error
                pass
            done.set()


WAITER = _Waiter()


def drive(
    loop: Loop,
    program: Callable[[Loop], Callable[..., tuple[TrainState, Report]]],
    state: TrainState,
    feeds: Iterator[Feed],
    plan: Plan,
    *,
    bar: Bar | None = None,
    callbacks: Sequence[Callback] = (),
    store: Checkpoints | None = None,
    interrupt: Interrupt | None = None,
    save: Callable[[TrainState], PyTree] | None = None,
) -> Outcome:
    """Runs the compiled `program(loop)` over the feeds from `plan.begin` until the end,
    a stop or an interrupt.

    Each call is queued before the previous one's report is read: the host updates the
    bar while the device works. Calls last about `plan.seconds_per_call`, measured as
    training goes; with `plan.whole_epochs` they end at epochs' ends. Checkpoints, which
    need the state itself, wait for their call; so do epochs' ends when callbacks may stop
    training. After a Ctrl-C, training goes on to the next epoch's end and stops there.

    **Returns:**

    An `Outcome` with the final state and the last call's report.
    """
    reader = _Reader(
        loop.placement,
        loop.log_names,
        plan.steps_per_epoch,
        loop.first_epoch,
        plan.begin,
        bar,
        callbacks,
    )
    programs = {loop.batch_size: program(loop)}  # and for pieces of a smaller last batch
    per_epoch = plan.steps_per_epoch
    position, report = plan.begin, None

    # Calls are sized by the speed: the one measured by an earlier run of this
    # configuration, else by this run's first call, which is one short epoch, or 8 steps
    # of a long one (whole on the compiled path), to report soon.
    def steps_for(seconds_per_step: float) -> int:
        return max(1, int(plan.seconds_per_call / max(seconds_per_step, 1e-9)))

    known = PROGRAM_CACHE.speed(run_key(loop))
    if known is not None:
        steps_per_call = steps_for(known)
    else:
        steps_per_call = per_epoch if per_epoch <= 64 or plan.whole_epochs else 8
    # Steps between checkpoints; calls end at each.
    every = None
    if store is not None and plan.checkpoint_every:
        every = plan.checkpoint_every * per_epoch
    finished = interrupted = False
    failure = None
    try:
        for feed in feeds:
            while not finished:
                interrupted = interrupt is not None and interrupt.requested
                next_epoch = (position // per_epoch + 1) * per_epoch
                if interrupted and position % per_epoch == 0 and report is not None:
                    break  # at an epoch's end: stop here
                stop = min(plan.total, feed.end, position + steps_per_call)
                if plan.whole_epochs:
                    stop = max(stop // per_epoch * per_epoch, min(next_epoch, plan.total))
                if plan.epoch_calls or plan.sync_epochs or interrupted:
                    stop = min(stop, next_epoch)
                if every is not None:
                    stop = min(stop, (position // every + 1) * every)
                stop = min(max(stop, position), feed.end)  # a call with nothing to do reports
                size = feed.batch_size or loop.batch_size
                if size not in programs:
                    programs[size] = program(dataclasses.replace(loop, batch_size=size))
                state, report = programs[size](state, feed.inputs, np.int32(stop))
                reader.queued(report, position, stop)
                seconds = reader.read(keep=1)
                if seconds is not None:
                    steps_per_call = steps_for(seconds)
                    PROGRAM_CACHE.set_speed(run_key(loop), seconds)
                position = stop
                if plan.sync_epochs and position % per_epoch == 0:
                    reader.read()
                if every is not None and (position % every == 0 or position >= plan.total):
                    assert store is not None and save is not None
                    try:
                        store.save(save(state))
                    except CheckpointError as e:  # the result goes with the error
                        failure = e
                        break
                finished = reader.finished or position >= plan.total
                if position >= feed.end:
                    break
            if failure or finished or interrupted and position % per_epoch == 0 and report:
                break
        if report is None:  # no feed at all: nothing to train on from here
            raise ValueError("The data yielded no batches to train on.")
        WAITER.wait(report.step)
        if bar is not None or callbacks:
            reader.read()
    finally:
        if bar is not None:
            bar.close()
        for callback in callbacks:
            end = getattr(callback, "on_train_end", None)
            if callable(end):
                end(dict(reader.last_logs))
    return Outcome(
        state,
        report,
        stopped_by_callback=reader.by_callback,
        interrupted=interrupt is not None and interrupt.requested,
        failure=failure,
    )
