"""Mixed precision: a policy that casts inside the step, and float16's dynamic loss scale.

The policy is an option with state, as diffrax's step-size controllers are: `init` makes
the loss scale that rides in the training state, `cast` casts a model or a batch for the
loss's forward and backward passes, `unscale` and `adjust` undo the scale and move it.
The master copy of the trained arrays, the optimizer state and the moving average stay in
`params` precision: only what the loss sees is cast, per array, inside the step, so that
under `shard=` each device casts its own shard and no device ever holds a whole
low-precision copy of the model (levanter #426 describes the trap of casting the whole
model up front).
"""

import functools
import math
import re
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._core._typing import ArrayTree


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class LossScale(NamedTuple):
    """The dynamic loss scale, carried in the training state (and its checkpoints)."""

    scale: Float[Array, ""]
    good_steps: Int[Array, ""]  # finite steps in a row since the scale last moved


def _dtype(value: Any, name: str) -> np.dtype:
    if value is None:  # which NumPy takes for float64, and JAX truncates to float32
        raise TypeError(
            f"`Precision.{name}` must be a floating dtype (such as `jnp.bfloat16`), got None."
        )
    try:
        dtype = np.dtype(jnp.dtype(value))
    except TypeError:
        raise TypeError(f"`Precision.{name}` must be a floating dtype, got {value!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`Precision.{name}` must be a floating dtype (such as `jnp.bfloat16`), got {dtype}."
        )
    return dtype


class Precision(eqx.Module):
    """A mixed-precision policy: what the loss computes in, and what is kept.

    `fit(..., precision="bfloat16")` is `Precision(jnp.bfloat16)`, and
    `precision="float16"` is `Precision(jnp.float16)`, which scales the loss.

    Inside each step the model's floating arrays (trained and frozen) and the floating
    arrays of the batch's inputs (`x` of a batch `(x, y, ...)`; every array of a batch
    passed whole, such as a dict) are cast to `compute` for the loss's forward and
    backward passes. Targets and sample weights stay as given, and `eqfit.losses` and
    `eqfit.metrics` take the model's outputs in float32. The loss, the aux values and the
    gradients come back in float32, and the update is made on the master copy, in
    `params`. Integer arrays, PRNG keys and leaves that are not arrays are never cast,
    nor is a stateful model's `state`. `result.model` comes back in the model's own
    dtypes.

    **Arguments:**

    - `compute`: the dtype of the loss's computation: `jnp.bfloat16` or `jnp.float16`
        (or `jnp.float32`, to keep only `params`).
    - `params`: the dtype of the master copy of the trained arrays, their optimizer state
        and their moving average.
    - `keep`: regular expressions over the arrays' paths (`jax.tree_util.keystr`, as
        [`eqfit.sharding.rules`][] match them, with `re.search`): the arrays they match stay
        in `params` precision in the forward pass (norm layers, say: `(r"norm",)`). A
        pattern that matches none of the model's floating arrays is refused.
    - `loss_scaling`: dynamic loss scaling, as Keras's `LossScaleOptimizer`: the loss is
        multiplied by a scale before the backward pass and the gradients divided by it, so
        that float16's small gradients do not underflow to zero. A step whose gradient is
        not finite is skipped (it counts as a step) and halves the scale;
        `growth_steps` finite steps in a row double it. `None` (the default): on for
        float16 only, whose exponent is narrow; bfloat16 has float32's range.
    - `initial_scale`: the scale at the start (Keras's `2**15`).
    - `growth_steps`: finite steps in a row that double the scale (Keras's 2,000).
    """

    compute: Any = jnp.bfloat16
    params: Any = jnp.float32
    keep: tuple[str, ...] = ()
    loss_scaling: bool | None = None
    initial_scale: float = 2.0**15
    growth_steps: int = 2000

    def __check_init__(self) -> None:
        _dtype(self.compute, "compute")
        _dtype(self.params, "params")
        if isinstance(self.keep, str) or not isinstance(self.keep, tuple):
            raise TypeError(
                f"`Precision.keep` must be a tuple of regular expressions, got {self.keep!r}."
            )
        for pattern in self.keep:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(
                    f"`Precision.keep`: {pattern!r} is not a regular expression ({e})."
                ) from None
        if self.loss_scaling not in (None, True, False):
            raise TypeError(
                f"`Precision.loss_scaling` must be None, True or False, got {self.loss_scaling!r}."
            )
        scale = self.initial_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(
                f"`Precision.initial_scale` must be a number (such as 2**15), got {scale!r}."
            )
        # The scale is kept in float32: a larger one would be infinite there.
        if not (math.isfinite(scale) and 0 < scale <= _FLOAT32_MAX):
            raise ValueError(
                "`Precision.initial_scale` must be a finite number above 0 that float32 "
                f"holds (such as 2**15), got {scale!r}."
            )
        steps = self.growth_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"`Precision.growth_steps` must be an integer of 1 or more, got {steps!r}."
            )

    @property
    def compute_dtype(self) -> np.dtype:
        return _dtype(self.compute, "compute")

    @property
    def params_dtype(self) -> np.dtype:
        return _dtype(self.params, "params")

    @property
    def scales(self) -> bool:
        """Whether the loss is scaled: `loss_scaling`, or by default for float16."""
        if self.loss_scaling is not None:
            return self.loss_scaling
        return self.compute_dtype == np.dtype(jnp.float16)

    def init(self) -> LossScale | None:
        """The loss scale at the start, or `None` where the loss is not scaled."""
        if not self.scales:
            return None
        return LossScale(jnp.asarray(self.initial_scale, jnp.float32), jnp.asarray(0, jnp.int32))

    def cast(self, model: ArrayTree) -> ArrayTree:
        """`model` with each floating array in `compute`, but those `keep` matches. Under
        a loss scale, a gradient beyond `compute`'s range comes back infinite (`_narrowed`).
        """
        compute = self.compute_dtype
        patterns = [re.compile(p) for p in self.keep]
        scales = self.scales

        def one(path: Any, x: Any) -> Any:
            if not _is_floating(x) or x.dtype == compute:
                return x
            if patterns:
                where = jax.tree_util.keystr(path)
                if any(p.search(where) for p in patterns):
                    return x.astype(self.params_dtype)
            return _narrowed(x, x.dtype, compute) if scales else x.astype(compute)

        return jax.tree_util.tree_map_with_path(one, model)

    def cast_batch(self, batch: ArrayTree) -> ArrayTree:
        """`batch` with each floating array in `compute`."""
        compute = self.compute_dtype
        return jax.tree.map(lambda x: x.astype(compute) if _is_floating(x) else x, batch)

    def master(self, params: ArrayTree) -> ArrayTree:
        """The trained arrays as the master copy keeps them: floating ones in `params`."""
        dtype = self.params_dtype
        return jax.tree.map(lambda x: x.astype(dtype) if _is_floating(x) else x, params)

    def scale(self, loss: Float[Array, ""], state: LossScale | None) -> Float[Array, ""]:
        """The loss to differentiate: multiplied by the scale, if there is one."""
        return loss if state is None else loss * state.scale

    def unscale(self, grads: ArrayTree, state: LossScale | None) -> ArrayTree:
        """The gradients of the unscaled loss, in float32."""
        if state is None:
            return grads
        return jax.tree.map(lambda g: g / state.scale, grads)

    def adjust(self, state: LossScale, finite: Bool[Array, ""]) -> LossScale:
        """The scale after a step: halved if its gradient was not finite, doubled after
        `growth_steps` finite steps in a row (Keras's `LossScaleOptimizer`).
        """
        good = jnp.where(finite, state.good_steps + 1, 0)
        grows = good >= self.growth_steps
        scale = jnp.where(
            finite, jnp.where(grows, state.scale * 2.0, state.scale), state.scale / 2.0
        )
        return LossScale(scale, jnp.where(grows, 0, good))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _narrowed(x: Array, wide: Any, narrow: Any) -> Array:
    """`x` (of dtype `wide`) cast to `narrow`, whose gradient comes back infinite where it
    is beyond `narrow`'s range. It is so already where the chip rounds every result to
    `narrow` (a CPU's float16); a TPU computes float16 in float32 and can hand back a
    larger, finite one, which the loss scale's check would then apply instead of skip.
    """
    return x.astype(narrow)


