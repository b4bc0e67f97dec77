"""Batched inference: `predict` and `evaluate`, each one compiled scan over the data."""

import dataclasses
from collections.abc import Callable
from typing import Any, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._core._checks import checked, reported_as
from ._core._data import (
    as_data,
    as_key,
    check_alive,
    check_batch_size,
    ensemble_size,
    not_a_stack,
    num_samples,
)
from ._core._typing import Arrays, ArrayTree, Loss, Metrics, ModelState, PRNGKey
from ._program._jit import cached_jit
from ._step._evaluate import evaluate_batches
from ._step._labels import raise_found
from ._step._objective import find_outputs, Objective, takes_key
from ._step._precision import as_precision, Precision, PrecisionLike
from .losses import outputs


# What the model returns for one example, so what `predict` returns for all of them.
Output = TypeVar("Output")


@overload
def predict(
    model: Callable[..., Output],
    x: Arrays,
    *,
    batch_size: int = 256,
    ensemble: bool = False,
    state: None = None,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
) -> Output: ...
@overload
def predict(
    model: Callable[..., tuple[Output, Any]],
    x: Arrays,
    *,
    batch_size: int = 256,
    ensemble: bool = False,
    state: ModelState,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
) -> Output: ...
@checked("predict")
def predict(
    model: Callable[..., Any],
    x: Arrays,
    *,
    batch_size: int = 256,
    ensemble: bool = False,
    state: ModelState | None = None,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
) -> ArrayTree:
    """Runs `model` over every example of `x`, in batches, in inference mode.

    One compiled program: a scan over full batches and one smaller last batch, so memory
    stays at one batch's activations however large `x` is.

    **Arguments:**

    - `model`: called on one example, `model(x[i])` (or `model(x[i], state)`).
    - `x`: the inputs, with a leading example axis: an array, or any PyTree of arrays
        sharing it (then the model is called on one example's PyTree).
    - `batch_size`: examples per batch.
    - `ensemble`: `model` is a stack of members (as `fit(..., ensemble=True)` takes);
        every member predicts every example.
    - `state`: the model's `eqx.nn.State`, for a stateful model: called as `model(x[i],
        state)` under `jax.vmap` with `axis_name="batch"`, returning `(output, state)`,
        whose output is kept.
    - `precision`: as `fit`'s: the model's floating arrays and the inputs' are cast to
        its compute dtype inside the program, and floating outputs come back in its
        `params` dtype (float32).
    - `key`: for a model that takes a keyword `key`: batch `b` (counted from 0) gets
        `jax.random.fold_in(key, b)`, split over its examples. By default the model gets
        no key.

    **Returns:**

    The stacked outputs, `(n, ...)`, or `(members, n, ...)` with `ensemble=True`: to a
    type checker, what `model` returns (without the state, given one).
    """
    check_alive(model=model, x=x, state=state)
    x_ = as_data(x if not _is_array(x) else (x,), "x")
    check_batch_size(batch_size)
    policy = as_precision(precision, model=model)
    members = ensemble_size(model) if ensemble else None
    key_ = None if key is None else as_key(key)
    with reported_as("predict", "x"):
        try:
            return _predict(
                eqx.nn.inference_mode(model),
                x_ if not _is_array(x) else x_[0],
                state,
                batch_size,
                ensemble,
                policy,
                key_,
            )
        except Exception as e:
            if members is not None:
                # A single model whose arrays happen to share their leading size passes
                # for a stack; this is where it shows.
                raise not_a_stack(members, "`predict`", e) from e
            raise


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


@cached_jit  # not `eqx.filter_jit`: `eqfit.clear_cache()` frees its programs
def _predict(
    model: PyTree,
    x: PyTree,
    state: PyTree,
    batch_size: int,
    ensemble: bool,
    policy: Precision | None,
    key: Any = None,
) -> Any:
    n = num_samples(x)
    num_full, remainder = divmod(n, batch_size)

    def run(model: PyTree, state: PyTree) -> Any:
        if policy is not None:
            model = policy.cast(model)

        def forward(x: PyTree, b: Any) -> Any:
            batch_key = None if key is None else jax.random.fold_in(key, b)
            if policy is None:
                return outputs(model, x, state, batch_key)[0]
            out = outputs(model, policy.cast_batch(x), state, batch_key)[0]
            return policy.master(out)

        parts = []
        if num_full:
            full = jax.tree.map(
                lambda a: a[: num_full * batch_size].reshape(num_full, batch_size, *a.shape[1:]),
                x,
            )
            _, out = jax.lax.scan(
                lambda _, b_xb: (None, forward(b_xb[1], b_xb[0])),
                None,
                (jnp.arange(num_full), full),
            )
            parts.append(
                jax.tree.map(lambda o: o.reshape(num_full * batch_size, *o.shape[2:]), out)
            )
        if remainder:
            last = jax.tree.map(lambda a: a[num_full * batch_size :], x)
            parts.append(forward(last, num_full))
        if len(parts) == 1:
            return parts[0]
        return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)

    if ensemble:
        return eqx.filter_vmap(run)(model, state)
    return run(model, state)


@checked("evaluate")
def evaluate(
    model: ArrayTree,
    data: Arrays,
    *,
    loss: Loss,
    metrics: Metrics | None = None,
    batch_size: int = 256,
    state: ModelState | None = None,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
) -> dict[str, float]:
    """The loss and metrics of `model` over all of `data`, in batches, in inference mode.

    Each batch's value is weighted by its size, so for a loss that is a mean over the
    batch's examples the result equals the full-batch value, without its memory. A value
    that is an `eqfit.Mean` (a masked or token-weighted loss) is the sum of its totals
    over the sum of its weights, the whole data's weighted mean (NaN if they sum to 0).

    **Arguments:**

    - `model`: the model, as `fit` takes it.
    - `data`: a tuple of arrays sharing their leading axis (or another PyTree of them),
        as `fit` takes it.
    - `loss`: `loss(model, *batch)`, or `loss(model, state, *batch) -> (value, state)`.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar` (with `state`,
        `fn(model, state, *batch)`).
    - `batch_size`: examples per batch.
    - `state`: the model's `eqx.nn.State`, for stateful models.
    - `precision`: as `fit`'s: the loss and metrics compute under this policy.
    - `key`: for a loss (or model) that requires a keyword `key`, as `fit`'s validation
        passes one: batch `b` (counted from 0) gets `jax.random.fold_in(key, b)`. By
        default every batch gets `jax.random.key(0)`. A loss whose `key` has a default
        gets none, in inference as in `fit`'s validation.

    **Returns:**

    `{"loss": ..., **{name: ...}}` as plain floats: the loss, the aux values it returns
    (see `fit`'s `loss`), and the metrics.
    """
    check_alive(model=model, data=data, state=state)
    data_ = as_data(data)
    check_batch_size(batch_size)
    objective = Objective(
        loss,
        tuple((metrics or {}).items()),
        state is not None,
        takes_key(loss),
        precision=as_precision(precision, model=model),
    )
    with reported_as("evaluate", "data"):
        batch = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((min(batch_size, a.shape[0]), *a.shape[1:]), a.dtype),
            data_,
        )
        outputs = find_outputs(objective, model, state, batch)
        objective = dataclasses.replace(objective, aux_names=outputs.aux_names, means=outputs.means)
        key_ = None if key is None else as_key(key)
        values_, labels = _evaluate(objective, model, state, data_, batch_size, key_)
        values = np.asarray(values_).tolist()
    if labels is not None:
        raise_found(labels)
    return dict(zip(objective.value_names, values))


_evaluate = cached_jit(evaluate_batches)
