"""One loss's gradient step, as `fit`'s step and a hand loop's `eqfit.Update.apply` both
run it (`UpdateContext.descend`): the forward and backward pass (in one, or summed over
microbatches), the `eqfit.Mean` zero guard, the precision policy's scaling, the optax
update with its extra arguments (`value`, `grad_fn`), the norms, and the `lax.cond` that
leaves a non-finite update unapplied.

`fit`'s options that act inside an update reach it as an `UpdateContext`; its defaults
are a hand loop's (one device, no microbatches, no norms, no layout).
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Key, PyTree

from .._core._metric import MetricLike
from ._hyperparams import injected_names, injected_values
from ._labels import either, LabelError
from ._mean import divisor
from ._microbatches import ForwardBackward, in_microbatches
from ._objective import clone, Objective
from ._optimizer import extra_args
from ._precision import all_finite, LossScale, Precision
from ._record import GRAD_NORM, LOSS, UPDATE_NORM
from ._remat import checkpointed, Remat


def _whole(params: PyTree) -> PyTree:
    return params


class Descent(NamedTuple):
    """One loss's gradient step (`UpdateContext.descend`): the state after it, and what
    it saw.
    """

    params: PyTree  # the trained arrays after it
    opt_state: PyTree
    model_state: PyTree  # the loss's new state, or the state as it was if not applied
    loss_scale: LossScale | None
    loss: Float[Array, ""]  # NaN for a weighted mean's batch of weight 0
    aux: Float[Array, " aux"]  # in the objective's `aux_names`' order
    finite: Bool[Array, ""]  # the loss is finite
    applies: Bool[Array, ""]  # the update was applied
    norms: tuple[Float[Array, ""], Float[Array, ""]] | None  # the gradient's, the update's
    labels: LabelError | None
    metrics: Float[Array, " metrics"]  # the objective's, on the model before the step
    # The weights of those values that are weighted means (`eqfit.Mean`), summed over the
    # devices, by the values' names (`"loss"`, an aux value's).
    weights: dict[str, Array]
    # The batch's statistics of each metric that accumulates, summed over the devices.
    statistics: tuple[PyTree, ...] = ()

    def values(self, objective: Objective) -> dict[str, Array]:
        """What the step records of it, by the update's own names: its loss, its aux
        values and its norms (where computed).
        """
        values = {LOSS.name: self.loss, **dict(zip(objective.aux_names, self.aux))}
        if self.norms is not None:
            values[GRAD_NORM.name], values[UPDATE_NORM.name] = self.norms
        return values


def hyperparams(opt_state: PyTree) -> dict[str, Array]:
    """The hyperparameters that `inject_hyperparams` states in `opt_state` hold, by the
    names the run records them under.
    """
    return dict(zip(injected_names(opt_state), injected_values(opt_state)))


class UpdateContext(eqx.Module):
    """`fit`'s options that act inside an update, with a hand loop's defaults.

    `combine` makes the whole model from the arrays the update trains; `axis_name` is
    set under `pmap` (losses and gradients are averaged over it); `lay_out` lays out a
    params-shaped tree, and the optimizer state following it, as `shard=` asks;
    `microbatch`: the rows of one microbatch (`microbatches=`), computed one after
    another; `norms`: the gradient's and the update's norms are computed; `precision`:
    the policy an update's loss runs under; `split` takes the arrays the update trains
    out of a whole model (`combine`'s inverse), for an update of the user's own, whose
    `apply` gives a whole model; `loss_scale`: the update's loss scale (float16's), which
    an `eqfit.Update`'s turn descends with; `metrics`: those it computes in its forward
    pass, on the model before it; `remat`: the policy its loss's forward pass is
    checkpointed by (`remat=`), and `recompute`: false where the step is traced only to
    count its FLOPs, so that no policy applies (`_remat.chosen`).
    """

    combine: Callable[[PyTree], PyTree] = _whole
    axis_name: str | None = None
    lay_out: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]] | None = None
    microbatch: int | None = None
    norms: bool = False
    precision: Precision | None = None
    split: Callable[[PyTree], PyTree] | None = None
    loss_scale: LossScale | None = None
    # The run's metrics, for an update's forward pass to compute (`Turn.metrics`), and
    # those of them that are weighted means.
    metrics: tuple[tuple[str, MetricLike], ...] = ()
    metric_means: tuple[str, ...] = ()
    # `False`: a non-finite update is applied too, with no `cond` around it (`fit`'s
    # `on_nan="raise"` and `"stop"`, which stop there and replay the last finite state).
    guard: bool = True
    # The guard as a `where` over the state's leaves, not a `cond` (`Step.guard_where`).
    guard_where: bool = False
    # In an ensemble's `vmap`, where the guard's `cond` is a select of both its branches:
    # the same select, made so that XLA updates the optimizer state in place (`_selected`).
    guard_in_place: bool = False
    remat: Remat | None = None
    recompute: bool = True

    def descend(
        self,
        objective: Objective,
        optimizer: optax.GradientTransformation,
        trained: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        loss_scale: LossScale | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
    ) -> Descent:
        """One gradient step of `optimizer` on `objective`'s loss with respect to
        `trained` (the rest of the model held as it is by `combine`). `objective`'s
        metrics see the model before it, as the loss does.
        """
        policy = objective.precision
        norms = self.norms
        # A stateful layer marks the state it was given as used up, so the loss, the
        # metrics and a skipped step each get their own copy.
        kept = clone(model_state)
        weighted = LOSS.name in objective.means  # a weighted mean (`eqfit.Mean`)
        m = self.measure(objective, trained, model_state, loss_scale, batch, key)
        loss, grads, v = m.loss, m.grads, m.value
        aux, new_state, labels, metrics = v.aux, v.state, m.labels, m.metrics
        if self.axis_name is not None:
            # Data parallel: each device saw an equal share of the batch, so the mean of
            # the per-device means is the mean over the whole batch. A weighted mean's
            # totals and weights are averaged alike, and divided below: a sum over a sum.
            loss, aux, grads, metrics = jax.lax.pmean((loss, aux, grads, metrics), self.axis_name)
            labels = on_any_device(labels, self.axis_name)
        statistics = m.statistics
        if self.axis_name is not None and statistics:
            # Counts add across devices: summed, not averaged as the values are.
            statistics = jax.lax.psum(statistics, self.axis_name)
        finite = jnp.isfinite(loss)
        aux, metrics, weights, empty = self._weighed(objective, m, aux, metrics)

        def grad_fn(p: PyTree, _: Any) -> PyTree:
            """The gradient at `p` on this step's batch, as `grads` is at `trained`."""
            state = clone(model_state)
            g = self.measure(objective, p, state, loss_scale, batch, key, False).grads
            return g if self.axis_name is None else jax.lax.pmean(g, self.axis_name)

        # `value=` lets optax transformations that read the loss (reduce_on_plateau) work
        # unchanged, and `grad_fn=` those that take further gradients (SAM's opaque mode);
        # with_extra_args_support makes plain ones ignore them.
        optimizer = optax.with_extra_args_support(optimizer)
        extra = extra_args(optimizer.update, value=loss, grad_fn=grad_fn)
        grad_norm = optax.tree.norm(grads) if norms else None
        if grad_norm is not None and loss_scale is None:
            # With norms, whose gradient norm costs nothing more, a gradient that is not
            # finite counts as a loss that is not: its update would make the model so.
            # (Under loss scaling, the scale's own check skips it instead.)
            finite = finite & jnp.isfinite(grad_norm)
        applies = finite
        if loss_scale is not None:
            assert policy is not None
            grads_finite = all_finite(grads)
            applies = finite & grads_finite
            new_scale = policy.adjust(loss_scale, grads_finite)
        else:
            new_scale = None
        carry = (trained, opt_state, kept)
        out = self._apply(optimizer, carry, grads, extra, new_state, applies, loss_scale)
        trained, opt_state, model_state, *update_norm = out
        return Descent(
            params=trained,
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
            statistics=statistics,
        )

    def _weighed(
        self, objective: Objective, m: ForwardBackward, aux: Array, metrics: Array
    ) -> tuple[Array, Array, dict[str, Array], Array]:
        """`aux` and `metrics` (averaged over the devices) with the weighted means'
        (`eqfit.Mean`) totals divided by their weights, summed over the devices; those
        weights by the values' names; and whether a weighted mean loss's batch weighs 0.
        """
        v, metric_weights = m.value, m.metric_weights
        weighted = LOSS.name in objective.means  # a weighted mean (`eqfit.Mean`)
        weights: dict[str, Array] = {}
        empty = jnp.asarray(False)  # a weighted mean loss's batch of weight 0
        if not objective.means:
            return aux, metrics, weights, empty
        pairs = (v.weight, v.aux_weights, metric_weights)
        if self.axis_name is not None:
            summed = jax.lax.psum(pairs, self.axis_name)
            n = jax.lax.psum(1, self.axis_name)
            aux_w, metric_w = summed[1] / n, summed[2] / n
        else:
            summed, (_, aux_w, metric_w) = pairs, pairs
        aux, metrics = aux / aux_w, metrics / metric_w  # a plain value's weight is 1
        names = objective.value_names
        every = jnp.concatenate([summed[0][None], summed[1], summed[2]])
        weights = {n: w for n, w in zip(names, every) if n in objective.means}
        if weighted:  # a batch of weight 0 records NaN (0 / 0), and trains on 0
            empty = summed[0] == 0
        return aux, metrics, weights, empty

    def _apply(
        self,
        optimizer: optax.GradientTransformationExtraArgs,
        carry: tuple[Any, ...],
        grads: PyTree,
        extra: dict[str, Any],
        new_state: PyTree,
        applies: Bool[Array, ""],
        loss_scale: LossScale | None,
    ) -> tuple[Any, ...]:
        """The update applied to `carry` (the trained arrays, the optimizer state, the
        model state) where `applies`, under a `cond`; or without a guard, whatever the
        loss. With norms, the update's norm after them (0 where not applied).
        """
        norms = self.norms

        def apply(
            carry: tuple[Any, ...], grads: PyTree, extra: dict[str, Any], new_state: PyTree
        ) -> tuple[Any, ...]:
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

        if norms:
            carry += (jnp.zeros((), jnp.float32),)
        guarded = self.guard or loss_scale is not None
        if guarded and self.guard_in_place and not self.guard_where:
            return self._selected(optimizer, carry, grads, extra, new_state, applies)
        if guarded and not self.guard_where:
            # A `cond`, not a `where` over every leaf, which would compute and select the
            # whole update even for finite losses.
            applied = lambda carry: apply(carry, grads, extra, new_state)  # noqa: E731
            return jax.lax.cond(applies, applied, skip, carry)
        # Between barriers, which keep XLA from fusing the update with what surrounds it,
        # as the `cond`'s branch did: the same arithmetic, so the same bits as a guarded
        # run's.
        arrays, static = eqx.partition((carry, grads, extra, new_state), eqx.is_array)
        out = apply(*eqx.combine(jax.lax.optimization_barrier(arrays), static))
        out = jax.lax.optimization_barrier(out)
        if guarded:  # applied where `applies`, else the state as it was
            keep = lambda n, o: jnp.where(applies, n, o) if eqx.is_array(n) else n  # noqa: E731
            return jax.tree.map(keep, out, skip(carry))
        # Else applied whatever the loss (the run stops after a non-finite step, and its
        # last finite state is replayed).
        if norms:  # recorded as the guard's skipped update records it: 0
            out = (*out[:-1], jnp.where(applies, out[-1], 0.0))
        return out

    def _selected(
        self,
        optimizer: optax.GradientTransformationExtraArgs,
        carry: tuple[Any, ...],
        grads: PyTree,
        extra: dict[str, Any],
        new_state: PyTree,
        applies: Bool[Array, ""],
    ) -> tuple[Any, ...]:
        """`_apply`'s guard where the members' `vmap` makes its `cond` a select of both
        branches (`_select`): the same values, computed in an order that lets XLA update
        the optimizer state in place.

        Selected as the `cond`'s outputs, each parameter's new value (whose kernel
        computes Adam's moments again) reads the state as it was, and the state's select
        overwrites it in place; the two kernels unordered, XLA copies each array of the
        state every step. Here the new state is computed again from the gradients, each
        read after its parameter's new value (`_read_after`): each moment's kernel comes
        after its parameter's, and XLA computes the moments twice, as it did.
        """
        assert self.lay_out is None  # an ensemble takes no `shard=`
        trained, opt_state, kept = carry[:3]
        updates, state = optimizer.update(grads, opt_state, trained, **extra)
        keep = functools.partial(_select, applies)
        selected = jax.tree.map(keep, eqx.apply_updates(trained, updates), trained)
        state = _state_after(optimizer, selected, grads, opt_state, state, trained, extra)
        out = (selected, jax.tree.map(keep, state, opt_state), jax.tree.map(keep, new_state, kept))
        if not self.norms:
            return out
        norm = optax.tree.norm(updates).astype(jnp.float32)
        return (*out, keep(norm, jnp.zeros((), jnp.float32)))  # as skipped: 0

    def measure(
        self,
        objective: Objective,
        trained: PyTree,
        model_state: PyTree,
        loss_scale: LossScale | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
        metrics: bool = True,
    ) -> ForwardBackward:
        """The loss, its gradient with respect to `trained` and its aux values on `batch`,
        and (with `metrics`) the metrics on the model the loss saw, with the state after
        it. With `microbatch`, one microbatch after another, each summed into the whole:
        the same values as in one pass, holding one microbatch's activations. With
        `remat`, each forward pass (each microbatch's) is checkpointed by its policy.
        """
        policy = objective.precision
        weighted = LOSS.name in objective.means  # a weighted mean (`eqfit.Mean`)

        def value(
            p: PyTree, state: PyTree, batch: PyTree, key: Key[Array, ""] | None
        ) -> tuple[Float[Array, ""], tuple[Any, ...]]:
            model = self.combine(p)
            v = objective.value(model, state, batch, key)
            loss = v.loss
            if weighted:  # the total over the weight (over every device's weight)
                loss = loss / divisor(self.device_mean(jax.lax.stop_gradient(v.weight)))
            scaled = loss if policy is None else policy.scale(loss, loss_scale)
            return scaled, (loss, v, model)

        value = checkpointed(value, self.remat)

        def once(state: PyTree, batch: PyTree, key: Key[Array, ""] | None) -> ForwardBackward:
            # One forward pass: the aux values ride out of it with the loss.
            (_, (loss, v, model)), grads = jax.value_and_grad(value, has_aux=True)(
                trained, state, batch, key
            )
            if policy is not None:
                grads = policy.unscale(grads, loss_scale)
            if self.lay_out is not None:
                # The gradients as the parameters are laid out: XLA reduce-scatters them.
                grads, _ = self.lay_out(grads, None)
            statistics: tuple[PyTree, ...] = ()
            if metrics:
                values, weights, metric_labels = objective.metric_values(
                    model, clone(v.state), batch
                )
                statistics, counted = objective.statistics(model, clone(v.state), batch)
                metric_labels = either(metric_labels, counted)
            else:
                values, weights, metric_labels = jnp.zeros(0), jnp.zeros(0), None
            labels = either(v.labels, metric_labels)
            return ForwardBackward(
                loss, grads, v._replace(labels=None), values, weights, labels, statistics
            )

        rows = jax.tree.leaves(batch)[0].shape[0]
        size = self.microbatch
        if size is None or rows <= size:
            return once(model_state, batch, key)
        return in_microbatches(objective, once, model_state, batch, key, size, self.device_mean)

    def device_mean(self, x: Array) -> Array:
        """`x`'s mean over the devices (`x` itself on one)."""
        return x if self.axis_name is None else jax.lax.pmean(x, self.axis_name)


