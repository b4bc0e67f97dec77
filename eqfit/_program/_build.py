"""The run's static description built from `fit`'s checked arguments (`make_loop`), and
the checks that need the model, the loss and the optimizer: what trains, the names the
run records, the optimizer's state. What the losses and updates give, traced before the
run (the aux values a loss returns, what an update of one's own records), is
`_traces.py`'s.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, PyTree

from .._core._data import describe, dtype_of, is_dtype, num_samples, summary
from .._core._execution import choose
from .._core._metric import adds
from .._step._hyperparams import check_schedules, injected_names
from .._step._objective import LossTrace, Objective
from .._step._record import Record, record_for, UpdateInfo
from .._step._statistics import accumulated_shapes, check_split, split_statistics
from .._step._step import by_name
from .._step._updates import (
    AbstractUpdate,
    own_names,
    run_loss,
    run_traced,
    trained_spec,
    uses_key,
)
from ._ahead import steps_ahead
from ._compile import PROGRAMS
from ._jit import cached_jit
from ._loop import Loop
from ._options import (
    EARLY_STOPPING,
    monitor_hint,
    Options,
    refuse_array_monitor,
    StepOptions,
)
from ._parallel import (
    CompilerOptions,
    placement_devices,
    Pmap,
    SMALL_STEP_FLOPS,
    SMALL_STEP_OPTIONS,
)
from ._schedule import Schedule
from ._skeleton import split_arrays
from ._state import Callables, Consts, StartArgs
from ._traces import abstract_call, loss_outputs, traced_outputs, update_info


def make_loop(
    model: PyTree,
    schedule: Schedule,
    options: Options,
    like: PyTree,
    model_state: PyTree,
    opt_state: PyTree | None,
    rows: PyTree = None,
) -> tuple[Loop, StartArgs]:
    """Splits the model into the arrays that train and the frozen rest, takes out the
    arrays the other objects hold, finds the aux values the loss returns (by tracing it
    on a batch shaped as `like`'s, a batch of one), and describes the run as a hashable
    `Loop`, whose record it declares (`record_for`, which checks the names) and checks
    against early stopping's monitor. It finds the hyperparameters
    to record in the optimizer's state, made on abstract arrays, and checks a given
    `opt_state` against that state; and a metric of one's own that accumulates, on a
    few `rows` of the data (`check_additive`). Returns the `Loop` and the starting
    program's arguments.
    """
    objects, filter_spec = options.objects, options.filter_spec
    arrays, skeleton = split_arrays(model)
    check_update_options(objects.updates, options)
    specs, picked, trains = _what_trains(model, arrays, objects.updates, filter_spec)
    params = [a for a, t in zip(arrays, trains) if t]
    frozen = [a for a, t in zip(arrays, trains) if not t]
    object_arrays, objects_skeleton = split_arrays(objects)
    step = options.step
    # What the loss is traced on, to find its aux values and whether it convolves.
    traced = abstract_call(model, model_state, like, schedule.batch_size, options)
    use_key = uses_key(objects.updates)
    loss = run_loss(objects.updates, options.stateful)
    objective = Objective(
        loss, objects.metrics, options.stateful, use_key, precision=step.precision
    )
    infos, outputs = _traced_updates(objects, specs, picked, trains, traced, options, objective)
    statistics = objective.find_statistics(*traced) if objective.accumulating else ()
    if statistics and rows is not None:
        check_additive(objective, model, model_state, rows, options.members)
    loop = Loop(
        model=skeleton,
        trains=trains,
        objects=objects_skeleton,
        record=Record(),  # known once the optimizer's state is: below
        schedule=schedule,
        shuffle=options.shuffle,
        step=step,
        validation=options.validation,
        members=options.members,
        stateful=options.stateful,
        use_key=use_key,
        placement=options.placement,
        early_stopping=options.early_stopping,
        trained_dtypes=None
        if step.precision is None and step.average is None
        else tuple(np.dtype(a.dtype) for a in params),
        updates=infos,
        samples_per_step=_samples_per_step(objects.updates),
        log_every=options.log_every,
        statistics=statistics,
        ahead=steps_ahead(options.placement, schedule, options.shuffle, options.members, like),
    )
    consts = Consts(frozen, object_arrays)
    accumulated = accumulated_shapes(objective.accumulating, statistics)
    loop = _with_record(
        loop, params, object_arrays, outputs, objective.metric_names, objects, accumulated
    )
    # Traced once, if asked at all (`choose` and `_guard` ask only where they decide).
    found = functools.cache(functools.partial(traced_outputs, objective, traced, options, outputs))
    loop = _with_execution(loop, options, found)
    if loop.early_stopping is not None:
        check_monitor(loop.early_stopping.monitor, loop)
    if opt_state is not None:
        check_opt_state(loop, params, opt_state, consts)
    begin = np.int32(schedule.begin)
    return loop, StartArgs(params, opt_state, model_state, options.key, consts, begin)


def _traced_updates(
    objects: Callables,
    specs: list[PyTree],
    picked: list[tuple[bool, ...]],
    trains: tuple[bool, ...],
    traced: tuple[PyTree, PyTree, PyTree],
    options: Options,
    objective: Objective,
) -> tuple[tuple[UpdateInfo, ...], LossTrace]:
    """What the run keeps of each update (`update_info`), of the trained arrays it
    picks, and what the run's loss and metrics (`objective`) return: traced once where
    the run's loss is `fit`'s one loss, whose update's info is read off that trace;
    several updates' losses are traced one by one (`run_traced`).
    """
    run = functools.cache(functools.partial(loss_outputs, objective, traced, options))
    infos = tuple(
        update_info(
            u,
            spec,
            [p for p, t in zip(picks, trains) if t],
            traced,
            options,
            run,
            objective.metric_names,
        )
        for u, spec, picks in zip(objects.updates, specs, picked)
    )
    return infos, run_traced(objects.updates, run)


def _with_execution(loop: Loop, options: Options, found: Callable[[], LossTrace]) -> Loop:
    """`loop` with the way its steps run (`choose`), why, and XLA's options for its
    programs (`_guard`); `found()` traces the loss where one of them needs it.
    """
    schedule = loop.schedule
    platform = placement_devices(options.placement)[0].platform
    execution, why = choose(
        options.execution,
        platform=platform,
        steps_per_epoch=None if schedule.learning else schedule.steps_per_epoch,
        convolves=lambda: bool(found().convolves),
    )
    # An update of one's own does work its loss's trace does not see (a rollout): its
    # step's size is unknown.
    own = any(not info.loss for info in loop.updates)
    guard_why, compiler_options = _guard(
        options.step, platform, lambda: None if own else found().flops
    )
    return dataclasses.replace(
        loop,
        execution=execution,
        execution_why=why + guard_why,
        compiler_options=compiler_options,
    )


def _what_trains(
    model: PyTree, arrays: list[Any], updates: tuple[AbstractUpdate, ...], filter_spec: Any
) -> tuple[list[PyTree], list[tuple[bool, ...]], tuple[bool, ...]]:
    """What trains: each update's spec (`trained_spec`) and the arrays it picks, and for
    each array of `model` whether an update trains it, of those `filter_spec` chooses
    (`fit`'s `trains=` or `filter_spec=`, beside `loss=`; every floating-point array
    beside `updates=`). Refuses a model of which nothing would train.
    """
    specs = [trained_spec(model, u.trains, f"update {u.name!r}'s `trains`") for u in updates]
    floating = tuple(is_dtype(a.dtype, np.inexact) for a in arrays)
    picked = [  # an update that trains every floating-point array picks them all
        floating if u.trains is None else update_picks(model, arrays, spec)
        for u, spec in zip(updates, specs)
    ]
    chosen = _trains(model, arrays, filter_spec)
    trains = tuple(c and any(p) for c, *p in zip(chosen, *picked))
    if not any(trains):
        raise ValueError(
            "`model` has no floating-point arrays that `filter_spec` chooses to train, so "
            f"training would change nothing (its arrays: {describe(model)[:6]})."
        )
    return specs, picked, trains


def _init(loop: Loop, consts: Consts) -> Callable[[PyTree], PyTree]:
    """The optimizer state's maker from the trained arrays, for what needs only its
    shapes: each update's `init`, given a fixed key (the run's start gives each its own).
    """
    init = loop.parts(consts).init
    return lambda params: init(params, jax.random.key(0))


def _with_record(
    loop: Loop,
    params: list[Array],
    object_arrays: list[Array],
    outputs: LossTrace,
    metric_names: tuple[str, ...],
    objects: Callables,
    accumulated: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> Loop:
    """`loop` with its record declared (`record_for`, which checks the names), once the
    optimizer's state (its updates', each as its `init` makes it) is known, made on
    abstract arrays: the hyperparameters it injects, and `objects`' schedules, each
    checked at its count (each update's own).
    """
    shapes = tuple((p.shape, np.dtype(p.dtype)) for p in params)
    held = tuple((a.shape, np.dtype(a.dtype)) for a in object_arrays)
    states = by_name(loop.updates, _opt_state_shape(loop, shapes, held))
    hyperparams = _hyperparams(loop, shapes, held)
    schedules = dict(objects.schedules)
    infos = tuple(  # each update's hyperparameters, and its schedules where it has an optimizer
        i._replace(
            hyperparams=hyperparams[i.name],
            schedules=_update_schedules(i, schedules, states[i.name]),
        )
        for i in loop.updates
    )
    record = record_for(
        updates=infos,
        metric_names=metric_names,
        metric_means=tuple(n for n in outputs.means if n in metric_names),
        norms=loop.step.norms,
        scales=loop.step.scales,
        val_sets=loop.val_sets,
        accumulated=accumulated,
    )
    return dataclasses.replace(loop, updates=infos, record=record)


# Cached as the programs are: tracing the optimizer's `init` is most of a warm `fit`'s
# host work otherwise, and a sweep's fits of one configuration would trace it each time.
@functools.lru_cache(maxsize=PROGRAMS)
def _opt_state_shape(
    loop: Loop,
    params: tuple[tuple[tuple[int, ...], np.dtype], ...],
    held: tuple[tuple[tuple[int, ...], np.dtype], ...],
) -> PyTree:
    """The shapes of the optimizer's state (each update's, as its `init` makes it, with a
    fixed key) for parameters of shapes and dtypes `params` (one member's in an
    ensemble), as the step sees it; `held`: those of the arrays the run's objects hold.
    """
    drop = 0 if loop.members is None else 1
    trained = loop.params_tree([jax.ShapeDtypeStruct(s[drop:], d) for s, d in params])
    if loop.step.precision is not None:  # the optimizer keeps the master copy's dtypes
        trained = jax.eval_shape(loop.step.precision.master, trained)

    def init(objects: list[Array], params: PyTree) -> PyTree:
        return loop.parts(Consts([], objects)).init(params, jax.random.key(0))

    objects = [jax.ShapeDtypeStruct(s, d) for s, d in held]
    return jax.eval_shape(init, objects, trained)


@functools.lru_cache(maxsize=PROGRAMS)
def _hyperparams(
    loop: Loop,
    params: tuple[tuple[tuple[int, ...], np.dtype], ...],
    held: tuple[tuple[tuple[int, ...], np.dtype], ...],
) -> dict[str, tuple[str, ...]]:
    """The hyperparameters each update's optimizer injects (by the update's name), read
    from `_opt_state_shape`'s state, and cached with it: a warm `fit` walks no state.
    """
    states = by_name(loop.updates, _opt_state_shape(loop, params, held))
    return {i.name: injected_names(states[i.name]) for i in loop.updates}


# A metric's statistics are tried on this many rows of the data, whole and halved.
SPLIT_ROWS = 8
_split_statistics = cached_jit(split_statistics)


def check_additive(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    rows: PyTree,
    members: int | None = None,
) -> None:
    """Tries each metric of one's own that accumulates on a few `rows` of the data, whole
    and in two halves (`check_split`), in inference mode (one member's, of an ensemble):
    its statistics must add, or the run's sums of them would be wrong without a word.
    Nothing runs where eqfit's and metrax's are the only ones, or the data is one row.
    """
    if all(adds(metric) for _, metric in objective.accumulating):
        return
    n = min(num_samples(rows), SPLIT_ROWS) // 2 * 2
    if n < 2:
        return
    if members is not None:
        model, model_state = jax.tree.map(
            lambda a: a[0] if eqx.is_array(a) else a, (model, model_state)
        )
    rows = jax.tree.map(lambda a: a[:n], rows)
    model = eqx.nn.inference_mode(model)
    halves = _split_statistics(objective, model, model_state, rows, n // 2)
    check_split(objective.accumulating, *halves, n)


def _guard(
    step: StepOptions, platform: str, flops: Callable[[], float | None]
) -> tuple[str, CompilerOptions]:
    """The NaN guard as `fit` resolved it (`_replay.replays`), in words for `plan`'s
    `execution_why`, and XLA's options for the programs that train: on the CPU, a small
    step without the guard (its loss's products under `SMALL_STEP_FLOPS` a batch, as
    `flops()` counts them) ordered for memory (`SMALL_STEP_OPTIONS`).
    """
    if step.on_nan == "skip":
        return "", ()
    if not step.replays:
        return "; each update in a NaN guard's `cond`", ()
    why = "; no NaN guard: a non-finite step is applied, and the state before it replayed"
    counted = flops() if platform == "cpu" else None
    if counted is None or counted >= SMALL_STEP_FLOPS:
        return why, ()
    why += (
        f"; a small step ({counted:.3g} FLOPs of products a batch): XLA:CPU orders "
        "its operations for memory, not for concurrency"
    )
    return why, SMALL_STEP_OPTIONS


def check_update_options(updates: tuple[AbstractUpdate, ...], options: Options) -> None:
    """Refuses the options that several updates do not take, before anything is traced,
    saying why.
    """
    custom = own_names(updates)
    if options.validation is not None and not any(u.validation_loss() for u in updates):
        raise ValueError(
            f"Validation (`validation_data=` or `validation_split=`) with only updates of "
            f"your own ({', '.join(map(repr, custom))}), none of which has a loss: "
            "validation computes the updates' losses. Give your update a method "
            "`loss(self, model, *batch)` returning the loss its `apply` records as 'loss' "
            "(`eqfit.AbstractUpdate` says how), or train without validation."
        )
    if custom and len(custom) == len(updates):
        # Each acts on a loss's gradient step, and no update here takes one.
        acting = [
            (option, does)
            for option, does, given in (
                (
                    "norms=True",
                    "records each loss's update's gradient and update norms",
                    options.step.norms,
                ),
                (
                    "precision=",
                    "casts each loss's forward pass",
                    options.step.precision is not None,
                ),
                (
                    "remat=",
                    "checkpoints each loss's forward pass",
                    options.step.remat is not None,
                ),
            )
            if given
        ]
        if acting:
            option, does = acting[0]
            raise ValueError(
                f"`{option}` with only updates of your own ({', '.join(map(repr, custom))}): "
                f"it {does}, and an update of your own has none: its `apply` trains as it "
                f"is written. Cast, measure or checkpoint inside `apply` (recording norms as "
                f"values; `jax.checkpoint`), or train without `{option.split('=')[0]}=`."
            )
    if custom and isinstance(options.placement, Pmap):
        raise ValueError(
            f"`devices=` with update {custom[0]!r} of your own: under `devices=` each device "
            "runs the step on its share of the batch, and an update of your own would see "
            "only that share. Use `mesh=` (the program sees the whole batch), or no devices."
        )


def _update_schedules(
    info: UpdateInfo, schedules: dict[str, Any], opt_state: PyTree
) -> tuple[str, ...]:
    """The schedules a loss's update records, each at its optimizer's count (checked on
    its state's shapes, `opt_state`, and refused naming it where it counts nothing); none
    for an update of the user's own, whose state is no optimizer's.
    """
    if not schedules or not info.loss:
        return ()
    try:
        check_schedules(schedules, opt_state)
    except ValueError as e:
        raise ValueError(info.said(str(e))) from None
    return tuple(schedules)


def update_picks(model: PyTree, arrays: list[Any], spec: PyTree) -> tuple[bool, ...]:
    """For each array of `model` (`arrays`, in order): whether `spec` (an update's
    `trained_spec`) picks it.
    """
    leaves = jax.tree.leaves(model)
    picks = tuple(bool(s) for s, x in zip(jax.tree.leaves(spec), leaves) if eqx.is_array(x))
    assert len(picks) == len(arrays)
    return picks


def _samples_per_step(updates: tuple[AbstractUpdate, ...]) -> int | None:
    """The samples a step processes: the sum of its updates' `samples`, where any says."""
    said = [int(u.samples) for u in updates if u.samples is not None]
    return sum(said) if said else None


def check_monitor(monitor: str, loop: Loop, what: str = EARLY_STOPPING) -> None:
    """Refuses a monitored value (early stopping's, or `what`'s) that the run does not
    compute, saying what it computes and, where one would, which option computes it.
    """
    names = loop.log_names
    if monitor not in names:
        refuse_array_monitor(monitor, names, what)
        hint = monitor_hint(monitor, loop.validation, loop.step)
        raise ValueError(
            f"{what} is {monitor!r}, which this run does not compute; it computes "
            f"{list(names)}.{hint}"
        )


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
    one = _init(loop, consts)
    init = one if loop.members is None else jax.vmap(one)
    trained = loop.params_tree(params)
    if loop.step.precision is not None:  # the optimizer keeps the master copy's dtypes
        trained = jax.eval_shape(loop.step.precision.master, trained)
    expected = jax.eval_shape(init, trained)
    # Shapes and dtypes, not weak types: a state made of `jnp.asarray(0)` comes back from
    # a run as a plain int32.
    differs = None
    if jax.tree.structure(expected) != jax.tree.structure(given := opt_state):
        differs = "its structure differs"
    else:
        paths = jax.tree_util.tree_flatten_with_path(expected)[0]
        for (path, want), got in zip(paths, jax.tree.leaves(given)):
            if (tuple(want.shape), want.dtype) != (np.shape(got), dtype_of(got)):
                differs = (
                    f"at `opt_state{jax.tree_util.keystr(path)}` it holds "
                    f"{dtype_of(got)}{list(np.shape(got))} where {want.dtype}{list(want.shape)} "
                    "belongs"
                )
                break
    if differs is not None:
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)), opt_state)
        raise ValueError(
            f"`opt_state` is not this optimizer's state for the arrays that train ({differs}): "
            f"expected {summary(expected)}, got {summary(shapes)}. Pass the `opt_state` of a "
            "result trained with the same optimizer (and `filter_spec`), or none."
        )
