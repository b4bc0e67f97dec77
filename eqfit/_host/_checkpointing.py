"""The observer that writes a run's checkpoints (`Checkpointing`): when one falls due,
where it is written (`in_background`), and what `keep_best` judges it by (`BestBy`).
"""

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from .._core._policy import Checkpoint
from .._keep._checkpoint import Checkpoints, position as position_of
from .._keep._files import folder_name
from .._keep._identity import learned_config
from .._keep._writer import go_on, Writer
from .._program._schedule import epochs_and_steps, Schedule
from .._program._state import stopped_at_non_finite, TrainState
from .._step._record import CHECKPOINT_BLOCKED
from .._step._validation_steps import AtEpochEnds, StepValidation
from ._observers import copy_taken, Observer
from ._signals import Interrupt


_LOG = logging.getLogger("eqfit")
_WAITS = (
    "The checkpoint at step %d waits for the write of the one at step %s, which is still "
    "going: training waits for it. Checkpoints that fall more often than %s takes to "
    "write one hold the training up; give `Checkpoint` a longer period, or a faster disk."
)


class BestBy(NamedTuple):
    """What `Checkpoint(keep_best=)` judges a checkpoint by: a column of each epoch's
    values (`TrainState.epoch_values`), or where `steps` judges validations after steps
    (`validation_every`, monitoring a validation value) of each validation's
    (`TrainState.validations`).
    """

    column: int
    steps: StepValidation = AtEpochEnds()

    def next(self, schedule: Schedule, position: int) -> int:
        """The next position that may be the best: an epoch's end, or a validation's."""
        return self.steps.next_judged(schedule, position)

    def row(self, schedule: Schedule, position: int) -> int | None:
        """The row of the value judged at `position`, if one is made there."""
        return self.steps.judged_row(schedule, position)

    def values(self, state: PyTree, row: int) -> np.ndarray:
        """The values judged at `row` of a state on the host, of each member (NaN where
        none was made).
        """
        return self.steps.judged_values(state, row, self.column, _local)


