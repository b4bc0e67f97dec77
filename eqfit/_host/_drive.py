"""The one host driver: calls the compiled run piece by piece until it ends.

`Drive` keeps the run's state as attributes and makes one call at a time: a `CallSizer`
decides how many steps the next call takes, `_Reader` reads each call's report once the
next one is queued and tells the observers (`_observers.py`: the bar, the callbacks, the
checkpoints, signals) through one small protocol; its `Clock` times the calls, its
`FirstEpoch` keeps the steps of a first epoch that teaches the epoch's length. Streamed
data arrives through `_feeds.ReadAhead`.
"""

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._core._execution import check_steps
from .._keep._directory import CheckpointError
from .._program._calls import Program, program_key
from .._program._compile import PROGRAM_CACHE, Starting
from .._program._loop import Loop
from .._program._parallel import copying
from .._program._records import learned_state
from .._program._state import Ending, Report, Steps, Stop, Taken, TrainState
from ._feeds import DataError, Feed, feeds as feeds, from_data
from ._observers import Costs, Observer, Progress, Throughput
from ._signals import Interrupt
from ._waiter import Stamp, wait_for, WAITER


# Calls of the program last about this long, so that the host reports often and a Ctrl-C
# is answered soon, whatever an epoch's length; the bar redraws more often. A call costs a
# dispatch and a sync, which is nothing next to either.
SECONDS_PER_CALL = 0.5
# Epochs at least this long (by the run's mean speed so far) get a call each, so that each
# is timed by itself as its call finishes. Shorter ones share calls, each epoch an even share
# of its call: a call a shorter epoch costs host work (dispatch, report) worth more than
# about a percent of it.
SECONDS_PER_TIMED_EPOCH = 0.05
# Before a run's speed is known, calls grow from one step (1, 2, 4, ...) until a call's
# report has been read: a step may take a second, and the bar must move soon after it is
# drawn. Then calls go by the measured speed.
FIRST_CALL_STEPS = 1


class Outcome(NamedTuple):
    """How the drive ended: the final state, the last report, and what stopped it;
    `loop` is the run's, with the epoch's length learned if it was to be.
    """

    loop: Loop
    state: TrainState
    report: Report
    stopped_by_callback: bool
    interrupted: bool
    # The signal that stopped training ("SIGINT" for Ctrl-C, "SIGTERM", ...), if one did.
    signal: str | None
    # What ended the drive early, to raise with the result: a checkpoint that could not
    # be written, or an error of the data's (a loader that raised).
    failure: BaseException | None
    read: Ending  # what the result reads of `report` and `state`, on the host
    # Each epoch's wall seconds, steps and samples per second (`Throughput.epoch`).
    epoch_figures: dict[int, dict[str, float]] = {}


class CallSizer:
    """How many steps the next call takes: about `SECONDS_PER_CALL` (or less, as the
    observers ask) by the speed measured so far, or by an earlier run's of this
    configuration; before any is known, 1, 2, 4, ... steps. Calls end at the epoch end of
    an epoch long enough to be timed by itself, at every observer's boundary, and at the
    feed's end.
    """

    def __init__(self, loop: Loop, observers: Sequence[Observer]):
        self.loop, self.observers = loop, observers
        self.seconds_per_call = min(
            [SECONDS_PER_CALL] + [o.seconds_per_call or 1e9 for o in observers]
        )
        known = PROGRAM_CACHE.fact(program_key(loop), "seconds_per_step")
        if known is not None:  # measured by an earlier run of this configuration
            self.steps = max(1, int(self.seconds_per_call / max(known, 1e-9)))
        else:
            self.steps = FIRST_CALL_STEPS
        self.measured = known is not None
        # Over a whole earlier run: its last call may have missed the epochs that cost more.
        self.known_mean = PROGRAM_CACHE.fact(program_key(loop), "mean_seconds_per_step")

    def stop(
        self, position: int, end: int, mean: float | None, snap: Callable[[int, int], int]
    ) -> int:
        """Where the call from `position` stops, in a feed that ends at `end`; `mean`:
        this run's mean seconds per step so far, if known; `snap`: the program's
        (`Program.snap`), where a stop that time chooses moves to.
        """
        schedule = self.loop.schedule
        stop = schedule.call_stop(position, self.steps, at_epoch_ends=True)
        # By the slower of this run's mean speed so far and an earlier run's, since calls
        # queued ahead are not read yet: an epoch that validates may be one.
        speed = max(mean or 0.0, self.known_mean or 0.0)
        if schedule.steps_per_epoch * speed >= SECONDS_PER_TIMED_EPOCH:
            stop = min(stop, schedule.next_epoch_end(position))  # timed by itself
        stop = snap(position, stop)
        for observer in self.observers:
            boundary = observer.boundary(position)
            if boundary is not None:
                stop = min(stop, boundary)
        return max(min(stop, end), position)

    def measure(self, seconds: float | None, mean: float | None) -> None:
        """Sizes the next calls by the seconds per step of the calls just read (`None`:
        none read, or only a compiling one), and remembers them for the next run.
        """
        if seconds is not None:
            self.steps = max(1, int(self.seconds_per_call / max(seconds, 1e-9)))
            PROGRAM_CACHE.set_fact(program_key(self.loop), "seconds_per_step", seconds)
            PROGRAM_CACHE.set_fact(program_key(self.loop), "mean_seconds_per_step", mean)
            self.measured = True
        elif not self.measured:
            self.steps *= 2


