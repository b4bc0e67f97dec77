"""Batch-level losses, each `loss(model, x, y) -> scalar`, vmapping the model over the batch.

Given a batch `(x, y, weights)`, each returns the weighted mean as an `eqfit.Mean`:
`weights` per example or per label, a mask or class weights (`class_weights[y]`), which
`fit` averages as a sum over a sum (a masked sequence loss's mean over tokens). With one
label per sequence, `(batch,)`, and a mask over its positions, `(batch, length)` (a
classifier over `eqfit.Buckets`), each sequence weighs 1 if any of its positions is real
and 0 if none is (a row of padding): the ready metrics take them so too.

The model is called on one example at a time, `model(x[i])`, as Equinox models are. Each
loss also takes:

- a keyword `key`: given one, a model whose `__call__` takes a `key` (dropout) gets one per
    example, so `fit` passes a fresh key each step; without one, or in inference mode,
    the model runs deterministically;
- a model state: `loss(model, state, x, y) -> (value, new_state)` for a stateful model
    (`eqx.nn.BatchNorm` and the like), called as `model(x[i], state)` under `jax.vmap`
    with `axis_name="batch"`, Equinox's convention for BatchNorm. That is how `fit(...,
    state=)` calls its loss.
"""

import inspect
from collections.abc import Callable
from typing import Any, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped, PyTree, Shaped

from ._core._typing import ArrayTree, PRNGKey
from ._step._labels import check_labels, same_shape
from ._step._mean import Mean
from ._step._signatures import takes_key


Model = Callable[..., Any]
State = eqx.nn.State


def outputs(
    model: Model, x: ArrayTree, state: State | None = None, key: PRNGKey | None = None
) -> tuple[Array, State | None]:
    """The model's outputs on a batch `x` (vmapped over its leading axis), and the new
    state for a stateful model.
    """
    keys = None
    if key is not None and takes_key(model):
        keys = jax.random.split(key, jax.tree.leaves(x)[0].shape[0])

    if state is not None:
        _check_takes_state(model)

    def one(x: PyTree, key: PRNGKey | None) -> Any:
        kwargs = {} if key is None else {"key": key}
        return model(x, **kwargs) if state is None else model(x, state, **kwargs)

    if state is None:
        out, state = jax.vmap(one)(x, keys), None
    else:
        out, state = jax.vmap(one, axis_name="batch", out_axes=(0, None))(x, keys)
    # A model that computes in a low precision (`fit(..., precision=)`): the loss and
    # metrics are taken in float32, as Keras and PyTorch's autocast take them.
    low = lambda o: eqx.is_array(o) and o.dtype in (jnp.bfloat16, jnp.float16)  # noqa: E731
    return jax.tree.map(lambda o: o.astype(jnp.float32) if low(o) else o, out), state


def _check_takes_state(model: Any) -> None:
    """Refuses, naming the cause, a model that cannot be called as `model(x, state)`: a
    model state was given (`fit(..., state=)`), but the model is not a stateful one.
    """
    try:
        signature = inspect.signature(model)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"With a model state (`state=`), eqfit's losses and metrics call the model as "
            f"`model(x, state)`, but `{type(model).__name__}{signature}` takes no state: is "
            "it a stateful model (one with `eqx.nn.BatchNorm`, say, made by "
            "`eqx.nn.make_with_state`)? If not, leave out `state=`."
        ) from None


def split_state(args: tuple[Any, ...], name: str) -> tuple[State | None, Any, Any, Any]:
    """`(x, y)`, `(x, y, weights)`, or either after a `state`: the arguments after the
    model, as `fit` passes them; `x`, `y` and `weights` as JAX arrays (numpy ones are
    taken too); `weights` `None` where none are given, and one per sequence where they
    are a mask over its positions and `y` one label per sequence (`per_sequence`).
    """
    state = None
    if args and isinstance(args[0], eqx.nn.State):
        state, args = args[0], args[1:]
    if len(args) in (2, 3):
        y = jnp.asarray(args[1])
        weights = per_sequence(jnp.asarray(args[2]), y) if len(args) == 3 else None
        return state, jax.tree.map(jnp.asarray, args[0]), y, weights
    raise TypeError(
        f"`{name}` takes `(model, x, y)` or `(model, x, y, weights)`, with a model state "
        f"after the model for a stateful model (an `eqx.nn.State`); got "
        f"{len(args) + (state is not None)} arguments after the model"
        + (f", the first a {type(args[0]).__name__}" if args and state is None else "")
        + "."
    )


