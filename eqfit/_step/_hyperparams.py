"""The optimizer's hyperparameters, recorded every step: those that
`optax.inject_hyperparams` keeps in its state, and schedules evaluated at the optimizer's
step count (`fit(..., schedules=)`).

Both are found by their names in the optimizer's state, anywhere in it (inside
`optax.chain`, `optax.MultiSteps`, `optax.multi_transform`), with optax's own
`tree_get_all_with_path`: once before the run on the state's shapes, for the names, and
then inside the step on the state itself, in the same order, since the state keeps its
structure from step to step.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree
from optax.tree_utils import NamedTupleKey, tree_get_all_with_path


# The states of `optax.inject_hyperparams` (the first, deprecated, is what older optax made).
_INJECTED = ("InjectHyperparamsState", "InjectStatefulHyperparamsState")
# Where a state counts its updates: `optax.MultiSteps` counts the inner optimizer's in
# `gradient_step` (its `count`s would be those of its inner state, or none), others in
# `count`.
_COUNTS = ("gradient_step", "count")


def _injected(opt_state: PyTree, scalar: bool = True) -> list[tuple[tuple[Any, ...], str, Any]]:
    """Each numeric scalar hyperparameter of each `inject_hyperparams` state in
    `opt_state` (with `scalar=False`, those of any shape: an ensemble's, stacked), as
    `(path of its state, name, value)`: the states in the order optax finds them (outer
    first, then in flattening order), the names of each sorted.
    """

    def injected(path: tuple[Any, ...], value: Any) -> bool:
        last = path[-1] if path else None
        return isinstance(last, NamedTupleKey) and last.tuple_name in _INJECTED

    found = []
    for path, hyperparams in tree_get_all_with_path(opt_state, "hyperparams", injected):
        for name in sorted(hyperparams):
            value = hyperparams[name]
            if _numeric(value) and (np.shape(value) == () or not scalar):
                found.append((path[:-1], name, value))
    return found


def _numeric(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.number)


def injected_arrays(opt_state: PyTree) -> dict[str, np.ndarray]:
    """The numeric hyperparameters that `inject_hyperparams` states in `opt_state` hold,
    of any shape (an ensemble's, one a member), on the host, by the path of each's state
    and its name (`"learning_rate"`, `"inner_states/b/inner_state/learning_rate"`).
    """
    return {
        "/".join(filter(None, (_path_name(path), name))): np.asarray(value)
        for path, name, value in _injected(opt_state, scalar=False)
    }


def with_injected(opt_state: PyTree, like: PyTree) -> PyTree:
    """`opt_state` with the numeric hyperparameters of its `inject_hyperparams` states
    (the values its updates use) taken from `like`, a state of the same structure.
    """
    kept = lambda x: type(x).__name__ in _INJECTED  # noqa: E731

    def take(state: Any, new: Any) -> Any:
        if not kept(state):
            return state
        hyperparams = {
            k: new.hyperparams[k] if _numeric(v) else v for k, v in state.hyperparams.items()
        }
        inner = with_injected(state.inner_state, new.inner_state)
        return state._replace(hyperparams=hyperparams, inner_state=inner)

    return jax.tree.map(take, opt_state, like, is_leaf=kept)


def injected_names(opt_state: PyTree) -> tuple[str, ...]:
    """The names under which the run records the hyperparameters that `inject_hyperparams`
    states in `opt_state` (its shapes will do: `jax.eval_shape(optimizer.init, params)`)
    hold, in `injected_values`' order.

    A hyperparameter is recorded by its name (`"learning_rate"`); one whose name an
    earlier state has taken already, by the path of its own state in the optimizer's
    state and its name, joined by `/` (`"inner_states/b/inner_state/learning_rate"` in
    `optax.multi_transform`'s second injected optimizer).
    """
    names: list[str] = []
    for path, name, _ in _injected(opt_state):
        if name in names:
            name = f"{_path_name(path)}/{name}"
        names.append(name)
    return tuple(names)


def _path_name(path: tuple[Any, ...]) -> str:
    """`inner_states/b/inner_state`: optax's path, its named tuples' fields by name."""
    keys = tuple(
        jax.tree_util.GetAttrKey(k.name) if isinstance(k, NamedTupleKey) else k for k in path
    )
    return jax.tree_util.keystr(keys, simple=True, separator="/")


def injected_values(opt_state: PyTree) -> list[Array]:
    """The values of `injected_names`' hyperparameters in `opt_state`, in order: after an
    update, those that `inject_hyperparams` used for it.
    """
    return [jnp.asarray(value) for _, _, value in _injected(opt_state)]


def step_count(opt_state: PyTree) -> Any:
    """The optimizer's count of its updates in `opt_state` (a scalar integer, or its
    shape): the first `gradient_step` (`optax.MultiSteps`'s count of the inner
    optimizer's updates) found in it, else its first `count`; `None` if it holds neither.
    """

    def scalar_integer(path: tuple[Any, ...], value: Any) -> bool:
        dtype = getattr(value, "dtype", None)
        return dtype is not None and jnp.issubdtype(dtype, jnp.integer) and np.shape(value) == ()

    for key in _COUNTS:
        found = tree_get_all_with_path(opt_state, key, scalar_integer)
        if found:
            return found[0][1]
    return None


def check_schedules(schedules: Mapping[str, Callable[[Any], Any]], opt_state: PyTree) -> Any:
    """Refuses `schedules` where the optimizer's state (`opt_state`, its shapes) counts
    no updates, or a schedule that does not give a scalar number for the count.

    **Returns:**

    The count (its shape), which the schedules are evaluated at.
    """
    count = step_count(opt_state)
    if count is None:
        raise ValueError(
            "`schedules` are evaluated at the optimizer's count of its updates, but the "
            "optimizer's state holds none (no `count` in it, as `optax.sgd(0.1)`'s). Give "
            "the optimizer its schedule (`optax.sgd(schedule)`), or wrap it in "
            "`optax.inject_hyperparams`, whose values the run records by themselves."
        )
    for name, schedule in schedules.items():
        try:
            out = jax.eval_shape(schedule, count)
        except Exception as e:
            e.add_note(f"while eqfit traced `schedules[{name!r}]` on the optimizer's count")
            raise
        dtype = getattr(out, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.number) or np.shape(out) != ():
            raise ValueError(
                f"`schedules[{name!r}]` must return a scalar number for a step count, got {out!r}."
            )
    return count


def schedule_values(
    schedules: tuple[Callable[[Any], Any], ...], opt_state: PyTree
) -> list[Float[Array, ""]]:
    """Each schedule at the count of updates in `opt_state` (`step_count`'s; the state
    before the step's update: the count that update uses), in float32.
    """
    if not schedules:
        return []
    count = step_count(opt_state)
    assert count is not None  # `check_schedules` saw to that
    return [jnp.asarray(schedule(count), jnp.float32) for schedule in schedules]
