"""A weighted mean that a loss, an aux value or a metric returns as its sum and its weight
(`Mean`), so that the run divides a sum by a sum: over an epoch, over validation's
batches, across devices.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._core._checks import real_dtype


class Mean(eqx.Module):
    """A weighted mean, as its sum and its weight: what a loss, an aux value or a metric
    returns when its batches' values do not weigh the same, as a masked or token-weighted
    loss's do. `Mean(jnp.sum(mask * ce), jnp.sum(mask))`, or `Mean.of(ce, mask)`.

    The step differentiates `total / weight`. An epoch's value, a validation value and
    `eqfit.evaluate`'s are the sum of the totals over the sum of the weights, not a mean
    of batch means; across devices (`devices=`, `mesh=`) the totals and the weights are
    summed before dividing, in the gradient too.

    A batch whose weight is 0 (every target masked, or weights that cancel) trains with
    a zero gradient whatever its total (the optimizer still steps, as on any zero
    gradient) and records NaN as its step's value (0 / 0), which the epoch leaves out; an
    epoch (a validation set, `eqfit.evaluate`'s data) whose weights sum to 0 records NaN,
    never 0 or an infinity. Negative
    weights are allowed and divided as they are: the epoch's value is still the sum of
    the totals over the sum of the weights.

    **Arguments:**

    - `total`: the weighted sum, a scalar.
    - `weight`: the sum of the weights, a scalar (a count of tokens, say).
    """

    total: Float[Array, ""]
    weight: Float[Array, ""]

    def __init__(self, total: ArrayLike, weight: ArrayLike):
        self.total = _scalar(total, "total")
        self.weight = _scalar(weight, "weight")

    @classmethod
    def of(cls, values: ArrayLike, weights: ArrayLike | None = None) -> "Mean":
        """The weighted mean of `values`: `Mean(sum(weights * values), sum(weights))`.

        **Arguments:**

        - `values`: an array of values (per example, per token).
        - `weights`: an array of `values`' shape, or one that broadcasts to it (a mask of
            bools, say); `None`: every value weighs 1.

        **Returns:**

        The `Mean`.
        """
        values = jnp.asarray(values)
        if weights is None:
            return cls(jnp.sum(values), jnp.asarray(values.size, values.dtype))
        weights = jnp.asarray(weights)
        try:
            w = jnp.broadcast_to(weights, values.shape).astype(values.dtype)
        except ValueError:
            raise ValueError(
                f"`eqfit.Mean.of`'s `weights` must have `values`' shape {values.shape} or one "
                f"that broadcasts to it (a mask of the same shape, or per-example weights "
                f"with trailing axes of 1), got shape {weights.shape}."
            ) from None
        return cls(jnp.sum(w * values), jnp.sum(w))

    @property
    def value(self) -> Float[Array, ""]:
        """`total / weight`."""
        return self.total / self.weight


def _scalar(x: Any, name: str) -> Array:
    """`x` as a float scalar, or a refusal naming the field, the shape wanted and given,
    or what it is where it is no real number.
    """
    if real_dtype(x) is None:
        dtype = getattr(x, "dtype", None)
        what = type(x).__name__ if dtype is None else f"an array of dtype {dtype}"
        raise TypeError(
            f"`eqfit.Mean`'s `{name}` must be a real number (a scalar array), got {what}."
        )
    if np.shape(x) != ():
        raise ValueError(
            f"`eqfit.Mean`'s `{name}` must be a scalar (shape ()), but it has shape "
            f"{tuple(np.shape(x))}: reduce it over the batch, e.g. `Mean(jnp.sum(mask * ce), "
            "jnp.sum(mask))`, or use `eqfit.Mean.of(values, weights)`."
        )
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x


def divisor(weight: Array) -> Array:
    """The divisor of a total over its `weight`: the weight, or infinity where it is 0,
    so that the quotient is 0 and so is its gradient, whatever the total (weights that
    cancel, summing to 0 with a total that does not, train on 0).
    """
    return jnp.where(weight == 0, jnp.inf, weight)