class Clock:
    """The calls' times: from the first call's start on, the clock runs on, so that an
    epoch's seconds are its wall time, the host's work between calls (callbacks,
    checkpoints) included.
    """

    def __init__(self) -> None:
        self.taken = time.perf_counter()
        self.started = False  # whether a call was queued
        self.seconds, self.steps = 0.0, 0  # of the calls read

    def start(self, since: float | None) -> None:
        """A call is queued; the first starts the clock (its compilation is done), at
        `since` if it ran before it returned.
        """
        if not self.started:
            self.taken = time.perf_counter() if since is None else since
            self.started = True

    def finished(self, at: float) -> float:
        """A call finished on the device `at`: the seconds it took, from the end of the
        one before it (or from the start), not from when the host got to read it.
        """
        took, self.taken = max(at - self.taken, 0.0), max(at, self.taken)
        self.seconds += took
        return took

    def mean(self) -> float | None:
        """The seconds per step of every call read so far, if any ran a step."""
        return self.seconds / self.steps if self.steps else None


class FirstEpoch:
    """The record of the first epoch's steps, kept on the host from each call's report
    while the epoch's length is learned (a loader without `len`).
    """

    def __init__(self, ensemble: bool):
        self.axis = 1 if ensemble else 0  # the steps' axis: after an ensemble's members'
        self.calls: list[Steps] = []

    def add(self, steps: Steps, columns: np.ndarray) -> None:
        """A call's steps, from its report's record (`columns` its steps' columns)."""
        self.calls.append(Steps(*(np.take(x, columns, axis=self.axis) for x in steps)))

    def steps(self, length: int) -> Steps | None:
        """The first epoch's steps, up to `length` of them; `None` before any call."""
        if not self.calls:
            return None
        joined = [np.concatenate(x, axis=self.axis) for x in zip(*self.calls)]
        kept = [np.arange(min(length, x.shape[self.axis])) for x in joined]
        return Steps(*(np.take(x, k, axis=self.axis) for x, k in zip(joined, kept)))


