"""A moving average of the trained arrays (Polyak/EMA): an option with its own state."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, PyTree


class Average(eqx.Module):
    """`average = momentum * average + (1 - momentum) * weights` after every step that
    updates the weights, starting from the initial weights, with no bias correction (as
    Keras's `use_ema`, but for its first step, where Keras takes the weights as they are).

    eqfit keeps the average in the training state, not in the optimizer state as Keras
    does: the optimizer state stays the user's optimizer's own (`fit(..., opt_state=)`
    takes it back unchanged), the average is laid out as the parameters under `shard=`,
    and validation can read it without knowing the optimizer.
    """

    momentum: float

    def __check_init__(self) -> None:
        m = self.momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 < m < 1.0:
            raise ValueError(f"`ema` must be a number in (0, 1), such as 0.999, got {m!r}.")

    def init(self, params: PyTree) -> PyTree:
        """The average before the first step: the initial weights, in float32 at least (a
        bfloat16 average would lose every step's share of the weights to rounding).
        """
        return jax.tree.map(lambda w: w.astype(jnp.promote_types(w.dtype, jnp.float32)), params)

    def update(self, average: PyTree, params: PyTree, applied: Bool[Array, ""]) -> PyTree:
        """The average after a step that made `params`; unchanged if the step was not
        `applied` (skipped for a non-finite loss or gradient).
        """
        m = jnp.where(applied, self.momentum, 1.0)  # 1 * a + 0 * w is `a`, bit for bit
        return jax.tree.map(lambda a, w: m * a + (1.0 - m) * w, average, params)


def as_average(ema: object) -> Average | None:
    """`fit`'s `ema=` as an `Average` (`None`: no average), checked."""
    if ema is None:
        return None
    if isinstance(ema, bool) or not isinstance(ema, (int, float)):
        raise TypeError(f"`ema` must be a number in (0, 1), such as 0.999, or None, got {ema!r}.")
    return Average(float(ema))
