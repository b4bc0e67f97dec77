"""The one host driver: calls the compiled run piece by piece until it ends.

The driver sizes each call (about half a second, less for the bar), reads the program's
reports once the next call is queued, and tells its observers (`_observers.py`: the bar,
the callbacks, the checkpoints, signals) through one small protocol. Streamed data
arrives through `ReadAhead`, a background thread that moves each chunk to the device
while the one before trains, and that every way out stops.
"""

import atexit
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ._checkpoint import CheckpointError
from ._compile import PROGRAM_CACHE, Starting
from ._loop import Loop
from ._observers import Costs, Observer, Progress, Throughput
from ._program import learned_state, run_key
from ._signals import Interrupt
from ._sources import Chunk
from ._state import Inputs, Piece, Report, Steps, Stop, TrainState


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


class Feed(NamedTuple):
    """Data for the steps before the global step `end`, as the program takes it."""

    inputs: Inputs
    end: int
    batch_size: int
    epoch_length: int | None = None  # learned from the loader's first pass


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
    # Each epoch's wall seconds, steps and samples per second (`Throughput.epoch`).
    epoch_figures: dict[int, dict[str, float]] = {}


class _Reader:
    """Reads the reports of calls in flight, in order, once the next call is queued (so
    the host never waits with the device idle), and hands what they say to the observers.
    """

    def __init__(self, loop: Loop, begin: int, observers: Sequence[Observer], costs: Costs | None):
        self.loop, self.observers = loop, observers
        # Each call's report, begin and stop, and when the device finished it.
        self.in_flight: list[tuple[Report, int, int, Stamp]] = []
        self.first_epoch: list[Steps] = []  # while it teaches the epoch's length: its steps
        self.finished = False  # the program stopped, or an observer asked to stop
        self.by_observer = False
        # The position the last report read had reached. Reads count from it, not from
        # where a call was asked to begin: after an early stop, calls already queued report
        # the step the run stopped at, behind their begin.
        self.done = begin
        self.clock = self.taken = time.perf_counter()
        self.started = False  # whether a call was queued
        self.throughput = Throughput(loop.schedule, costs)
        self.timed_seconds, self.timed_steps = 0.0, 0  # of the calls read
        self.epoch_figures: dict[int, dict[str, float]] = {}  # by epoch: `Throughput.epoch`

    def queued(self, report: Report, begin: int, stop: int, since: float | None = None) -> None:
        """`since`: when the call began, for one that ran before it returned (`drive`)."""
        if not self.started:  # the device starts on it now (its compilation is done)
            # From then on the clock runs on: an epoch's seconds are its wall time, the
            # host's work between calls (callbacks, checkpoints) included.
            self.clock = self.taken = time.perf_counter() if since is None else since
            self.started = True
        self.in_flight.append((report, begin, stop, WAITER.stamp(report.step)))

    def read(self, keep: int = 0) -> float | None:
        """Reads every report in flight but the last `keep`; returns the seconds per step
        of the calls read (each read waits for its call to finish), if any.
        """
        steps = 0
        while len(self.in_flight) > keep:
            report, begin, stop, finished = self.in_flight.pop(0)
            self._take(report, begin, stop, finished)
            steps += stop - begin
        if not steps:
            return None
        now = time.perf_counter()
        seconds = (now - self.clock) / steps
        self.clock = now
        return seconds

    def mean_seconds_per_step(self) -> float | None:
        """The seconds per step of every call read so far, if any ran a step."""
        steps = self.timed_steps
        return self.timed_seconds / steps if steps else None

    @property
    def _steps_axis(self) -> int:
        """The steps' axis in a `Steps` record: after the members' of an ensemble."""
        return 0 if self.loop.members is None else 1

    def first_steps(self, length: int) -> Steps | None:
        """The record of the first epoch's steps, up to `length` of them, as the calls
        read so far reported them; `None` before any call.
        """
        if not self.first_epoch:
            return None
        axis = self._steps_axis
        joined = [np.concatenate(x, axis=axis) for x in zip(*self.first_epoch)]
        return Steps(
            *(np.take(x, np.arange(min(length, x.shape[axis])), axis=axis) for x in joined)
        )

    def _take(self, report: Report, call_begin: int, call_stop: int, finished: "Stamp") -> None:
        # A call lasts from the end of the one before it (or from the start) to its own:
        # the host's work between them counts, but not when it got to read the report.
        finished.wait()
        took, self.taken = max(finished.at - self.taken, 0.0), max(finished.at, self.taken)
        self.timed_seconds += took
        placement, schedule = self.loop.placement, self.loop.schedule
        self.throughput.schedule = schedule  # learned, maybe, since
        if report.steps is not None:  # the first epoch, while it teaches its length
            axis = self._steps_axis
            columns = np.arange(call_begin, call_stop) % schedule.columns
            steps = placement.host(report.steps)
            self.first_epoch.append(Steps(*(np.take(x, columns, axis=axis) for x in steps)))
        host = placement.host((report.step, report.reason, report.epoch_loss, report.epoch_values))
        step, reason, epoch_loss, table = (np.asarray(x) for x in host)
        stopped = bool((reason != Stop.RUNNING).all())
        position = max(int(step.max()), self.done)  # members stopped early are behind
        begin, self.done = self.done, position
        self.throughput.record(begin, position, took)
        self.timed_steps += position - begin
        ended = []
        # An ensemble's values are its members' mean, leaving out members that stopped.
        rows = table.reshape(-1, *table.shape[-2:])
        for epoch in range(schedule.epochs_ended(begin) + 1, schedule.epochs_ended(position) + 1):
            row = rows[:, epoch - 1 - schedule.first_epoch]
            logs = dict(zip(self.loop.log_names, _mean_of_finished(row).tolist()))
            figures = self.throughput.epoch(epoch)
            self.epoch_figures[epoch] = figures
            ended.append((epoch, logs | figures))
        last = max(position - 1, schedule.begin)
        if ended and ended[-1][0] == schedule.epoch_of(last):
            loss = ended[-1][1]["loss"]  # at the epoch's end: its own value, as recorded
        else:  # inside an epoch: its running mean (of the members still training)
            losses = epoch_loss.reshape(-1)
            finite = losses[np.isfinite(losses)]
            loss = float(finite.mean()) if finite.size else float("nan")
        progress = Progress(
            position=position,
            stopped=stopped,
            epoch=int(schedule.epoch_of(last)),
            epoch_loss=loss,
            ended=tuple(ended),
            samples_per_second=self.throughput.recent(),
        )
        for observer in self.observers:
            if observer.on_progress(progress):
                self.finished = self.by_observer = True
        self.finished |= stopped


