"""The checks of `fit(..., updates=)` made before the run: the list of updates
(`check_updates`), and what an update of the user's own gives on abstract arrays
(`check_applied`): its state, the model it returns, the values it records.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from .._core._data import dtype_of, summary
from ._turn import kind_of, NAME, recorded
from ._updates import AbstractUpdate


def check_applied(
    update: AbstractUpdate, model: Any, spec: PyTree, state: Any, model_state: Any, out: Any
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Checks, on abstract arrays before the run, what an update of one's own gives: its
    `init`'s `state` (a PyTree of arrays), and its `apply`'s `out` (`recorded`) on
    `model` and `model_state`: the model's arrays outside the parts it trains (`spec`)
    and its other fields must come back as they were given (`fit` keeps only the arrays
    it trains), those it trains with their shapes and dtypes, and the model state and
    its own state as they were made. Returns the names it records and those that are
    weighted means.
    """
    bad = [x for x in jax.tree.leaves(state) if not (eqx.is_array(x) or isinstance(x, int | float))]
    if bad:
        raise TypeError(
            f"Update {update.name!r}'s `init` returned a state holding {kind_of(bad[0])}: its "
            "state must be a PyTree of arrays (or `None`), which `fit` carries from step to "
            "step and checkpoints."
        )
    values, weights = recorded(update, out)
    given = jax.tree_util.tree_flatten_with_path(model)
    back, treedef = jax.tree.flatten(out.model)
    if treedef != given[1]:
        raise TypeError(
            f"Update {update.name!r}'s `apply` returned a model of another structure than "
            "the one it was given: return the model with its parts replaced "
            "(`eqx.tree_at(lambda m: m.target, model, new_target)`)."
        )
    trains = jax.tree.leaves(spec)
    reshaped = [
        f"model{jax.tree_util.keystr(path)}: {dtype_of(y)}{list(np.shape(y))} where "
        f"{dtype_of(x)}{list(np.shape(x))} was"
        for (path, x), y, t in zip(given[0], back, trains)
        if t and (np.shape(y) != np.shape(x) or dtype_of(y) != dtype_of(x))
    ]
    if reshaped:
        raise TypeError(
            f"Update {update.name!r}'s `apply` returned arrays it trains of another shape or "
            f"dtype than it was given ({'; '.join(reshaped[:3])}): `fit` carries them from "
            "step to step, so each keeps its shape and dtype."
        )
    moved = [
        jax.tree_util.keystr(path)
        for (path, x), y, t in zip(given[0], back, trains)
        if not t and y is not x and (eqx.is_array(x) or eqx.is_array(y) or not _same(x, y))
    ]
    if moved:
        shown = ", ".join(f"model{p}" for p in moved[:3]) + (", ..." if len(moved) > 3 else "")
        raise ValueError(
            f"Update {update.name!r}'s `apply` changed the model outside the arrays it "
            f"`trains` ({shown}): `fit` keeps only the arrays an update trains, so those "
            "changes would be lost. Widen its `trains` to hold them, or give them back as they "
            "came (`eqx.tree_at` replaces only the parts it names)."
        )

    def shapes(tree: Any) -> tuple[Any, list[tuple[Any, ...]]]:
        leaves, treedef = jax.tree.flatten(tree)
        return treedef, [(np.shape(x), dtype_of(x)) for x in leaves]

    if shapes(out.model_state) != shapes(model_state):
        raise TypeError(
            f"Update {update.name!r}'s `apply` returned a model state unlike the one it was "
            f"given ({summary(out.model_state)} against {summary(model_state)}): give back "
            "the model state it was given, or the one its model's stateful layers return "
            "(`None` without `fit(..., state=)`)."
        )
    if shapes(out.state) != shapes(state):
        raise TypeError(
            f"Update {update.name!r}'s `apply` returned a state unlike the one it was given "
            f"(its `init`'s): {summary(out.state)} against {summary(state)}. `fit` carries "
            "the state from step to step, so its structure, shapes and dtypes must stay."
        )
    return tuple(sorted(values)), tuple(sorted(weights))


def _same(x: Any, y: Any) -> bool:
    """Whether two of a model's fields that are no arrays are the same (equal)."""
    try:
        return bool(x == y)
    except Exception:  # no comparison to make: a new object
        return False


def check_updates(updates: Any) -> tuple[AbstractUpdate, ...]:
    """Refuses `updates` that are not a non-empty sequence of updates with distinct names
    that are words, naming what is wrong.
    """
    if isinstance(updates, AbstractUpdate) or not isinstance(updates, Sequence) or not updates:
        raise TypeError(
            "`updates` must be a non-empty list of updates, run in order each step "
            "(`[eqfit.Update('d', d_loss, opt_d, trains=...), eqfit.Update('g', ...)]`), "
            f"got {type(updates).__name__}."
        )
    seen: set[str] = set()
    for i, update in enumerate(updates):
        if not isinstance(update, AbstractUpdate):
            raise TypeError(
                f"`updates[{i}]` must be an `eqfit.Update` (or an `eqfit.AbstractUpdate` "
                f"of your own), got {type(update).__name__}."
            )
        name = update.name
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(
                f"`updates[{i}]` is named {name!r}: an update's name begins the history's "
                "names of its values (`d_loss`), so it must be a letter, then letters, digits "
                "and underscores (such as 'd', 'g' or 'critic')."
            )
        if name in seen:
            raise ValueError(
                f"`updates` has two updates named {name!r}: each records its values and "
                "keeps its optimizer's state under its name, so the names must differ."
            )
        seen.add(name)  # `every` and `samples` each update checked when it was made
    return tuple(updates)
