"""Batched inference: `predict` and `evaluate`, each one compiled scan over the data."""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._core._checks import checked, reported_as
from ._core._data import (
    as_data,
    as_key,
    batch_calls,
    check_alive,
    check_batch_size,
    ensemble_size,
    not_a_stack,
    num_samples,
)
from ._core._execution import choose, Execution
from ._core._typing import Arrays, ArrayTree, Loss, Metrics, ModelState, PRNGKey
from ._program._jit import cached_jit
from ._step._evaluate import add_batches, batch_rows, evaluate_batches
from ._step._labels import LabelError, raise_found
from ._step._objective import abstract_key, applies, CONVOLUTION, find_outputs, Objective, takes_key
from ._step._precision import as_precision, Precision, PrecisionLike
from .losses import outputs


HINTS = {"execution": "`'auto'`, `eqfit.WholeRun()` or `eqfit.PerStep(unroll)`"}


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
    execution: Execution | Literal["auto"] = "auto",
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
    execution: Execution | Literal["auto"] = "auto",
) -> Output: ...
@checked("predict", HINTS)
def predict(
    model: Callable[..., Any],
    x: Arrays,
    *,
    batch_size: int = 256,
    ensemble: bool = False,
    state: ModelState | None = None,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
    execution: Execution | Literal["auto"] = "auto",
) -> ArrayTree:
    """Runs `model` over every example of `x`, in batches, in inference mode.

    One compiled program, a scan over full batches and one smaller last batch; or, where
    XLA compiles the forward pass worse inside a loop (one that convolves, on the CPU
    backend), programs of a few batches with no loop in them, called one after another
    from Python (as `fit`'s `execution=` runs its steps). Either way memory stays at one
    batch's activations however large `x` is, and the outputs agree to float tolerance.

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
    - `execution`: as `fit`'s: [`eqfit.WholeRun`][]`()`, one program over every batch,
        or [`eqfit.PerStep`][]`(unroll)`, programs of `unroll` batches called from
        Python; by default (`"auto"`) `PerStep(1)` where the model convolves on the CPU
        backend, else `WholeRun()`.

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
            args = (
                eqx.nn.inference_mode(model),
                x_ if not _is_array(x) else x_[0],
                state,
                batch_size,
                ensemble,
                policy,
                key_,
            )
            unroll = batches_per_program(execution, lambda: _forward_convolves(*args))
            if unroll is None:
                return _predict(*args)
            return _predict_in_calls(args, unroll)
        except Exception as e:
            if members is not None:
                # A single model whose arrays happen to share their leading size passes
                # for a stack; this is where it shows.
                raise not_a_stack(members, "`predict`", e) from e
            raise


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def batches_per_program(
    asked: Execution | Literal["auto"], convolves: Callable[[], bool]
) -> int | None:
    """The batches of each program of an inference (`predict`, `evaluate`) as `asked`
    (`execution=`), or by default by `fit`'s rule (`choose`): `None` for one program
    over all of them.
    """
    platform = jax.devices()[0].platform
    choice = choose(asked, platform=platform, steps_per_epoch=None, convolves=convolves)
    return choice.execution.steps_per_program()


# Whether a model's forward pass convolves, by the abstract model, inputs and options:
# traced once, not at each `predict`.
_CONVOLVES: dict[Any, bool] = {}


def _forward_convolves(
    model: PyTree,
    x: PyTree,
    state: PyTree,
    batch_size: int,
    ensemble: bool,
    policy: Precision | None,
    key: Any,
) -> bool:
    """Whether `predict`'s forward pass on these arguments convolves."""
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), x)
    try:
        cache_key = (abstract_key((model, state, key)), abstract_key(one), ensemble, policy)
        hash(cache_key)
    except TypeError:  # a model that cannot be hashed: traced every time
        cache_key = None
    if cache_key is not None and cache_key in _CONVOLVES:
        return _CONVOLVES[cache_key]
    jaxpr = eqx.filter_make_jaxpr(lambda m, s, x, k: _predict_all(m, x, s, 1, ensemble, policy, k))(
        model, state, one, key
    )[0]
    convolves = applies(jaxpr.jaxpr, CONVOLUTION)
    if cache_key is not None:
        if len(_CONVOLVES) >= 64:
            _CONVOLVES.pop(next(iter(_CONVOLVES)))
        _CONVOLVES[cache_key] = convolves
    return convolves


