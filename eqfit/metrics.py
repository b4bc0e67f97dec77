"""Ready metrics, each `metric(model, x, y) -> scalar` on a batch, vmapping the model.

Pass them to `fit(..., metrics={"accuracy": eqfit.metrics.accuracy})` and read them back
from the history by the same name, with `"val_"` in front for the validation data.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped, Shaped

from .losses import _predict_like


Model = Callable[..., Array]


@jaxtyped(typechecker=beartype)
def accuracy(
    model: Model, x: Shaped[Array, "batch ..."], y: Int[Array, " batch"]
) -> Float[Array, ""]:
    """The fraction of examples whose largest logit is at the integer label `y`.

    **Arguments:** `model`, returning logits `(classes,)` for one example; `x`; `y`.

    **Returns:** the accuracy over the batch, in [0, 1].
    """
    return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y)


@jaxtyped(typechecker=beartype)
def binary_accuracy(
    model: Model,
    x: Shaped[Array, "batch ..."],
    y: Int[Array, "batch ..."] | Bool[Array, "batch ..."] | Float[Array, "batch ..."],
) -> Float[Array, ""]:
    """The fraction of outputs whose logit has the sign of the 0/1 label `y`.

    **Arguments:** `model`, returning logits shaped like one row of `y`; `x`; `y`.

    **Returns:** the accuracy over the batch and every output, in [0, 1].
    """
    return jnp.mean((_predict_like(model, x, y, "binary_accuracy") > 0) == (y > 0.5))


@jaxtyped(typechecker=beartype)
def mae(
    model: Model, x: Shaped[Array, "batch ..."], y: Float[Array, "batch ..."]
) -> Float[Array, ""]:
    """Mean absolute error.

    **Arguments:** `model`, returning an output shaped like one row of `y`; `x`; `y`.

    **Returns:** `mean(|model(x_i) - y_i|)` over the batch and every output.
    """
    return jnp.mean(jnp.abs(_predict_like(model, x, y, "mae") - y))
