"""A write of one place of an array that stays one in an ensemble's `vmap`.

JAX maps `lax.dynamic_update_slice` over a `vmap`'s members as a scatter, even where the
place is one for all members (a collective's value, or a constant): XLA then writes it
as a dynamic update slice behind a check that the place is in range, and a select, whose
index arithmetic costs a step of an ensemble several small kernels for each record it
writes. `update_slice` writes such a place as one dynamic update slice of the members'
arrays; a place of each member's own is still a scatter.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, ArrayLike, Int


def update_slice(array: Array, update: Array, *start: Int[ArrayLike, ""]) -> Array:
    """`lax.dynamic_update_slice(array, update, start)`, the start in range (so neither
    negative indices nor clamping need handling): where `array` is mapped over a `vmap`
    and `start` is not, one dynamic update slice of the mapped array, not a scatter.
    """
    return _update_slice(array, update, *start)


def _written(array: Array, update: Array, *start: Int[ArrayLike, ""]) -> Array:
    # Of one integer type, as XLA asks: a Python 0 is an int64 under `jax_enable_x64`.
    places = [jnp.asarray(s, jnp.int32) for s in start]
    return jax.lax.dynamic_update_slice(array, update, places, allow_negative_indices=False)


@custom_vmap
def _update_slice(array: Array, update: Array, *start: Int[ArrayLike, ""]) -> Array:
    return _written(array, update, *start)


@_update_slice.def_vmap
def _mapped(
    axis_size: int,
    in_batched: list[bool],
    array: Array,
    update: Array,
    *start: Int[ArrayLike, "*"],
) -> tuple[Array, bool]:
    """`_written` mapped over the leading axis of the arguments `in_batched` says are: a
    start that is not, into an array that is, as one write (of each member's update, or
    of one for all, broadcast); else as `vmap` maps it.
    """
    mapped, updates, *starts = in_batched
    if mapped and not any(starts):
        if not updates:
            update = jnp.broadcast_to(update, (axis_size, *update.shape))
        return _written(array, update, 0, *start), True
    axes: Any = [0 if b else None for b in in_batched]
    return jax.vmap(_written, in_axes=axes, axis_size=axis_size)(array, update, *start), True