def _select(applies: Bool[Array, ""], new: Any, old: Any) -> Any:
    """`new` where `applies`, else `old`: the select the members' `vmap` makes of a `cond`
    on `applies`, operand for operand (`select_n` on its index), so that XLA compiles the
    arithmetic around it as it did: on the CPU, the operands' order decides which product
    an FMA takes in, the result's last bit.
    """
    if not eqx.is_array(new):
        return new
    index = jnp.broadcast_to(applies.astype(jnp.int32), jnp.shape(old))
    return jax.lax.select_n(index, old, new)


def _read_after(x: Any, p: Any) -> Any:
    """`x` itself, read after `p`: times one, computed from `p` (its first element is NaN
    or is not), which XLA keeps and which orders the kernels that read `x` so after `p`'s.
    (LLVM folds it away inside the kernel.) Only floating-point arrays, where `x * 1`
    is `x` exactly.
    """
    if not (eqx.is_array(x) and eqx.is_array(p) and jnp.issubdtype(x.dtype, jnp.floating)):
        return x
    if p.size == 0:
        return x
    nan = jnp.isnan(jnp.ravel(p)[0])
    return x * (nan | ~nan).astype(x.dtype)


def _state_after(
    optimizer: optax.GradientTransformationExtraArgs,
    selected: PyTree,
    grads: PyTree,
    opt_state: PyTree,
    state: PyTree,
    trained: PyTree,
    extra: dict[str, Any],
) -> PyTree:
    """`state` (`optimizer`'s new state from `grads` and `opt_state`) computed again, from
    the gradients each read after its parameter's new value in `selected` (`_read_after`):
    the same values. `state` itself where that computation calls `grad_fn` (SAM's opaque
    mode), which would compute the loss's gradient a second time.
    """
    calls = []

    def grad_fn(*args: Any) -> Any:
        calls.append(args)
        return extra["grad_fn"](*args)

    again = extra | {"grad_fn": grad_fn} if "grad_fn" in extra else extra
    later = jax.tree.map(_read_after, grads, selected)
    _, recomputed = optimizer.update(later, opt_state, trained, **again)
    return state if calls else recomputed


def on_any_device(labels: LabelError | None, axis_name: str) -> LabelError | None:
    """The first bad label on any device's share of the batch: the batch's."""
    if labels is None:
        return None
    every = jax.lax.all_gather(labels, axis_name)
    first = jnp.argmax(every.found)
    return jax.tree.map(lambda x: x[first], every)
