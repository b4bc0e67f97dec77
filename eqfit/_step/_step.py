"""The pure training step `Step(params, opt_state, model_state, average, loss_scale, batch,
key, step) -> StepResult`: its updates in turn (`fit(..., updates=)`; `fit`'s `loss=` and
`optimizer=` are one, unnamed), each taking its turn (`Step._turn`) under the step's
options (precision, the loss scale, the layout, norms, schedules), the average after
them, and the record written by name.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key, PyTree

from .._core._metric import MetricLike
from ._average import Average
from ._descent import on_any_device, UpdateContext
from ._hyperparams import injected_values, schedule_values
from ._labels import either, LabelError
from ._objective import clone, Objective
from ._precision import LossScale
from ._record import (
    GRAD_NORM,
    Kind,
    LOSS,
    LOSS_SCALE,
    Record,
    SKIPPED_STEPS,
    UpdateInfo,
    weight_name,
)
from ._remat import Remat
from ._updates import AbstractUpdate, Turn


class StepResult(NamedTuple):
    """What a step gives back: the new training state's parts, and its report."""

    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    average: PyTree  # the moving average (`None` without one)
    # float16's loss scale; with several updates, each loss's update's, by name
    loss_scale: LossScale | dict[str, LossScale] | None
    loss: Float[Array, ""]
    values: Float[Array, " values"]  # the record's columns (`Record.pack`)
    finite: Bool[Array, ""]  # the loss is finite
    labels: LabelError | None  # the first label out of range; `None`: nothing checked
    weight: Float[Array, ""] | None = None  # a weighted mean loss's (`eqfit.Mean`) weight
    # The batch's statistics of each metric that accumulates (`Objective.statistics`),
    # summed over the devices; `None` without such metrics.
    statistics: tuple[PyTree, ...] | None = None


def select(params: PyTree, picks: tuple[bool, ...]) -> tuple[PyTree, Callable[[PyTree], PyTree]]:
    """The arrays of `params` that `picks` picks (one bool for each, in order), in the
    parameters' structure (`None` elsewhere), and the function that puts such a tree back
    among the rest of `params`.
    """
    leaves, treedef = jax.tree.flatten(params)
    mine = jax.tree.unflatten(treedef, [p if m else None for p, m in zip(leaves, picks)])

    def merge(new: PyTree) -> PyTree:
        it = iter(jax.tree.leaves(new))
        return jax.tree.unflatten(treedef, [next(it) if m else p for p, m in zip(leaves, picks)])

    return mine, merge


def by_name(infos: tuple[UpdateInfo, ...], tree: Any) -> dict[str, Any]:
    """A run's state of its updates (the optimizer state, the loss scale) as a dict by
    update name: an update whose state is the run's whole (`UpdateInfo.whole`, `fit`'s one
    loss) keeps it all; several updates' is such a dict already. `as_run` is its inverse.
    """
    whole = [info.name for info in infos if info.whole]
    return {whole[0]: tree} if whole else dict(tree)


def as_run(infos: tuple[UpdateInfo, ...], states: dict[str, Any]) -> Any:
    """`by_name`'s inverse: the run's state of its updates from each one's by name."""
    whole = [states[info.name] for info in infos if info.whole]
    return whole[0] if whole else states


