"""What the run's losses and updates give, found before the run by tracing them once on
abstract arrays (`abstract_call`'s: one member's model and state, and a batch): the aux
values and weighted means a loss returns, whether it convolves and its FLOPs
(`loss_outputs`, `traced_outputs`); and what a run keeps of each update (`update_info`):
a loss's aux names, or the values an update of the user's own records.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from .._core._data import not_a_stack
from .._step._objective import abstract_key, find_outputs, LossTrace, Objective
from .._step._record import LOSS, UpdateInfo
from .._step._signatures import takes_key
from .._step._update_checks import check_applied
from .._step._updates import AbstractUpdate, info_of
from ._options import Options


def abstract_call(
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


def traced_outputs(
    objective: Objective,
    traced: tuple[PyTree, PyTree, PyTree],
    options: Options,
    outputs: LossTrace,
) -> LossTrace:
    """What the loss (with several updates, their losses as one) computes, whether it
    convolves and its products' FLOPs: from the trace that found its `outputs`, or where
    none was made (eqfit's own loss, or several updates' losses), from one made now
    (cached with them); unknown (`None`) for losses that fail to trace, which the run's
    own trace then reports, with the batch that it meets.
    """
    if outputs.convolves is not None:
        return outputs
    try:
        return loss_outputs(objective, traced, options, always=True)
    except Exception:
        return outputs


def loss_outputs(
    objective: Objective,
    traced: tuple[PyTree, PyTree, PyTree],
    options: Options,
    always: bool = False,
) -> LossTrace:
    """What the loss returns (`find_outputs`), traced on `traced` (`abstract_call`'s: one
    member's model and state in an ensemble, and a batch); eqfit's own losses only where
    `always`.
    """
    member, state, batch = traced
    if options.members is None:
        return find_outputs(objective, member, state, batch, always)
    # An ensemble: one member is traced whatever the loss, so that a single model taken
    # for a stack is refused here, saying so, not deep inside the run's trace.
    try:
        return find_outputs(objective, member, state, batch, always=True)
    except Exception as e:
        raise not_a_stack(options.members, "`fit`", e) from e


# What an update of the user's own records, found by tracing it (`update_info`), by the
# update and the shapes it was traced on: a second `fit` traces nothing.
_OWN_UPDATES: dict[tuple[Any, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def update_info(
    update: AbstractUpdate,
    spec: PyTree,
    picks: list[bool],
    traced: tuple[PyTree, PyTree, PyTree],
    options: Options,
    run: Callable[[], LossTrace],
    metric_names: tuple[str, ...],
) -> UpdateInfo:
    """What a run keeps of an update, static (`info_of`): for a loss's update the aux
    names its loss returns (`fit`'s one loss: those of `run()`, the trace of the run's
    loss and metrics); for a user's own the names of the values its `apply` records
    (traced once, on abstract arrays).
    """
    return info_of(
        update,
        tuple(picks),
        lambda objective: loss_outputs(objective, traced, options),
        run,
        lambda: _own_update_info(update, spec, picks, traced, options),
        options.stateful,
        options.step.precision,
        metric_names,
    )


def _own_update_info(
    update: AbstractUpdate,
    spec: PyTree,
    picks: list[bool],
    traced: tuple[PyTree, PyTree, PyTree],
    options: Options,
) -> UpdateInfo:
    """What a run keeps of an update of the user's own: the names of the values its
    `apply` records, traced once on abstract arrays, and those validation computes.
    """
    member, state, batch = traced
    batch = batch if options.step.batch else None  # no data: the step hands `None`
    try:  # traced once for the same update on arrays of the same shapes
        cache_key = (update, *map(abstract_key, (spec, member, state, batch)))
        hash(cache_key)
    except TypeError:  # an update that holds arrays, say: traced every time
        cache_key = None
    validated = _validated(update, traced, options)
    if cache_key is not None and cache_key in _OWN_UPDATES:
        names, means = _OWN_UPDATES[cache_key]
        return _own_info(update, picks, names, means, validated)

    def values(model: PyTree, model_state: PyTree, batch: PyTree) -> None:
        kwargs = {"key": jax.random.key(0)} if takes_key(update.init) else {}
        own = update.init(eqx.filter(model, spec), **kwargs)
        try:
            out = update.apply(model, own, batch, model_state=model_state, key=jax.random.key(0))
        except (TypeError, IndexError, AttributeError, KeyError) as e:
            if options.step.batch:
                raise
            raise ValueError(
                f"Update {update.name!r}'s `apply` failed on `batch=None`, which it gets "
                "where `fit` has no data (`data=None`): an update that reads a batch needs "
                f"`data`; one that makes its own (a rollout) must not read it. The error: "
                f"{type(e).__name__}: {e}"
            ) from e
        found.append(check_applied(update, model, spec, own, model_state, out))

    found: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    eqx.filter_eval_shape(values, member, state, batch)
    names, means = found[0]
    if cache_key is not None:
        if len(_OWN_UPDATES) >= 64:
            _OWN_UPDATES.pop(next(iter(_OWN_UPDATES)))
        _OWN_UPDATES[cache_key] = found[0]
    return _own_info(update, picks, names, means, validated)


def _validated(
    update: AbstractUpdate, traced: tuple[PyTree, PyTree, PyTree], options: Options
) -> tuple[str, ...]:
    """The values of an update of the user's own that validation computes, by its own
    names: its `loss` method's value (`"loss"`) and aux values, found by tracing it as
    `fit`'s loss is; none without such a method.
    """
    loss = update.validation_loss()
    if loss is None:
        return ()
    objective = Objective(loss, (), options.stateful, takes_key(loss))
    return (LOSS.name, *loss_outputs(objective, traced, options, always=True).aux_names)


def _own_info(
    update: AbstractUpdate,
    picks: list[bool],
    names: tuple[str, ...],
    means: tuple[str, ...],
    validated: tuple[str, ...],
) -> UpdateInfo:
    """What a run keeps of an update of the user's own, refusing a `loss` method whose
    values its `apply` does not record (validation's values are training's, on other data).
    """
    missing = [n for n in validated if n not in names]
    if missing:
        raise ValueError(
            f"Update {update.name!r}'s `loss` method returns {list(validated)}, but its "
            f"`apply` records {list(names)}, without {missing}: validation computes its loss "
            "as training records it (`val_<name>_loss` beside `<name>_loss`), so `apply` must "
            "record the same values by the same names (its loss as 'loss')."
        )
    return UpdateInfo(
        update.name, update.every, tuple(picks), False, names, means=means, validated=validated
    )
