"""The programs `PerStep`'s drive calls beside its steps: a validation set's batches, a
few at a time (`validation_batches`) or a streamed chunk's (`validation_chunk`), added to
the sums the epoch's close divides; and the n-th steps' values of a call made of several
programs (`logs`). Each takes the run's `TrainState` as the steps left it.
"""

import functools

from jaxtyping import Array, Float, Key, PyTree

from ._epoch_end import EpochEnd
from ._loop import Loop, Rebuilt
from ._program import each_member, each_member_with
from ._records import logs_of
from ._state import CallEnd, Inputs, TrainState, ValAt, ValSums


def validation_batches(
    loop: Loop,
    set_index: int,
    batch_size: int,
    count: int,
    remainder: bool,
    carry: tuple[TrainState, ValSums],
    read: tuple[Inputs, PyTree | None],
    at: ValAt,
) -> ValSums:
    """`PerStep`'s validation, as its steps run: `count` batches of validation set
    `set_index` (of its streamed chunk, `read`'s after the inputs, where it streams) from
    batch `at.batch` on (those past its full batches computed and dropped), or with
    `remainder` its smaller last batch, written out with no loop around them and added to
    the sums so far (`carry`'s). The same values as `run`'s validation, in the same order
    (to XLA's fusion).
    """
    state, sums = carry
    inputs, chunk = read

    def one(parts: Rebuilt, state: TrainState, sums: ValSums, key: Key[Array, ""]) -> ValSums:
        end = EpochEnd(loop, parts, inputs, key)
        data = end.sets()[set_index] if chunk is None else chunk  # in memory, or streamed
        return end.batches(state, sums, set_index, data, batch_size, count, remainder, at)

    return each_member_with(loop, inputs.consts, one, state, sums, inputs.key)


def validation_chunk(
    loop: Loop,
    set_index: int,
    batch_size: int,
    carry: tuple[TrainState, ValSums],
    read: tuple[Inputs, PyTree],
    at: ValAt,
) -> ValSums:
    """A streamed validation set's chunk (`read`'s, after the inputs) added to the sums so
    far (`carry`'s), at the epoch's end, by the host's calls (`EpochEnd.chunk`): all its
    batches in one scan (`PerStep`'s programs of a few: `validation_batches`).
    """
    state, sums = carry
    inputs, chunk = read

    def one(parts: Rebuilt, state: TrainState, sums: ValSums, key: Key[Array, ""]) -> ValSums:
        end = EpochEnd(loop, parts, inputs, key)
        return end.chunk(state, sums, set_index, chunk, batch_size, at)

    return each_member_with(loop, inputs.consts, one, state, sums, inputs.key)


def logs(
    loop: Loop, state: TrainState, inputs: Inputs, until: CallEnd
) -> Float[Array, "*members rows values"] | None:
    """The n-th steps' values (`log_every`) as the state's record holds them, for a drive's
    call made of several programs (`PerStep`'s, or where the host closes epochs): called
    once after them, so they pay nothing for it.
    """
    del inputs, until  # the placement's programs take three arguments
    return each_member(loop, functools.partial(logs_of, loop), state)
