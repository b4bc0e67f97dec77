"""Gradient accumulation (`fit(..., microbatches=k)`): a step's forward and backward pass
computed one microbatch after another and summed as the whole batch's, so that the step
is the whole batch's and holds one microbatch's activations.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Key, PyTree

from ._labels import either, LabelError
from ._mean import divisor
from ._objective import clone, Objective, Value
from ._statistics import add as add_statistics


class ForwardBackward(NamedTuple):
    """A loss's forward and backward pass on a batch (`Step.measure`), or several summed
    as one (`microbatches=`).
    """

    loss: Float[Array, ""]  # what the step differentiates, unscaled (a `Mean`'s quotient)
    grads: PyTree  # its gradient, unscaled
    value: Value  # the loss's pairs, and the model state after the batch
    metrics: Float[Array, " metrics"]  # the metrics' pairs (empty where not measured)
    metric_weights: Float[Array, " metrics"]
    labels: LabelError | None  # the first label out of range the loss or metrics met
    # The batch's statistics of each metric that accumulates (`Objective.statistics`).
    statistics: tuple[PyTree, ...] = ()


def in_microbatches(
    objective: Objective,
    once: Callable[[PyTree, PyTree, Key[Array, ""] | None], ForwardBackward],
    model_state: PyTree,
    batch: PyTree,
    key: Key[Array, ""] | None,
    size: int,
    device_mean: Callable[[Array], Array],
) -> ForwardBackward:
    """`once` (one pass of the step's loss) over microbatches of `size` rows, in turn (a
    `lax.scan`, then a smaller last one), the model state carried from each to the next,
    summed as one batch's: each value weighs as its rows, or a `Mean` as its weight.
    Microbatch `j` takes rows `j, j + n, j + 2n, ...` of the first `n * size`: spread
    over the devices as the batch is, so that no device sends another its rows.
    `device_mean`: a value's mean over the devices, the divisor of a `Mean` loss's
    quotient.
    """
    rows = jax.tree.leaves(batch)[0].shape[0]
    n, tail = divmod(rows, size)
    sums = _Sums.of(objective, device_mean)

    def micro_key(j: Any) -> Key[Array, ""] | None:
        return None if key is None else jax.random.fold_in(key, j)

    # Rows `j, j + n, ...` are microbatch `j`: sliced from the batch as it is, in
    # the loop, not copied out into a stack of microbatches before it.
    stacked = jax.tree.map(lambda x: x[: n * size].reshape(size, n, *x.shape[1:]), batch)

    def microbatch(j: Any) -> PyTree:
        return jax.tree.map(
            lambda x: jax.lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False), stacked
        )

    shapes = jax.eval_shape(once, model_state, microbatch(0), micro_key(0))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    labels = None if shapes.labels is None else LabelError.none()
    init = zeros._replace(value=zeros.value._replace(state=model_state), labels=labels)

    def body(carry: tuple[ForwardBackward, Array], j: Array) -> tuple[Any, None]:
        total, count = carry
        part = once(clone(total.value.state), microbatch(j), micro_key(j))
        return sums.add(total, part, count, size), None

    carry = (init, jnp.zeros((), jnp.float32))
    (total, count), _ = jax.lax.scan(body, carry, jnp.arange(n))
    if tail:
        last = jax.tree.map(lambda x: x[n * size :], batch)
        part = once(clone(total.value.state), last, micro_key(n))
        total, count = sums.add(total, part, count, tail)
    return sums.whole(total, count)


class _Sums(NamedTuple):
    """How microbatches' passes add up as one batch's: each value weighs as its rows, a
    `Mean` (`weighted` for the loss; `aux_means` and `metric_means` say which of the aux
    values and metrics are) as its weight.
    """

    weighted: bool
    aux_means: Bool[Array, " aux"]
    metric_means: Bool[Array, " metrics"]
    device_mean: Callable[[Array], Array]

    @classmethod
    def of(cls, objective: Objective, device_mean: Callable[[Array], Array]) -> "_Sums":
        """`objective`'s, with `device_mean`, a value's mean over the devices."""
        weighted = "loss" in objective.means
        aux_means = jnp.asarray([a in objective.means for a in objective.aux_names], bool)
        metric_means = jnp.asarray([a in objective.means for a in objective.metric_names], bool)
        return cls(weighted, aux_means, metric_means, device_mean)

    def add(
        self, total: ForwardBackward, part: ForwardBackward, count: Array, rows: int
    ) -> tuple[ForwardBackward, Array]:
        """`total` (sums) and `count` (the loss's weights) with `part` added."""
        aux_means, metric_means = self.aux_means, self.metric_means
        v, t = part.value, total.value
        # The loss's weight among the microbatches: a `Mean`'s, over every device
        # (the divisor `part.loss` was taken over), or its rows.
        weight = self.device_mean(v.weight) if self.weighted else jnp.asarray(rows, jnp.float32)
        aux = jnp.where(aux_means, v.aux, rows * v.aux)
        aux_weights = jnp.where(aux_means, v.aux_weights, rows)
        metrics = jnp.where(metric_means, part.metrics, rows * part.metrics)
        metric_weights = jnp.where(metric_means, part.metric_weights, rows)
        summed = ForwardBackward(
            total.loss + weight * part.loss,
            jax.tree.map(lambda a, b: (a + weight * b).astype(a.dtype), total.grads, part.grads),
            Value(
                t.loss,
                t.weight + v.weight,
                t.aux + aux,
                t.aux_weights + aux_weights,
                v.state,
                None,
            ),
            total.metrics + metrics,
            total.metric_weights + metric_weights,
            either(total.labels, part.labels),
            add_statistics(total.statistics, part.statistics),
        )
        return summed, count + weight

    def whole(self, total: ForwardBackward, count: Array) -> ForwardBackward:
        """The sums of every microbatch (`total`, the loss's weights summing to `count`)
        as one batch's pass: a plain value's mean over the rows, weight 1; a `Mean`'s
        sums stay sums.
        """
        aux_means, metric_means = self.aux_means, self.metric_means
        v = total.value
        aux = jnp.where(aux_means, v.aux, v.aux / v.aux_weights)
        aux_weights = jnp.where(aux_means, v.aux_weights, 1.0)
        metrics = jnp.where(metric_means, total.metrics, total.metrics / total.metric_weights)
        metric_weights = jnp.where(metric_means, total.metric_weights, 1.0)
        # A `Mean` whose weights over the microbatches sum to 0 trains on 0 (`divisor`).
        by = divisor(count)
        loss = total.loss / by
        weight = v.weight if self.weighted else jnp.ones((), jnp.float32)
        return ForwardBackward(
            loss,
            jax.tree.map(lambda g: g / by, total.grads),
            Value(loss, weight, aux, aux_weights, v.state, None),
            metrics,
            metric_weights,
            total.labels,
            total.statistics,
        )
