"""The one compiled run: training from a position to a stop position, both traced.

Every path calls the same two programs: `start` makes the training state once, and `run`
trains from the state's position (a global step count) up to a stop position. The
compiled path calls `run` once, from the start to the end; the bar, checkpoints, resume
and streamed data call it in pieces. Since the positions are traced, every piece runs the
same compiled program, and the pieces agree with one whole run bit for bit.
"""

import dataclasses
import enum
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Key, PyTree, UInt32

from ._average import Average
from ._checkpoint import as_plain
from ._compile import PROGRAM_CACHE, PROGRAMS
from ._data import describe, epoch_order, is_dtype, not_a_stack, shuffle_seed
from ._early_stopping import EarlyStopping, StoppingState
from ._evaluate import evaluate_batches, evaluation_needs_key
from ._hyperparams import check_schedules, injected_names
from ._labels import LabelError
from ._options import check_monitor, Options
from ._parallel import OneDevice, param_specs, Placement
from ._precision import LossScale, Precision
from ._schedule import Schedule
from ._step import (
    find_aux_names,
    log_names,
    Objective,
    RESERVED,
    reserved_for,
    reserved_names,
    Step,
    step_value_names,
    takes_key,
)
from ._validation import check_unique, validation_names


OnNan = Literal["raise", "stop", "skip"]


class Stop(enum.IntEnum):
    """Why the program stopped a run (a member, in an ensemble): reported as a value."""

    RUNNING = 0  # not stopped: it reached the call's stop, or the run's end
    EARLY_STOPPING = 1
    NON_FINITE_LOSS = 2
    BAD_LABEL = 3  # a label out of range made the loss non-finite


class Skeleton(NamedTuple):
    """A PyTree with its arrays taken out: hashable, so it can be a static argument.

    `leaves` holds `None` where an array was (flattening never yields `None` itself) and
    `types` tells `1` from `1.0` and `True`, which compare equal but trace differently.
    """

    treedef: Any
    leaves: tuple[Any, ...]
    types: tuple[type, ...]

    def fill(self, arrays: list[Any]) -> PyTree:
        """The PyTree again, its array places filled in order from `arrays`."""
        it = iter(arrays)
        return jax.tree.unflatten(self.treedef, [next(it) if x is None else x for x in self.leaves])


def split_arrays(tree: PyTree) -> tuple[list[Any], Skeleton]:
    """`tree`'s arrays, and the rest of it as a `Skeleton`."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [x for x in leaves if eqx.is_array(x)]
    rest = tuple(None if eqx.is_array(x) else _hashable(x) for x in leaves)
    return arrays, Skeleton(treedef, rest, tuple(map(type, rest)))


class _ByIdentity:
    """A leaf that cannot be hashed, compared by identity instead (so a new one each call
    means a new compilation, as `jax.jit` would demand a hashable static argument).
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.value is self.value


