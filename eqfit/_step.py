"""The pure training step `(params, opt_state, batch, key) -> (params, opt_state, loss)`,
with its options (precision, the average, norms) and its record written by name: one
loss and one optimizer, or several updates in turn (`fit(..., updates=)`)."""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, Key, PyTree

from ._average import Average
from ._hyperparams import injected_values, schedule_values
from ._labels import either, LabelError
from ._mean import Mean, nonzero
from ._microbatches import in_microbatches, Measured
from ._objective import clone, Objective
from ._optimizer import extra_args
from ._precision import all_finite, LossScale
from ._record import GRAD_NORM, Kind, LOSS_SCALE, Record, SKIPPED_STEPS, UPDATE_NORM
from ._updates import AbstractUpdate


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
    weight: Float[Array, ""] | None = None  # a weighted mean loss's (`eqfit.Mean`) weight


class Rule(eqx.Module):
    """One of several updates (`fit(..., updates=)`), as the step runs it: a loss and an
    optimizer (`eqfit.Update`), or a user's own update (`custom`), on the trained arrays
    it `picks`.
    """

    name: str
    every: int
    picks: tuple[bool, ...]  # for each array that trains, in order: does this update
    objective: Objective | None = None  # a built-in update's loss, and its optimizer
    optimizer: optax.GradientTransformation | None = None
    custom: AbstractUpdate | None = None
    # The record's names of what it reports: its loss and aux values (`d_loss`, `d_acc`),
    # a custom update's values, its injected hyperparameters.
    aux_names: tuple[str, ...] = ()
    hyperparams: tuple[str, ...] = ()
    norms: bool = False  # it records its gradient's and update's norms

    def select(self, params: PyTree) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
        """The arrays it trains, in the parameters' structure (`None` elsewhere), and the
        function that puts such a tree back among the rest of `params`.
        """
        leaves, treedef = jax.tree.flatten(params)
        mine = jax.tree.unflatten(treedef, [p if m else None for p, m in zip(leaves, self.picks)])

        def merge(new: PyTree) -> PyTree:
            it = iter(jax.tree.leaves(new))
            return jax.tree.unflatten(
                treedef, [next(it) if m else p for p, m in zip(leaves, self.picks)]
            )

        return mine, merge


class Descent(NamedTuple):
    """One loss's gradient step (`Step.descend`): the state after it, and what it saw."""

    params: PyTree
    opt_state: PyTree
    model_state: PyTree  # the loss's new state, or the state as it was if not applied
    loss_scale: LossScale | None
    loss: Float[Array, ""]
    aux: Float[Array, " aux"]
    finite: Bool[Array, ""]  # the loss is finite
    applies: Bool[Array, ""]  # the update was applied
    norms: tuple[Float[Array, ""], Float[Array, ""]] | None  # the gradient's, the update's
    labels: LabelError | None
    metrics: Float[Array, " metrics"]  # the objective's, on the model before the step
    # The weights of those values that are weighted means (`eqfit.Mean`), summed over the
    # devices, by the record's names (`<name>:weight`).
    weights: dict[str, Array]


class RuleResult(NamedTuple):
    """What one of several updates gives back (`Step.rule`)."""

    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    loss: Float[Array, ""]  # 0 for an update that reports none
    finite: Bool[Array, ""]
    applies: Bool[Array, ""]
    values: dict[str, Array]  # by the record's names
    labels: LabelError | None


