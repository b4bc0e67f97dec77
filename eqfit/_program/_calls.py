"""What the drive calls: the run's program as a way of running the steps makes it
(`Program`): one call of `run` (`WholeRunCalls`), or calls of `unrolled`, a few steps
each, the host following the run's position by the schedule (`StepCalls`).
"""

import abc
import collections
import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np
from jaxtyping import Array, Int, PyTree

from .._core._data import batch_calls
from .._step._labels import LabelError
from ._beside import logs, validation_batches, validation_chunk
from ._compile import PROGRAM_CACHE
from ._loop import Loop
from ._program import close, run, unrolled as reporting_unrolled
from ._state import (
    CallEnd,
    Inputs,
    OnDevice,
    ReadSet,
    Releases,
    Report,
    Stop,
    TrainState,
    ValAt,
    ValSums,
)


def program_key(loop: Loop) -> tuple[str, Loop]:
    """Where the run's program compiled for `loop` is cached (with its speed): by its
    shape, not its extent (`Loop.for_programs`).
    """
    return ("run", loop.for_programs())


def program_for(loop: Loop) -> "Program":
    """The run's program for `loop`, as its `execution` makes it (cached)."""

    loop = loop.for_programs()

    def make() -> Program:
        return loop.execution.program(
            functools.partial(WholeRunCalls, loop), functools.partial(StepCalls, loop)
        )

    return cast(Program, PROGRAM_CACHE.get(program_key(loop), make))


class Program(abc.ABC):
    """The run's program as the drive calls it: trains from `begin` (the state's
    position) to the global step `stop`, or until stopped, and reports.
    """

    @abc.abstractmethod
    def __call__(
        self,
        state: TrainState,
        inputs: Inputs,
        begin: int,
        stop: int,
        stopping: Callable[[], bool] | None = None,
        validation: ReadSet | None = None,
    ) -> tuple[TrainState, Report, int]:
        """Returns the state, the report, and the position the call goes to: `stop`, or
        less where `stopping()` turned true on the way (a signal), where a program of
        few steps a call sees it. `validation`: how to read the validation sets, where
        they stream (`Validation.streamed`).
        """

    def snap(self, position: int, stop: int) -> int:
        """Where a call from `position` that time (the drive's `CallSizer`) would end at
        `stop` ends instead: `stop`, but where a program's steps must not be split.
        """
        return stop

    @abc.abstractmethod
    def lower(self, state: PyTree, inputs: Inputs, stop: int) -> list[Any]:
        """Its compiled programs lowered for a call to `stop`, the one that runs most
        steps first: what `eqfit.plan` compiles, and what `fit` traces while `start`
        compiles.
        """


class WholeRunCalls(Program):
    """`WholeRun`'s: `run`, compiled by the placement, the state donated. Where validation
    streams, a call of `run` to each epoch end on the way, which the host then closes
    (`EpochCloses`): the sets are read as the epoch ends, not held in the program; a
    signal then stops the call at the next epoch end.
    """

    def __init__(self, loop: Loop):
        self.loop = loop
        self.compiled: Any = loop.placement.compile(
            functools.partial(run, loop), (0,), loop.compiler_options
        )
        validation = loop.validation
        self.closes = None
        if validation is not None and validation.streamed:
            self.closes = EpochCloses(loop)

    def __call__(
        self,
        state: TrainState,
        inputs: Inputs,
        begin: int,
        stop: int,
        stopping: Callable[[], bool] | None = None,
        validation: ReadSet | None = None,
    ) -> tuple[TrainState, Report, int]:
        if self.closes is None:  # one call, to `stop`: the state knows where it is
            return *self.compiled(state, inputs, np.int32(stop)), stop
        schedule, position = self.loop.schedule, begin
        while True:
            reached = stop if schedule.learning else min(stop, self.loop.next_boundary(position))
            state, report = self.compiled(state, inputs, np.int32(reached))
            stopped = False
            if reached > position and self.closes.due(reached):
                # The set is read only for a running run.
                stopped = self.closes.stopped(report.reason)
                state, report = self.closes(state, inputs, reached, None if stopped else validation)
            signalled = stopping is not None and stopping()  # a signal: stop at an epoch end
            if reached >= stop or reached == position or stopped or signalled:
                return state, self.closes.logged(state, inputs, report), reached
            position = reached

    def lower(self, state: PyTree, inputs: Inputs, stop: int) -> list[Any]:
        return [self.compiled.lower(state, inputs, np.int32(stop))]