def _hashable(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return _ByIdentity(x)
    return x


def _unwrap(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x.value if isinstance(x, _ByIdentity) else x, tree)


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
    objects: Skeleton  # (loss, metrics, optimizer, schedules)
    metric_names: tuple[str, ...]
    schedule: Schedule
    batch_size: int  # of each step here (for streamed data: of this program's pieces)
    shuffle: bool = True
    validate: bool = False
    on_nan: OnNan = "raise"
    members: int | None = None  # an ensemble: everything carries a leading member axis
    stateful: bool = False
    use_key: bool = False
    placement: Placement = OneDevice()
    stopping: EarlyStopping | None = None
    aux_names: tuple[str, ...] = ()  # the aux values the loss returns
    precision: Precision | None = None
    average: Average | None = None  # `ema=`
    validate_ema: bool = False  # validation and early stopping read the average
    norms: bool = False
    # The hyperparameters recorded each step: the names of those that the optimizer's
    # `inject_hyperparams` states hold, and of `schedules=`' (`eqfit._hyperparams`).
    hyperparams: tuple[str, ...] = ()
    schedule_names: tuple[str, ...] = ()
    # With a precision policy or an average: the dtype of each trained array as the model
    # holds it, to give the result back in (the master copy and the average may be wider).
    trained_dtypes: tuple[np.dtype, ...] | None = None
    # The validation sets' names (`ValidationSets`), in order; empty: one unnamed set.
    val_sets: tuple[str, ...] = ()
    validation_freq: int = 1  # the epochs validated: those whose number is a multiple

    @property
    def step_names(self) -> tuple[str, ...]:
        """The values each step records besides its loss, in the order of
        `TrainState.step_values`' last axis.
        """
        return step_value_names(
            self.aux_names, self.metric_names, self.norms, self.scales, self.recorded
        )

    @property
    def log_names(self) -> tuple[str, ...]:
        """The per-epoch values, in the order of `TrainState.epoch_values`' columns."""
        return log_names(
            self.aux_names,
            self.metric_names,
            self.norms,
            self.scales,
            self.validate,
            self.recorded,
            self.val_sets,
        )

    @property
    def val_names(self) -> tuple[str, ...]:
        """The validation values among `log_names`, the last of them (none without
        validation).
        """
        if not self.validate:
            return ()
        return validation_names(self.val_sets, self.aux_names, self.metric_names)

    @property
    def recorded(self) -> tuple[str, ...]:
        """The hyperparameters' names, as the run records them: the injected, then the
        schedules'.
        """
        return (*self.hyperparams, *self.schedule_names)

    @property
    def scales(self) -> bool:
        """Whether the loss is scaled (float16), so the run records the loss scale."""
        return self.precision is not None and self.precision.scales

    def parts(self, consts: "Consts") -> "Parts":
        """The run's objects, rebuilt inside the program from the static skeletons."""
        loss, metrics, optimizer, schedules = _unwrap(self.objects.fill(consts.objects))
        objective = Objective(
            loss, metrics, self.stateful, self.use_key, self.aux_names, self.precision
        )
        frozen = consts.frozen

        def combine(params: PyTree) -> PyTree:
            """The whole model from its trained arrays (and its frozen ones)."""
            trained, fixed = iter(jax.tree.leaves(params)), iter(frozen)
            arrays = [next(trained) if t else next(fixed) for t in self.trains]
            return _unwrap(self.model.fill(arrays))

        lay_out = None
        if self.param_shardings() is not None:
            lay_out = functools.partial(lay_out_state, self, optimizer)
        step = Step(
            objective,
            optimizer,
            combine,
            self.placement.axis_name,
            lay_out,
            self.average,
            self.norms,
            bool(self.hyperparams),
            tuple(schedule for _, schedule in schedules),
        )
        return Parts(objective, optimizer, combine, step)

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


class Objects(NamedTuple):
    """What the run calls: the loss, the metrics, the optimizer (a plain one) and the
    schedules whose values it records.
    """

    loss: Callable[..., Any]
    metrics: tuple[tuple[str, Callable[..., Any]], ...]
    optimizer: optax.GradientTransformation
    schedules: tuple[tuple[str, Callable[[Any], Any]], ...] = ()


class Parts(NamedTuple):
    objective: Objective
    optimizer: optax.GradientTransformation
    combine: Callable[[PyTree], PyTree]
    step: Step


class Consts(NamedTuple):
    """Arrays the run reads but never changes: the model's frozen ones, and any that the
    loss, metrics, optimizer or early stopping hold.
    """

    frozen: list[Array]
    objects: list[Array]


class TrainState(NamedTuple):
    """Everything a run carries from step to step and from call to call; all arrays.

    With an ensemble every field has a leading member axis.
    """

    params: PyTree  # the arrays that train, in the model's structure (`Loop.params_tree`)
    opt_state: PyTree
    model_state: PyTree
    average: PyTree  # their moving average, laid out as they are (`None` without `ema=`)
    loss_scale: LossScale | None  # with a precision policy that scales the loss
    stopping: StoppingState | None
    step: Int[Array, ""]  # optimizer steps done since the first epoch ever: the position
    reason: Int[Array, ""]  # a `Stop`: why the run stopped, if it did
    nan_step: Int[Array, ""]  # the first step whose loss was not finite, or -1
    label_error: LabelError  # the first label out of range met, if any
    # One row per epoch of this run:
    step_loss: Float[Array, "epochs steps"]  # NaN where no step ran
    step_values: Float[Array, "epochs steps values"]  # `Loop.step_names`' values
    batch_sizes: Int[Array, "epochs steps"]  # 0 where no step ran
    epoch_values: Float[Array, "epochs logs"]  # `Loop.log_names` of each finished epoch
    # The epoch in progress: its finite steps' losses weighted by their batch sizes,
    # summed, and the sizes summed (for the bar; the epoch's value is `epoch_values`').
    running: Float[Array, "2"]


class Piece(NamedTuple):
    """A piece of streamed data: the rows of consecutive batches, all of the program's
    `Loop.batch_size`. Step `t` (a global step, `first <= t < end`) takes rows
    `order[(t - first) * batch_size:]`. Made on the host (numpy), then placed.
    """

    order: UInt32[ArrayLike, " rows"]
    first: Int[ArrayLike, ""]  # the global step of its first batch
    end: Int[ArrayLike, ""]  # the global step after its last batch


class Inputs(NamedTuple):
    """The arrays a run reads but never changes (never donated)."""

    data: PyTree
    val_data: PyTree
    key: Key[Array, "*members"]
    consts: Consts
    piece: Piece | None = None  # streamed data: where `data` sits in the run


class Steps(NamedTuple):
    """The record of one call's steps, while the epoch's length is learned: column
    `t % Schedule.columns` holds step `t`'s (NaN, or 0 for sizes, where none ran).
    """

    loss: Float[ArrayLike, "*members steps"]
    values: Float[ArrayLike, "*members steps values"]
    batch_sizes: Int[ArrayLike, "*members steps"]


class Report(NamedTuple):
    """What a call of `run` tells the host, read once it is due."""

    step: Int[Array, "*members"]  # the position after the call
    reason: Int[Array, "*members"]  # a `Stop`
    nan_step: Int[Array, "*members"]
    label_error: LabelError
    best_epoch: Int[Array, "*members"]  # by early stopping; -1 without it
    # The mean loss of the epoch in progress so far (NaN at its start).
    epoch_loss: Float[Array, "*members"]
    epoch_values: Float[Array, "*members epochs logs"]  # NaN for epochs not finished
    # With `restore_best`: the trained arrays, model state and average to return.
    trained: tuple[PyTree, PyTree, PyTree] | None
    steps: Steps | None = None  # while the epoch's length is learned: this call's steps


def run_config(
    loop: Loop, state: PyTree, data: list[list[Any]], val_data: Any, loss: Any, key: Any
) -> dict[str, Any]:
    """What identifies a run for its checkpoints: shapes, settings, key; not devices, so
    that a run may resume on others.
    """
    schedule = loop.schedule
    config = {
        "state": describe(state),
        "data": data,
        "validation_data": describe(val_data),
        "batch_size": schedule.batch_size,
        "passes": None if schedule.passes is None else [as_plain(v) for v in schedule.passes],
        "steps_per_epoch": None if schedule.learning else schedule.steps_per_epoch,
        "epochs": [schedule.first_epoch, schedule.epochs],
        "shuffle": loop.shuffle,
        "on_nan": loop.on_nan,
        "early_stopping": None if loop.stopping is None else repr(loop.stopping),
        "metrics": list(loop.metric_names),
        "loss": getattr(loss, "__qualname__", type(loss).__name__),
        "key": np.asarray(jax.random.key_data(key)).tolist(),
        "ensemble": loop.members is not None,
    } | _real_model_config(loop)
    return config | _validation_config(loop)


def _validation_config(loop: Loop) -> dict[str, Any]:
    """Named sets and a `validation_freq`, where given: a run with one unnamed set,
    validated every epoch, has the config it had before they were, so that its
    checkpoints still resume.
    """
    config: dict[str, Any] = {}
    if loop.val_sets:  # their order is that of the record's columns
        config["validation_sets"] = list(loop.val_sets)
    if loop.validation_freq != 1:
        config["validation_freq"] = loop.validation_freq
    return config


def learned_config(config: dict[str, Any], schedule: Schedule, state: PyTree) -> dict[str, Any]:
    """`run_config`'s `config` once the run has learned its epoch's length (`schedule`'s)
    and `state` keeps its record by it: what a resumed run, knowing the length from its
    checkpoint, makes.
    """
    return config | {"state": describe(state), "steps_per_epoch": schedule.steps_per_epoch}


def _real_model_config(loop: Loop) -> dict[str, Any]:
    """The options of real models, where given: a run without them has the config it had
    before they were, so that its checkpoints still resume.
    """
    config: dict[str, Any] = {}
    policy = loop.precision
    if policy is not None:  # by its dtypes' names: one policy, however spelled
        config["precision"] = {
            "compute": str(policy.compute_dtype),
            "params": str(policy.params_dtype),
            "keep": list(policy.keep),
            "loss_scaling": policy.scales,
            "initial_scale": policy.initial_scale,
            "growth_steps": policy.growth_steps,
        }
    if loop.average is not None:
        config["ema"] = loop.average.momentum
    if loop.validate_ema:
        config["validate_ema"] = True
    if loop.norms:
        config["norms"] = True
    if loop.aux_names:
        config["aux"] = list(loop.aux_names)
    if loop.hyperparams:
        config["hyperparams"] = list(loop.hyperparams)
    if loop.schedule_names:
        config["schedules"] = list(loop.schedule_names)
    return config


def start(
    loop: Loop,
    params: list[Array],
    opt_state: PyTree | None,
    model_state: PyTree,
    key: Key[Array, ""],
    consts: Consts,
) -> tuple[TrainState, Key[Array, "*members"]]:
    """The training state at the start, and the key of each member (or the key).

    Its outputs are new buffers (`run` may donate them), never the caller's arrays.
    """
    parts = loop.parts(consts)
    schedule = loop.schedule
    rows, steps = schedule.rows, schedule.columns

    def start_one(params: list[Array], opt_state: PyTree, model_state: PyTree) -> TrainState:
        params = loop.params_tree([jnp.copy(p) for p in params])
        if loop.precision is not None:  # the master copy
            params = loop.precision.master(params)
        if opt_state is None:
            opt_state = parts.optimizer.init(params)
        else:
            opt_state = jax.tree.map(jnp.copy, opt_state)
        if loop.param_shardings() is not None:  # laid out as `shard=` asks, from the start
            params, opt_state = lay_out_state(loop, parts.optimizer, params, opt_state)
        model_state = jax.tree.map(jnp.copy, model_state)
        average = None if loop.average is None else loop.average.init(params)
        if average is not None and loop.param_shardings() is not None:
            average, _ = lay_out_state(loop, parts.optimizer, average, None)
        stopping = None
        if loop.stopping is not None:
            stopping = loop.stopping.init((params, average), model_state)
        nan = jnp.float32(jnp.nan)
        return TrainState(
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            average=average,
            loss_scale=None if loop.precision is None else loop.precision.init(),
            stopping=stopping,
            step=jnp.asarray(schedule.begin, jnp.int32),
            reason=jnp.asarray(Stop.RUNNING, jnp.int32),
            nan_step=jnp.asarray(-1, jnp.int32),
            label_error=LabelError.none(),
            step_loss=jnp.full((rows, steps), nan),
            step_values=jnp.full((rows, steps, len(loop.step_names)), nan),
            batch_sizes=jnp.zeros((rows, steps), jnp.int32),
            epoch_values=jnp.full((rows, len(loop.log_names)), nan),
            running=jnp.zeros(2),
        )

    if loop.members is None:
        return start_one(params, opt_state, model_state), key
    in_axes = (0, None if opt_state is None else 0, 0)
    state = jax.vmap(start_one, in_axes=in_axes)(params, opt_state, model_state)
    return state, jax.random.split(key, loop.members)


def start_program(loop: Loop) -> Callable[..., tuple[TrainState, Key[Array, "*members"]]]:
    """`start` compiled for `loop`, from eqfit's bounded cache of programs.

    It runs once per `fit` and only fills and copies arrays, so XLA compiles it without
    optimising its kernels: half the compile time, which a first `fit` waits for.
    """
    fn = functools.partial(start, loop)
    return PROGRAM_CACHE.get(("start", loop), lambda: jax.jit(fn, compiler_options=START_OPTIONS))


START_OPTIONS = {"xla_backend_optimization_level": 0}


class Starting:
    """The training state while `start` makes it in a thread: on one device, XLA compiles
    `start` there while the host traces `run` (`ready`), so a first `fit` waits for the
    one compilation, not for both in turn. Its shapes are known at once.
    """

    def __init__(self, program: Callable[..., tuple[TrainState, Any]], args: tuple[Any, ...]):
        self.shapes: TrainState = jax.eval_shape(program, *args)[0]
        self.made: tuple[TrainState, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._make, args=(program, args), daemon=True)
        self.thread.start()

    def _make(self, program: Callable[..., tuple[TrainState, Any]], args: tuple[Any, ...]):
        try:
            self.made = program(*args)
        except BaseException as e:  # raised in the training thread, by `ready`
            self.error = e

    def ready(self, run: Callable[..., Any], *args: Any) -> TrainState:
        """The state, once `run` (a `jax.jit` program) is traced for it with `args`."""
        trace = getattr(run, "trace", None)
        if trace is not None:
            try:
                trace(self.shapes, *args).lower()  # the call then finds it in JAX's caches
            except Exception:  # the call itself raises it, with eqfit's notes
                pass
        return self.result()

    def join(self) -> None:
        """Waits for the thread that makes the state (its compilation included)."""
        self.thread.join()

    def result(self) -> TrainState:
        """The state, once made."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.made is not None
        return self.made[0]


def run_key(loop: Loop) -> tuple[str, Loop]:
    """Where `run` compiled for `loop` is cached (with its speed)."""
    return ("run", loop)


def run_program(loop: Loop) -> Callable[..., tuple[TrainState, Report]]:
    """`run` compiled for `loop` by its placement, the state donated (cached)."""
    compile = loop.placement.compile
    return PROGRAM_CACHE.get(run_key(loop), lambda: compile(functools.partial(run, loop), (0,)))


def run(
    loop: Loop, state: TrainState, inputs: Inputs, stop: Int[Array, ""]
) -> tuple[TrainState, Report]:
    """Trains from `state.step` to the global step `stop`, or until stopped.

    A while loop over passes over the data, each holding a while loop over the stretches
    between epoch ends (one stretch and no loop where epochs end only at pass ends), each
    a while loop over full batches, then the pass's remainder batch and the epoch's end
    (validation, metrics, early stopping) as they fall due.
    """
    parts = loop.parts(inputs.consts)

    def one(state: TrainState, key: Key[Array, ""]) -> tuple[TrainState, Report]:
        return _Run(loop, parts, inputs, key, stop).run(state)

    if loop.members is None:
        return one(state, inputs.key)
    return jax.vmap(one)(state, inputs.key)


@dataclasses.dataclass(frozen=True)
class _Run:
    """One member's run, while tracing: the loop's pieces with their shared arguments."""

    loop: Loop
    parts: Parts
    inputs: Inputs
    key: Key[Array, ""]
    stop: Int[Array, ""]

    def run(self, state: TrainState) -> tuple[TrainState, Report]:
        loop, schedule = self.loop, self.loop.schedule
        stop = jnp.minimum(jnp.asarray(self.stop, jnp.int32), schedule.total)
        if schedule.learning:  # each call's steps are recorded afresh, for the host
            state = state._replace(
                step_loss=jnp.full_like(state.step_loss, jnp.nan),
                step_values=jnp.full_like(state.step_values, jnp.nan),
                batch_sizes=jnp.zeros_like(state.batch_sizes),
            )
        # One key per global step, so a step's key does not depend on how the run is cut
        # into pieces. (Derived only if the loss asks for one: threefry is costly to
        # compile.)
        step_key = jax.random.fold_in(self.key, 1) if loop.use_key else None
        piece, passes = self.inputs.piece, schedule.passes
        if piece is not None:  # streamed: this piece's rows
            end = jnp.minimum(stop, piece.end)
            order = jnp.asarray(piece.order)
            # A piece of smaller batches (a pass's last) is a remainder: not split over
            # devices, as it need not divide evenly.
            full = loop.batch_size == schedule.batch_size
            state = self.run_steps(state, order, piece.first, end, None, step_key, full)
        else:
            assert passes is not None
            seed = shuffle_seed(self.key)

            def more(state: TrainState) -> Bool[Array, ""]:
                return (state.step < stop) & (state.reason == Stop.RUNNING)

            def one_pass(state: TrainState) -> TrainState:
                index = schedule.pass_of(state.step)
                order = epoch_order(seed, index, passes.num_samples, loop.shuffle)
                first = schedule.pass_start(index)
                end = jnp.minimum(stop, first + passes.steps_per_pass)
                remainder = schedule.remainder_step(index)
                return self.run_steps(state, order, first, end, remainder, step_key)

            state = jax.lax.while_loop(more, one_pass, state)
        if loop.param_shardings() is not None:  # the outputs laid out as `shard=` asks
            params, opt_state = lay_out_state(
                loop, self.parts.optimizer, state.params, state.opt_state
            )
            state = state._replace(params=params, opt_state=opt_state)
            if state.average is not None:
                average, _ = lay_out_state(loop, self.parts.optimizer, state.average, None)
                state = state._replace(average=average)
        return state, self.report(state)

    def run_steps(
        self,
        state: TrainState,
        order: UInt32[Array, " n"],
        first: Any,
        end: Any,
        remainder_step: Any,
        step_key: Key[Array, ""] | None,
        full: bool = True,
    ) -> TrainState:
        """Steps until `end` or until stopped, closing each epoch as it ends. Step `t`
        takes rows `order[(t - first) * batch_size:]`; in memory, `remainder_step` is
        the pass's last step, on the smaller batch of its remaining samples.
        """
        loop, schedule = self.loop, self.loop.schedule
        data = self.inputs.data
        running = lambda state: state.reason == Stop.RUNNING  # noqa: E731

        def batch_step(state: TrainState, size: int, full: bool) -> TrainState:
            t = state.step
            start = (t - first) * loop.batch_size  # in range: `t` is in the piece
            index = jax.lax.dynamic_slice(order, (start,), (size,), allow_negative_indices=False)
            placement = loop.placement
            if full:
                batch, step = placement.full_batch(data, index), self.parts.step
            else:  # never split over devices (it need not divide evenly): no pmean
                batch = placement.remainder_batch(data, index)
                step = dataclasses.replace(self.parts.step, axis_name=None)
            key = None if step_key is None else jax.random.fold_in(step_key, t)
            out = step(
                state.params,
                state.opt_state,
                state.model_state,
                state.average,
                state.loss_scale,
                batch,
                key,
            )
            row, column = schedule.record_row(t), schedule.record_column(t)
            nan_step = jnp.where(~out.finite & (state.nan_step < 0), t, state.nan_step)
            reason, label_error = state.reason, state.label_error
            why: Any = Stop.NON_FINITE_LOSS
            if out.labels is not None:  # the loss or the metrics check labels
                label_error = label_error.or_else(
                    out.labels._replace(step=jnp.asarray(t, jnp.int32))
                )
                why = jnp.where(out.labels.found, Stop.BAD_LABEL, Stop.NON_FINITE_LOSS)
            if loop.on_nan != "skip":
                reason = jnp.where(out.finite, reason, why)
            state = state._replace(
                params=out.params,
                opt_state=out.opt_state,
                model_state=out.model_state,
                average=out.average,
                loss_scale=out.loss_scale,
                step=t + 1,
                reason=reason,
                nan_step=nan_step,
                label_error=label_error,
                step_loss=_put(state.step_loss, out.loss, row, column),
                running=state.running
                + jnp.where(out.finite, jnp.stack([out.loss * size, size]), 0.0),
                batch_sizes=_put(state.batch_sizes, size, row, column),
            )
            if loop.step_names:
                values = _put(state.step_values, out.values, row, column)
                state = state._replace(step_values=values)
            return state

        def between_epoch_ends(state: TrainState) -> TrainState:
            epoch_end = schedule.next_epoch_end(state.step)
            limit = jnp.minimum(end, epoch_end)
            full_limit = limit if remainder_step is None else jnp.minimum(limit, remainder_step)

            def more_full(state: TrainState) -> Bool[Array, ""]:
                return (state.step < full_limit) & running(state)

            passes = schedule.passes
            if passes is None or passes.num_full:  # else all is the remainder
                state = jax.lax.while_loop(
                    more_full, lambda s: batch_step(s, loop.batch_size, full), state
                )
            if remainder_step is not None:
                assert passes is not None

                # A loop that runs once or not at all, not a `cond`: XLA compiles a step
                # inside a conditional more slowly than inside a loop.
                def remainder_due(state: TrainState) -> Bool[Array, ""]:
                    return (state.step == remainder_step) & (state.step < limit) & running(state)

                remainder = passes.remainder
                state = jax.lax.while_loop(
                    remainder_due, lambda s: batch_step(s, remainder, False), state
                )
            closes = (state.step == epoch_end) & running(state)
            return jax.lax.cond(closes, self.close_epoch, lambda s: s, state)

        if schedule.epochs_end_at_pass_ends:
            # From a step inside a pass to `end`, at or before the pass's end (in memory
            # the caller's loop sees to that, and a memmap's pieces each lie in one pass),
            # no epoch ends but at `end`: one stretch, with no loop around it. A loop
            # level fewer in the program, which XLA then compiles in much less time.
            return between_epoch_ends(state)

        def more(state: TrainState) -> Bool[Array, ""]:
            return (state.step < end) & running(state)

        return jax.lax.while_loop(more, between_epoch_ends, state)

    def close_epoch(self, state: TrainState) -> TrainState:
        """The end of the epoch just finished: its values, validation, early stopping."""
        loop, schedule = self.loop, self.loop.schedule
        row = schedule.record_row(state.step - 1)
        epoch = schedule.epoch_of(state.step - 1)
        values = epoch_means(state, row, loop)
        validated = None  # every epoch, or not at all
        if loop.validate:
            if loop.validation_freq == 1:  # no branch: the program it always was
                val, label_error = self.validate(state, epoch)
            else:
                validated = epoch % loop.validation_freq == 0

                def not_due(state: TrainState) -> tuple[Array, LabelError]:
                    return jnp.full(len(loop.val_names), jnp.nan), state.label_error

                val, label_error = jax.lax.cond(
                    validated, lambda s: self.validate(s, epoch), not_due, state
                )
            values = jnp.concatenate([values, val])
            state = state._replace(label_error=label_error)
        state = state._replace(
            epoch_values=_put(state.epoch_values, values, row), running=jnp.zeros(2)
        )
        if loop.stopping is None:
            return state
        assert state.stopping is not None
        stopping_rule = loop.stopping
        monitored = values[loop.log_names.index(stopping_rule.monitor)]
        trained = (state.params, state.average)

        def update(stopping: StoppingState) -> tuple[StoppingState, Bool[Array, ""]]:
            return stopping_rule.update(stopping, monitored, epoch, trained, state.model_state)

        if validated is not None and stopping_rule.monitor in loop.val_names:
            # As Keras, which checks the monitor only where it is in the epoch's logs: an
            # epoch not validated neither improves nor counts towards the patience.
            def wait(stopping: StoppingState) -> tuple[StoppingState, Bool[Array, ""]]:
                return stopping, jnp.asarray(False)

            stopping, stop = jax.lax.cond(validated, update, wait, state.stopping)
        else:
            stopping, stop = update(state.stopping)
        reason = jnp.where(stop, Stop.EARLY_STOPPING, state.reason)
        return state._replace(stopping=stopping, reason=reason)

    def validate(self, state: TrainState, epoch: Int[Array, ""]) -> tuple[Array, LabelError]:
        """The validation values of epoch `epoch`'s model (`Loop.val_names`'), and the
        label error with the first label out of range that they met, if any.

        A loss that takes a key (and requires one, `evaluation_needs_key`) gets a new one
        for each batch of each set at each epoch, from the run's key: the noise of a
        variational loss differs from batch to batch and epoch to epoch, and is the same
        for the same run, however it is cut into calls. Its own fold of the run's key
        (the steps' is 1) leaves the training's keys as they were.
        """
        loop, parts = self.loop, self.parts
        model = parts.combine(state.average if loop.validate_ema else state.params)
        val_data = self.inputs.val_data
        sets = [val_data[name] for name in loop.val_sets] if loop.val_sets else [val_data]
        epoch_key = None
        if evaluation_needs_key(parts.objective, model):
            epoch_key = jax.random.fold_in(jax.random.fold_in(self.key, 2), epoch)
        values, label_error = [], state.label_error
        for i, data in enumerate(sets):
            key = None if epoch_key is None else jax.random.fold_in(epoch_key, i)
            val, labels = evaluate_batches(
                parts.objective, model, state.model_state, data, loop.schedule.batch_size, key
            )
            values.append(val)
            if labels is not None:
                label_error = label_error.or_else(labels)
        return jnp.concatenate(values), label_error

    def report(self, state: TrainState) -> Report:
        stopping = self.loop.stopping
        trained = None
        if stopping is not None and stopping.restore_best:
            assert state.stopping is not None
            (params, average), model_state = stopping.trained(
                state.stopping, (state.params, state.average), state.model_state
            )
            trained = (params, model_state, average)
        best = -1 if state.stopping is None else state.stopping.best_epoch
        return Report(
            step=state.step,
            reason=state.reason,
            nan_step=state.nan_step,
            label_error=state.label_error,
            best_epoch=jnp.asarray(best, jnp.int32),
            epoch_loss=state.running[0] / state.running[1],
            epoch_values=state.epoch_values,
            trained=trained,
            steps=Steps(state.step_loss[0], state.step_values[0], state.batch_sizes[0])
            if self.loop.schedule.learning
            else None,
        )


def _put(record: Array, value: Any, *index: Any) -> Array:
    """`record.at[index].set(value)` as a dynamic update slice, not a scatter: XLA
    compiles it in less time. The indices are in range by construction, so neither
    negative ones nor clamping need handling.
    """
    value = jnp.asarray(value, record.dtype)
    update = value.reshape((1,) * len(index) + value.shape)
    start = (*index, *(0,) * value.ndim)
    return jax.lax.dynamic_update_slice(record, update, start, allow_negative_indices=False)


def learned_state(loop: Loop, state: TrainState, first: Steps | None) -> TrainState:
    """`state` of a run that learned its epoch's length, as `loop` (the learned one)
    keeps it: the first epoch's steps so far (`first`, on the host; `None`: none) in its
    record.
    """
    schedule = loop.schedule
    members = () if loop.members is None else (loop.members,)
    shape = (*members, schedule.rows, schedule.columns)
    if first is None:
        none = (*members, 0)
        values = np.zeros((*none, len(loop.step_names)), np.float32)
        first = Steps(np.zeros(none, np.float32), values, np.zeros(none, np.int32))

    def record(steps: ArrayLike, fill: Any) -> np.ndarray:
        """A record of `steps` (`(*members, n, ...)`) as row 0 of `(*members, rows,
        columns, ...)`, filled with `fill` elsewhere.
        """
        steps = np.asarray(steps)
        rest = steps.shape[len(members) + 1 :]
        out = np.full((*shape, *rest), fill, steps.dtype)
        out[(slice(None),) * len(members) + (0, slice(0, steps.shape[len(members)]))] = steps
        return out

    logs = (*members, schedule.rows, len(loop.log_names))
    return state._replace(
        step_loss=record(first.loss, np.nan),
        step_values=record(first.values, np.nan),
        batch_sizes=record(first.batch_sizes, 0),
        epoch_values=np.full(logs, np.nan, np.float32),
    )


def epoch_means(state: TrainState, row: Int[Array, ""], loop: Loop) -> Float[Array, " values"]:
    """The epoch's values from the steps of record row `row` that ran: the loss and
    `Loop.step_names`' values.

    Each step weighs as its share of the epoch's samples: the epoch's mean loss is then the
    mean over samples, as one full-batch pass would average a mean loss. Steps skipped for
    a non-finite loss (`on_nan="skip"`) trained nothing and are left out; NaN (0 / 0) if
    no step counts. The norms are means over the steps whose update was applied (a step
    skipped by the loss scale is not); `skipped_steps` is their count; `loss_scale` and
    the hyperparameters are those of the epoch's last step.
    """

    def at_row(record: Array) -> Array:  # `row` is in range by construction
        return jax.lax.dynamic_index_in_dim(record, row, 0, False, allow_negative_indices=False)

    step_loss = at_row(state.step_loss)
    counts = jnp.isfinite(step_loss)  # NaN where no step ran, so this is false there too
    all_sizes = at_row(state.batch_sizes).astype(jnp.float32)
    sizes = jnp.where(counts, all_sizes, 0.0)
    weights = sizes / jnp.sum(sizes)
    # Full float32 precision: on GPUs a default-precision dot may round through TF32.
    precision = jax.lax.Precision.HIGHEST
    loss = jnp.dot(weights, jnp.where(counts, step_loss, 0.0), precision=precision)[None]
    names = loop.step_names
    if not names:
        return loss
    values = at_row(state.step_values)
    means = len(loop.aux_names) + len(loop.metric_names)  # the first columns
    out = [
        loss,
        jnp.dot(weights, jnp.where(counts[:, None], values[:, :means], 0.0), precision=precision),
    ]
    ran = all_sizes > 0
    applied = counts
    if "skipped_steps" in names:
        applied = counts & (values[:, names.index("skipped_steps")] == 0)
    for i, name in enumerate(names[means:], means):
        column = values[:, i]
        if name in ("grad_norm", "update_norm"):
            w = jnp.where(applied, all_sizes, 0.0)
            mean = jnp.dot(w / jnp.sum(w), jnp.where(applied, column, 0.0), precision=precision)
            out.append(mean[None])
        elif name == "skipped_steps":
            out.append(jnp.sum(jnp.where(ran, column, 0.0))[None])
        else:  # "loss_scale" and the hyperparameters: the last step's
            last = jnp.argmax(jnp.where(ran, jnp.arange(column.shape[0]), -1))
            out.append(column[last][None])
    return jnp.concatenate(out)


def make_loop(
    model: PyTree,
    filter_spec: Any,
    objects: Objects,
    schedule: Schedule,
    options: Options,
    like: PyTree,
    model_state: PyTree,
) -> tuple[Loop, list[Array], Consts]:
    """Splits the model into the arrays that train and the frozen rest, takes out the
    arrays the other objects hold, finds the aux values the loss returns (by tracing it
    on a batch shaped as `like`'s, a batch of one), and describes the run as a hashable
    `Loop`, whose values it checks against early stopping's monitor. It finds the
    hyperparameters to record in the optimizer's state, made on abstract arrays.
    """
    arrays, skeleton = split_arrays(model)
    trains = _trains(model, arrays, filter_spec)
    if not any(trains):
        raise ValueError(
            "`model` has no floating-point arrays that `filter_spec` chooses to train, so "
            f"training would change nothing (its arrays: {describe(model)[:6]})."
        )
    params = [a for a, t in zip(arrays, trains) if t]
    frozen = [a for a, t in zip(arrays, trains) if not t]
    object_arrays, objects_skeleton = split_arrays(objects)
    objective = Objective(
        objects.loss,
        objects.metrics,
        options.stateful,
        takes_key(objects.loss),
        precision=options.precision,
    )
    loop = Loop(
        model=skeleton,
        trains=trains,
        objects=objects_skeleton,
        metric_names=objective.metric_names,
        schedule=schedule,
        batch_size=schedule.batch_size,
        shuffle=options.shuffle,
        validate=options.validates,
        on_nan=options.on_nan,
        members=options.members,
        stateful=options.stateful,
        use_key=objective.use_key,
        placement=options.placement,
        stopping=options.early_stopping,
        aux_names=_aux_names(objective, model, model_state, like, schedule.batch_size, options),
        precision=options.precision,
        average=options.average,
        validate_ema=options.validate_ema,
        norms=options.norms,
        trained_dtypes=None
        if options.precision is None and options.average is None
        else tuple(np.dtype(a.dtype) for a in params),
        val_sets=options.validation_sets,
        validation_freq=options.validation_freq,
    )
    shapes = tuple((p.shape, np.dtype(p.dtype)) for p in params)
    opt_state, hyperparams = _opt_state_shape(loop, objects.optimizer, shapes)
    schedules = dict(objects.schedules)
    if schedules:
        check_schedules(schedules, opt_state)
    loop = dataclasses.replace(loop, hyperparams=hyperparams, schedule_names=tuple(schedules))
    check_names(loop, options)
    return loop, params, Consts(frozen, object_arrays)


# Cached as the programs are: tracing the optimizer's `init` is most of a warm `fit`'s
# host work otherwise, and a sweep's fits of one configuration would trace it each time.
@functools.lru_cache(maxsize=PROGRAMS)
def _opt_state_shape(
    loop: Loop,
    optimizer: optax.GradientTransformation,
    params: tuple[tuple[tuple[int, ...], np.dtype], ...],
) -> tuple[PyTree, tuple[str, ...]]:
    """The shapes of the optimizer's state for parameters of shapes and dtypes `params`
    (one member's in an ensemble), as the step sees it, and the names of the
    hyperparameters it records (`injected_names`).
    """
    drop = 0 if loop.members is None else 1
    trained = loop.params_tree([jax.ShapeDtypeStruct(s[drop:], d) for s, d in params])
    if loop.precision is not None:  # the optimizer keeps the master copy's dtypes
        trained = jax.eval_shape(loop.precision.master, trained)
    opt_state = jax.eval_shape(optimizer.init, trained)
    return opt_state, injected_names(opt_state)


def _aux_names(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    like: PyTree,
    batch_size: int,
    options: Options,
) -> tuple[str, ...]:
    """The names of the aux values the loss returns, traced on abstract arrays: a batch
    of `batch_size` samples like `like`'s, one member's model and state in an ensemble.
    """

    def abstract(x: Any, drop: int = 0, lead: tuple[int, ...] = ()) -> Any:
        if not eqx.is_array(x) and not isinstance(x, np.ndarray):
            return x
        return jax.ShapeDtypeStruct((*lead, *x.shape[drop:]), x.dtype)

    drop = 0 if options.members is None else 1
    batch = jax.tree.map(lambda x: abstract(x, 1, (batch_size,)), like)
    member = jax.tree.map(lambda x: abstract(x, drop), model)
    state = jax.tree.map(lambda x: abstract(x, drop), model_state)
    if options.members is None:
        return find_aux_names(objective, member, state, batch)
    # An ensemble: one member is traced whatever the loss, so that a single model taken
    # for a stack is refused here, saying so, not deep inside the run's trace.
    try:
        return find_aux_names(objective, member, state, batch, always=True)
    except Exception as e:
        raise not_a_stack(options.members, "`fit`", e) from e


def check_names(loop: Loop, options: Options) -> None:
    """Refuses an aux value named as a metric or a built-in history entry, a schedule or
    an injected hyperparameter named as any of these or as each other, and an early
    stopping monitor that the run does not compute.
    """
    for name in loop.aux_names:
        if name in loop.metric_names:
            raise ValueError(
                f"`loss` returns an aux value {name!r}, and `metrics` has a metric "
                f"{name!r}: the history would hold both under one name; rename one."
            )
        what = reserved_for(name)
        if what is not None:
            raise ValueError(
                f"`loss` returns an aux value {name!r}, a name the run gives to {what}; "
                f"rename it. Reserved: {reserved_names()}."
            )
    taken = {name: reserved_for(name) or "" for name in RESERVED}
    taken |= {name: f"`loss`'s aux value {name!r}" for name in loop.aux_names}
    taken |= {name: f"the metric {name!r}" for name in loop.metric_names}
    for name in loop.hyperparams:  # the optimizer's names cannot be changed; the others can
        if name in taken or name.startswith("val_"):
            raise ValueError(
                f"The optimizer's `inject_hyperparams` state holds a hyperparameter {name!r}, "
                "which the run records under that name, and so is "
                f"{taken.get(name) or reserved_for(name)}: rename it."
            )
        taken[name] = f"the optimizer's injected hyperparameter {name!r} (`inject_hyperparams`)"
    for name in loop.schedule_names:  # built-in names were refused with the options
        if name in taken:
            raise ValueError(
                f"`schedules` has a schedule {name!r}, which collides with {taken[name]} in "
                "the history; rename the schedule (or leave it out: an injected "
                "hyperparameter is recorded by itself)."
            )
    if loop.validate:
        train_names = loop.log_names[: len(loop.log_names) - len(loop.val_names)]
        check_unique(train_names, loop.val_sets, loop.aux_names, loop.metric_names)
    if loop.stopping is not None:
        check_monitor(loop.stopping.monitor, loop.log_names, options, final=True)
    policy = options.checkpoint
    if policy is not None and policy.keep_best is not None:
        what = "`checkpoint`'s `keep_best`"
        check_monitor(policy.keep_best, loop.log_names, options, final=True, what=what)


def _trains(model: PyTree, arrays: list[Any], filter_spec: Any) -> tuple[bool, ...]:
    """For each array of `model`: whether `filter_spec` chooses it and it is floating."""
    if callable(filter_spec) and jax.tree_util.treedef_is_leaf(jax.tree.structure(filter_spec)):
        chosen = [bool(filter_spec(a)) for a in arrays]
    else:  # a PyTree of bools or callables, as `eqx.partition` takes
        picked, _ = eqx.partition(model, filter_spec)
        none = lambda x: x is None  # noqa: E731
        leaves = jax.tree.leaves(model, is_leaf=none)
        kept = jax.tree.leaves(picked, is_leaf=none)
        chosen = [k is not None for leaf, k in zip(leaves, kept) if eqx.is_array(leaf)]
    return tuple(c and is_dtype(a.dtype, np.inexact) for a, c in zip(arrays, chosen))


def check_opt_state(loop: Loop, params: list[Array], opt_state: PyTree, consts: Consts) -> None:
    """Refuses an `opt_state` that is not the optimizer's state for these parameters."""
    optimizer = loop.parts(consts).optimizer
    init = optimizer.init if loop.members is None else jax.vmap(optimizer.init)
    trained = loop.params_tree(params)
    if loop.precision is not None:  # the optimizer keeps the master copy's dtypes
        trained = jax.eval_shape(loop.precision.master, trained)
    expected = jax.eval_shape(init, trained)
    given = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), opt_state)
    if jax.tree.structure(expected) != jax.tree.structure(given) or jax.tree.leaves(
        expected
    ) != jax.tree.leaves(given):
        raise ValueError(
            "`opt_state` is not this optimizer's state for the arrays that train: expected "
            f"{_summary(expected)}, got {_summary(given)}. Pass the `opt_state` of a result "
            "trained with the same optimizer (and `filter_spec`), or none."
        )


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def _summary(state: PyTree) -> str:
    """An optimizer state in a line: its outer types and its arrays."""
    kinds = (
        f"({', '.join(type(s).__name__ for s in state)})"
        if isinstance(state, tuple) and not hasattr(state, "_fields")
        else type(state).__name__
    )
    leaves = jax.tree.leaves(state)
    shapes = ", ".join(f"{x.dtype}{list(x.shape)}" for x in leaves[:4])
    more = ", ..." if len(leaves) > 4 else ""
    return f"{kinds} of {len(leaves)} arrays [{shapes}{more}]"


def lay_out_state(
    loop: Loop, optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree
) -> tuple[PyTree, PyTree]:
    """`params` (or any tree shaped like them) laid out as `shard=` asks, and `opt_state`
    (unless `None`) following them: each copy of the parameters in it (Adam's moments, say)
    laid out as they are, the rest (step counts) replicated. Constraints inside the
    program, so that XLA's partitioner places every intermediate to match.
    """
    shardings = loop.param_shardings()
    assert shardings is not None
    constrain = jax.lax.with_sharding_constraint
    params = jax.tree.map(constrain, params, shardings)
    if opt_state is not None:
        replicated = NamedSharding(loop.placement.mesh, PartitionSpec())  # pyright: ignore
        opt_state = optax.tree_map_params(
            optimizer,
            constrain,
            opt_state,
            shardings,
            transform_non_params=lambda x: constrain(x, replicated) if eqx.is_array(x) else x,
        )
    return params, opt_state
