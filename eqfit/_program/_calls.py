"""What the drive calls: the run's program as a way of running the steps makes it
(`Program`): one call of `run` (`WholeRunCalls`), or calls of `unrolled`, a few steps
each, the host following the run's position by the schedule (`StepCalls`).
"""

import abc
import collections
import functools
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from jaxtyping import Array, PyTree

from ._compile import PROGRAM_CACHE
from ._loop import Loop
from ._program import run, unrolled
from ._state import CallEnd, Inputs, Report, TrainState


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
    it no-ops, and its report says where it stopped).
    """

    def __init__(self, loop: Loop, unroll: int):
        self.loop, self.unroll = loop, unroll
        compile = loop.placement.compile
        self.full: Any = compile(functools.partial(unrolled, loop, unroll, False), (0,))
        self.last: Any = compile(functools.partial(unrolled, loop, 1, True), (0,))

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
            closes = reached > position and schedule.is_epoch_end(reached)
            until = CallEnd(np.int32(reached), np.bool_(fresh), np.bool_(closes))
            state, report = (self.last if last else self.full)(state, inputs, until)
            fresh = False
            if reached >= stop or reached == position:
                return state, report, reached
            position = reached
            in_flight.append(report.step)
            if len(in_flight) > AHEAD:
                in_flight.popleft().block_until_ready()
            if stopping is not None and stopping():
                return state, report, position

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
        until = CallEnd(np.int32(stop), np.bool_(True), np.bool_(True))
        passes = self.loop.schedule.passes
        lowered = []
        if inputs.piece is not None or passes is None or passes.num_full:
            lowered.append(self.full.lower(state, inputs, until))
        if inputs.piece is None and passes is not None and passes.remainder:
            lowered.append(self.last.lower(state, inputs, until))
        return lowered