class Checkpointing(Observer):
    """Writes checkpoints as its `Checkpoint` policy asks, at the run's end, and at the
    step where a signal stopped the run.

    At a checkpoint the state (`take`n off the placement: one replica of `devices=`) is
    written where the policy's `background` says (`in_background`). In the background,
    it is copied on the device (new buffers, which the next call's donation leaves alone,
    queued behind the call: the training thread does not wait for it) and a `Writer`
    takes the copy to the host (`host`), lets the device's go, and writes it while
    training goes on (under `shard=`, Orbax writes the copy's shards from that thread).
    In the training thread, the state itself is taken to the host (on a CPU, its own
    buffers) and written before the next call is queued, so no copy is made; by default
    the `Writer` then commits it (waits for the disk, renames it into place) while
    training goes on, and with `background=False` the training thread does. Where
    several processes take part, the write is made in the training thread, all
    processes together. A state that holds a non-finite step (`replays`) is not
    written.

    A checkpoint that falls due while the write before it is still going waits for it
    (one write at a time, one copy of the state at a time), and says so: the first time
    a run waits, as a warning of the `eqfit` logger, then at its DEBUG level; but the
    run's last in the background, queued behind it (its copy taken to the host
    meanwhile: two on the host, one on the device), whose write goes on as `fit`
    returns (`go_on`; not under `shard=`). The seconds the training thread spends at each checkpoint
    (`blocked`: the copy queued, or the state written, and any such wait) go to the
    figures of its epoch (`epoch_figures`).
    """

    def __init__(
        self,
        store: Checkpoints,
        policy: Checkpoint,
        schedule: Schedule,
        interrupt: Interrupt,
        take: Callable[[TrainState], PyTree],
        host: Callable[[PyTree], PyTree],
        monitor: BestBy | None,
        replays: bool = False,
    ):
        self.store, self.policy, self.schedule = store, policy, schedule
        # The run applies a non-finite step (`StepOptions.replays`): a state that stopped
        # at one holds it, and is never written.
        self.replays = replays
        self.interrupt = interrupt
        self.take, self.host = take, host
        self.monitor = monitor  # `keep_best`'s value
        self.background: bool | None = None  # decided at the first checkpoint
        self.writer = Writer()
        self.relearned = False  # the epoch's length learned, the store not yet told
        self.saved_at: int | None = None  # the position of the last checkpoint
        self.since = time.monotonic()  # when the last checkpoint fell
        self.writing: int | None = None  # the position of the last write begun
        self.waited = False  # whether a checkpoint waited for the write before it yet
        # The seconds training waited at each checkpoint, by position, until its epoch's
        # figures take them.
        self.blocked: dict[int, float] = {}

    def open(self) -> None:
        self.since = time.monotonic()

    def learned(self, schedule: Schedule) -> None:
        self.schedule, self.relearned = schedule, True

    def boundary(self, position: int) -> int | None:
        schedule = self.schedule
        if schedule.learning:  # no checkpoint is written while the length is learned
            return None
        due = self.policy.next_due(position, schedule.steps_per_epoch)
        if self.monitor is not None:  # every epoch's end (or validation): it may be the best
            end = self.monitor.next(schedule, position)
            due = end if due is None else min(due, end)
        return due

    def after_call(self, position: int, state: TrainState) -> None:
        schedule = self.schedule
        if self.relearned:  # before the first checkpoint: none is written while learning
            config = learned_config(self.store.config, schedule, state)
            self.store.learned(config, schedule.steps_per_epoch)
            self.relearned = False
        self.writer.check()  # a write that failed stops training at the next call's end
        if schedule.learning:
            return
        seconds = self.policy.every_seconds
        due = (
            self.policy.is_due(position, schedule.steps_per_epoch)
            or position >= schedule.total
            or self.interrupt.stopping
            or (seconds is not None and agreed(time.monotonic() - self.since >= seconds))
        )
        may_be_best = self.monitor is not None and self.monitor.row(schedule, position) is not None
        if due or may_be_best:
            self._save(position, state, due)

    def end(self, position: int, state: TrainState) -> None:
        """The drive is over: a checkpoint where a signal stopped it, if it has none yet,
        and every write committed.
        """
        stopped = self.interrupt.stopping and not self.schedule.learning
        if stopped and position != self.saved_at:
            self._save(position, state, True)
        self.writer.check()
        going = self.writer.busy() and self.background
        if going and not stopped and not self.store.collective:
            # In the background the run's last write goes on as `fit` returns (the
            # process's exit, a run reading the directory and `wait_for_checkpoints` wait
            # for it), as Orbax's asynchronous checkpoints do. Stopped by a signal, the
            # process is about to end: `fit` returns with its checkpoint committed. Orbax's
            # own writes (`shard=`) need its thread pools, which the exit closes before it
            # waits for threads: `fit` waits for them.
            assert self.writing is not None
            # Named as its write names it, by the step its state holds: a call queued
            # past a stop (early stopping's, a NaN's) holds the stop's step, not its end.
            written = min(self.writing, position_of(state))
            epoch, step = epochs_and_steps(written, self.schedule.steps_per_epoch)
            go_on(Path(self.store.directory) / folder_name(epoch, step), self.writer)
            self.writer = Writer()
        self.writer.wait()

    def close(self) -> None:
        # On every way out the write in flight ends, so that it is committed (or not) before
        # `fit` returns; an error of its is raised by `end`, not over another's.
        with contextlib.suppress(BaseException):
            self.writer.wait()

    def epoch_figures(self, begin: int, end: int) -> dict[str, float]:
        """The seconds training waited at the checkpoints after step `begin` up to step
        `end` (an epoch's).
        """
        seconds = sum((s for p, s in self.blocked.items() if begin < p <= end), 0.0)
        self.blocked = {p: s for p, s in self.blocked.items() if p > end}
        return {CHECKPOINT_BLOCKED: seconds}

    def _save(self, position: int, state: TrainState, due: bool) -> None:
        began = time.perf_counter()
        if due:
            self.saved_at, self.since = position, time.monotonic()
        schedule = self.schedule
        row = None if self.monitor is None else self.monitor.row(schedule, position)
        taken = self.take(state)
        if self.background is None:
            self.background = in_background(self.policy.background, taken)
        # The run's last, in the background, queued behind the write in flight: the
        # training is over, and the device's copy waits for the write as it would have.
        last = self.background and position >= schedule.total and not self.interrupt.stopping
        if not last:
            self._wait_for_write(position)
        if self.background:
            # Queued behind the call: the device copies it. Held in a list that the
            # writer's thread empties, so that the device's copy is let go once it is on
            # the host, not at the end of the write.
            held = [copy_taken(taken)]
            if last:  # taken to the host beside the write in flight: the device's let go
                self.writer.queue(lambda: self.host(held.pop()), self._whole(due, row))
            else:
                self.writer.submit(lambda: self._whole(due, row)(self.host(held.pop())))
        elif self.policy.background is None:
            # The state's file is written here, from its buffers, before the next call
            # donates them; the wait for the disk, the manifest and the rename go on in
            # the writer's thread, which needs no core to wait.
            self.writer.submit(self._begin(self.host(taken), due, row))
        else:  # committed at its step, as `background=False` promises
            self._begin(self.host(taken), due, row)()
        self.writing = position
        blocked = time.perf_counter() - began
        self.blocked[position] = self.blocked.get(position, 0.0) + blocked

    def _wait_for_write(self, position: int) -> None:
        """Waits for the write in flight, if any, saying so (`Checkpointing`'s)."""
        if self.writer.busy():
            # A log record, not a warning: whether a write outlasts the time between
            # checkpoints depends on the disk and the machine's load, and a warning would
            # fail a run that makes warnings errors by chance.
            level = logging.DEBUG if self.waited else logging.WARNING
            _LOG.log(level, _WAITS, position, self.writing, self.store.directory)
            self.waited = True
        self.writer.wait()

    def _whole(self, due: bool, row: int | None) -> Callable[[PyTree], Any]:
        """The whole write of a state on the host (`_begin` and its commit)."""
        return lambda host: self._begin(host, due, row)()

    def _begin(self, host: PyTree, due: bool, row: int | None) -> Callable[[], Any]:
        """Writes `host` (a state on the host) if `due`, or if its epoch (record row
        `row`) is the best yet by `keep_best`'s value; returns the rest of the write to
        run once (`Checkpoints.begin`'s commit; nothing where none is written).
        """
        if self.replays and stopped_at_non_finite(host.reason):
            return lambda: None
        value = None
        if self.monitor is not None and row is not None:
            values = self.monitor.values(host, row)  # each member's
            with warnings.catch_warnings():  # an ensemble whose members all stopped
                warnings.simplefilter("ignore", RuntimeWarning)
                value = float(np.nanmean(values))
            if not math.isfinite(value):
                value = None
        if not due and (value is None or not self._better(value)):
            return lambda: None
        return self.store.begin(host, value)

    def _better(self, value: float) -> bool:
        best = self.store.best_value()
        if best is None:
            return True
        return value < best if self.policy.mode == "min" else value > best


