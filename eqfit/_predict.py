"""Batched inference: `predict` and `evaluate`, each one compiled scan over the data."""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, jaxtyped, PyTree, Shaped

from ._data import as_data, check_batch_size, ensemble_size
from ._evaluate import evaluate_batches
from ._step import Objective, takes_key


@jaxtyped(typechecker=beartype)
def predict(
    model: PyTree,
    x: Shaped[Array | np.ndarray, "n ..."],
    *,
    batch_size: int = 256,
    ensemble: bool = False,
) -> Shaped[Array, "..."]:
    """Runs `model` over every example of `x`, in batches, in inference mode.

    One compiled program: a scan over full batches and one smaller last batch, so memory
    stays at one batch's activations however large `x` is.

    **Arguments:**

    - `model`: called on one example, `model(x[i])`.
    - `x`: the inputs, with a leading example axis.
    - `batch_size`: examples per batch.
    - `ensemble`: `model` is a stack of members (as `fit(..., ensemble=True)` takes);
        every member predicts every example.

    **Returns:**

    The stacked outputs, `(n, ...)`, or `(members, n, ...)` with `ensemble=True`.
    """
    (x_,) = as_data((x,))
    check_batch_size(batch_size)
    if ensemble:
        ensemble_size(model)
    return _predict(eqx.nn.inference_mode(model), x_, batch_size, ensemble)


@eqx.filter_jit
def _predict(model: PyTree, x: Array, batch_size: int, ensemble: bool) -> Array:
    def run(model: PyTree) -> Array:
        num_full, remainder = divmod(x.shape[0], batch_size)
        outputs = []
        if num_full:
            full = x[: num_full * batch_size].reshape(num_full, batch_size, *x.shape[1:])
            _, out = jax.lax.scan(lambda _, xb: (None, jax.vmap(model)(xb)), None, full)
            outputs.append(out.reshape(num_full * batch_size, *out.shape[2:]))
        if remainder:
            outputs.append(jax.vmap(model)(x[num_full * batch_size :]))
        return jnp.concatenate(outputs) if len(outputs) > 1 else outputs[0]

    return eqx.filter_vmap(run)(model) if ensemble else run(model)


@jaxtyped(typechecker=beartype)
def evaluate(
    model: PyTree,
    data: tuple[Shaped[Array | np.ndarray, "n ..."], ...],
    *,
    loss: Callable[..., Any],
    metrics: Mapping[str, Callable[..., Any]] | None = None,
    batch_size: int = 256,
    state: PyTree | None = None,
) -> dict[str, float]:
    """The loss and metrics of `model` over all of `data`, in batches, in inference mode.

    Each batch's value is weighted by its size, so for a loss that is a mean over the
    batch the result equals the full-batch value, without its memory.

    **Arguments:**

    - `model`: the model, as `fit` takes it.
    - `data`: a tuple of arrays sharing their leading axis, as `fit` takes it.
    - `loss`: `loss(model, *batch)`, or `loss(model, state, *batch) -> (value, state)`.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar`.
    - `batch_size`: examples per batch.
    - `state`: the model's `eqx.nn.State`, for stateful models.

    **Returns:**

    `{"loss": ..., **{name: ...}}` as plain floats.
    """
    data_ = as_data(data)
    check_batch_size(batch_size)
    objective = Objective(loss, tuple((metrics or {}).items()), state is not None, takes_key(loss))
    values = _evaluate(objective, model, state, data_, batch_size)
    names = ("loss", *(name for name, _ in objective.metrics))
    return dict(zip(names, np.asarray(values).tolist()))


_evaluate = eqx.filter_jit(evaluate_batches)
