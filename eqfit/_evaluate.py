"""Loss and metrics over a whole dataset, in batches, in inference mode."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._step import clone, Objective


def evaluate_batches(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    data: PyTree,
    batch_size: int,
) -> Float[Array, " values"]:
    """The mean loss and metrics over `data`, as `[loss, *metrics]`.

    It runs a scan over full batches and one smaller last batch, weighting each batch's
    value by its size, so for a loss that is a mean over the batch this is the mean over
    the whole data: what one full-batch call would give, without its memory.
    """
    model = eqx.nn.inference_mode(model)
    key = jax.random.key(0)  # a loss that asks for a key gets one; inference ignores it
    num = jax.tree.leaves(data)[0].shape[0]
    num_full, remainder = divmod(num, batch_size)

    def values(batch: PyTree) -> Float[Array, " values"]:
        loss, _ = objective.value(model, clone(model_state), batch, key)
        metrics = objective.metric_values(model, clone(model_state), batch)
        return jnp.concatenate([loss[None].astype(jnp.float32), metrics])

    total = jnp.zeros(1 + len(objective.metrics))
    if num_full:
        full = jax.tree.map(
            lambda a: a[: num_full * batch_size].reshape(num_full, batch_size, *a.shape[1:]),
            data,
        )

        def add(total: Float[Array, " values"], batch: PyTree):
            return total + values(batch) * batch_size, None

        total, _ = jax.lax.scan(add, total, full)
    if remainder:
        last = jax.tree.map(lambda a: a[num_full * batch_size :], data)
        total = total + values(last) * remainder
    return total / num
