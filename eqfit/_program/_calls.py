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
from jaxtyping import Array, PyTree

from .._core._data import batch_calls
from .._step._labels import LabelError
from ._compile import PROGRAM_CACHE
from ._loop import Loop
from ._program import close, run, unrolled, validation_batches
from ._state import CallEnd, Inputs, Report, TrainState, ValAt, ValSums


def program_key(loop: Loop) -> tuple[str, Loop]:
    """Where the run's program compiled for `loop` is cached (with its speed)."""
    return ("run", loop)


def program_for(loop: Loop) -> "Program":
    """The run's program for `loop`, as its `execution` runs the steps (cached)."""
    unroll = loop.execution.steps_per_program()

    def make() -> Program:
        return WholeRunCalls(loop) if unroll is None else StepCalls(loop, unroll)

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
    ) -> tuple[TrainState, Report, int]:
        """Returns the state, the report, and the position the call goes to: `stop`, or
        less where `stopping()` turned true on the way (a signal), where a program of
        few steps a call sees it.
        """

    @abc.abstractmethod
    def lower(self, state: PyTree, inputs: Inputs, stop: int) -> list[Any]:
        """Its compiled programs lowered for a call to `stop`, the one that runs most
        steps first: what `eqfit.plan` compiles, and what `fit` traces while `start`
        compiles.
        """


class WholeRunCalls(Program):
    """`WholeRun`'s: `run`, compiled by the placement, the state donated."""

    def __init__(self, loop: Loop):
        self.compiled: Any = loop.placement.compile(functools.partial(run, loop), (0,))

    def __call__(
        self,
        state: TrainState,
        inputs: Inputs,
        begin: int,
        stop: int,
        stopping: Callable[[], bool] | None = None,
    ) -> tuple[TrainState, Report, int]:
        del begin, stopping  # the state knows where it is; one call, to `stop`
        return *self.compiled(state, inputs, np.int32(stop)), stop

    def lower(self, state: PyTree, inputs: Inputs, stop: int) -> list[Any]:
        return [self.compiled.lower(state, inputs, np.int32(stop))]


# How many calls of a `PerStep` program the host queues ahead of the device: enough
# that the device never waits for the host between steps.
AHEAD = 2