def _mean_of_finished(rows: np.ndarray) -> np.ndarray:
    """The mean over members of each value, leaving out members that had stopped (NaN);
    NaN where every member has NaN (a value of an epoch not validated, say).
    """
    finished = ~np.isnan(rows)
    total = np.where(finished, rows, 0.0).sum(axis=0)
    count = finished.sum(axis=0)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


class Stamp:
    """When an array became ready (`time.perf_counter()`), as `_Waiter` saw it."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.at = math.nan

    def set(self) -> None:
        self.at = time.perf_counter()
        self.ready.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the array (at most `timeout` seconds); returns whether it is ready."""
        return self.ready.wait(timeout)


class _Waiter:
    """Waits for device arrays in a thread of its own, in the order asked. The main
    thread then waits on a lock, which a signal interrupts, so that a second Ctrl-C gets
    through at once; a blocking wait for the device in the main thread would hold it
    until the device is done. Since the thread waits on each call's report from when the
    call is queued, it also tells when the device finished each call (`stamp`), however
    late the host reads the report: within the thread's wake-up, which one thread keeps
    in order (a call done before the thread got to it is stamped then).
    """

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[tuple[Any, Stamp]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def wait(self, array: Any, timeout: float | None = None) -> bool:
        """Waits for `array` (at most `timeout` seconds); returns whether it is ready."""
        if array.is_ready():
            return True
        return self.stamp(array).wait(timeout)

    def stamp(self, array: Any) -> Stamp:
        """When `array` becomes ready: at once, or once the thread has waited for the
        arrays asked before it, and for it.
        """
        stamp = Stamp()
        if array.is_ready():
            stamp.set()
            return stamp
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, daemon=True)
                self.thread.start()
        self.requests.put((array, stamp))
        return stamp

    def _serve(self) -> None:
        while True:
            array, stamp = self.requests.get()
            try:
                array.block_until_ready()
            except Exception:  # the main thread reads the array and meets the error
                pass
            stamp.set()