class Step(eqx.Module):
    """One optimisation step on a batch: its updates, each in its turn on the model the
    one before it left, on its own part of the parameters and its own state. `fit`'s
    `loss=` and `optimizer=` are one `eqfit.Update`, unnamed, whose `UpdateInfo` says what
    it does differently: its values keep their own names (`loss`, `grad_norm`), it gets
    the step's key as it is (`keyed`), and its state is the run's `opt_state` (and loss
    scale) itself (`whole`); several updates keep theirs in dicts by name.

    An update whose loss is not finite is not applied: one `lax.cond` per update, as
    `optax.apply_if_finite` does (on an accelerator, `guard_where`: a `where` over the
    state after it), so the parameters are always the last finite ones and every `on_nan`
    policy runs the same arithmetic. The caller decides whether to stop.
    Without `guard`, each is applied whatever its loss (between barriers, with the same
    arithmetic): the caller stops there and replays the state before it.
    With a loss scale, an update whose gradient is not finite is skipped too, and its
    scale moves. The options own their logic: the precision policy casts and scales, the
    average updates itself; the step records what they report as named values. An
    update not due this step (`every`) records NaN, which the epoch leaves out.
    """

    objective: Objective  # the metrics (its loss is validation's)
    combine: Callable[[PyTree], PyTree]  # the trained arrays -> the whole model
    record: Record  # what the step records, written by name
    # The updates, each with what the run knows of it.
    updates: tuple[tuple[UpdateInfo, AbstractUpdate], ...]
    # The trained arrays of a whole model (what an update's `apply` gives).
    split: Callable[[PyTree], PyTree]
    axis_name: str | None = None  # set under `pmap`: losses and gradients are averaged
    # With `shard=`: lays out a params-shaped tree (the gradients, the new parameters) as
    # the parameters are, and the optimizer state as it follows them; with `update=i`,
    # those of the `i`-th of `updates`, the arrays it trains and its state.
    lay_out: Callable[..., tuple[PyTree, PyTree]] | None = None
    average: Average | None = None
    schedules: tuple[Callable[[Any], Any], ...] = ()  # each evaluated at a count
    # With `microbatches=`: the rows of one microbatch of the batch this step sees, which
    # it computes one microbatch after another (`Step.measure`); `None`: all at once.
    microbatch: int | None = None
    # `False`: `fit` was given no data, and the updates get `batch=None`.
    batch: bool = True
    # `False`: a non-finite update is applied too (`UpdateContext.guard`).
    guard: bool = True
    # The guard as a `where` over the state's leaves after the update, computed between
    # barriers as an unguarded one is, not as a `cond`: on an accelerator, whose scalar
    # core waits for a `cond`'s predicate at every step and whose branch copies the state
    # in and out (`benchmarks/guards.py`); the CPU keeps the `cond`.
    guard_where: bool = False
    # An ensemble's step, in the members' `vmap`, where the guard's `cond` is a select of
    # both branches: the same select, made so that XLA updates the optimizer state in
    # place (`UpdateContext.guard_in_place`).
    guard_in_place: bool = False
    # With `remat=`: the policy each `eqfit.Update`'s forward pass is checkpointed by
    # (its own over it); `recompute` false: none is, whatever the policies, where the
    # step is traced to count its FLOPs (the model's).
    remat: Remat | None = None
    recompute: bool = True

    def __call__(
        self,
        params: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        average: PyTree,
        loss_scale: LossScale | dict[str, LossScale] | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
        step: Int[Array, ""],
    ) -> StepResult:
        """The step. Its loss is its updates' (`_step_loss`); it is finite if each of
        theirs is.
        """
        if self.axis_name is not None and key is not None:
            # Each device's share of the batch gets its own key.
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))
        if not self.batch:  # a row of nothing stood for it: the updates make their data
            batch = None
        infos = tuple(info for info, _ in self.updates)
        states = by_name(infos, opt_state)
        scales = None if loss_scale is None else by_name(infos, loss_scale)
        before = (params, model_state)
        reported: dict[str, Any] = {}
        metrics: dict[str, Any] | None = None
        statistics: tuple[PyTree, ...] | None = None
        labels = None
        finite = applied = None
        turns: list[Turn] = []
        for i, (info, update) in enumerate(self.updates):
            scale = None if scales is None else scales.get(info.name)
            operand = (params, states[info.name], model_state, scale)
            out = self._when_due(i, info, update, operand, batch, key, step)
            params, states[info.name], model_state = out.params, out.opt_state, out.model_state
            if scales is not None and out.loss_scale is not None:
                scales[info.name] = out.loss_scale
            if i == 0:
                metrics, statistics = out.metrics, out.statistics
            turns.append(out)
            finite = out.finite if finite is None else finite & out.finite
            applied = out.applies if applied is None else applied | out.applies
            reported |= out.values
            labels = either(labels, out.labels)
        assert finite is not None and applied is not None
        if metrics is None and self.objective.metric_names:  # on the model before the step
            metrics, met = self._metrics(*before, batch)
            labels = either(met, labels)
        if statistics is None and self.objective.accumulating:
            statistics, met = self._statistics(*before, batch)
            labels = either(met, labels)
        reported |= metrics or {}
        # The record's names: a loss's own value is the step's loss, outside them.
        reported = {name: value for name, value in reported.items() if name in self.record.names}
        return StepResult(
            params,
            as_run(infos, states),
            model_state,
            self._averaged(average, params, applied),
            None if scales is None else as_run(infos, scales),
            _step_loss(turns),
            self.record.pack(reported),
            finite,
            labels,
            reported.get(weight_name(LOSS.name)),
            statistics,
        )

    def _when_due(
        self,
        i: int,
        info: UpdateInfo,
        update: AbstractUpdate,
        operand: tuple[PyTree, PyTree, PyTree, LossScale | None],
        batch: PyTree,
        key: Key[Array, ""] | None,
        step: Int[Array, ""],
    ) -> Turn:
        """The `i`-th update's turn (`_turn`) on `operand` (the parameters, its state, the
        model state, its loss scale), with its key (`UpdateInfo.turn_key`); on the steps it
        is due at alone (`every`), else nothing done (`_not_due`).
        """
        turn_key = None if key is None else info.turn_key(key, i)
        # The metrics ride in the first update's forward pass where it has one.
        measures = self.objective.metrics if i == 0 and info.every == 1 else ()

        def run(operand: tuple[PyTree, PyTree, PyTree, LossScale | None]) -> Turn:
            return self._turn(i, info, update, *operand, batch, turn_key, measures)

        if info.every == 1:
            return run(operand)
        # On steps `every`, `2 * every`, ... (counted from 1).
        due = (step + 1) % info.every == 0
        return jax.lax.cond(due, run, functools.partial(_not_due, run), operand)

    def _metrics(
        self, params: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[dict[str, Any], LabelError | None]:
        """The metrics by name on the model `params` make, computed on their own (the
        first update is one of the user's own, or not due every step), and the first
        label out of range they met.
        """
        values, _, labels = self.objective.metric_values(
            self.combine(params), clone(model_state), batch
        )
        if self.axis_name is not None:
            values = jax.lax.pmean(values, self.axis_name)
            labels = on_any_device(labels, self.axis_name)
        return dict(zip(self.record.names_of(Kind.METRIC), values)), labels

    def _statistics(
        self, params: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[tuple[PyTree, ...], LabelError | None]:
        """The batch's statistics of the metrics that accumulate, on the model `params`
        make, computed on their own (as `_metrics`), summed over the devices.
        """
        statistics, labels = self.objective.statistics(
            self.combine(params), clone(model_state), batch
        )
        if self.axis_name is not None:
            statistics = jax.lax.psum(statistics, self.axis_name)
            labels = on_any_device(labels, self.axis_name)
        return statistics, labels

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

    def _turn(
        self,
        i: int,
        info: UpdateInfo,
        update: AbstractUpdate,
        params: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        loss_scale: LossScale | None,
        batch: PyTree,
        key: Key[Array, ""] | None,
        measures: tuple[tuple[str, MetricLike], ...],
    ) -> Turn:
        """One update's turn (`AbstractUpdate._take_turn`) on the arrays it trains, its
        values under the record's names: its own, its weighted means' weights, its
        optimizer's injected hyperparameters, the schedules at its optimizer's count, and
        with a loss scale, the scale it used and whether it skipped its update.
        `measures`: the metrics, for its forward pass to compute where it has one.
        """
        mine, merge = select(params, info.picks)
        norms = info.column(GRAD_NORM.name) in self.record.names
        split = self.split
        # With `shard=`: its arrays and its state laid out as the run's are.
        lay_out = None if self.lay_out is None else functools.partial(self.lay_out, update=i)
        context = UpdateContext(
            combine=lambda p: self.combine(merge(p)),
            axis_name=self.axis_name,
            lay_out=lay_out,
            microbatch=self.microbatch,
            norms=norms,
            precision=self.objective.precision,
            split=lambda model: select(split(model), info.picks)[0],
            loss_scale=loss_scale,
            metrics=measures,
            metric_means=tuple(n for n in self.objective.means if n in self.objective.metric_names),
            guard=self.guard,
            guard_where=self.guard_where,
            guard_in_place=self.guard_in_place,
            remat=self.remat,
            recompute=self.recompute,
        )
        # At the count this update's step uses: its state's before it.
        scheduled = schedule_values(self.schedules, opt_state) if info.schedules else []
        t = update._take_turn(info, context, mine, opt_state, model_state, batch, key)
        if lay_out is not None:  # what an update of one's own gives, as the rest is laid out
            t = t._replace(params=lay_out(t.params, None)[0])
        values = {info.column(n): v for n, v in t.values.items()}
        values |= {weight_name(info.column(n)): w for n, w in t.weights.items()}
        values |= dict(zip(map(info.column, info.hyperparams), injected_values(t.opt_state)))
        values |= dict(zip(map(info.column, info.schedules), scheduled))
        if loss_scale is not None:
            values[info.column(LOSS_SCALE.name)] = loss_scale.scale
            skipped = (t.finite & ~t.applies).astype(jnp.float32)
            values[info.column(SKIPPED_STEPS.name)] = skipped
        return t._replace(params=merge(t.params), values=values, weights={})


def _step_loss(turns: list[Turn]) -> Float[Array, ""]:
    """The step's loss: a sole update's own (NaN for a weighted mean's batch of weight 0,
    which the epoch leaves out), or the sum of several updates' losses, each of weight 0
    counted as 0, so that the other updates' values of the step still count.
    """
    if len(turns) == 1:
        return turns[0].loss
    total = jnp.zeros((), jnp.float32)
    for t in turns:
        empty = t.finite & jnp.isnan(t.loss)
        total = total + jnp.where(empty, 0.0, t.loss.astype(jnp.float32))
    return total


def _not_due(
    run: Callable[[Any], Turn], operand: tuple[PyTree, PyTree, PyTree, LossScale | None]
) -> Turn:
    """An update not due this step: everything as it was, its values NaN (which the
    epoch's means leave out), its loss 0.
    """
    shapes = jax.eval_shape(run, operand)
    params, opt_state, model_state, loss_scale = operand
    return Turn(
        params,
        opt_state,
        clone(model_state),
        jnp.zeros(shapes.loss.shape, shapes.loss.dtype),
        jnp.asarray(True),
        jnp.asarray(False),
        {name: jnp.full(v.shape, jnp.nan, v.dtype) for name, v in shapes.values.items()},
        {},
        None if shapes.labels is None else LabelError.none(),
        loss_scale,
    )
