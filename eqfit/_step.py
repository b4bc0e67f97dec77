"""Build the pure training step `(params, opt_state, batch, key) -> (params, opt_state, loss)`."""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Key, PyTree

from ._data import Batch


def takes_key(loss: Callable[..., Any]) -> bool:
    """Whether `loss` accepts a keyword argument `key` (for dropout and the like)."""
    try:
        parameters = inspect.signature(loss).parameters
    except (TypeError, ValueError):
        return False
    param = parameters.get("key")
    return param is not None and param.kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def batch_loss(
    loss: Callable[..., Any],
    model: PyTree,
    batch: Batch,
    key: Key[Array, ""] | None,
) -> Float[Array, ""]:
    """Calls `loss(model, *batch)` (with `key=` if given) and checks it is a float scalar."""
    value = loss(model, *batch) if key is None else loss(model, *batch, key=key)
    if not isinstance(value, jax.Array) or value.shape != ():
        shape = getattr(value, "shape", None)
        raise ValueError(
            "`loss(model, *batch)` must return a scalar, but it returned "
            + (f"an array of shape {tuple(shape)}" if shape is not None else repr(value))
            + ". Reduce it over the batch, e.g. with `jnp.mean`."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"`loss(model, *batch)` must return a float scalar, got dtype {value.dtype}."
        )
    return value


class Step(eqx.Module):
    """One optimisation step on a batch, with the model's static structure closed over.

    A `Step` holds no arrays, so it hashes as part of a compiled program: two `fit` calls
    with the same model structure, loss and optimizer share one compilation.
    """

    static: PyTree
    loss: Callable[..., Any]
    optimizer: optax.GradientTransformation
    use_key: bool
    axis_name: str | None = None

    def __call__(
        self, params: PyTree, opt_state: PyTree, batch: Batch, key: Key[Array, ""]
    ) -> tuple[PyTree, PyTree, Float[Array, ""]]:
        if self.axis_name is not None and self.use_key:
            # Each device's share of the batch gets its own key.
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))

        def value(p: PyTree) -> Float[Array, ""]:
            model = eqx.combine(p, self.static)
            return batch_loss(self.loss, model, batch, key if self.use_key else None)

        loss, grads = jax.value_and_grad(value)(params)
        if self.axis_name is not None:
            # Data parallel: each device saw an equal share of the batch, so the mean of
            # the per-device means is the mean over the whole batch.
            loss, grads = jax.lax.pmean((loss, grads), self.axis_name)
        # `value=` lets optax transformations that read the loss (reduce_on_plateau)
        # work unchanged; with_extra_args_support makes plain ones ignore it.
        optimizer = optax.with_extra_args_support(self.optimizer)
        updates, opt_state = optimizer.update(grads, opt_state, params, value=loss)
        params = eqx.apply_updates(params, updates)
        return params, opt_state, loss
