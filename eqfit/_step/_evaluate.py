"""Loss and metrics over a whole dataset, in batches, in inference mode."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Key, PyTree

from ._labels import either, LabelError
from ._objective import clone, Objective
from ._signatures import needs_key
from ._statistics import flatten


def evaluation_needs_key(objective: Objective, model: PyTree) -> bool:
    """Whether evaluating passes the loss a key: only if it or the model requires one.
    Inference needs no randomness (in inference mode the model ignores a key), and keys
    cost compile time.
    """
    return needs_key(objective.loss) or needs_key(eqx.nn.inference_mode(model))


def evaluate_batches(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    data: PyTree,
    batch_size: int,
    key: Key[Array, ""] | None = None,
) -> tuple[Float[Array, " values"], LabelError | None]:
    """The mean loss, aux values and metrics over `data`, as `[loss, *aux, *metrics]`
    (`objective.value_names`), and the first label out of range met, if any (`None` where
    nothing checks labels). The objective's precision policy casts the model and batches.

    It runs a scan over full batches and one smaller last batch, weighting each batch's
    value by its size, so for a loss that is a mean over the batch's examples this is the
    mean over the whole data: what one full-batch call would give, without its memory. A
    weighted mean (`eqfit.Mean`) is the sum of its totals over the sum of its weights.

    Where the loss gets a key (`evaluation_needs_key`), batch `b` (counted from 0) gets
    `jax.random.fold_in(key, b)`; without `key`, every batch gets `jax.random.key(0)`.
    """
    total, labels = sum_batches(objective, model, model_state, data, batch_size, key)
    # A sum over a sum: the mean over the whole data (NaN, 0 / 0, where weights sum to 0).
    return objective.quotient(total), labels


def sum_batches(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    data: PyTree,
    batch_size: int,
    key: Key[Array, ""] | None = None,
    offset: Int[ArrayLike, ""] | None = None,
    valid: Int[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "2 values"], LabelError | None]:
    """`evaluate_batches`' totals and weights (`batch_totals`'), summed over `data`'s
    batches, before their quotient; and the first label out of range met.

    A streamed chunk of a larger set (`offset` and `valid` given) holds only full
    batches: `offset` is the number of its first batch in the set (its keys are the
    set's), and only its first `valid` batches count; the rest (the padding that keeps
    every chunk one shape) are computed and dropped.
    """
    uses_key = evaluation_needs_key(objective, model)
    model = eqx.nn.inference_mode(model)
    num = jax.tree.leaves(data)[0].shape[0]
    num_full, remainder = divmod(num, batch_size)

    def batch_key(b: int | Array) -> Key[Array, ""] | None:
        return evaluation_key(key, batch_number(b, offset)) if uses_key else None

    total, labels = jnp.zeros((2, objective.width)), None
    if num_full:
        full = jax.tree.map(
            lambda a: a[: num_full * batch_size].reshape(num_full, batch_size, *a.shape[1:]),
            data,
        )

        def add(total: Float[Array, "2 values"], batch: tuple[Array, PyTree]):
            b, batch_ = batch
            batch_values, batch_labels = batch_totals(
                objective, model, model_state, batch_, batch_key(b)
            )
            batch_values, batch_labels = _drop_padding(batch_values, batch_labels, b, valid)
            return total + batch_values, batch_labels

        # Each batch's label check is an output of the scan (none where nothing checks
        # labels), the first found picked after it.
        total, every = jax.lax.scan(add, total, (jnp.arange(num_full), full))
        if every is not None:
            first = jnp.argmax(every.found)
            labels = jax.tree.map(lambda x: x[first], every)
    if remainder:
        last = jax.tree.map(lambda a: a[num_full * batch_size :], data)
        last_values, last_labels = batch_totals(
            objective, model, model_state, last, batch_key(num_full)
        )
        total, labels = total + last_values, either(labels, last_labels)
    return total, labels


def add_chunk(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    chunk: PyTree,
    batch_size: int,
    key: Key[Array, ""] | None,
    offset: Int[ArrayLike, ""],
    valid: Int[ArrayLike, ""],
    totals: Float[Array, "2 values"],
    labels: LabelError,
) -> tuple[Float[Array, "2 values"], LabelError]:
    """A streamed chunk's first `valid` batches (numbered from `offset` in the set)
    added to the totals so far in one scan, and the first label out of range kept (as
    `PerStep` runs them, programs of a few of its batches written out are `add_batches`',
    given `offset` and `valid`). One program per chunk's shape, called as chunks arrive.
    After every chunk, `totals[0] / totals[1]` is `evaluate_batches`' value over the
    whole set (to float rounding: the sums are taken chunk by chunk).
    """
    chunk_totals, found = sum_batches(
        objective, model, model_state, chunk, batch_size, key, offset, valid
    )
    return totals + chunk_totals, labels if found is None else labels.or_else(found)


def add_batches(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    data: PyTree,
    batch_size: int,
    key: Key[Array, ""] | None,
    first: Int[ArrayLike, ""],
    count: int,
    remainder: bool,
    totals: Float[Array, "2 values"],
    labels: LabelError,
    offset: Int[ArrayLike, ""] | None = None,
    valid: Int[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "2 values"], LabelError]:
    """`evaluate_batches` in pieces, for programs called one after the other with no
    loop around their batches: `count` full batches of `data` from batch `first` on
    (those past the last full batch computed and dropped), or with `remainder` its
    smaller last batch, each batch's totals added to `totals` in `evaluate_batches`'
    order, the first label out of range met kept in `labels`. `totals[0] / totals[1]`
    after every batch is `evaluate_batches`' value. `offset` and `valid`: for a
    streamed chunk, as `sum_batches` takes them.
    """
    uses_key = evaluation_needs_key(objective, model)
    model = eqx.nn.inference_mode(model)
    num_full = jax.tree.leaves(data)[0].shape[0] // batch_size
    for j in range(1 if remainder else count):
        if remainder:
            b: Any = num_full
            batch = jax.tree.map(lambda a: a[num_full * batch_size :], data)
        else:
            b = jnp.asarray(first, jnp.int32) + j
            start = jnp.minimum(b, num_full - 1) * batch_size  # in range: a past one is dropped
            batch = jax.tree.map(lambda a: batch_rows(a, start, batch_size), data)
        batch_key = evaluation_key(key, batch_number(b, offset)) if uses_key else None
        values, found = batch_totals(objective, model, model_state, batch, batch_key)
        if not remainder and valid is None:
            values = jnp.where(b < num_full, values, 0.0)
        values, found = _drop_padding(values, found, b, valid)
        totals = totals + values
        if found is not None:
            labels = labels.or_else(found)
    return totals, labels


def batch_number(b: Any, offset: Int[ArrayLike, ""] | None) -> Any:
    """Batch `b`'s number in its data, for its key: `b`, or in a streamed chunk whose
    first batch is the data's `offset`-th, counted from there.
    """
    return b if offset is None else jnp.asarray(offset) + b


def _drop_padding(
    values: Array, found: LabelError | None, b: Any, valid: Int[ArrayLike, ""] | None
) -> tuple[Array, LabelError | None]:
    """A batch's totals and label check, but where batch `b` pads a streamed chunk (past
    its `valid` batches): it then adds nothing and finds nothing.
    """
    if valid is None:
        return values, found
    counts = b < valid
    if found is not None:
        found = found.found_only_where(counts)
    return jnp.where(counts, values, 0.0), found


def batch_rows(a: Array, start: Int[Array, ""], size: int) -> Array:
    """Rows `start` to `start + size` of `a` (in range by construction)."""
    return jax.lax.dynamic_slice_in_dim(a, start, size, allow_negative_indices=False)


def evaluation_key(key: Key[Array, ""] | None, b: int | Array) -> Key[Array, ""]:
    """The key of batch `b` of an evaluation whose key is `key` (for a loss that gets
    one): `jax.random.fold_in(key, b)`, or without `key`, `jax.random.key(0)`.
    """
    return jax.random.key(0) if key is None else jax.random.fold_in(key, b)


def batch_totals(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    batch: PyTree,
    key: Key[Array, ""] | None,
) -> tuple[Float[Array, "2 values"], LabelError | None]:
    """One batch's totals and weights of the values `objective.value_names`, stacked, for
    a model in inference mode: a plain value times the batch's size, and the size; a
    weighted mean's (`eqfit.Mean`) own total and weight. Their sums over batches, total
    over weight, are the means over the data; and the first label out of range met.
    """
    v = objective.value(model, clone(model_state), batch, key)
    metrics, metric_weights, metric_labels = objective.metric_values(
        model, clone(model_state), batch
    )
    totals = jnp.concatenate([v.loss[None].astype(jnp.float32), v.aux, metrics])
    weights = jnp.concatenate([v.weight[None], v.aux_weights, metric_weights])
    size = jax.tree.leaves(batch)[0].shape[0]
    if objective.means:
        mean = np.isin(np.asarray(objective.value_names), objective.means)
        totals = jnp.where(mean, totals, totals * size)
        weights = jnp.where(mean, weights, size)
    else:
        totals, weights = totals * size, jnp.full_like(weights, size)
    if objective.accumulating:  # their statistics summed over batches, weights unused
        statistics, counted = objective.statistics(model, clone(model_state), batch)
        flat = flatten(statistics)
        totals = jnp.concatenate([totals, flat])
        weights = jnp.concatenate([weights, jnp.zeros_like(flat)])
        metric_labels = either(metric_labels, counted)
    return jnp.stack([totals, weights]), either(v.labels, metric_labels)
