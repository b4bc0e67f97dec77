"""Batch-level losses, each `loss(model, x, y) -> scalar`, vmapping the model over the batch.

The model is called on one example at a time, `model(x[i])`, as Equinox models are.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped, Shaped


Model = Callable[..., Array]


def _predict_like(model: Model, x: Array, like: Array, name: str) -> Array:
    out = jax.vmap(model)(x)
    if out.shape != like.shape:
        # Broadcasting (batch, 1) against (batch,) would silently give a (batch, batch)
        # loss; refuse it instead.
        raise ValueError(
            f"`{name}`: the model's outputs have shape {tuple(out.shape)} but `y` has "
            f"shape {tuple(like.shape)}; they must match."
        )
    return out


@jaxtyped(typechecker=beartype)
def mse(
    model: Model, x: Shaped[Array, "batch ..."], y: Float[Array, "batch ..."]
) -> Float[Array, ""]:
    """Mean squared error of `model` on a batch.

    **Arguments:**

    - `model`: called on one example, returning an array shaped like one row of `y`.
    - `x`: the batch of inputs.
    - `y`: the targets.

    **Returns:**

    `mean((model(x_i) - y_i) ** 2)` over the batch and every output.
    """
    return jnp.mean(optax.squared_error(_predict_like(model, x, y, "mse"), y))


@jaxtyped(typechecker=beartype)
def softmax_cross_entropy(
    model: Model, x: Shaped[Array, "batch ..."], y: Int[Array, " batch"]
) -> Float[Array, ""]:
    """Softmax cross-entropy against integer class labels.

    **Arguments:**

    - `model`: called on one example, returning unnormalised logits of shape `(classes,)`.
    - `x`: the batch of inputs.
    - `y`: integer labels in `[0, classes)`.

    **Returns:**

    The mean cross-entropy over the batch.
    """
    logits = jax.vmap(model)(x)
    if logits.ndim != 2:
        raise ValueError(
            "`softmax_cross_entropy`: the model must return a vector of logits per "
            f"example, but the batch of outputs has shape {tuple(logits.shape)}."
        )
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


@jaxtyped(typechecker=beartype)
def binary_cross_entropy(
    model: Model,
    x: Shaped[Array, "batch ..."],
    y: Float[Array, "batch ..."] | Int[Array, "batch ..."] | Bool[Array, "batch ..."],
) -> Float[Array, ""]:
    """Binary cross-entropy on logits, for labels in {0, 1} (or probabilities).

    **Arguments:**

    - `model`: called on one example, returning logits shaped like one row of `y`.
    - `x`: the batch of inputs.
    - `y`: the labels.

    **Returns:**

    The mean sigmoid cross-entropy over the batch and every output.
    """
    logits = _predict_like(model, x, y, "binary_cross_entropy")
    labels = y.astype(logits.dtype)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