class StepCalls(Program):
    """`PerStep`'s: calls of `unrolled`, each of `unroll` steps or of a pass's smaller
    last batch, dispatched one after the other with no wait between them; the host
    follows the run's position by the schedule (a run that stops makes the calls after
    it no-ops, and its report says where it stopped). At an epoch's end, calls of
    `validation_batches`, each of `unroll` batches of a set or of its smaller last
    batch, then one of `close`: validation runs as the steps do, with no loop around
    its batches.
    """

    def __init__(self, loop: Loop, unroll: int):
        self.loop, self.unroll = loop, unroll
        compile = loop.placement.compile
        self.full: Any = compile(functools.partial(unrolled, loop, unroll, False), (0,))
        self.last: Any = compile(functools.partial(unrolled, loop, 1, True), (0,))
        self.close: Any = compile(functools.partial(close, loop), (0,))
        self.validations: dict[tuple[int, int, bool], Any] = {}  # by set, batches, remainder

    def __call__(
        self,
        state: TrainState,
        inputs: Inputs,
        begin: int,
        stop: int,
        stopping: Callable[[], bool] | None = None,
    ) -> tuple[TrainState, Report, int]:
        schedule, position, fresh = self.loop.schedule, begin, True
        if not schedule.learning:
            stop = min(stop, schedule.total)
        # The device runs at most `AHEAD` calls behind the host: a signal then stops
        # training within a few steps, as the host sees it between calls.
        in_flight: collections.deque[Array] = collections.deque()
        while True:
            last, reached = self.next_call(position, stop, inputs.piece is not None)
            until = CallEnd(np.int32(reached), np.bool_(fresh))
            state, report = (self.last if last else self.full)(state, inputs, until)
            fresh = False
            if reached > position and schedule.is_epoch_end(reached):
                state, report = self.close_epoch(state, inputs, reached)
            if reached >= stop or reached == position:
                return state, report, reached
            position = reached
            in_flight.append(report.step)
            if len(in_flight) > AHEAD:
                in_flight.popleft().block_until_ready()
            if stopping is not None and stopping():
                return state, report, position

    def close_epoch(self, state: TrainState, inputs: Inputs, end: int) -> tuple[TrainState, Report]:
        """The epoch that ends at step `end` validated, if due, and closed."""
        sums: tuple[ValSums, ...] = ()
        validation, schedule = self.loop.validation, self.loop.schedule
        if validation is not None:
            epoch = schedule.epoch_of(end - 1)
            due = epoch % validation.freq == 0
            sets = validation.sets or (None,)
            sums = tuple(self.validate(state, inputs, i, epoch, due) for i in range(len(sets)))
        return self.close(state, (inputs, sums), CallEnd(np.int32(end), np.bool_(False)))

    def validate(self, state: TrainState, inputs: Inputs, i: int, epoch: int, due: bool) -> ValSums:
        """Validation set `i`'s sums at epoch `epoch`: its batches, `unroll` a call, and
        its smaller last batch; none where validation is not `due` (its values are NaN).
        """
        loop = self.loop
        validation = loop.validation
        assert validation is not None
        data = inputs.val_data[validation.sets[i]] if validation.sets else inputs.val_data
        members = () if loop.members is None else (loop.members,)
        values = len(loop.val_names) // max(len(validation.sets), 1)
        none = LabelError.none()
        sums = ValSums(
            np.zeros((*members, 2, values), np.float32),
            jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (*members, *x.shape)), none),
        )
        sums = loop.placement.put(sums)
        if not due:
            return sums
        rows = loop.placement.rows(data)
        for b, count, remainder in batch_calls(rows, loop.schedule.batch_size, self.unroll):
            at = ValAt(np.int32(b), np.int32(epoch))
            sums = self.validation(i, count, remainder)((state, sums), inputs, at)
        return sums

    def validation(self, i: int, count: int, remainder: bool) -> Any:
        """The program of set `i`'s `count` batches, or of its smaller last batch."""
        if (i, count, remainder) not in self.validations:
            fn = functools.partial(validation_batches, self.loop, i, count, remainder)
            self.validations[i, count, remainder] = self.loop.placement.compile(fn)
        return self.validations[i, count, remainder]

    def next_call(self, position: int, stop: int, streamed: bool) -> tuple[bool, int]:
        """Whether the call from `position` is the pass's smaller last batch's, and the
        position it reaches: `unroll` steps on, or at `stop`, the epoch's end or the
        pass's full batches' end if sooner.
        """
        schedule, passes = self.loop.schedule, self.loop.schedule.passes
        end = min(stop, schedule.next_epoch_end(position))
        if streamed or passes is None:  # a piece's batches are all alike
            return False, max(min(position + self.unroll, end), position)
        first = schedule.pass_start(schedule.pass_of(position))
        remainder = schedule.remainder_step(schedule.pass_of(position))
        if (remainder is not None and position == remainder) or not passes.num_full:
            return True, max(min(position + 1, end), position)
        end = min(end, first + passes.num_full)
        return False, max(min(position + self.unroll, end), position)

    def lower(self, state: PyTree, inputs: Inputs, stop: int) -> list[Any]:
        until = CallEnd(np.int32(stop), np.bool_(True))
        passes = self.loop.schedule.passes
        lowered = []
        if inputs.piece is not None or passes is None or passes.num_full:
            lowered.append(self.full.lower(state, inputs, until))
        if inputs.piece is None and passes is not None and passes.remainder:
            lowered.append(self.last.lower(state, inputs, until))
        return lowered