def per_sequence(weights: Array, y: Array) -> Array:
    """`weights` for labels `y`: a mask over each sequence's positions, `(batch, length)`
    (an `eqfit.Buckets` batch's), where `y` has one axis fewer (a label per sequence: a
    classifier's), made one weight per sequence: 1 where any of its positions is real (its
    weight not 0), 0 where none is (a row of padding, which fills a bucket's last batch).
    Any, not a sum or a mean over the positions: a sequence has one label and counts once,
    however long. Other weights are returned as they are.
    """
    if y.ndim == 0 or weights.ndim != y.ndim + 1 or weights.shape[:-1] != y.shape:
        return weights
    return jnp.any(weights != 0, axis=-1).astype(weights.dtype)


def check_weights(weights: Array, shape: tuple[int, ...], name: str) -> Array:
    """Refuses, naming `name`, `weights` that are not per example (`(batch,)`) nor shaped
    as a leading part of `shape`, the per-output values' (`(batch, time)` for sequence
    targets); else returns them as they are.
    """
    if weights.shape != tuple(shape[: weights.ndim]) or weights.ndim == 0:
        mask = ""
        if weights.ndim > len(shape):
            mask = (
                " (A mask over each sequence's positions, `(batch, length)`, is taken as one "
                "weight per sequence where the labels are one per sequence, `(batch,)`.)"
            )
        raise ValueError(
            f"`{name}`: `weights` must have shape (batch,) or a leading part of the "
            f"per-output values' shape {tuple(shape)}, but it has shape "
            f"{tuple(weights.shape)}.{mask}"
        )
    return weights


def reduce(values: Array, weights: Array | None, name: str) -> Any:
    """The mean of `values` (a loss or a score per output, shaped `(batch, ...)`): plain
    without `weights`; with them, an `eqfit.Mean` of each example's (or each position's)
    value weighted by its weight. `weights` are shaped `(batch,)`, or as `values`'
    leading axes (`(batch, time)` for sequence targets); a value's trailing axes beyond
    them are averaged first. A mask of bools is a weight of 0 or 1.
    """
    if weights is None:
        return jnp.mean(values)
    check_weights(weights, values.shape, name)
    if not (jnp.issubdtype(weights.dtype, jnp.number) or weights.dtype == jnp.bool_):
        raise TypeError(f"`{name}`: `weights` must be numbers or bools, got {weights.dtype}.")
    per = jnp.mean(values, axis=tuple(range(weights.ndim, values.ndim)))
    return Mean.of(per.astype(jnp.float32), weights.astype(jnp.float32))


def _returns(value: Array | Mean, state: State | None) -> Any:
    return value if state is None else (value, state)


@overload
def mse(model: Model, x: Any, y: Any, /, *, key: Any = None) -> Float[Array, ""]: ...
@overload
def mse(
    model: Model, state: State, x: Any, y: Any, /, *, key: Any = None
) -> tuple[Float[Array, ""], State]: ...
@overload
def mse(model: Model, x: Any, y: Any, weights: Any, /, *, key: Any = None) -> Any: ...  # a Mean
@overload
def mse(
    model: Model, state: State, x: Any, y: Any, weights: Any, /, *, key: Any = None
) -> tuple[Mean, State]: ...
def mse(model: Model, *args: Any, key: PRNGKey | None = None) -> Any:
    """Mean squared error of `model` on a batch.

    **Arguments:**

    - `model`: called on one example, returning an array shaped like one row of `y`.
    - `state`: optional, for a stateful model.
    - `x`: the batch of inputs.
    - `y`: the targets (floating point).
    - `weights`: optional: a weight per example, `(batch,)`, or per output (`y`'s
        shape, or its leading axes); a mask of bools is a weight of 0 or 1.
    - `key`: optional: per-example keys for a model that takes one (dropout).

    **Returns:**

    `mean((model(x_i) - y_i) ** 2)` over the batch and every output; with `weights`, the
    weighted mean as an `eqfit.Mean`, which `fit` sums over sums; with a state, that and
    the new state.
    """
    state, x, y, weights = split_state(args, "mse")
    return _mse(model, state, x, y, weights, key)