WAITER = _Waiter()


class ReadAhead:
    """Chunks of streamed data turned into feeds (moved to the device) in a background
    thread, at most `depth` ahead of the driver.

    The thread checks a stop event between chunks and never blocks on the queue for
    long; `close()`, which the driver calls on every way out, sets the event and waits a
    bounded time for it. A loader that blocks forever inside `next` leaves a daemon thread
    behind, never a hung `fit`.
    """

    def __init__(self, chunks: Iterator[Chunk], feed: Callable[[Chunk], Feed], depth: int = 2):
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, args=(chunks, feed), daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, chunks: Iterator[Chunk], feed: Callable[[Chunk], Feed]) -> None:
        try:
            for chunk in chunks:
                if self.stop.is_set() or not self._put(feed(chunk)):
                    return
            self._put(_DONE)
        except BaseException as e:  # surfaced in the training thread
            self._put(e)

    def __iter__(self) -> Iterator[Feed]:
        while True:
            try:
                item = self.ready.get(timeout=0.05)
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    return
                continue
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=1.0)


_DONE = object()


def feeds(
    chunks: Iterator[Chunk], template: Inputs, put: Callable[..., Any], streamed: bool
) -> tuple[Iterator[Feed], Callable[[], None]]:
    """The program's feeds from a source's chunks, and how to stop making them. Streamed
    chunks are moved to the device ahead of time, in a background thread.
    """

    def feed(chunk: Chunk) -> Feed:
        if chunk.order is None:  # the whole data: the program orders it
            inputs = template._replace(data=put(chunk.data, sharded=True))
        else:
            piece = Piece(chunk.order, np.int32(chunk.first), np.int32(chunk.end))
            inputs = template._replace(data=put(chunk.data, sharded=True), piece=put(piece))
        return Feed(inputs, chunk.end, chunk.batch_size, chunk.epoch_length)

    if not streamed:
        return map(feed, chunks), lambda: None
    ahead = ReadAhead(chunks, feed)
    return iter(ahead), ahead.close