def in_background(asked: bool | None, state: PyTree) -> bool:
    """Whether checkpoints of `state` are written in a background thread: as `asked`
    (`Checkpoint.background`), else unless it lives on the CPU backend, where the
    writer would take cores from XLA's computation; never with several processes.
    """
    # With several processes every one takes part in a write (Orbax's shards, the
    # barrier after it), which must be in step with the training's collectives.
    if jax.process_count() > 1:
        return False
    if asked is not None:
        return asked
    # Not by default on the CPU backend. There the device's arrays are the host's memory,
    # and the next call donates them, so the background would need a real copy of the
    # state (a pass over its bytes, and one more state of memory) before its write (another
    # pass, with the CRC, into the kernel's page cache), on the cores XLA computes on:
    # the training thread's write from the state's own buffers costs about that copy
    # alone. The part that waits for the disk (fsync), slow where a copy is not, and the
    # commit go on in the writer's thread by default (`Checkpointing._save`), which needs
    # no core to wait. On a GPU or TPU the copy is the device's own (its memory's
    # bandwidth, queued behind the call), and the host's cores are free to write.
    platforms = {
        device.platform
        for x in jax.tree.leaves(state)
        if isinstance(x, jax.Array)
        for device in x.devices()
    }
    return bool(platforms - {"cpu"})


def _local(x: Any) -> np.ndarray:
    """`x` (replicated) as numpy, from this process's copy where it is global."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def agreed(flag: bool) -> bool:
    """`flag` as process 0 has it, in every process of a `jax.distributed` run (a
    decision by the clock, say, must be one decision); `flag` itself in one process.
    """
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