class EpochCloses:
    """An epoch's end as the host makes it, where the run's program leaves it to the host
    (`PerStep`'s, and every run whose validation streams): each set's validation sums,
    added up by programs of its batches as the run's execution runs them
    (`Execution.batches`), then one call of `close`. A set in memory is read by
    `validation_batches`, a few batches a call; a streamed set, as its chunks arrive, by
    `validation_chunk` (a chunk's batches in one scan a call) or `validation_batches` (a
    few of a chunk's batches a call).
    """

    def __init__(self, loop: Loop):
        self.loop = loop
        self.close: Any = loop.placement.compile(functools.partial(close, loop), (0,))
        self.programs: dict[tuple[Any, ...], Any] = {}  # by kind, set, size, batches
        self.logs: Any = None
        if loop.log_every is not None:
            self.logs = loop.placement.compile(functools.partial(logs, loop))

    def due(self, position: int) -> bool:
        """Whether the host closes something at `position`: an epoch's end, or a
        validation's step (`validation_every`).
        """
        return self.loop.schedule.is_epoch_end(position) or self.loop.validates_at(position)

    def stopped(self, reason: Int[Array, "*members"]) -> bool:
        """Whether the run (every member) has stopped, by its `reason` (a report's, or a
        state's): read where the validation sets stream, whose reading syncs with the
        device anyway, so that a stopped run reads none of them.
        """
        validation = self.loop.validation
        if validation is None or not validation.streamed:
            return False
        read = np.asarray(self.loop.placement.host(reason))
        return bool((read != Stop.RUNNING).all())

    def logged(self, state: TrainState, inputs: Inputs, report: Report) -> Report:
        """`report` with the n-th steps' values (`log_every`), at a drive's call's end."""
        if self.logs is None:
            return report
        until = CallEnd(np.int32(0), np.bool_(False))
        return report._replace(logs=self.logs(state, inputs, until))

    def __call__(
        self, state: TrainState, inputs: Inputs, end: int, validation: ReadSet | None
    ) -> tuple[TrainState, Report]:
        """The epoch that ends at step `end` validated, if due, and closed; with
        `validation_every`, at a validation's step too, validated there. Where the
        validation sets stream, `validation` reads them; `None` there: the run has
        stopped (`stopped`), and nothing is read, since `close` keeps nothing of it.
        """
        sums: tuple[ValSums, ...] = ()
        loop_validation, schedule = self.loop.validation, self.loop.schedule
        if loop_validation is not None:
            # The validation's keys are folded from the epoch, or the step (`every`).
            epoch, due = loop_validation.steps.when(schedule, end, loop_validation.freq)
            if loop_validation.streamed and validation is None:
                due = False
            sets = loop_validation.sets or (None,)
            sums = tuple(
                self.validate(state, inputs, i, epoch, due, validation) for i in range(len(sets))
            )
        return self.close(state, (inputs, sums), CallEnd(np.int32(end), np.bool_(False)))

    def validate(
        self,
        state: TrainState,
        inputs: Inputs,
        i: int,
        epoch: int,
        due: bool,
        validation: ReadSet | None,
    ) -> ValSums:
        """Validation set `i`'s sums at epoch `epoch`: its batches, and its smaller last
        batch; none where validation is not `due` (its values are NaN).
        """
        loop = self.loop
        members = () if loop.members is None else (loop.members,)
        values = loop.val_width
        none = LabelError.none()
        sums = ValSums(
            np.zeros((*members, 2, values), np.float32),
            jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (*members, *x.shape)), none),
        )
        sums = loop.placement.put(sums)
        if not due:
            return sums
        if validation is not None:
            return self.validate_streamed(state, inputs, i, epoch, validation, sums)
        name = self.sets()[i]
        data = inputs.val_data if name is None else inputs.val_data[name]
        rows, batch_size = loop.placement.rows(data), loop.schedule.batch_size

        def in_calls(unroll: int) -> ValSums:
            added = sums
            for b, count, remainder in batch_calls(rows, batch_size, unroll):
                at = ValAt(np.int32(b), np.int32(epoch))
                program = self.program("batches", i, batch_size, count, remainder)
                added = program((state, added), (inputs, None), at)
            return added

        # No program loops over a set in memory for the host: a batch a call there (the
        # host closes the epochs of a run whose steps loop only where its sets stream).
        return loop.execution.batches(functools.partial(in_calls, 1), in_calls)

    def validate_streamed(
        self,
        state: TrainState,
        inputs: Inputs,
        i: int,
        epoch: int,
        validation: ReadSet,
        sums: ValSums,
    ) -> ValSums:
        """A streamed set `i`'s sums at epoch `epoch`, its chunks added as they arrive."""
        with validation(i, self.loop.schedule.batch_size) as chunks:
            done = Releases()
            for chunk in chunks:
                args = (state, inputs, i, epoch, chunk, sums)
                sums = self.loop.execution.batches(
                    functools.partial(self.chunk_scanned, *args),
                    functools.partial(self.chunk_in_calls, *args),
                )
                done.computed(chunk, sums)
            done.computed()
        return sums

    def chunk_scanned(
        self, state: TrainState, inputs: Inputs, i: int, epoch: int, chunk: OnDevice, sums: ValSums
    ) -> ValSums:
        """A streamed set `i`'s `chunk` added to its `sums` by one program."""
        valid = np.asarray(chunk.valid, np.int32)
        at = ValAt(np.int32(0), np.int32(epoch), chunk.offset, valid)
        program = self.program("chunk", i, chunk.batch_size)
        return program((state, sums), (inputs, chunk.data), at)

    def chunk_in_calls(
        self,
        state: TrainState,
        inputs: Inputs,
        i: int,
        epoch: int,
        chunk: OnDevice,
        sums: ValSums,
        unroll: int,
    ) -> ValSums:
        """A streamed set `i`'s `chunk` added to its `sums` by programs of `unroll`
        batches (`OnDevice.calls`).
        """
        size, valid = chunk.batch_size, np.asarray(chunk.valid, np.int32)
        for b, count in chunk.calls(unroll):
            at = ValAt(np.int32(b), np.int32(epoch), chunk.offset, valid)
            program = self.program("batches", i, size, count, False)
            sums = program((state, sums), (inputs, chunk.data), at)
        return sums

    def sets(self) -> tuple[Any, ...]:
        validation = self.loop.validation
        assert validation is not None
        return validation.sets or (None,)

    def program(self, kind: str, i: int, *sizes: Any) -> Any:
        """The program of set `i`'s batches: `"batches"`, `validation_batches` (of a batch
        size, of `count` batches or the smaller last); `"chunk"`, `validation_chunk` (of a
        chunk of batches of a size, all of them)."""
        if (kind, i, *sizes) not in self.programs:
            make = validation_batches if kind == "batches" else validation_chunk
            fn = functools.partial(make, self.loop, i, *sizes)
            self.programs[kind, i, *sizes] = self.loop.placement.compile(fn)
        return self.programs[kind, i, *sizes]