def _narrowed_fwd(x: Array, wide: Any, narrow: Any) -> tuple[Array, None]:
    return x.astype(narrow), None


def _narrowed_bwd(wide: Any, narrow: Any, _: None, cotangent: Array) -> tuple[Array]:
    back = cotangent.astype(wide)
    beyond = jnp.abs(back) > float(jnp.finfo(narrow).max)
    return (jnp.where(beyond, jnp.asarray(jnp.inf, wide), back),)


_narrowed.defvjp(_narrowed_fwd, _narrowed_bwd)


PrecisionLike = Precision | Literal["bfloat16", "float16"] | None


def as_precision(precision: Any, name: str = "precision", model: Any = None) -> Precision | None:
    """`precision` as a policy: a name, a `Precision`, or `None`; anything else refused,
    as is a `keep` pattern that matches none of `model`'s floating arrays (if given).
    """
    if precision is None:
        return None
    if isinstance(precision, Precision):
        if model is not None:
            _check_keep(precision, model, name)
        return precision
    if precision == "bfloat16":
        return Precision(jnp.bfloat16)
    if precision == "float16":
        return Precision(jnp.float16)
    raise ValueError(
        f'`{name}` must be None, "bfloat16", "float16" or an `eqfit.Precision`, got {precision!r}.'
    )


def _check_keep(policy: Precision, model: Any, name: str) -> None:
    """Refuses a pattern of `policy.keep` that matches none of `model`'s floating arrays:
    a typo would leave every array in `compute`, without a word.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(model)
    paths = [jax.tree_util.keystr(path) for path, x in flat if _is_floating(x)]
    for pattern in policy.keep:
        if not any(re.search(pattern, path) for path in paths):
            shown = ", ".join(repr(path) for path in paths[:4])
            more = f" and {len(paths) - 4} more" if len(paths) > 4 else ""
            raise ValueError(
                f"`{name}`'s `keep` holds {pattern!r}, which matches none of the model's "
                f"floating arrays (`re.search` over their paths: {shown or 'none'}{more})."
            )


def all_finite(tree: ArrayTree) -> Bool[Array, ""]:
    """Whether every element of every array of `tree` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _is_floating(x: Any) -> bool:
    return eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)
