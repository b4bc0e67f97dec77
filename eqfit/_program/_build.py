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
from .._step._record import LOSS, Record, record_for, UpdateInfo
from .._step._signatures import takes_key
from .._step._statistics import accumulated_shapes, check_split, split_statistics
from .._step._updates import AbstractUpdate, builtin, trained_spec, validation_loss
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
    if objects.updates:
        check_update_options(objects.updates, options)
    specs, picked, trains = _what_trains(model, arrays, objects.updates, filter_spec)
    params = [a for a, t in zip(arrays, trains) if t]
    frozen = [a for a, t in zip(arrays, trains) if not t]
    object_arrays, objects_skeleton = split_arrays(objects)
    step = options.step
    # What the loss is traced on, to find its aux values and whether it convolves.
    traced = abstract_call(model, model_state, like, schedule.batch_size, options)
    infos = tuple(
        update_info(u, spec, [p for p, t in zip(picks, trains) if t], traced, options)
        for u, spec, picks in zip(objects.updates, specs, picked)
    )
    use_key = _uses_key(objects)
    objective = Objective(
        objects.loss, objects.metrics, options.stateful, use_key, precision=step.precision
    )
    # Several updates' losses are traced one by one (`update_info`).
    outputs = LossTrace((), ()) if infos else loss_outputs(objective, traced, options)
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
    # The optimizer's `init` (the user's object's, so that its state's shapes are cached
    # for the next `fit`); several updates' each made by its `init`, with a fixed key.
    init = objects.optimizer.init if objects.optimizer is not None else _init(loop, consts)
    accumulated = accumulated_shapes(objective.accumulating, statistics)
    loop = _with_record(loop, init, params, outputs, objective.metric_names, objects, accumulated)
    # Traced once, if asked at all (`choose` and `_guard` ask only where they decide).
    found = functools.cache(functools.partial(traced_outputs, objective, traced, options, outputs))
    loop = _with_execution(loop, options, found)
    if loop.early_stopping is not None:
        check_monitor(loop.early_stopping.monitor, loop)
    if opt_state is not None:
        check_opt_state(loop, params, opt_state, consts)
    return loop, StartArgs(params, opt_state, model_state, options.key, consts)


def _uses_key(objects: Callables) -> bool:
    """Whether the step makes a key: for an update of the user's own, or a loss (each
    update's, or `fit`'s one) that takes one.
    """
    if objects.updates:
        # An update of the user's own gets a key; a loss's, where the loss takes one.
        return any((b := builtin(u)) is None or takes_key(b.loss) for u in objects.updates)
    return takes_key(objects.loss)


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
    """What trains: with several updates each one's spec (`trained_spec`) and the arrays
    it picks, and for each array of `model` whether any update (or `filter_spec`, with one
    loss) trains it. Refuses a model of which nothing would train.
    """
    specs = [trained_spec(model, u.trains, f"update {u.name!r}'s `trains`") for u in updates]
    picked = [update_picks(model, arrays, spec) for spec in specs]
    trains = tuple(map(any, zip(*picked))) if picked else _trains(model, arrays, filter_spec)
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
    init: Callable[[PyTree], PyTree],
    params: list[Array],
    outputs: LossTrace,
    metric_names: tuple[str, ...],
    objects: Callables,
    accumulated: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> Loop:
    """`loop` with its record declared (`record_for`, which checks the names), once the
    optimizer's state (the run's, or its updates' by name, as `init` makes it) is known,
    made on abstract arrays: the hyperparameters it injects, and `objects`' schedules,
    each checked at its count (each update's, by name).
    """
    shapes = tuple((p.shape, np.dtype(p.dtype)) for p in params)
    opt_shapes, hyperparams = _opt_state_shape(loop, init, shapes)
    schedules = dict(objects.schedules)
    infos = loop.updates
    if infos:  # each update's hyperparameters, and its schedules where it has an optimizer
        infos = tuple(
            i._replace(
                hyperparams=injected_names(opt_shapes[i.name]),
                schedules=_update_schedules(i, schedules, opt_shapes[i.name]),
            )
            for i in infos
        )
    metric_means = tuple(n for n in outputs.means if n in metric_names)
    # `fit`'s one loss: its update, unnamed, as the step runs it (`Loop.unnamed_update`).
    values = (LOSS.name, *outputs.aux_names)
    unnamed = UpdateInfo(
        name="",
        every=1,
        picks=(),
        loss=True,
        values=values,
        hyperparams=hyperparams,
        means=tuple(n for n in outputs.means if n not in metric_means),
        validated=values,
        schedules=tuple(schedules),
    )
    record = record_for(
        updates=infos or (unnamed,),
        metric_names=metric_names,
        metric_means=metric_means,
        norms=loop.step.norms,
        scales=loop.step.scales,
        val_sets=loop.val_sets,
        accumulated=accumulated,
    )
    if schedules and not infos:
        check_schedules(schedules, opt_shapes)
    return dataclasses.replace(loop, updates=infos, record=record)


# Cached as the programs are: tracing the optimizer's `init` is most of a warm `fit`'s
# host work otherwise, and a sweep's fits of one configuration would trace it each time.
@functools.lru_cache(maxsize=PROGRAMS)
def _opt_state_shape(
    loop: Loop,
    init: Callable[[PyTree], PyTree],
    params: tuple[tuple[tuple[int, ...], np.dtype], ...],
) -> tuple[PyTree, tuple[str, ...]]:
    """The shapes of the optimizer's state for parameters of shapes and dtypes `params`
    (one member's in an ensemble), as the step sees it, and the names of the
    hyperparameters it records (`injected_names`).
    """
    drop = 0 if loop.members is None else 1
    trained = loop.params_tree([jax.ShapeDtypeStruct(s[drop:], d) for s, d in params])
    if loop.step.precision is not None:  # the optimizer keeps the master copy's dtypes
        trained = jax.eval_shape(loop.step.precision.master, trained)
    opt_state = jax.eval_shape(init, trained)
    return opt_state, injected_names(opt_state)


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
    custom = [u.name for u in updates if builtin(u) is None]
    if options.validation is not None and not any(map(validation_loss, updates)):
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
        raise ValueError(f"Update {info.name!r}: {e}") from None
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