@jaxtyped(typechecker=beartype)
def _mse(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Float[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
    key: PRNGKey | None,
) -> Any:
    out, state = outputs(model, x, state, key)
    value = reduce(optax.squared_error(same_shape(out, y, "mse"), y), weights, "mse")
    return _returns(value, state)


@overload
def softmax_cross_entropy(
    model: Model, x: Any, y: Any, /, *, key: Any = None
) -> Float[Array, ""]: ...
@overload
def softmax_cross_entropy(
    model: Model, state: State, x: Any, y: Any, /, *, key: Any = None
) -> tuple[Float[Array, ""], State]: ...
@overload
def softmax_cross_entropy(
    model: Model, x: Any, y: Any, weights: Any, /, *, key: Any = None
) -> Any: ...  # an `eqfit.Mean`
@overload
def softmax_cross_entropy(
    model: Model, state: State, x: Any, y: Any, weights: Any, /, *, key: Any = None
) -> tuple[Mean, State]: ...
def softmax_cross_entropy(model: Model, *args: Any, key: PRNGKey | None = None) -> Any:
    """Softmax cross-entropy against integer class labels.

    **Arguments:**

    - `model`: called on one example, returning unnormalised logits of shape `(classes,)`.
    - `state`: optional, for a stateful model.
    - `x`: the batch of inputs.
    - `y`: integer labels in `[0, classes)`, `(batch,)`, or `(batch, time)` (and so on)
        for a model that returns logits `(time, classes)` per example.
    - `weights`: optional: a weight per example, `(batch,)`, or per label (`y`'s shape):
        a mask of bools (padding tokens out), or class weights as `class_weights[y]`.
    - `key`: optional: per-example keys for a model that takes one (dropout).

    **Returns:**

    The mean cross-entropy over the batch (and positions); with `weights`, the weighted
    mean as an `eqfit.Mean`, which `fit` sums over sums; with a state, that and the new
    state.
    """
    state, x, y, weights = split_state(args, "softmax_cross_entropy")
    return _softmax_cross_entropy(model, state, x, y, weights, key)


@jaxtyped(typechecker=beartype)
def _softmax_cross_entropy(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Int[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
    key: PRNGKey | None,
) -> Any:
    logits, state = outputs(model, x, state, key)
    if logits.ndim != y.ndim + 1 or logits.shape[:-1] != y.shape:
        raise ValueError(
            "`softmax_cross_entropy`: the model must return a vector of logits per "
            f"label, but the batch of outputs has shape {tuple(logits.shape)} for labels "
            f"of shape {tuple(y.shape)}."
        )
    logits = check_labels(logits, y, logits.shape[-1], "softmax_cross_entropy")
    value = reduce(
        optax.softmax_cross_entropy_with_integer_labels(logits, y),
        weights,
        "softmax_cross_entropy",
    )
    return _returns(value, state)


@overload
def binary_cross_entropy(
    model: Model, x: Any, y: Any, /, *, key: Any = None
) -> Float[Array, ""]: ...
@overload
def binary_cross_entropy(
    model: Model, state: State, x: Any, y: Any, /, *, key: Any = None
) -> tuple[Float[Array, ""], State]: ...
@overload
def binary_cross_entropy(
    model: Model, x: Any, y: Any, weights: Any, /, *, key: Any = None
) -> Any: ...  # an `eqfit.Mean`
@overload
def binary_cross_entropy(
    model: Model, state: State, x: Any, y: Any, weights: Any, /, *, key: Any = None
) -> tuple[Mean, State]: ...
def binary_cross_entropy(model: Model, *args: Any, key: PRNGKey | None = None) -> Any:
    """Binary cross-entropy on logits, for labels in {0, 1} (or probabilities).

    **Arguments:**

    - `model`: called on one example, returning logits shaped like one row of `y`.
    - `state`: optional, for a stateful model.
    - `x`: the batch of inputs.
    - `y`: the labels.
    - `weights`: optional: a weight per example, `(batch,)`, or per output (`y`'s
        shape, or its leading axes); a mask of bools is a weight of 0 or 1.
    - `key`: optional: per-example keys for a model that takes one (dropout).

    **Returns:**

    The mean sigmoid cross-entropy over the batch and every output; with `weights`, the
    weighted mean as an `eqfit.Mean`; with a state, that and the new state.
    """
    state, x, y, weights = split_state(args, "binary_cross_entropy")
    return _binary_cross_entropy(model, state, x, y, weights, key)


@jaxtyped(typechecker=beartype)
def _binary_cross_entropy(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Float[Array, "batch ..."] | Int[Array, "batch ..."] | Bool[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
    key: PRNGKey | None,
) -> Any:
    logits, state = outputs(model, x, state, key)
    logits = check_labels(
        same_shape(logits, y, "binary_cross_entropy"), y, None, "binary_cross_entropy"
    )
    labels = y.astype(logits.dtype)
    value = reduce(
        optax.sigmoid_binary_cross_entropy(logits, labels), weights, "binary_cross_entropy"
    )
    return _returns(value, state)
