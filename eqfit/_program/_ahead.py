"""A shuffled pass's batches gathered ahead, several steps' at once.

XLA:CPU gathers a batch's rows from arrays in memory one by one, at a cost per gather
that a small step feels against a pass in order, whose batches are slices
(`benchmarks/shuffle.py` measures both). A gather of the rows of several steps costs
little more than one batch's; each step then slices its batch from them. The rows and
their order are those of one gather a step, so the bits are the same.
"""

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Key, PyTree, UInt32

from .._core._data import take
from ._loop import Loop
from ._parallel import OneDevice, Placement, placement_devices
from ._schedule import Schedule
from ._state import Inputs, running, TrainState


# The rows of the steps gathered at once: about this many bytes of them, of at most
# `AHEAD_STEPS` steps (and no more than a pass's full batches): few enough to stay in a
# core's cache.
AHEAD_BYTES = 2**21
AHEAD_STEPS = 128


def steps_ahead(
    placement: Placement,
    schedule: Schedule,
    shuffle: bool,
    members: int | None,
    like: PyTree,
) -> int:
    """How many steps' rows a run gathers at once: 1 (each step its own) but for a
    shuffled pass over arrays in memory on one CPU device, outside an ensemble (whose
    members may stop at different steps).
    """
    passes = schedule.passes
    if not shuffle or members is not None or passes is None or passes.num_full < 2:
        return 1
    if not isinstance(placement, OneDevice):
        return 1
    if placement_devices(placement)[0].platform != "cpu":
        return 1
    row = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in jax.tree.leaves(like))
    steps = AHEAD_BYTES // max(1, row * schedule.batch_size)
    return int(max(1, min(steps, AHEAD_STEPS, passes.num_full)))


@runtime_checkable
class Stepping(Protocol):
    """What of a member's program (`_program.Program`) the steps ahead call."""

    @property
    def loop(self) -> Loop: ...

    @property
    def inputs(self) -> Inputs: ...

    def steps_while(
        self,
        more: Callable[[TrainState], Bool[Array, ""]],
        rows: Callable[[TrainState], tuple[UInt32[Array, " batch"], PyTree]],
        state: TrainState,
        full: bool,
        step_key: Key[Array, ""] | None,
        size: int,
    ) -> TrainState: ...


def gathered_steps(
    program: Stepping,
    state: TrainState,
    order: UInt32[Array, " n"],
    first: Any,
    limit: Any,
    step_key: Key[Array, ""] | None,
) -> TrainState:
    """The full batches' steps from `state.step` to `limit` (or until stopped), step `t`
    on rows `order[(t - first) * batch_size:]`, `program.loop.ahead` steps' rows gathered
    at once.

    **Arguments:**

    - `program`: the member's program, whose steps these are.
    - `state`: the training state.
    - `order`: the pass's order of rows.
    - `first`: the pass's first step.
    - `limit`: the step to stop before.
    - `step_key`: the key the steps' keys are folded from, if the loss takes one.

    **Returns:**

    The state after the steps.
    """
    loop = program.loop
    batch_size, ahead = loop.batch_size, loop.ahead
    span = ahead * batch_size
    last = order.shape[0] - span  # the last start with `span` rows from it (`ahead` fits)

    def stretch(state: TrainState) -> TrainState:
        start = jnp.minimum((state.step - first) * batch_size, last)
        index = jax.lax.dynamic_slice(order, (start,), (span,), allow_negative_indices=False)
        taken = take(program.inputs.data, index)
        end = jnp.minimum(limit, state.step + ahead)

        def more(state: TrainState) -> Bool[Array, ""]:
            return (state.step < end) & running(state)

        def rows(state: TrainState) -> tuple[UInt32[Array, " batch"], PyTree]:
            at = (state.step - first) * batch_size - start

            def sliced(a: Array) -> Array:
                return jax.lax.dynamic_slice_in_dim(a, at, batch_size, allow_negative_indices=False)

            return sliced(index), jax.tree.map(sliced, taken)

        return program.steps_while(more, rows, state, True, step_key, batch_size)

    def more(state: TrainState) -> Bool[Array, ""]:
        return (state.step < limit) & running(state)

    return jax.lax.while_loop(more, stretch, state)
