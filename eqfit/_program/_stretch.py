"""A stretch of steps whose bookkeeping waits for its end.

Each step of a run writes its loss (and values) to the run's record and adds to the
running mean's sums. The rest of what it used to write every step, the run's reason to
stop, the step its loss first went non-finite, and the step's batch size, is the same for
every step of a stretch but its last, so one model's run that stops at its first
non-finite step (`on_nan="raise"` or `"stop"`) writes them once, where the stretch ends
(`settle`). A step of small kernels runs no kernel for them: on XLA:CPU each is a thunk
of its own, and on a TPU each waits on the scalar core for the loss.

The loop's condition reads the last step's reason to stop (`StepEnd`, carried), where the
state's `reason` said it.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ._loop import Loop
from ._records import first_step, put
from ._state import Stop, TrainState


class StepEnd(NamedTuple):
    """What a step leaves for its stretch's end (`settle`): the reason it stops the run
    with, `Stop.RUNNING` where its loss was finite. One value, made with the step's
    finiteness in one kernel, where a flag and the reason apart were a kernel each.
    """

    reason: Int[Array, ""]

    @staticmethod
    def start() -> "StepEnd":
        return StepEnd(jnp.asarray(Stop.RUNNING, jnp.int32))

    @staticmethod
    def of(finite: Bool[Array, ""], bad_label: Bool[Array, ""] | None) -> "StepEnd":
        why = Stop.NON_FINITE_LOSS
        if bad_label is not None:
            why = jnp.where(bad_label, Stop.BAD_LABEL, Stop.NON_FINITE_LOSS)
        return StepEnd(jnp.where(finite, Stop.RUNNING, why).astype(jnp.int32))

    @property
    def finite(self) -> Bool[Array, ""]:
        return self.reason == Stop.RUNNING


def waits(loop: Loop) -> bool:
    """Whether `loop`'s steps can leave their bookkeeping to their stretch's end: one
    model (an ensemble's members stop apart, each step masked), a run that stops at its
    first non-finite step (`"skip"` goes on), and a record whose rows are epochs (a
    stretch lies in one row).
    """
    schedule = loop.schedule
    return (
        loop.members is None
        and loop.step.on_nan != "skip"
        and not schedule.learning
        and schedule.columns == schedule.steps_per_epoch
    )


def steps_waiting(
    more: Callable[[TrainState], Bool[Array, ""]],
    step: Callable[[TrainState], tuple[TrainState, StepEnd]],
    state: TrainState,
    size: int,
    loop: Loop,
) -> TrainState:
    """Steps (`step`) while `more` and the last step was finite, then the stretch's
    bookkeeping (`settle`) for its steps of batches of `size` rows.
    """
    begin = state.step

    def go_on(carry: tuple[TrainState, StepEnd]) -> Bool[Array, ""]:
        state, end = carry
        return more(state) & end.finite

    state, end = jax.lax.while_loop(go_on, lambda c: step(c[0]), (state, StepEnd.start()))
    return settle(loop, state, begin, end, size)


def settle(
    loop: Loop, state: TrainState, begin: Int[Array, ""], end: StepEnd, size: int
) -> TrainState:
    """`state` after the steps from `begin` (a stretch inside one row of the record) with
    what each would have written: the reason to stop and the step of the first
    non-finite loss (the last step, if not finite), and each step's batch size.
    """
    schedule = loop.schedule
    last = state.step - 1
    stopped = ~end.finite
    state = state._replace(
        reason=jnp.where(stopped, end.reason, state.reason),
        nan_step=jnp.where(stopped & (state.nan_step < 0), last, state.nan_step),
    )
    row = schedule.record_row(begin, first_step(loop, state))
    first = schedule.record_column(begin)
    ran = state.step - begin
    columns = jnp.arange(schedule.columns)
    inside = (columns >= first) & (columns < first + ran)
    sizes = jnp.where(inside, jnp.asarray(size, jnp.int32), state.batch_sizes[row])
    return state._replace(batch_sizes=put(state.batch_sizes, sizes, row))
