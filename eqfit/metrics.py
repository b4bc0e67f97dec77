"""Ready metrics, each `metric(model, x, y) -> scalar` on a batch, vmapping the model.
Given a batch `(x, y, weights)`, each returns the weighted mean as an `eqfit.Mean`, as
`eqfit.losses` do.

Pass them to `fit(..., metrics={"accuracy": eqfit.metrics.accuracy})` and read them back
from the history by the same name, with `"val_"` in front for the validation data. With
`fit(..., state=)` they are called `metric(model, state, x, y)`, which they take too (the
model called as `model(x[i], state)` under `jax.vmap` with `axis_name="batch"`); the new
state is dropped.
"""

from typing import Any, overload

import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped, PyTree, Shaped

from ._step._labels import check_labels, same_shape
from ._step._mean import Mean
from .losses import Model, outputs, reduce, split_state, State


@overload
def accuracy(model: Model, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def accuracy(model: Model, state: State, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def accuracy(model: Model, x: Any, y: Any, weights: Any, /) -> Any: ...  # an `eqfit.Mean`
@overload
def accuracy(model: Model, state: State, x: Any, y: Any, weights: Any, /) -> Mean: ...
def accuracy(model: Model, *args: Any) -> Any:
    """The fraction of examples whose largest logit is at the integer label `y`.

    **Arguments:** `model`, returning logits `(classes,)` for one example; optionally its
    `state`; `x`; `y`; optionally `weights` per example or per label.

    **Returns:** the accuracy over the batch, in [0, 1] (an `eqfit.Mean` with `weights`).
    """
    state, x, y, weights = split_state(args, "accuracy")
    return _accuracy(model, state, x, y, weights)


@jaxtyped(typechecker=beartype)
def _accuracy(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Int[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
) -> Any:
    logits, _ = outputs(model, x, state)
    logits = check_labels(logits, y, logits.shape[-1], "accuracy")
    return reduce(jnp.argmax(logits, axis=-1) == y, weights, "accuracy")


@overload
def binary_accuracy(model: Model, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def binary_accuracy(model: Model, state: State, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def binary_accuracy(model: Model, x: Any, y: Any, weights: Any, /) -> Any: ...  # an `eqfit.Mean`
@overload
def binary_accuracy(model: Model, state: State, x: Any, y: Any, weights: Any, /) -> Mean: ...
def binary_accuracy(model: Model, *args: Any) -> Any:
    """The fraction of outputs whose logit has the sign of the 0/1 label `y`.

    **Arguments:** `model`, returning logits shaped like one row of `y`; optionally its
    `state`; `x`; `y`; optionally `weights` per example or per label.

    **Returns:** the accuracy over the batch and every output, in [0, 1] (an `eqfit.Mean`
    with `weights`).
    """
    state, x, y, weights = split_state(args, "binary_accuracy")
    return _binary_accuracy(model, state, x, y, weights)


@jaxtyped(typechecker=beartype)
def _binary_accuracy(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Int[Array, "batch ..."] | Bool[Array, "batch ..."] | Float[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
) -> Any:
    logits, _ = outputs(model, x, state)
    logits = check_labels(same_shape(logits, y, "binary_accuracy"), y, None, "binary_accuracy")
    return reduce((logits > 0) == (y > 0.5), weights, "binary_accuracy")


@overload
def mae(model: Model, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def mae(model: Model, state: State, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def mae(model: Model, x: Any, y: Any, weights: Any, /) -> Any: ...  # an `eqfit.Mean`
@overload
def mae(model: Model, state: State, x: Any, y: Any, weights: Any, /) -> Mean: ...
def mae(model: Model, *args: Any) -> Any:
    """Mean absolute error.

    **Arguments:** `model`, returning an output shaped like one row of `y`; optionally its
    `state`; `x`; `y`; optionally `weights` per example or per label.

    **Returns:** `mean(|model(x_i) - y_i|)` over the batch and every output (an
    `eqfit.Mean` with `weights`).
    """
    state, x, y, weights = split_state(args, "mae")
    return _mae(model, state, x, y, weights)


@jaxtyped(typechecker=beartype)
def _mae(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Float[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
) -> Any:
    out, _ = outputs(model, x, state)
    return reduce(jnp.abs(same_shape(out, y, "mae") - y), weights, "mae")
