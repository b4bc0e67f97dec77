"""What the run calls and what it trains, checked from `fit`'s arguments: its updates,
`loss=` and `optimizer=` made one, unnamed (`callables` → `Callables`), the schedules
(`as_schedules`), the trained arrays' filter spec (`trained_filter`), and a run given
no data, whose updates make their own (`check_no_data`, `no_data`).
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import numpy as np
import optax

from .._step._update_checks import check_updates
from .._step._updates import AbstractUpdate, refuse_without_data, trained_spec, Update
from ._compile import PROGRAMS
from ._state import Callables


def no_data(steps_per_epoch: int) -> tuple[np.ndarray]:
    """What `fit` trains on when it is given no data: a row of no values for each step of
    an epoch, taken one a step (`batch_size` 1, in order); the step hands its updates
    `batch=None`.
    """
    return (np.zeros((steps_per_epoch, 0), np.float32),)


def check_no_data(
    updates: Any,
    steps_per_epoch: Any,
    batch_size: Any,
    validates: bool,
    metrics: Any,
    mesh: Any,
    devices: Any,
) -> None:
    """Refuses `data=None` but with updates of one's own that make their data (a
    rollout), and `steps_per_epoch`; and the options that need a batch.
    """
    if updates is None:
        raise TypeError(
            "`data` is None, but `loss=` is computed on batches of data: give `data`, or "
            "train with `updates=[...]` of your own that make their data (a rollout in a JAX "
            "environment), and `steps_per_epoch=`."
        )
    refuse_without_data(updates if isinstance(updates, Sequence) else ())
    if steps_per_epoch is None:
        raise ValueError(
            "`data` is None, so `fit` cannot count an epoch's steps from it: give "
            "`steps_per_epoch=` (each step runs every update once)."
        )
    given = [
        name
        for name, value in (
            ("batch_size", batch_size is not None),
            ("validation_data", validates),
            ("metrics", bool(metrics)),
            ("mesh", mesh is not None),
            ("devices", devices is not None),
        )
        if value
    ]
    if given:
        raise ValueError(
            f"`{given[0]}=` with `data=None`: it acts on batches of data, and this run has "
            "none (its updates make their own); leave it out."
        )


def callables(
    loss: Any,
    optimizer: Any,
    updates: Any,
    metrics: Any,
    schedules: tuple[tuple[str, Callable[[Any], Any]], ...],
) -> Callables:
    """What the run calls: its updates, `updates` (several in turn), or `loss` and
    `optimizer` made one, `eqfit.Update("", loss, optimizer)`, unnamed. Refuses both, or
    neither.
    """
    metrics = tuple((metrics or {}).items())
    if updates is None:
        if loss is None or optimizer is None:
            missing = " and ".join(
                n for n, v in (("loss", loss), ("optimizer", optimizer)) if v is None
            )
            raise TypeError(
                f"`fit` needs `{missing}`: a loss and an optimizer (one update each step), "
                "or `updates=[eqfit.Update(name, loss, optimizer), ...]` (several in turn)."
            )
        return Callables(metrics, schedules, (_unnamed(loss, plain_optimizer(optimizer)),))
    given = [n for n, v in (("loss", loss), ("optimizer", optimizer)) if v is not None]
    if given:
        raise ValueError(
            f"`updates` and `{'` and `'.join(given)}` both say how the model trains: give "
            "`loss=` and `optimizer=` for one update each step, or `updates=` for several "
            "(each an `eqfit.Update(name, loss, optimizer)` with its own)."
        )
    checked: tuple[AbstractUpdate, ...] = check_updates(updates)
    return Callables(metrics, schedules, checked)


def _unnamed(loss: Any, optimizer: Any) -> Update:
    """`eqfit.Update("", loss, optimizer)`, the one made for these objects before where
    they hash (the same object for a sweep's fits of one configuration, its checks run
    once).
    """
    try:
        return _cached_unnamed(loss, optimizer)
    except TypeError:  # an object that does not hash: made anew
        return Update("", loss, optimizer)


@functools.lru_cache(maxsize=PROGRAMS)
def _cached_unnamed(loss: Any, optimizer: Any) -> Update:
    return Update("", loss, optimizer)


def trained_filter(model: Any, trains: Any, filter_spec: Any, updates: Any) -> Any:
    """What trains, as `eqx.partition`'s filter spec: `filter_spec`, or the parts `trains`
    picks (as `eqx.tree_at`'s `where`). Refuses both, and either beside `updates`, each
    of which says what it trains.
    """
    given = filter_spec is not eqx.is_inexact_array
    if updates is not None and (trains is not None or given):
        what = "trains" if trains is not None else "filter_spec"
        raise ValueError(
            f"`updates` and `{what}` both say what trains: with `updates=`, each update "
            "says what it trains (`eqfit.Update(..., trains=lambda m: m.generator)`)."
        )
    if trains is None:
        return filter_spec
    if given:
        raise ValueError(
            "`trains` and `filter_spec` both say what trains: give one of them (`trains` "
            "picks parts of the model by name, `filter_spec` is `eqx.partition`'s)."
        )
    return trained_spec(model, trains, "`trains`")


def as_schedules(schedules: Any) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """`schedules` as `(name, schedule)` pairs, refusing what is not a mapping of names
    to functions. (Their names are checked with every recorded value's, `record_for`.)
    """
    if schedules is None:
        return ()
    if not isinstance(schedules, Mapping):
        raise TypeError(
            "`schedules` must map names to schedules, functions of the optimizer's step "
            f"count (`{{'learning_rate': optax.cosine_decay_schedule(1e-3, 1000)}}`), got a "
            f"{type(schedules).__name__}."
        )
    for name, schedule in schedules.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"`schedules` must be keyed by names (strings), got {name!r}.")
        if not callable(schedule):
            raise TypeError(
                f"`schedules[{name!r}]` must be a schedule, a function of the step count "
                f"(such as `optax.linear_schedule(...)`), got a {type(schedule).__name__}."
            )
    return tuple(schedules.items())


def plain_optimizer(optimizer: Any) -> optax.GradientTransformation:
    """`optimizer` as a plain transformation (`optax.MultiSteps` unwrapped)."""
    if isinstance(optimizer, optax.MultiSteps):
        return optimizer.gradient_transformation()
    return optimizer
