"""A moving average of the trained arrays (Polyak/EMA): an option with its own state."""

import importlib.util
import math
import os
import sys
import types
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, PyTree

from .._core._checks import as_real


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
    """`fit`'s `ema=` as an `Average` (`None`: no average), checked: a Python, numpy or
    JAX real scalar.
    """
    if ema is None:
        return None
    momentum = as_real(ema)
    if momentum is None:
        raise TypeError(f"`ema` must be a number in (0, 1), such as 0.999, or None, got {ema!r}.")
    return Average(momentum)


def warn_if_short(average: Average | None, steps: int) -> None:
    """Warns where the run's `steps` leave more than half of the average at the initial
    weights (`ema**steps > 0.5`): the "averaged" model is then mostly the untrained one,
    and nothing else would say so. (Keras says nothing either.) `steps` of 0 or less: the
    run's length is not known yet (a loader without `len`), or it trains nothing.
    """
    if average is None or steps <= 0:
        return
    m = average.momentum
    left = m**steps
    if left <= 0.5:
        return
    half = math.ceil(math.log(0.5) / math.log(m))  # the steps that leave half
    suggested = 0.01 ** (1 / steps)  # 1% left after the run
    warnings.warn(
        f"`ema={m}` over this run's {steps} steps leaves {100 * left:.3g}% of the moving "
        f"average at the initial weights (`ema**steps` = {m}**{steps} = {left:.3g}): "
        "`ema_model` will be mostly the untrained model. Train for more steps "
        f"({half} or more leave half or less), or give a smaller `ema` "
        f"(`ema={suggested:.2g}` leaves 1% over {steps} steps).",
        UserWarning,
        stacklevel=_caller_level(sys._getframe(0)),
    )


def _caller_level(warning: types.FrameType) -> int:
    """The `stacklevel`, for a warning issued in the frame `warning`, of the first frame
    outside eqfit and the runtime checks that wrap its functions: the user's call of
    `fit` or `plan`, which the warning points at.
    """
    eqfit = os.path.dirname(os.path.dirname(__file__))  # this module is in eqfit/_step/
    skipped = (eqfit, *map(_folder, ("jaxtyping", "beartype")))
    frame, level = warning, 1
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    return level


def _folder(module: str) -> str:
    spec = importlib.util.find_spec(module)
    origin = None if spec is None else spec.origin
    return os.path.dirname(origin) if origin else "\0"