# How many calls of a `PerStep` program the host queues ahead of the device: enough
# that the device never waits for the host between steps.
AHEAD = 2


def unrolled(
    loop: Loop, unroll: int, remainder: bool, state: TrainState, inputs: Inputs, until: CallEnd
) -> tuple[TrainState, Int[Array, "*members"]]:
    """`_program.unrolled`'s state, and the position it reached (a copy, which the host
    may wait on once the state is donated to the next call), with no report: a report
    copies the run's table of epochs (and validations) at each call, where the host reads
    one a call of the drive's (`reported`).
    """
    state, report = reporting_unrolled(loop, unroll, remainder, state, inputs, until)
    return state, report.step


def reported(loop: Loop, state: TrainState, inputs: Inputs, until: CallEnd) -> Report:
    """The report of `state`, as the call of `_program.unrolled` that made it reports
    (one of no step), for the host to read once later calls have the state.
    """
    return reporting_unrolled(loop, 0, False, state, inputs, until)[1]


class StepCalls(Program):
    """`PerStep`'s: calls of `unrolled`, each of `unroll` steps or of a pass's smaller
    last batch, dispatched one after the other with no wait between them; the host
    follows the run's position by the schedule (a run that stops makes the calls after
    it no-ops, and its report says where it stopped). At an epoch's end, `EpochCloses`:
    calls of `unroll` batches of each set (or of its smaller last batch), then one of
    `close`: validation runs as the steps do, with no loop around its batches.

    The host's work a call is the call: the calls of a stretch (`stretch`) share their
    arguments from the host, put on the device once, and the report of the drive's call
    is made once, at its end.
    """

    def __init__(self, loop: Loop, unroll: int):
        self.loop, self.unroll = loop, unroll
        compile = functools.partial(loop.placement.compile, options=loop.compiler_options)
        self.full: Any = compile(functools.partial(unrolled, loop, unroll, False), (0,))
        self.last: Any = compile(functools.partial(unrolled, loop, 1, True), (0,))
        self.report: Any = loop.placement.compile(functools.partial(reported, loop))
        self.closes = EpochCloses(loop)

    def __call__(
        self,
        state: TrainState,
        inputs: Inputs,
        begin: int,
        stop: int,
        stopping: Callable[[], bool] | None = None,
        validation: ReadSet | None = None,
    ) -> tuple[TrainState, Report, int]:
        # `stop` is within the run: the drive stops its calls at the run's end.
        position, fresh = begin, True
        # The device runs at most `AHEAD` calls behind the host: a signal then stops
        # training within a few steps, as the host sees it between calls.
        in_flight: collections.deque[Array] = collections.deque()
        while True:
            last, end, idle = self.stretch(position, stop, inputs.piece is not None)
            program, steps = (self.last, 1) if last else (self.full, self.unroll)
            # Each call's steps stop at `end` on the device as on the host.
            until = self.loop.placement.constant(CallEnd(np.int32(end), np.bool_(fresh)))
            while True:  # a call at least: one with nothing to do still reports
                state, step = program(state, inputs, until)
                # The first call may begin inside the stretch: its first slots idle.
                reached = max(min(position + steps - idle, end), position)
                idle = 0
                if reached >= end:
                    break
                if fresh:  # only the drive's call's first begins its record afresh
                    until = self.loop.placement.constant(CallEnd(np.int32(end), np.bool_(False)))
                    fresh = False
                position = self.sent(in_flight, step, reached)
                if stopping is not None and stopping():
                    return state, self.reporting(state, inputs), position
            fresh, report = False, None
            if reached > position and self.closes.due(reached):
                read = None if self.closes.stopped(state.reason) else validation
                state, report = self.closes(state, inputs, reached, read)
            if reached >= stop or reached == position:
                return state, self.reporting(state, inputs, report), reached
            position = self.sent(in_flight, step if report is None else report.step, reached)
            if stopping is not None and stopping():
                return state, self.reporting(state, inputs, report), position

    def sent(self, in_flight: collections.deque[Array], step: Array, reached: int) -> int:
        """Keeps at most `AHEAD` calls in flight, `step` the newest's (it waits only
        where the device is behind the host); returns `reached`.
        """
        in_flight.append(step)
        if len(in_flight) > AHEAD:
            in_flight.popleft().block_until_ready()
        return reached

    def reporting(self, state: TrainState, inputs: Inputs, report: Report | None = None) -> Report:
        """The report of the drive's call that ends at `state`: `close`'s, if the call
        ended at one (`report`), or else made from `state`; with its n-th steps' values.
        """
        if report is not None:
            return self.closes.logged(state, inputs, report)
        until = self.loop.placement.constant(CallEnd(np.int32(0), np.bool_(False)))
        return self.closes.logged(state, inputs, self.report(state, inputs, until))

    def stretch(self, position: int, stop: int, streamed: bool) -> tuple[bool, int, int]:
        """Whether the calls from `position` are of the pass's smaller last batch, where
        they end (at `stop`, the epoch's end, a validation's step, or the pass's full
        batches' end; the last batch's call, one step on), and the slots the first leaves
        idle (`Loop.idle_slots`). No step before that end ends an epoch or validates: the
        host has nothing to do between its calls.
        """
        loop, schedule, passes = self.loop, self.loop.schedule, self.loop.schedule.passes
        end = min(stop, loop.next_boundary(position))
        idle = loop.idle_slots(position, self.unroll)
        if streamed or passes is None:  # a piece's batches are all alike
            return False, max(end, position), idle
        first = schedule.pass_start(schedule.pass_of(position))
        remainder = schedule.remainder_step(schedule.pass_of(position))
        if (remainder is not None and position == remainder) or not passes.num_full:
            return True, max(min(position + 1, end), position), 0
        return False, max(min(end, first + passes.num_full), position), idle

    def snap(self, position: int, stop: int) -> int:
        """Where a call of the drive's from `position` that time would end at `stop` ends:
        where a call of the program begins at or before `stop` (or, if none is past
        `position`, where the first call from `position` ends). The steps of one call
        are never split between two by time: their bits might differ by an ulp.
        """
        if self.unroll == 1:
            return stop
        back = stop - self.loop.idle_slots(stop, self.unroll)
        if back > position:
            return back
        _, end, idle = self.stretch(position, stop + self.unroll, False)
        return max(min(position + self.unroll - idle, end), position)

    def lower(self, state: PyTree, inputs: Inputs, stop: int) -> list[Any]:
        until = CallEnd(np.int32(stop), np.bool_(True))
        passes = self.loop.schedule.passes
        lowered = []
        if inputs.piece is not None or passes is None or passes.num_full:
            lowered.append(self.full.lower(state, inputs, until))
        if inputs.piece is None and passes is not None and passes.remainder:
            lowered.append(self.last.lower(state, inputs, until))
        return lowered
