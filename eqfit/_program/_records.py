"""The run's records inside its training state: each step's loss, values and batch size
at its cell of `(rows, columns)` (`Schedule.record_cell`), each epoch's values at its
row, and, while a run learns its epoch's length, the bar's running mean; emptied for each
call (then), written without a scatter, read at a row, and laid out anew once the length
is learned.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._step._step import StepResult
from ._in_place import update_slice
from ._loop import Loop
from ._state import Steps, TrainState


def add_running(running: Float[Array, "2"], out: StepResult, size: int) -> Float[Array, "2"]:
    """`running`, the bar's running mean's sums, with the step's: its loss times its
    weight (the batch size, or a weighted mean's weight), and the weight; nothing for a
    step whose loss is not finite. Kept only where the record is emptied for each call
    (`_Member.running_with`).
    """
    if out.weight is None:
        pair = jnp.stack([out.loss * size, size])
    else:
        pair = jnp.stack([jnp.where(out.weight != 0, out.loss * out.weight, 0.0), out.weight])
    return running + jnp.where(out.finite, pair, 0.0)


def fresh_record(state: TrainState) -> TrainState:
    """`state` with its record of steps emptied: NaN, and no batch."""
    return state._replace(
        step_loss=jnp.full_like(state.step_loss, jnp.nan),
        step_values=jnp.full_like(state.step_values, jnp.nan),
        batch_sizes=jnp.zeros_like(state.batch_sizes),
    )


def put(record: Array, value: Any, *index: Any) -> Array:
    """`record.at[index].set(value)` as a dynamic update slice, not a scatter: XLA
    compiles it in less time (in an ensemble's `vmap` too, `update_slice`). The indices
    are in range by construction, so neither negative ones nor clamping need handling.
    """
    value = jnp.asarray(value, record.dtype)
    update = value.reshape((1,) * len(index) + value.shape)
    return update_slice(record, update, *index, *(0,) * value.ndim)


def put_cell(
    record: Array, value: Any, place: tuple[Any, Any], active: Bool[Array, ""] | None = None
) -> Array:
    """`put` of a step's `value` into a record of `(rows, columns, ...)`, at its cell's
    `place`, `(row, column)` (`Schedule.record_place`); where `active` is false, the
    cell's own value is put back.

    Written at the cell's row and column, never through a reshape of the record to its
    cells: XLA then copies the whole record on every step to write one cell in place, a
    cost that grows with the run. And a masked step writes its one cell masked, where
    selecting between the records after and before the step reads and writes them whole.
    """
    row, column = place
    if active is not None:
        old = jax.lax.dynamic_index_in_dim(
            jax.lax.dynamic_index_in_dim(record, row, 0, False, allow_negative_indices=False),
            column,
            0,
            False,
            allow_negative_indices=False,
        )
        value = jnp.where(active, jnp.asarray(value, record.dtype), old)
    return put(record, value, row, column)


RECORDS = ("step_loss", "step_values", "batch_sizes")  # written a cell at a time


def masked(active: Bool[Array, ""], stepped: TrainState, state: TrainState) -> TrainState:
    """`stepped` where `active`, else `state`, but the records: `stepped`'s, whose step
    wrote its cell masked (`put_cell`'s `active`), so that a masked step costs no pass
    over the whole run's record.
    """
    unrecorded = {name: None for name in RECORDS}
    kept = jax.tree.map(
        lambda a, b: jnp.where(active, a, b),
        stepped._replace(**unrecorded),
        state._replace(**unrecorded),
    )
    return kept._replace(**{name: getattr(stepped, name) for name in RECORDS})


def learned_state(loop: Loop, state: TrainState, first: Steps | None) -> TrainState:
    """`state` of a run that learned its epoch's length, as `loop` (the learned one)
    keeps it: the first epoch's steps so far (`first`, on the host; `None`: none) in its
    record.
    """
    schedule = loop.schedule.shaped_for_programs()  # the programs' record's rows
    members = () if loop.members is None else (loop.members,)
    shape = (*members, schedule.rows, schedule.columns)
    if first is None:
        none = (*members, 0)
        values = np.zeros((*none, len(loop.record.names)), np.float32)
        first = Steps(np.zeros(none, np.float32), values, np.zeros(none, np.int32))

    def record(steps: ArrayLike, fill: Any) -> np.ndarray:
        """A record of `steps` (`(*members, n, ...)`) as row 0 of `(*members, rows,
        columns, ...)`, filled with `fill` elsewhere.
        """
        steps = np.asarray(steps)
        rest = steps.shape[len(members) + 1 :]
        out = np.full((*shape, *rest), fill, steps.dtype)
        out[(slice(None),) * len(members) + (0, slice(0, steps.shape[len(members)]))] = steps
        return out

    logs = (*members, schedule.rows, len(loop.log_names))
    return state._replace(
        step_loss=record(first.loss, np.nan),
        step_values=record(first.values, np.nan),
        batch_sizes=record(first.batch_sizes, 0),
        epoch_values=np.full(logs, np.nan, np.float32),
    )


def epoch_values(state: TrainState, row: Int[Array, ""], loop: Loop) -> Float[Array, " values"]:
    """The epoch's values (`Record.epoch_values`) from the steps of record row `row`."""

    def at_row(record: Array) -> Array:  # `row` is in range by construction
        return jax.lax.dynamic_index_in_dim(record, row, 0, False, allow_negative_indices=False)

    return loop.record.epoch_values(
        at_row(state.step_loss), at_row(state.step_values), at_row(state.batch_sizes)
    )


# -- `log_every=n`: the training values of every n steps, reduced from the record.


def log_rows(loop: Loop) -> int:
    """The n-th steps this run reaches (its global step count a multiple of `log_every`),
    at least one.
    """
    assert loop.log_every is not None
    return rows_every(loop, loop.log_every)


def rows_every(loop: Loop, every: int) -> int:
    """The n-th steps this run reaches (its global step count a multiple of `every`), at
    least one: the rows of a table with one for each (`log_every`'s; `validation_every`'s
    are `EveryNSteps.rows`).
    """
    return max(loop.schedule.multiples_run(every), 1)


def logs_of(
    loop: Loop, state: TrainState, begin: Int[Array, ""] | None = None
) -> Float[Array, "rows values"] | None:
    """What a call reports of the n-th steps (`log_every=n`): the training values of the
    n steps before each, reduced from the record as an epoch's are
    (`Record.epoch_values`), NaN for one not computed. With `begin` (the call's first
    step), those the call reached, one at a time: a cost of the call's steps, not of the
    run's; else every one the run has reached. Computed at the end of the drive's call,
    from the record, so the steps pay nothing for it.
    """
    every, schedule = loop.log_every, loop.schedule
    if every is None:
        return None
    first = schedule.multiples(first_step(loop, state), every)  # the first n-th's: `+ 1`
    rows = log_rows(loop)
    if begin is None:
        values = jax.vmap(lambda r: _log_row(loop, state, r))(jnp.arange(rows))
        reached = (first + 1 + jnp.arange(rows)) * every <= state.step
        return jnp.where(reached[:, None], values, jnp.nan)
    end = state.step // every - first  # the rows before it are reached

    def more(carry: tuple[Int[Array, ""], Array]) -> Bool[Array, ""]:
        return carry[0] < end

    def row(carry: tuple[Int[Array, ""], Array]) -> tuple[Int[Array, ""], Array]:
        r, table = carry
        value = jnp.where(more(carry), _log_row(loop, state, r), jnp.nan)
        return r + 1, put(table, value, jnp.clip(r, 0, rows - 1))

    width = jax.eval_shape(lambda: _log_row(loop, state, jnp.int32(0))).shape[0]
    table = jnp.full((rows, width), jnp.float32(jnp.nan))
    start = jnp.maximum(begin // every - first, 0)
    if loop.members is not None:  # while any member has a row more (`any_member`)
        return jax.lax.while_loop(lambda c: any_member(more(c)), row, (start, table))[1]
    return jax.lax.while_loop(more, row, (start, table))[1]


def _log_row(loop: Loop, state: TrainState, r: Int[Array, ""]) -> Float[Array, " values"]:
    """The values of the log's row `r` (`logs_of`): its n steps' reduced from the record,
    those the run has not reached left out.
    """
    every, schedule = loop.log_every, loop.schedule
    assert every is not None
    cells = state.step_loss.size
    first = first_step(loop, state)
    steps = (schedule.multiples(first, every) + r) * every + jnp.arange(every, dtype=jnp.int32)
    cell = schedule.record_cell(steps, first)
    inside = (steps >= first) & (steps < state.step) & (cell < cells)
    index = jnp.clip(cell, 0, cells - 1)

    def gathered(record: Array, fill: Any) -> Array:
        flat = record.reshape(cells, *record.shape[2:])
        picked = flat.at[index].get(mode="promise_in_bounds")
        return jnp.where(inside.reshape(-1, *(1,) * (picked.ndim - 1)), picked, fill)

    return loop.record.epoch_values(
        gathered(state.step_loss, jnp.nan),
        gathered(state.step_values, jnp.nan),
        gathered(state.batch_sizes, 0),
    )


MEMBERS = "members"  # the axis an ensemble's programs are vmapped over (`each_member`)


def first_step(loop: Loop, state: TrainState) -> Int[Array, ""]:
    """The run's first step (`TrainState.first`), whence its record's rows count. In an
    ensemble, the members' one (they begin together), as one value for all: rows and
    cells made from it are then the members' own one, which they write in place, where
    one of each member's would be a scatter in the members' `vmap`.
    """
    if loop.members is None:
        return state.first
    return jax.lax.pmax(state.first, MEMBERS)


def any_member(more: Bool[Array, ""]) -> Bool[Array, ""]:
    """Whether any member of an ensemble has `more`: the same for all, no member's own
    (a loop whose condition differs between a `vmap`'s members selects each member's
    whole carry after every turn).
    """
    return jax.lax.psum(more.astype(jnp.int32), MEMBERS) > 0
