"""The run's static description built from `fit`'s checked arguments (`make_loop`), and
the checks that need the model, the loss and the optimizer: what trains, the aux values
the loss returns, the names the run records, the optimizer's state.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import Array, PyTree

from ._compile import PROGRAMS
from ._data import describe, is_dtype, not_a_stack
from ._execution import choose, loss_convolves
from ._hyperparams import check_schedules, injected_names
from ._loop import Loop
from ._objective import find_aux_names, Objective, takes_key
from ._options import EARLY_STOPPING, KEEP_BEST, monitor_hint, Options
from ._parallel import placement_devices
from ._record import Record, record_for
from ._schedule import Schedule
from ._skeleton import split_arrays
from ._state import Consts, Objects, StartArgs


def make_loop(
    model: PyTree,
    filter_spec: Any,
    objects: Objects,
    schedule: Schedule,
    options: Options,
    like: PyTree,
    model_state: PyTree,
    opt_state: PyTree | None,
) -> tuple[Loop, StartArgs]:
    """Splits the model into the arrays that train and the frozen rest, takes out the
    arrays the other objects hold, finds the aux values the loss returns (by tracing it
    on a batch shaped as `like`'s, a batch of one), and describes the run as a hashable
    `Loop`, whose record it declares (`record_for`, which checks the names) and checks
    against early stopping's and the checkpoints' monitors. It finds the hyperparameters
    to record in the optimizer's state, made on abstract arrays, and checks a given
    `opt_state` against that state. Returns the `Loop` and the starting program's
    arguments.
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
    step = options.step
    objective = Objective(
        objects.loss,
        objects.metrics,
        options.stateful,
        takes_key(objects.loss),
        precision=step.precision,
    )
    # What the loss is traced on, to find its aux values and whether it convolves.
    traced = _abstract_call(model, model_state, like, schedule.batch_size, options)
    aux_names = _aux_names(objective, traced, options)
    loop = Loop(
        model=skeleton,
        trains=trains,
        objects=objects_skeleton,
        record=Record(),  # known once the optimizer's state is: below
        schedule=schedule,
        batch_size=schedule.batch_size,
        shuffle=options.shuffle,
        step=step,
        validation=options.validation,
        members=options.members,
        stateful=options.stateful,
        use_key=objective.use_key,
        placement=options.placement,
        early_stopping=options.early_stopping,
        trained_dtypes=None
        if step.precision is None and step.average is None
        else tuple(np.dtype(a.dtype) for a in params),
    )
    shapes = tuple((p.shape, np.dtype(p.dtype)) for p in params)
    opt_shapes, hyperparams = _opt_state_shape(loop, objects.optimizer, shapes)
    schedules = dict(objects.schedules)
    record = record_for(
        aux_names=aux_names,
        metric_names=objective.metric_names,
        norms=step.norms,
        scales=step.scales,
        hyperparams=hyperparams,
        schedule_names=tuple(schedules),
        val_sets=loop.val_sets,
    )
    if schedules:
        check_schedules(schedules, opt_shapes)
    loop = dataclasses.replace(loop, record=record)
    convolves = functools.partial(_convolves, objective, traced)
    execution, why = choose(
        options.execution,
        platform=placement_devices(options.placement)[0].platform,
        steps_per_epoch=None if schedule.learning else schedule.steps_per_epoch,
        convolves=convolves,
    )
    loop = dataclasses.replace(loop, execution=execution, execution_why=why)
    if loop.early_stopping is not None:
        check_monitor(loop.early_stopping.monitor, loop)
    policy = options.checkpoint
    if policy is not None and policy.keep_best is not None:
        check_monitor(policy.keep_best, loop, what=KEEP_BEST)
    consts = Consts(frozen, object_arrays)
    if opt_state is not None:
        check_opt_state(loop, params, opt_state, consts)
    return loop, StartArgs(params, opt_state, model_state, options.key, consts)


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
    if loop.step.precision is not None:  # the optimizer keeps the master copy's dtypes
        trained = jax.eval_shape(loop.step.precision.master, trained)
    opt_state = jax.eval_shape(optimizer.init, trained)
    return opt_state, injected_names(opt_state)


def _abstract_call(
    model: PyTree, model_state: PyTree, like: PyTree, batch_size: int, options: Options
) -> tuple[PyTree, PyTree, PyTree]:
    """What the loss is traced on: one member's model and state (in an ensemble) and a
    batch of `batch_size` samples like `like`'s, as abstract arrays.
    """

    def abstract(x: Any, drop: int = 0, lead: tuple[int, ...] = ()) -> Any:
        if not eqx.is_array(x) and not isinstance(x, np.ndarray):
            return x
        return jax.ShapeDtypeStruct((*lead, *x.shape[drop:]), x.dtype)

    drop = 0 if options.members is None else 1
    batch = jax.tree.map(lambda x: abstract(x, 1, (batch_size,)), like)
    member = jax.tree.map(lambda x: abstract(x, drop), model)
    state = jax.tree.map(lambda x: abstract(x, drop), model_state)
    return member, state, batch


def _convolves(objective: Objective, traced: tuple[PyTree, PyTree, PyTree]) -> bool:
    """Whether the loss convolves (`loss_convolves`), traced on `traced` (`_abstract_call`'s);
    `False` for a loss that fails to trace, which the run's own trace then reports, with
    the batch that it meets.
    """
    try:
        return loss_convolves(objective, *traced)
    except Exception:
        return False


def _aux_names(
    objective: Objective, traced: tuple[PyTree, PyTree, PyTree], options: Options
) -> tuple[str, ...]:
    """The names of the aux values the loss returns, traced on `traced` (`_abstract_call`'s:
    one member's model and state in an ensemble, and a batch).
    """
    member, state, batch = traced
    if options.members is None:
        return find_aux_names(objective, member, state, batch)
    # An ensemble: one member is traced whatever the loss, so that a single model taken
    # for a stack is refused here, saying so, not deep inside the run's trace.
    try:
        return find_aux_names(objective, member, state, batch, always=True)
    except Exception as e:
        raise not_a_stack(options.members, "`fit`", e) from e


def trained_parts(model: PyTree, trains: Callable[[Any], Any], filter_spec: Any) -> PyTree:
    """`fit`'s `trains` as a filter spec: a PyTree of bools shaped as `model`, `True`
    inside the parts `trains(model)` picks (as `eqx.tree_at`'s `where`) and `False`
    elsewhere. Refuses `trains` beside a `filter_spec` of the caller's, a `trains` that
    picks nothing of the model, and one that picks no floating-point array.
    """
    if filter_spec is not eqx.is_inexact_array:
        raise ValueError(
            "`trains` and `filter_spec` both say what trains: give one of them (`trains` "
            "picks parts of the model by name, `filter_spec` is `eqx.partition`'s)."
        )
    nothing = jax.tree.map(lambda _: False, model)

    def everything(part: Any) -> Any:
        return jax.tree.map(lambda _: True, part)

    try:
        spec = eqx.tree_at(trains, nothing, replace_fn=everything)
    except Exception as e:
        raise ValueError(
            "`trains` must pick parts of the model, as `eqx.tree_at`'s `where` does "
            f"(`lambda m: m.student`), but calling it on the model failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    chosen = [
        bool(s) and eqx.is_inexact_array(a)
        for s, a in zip(jax.tree.leaves(spec), jax.tree.leaves(model))
    ]
    if not any(chosen):
        raise ValueError(
            "`trains` picks no floating-point array of the model, so training would change "
            "nothing: pick the parts that hold its weights (`lambda m: m.student`)."
        )
    return spec


def check_monitor(monitor: str, loop: Loop, what: str = EARLY_STOPPING) -> None:
    """Refuses a monitored value (early stopping's, or `what`'s) that the run does not
    compute, saying what it computes and, where one would, which option computes it.
    """
    names = loop.log_names
    if monitor not in names:
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
    optimizer = loop.parts(consts).optimizer
    init = optimizer.init if loop.members is None else jax.vmap(optimizer.init)
    trained = loop.params_tree(params)
    if loop.step.precision is not None:  # the optimizer keeps the master copy's dtypes
        trained = jax.eval_shape(loop.step.precision.master, trained)
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
