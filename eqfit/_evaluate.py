"""Loss and metrics over a whole dataset, in batches, in inference mode."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ._data import Data
from ._step import Objective


def evaluate_batches(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    data: Data,
    batch_size: int,
) -> Float[Array, " values"]:
    """The mean loss and metrics over `data`, as `[loss, *metrics]`.

    It runs a scan over full batches and one smaller last batch, weighting each batch's
    value by its size, so for a loss that is a mean over the batch this is the mean over
    the whole data: what one full-batch call would give, without its memory.
    """
    model = eqx.nn.inference_mode(model)
    key = jax.random.key(0)  # a loss that asks for a key gets one; inference ignores it
    num = data[0].shape[0]
    num_full, remainder = divmod(num, batch_size)

    def values(batch: tuple[Array, ...]) -> Float[Array, " values"]:
        loss, _ = objective.value(model, model_state, batch, key)
        metrics = objective.metric_values(model, model_state, batch)
        return jnp.concatenate([loss[None].astype(jnp.float32), metrics])

    total = jnp.zeros(1 + len(objective.metrics))
    if num_full:
        full = tuple(
            a[: num_full * batch_size].reshape(num_full, batch_size, *a.shape[1:]) for a in data
        )

        def add(total: Float[Array, " values"], batch: tuple[Array, ...]):
            return total + values(batch) * batch_size, None

        total, _ = jax.lax.scan(add, total, full)
    if remainder:
        total = total + values(tuple(a[num_full * batch_size :] for a in data)) * remainder
    return total / num