class _Reader:
    """Reads the reports of calls in flight, in order, once the next call is queued (so
    the host never waits with the device idle), and hands what they say to the observers.
    """

    def __init__(self, loop: Loop, begin: int, observers: Sequence[Observer], costs: Costs | None):
        self.loop, self.observers = loop, observers
        # Each call's report, begin and stop, and when the device finished it.
        self.in_flight: list[tuple[Report, int, int, Stamp]] = []
        self.first_epoch = FirstEpoch(loop.members is not None)
        self.finished = False  # the program stopped, or an observer asked to stop
        self.by_observer = False
        # The position the last report read had reached. Reads count from it, not from
        # where a call was asked to begin: after an early stop, calls already queued report
        # the step the run stopped at, behind their begin.
        self.done = begin
        self.clock = Clock()
        self.throughput = Throughput(loop.schedule, costs, loop.samples_per_step)
        self.epoch_figures: dict[int, dict[str, float]] = {}  # by epoch: `Throughput.epoch`

    def queued(self, report: Report, begin: int, stop: int, since: float | None = None) -> None:
        """`since`: when the call began, for one that ran before it returned (`drive`)."""
        self.clock.start(since)
        self.in_flight.append((report, begin, stop, WAITER.stamp(report.step)))

    def read(self, keep: int = 0) -> float | None:
        """Reads every report in flight but the last `keep`; returns the seconds per step
        of the calls read (each read waits for its call to finish), if any: by when the
        device finished them, not by when the host read them (a host that waited for the
        device meanwhile, writing a checkpoint, reads a call long done).
        """
        steps, seconds = 0, 0.0
        # Every copy begun before any read waits: the reads wait one transfer in all.
        copying([Taken.of(r) for r, *_ in self.in_flight[: max(len(self.in_flight) - keep, 0)]])
        while len(self.in_flight) > keep:
            calls = [self.in_flight.pop(0)]
            calls[0][3].wait()
            # Calls queued after it that were done by when it was stamped (the waiter's
            # thread woke late for it, on a busy machine, and they were done when queued,
            # or when the thread got to them): the device finished them all by then, so
            # they are timed as one call, their seconds shared by their steps, rather than
            # the first taking them all and the others none.
            while self.in_flight and _done_by(self.in_flight[0][3], calls[-1][3]):
                calls.append(self.in_flight.pop(0))
            # A call lasts from the end of the one before it (or from the start) to its
            # own: the host's work between them counts, but not when it got to read it.
            took = self.clock.finished(min(finished.at for *_, finished in calls))
            seconds += took
            end = max(self._position(calls[-1][0]), self.done)
            self.throughput.record(self.done, end, took)
            for report, begin, stop, _ in calls:
                self._take(report, begin, stop)
                steps += stop - begin
        return seconds / steps if steps else None

    def _position(self, report: Report) -> int:
        """The position a report says the run reached (an ensemble's furthest member's)."""
        return int(np.asarray(self.loop.placement.host(report.step)).max())

    def _take(self, report: Report, call_begin: int, call_stop: int) -> None:
        placement, schedule = self.loop.placement, self.loop.schedule
        self.throughput.schedule = schedule  # learned, maybe, since
        if report.steps is not None:  # the first epoch, while it teaches its length
            columns = np.arange(call_begin, call_stop) % schedule.columns
            self.first_epoch.add(placement.host(report.steps), columns)
        taken = placement.host(Taken.of(report)._replace(steps=None))  # its steps: above
        step, reason, table = map(np.asarray, (taken.step, taken.reason, taken.epoch_values))
        stopped = bool((reason != Stop.RUNNING).all())
        position = max(int(step.max()), self.done)  # members stopped early are behind
        begin, self.done = self.done, position
        self.clock.steps += position - begin
        ended, names = [], self.loop.log_names
        done, now = schedule.epochs_ended(begin), schedule.epochs_ended(position)
        # Read in one pass; an ensemble's values: the mean of the members not stopped.
        rows = table.reshape(-1, *table.shape[-2:])[:, done - schedule.first_epoch :]
        means = _mean_of_finished(rows[:, : now - done]).tolist() if now > done else []
        for epoch, values in zip(range(done + 1, now + 1), means):
            logs = dict(zip(names, values))
            figures = self.throughput.epoch(epoch)
            start = (epoch - 1) * schedule.steps_per_epoch
            for observer in self.observers:  # each epoch's, kept where it was timed whole
                more = observer.epoch_figures(start, start + schedule.steps_per_epoch)
                figures |= more if figures else {}
            self.epoch_figures[epoch] = figures
            ended.append((epoch, logs | figures))
        last = max(position - 1, schedule.begin)
        if ended and ended[-1][0] == schedule.epoch_of(last):
            loss = ended[-1][1]["loss"]  # at the epoch's end: its own value, as recorded
        else:  # inside an epoch: its running mean (of the members still training)
            losses = np.asarray(taken.epoch_loss).reshape(-1)
            finite = losses[np.isfinite(losses)]
            loss = float(finite.mean()) if finite.size else float("nan")
        progress = Progress(
            position=position,
            stopped=stopped,
            epoch=int(schedule.epoch_of(last)),
            epoch_loss=loss,
            ended=tuple(ended),
            samples_per_second=self.throughput.recent(),
            logged=self._logged(report, begin, position),
            validated=self._validated(report, begin, position),
        )
        for observer in self.observers:
            if observer.on_progress(progress):
                self.finished = self.by_observer = True
        self.finished |= stopped

    def _logged(self, report: Report, begin: int, position: int) -> tuple[Any, ...]:
        """The n-th steps (`log_every=n`) after `begin` up to `position`, each with its
        values from the report's (an ensemble's: its members' mean, as an epoch's).
        """
        every, logs = self.loop.log_every, report.logs
        if every is None or logs is None or position // every <= begin // every:
            return ()
        values = np.asarray(self.loop.placement.host(logs))
        rows = values.reshape(-1, *values.shape[-2:])  # members first, if any
        low = self.loop.schedule.begin // every  # row 0's n-th step, counted from 0
        names = self.loop.log_names[: rows.shape[-1]]
        ks = range(begin // every, position // every)
        table = _mean_of_finished(rows[:, ks[0] - low : ks[-1] - low + 1]).tolist()
        return tuple(((k + 1) * every, dict(zip(names, row))) for k, row in zip(ks, table))

    def _validated(self, report: Report, begin: int, position: int) -> tuple[Any, ...]:
        """The validations (`validation_every=n`) made after `begin` up to `position`,
        each with its step and values (an ensemble's: the mean of the members that made
        it, as an epoch's).
        """
        table = report.validations
        if table is None:  # no validation after steps
            return ()
        steps = self.loop.val_steps.made(self.loop.schedule, begin, position)
        if not steps:
            return ()
        values, done = (np.asarray(x) for x in self.loop.placement.host(table))
        values, done = values.reshape(-1, *values.shape[-2:]), done.reshape(-1, done.shape[-1])
        made = []
        for step, row in steps:
            if done[:, row].any():
                value = _mean_of_finished(np.where(done[:, row, None], values[:, row], np.nan))
                made.append((step, dict(zip(self.loop.val_names, value.tolist()))))
        return tuple(made)


def _mean_of_finished(rows: np.ndarray) -> np.ndarray:
    """The mean over members of each value, leaving out members that had stopped (NaN);
    NaN where every member has NaN (a value of an epoch not validated, say).
    """
    finished = ~np.isnan(rows)
    total = np.where(finished, rows, 0.0).sum(axis=0)
    count = finished.sum(axis=0)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


class Drive:
    """One run's drive: the state it carries from call to call, as attributes."""

    def __init__(
        self,
        loop: Loop,
        program: Callable[[Loop], Program],
        state: TrainState | Starting,
        begin: int,
        observers: Sequence[Observer],
        interrupt: Interrupt,
        costs: Costs | None,
    ):
        self.loop, self.program, self.observers = loop, program, observers
        self.interrupt = interrupt
        self.reader = _Reader(loop, begin, observers, costs)
        self.sizer = CallSizer(loop, observers)
        self.programs = {loop.batch_size: program(loop)}  # and for a smaller last batch's
        self.starting = state if isinstance(state, Starting) else None
        self.current = None if isinstance(state, Starting) else state  # once made
        self.position, self.report = begin, None
        self.called: set[int] = set()  # the programs called so far (by `id`): a first compiles
        self.failure: BaseException | None = None
        self.second_ctrl_c = False
        self.several = jax.process_count() > 1

    def interrupted(self) -> bool:
        """Whether a signal asks training to stop (with several processes, as they agreed
        before the last call: see `_agree`).
        """
        if not self.several:
            self.interrupt.stopping = self.interrupt.requested
        return self.interrupt.stopping

    def state(self) -> TrainState:
        """The training state, made (waiting for `start`'s thread) if it is not yet."""
        if self.current is None:
            assert self.starting is not None
            self.current = self.starting.result()
        return self.current

    def learn(self, length: int) -> None:
        """The first epoch has shown the epoch's length: the run goes on as one of
        epochs of `length` steps, with the steps so far in its record.
        """
        self.reader.read()  # the steps of every call so far
        self.loop = dataclasses.replace(self.loop, schedule=self.loop.schedule.learned(length))
        self.reader.loop = self.sizer.loop = self.loop
        current = self.state()
        learned = learned_state(self.loop, current, self.reader.first_epoch.steps(length))
        records = ("step_loss", "step_values", "batch_sizes", "epoch_values")
        placed = self.loop.placement.put(jax.device_put({k: getattr(learned, k) for k in records}))
        self.current = current._replace(**placed)
        self.programs = {self.loop.batch_size: self.program(self.loop)}
        for observer in self.observers:
            observer.learned(self.loop.schedule)

    def call(self, feed: Feed) -> bool:
        """Makes one call of the program on `feed`, and reads the reports then due;
        returns whether training goes on in this feed.
        """
        interrupt, reader = self.interrupt, self.reader
        if feed.batch_size not in self.programs:
            piece_loop = dataclasses.replace(self.loop, last_batch=feed.batch_size)
            self.programs[feed.batch_size] = self.program(piece_loop)
        call = self.programs[feed.batch_size]
        stop = self.sizer.stop(self.position, feed.end, reader.clock.mean(), call.snap)
        if self.several:  # one call of every process, or none
            stop, name = _agree(stop, interrupt.signal)
            if name is not None:  # by what was gathered, not by a later signal
                interrupt.request(name)
                interrupt.stopping = True
                if self.report is not None:
                    return False
        if self.current is None:  # traced while `start` compiles
            assert self.starting is not None
            self.current = self.starting.ready(call, feed.inputs, stop)
        reader.throughput.before_call(call.lower, self.current, feed.inputs, stop)
        # XLA's CPU client runs a program that calls the host (`jax.debug.print`,
        # `jax.debug.callback`) in the calling thread: such a call returns done, its time
        # spent inside it, and a Ctrl-C is answered once it returns. So a call that returns
        # done is timed from its dispatch (unless it compiled there, a program's first) and
        # read at once: calls keep to their half second.
        compiles = id(call) not in self.called
        self.called.add(id(call))
        dispatched = time.perf_counter()
        with interrupt.held():
            # With one process, a program of few steps a call stops at a signal (with
            # several, every process makes the same calls, agreed at each call).
            stopping = None if self.several else lambda: interrupt.requested
            current, self.report, stop = call(
                self.current, feed.inputs, self.position, stop, stopping, feed.validation
            )
            self.current = current
            ran = _is_done(self.report.step)
            since = dispatched if ran and not compiles else None
            reader.queued(self.report, self.position, stop, since)
            self.position = stop
        try:
            for observer in self.observers:
                observer.after_call(self.position, self.current)
        except CheckpointError as e:  # the result goes with the error
            self.failure = e
            return False
        # After a signal, no call is queued ahead: a second one then waits for one call
        # at most.
        seconds = reader.read(keep=0 if interrupt.requested or ran else 1)
        if ran and compiles:  # its time was the compilation's: it measures nothing
            seconds = None
        self.sizer.measure(seconds, reader.clock.mean())
        if any(observer.waits(self.position) for observer in self.observers):
            reader.read()
        return self.position < feed.end and not reader.finished

    def train(self, feeds: Iterator[Feed]) -> None:
        """Calls the program over the feeds until the run's end, a stop or a signal."""
        for feed in from_data(feeds):
            if feed.epoch_length is not None and self.loop.schedule.learning:
                check_steps(self.loop.execution, feed.epoch_length, "an epoch of this run has")
                self.learn(feed.epoch_length)
            if self.report is None and feed.inputs.piece is not None:
                # A call never goes past a chunk of streamed batches (a full one holds
                # `capacity`): the steps past it would be compiled and never run.
                capacity = np.shape(feed.inputs.piece.order)[0] // feed.batch_size
                if feed.batch_size == self.loop.batch_size:
                    check_steps(self.loop.execution, capacity, "the data streams in chunks of")
            # A call per turn, at least one per feed: a call with nothing to do (a finished
            # run resumed) still reports where the run stands.
            while not (self.report is not None and self.interrupted()):
                if not self.call(feed):
                    break
            ended = self.position >= self.loop.schedule.total or self.reader.finished
            if self.failure is not None or ended or self.interrupt.stopping:
                break
        if self.report is None:  # no feed at all: nothing to train on from here
            raise ValueError("The data yielded no batches to train on.")

    def end(self) -> None:
        """The last reports read, and the observers told the run's end."""
        if self.report is not None and not self.loop.schedule.learning:
            # What `outcome` reads, copied with the last reports (`learn` remakes the state's).
            copying(Ending.of(self.report, self.state()))
        self.read_all()
        mean = self.reader.clock.mean()
        if mean is not None:  # the whole run's, for the next run's calls
            PROGRAM_CACHE.set_fact(program_key(self.loop), "mean_seconds_per_step", mean)
        if self.failure is None:
            try:
                for observer in self.observers:
                    observer.end(self.position, self.state())
            except CheckpointError as e:  # the result goes with the error
                self.failure = e

    def read_all(self) -> None:
        """Reads every report in flight (for the bar, the callbacks, each epoch's figures);
        a run stopped in its first epoch learns that the epoch is as long as it went.
        """
        self.reader.read()
        if self.loop.schedule.learning:
            self.learn(max(self.reader.done, 1))

    def abandon(self, error: BaseException) -> None:
        """After a second Ctrl-C or an error (a loader that raised, say): the calls in
        flight (after a Ctrl-C, one of about half a second, or one step) finish, so that
        the process never exits with the device still running, and the training up to
        there comes back with the error as its `.result`; else the error is raised.
        """
        if self.report is not None:
            wait_for(self.report.step)
        returns = isinstance(error, (DataError, KeyboardInterrupt))  # else a bug's, say
        current = self.current
        donated = current is not None and any(
            x.is_deleted() for x in jax.tree.leaves(current) if isinstance(x, jax.Array)
        )
        if not returns or self.report is None or current is None or donated:
            if isinstance(error, DataError):
                error.error.__suppress_context__ = True  # its own cause is kept
                raise error.error
            raise error
        if isinstance(error, KeyboardInterrupt):
            self.second_ctrl_c = True
        else:
            assert isinstance(error, DataError)
            self.failure = error.error
        if self.loop.schedule.learning:  # stopped in the first epoch: as long as it went
            self.read_all()

    def outcome(self) -> Outcome:
        assert self.report is not None
        interrupt = self.interrupt
        return Outcome(
            self.loop,
            self.state(),
            self.report,
            stopped_by_callback=self.reader.by_observer,
            interrupted=self.second_ctrl_c or interrupt.requested,
            signal=interrupt.signal or ("SIGINT" if self.second_ctrl_c else None),
            failure=self.failure,
            read=self.loop.placement.host(Ending.of(self.report, self.state())),
            epoch_figures=self.reader.epoch_figures,
        )


def drive(
    loop: Loop,
    program: Callable[[Loop], Program],
    state: TrainState | Starting,
    feeds: Iterator[Feed],
    begin: int,
    observers: Sequence[Observer],
    interrupt: Interrupt,
    costs: Costs | None = None,
) -> Outcome:
    """Runs the compiled `program(loop)` over the feeds from `begin` until the run's end,
    a stop, or an interrupt: a signal (`interrupt`) ends training once the call in flight
    is done, at the step it reached.

    Each call is queued before the previous one's report is read: the host updates the
    observers while the device works. A call lasts about `SECONDS_PER_CALL` (or less, as
    its observers ask), measured as training goes, ending at the last epoch end it reaches
    and at every observer's boundary (`CallSizer`).

    **Returns:**

    An `Outcome` with the final state and the last call's report.
    """
    run = Drive(loop, program, state, begin, observers, interrupt, costs)
    try:
        for observer in observers:  # in the `try`: every way out closes them
            observer.open()
        try:
            run.train(feeds)
            run.end()
        except BaseException as error:
            run.abandon(error)
    finally:
        for observer in observers:
            observer.close()
    return run.outcome()


def _agree(stop: int, signal_name: str | None) -> tuple[int, str | None]:
    """What every process of a `jax.distributed` run does next, in one exchange at each
    call: process 0's `stop` (each sizes its calls by its own clock, and a program that
    spans them must be called alike), and the signal that came to the process of lowest
    index that had one (`None`: none came), so that all stop at one step.
    """
    import signal

    from jax.experimental import multihost_utils

    number = 0 if signal_name is None else int(signal.Signals[signal_name])
    gathered = multihost_utils.process_allgather(np.asarray([stop, number], np.int32))
    rows = np.asarray(gathered).reshape(-1, 2)
    came = rows[rows[:, 1] > 0, 1]
    return int(rows[0, 0]), signal.Signals(int(came[0])).name if came.size else None


def _is_done(array: Any) -> bool:
    """Whether the call that makes `array` has finished (`jax.Array.is_ready`)."""
    return array.is_ready()


def _done_by(later: Stamp, earlier: Stamp) -> bool:
    """Whether the call stamped `later` was done by when `earlier`'s was seen done: stamped
    no later, or found done when the thread got to it, right after `earlier` (calls of a
    few steps each finish many to one wake-up of a thread that woke late; stamped a few
    microseconds apart, the last would be timed at microseconds for all its steps).
    """
    return later.ready.is_set() and (later.at <= earlier.at or later.done_before)