class Step(eqx.Module):
    """One optimisation step on a batch.

    An update whose loss is not finite is not applied: one `lax.cond` per step, as
    `optax.apply_if_finite` does, so the parameters are always the last finite ones and
    every `on_nan` policy runs the same arithmetic. The caller decides whether to stop.
    With a loss scale, an update whose gradient is not finite is skipped too, and the
    scale moves. The options own their logic: the precision policy casts and scales, the
    average updates itself; the step records what they report as named values.

    With `rules` (several updates), each runs in turn on the model the one before it
    left, on its own part of the parameters and its own entry of `opt_state` (a dict by
    name); one that is not due this step records NaN, which the epoch leaves out.
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
    rules: tuple[Rule, ...] = ()  # several updates; `()`: `objective` and `optimizer`
    # The trained arrays of a whole model (with `rules`: what a custom update returns).
    split: Callable[[PyTree], PyTree] | None = None
    # With `microbatches=`: the rows of one microbatch of the batch this step sees, which
    # it computes one microbatch after another (`Step.measure`); `None`: all at once.
    microbatch: int | None = None

    def __call__(
        self,
        params: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        average: PyTree,
        loss_scale: LossScale | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
        step: Int[Array, ""],
    ) -> StepResult:
        if self.axis_name is not None and key is not None:
            # Each device's share of the batch gets its own key.
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))
        if self.rules:
            return self._updates(params, opt_state, model_state, average, batch, key, step)
        record = self.record
        # At the count this step's update uses: the state's before the update.
        scheduled = schedule_values(self.schedules, opt_state)
        d = self.descend(
            self.objective,
            self.optimizer,
            params,
            opt_state,
            model_state,
            loss_scale,
            batch,
            key,
            norms=record.has(GRAD_NORM),
        )
        metrics = d.metrics
        reported = dict(zip(record.names_of(Kind.AUX), d.aux))
        reported |= dict(zip(record.names_of(Kind.METRIC), metrics))
        reported |= d.weights
        if d.norms is not None:
            reported[GRAD_NORM.name], reported[UPDATE_NORM.name] = d.norms
        if loss_scale is not None:
            reported[LOSS_SCALE.name] = loss_scale.scale
            reported[SKIPPED_STEPS.name] = (d.finite & ~d.applies).astype(jnp.float32)
        injected = record.names_of(Kind.HYPERPARAM)
        if injected:  # after the update: `inject_hyperparams` keeps those it used
            reported |= dict(zip(injected, injected_values(d.opt_state)))
        reported |= dict(zip(record.names_of(Kind.SCHEDULE), scheduled))
        average = self._averaged(average, d.params, d.applies)
        return StepResult(
            d.params,
            d.opt_state,
            d.model_state,
            average,
            d.loss_scale,
            d.loss,
            record.pack(reported),
            d.finite,
            d.labels,
            d.weights.get("loss:weight"),
        )

    def descend(
        self,
        objective: Objective,
        optimizer: optax.GradientTransformation,
        params: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        loss_scale: LossScale | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
        norms: bool,
        rule: Rule | None = None,
    ) -> Descent:
        """One gradient step of `optimizer` on `objective`'s loss: of all the trained
        arrays, or of those `rule` picks (the rest held as they are). `objective`'s metrics
        see the model before it, as the loss does; `norms`: the gradient's and the
        update's norms are computed.
        """
        policy = objective.precision
        if rule is None:
            trained, merge = params, lambda p: p
        else:
            trained, merge = rule.select(params)

        # A stateful layer marks the state it was given as used up, so the loss, the
        # metrics and a skipped step each get their own copy.
        kept = clone(model_state)
        weighted = "loss" in objective.means  # a weighted mean (`eqfit.Mean`)
        m = self.measure(objective, trained, merge, model_state, loss_scale, batch, key)
        loss, grads, v = m.loss, m.grads, m.value
        aux, new_state, labels = v.aux, v.state, m.labels
        metrics, metric_weights = m.metrics, m.metric_weights
        if self.axis_name is not None:
            # Data parallel: each device saw an equal share of the batch, so the mean of
            # the per-device means is the mean over the whole batch. A weighted mean's
            # totals and weights are averaged alike, and divided below: a sum over a sum.
            loss, aux, grads, metrics = jax.lax.pmean((loss, aux, grads, metrics), self.axis_name)
            labels = _on_any_device(labels, self.axis_name)
        weights: dict[str, Array] = {}
        finite = jnp.isfinite(loss)
        empty = jnp.asarray(False)  # a weighted mean loss's batch of weight 0
        if objective.means:
            pairs = (v.weight, v.aux_weights, metric_weights)
            if self.axis_name is not None:
                summed = jax.lax.psum(pairs, self.axis_name)
                n = jax.lax.psum(1, self.axis_name)
                aux_w, metric_w = summed[1] / n, summed[2] / n
            else:
                summed, (_, aux_w, metric_w) = pairs, pairs
            aux, metrics = aux / aux_w, metrics / metric_w  # a plain value's weight is 1
            names = ("loss", *objective.aux_names, *objective.metric_names)
            every = jnp.concatenate([summed[0][None], summed[1], summed[2]])
            weights = {f"{n}:weight": w for n, w in zip(names, every) if n in objective.means}
            if weighted:  # a batch of weight 0 records NaN (0 / 0), and trains on 0
                empty = summed[0] == 0

        def grad_fn(p: PyTree, _: Any) -> PyTree:
            """The gradient at `p` on this step's batch, as `grads` is at `params`."""
            state = clone(model_state)
            g = self.measure(objective, p, merge, state, loss_scale, batch, key, False).grads
            return g if self.axis_name is None else jax.lax.pmean(g, self.axis_name)

        # `value=` lets optax transformations that read the loss (reduce_on_plateau) work
        # unchanged, and `grad_fn=` those that take further gradients (SAM's opaque mode);
        # with_extra_args_support makes plain ones ignore them.
        optimizer = optax.with_extra_args_support(optimizer)
        extra = extra_args(optimizer.update, value=loss, grad_fn=grad_fn)
        applies = finite
        grad_norm = optax.tree.norm(grads) if norms else None
        if loss_scale is not None:
            assert policy is not None
            grads_finite = all_finite(grads)
            applies = finite & grads_finite
            new_scale = policy.adjust(loss_scale, grads_finite)
        else:
            new_scale = None

        def apply(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            trained, opt_state, *_ = carry
            updates, opt_state = optimizer.update(grads, opt_state, trained, **extra)
            trained = eqx.apply_updates(trained, updates)
            if self.lay_out is not None:
                trained, opt_state = self.lay_out(trained, opt_state)
            if not norms:
                return trained, opt_state, new_state
            norm = optax.tree.norm(updates).astype(jnp.float32)
            return trained, opt_state, new_state, norm

        def skip(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            return carry  # nothing is applied: with norms, an update of norm 0

        # A `cond`, not a `where` over every leaf, which would compute and select the
        # whole update even for finite losses.
        carry = (trained, opt_state, kept)
        if norms:
            carry += (jnp.zeros((), jnp.float32),)
        trained, opt_state, model_state, *update_norm = jax.lax.cond(applies, apply, skip, carry)
        return Descent(
            params=merge(trained),
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=new_scale,
            loss=jnp.where(empty, jnp.nan, loss) if weighted else loss,
            aux=aux,
            finite=finite,
            applies=applies,
            norms=None if grad_norm is None else (grad_norm, update_norm[0]),
            labels=labels,
            metrics=metrics,
            weights=weights,
        )

    def measure(
        self,
        objective: Objective,
        trained: PyTree,
        merge: Callable[[PyTree], PyTree],
        model_state: PyTree,
        loss_scale: LossScale | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
        metrics: bool = True,
    ) -> Measured:
        """The loss, its gradient with respect to `trained` and its aux values on `batch`,
        and (with `metrics`) the metrics on the model the loss saw, with the state after
        it. With `microbatch`, one microbatch after another, each summed into the whole:
        the same values as in one pass, holding one microbatch's activations.
        """
        policy = objective.precision
        weighted = "loss" in objective.means  # a weighted mean (`eqfit.Mean`)

        def value(
            p: PyTree, state: PyTree, batch: PyTree, key: Key[Array, ""] | None
        ) -> tuple[Float[Array, ""], tuple[Any, ...]]:
            model = self.combine(merge(p))
            v = objective.value(model, state, batch, key)
            loss = v.loss
            if weighted:  # the total over the weight (over every device's weight)
                loss = loss / nonzero(self._device_mean(jax.lax.stop_gradient(v.weight)))
            scaled = loss if policy is None else policy.scale(loss, loss_scale)
            return scaled, (loss, v, model)

        def once(state: PyTree, batch: PyTree, key: Key[Array, ""] | None) -> Measured:
            # One forward pass: the aux values ride out of it with the loss.
            (_, (loss, v, model)), grads = jax.value_and_grad(value, has_aux=True)(
                trained, state, batch, key
            )
            if policy is not None:
                grads = policy.unscale(grads, loss_scale)
            if self.lay_out is not None:
                # The gradients as the parameters are laid out: XLA reduce-scatters them.
                grads, _ = self.lay_out(grads, None)
            if metrics:
                values, weights, metric_labels = objective.metric_values(
                    model, clone(v.state), batch
                )
            else:
                values, weights, metric_labels = jnp.zeros(0), jnp.zeros(0), None
            labels = either(v.labels, metric_labels)
            return Measured(loss, grads, v._replace(labels=None), values, weights, labels)

        rows = jax.tree.leaves(batch)[0].shape[0]
        size = self.microbatch
        if size is None or rows <= size:
            return once(model_state, batch, key)
        return in_microbatches(objective, once, model_state, batch, key, size, self._device_mean)

    def _device_mean(self, x: Array) -> Array:
        """`x`'s mean over the devices (`x` itself on one)."""
        return x if self.axis_name is None else jax.lax.pmean(x, self.axis_name)

    def _averaged(self, average: PyTree, params: PyTree, applies: Bool[Array, ""]) -> PyTree:
        """The moving average after the step. Outside the update's `cond`, which would
        carry a copy of it through both branches: a skipped step leaves it as it is (its
        weights are the last step's).
        """
        if self.average is None:
            return average
        average = self.average.update(average, params, applies)
        if self.lay_out is not None:
            average, _ = self.lay_out(average, None)
        return average

    def _updates(
        self,
        params: PyTree,
        opt_state: dict[str, PyTree],
        model_state: PyTree,
        average: PyTree,
        batch: PyTree,
        key: Key[Array, ""] | None,
        step: Int[Array, ""],
    ) -> StepResult:
        """The step of several updates (`rules`), in turn. Its loss is the sum of the
        losses of the updates that ran; it is finite if each of theirs is.
        """
        record = self.record
        # Metrics see the model before the step's first update.
        metrics, _, labels = self.objective.metric_values(
            self.combine(params), clone(model_state), batch
        )
        if self.axis_name is not None:
            metrics = jax.lax.pmean(metrics, self.axis_name)
            labels = _on_any_device(labels, self.axis_name)
        reported: dict[str, Any] = dict(zip(record.names_of(Kind.METRIC), metrics))
        opt_state = dict(opt_state)
        total = jnp.zeros((), jnp.float32)
        finite = applied = None
        for i, rule in enumerate(self.rules):
            rule_key = None if key is None else jax.random.fold_in(key, i)

            def run(operand: tuple[PyTree, PyTree, PyTree], rule: Rule = rule) -> RuleResult:
                return self.rule(rule, *operand, batch, rule_key)

            operand = (params, opt_state[rule.name], model_state)
            if rule.every == 1:
                out = run(operand)
            else:  # on steps `every`, `2 * every`, ... (counted from 1)
                due = (step + 1) % rule.every == 0
                out = jax.lax.cond(due, run, functools.partial(_not_due, run), operand)
            params, opt_state[rule.name], model_state = out.params, out.opt_state, out.model_state
            total = total + out.loss.astype(jnp.float32)
            finite = out.finite if finite is None else finite & out.finite
            applied = out.applies if applied is None else applied | out.applies
            reported |= out.values
            labels = either(labels, out.labels)
        assert finite is not None and applied is not None
        return StepResult(
            params,
            opt_state,
            model_state,
            self._averaged(average, params, applied),
            None,
            total,
            record.pack(reported),
            finite,
            labels,
        )

    def rule(
        self,
        rule: Rule,
        params: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        batch: PyTree,
        key: Key[Array, ""] | None,
    ) -> RuleResult:
        """One of several updates: a loss's gradient step (`descend`), or a user's own."""
        if rule.custom is None:
            assert rule.objective is not None and rule.optimizer is not None
            d = self.descend(
                rule.objective,
                rule.optimizer,
                params,
                opt_state,
                model_state,
                None,
                batch,
                key,
                norms=rule.norms,
                rule=rule,
            )
            values = dict(zip(rule.aux_names, jnp.concatenate([d.loss[None], d.aux])))
            # A weighted mean's weight, by the record's name (`d_loss:weight`).
            values |= {f"{rule.name}_{n}": w for n, w in d.weights.items()}
            if d.norms is not None:
                values[f"{rule.name}_grad_norm"], values[f"{rule.name}_update_norm"] = d.norms
            values |= dict(zip(rule.hyperparams, injected_values(d.opt_state)))
            return RuleResult(
                d.params, d.opt_state, d.model_state, d.loss, d.finite, d.applies, values, d.labels
            )
        assert self.split is not None and key is not None
        out = rule.custom.apply(
            self.combine(params), opt_state, batch, model_state=clone(model_state), key=key
        )
        given = {f"{rule.name}_{name}": value for name, value in out.values.items()}
        for name, value in out.values.items():
            if isinstance(value, Mean):
                raise TypeError(
                    f"Update {rule.name!r} recorded an `eqfit.Mean` for {name!r}: an update "
                    "of your own records plain values (a `Mean`'s `.value`), which the "
                    "epoch weighs by the batch's size."
                )
        if set(given) != set(rule.aux_names):
            raise ValueError(
                f"Update {rule.name!r} recorded {sorted(out.values)}, but before the run it "
                f"recorded {sorted(n[len(rule.name) + 1 :] for n in rule.aux_names)}: an "
                "update must record the same names every step."
            )
        values = {name: jnp.mean(jnp.asarray(v)).astype(jnp.float32) for name, v in given.items()}
        loss = values.get(f"{rule.name}_loss", jnp.zeros((), jnp.float32))
        mine, _ = rule.select(self.split(out.model))
        _, merge = rule.select(params)
        finite = jnp.isfinite(loss)
        return RuleResult(
            merge(mine), out.state, out.model_state, loss, finite, finite, values, None
        )


def _not_due(
    run: Callable[[Any], RuleResult], operand: tuple[PyTree, PyTree, PyTree]
) -> RuleResult:
    """An update not due this step: everything as it was, its values NaN (which the
    epoch's means leave out), its loss 0.
    """
    shapes = jax.eval_shape(run, operand)
    params, opt_state, model_state = operand
    return RuleResult(
        params,
        opt_state,
        clone(model_state),
        jnp.zeros(shapes.loss.shape, shapes.loss.dtype),
        jnp.asarray(True),
        jnp.asarray(False),
        {name: jnp.full(v.shape, jnp.nan, v.dtype) for name, v in shapes.values.items()},
        None if shapes.labels is None else LabelError.none(),
    )


def _on_any_device(labels: LabelError | None, axis_name: str) -> LabelError | None:
    """The first bad label on any device's share of the batch: the batch's."""
    if labels is None:
        return None
    every = jax.lax.all_gather(labels, axis_name)
    first = jnp.argmax(every.found)
    return jax.tree.map(lambda x: x[first], every)
