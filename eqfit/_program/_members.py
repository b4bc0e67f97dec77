"""An ensemble's loops of steps, in the `vmap` of a member's program over its members
(`each_member`).

Its members may stop apart (a NaN in one, early stopping), so a loop of its steps runs
while any member has more, each member's step masked by its own condition: a select of
the member's whole state after every step (`_records.masked`). While every member has
more, though, all are at the same step and all step: those steps run first, in a loop of
their own with no mask, at a step that is one value for all (the record's cell is then
one place, written in place). The masked loop takes what is left of the stretch once a
member has stopped; where none has, it runs no turn.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from ._records import any_member, MEMBERS, put
from ._state import TrainState


def steps_while(
    members: int | None,
    more: Callable[[TrainState], Bool[Array, ""]],
    step: Callable[[TrainState, Bool[Array, ""] | None], TrainState],
    state: TrainState,
    together: bool = True,
) -> TrainState:
    """Steps (`step(state, active)`) while `more(state)`: for the one model, unmasked
    (`active` `None`); in an ensemble (of `members`), unmasked while every member has
    more, then while any has, each member's step masked by its own `more`. Without
    `together` (a loop that runs once a pass, the remainder's), the masked loop alone:
    a copy of the step fewer for XLA to compile.
    """
    if members is None:
        return jax.lax.while_loop(more, lambda s: step(s, None), state)
    if together:
        state = jax.lax.while_loop(every_member(more), lambda s: step(one_step(s), None), state)
    return jax.lax.while_loop(some_member(more), lambda s: step(s, more(s)), state)


def every_member(
    more: Callable[[TrainState], Bool[Array, ""]],
) -> Callable[[TrainState], Bool[Array, ""]]:
    """Whether every member has `more`, all at one step: the same for all members.

    (Members that all run are at one step: they start together, step together while
    all have more, and one that stops stays stopped. Asked all the same, as `one_step`
    takes it so.)
    """

    def together(state: TrainState) -> Bool[Array, ""]:
        level = state.step == jax.lax.pmax(state.step, MEMBERS)
        return jax.lax.pmin((more(state) & level).astype(jnp.int32), MEMBERS) > 0

    return together


def some_member(
    more: Callable[[TrainState], Bool[Array, ""]],
) -> Callable[[TrainState], Bool[Array, ""]]:
    """`more` of any member, the same for all: no member's own (a loop whose condition
    differs between a `vmap`'s members selects each member's whole carry every turn).
    """
    return lambda state: any_member(more(state))


def one_step(state: TrainState) -> TrainState:
    """`state` at its step as one value for all members (a collective's, not mapped over
    them), where they are at one step (`every_member`): the step's cell of the record is
    then one place, written in place, where each member's own would be a scatter.
    """
    return state._replace(step=jax.lax.pmax(state.step, MEMBERS))


def put_row(due: Bool[Array, ""], table: Array, row: Int[Array, ""], values: ArrayLike) -> Array:
    """A member's `values` written where `due` into row `row` of `table` (an epoch's
    values into the epochs' table, a validation's into the validations'), at the row of
    the members that write, one for all (they are at one step): the row's own values put
    back where a member does not write.

    Written at each member's own row inside the `cond` that makes the values, the write
    is a scatter in the `vmap`, and the `cond` a select between the whole tables written
    and not: each epoch, a pass over a table as long as the run.
    """
    row = jax.lax.pmax(jnp.where(due, row, 0), MEMBERS)
    old = jax.lax.dynamic_index_in_dim(table, row, 0, False, allow_negative_indices=False)
    return put(table, jnp.where(due, values, old), row)