def drive(
    loop: Loop,
    program: Callable[[Loop], Callable[..., tuple[TrainState, Report]]],
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
    and at every observer's boundary.

    **Returns:**

    An `Outcome` with the final state and the last call's report.
    """
    schedule = loop.schedule
    reader = _Reader(loop, begin, observers, costs)
    programs = {loop.batch_size: program(loop)}  # and for pieces of a smaller last batch
    seconds_per_call = min([SECONDS_PER_CALL] + [o.seconds_per_call or 1e9 for o in observers])
    known = PROGRAM_CACHE.fact(run_key(loop), "seconds_per_step")
    if known is not None:  # measured by an earlier run of this configuration
        steps_per_call = max(1, int(seconds_per_call / max(known, 1e-9)))
    else:
        steps_per_call = FIRST_CALL_STEPS
    measured = known is not None
    # Over a whole earlier run: its last call may have missed the epochs that cost more.
    known_mean = PROGRAM_CACHE.fact(run_key(loop), "mean_seconds_per_step")

    several = jax.process_count() > 1

    def interrupted() -> bool:
        """Whether a signal asks training to stop (with several processes, as they agreed
        before the last call: see `_agree`).
        """
        if not several:
            interrupt.stopping = interrupt.requested
        return interrupt.stopping

    position, report = begin, None
    called: set[int] = set()  # the programs called so far (by `id`): a first call compiles
    failure: BaseException | None = None
    second_ctrl_c = False
    starting = state if isinstance(state, Starting) else None
    current = None if isinstance(state, Starting) else state  # the state, once made

    def learn(length: int) -> None:
        """The first epoch has shown the epoch's length: the run goes on as one of
        epochs of `length` steps, with the steps so far in its record.
        """
        nonlocal loop, schedule, current, programs
        reader.read()  # the steps of every call so far
        loop = dataclasses.replace(loop, schedule=schedule.learned(length))
        reader.loop, schedule = loop, loop.schedule
        if current is None:  # learned before the first call
            assert starting is not None
            current = starting.result()
        learned = learned_state(loop, current, reader.first_steps(length))
        records = ("step_loss", "step_values", "batch_sizes", "epoch_values")
        placed = loop.placement.put(jax.device_put({k: getattr(learned, k) for k in records}))
        current = current._replace(**placed)
        programs = {loop.batch_size: program(loop)}
        for observer in observers:
            observer.learned(schedule)

    try:
        for observer in observers:  # in the `try`: every way out closes them
            observer.open()
        for feed in _from_data(feeds):
            if feed.epoch_length is not None and schedule.learning:
                learn(feed.epoch_length)
            # A call per turn, at least one per feed: a call with nothing to do (a finished
            # run resumed) still reports where the run stands.
            while not (report is not None and interrupted()):
                stop = schedule.call_stop(position, steps_per_call, at_epoch_ends=True)
                # By the slower of this run's mean speed so far and an earlier run's, since
                # calls queued ahead are not read yet: an epoch that validates may be one.
                speed = max(reader.mean_seconds_per_step() or 0.0, known_mean or 0.0)
                if schedule.steps_per_epoch * speed >= SECONDS_PER_TIMED_EPOCH:
                    stop = min(stop, schedule.next_epoch_end(position))  # timed by itself
                for observer in observers:
                    boundary = observer.boundary(position)
                    if boundary is not None:
                        stop = min(stop, boundary)
                stop = max(min(stop, feed.end), position)
                if several:  # one call of every process, or none
                    stop, name = _agree(stop, interrupt.signal)
                    if name is not None:  # by what was gathered, not by a later signal
                        interrupt.request(name)
                        interrupt.stopping = True
                        if report is not None:
                            break
                if feed.batch_size not in programs:
                    piece_loop = dataclasses.replace(loop, batch_size=feed.batch_size)
                    programs[feed.batch_size] = program(piece_loop)
                call = programs[feed.batch_size]
                if current is None:  # traced while `start` compiles
                    assert starting is not None
                    current = starting.ready(call, feed.inputs, np.int32(stop))
                # XLA's CPU client runs a program that calls the host (`jax.debug.print`,
                # `jax.debug.callback`) in the calling thread: such a call returns done, its
                # time spent inside it, and a Ctrl-C is answered once it returns. So a call
                # that returns done is timed from its dispatch (unless it compiled there, a
                # program's first) and read at once: calls keep to their half second.
                compiles = id(call) not in called
                called.add(id(call))
                dispatched = time.perf_counter()
                with interrupt.held():
                    current, report = call(current, feed.inputs, np.int32(stop))
                    ran = _is_done(report.step)
                    since = dispatched if ran and not compiles else None
                    reader.queued(report, position, stop, since)
                    position = stop
                try:
                    for observer in observers:
                        observer.after_call(position, current)
                except CheckpointError as e:  # the result goes with the error
                    failure = e
                    break
                # After a signal, no call is queued ahead: a second one then waits for
                # one call at most.
                asked = interrupt.requested
                seconds = reader.read(keep=0 if asked or ran else 1)
                if ran and compiles:  # its time was the compilation's: it measures nothing
                    seconds = None
                if seconds is not None:
                    steps_per_call = max(1, int(seconds_per_call / max(seconds, 1e-9)))
                    PROGRAM_CACHE.set_fact(run_key(loop), "seconds_per_step", seconds)
                    mean = reader.mean_seconds_per_step()
                    PROGRAM_CACHE.set_fact(run_key(loop), "mean_seconds_per_step", mean)
                    measured = True
                elif not measured:
                    steps_per_call *= 2
                if any(observer.waits(position) for observer in observers):
                    reader.read()
                if position >= feed.end or reader.finished:
                    break
            if failure is not None or reader.finished or position >= schedule.total:
                break
            if interrupt.stopping:
                break
        if report is None:  # no feed at all: nothing to train on from here
            raise ValueError("The data yielded no batches to train on.")
        if schedule.learning:  # stopped in the first epoch: it is as long as it went
            reader.read()
            learn(max(reader.done, 1))
        else:  # the last reports: for the bar and callbacks, and each epoch's figures
            reader.read()
        mean = reader.mean_seconds_per_step()
        if mean is not None:  # the whole run's, for the next run's calls
            PROGRAM_CACHE.set_fact(run_key(loop), "mean_seconds_per_step", mean)
        if failure is None:
            assert current is not None
            try:
                for observer in observers:
                    observer.end(position, current)
            except CheckpointError as e:  # the result goes with the error
                failure = e
    except BaseException as error:
        # A second Ctrl-C, or an error (a loader that raised, say): the calls in flight
        # (after a Ctrl-C, one of about half a second, or one step) finish, so that the
        # process never exits with the device still running, and the training up to
        # there comes back with the error as its `.result`.
        if report is not None:
            _wait_for(report.step)
        returns = isinstance(error, (DataError, KeyboardInterrupt))  # else a bug's, say
        donated = current is not None and any(
            x.is_deleted() for x in jax.tree.leaves(current) if isinstance(x, jax.Array)
        )
        if not returns or report is None or current is None or donated:
            if isinstance(error, DataError):
                error.error.__suppress_context__ = True  # its own cause is kept
                raise error.error
            raise
        if isinstance(error, KeyboardInterrupt):
            second_ctrl_c = True
        else:
            assert isinstance(error, DataError)
            failure = error.error
        if schedule.learning:  # stopped in the first epoch: it is as long as it went
            reader.read()
            learn(max(reader.done, 1))
    finally:
        for observer in observers:
            observer.close()
    assert current is not None
    return Outcome(
        loop,
        current,
        report,
        stopped_by_callback=reader.by_observer,
        interrupted=second_ctrl_c or interrupt.requested,
        signal=interrupt.signal or ("SIGINT" if second_ctrl_c else None),
        failure=failure,
        epoch_figures=reader.epoch_figures,
    )


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


class DataError(Exception):
    """An error raised while the data was read (a loader that raised, a bad batch)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _from_data(feeds: Iterator[Feed]) -> Iterator[Feed]:
    """`feeds`, with an error raised in reading them wrapped as a `DataError`."""
    while True:
        try:
            feed = next(feeds)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(e) from e
        yield feed


def _is_done(array: Any) -> bool:
    """Whether the call that makes `array` has finished (`jax.Array.is_ready`)."""
    return array.is_ready()


def _wait_for(array: Any) -> bool:
    """Waits for `array`, the last call's: whether it is ready. A further Ctrl-C stops the
    wait; then Python waits for it at exit (`_PENDING`), so that the process never exits
    with the device still running (XLA aborts it).
    """
    try:
        return WAITER.wait(array)
    except KeyboardInterrupt:
        _PENDING.append(array)
        raise


# Arrays of calls still running when `fit` raised: waited for before Python exits. JAX is
# imported first, so this runs before JAX's own exit handlers (they run last first).
_PENDING: list[Any] = []


@atexit.register
def _wait_for_pending() -> None:
    for array in _PENDING:
        try:
            array.block_until_ready()
        except Exception:
            pass
