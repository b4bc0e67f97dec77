"""A stretch of steps whose bookkeeping waits for its end.

Each step of a run writes its loss (and values) to the run's record. The rest of what it
used to write every step, the run's reason to stop and the step its loss first went
non-finite, the step's batch size and the running mean's sums, is the same for every step
of a stretch but its last, so one model's run that stops at its first non-finite step
(`on_nan="raise"` or `"stop"`) writes them once, where the stretch ends (`settle`). A step
of small kernels runs no kernel for them: on XLA:CPU each is a thunk of its own, and on a
TPU each waits on the scalar core for the loss.

The loop's condition reads whether the last step was finite (`StepEnd`, carried), where
the state's `reason` said so. The running mean's sums are added up at the end in the
steps' order, as each step added them, so that they are the same bits.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._loop import Loop
from ._records import put
from ._state import Stop, TrainState


# Cells of the record added up per turn of `add_running`'s loop, written out: a chain of
# scalar additions that XLA fuses into one kernel.
CHUNK = 128


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
    weighted: bool,
) -> TrainState:
    """Steps (`step`) while `more` and the last step was finite, then the stretch's
    bookkeeping (`settle`) for its steps of batches of `size` rows.
    """
    begin = state.step

    def go_on(carry: tuple[TrainState, StepEnd]) -> Bool[Array, ""]:
        state, end = carry
        return more(state) & end.finite

    state, end = jax.lax.while_loop(go_on, lambda c: step(c[0]), (state, StepEnd.start()))
    return settle(loop, state, begin, end, size, weighted)


def settle(
    loop: Loop, state: TrainState, begin: Int[Array, ""], end: StepEnd, size: int, weighted: bool
) -> TrainState:
    """`state` after the steps from `begin` (a stretch inside one row of the record) with
    what each would have written: the reason to stop and the step of the first
    non-finite loss (the last step, if not finite), each step's batch size, and (but for
    a weighted mean's loss, which each step added) the running mean's sums.
    """
    schedule = loop.schedule
    last = state.step - 1
    stopped = ~end.finite
    state = state._replace(
        reason=jnp.where(stopped, end.reason, state.reason),
        nan_step=jnp.where(stopped & (state.nan_step < 0), last, state.nan_step),
    )
    row = schedule.record_row(begin)
    first = schedule.record_column(begin)
    ran = state.step - begin
    columns = jnp.arange(schedule.columns)
    inside = (columns >= first) & (columns < first + ran)
    sizes = jnp.where(inside, jnp.asarray(size, jnp.int32), state.batch_sizes[row])
    state = state._replace(batch_sizes=put(state.batch_sizes, sizes, row))
    if weighted:
        return state
    losses = state.step_loss[row]
    running = add_running(state.running, losses, first, first + ran, end.finite, size)
    return state._replace(running=running)


def add_running(
    running: Float[Array, "2"],
    losses: Float[Array, " columns"],
    first: Int[Array, ""],
    stop: Int[Array, ""],
    finite: Bool[Array, ""],
    size: int,
) -> Float[Array, "2"]:
    """`running` plus each step's loss times `size`, and `size`, for the cells `first` to
    `stop` of `losses` (the last only if `finite`), one after another in the steps'
    order: the sums a step adds (`_records.running_pair`), the same bits.
    """
    columns = losses.shape[0]
    chunk = min(CHUNK, columns)
    padded = -(-columns // chunk) * chunk
    losses = jnp.pad(losses, (0, padded - columns), constant_values=jnp.nan)

    def turn(i: Int[Array, ""], running: Float[Array, "2"]) -> Float[Array, "2"]:
        start = i * chunk
        cells = jax.lax.dynamic_slice(losses, (start,), (chunk,), allow_negative_indices=False)
        for j in range(chunk):
            c = start + j
            counted = (c >= first) & (c < stop) & ((c < stop - 1) | finite)
            pair = jnp.stack([cells[j] * size, size])
            running = running + jnp.where(counted, pair, 0.0)
        return running

    return jax.lax.fori_loop(first // chunk, (stop + chunk - 1) // chunk, turn, running)
