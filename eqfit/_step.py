"""The pure training step `(params, opt_state, batch, key) -> (params, opt_state, loss)`,
with its options (precision, the average, norms) and its record written by name."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Key, PyTree

from ._average import Average
from ._hyperparams import injected_values, schedule_values
from ._labels import either, LabelError
from ._objective import clone, Objective
from ._optimizer import extra_args
from ._precision import all_finite, LossScale
from ._record import GRAD_NORM, Kind, LOSS_SCALE, Record, SKIPPED_STEPS, UPDATE_NORM


class StepResult(NamedTuple):
    """What a step gives back: the new training state's parts, and its report."""

    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    average: PyTree  # the moving average (`None` without one)
    loss_scale: LossScale | None
    loss: Float[Array, ""]
    values: Float[Array, " values"]  # the record's columns (`Record.pack`)
    finite: Bool[Array, ""]  # the loss is finite
    labels: LabelError | None  # the first label out of range; `None`: nothing checked


class Step(eqx.Module):
    """One optimisation step on a batch.

    An update whose loss is not finite is not applied: one `lax.cond` per step, as
    `optax.apply_if_finite` does, so the parameters are always the last finite ones and
    every `on_nan` policy runs the same arithmetic. The caller decides whether to stop.
    With a loss scale, an update whose gradient is not finite is skipped too, and the
    scale moves. The options own their logic: the precision policy casts and scales, the
    average updates itself; the step records what they report as named values.
    """

    objective: Objective
    optimizer: optax.GradientTransformation
    combine: Callable[[PyTree], PyTree]  # the trained arrays -> the whole model
    record: Record  # what the step records, written by name
    axis_name: str | None = None  # set under `pmap`: losses and gradients are averaged
    # With `shard=`: lays out a params-shaped tree (the gradients, the new parameters) as
    # the parameters are, and the optimizer state as it follows them.
    lay_out: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]] | None = None
    average: Average | None = None
    schedules: tuple[Callable[[Any], Any], ...] = ()  # each evaluated at the step's count

    def __call__(
        self,
        params: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        average: PyTree,
        loss_scale: LossScale | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
    ) -> StepResult:
        if self.axis_name is not None and key is not None:
            # Each device's share of the batch gets its own key.
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))
        policy = self.objective.precision

        # A stateful layer marks the state it was given as used up, so the loss, the
        # metrics and a skipped step each get their own copy.
        kept = clone(model_state)

        def value(
            p: PyTree, state: PyTree = model_state
        ) -> tuple[Float[Array, ""], tuple[Any, ...]]:
            model = self.combine(p)
            loss, aux, new_state, labels = self.objective.value(model, state, batch, key)
            scaled = loss if policy is None else policy.scale(loss, loss_scale)
            return scaled, (loss, aux, model, new_state, labels)

        # One forward pass: the aux values ride out of it with the loss.
        (_, (loss, aux, model, new_state, labels)), grads = jax.value_and_grad(value, has_aux=True)(
            params
        )
        if policy is not None:
            grads = policy.unscale(grads, loss_scale)
        # Metrics see the model before this step's update, as the loss does.
        metrics, metric_labels = self.objective.metric_values(model, clone(new_state), batch)
        labels = either(labels, metric_labels)
        if self.axis_name is not None:
            # Data parallel: each device saw an equal share of the batch, so the mean of
            # the per-device means is the mean over the whole batch.
            loss, aux, grads, metrics = jax.lax.pmean((loss, aux, grads, metrics), self.axis_name)
            if labels is not None:  # a bad label on any device's share is the batch's
                every = jax.lax.all_gather(labels, self.axis_name)
                first = jnp.argmax(every.found)
                labels = jax.tree.map(lambda x: x[first], every)
        if self.lay_out is not None:
            # The gradients as the parameters are laid out: XLA reduce-scatters them.
            grads, _ = self.lay_out(grads, None)

        def grad_fn(p: PyTree, _: Any) -> PyTree:
            """The gradient at `p` on this step's batch, as `grads` is at `params`."""
            g = jax.grad(lambda q: value(q, clone(model_state))[0])(p)
            if policy is not None:
                g = policy.unscale(g, loss_scale)
            if self.axis_name is not None:
                g = jax.lax.pmean(g, self.axis_name)
            return g if self.lay_out is None else self.lay_out(g, None)[0]

        # `value=` lets optax transformations that read the loss (reduce_on_plateau) work
        # unchanged, and `grad_fn=` those that take further gradients (SAM's opaque mode);
        # with_extra_args_support makes plain ones ignore them.
        optimizer = optax.with_extra_args_support(self.optimizer)
        extra = extra_args(optimizer.update, value=loss, grad_fn=grad_fn)
        finite = jnp.isfinite(loss)
        applies = finite
        record = self.record
        norms = record.has(GRAD_NORM)
        reported = dict(zip(record.names_of(Kind.AUX), aux))
        reported |= dict(zip(record.names_of(Kind.METRIC), metrics))
        # At the count this step's update uses: the state's before the update.
        scheduled = schedule_values(self.schedules, opt_state)
        if norms:
            reported[GRAD_NORM.name] = optax.tree.norm(grads)
        if loss_scale is not None:
            assert policy is not None
            grads_finite = all_finite(grads)
            applies = finite & grads_finite
            new_scale = policy.adjust(loss_scale, grads_finite)
        else:
            new_scale = None

        def apply(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            params, opt_state, *_ = carry
            updates, opt_state = optimizer.update(grads, opt_state, params, **extra)
            params = eqx.apply_updates(params, updates)
            if self.lay_out is not None:
                params, opt_state = self.lay_out(params, opt_state)
            if not norms:
                return params, opt_state, new_state
            norm = optax.tree.norm(updates).astype(jnp.float32)
            return params, opt_state, new_state, norm

        def skip(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            return carry  # nothing is applied: with norms, an update of norm 0

        # A `cond`, not a `where` over every leaf, which would compute and select the
        # whole update even for finite losses.
        carry = (params, opt_state, kept)
        if norms:
            carry += (jnp.zeros((), jnp.float32),)
        params, opt_state, model_state, *update_norm = jax.lax.cond(applies, apply, skip, carry)
        if self.average is not None:
            # Outside the `cond`, which would carry a copy of it through both branches: a
            # skipped step leaves it as it is (its weights are the last step's).
            average = self.average.update(average, params, applies)
            if self.lay_out is not None:
                average, _ = self.lay_out(average, None)
        if norms:
            reported[UPDATE_NORM.name] = update_norm[0]
        if loss_scale is not None:
            reported[LOSS_SCALE.name] = loss_scale.scale
            reported[SKIPPED_STEPS.name] = (finite & ~applies).astype(jnp.float32)
        injected = record.names_of(Kind.HYPERPARAM)
        if injected:  # after the update: `inject_hyperparams` keeps those it used
            reported |= dict(zip(injected, injected_values(opt_state)))
        reported |= dict(zip(record.names_of(Kind.SCHEDULE), scheduled))
        return StepResult(
            params,
            opt_state,
            model_state,
            average,
            new_scale,
            loss,
            record.pack(reported),
            finite,
            labels,
        )