def _predict_in_calls(args: tuple[Any, ...], unroll: int) -> Any:
    """`predict` as programs of `unroll` full batches (`_predict_some`), then one of the
    smaller last batch, called one after another; their outputs joined.
    """
    model, x, state, batch_size, ensemble, policy, key = args
    num_full = num_samples(x) // batch_size
    parts = []
    for b, count, remainder in batch_calls(num_samples(x), batch_size, unroll):
        first = np.asarray(b, np.int32)  # an array: traced, one program for every call
        out = _predict_some(
            model, x, state, batch_size, ensemble, policy, key, first, count, remainder
        )
        if not remainder and b + count > num_full:  # batches past the last full one
            rows = (num_full - b) * batch_size
            out = jax.tree.map(lambda o: o[:, :rows] if ensemble else o[:rows], out)
        parts.append(out)
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *p: jnp.concatenate(p, axis=1 if ensemble else 0), *parts)


def _forward(
    model: PyTree, state: PyTree, policy: Precision | None, key: Any
) -> Callable[[PyTree, Any], Any]:
    """The forward pass of one batch, `forward(batch, b)` (`b` the batch's number, for
    its key), in the precision policy's dtypes.
    """
    if policy is not None:
        model = policy.cast(model)

    def forward(x: PyTree, b: Any) -> Any:
        batch_key = None if key is None else jax.random.fold_in(key, b)
        if policy is None:
            return outputs(model, x, state, batch_key)[0]
        out = outputs(model, policy.cast_batch(x), state, batch_key)[0]
        return policy.master(out)

    return forward


def _predict_all(
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
        forward = _forward(model, state, policy, key)
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


# Compiled as `cached_jit` compiles, not as `eqx.filter_jit`: `eqfit.clear_cache()` frees
# their programs.
_predict = cached_jit(_predict_all)


@cached_jit
def _predict_some(
    model: PyTree,
    x: PyTree,
    state: PyTree,
    batch_size: int,
    ensemble: bool,
    policy: Precision | None,
    key: Any,
    first: Any,
    count: int,
    remainder: bool,
) -> Any:
    """`_predict`'s outputs of `count` full batches from batch `first` on (a batch past
    the last full one is computed on the last's rows, for the caller to drop), or with
    `remainder` of the smaller last batch, written out with no loop around them.
    """
    num_full = num_samples(x) // batch_size

    def run(model: PyTree, state: PyTree) -> Any:
        forward = _forward(model, state, policy, key)
        if remainder:
            return forward(jax.tree.map(lambda a: a[num_full * batch_size :], x), num_full)
        parts = []
        for j in range(count):
            b = jnp.asarray(first, jnp.int32) + j
            start = jnp.minimum(b, num_full - 1) * batch_size
            parts.append(forward(jax.tree.map(lambda a: batch_rows(a, start, batch_size), x), b))
        return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)

    if ensemble:
        return eqx.filter_vmap(run)(model, state)
    return run(model, state)


@checked("evaluate", HINTS)
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
    execution: Execution | Literal["auto"] = "auto",
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
    - `execution`: as `predict`'s: one program over every batch ([`eqfit.WholeRun`][]),
        or programs of `unroll` batches called from Python ([`eqfit.PerStep`][]); by
        default `PerStep(1)` where the loss or a metric convolves on the CPU backend.

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

        def convolves() -> bool:
            if outputs.convolves is not None:
                return outputs.convolves
            return bool(find_outputs(objective, model, state, batch, always=True).convolves)

        args = (objective, model, state, data_, batch_size, key_)
        unroll = batches_per_program(execution, convolves)
        if unroll is None:
            values_, labels = _evaluate(*args)
        else:
            values_, labels = _evaluate_in_calls(args, unroll)
        values = np.asarray(values_).tolist()
    if labels is not None:
        raise_found(labels)
    return dict(zip(objective.value_names, values))


_evaluate = cached_jit(evaluate_batches)
_add_batches = cached_jit(add_batches)


def _evaluate_in_calls(args: tuple[Any, ...], unroll: int) -> tuple[Any, LabelError | None]:
    """`evaluate_batches`' values and label error, as programs of `unroll` full batches
    then one of the smaller last batch (`add_batches`), called one after another.
    """
    objective, model, state, data, batch_size, key = args
    totals: Any = np.zeros((2, len(objective.value_names)), np.float32)
    labels: Any = jax.tree.map(np.asarray, LabelError.none())
    for b, count, remainder in batch_calls(num_samples(data), batch_size, unroll):
        first = np.asarray(b, np.int32)  # an array: traced, one program for every call
        totals, labels = _add_batches(
            objective, model, state, data, batch_size, key, first, count, remainder, totals, labels
        )
    return totals[0] / totals[1], labels
