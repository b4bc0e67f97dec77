"""A run's static description, `Loop`: hashable, the compiled programs' static argument.

It holds the model's and the objects' skeletons, what trains, the record's declaration,
the schedule and the checked option groups whole; `Loop.parts` rebuilds the step inside
the program.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Key, PyTree

from .._core._early_stopping import EarlyStopping
from .._core._execution import Execution, WholeRun
from .._step._objective import Objective
from .._step._precision import LossScale
from .._step._record import Kind, Record, UpdateInfo
from .._step._signatures import takes_key
from .._step._statistics import flat_size, Like
from .._step._step import as_run, by_name, select, Step
from .._step._updates import AbstractUpdate, optimizer_of, run_loss
from .._step._validation import Validation
from .._step._validation_steps import AT_EPOCH_ENDS, StepValidation
from ._options import StepOptions
from ._parallel import (
    CompilerOptions,
    microbatch_rows,
    OneDevice,
    param_specs,
    Placement,
    placement_devices,
)
from ._schedule import Schedule
from ._skeleton import Skeleton, split_arrays, unwrap
from ._state import Consts


@dataclasses.dataclass(frozen=True)
class Loop:
    """A run's static description: hashable, so it is the static argument of the compiled
    programs, and a second `fit` with an equal one compiles nothing.

    The model, the loss, the metrics and the optimizer enter as `Skeleton`s: their arrays
    (the model's, and any the others hold) are dynamic arguments, `Consts` and the
    trained ones in the `TrainState`.
    """

    model: Skeleton
    trains: tuple[bool, ...]  # for each array of the model, in order: does it train
    objects: Skeleton  # (metrics, schedules, updates)
    record: Record  # what each step records
    schedule: Schedule
    shuffle: bool = True
    step: StepOptions = StepOptions()
    validation: Validation | None = None
    members: int | None = None  # an ensemble: everything carries a leading member axis
    stateful: bool = False
    use_key: bool = False
    placement: Placement = OneDevice()
    early_stopping: EarlyStopping | None = None
    # With a precision policy or an average: the dtype of each trained array as the model
    # holds it, to give the result back in (the master copy and the average may be wider).
    trained_dtypes: tuple[np.dtype, ...] | None = None
    # How the steps run (`_execution`), and why, for `eqfit.plan`.
    execution: Execution = WholeRun()
    execution_why: str = ""
    # Each update's static part, in order (`fit`'s `loss=` and `optimizer=` one, unnamed).
    updates: tuple[UpdateInfo, ...] = ()
    # The samples a step processes, where its updates say (`AbstractUpdate.samples`);
    # `None`: the batch's rows.
    samples_per_step: int | None = None
    log_every: int | None = None  # the callbacks get the training values every n steps
    # Each metric that accumulates: its statistics of a batch, found abstractly
    # (`Objective.find_statistics`), in the order of `Objective.accumulating`.
    statistics: tuple[Like, ...] = ()
    # XLA's options for the programs that train (`_parallel.SMALL_STEP_OPTIONS`).
    compiler_options: CompilerOptions = ()
    # The steps whose rows a shuffled pass gathers at once (`_ahead.steps_ahead`).
    ahead: int = 1
    # A program of its own for a loader's smaller last batch: its rows (`None`: the
    # schedule's batch, which the run's other programs step by).
    last_batch: int | None = None

    @property
    def batch_size(self) -> int:
        """The rows of each step of this program: the schedule's batch, or a smaller last
        batch's (`last_batch`).
        """
        return self.schedule.batch_size if self.last_batch is None else self.last_batch

    def for_programs(self) -> "Loop":
        """The loop as the run's programs are compiled and cached for it: its schedule's
        shape without the run's extent (`Schedule.shaped_for_programs`), so that a run
        asked for other epochs (or another `initial_epoch`) compiles nothing anew.
        """
        shaped = self.schedule.shaped_for_programs()
        return self if shaped is self.schedule else dataclasses.replace(self, schedule=shaped)

    @property
    def val_sets(self) -> tuple[str, ...] | None:
        """The validation sets' names (`()`: one unnamed set; `None`: no validation)."""
        return None if self.validation is None else self.validation.sets

    @property
    def val_steps(self) -> StepValidation:
        """Whether it validates after steps (`validation_every`), or at epochs' ends."""
        return AT_EPOCH_ENDS if self.validation is None else self.validation.steps

    def next_boundary(self, position: Any) -> Any:
        """Where the stretch of steps from `position` (an int, or traced) ends: the epoch's
        end, or the next n-th step's validation (`validation_every`) if sooner.
        """
        end = self.schedule.next_epoch_end(position)
        return self.val_steps.next_boundary(self.schedule, position, end)

    def idle_slots(self, position: Any, unroll: int) -> Any:
        """How many of a `PerStep(unroll)` program's first slots a call from `position`
        (an int, or traced) leaves idle, so that each step runs in the slot it has in
        calls from where its stretch of steps began: its epoch's start, a validation's
        step (`validation_every`), or its pass's start, whichever is latest. XLA may
        compile the written-out steps apart, a few ulps from each other: where the host
        begins a call (a checkpoint's step, a chunk's) then moves no other step's slot.
        """
        schedule = self.schedule
        start = schedule.epochs_ended(position) * schedule.steps_per_epoch
        start = self.val_steps.last_boundary(schedule, position, start)
        traced = isinstance(position, jax.Array)
        if schedule.passes is not None:
            first = schedule.pass_start(schedule.pass_of(position))
            start = jnp.maximum(start, first) if traced else max(start, first)
        if traced:
            return jax.lax.rem(position - start, jnp.asarray(unroll, position.dtype))
        return (position - start) % unroll

    def in_slot(self, active: Any, slot: int, position: Any, unroll: int) -> Any:
        """`active`, where slot `slot` of a `PerStep(unroll)` program's call from
        `position` (traced) is not left idle (`idle_slots`).
        """
        if unroll == 1:
            return active
        return active & (slot >= self.idle_slots(position, unroll))

    def validates_at(self, position: int) -> bool:
        """Whether `validation_every` validates at `position` (never without it)."""
        return self.val_steps.validates_at(position)

    @property
    def log_names(self) -> tuple[str, ...]:
        """The per-epoch values, in the order of `TrainState.epoch_values`' columns."""
        return self.record.log_names(self.val_sets)

    @property
    def val_width(self) -> int:
        """How many numbers one validation set's sums hold (`Objective.width`): its
        values' totals and weights, but each accumulating metric's statistics in place
        of its value's entries.
        """
        per_set = len(self.val_names) // max(len(self.val_sets or ()), 1)
        return per_set - len(self.record.accumulated_names) + flat_size(self.statistics)

    @property
    def val_names(self) -> tuple[str, ...]:
        """The validation values among `log_names`, the last of them (none without
        validation).
        """
        return self.record.val_names(self.val_sets)

    @property
    def aux_names(self) -> tuple[str, ...]:
        """The aux values the loss returns."""
        return self.record.names_of(Kind.AUX)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return self.record.names_of(Kind.METRIC)

    def parts(self, consts: Consts) -> "Rebuilt":
        """The run's objects, rebuilt inside the program from the static skeletons."""
        metrics, schedules, updates = unwrap(self.objects.fill(consts.objects))
        objective = Objective(
            run_loss(updates, self.stateful),
            metrics,
            self.stateful,
            self.use_key,
            self.aux_names,
            self.step.precision,
            self.record.means,
            self.statistics,
        )
        frozen = consts.frozen

        def combine(params: PyTree) -> PyTree:
            """The whole model from its trained arrays (and its frozen ones)."""
            trained, fixed = iter(jax.tree.leaves(params)), iter(frozen)
            arrays = [next(trained) if t else next(fixed) for t in self.trains]
            return unwrap(self.model.fill(arrays))

        init = functools.partial(init_updates, self.updates, updates)
        steps = tuple(zip(self.updates, updates))

        def split(model: PyTree) -> PyTree:
            """The trained arrays of a whole model (the inverse of `combine`)."""
            arrays, _ = split_arrays(model)
            return self.params_tree([a for a, t in zip(arrays, self.trains) if t])

        lay_out = None
        if self.param_shardings() is not None:
            lay_out = functools.partial(lay_out_run, self, steps)
        step = Step(
            objective=objective,
            combine=combine,
            record=self.record,
            updates=steps,
            split=split,
            axis_name=self.placement.axis_name,
            lay_out=lay_out,
            average=self.step.average,
            schedules=tuple(schedule for _, schedule in schedules),
            microbatch=self.microbatch(),
            batch=self.step.batch,
            guard=not self.step.replays,
            guard_where=placement_devices(self.placement)[0].platform != "cpu",
            guard_in_place=self.members is not None,
            remat=self.step.remat,
        )
        return Rebuilt(objective, combine, step, init, lay_out)

    def start_loss_scale(self) -> LossScale | dict[str, LossScale] | None:
        """The loss scale at the start (float16's): each loss's update's own, by name, as
        the run holds them (`as_run`: `fit`'s one loss's alone); `None` where the loss is
        not scaled.
        """
        precision = self.step.precision
        scale = None if precision is None else precision.init()
        if scale is None:
            return None
        return as_run(self.updates, {u.name: scale for u in self.updates if u.loss})

    def microbatch(self, rows: int | None = None) -> int | None:
        """With `microbatches=`, the rows of one microbatch of what the step sees of a
        full batch (`rows=None`) or of a smaller last batch of `rows`; else `None`.
        """
        # The run's batch size: a streamed run's smaller pieces are never full batches.
        batch_size = self.schedule.batch_size
        return microbatch_rows(self.placement, batch_size, self.step.microbatches, rows)

    def param_shardings(self) -> PyTree | None:
        """With `shard=`, each trained array's `NamedSharding`, in `params_tree`'s
        structure; else `None`.
        """
        specs = param_specs(self.placement)
        if specs is None:
            return None
        mesh = self.placement.mesh  # pyright: ignore[reportAttributeAccessIssue]
        chosen = [NamedSharding(mesh, spec) for spec, t in zip(specs, self.trains) if t]
        return self.params_tree(chosen)

    def params_tree(self, params: Sequence[Any]) -> PyTree:
        """The trained arrays in the model's structure, `None` elsewhere: what the
        optimizer sees, as `eqx.filter(model, filter_spec)` would give it.
        """
        it = iter(params)
        chosen = [next(it) if t else None for t in self.trains]
        arrays = iter(chosen)
        leaves = [next(arrays) if x is None else None for x in self.model.leaves]
        return jax.tree.unflatten(self.model.treedef, leaves)


def init_updates(
    infos: tuple[UpdateInfo, ...],
    updates: tuple[AbstractUpdate, ...],
    params: PyTree,
    key: Key[Array, ""],
) -> PyTree:
    """Each update's state at the start, as the run holds them (`as_run`: in a dict by
    name, or `fit`'s one loss's alone): `AbstractUpdate.init` on the arrays it trains,
    given `jax.random.fold_in(key, i)` (the `i`-th update's) where it takes a `key`.
    """
    states = {}
    for i, (info, update) in enumerate(zip(infos, updates)):
        kwargs = {"key": jax.random.fold_in(key, i)} if takes_key(update.init) else {}
        states[info.name] = update.init(select(params, info.picks)[0], **kwargs)
    return as_run(infos, states)


class Rebuilt(NamedTuple):
    """The run's objects as the program calls them (`Loop.parts`)."""

    objective: Objective
    combine: Callable[[PyTree], PyTree]
    step: Step
    # The optimizer state at the start, from the trained arrays and a key of the run's
    # (a member's): each update's `init` gets its own.
    init: Callable[[PyTree, Key[Array, ""]], PyTree]
    # With `shard=`: the trained arrays (or a tree like them) and the optimizer state (or
    # `None`) laid out as it asks (`lay_out_run`); else `None`.
    lay_out: "Callable[[PyTree, PyTree], tuple[PyTree, PyTree]] | None"


def lay_out_run(
    loop: Loop,
    updates: tuple[tuple[UpdateInfo, AbstractUpdate], ...],
    params: PyTree,
    opt_state: PyTree,
    update: int | None = None,
) -> tuple[PyTree, PyTree]:
    """`params` (or any tree shaped like them) laid out as `shard=` asks, and `opt_state`
    (unless `None`) following them (`lay_out_state`): the run's, each of its `updates`'
    state as the arrays it trains; or (`update`, its place in `updates`) one update's,
    its arrays and its state.
    """
    if update is not None:
        info, u = updates[update]
        return lay_out_state(loop, optimizer_of(u), params, opt_state, info.picks)
    params, _ = lay_out_state(loop, None, params, None)
    if opt_state is not None:
        infos = tuple(info for info, _ in updates)
        states = by_name(infos, opt_state)
        for info, u in updates:
            mine = select(params, info.picks)[0]
            _, states[info.name] = lay_out_state(
                loop, optimizer_of(u), mine, states[info.name], info.picks
            )
        opt_state = as_run(infos, states)
    return params, opt_state


def lay_out_state(
    loop: Loop,
    optimizer: optax.GradientTransformation | None,
    params: PyTree,
    opt_state: PyTree,
    picks: tuple[bool, ...] | None = None,
) -> tuple[PyTree, PyTree]:
    """`params` (or any tree shaped like them; with `picks`, those of the trained arrays
    it picks, as an update trains them) laid out as `shard=` asks, and `opt_state`
    (unless `None`, or the `optimizer` is) following them: each copy of the parameters
    in it (Adam's moments, say) laid out as they are, the rest (step counts) replicated.
    Constraints inside the program, so that XLA's partitioner places every intermediate
    to match.
    """
    shardings = loop.param_shardings()
    assert shardings is not None
    if picks is not None:
        shardings = select(shardings, picks)[0]
    constrain = jax.lax.with_sharding_constraint
    params = jax.tree.map(constrain, params, shardings)
    if opt_state is not None and optimizer is not None:
        replicated = NamedSharding(loop.placement.mesh, PartitionSpec())  # pyright: ignore
        opt_state = optax.tree_map_params(
            optimizer,
            constrain,
            opt_state,
            shardings,
            transform_non_params=lambda x: constrain(x, replicated) if eqx.is_array(x) else x,
        )
    return params, opt_state
