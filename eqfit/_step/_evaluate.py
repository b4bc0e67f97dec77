"""Loss and metrics over a whole dataset, in batches, in inference mode."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Key, PyTree

from ._labels import either, LabelError
from ._objective import clone, needs_key, Objective


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
    uses_key = evaluation_needs_key(objective, model)
    model = eqx.nn.inference_mode(model)
    num = jax.tree.leaves(data)[0].shape[0]
    num_full, remainder = divmod(num, batch_size)

    def batch_key(b: int | Array) -> Key[Array, ""] | None:
        if not uses_key:
            return None
        return jax.random.key(0) if key is None else jax.random.fold_in(key, b)

    def values(
        batch: PyTree, key: Key[Array, ""] | None
    ) -> tuple[Float[Array, "2 values"], LabelError | None]:
        """The batch's totals and weights: a plain value times the batch's size, and the
        size; a weighted mean's (`eqfit.Mean`) own total and weight.
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
        return jnp.stack([totals, weights]), either(v.labels, metric_labels)

    total, labels = jnp.zeros((2, len(objective.value_names))), None
    if num_full:
        full = jax.tree.map(
            lambda a: a[: num_full * batch_size].reshape(num_full, batch_size, *a.shape[1:]),
            data,
        )

        def add(total: Float[Array, "2 values"], batch: tuple[Array, PyTree]):
            b, batch_ = batch
            batch_values, batch_labels = values(batch_, batch_key(b))
            return total + batch_values, batch_labels

        # Each batch's label check is an output of the scan (none where nothing checks
        # labels), the first found picked after it.
        total, every = jax.lax.scan(add, total, (jnp.arange(num_full), full))
        if every is not None:
            first = jnp.argmax(every.found)
            labels = jax.tree.map(lambda x: x[first], every)
    if remainder:
        last = jax.tree.map(lambda a: a[num_full * batch_size :], data)
        last_values, last_labels = values(last, batch_key(num_full))
        total, labels = total + last_values, either(labels, last_labels)
    # A sum over a sum: the mean over the whole data (NaN, 0 / 0, where weights sum to 0).
    return total[0] / total[1], labels
