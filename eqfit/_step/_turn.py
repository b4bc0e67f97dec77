"""An update's turn in `fit`'s step, by its parts: what its `apply` gives back
(`Applied`), its turn as the step takes it (`Turn`), what the step gives its `apply`
(`Given`, read by `given`), the values an update of one's own records, checked
(`recorded`), and what an update trains (`trained_spec`) and how often (`check_every`).
"""

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PyTree

from .._core._checks import real_dtype
from .._core._typing import ArrayTree
from ._descent import UpdateContext
from ._labels import LabelError
from ._mean import Mean
from ._precision import LossScale
from ._record import UpdateInfo


# An update's name begins the history's names of its values (`d_loss`): a word.
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


class Applied(NamedTuple):
    """What an update gives back: the model after it, its own state, the model state
    (`None` without `fit(..., state=)`), and the values it records, by name, each
    recorded as `<update>_<name>` (one named `"loss"` adds to `history.loss`): a real
    scalar, which the epoch averages over its steps, or an `eqfit.Mean`, which it reduces
    as the sum of the totals over the sum of the weights (NaN for an epoch whose weights
    sum to 0, and for a step's value of weight 0).
    """

    model: Any
    state: ArrayTree
    model_state: ArrayTree
    values: Mapping[str, Array]


class Turn(NamedTuple):
    """An update's turn in `fit`'s step (`AbstractUpdate._take_turn`), by its own names."""

    params: PyTree  # the arrays it trains, after it
    opt_state: PyTree  # its state
    model_state: PyTree
    loss: Float[Array, ""]  # 0 for an update that records no loss
    finite: Bool[Array, ""]  # its loss is finite
    applies: Bool[Array, ""]  # it was applied
    values: dict[str, Array]  # what it records (its hyperparameters aside)
    weights: dict[str, Array]  # the weights of those values that are weighted means
    labels: LabelError | None
    # Its loss scale after it (float16's, `UpdateContext.loss_scale`); `None` unscaled.
    loss_scale: LossScale | None = None
    # The metrics it computed in its forward pass (`UpdateContext.metrics`), by the
    # record's names, with the weights of those that are weighted means; `None`: none.
    metrics: dict[str, Array] | None = None
    # The batch's statistics of each metric that accumulates, from the same pass.
    statistics: tuple[PyTree, ...] | None = None


class Given(NamedTuple):
    """What `fit`'s step gives an update's `apply` in its turn (`_take_turn`): the update
    it is for, `fit`'s options inside it, what the run knows of it, and where an `apply`
    that takes its turn under them leaves that turn (`eqfit.Update`'s).
    """

    update: Any  # the `AbstractUpdate`
    context: UpdateContext
    info: UpdateInfo
    taken: list[Turn]


_GIVEN: contextvars.ContextVar[Given | None] = contextvars.ContextVar("turn", default=None)


@contextlib.contextmanager
def giving(update: Any, context: UpdateContext, info: UpdateInfo) -> Iterator[list[Turn]]:
    """`fit`'s options (`context`) and what the run knows of `update` (`info`), given to
    its `apply` while inside (`given`); yields the list an `apply` that takes its turn
    under them leaves it in.
    """
    taken: list[Turn] = []
    token = _GIVEN.set(Given(update, context, info, taken))
    try:
        yield taken
    finally:
        _GIVEN.reset(token)


def given(update: Any) -> Given | None:
    """What `fit`'s step gives `update`'s `apply` in its turn; `None` outside one (a hand
    loop's call), and for another update's `apply` that an update's calls.
    """
    found = _GIVEN.get()
    return found if found is not None and found.update is update else None


def recorded(update: Any, out: Any) -> tuple[dict[str, Array], dict[str, Array]]:
    """The values an update of one's own records (`apply`'s `Applied.values`), each a
    float32 scalar (a weighted mean's quotient), and the weights of those that are
    weighted means (`eqfit.Mean`). Refuses what is no `Applied`, a name that is no
    string, and a value that is no real scalar, naming the update and the value.
    """
    what = f"Update {update.name!r}'s `apply`"
    if not isinstance(out, Applied):
        raise TypeError(
            f"{what} returned {kind_of(out)}: it must return "
            "`eqfit.Applied(model, state, model_state, values)`, the model after the update, "
            "its state, the model state and a dict of the values to record (`{}` for none)."
        )
    if not isinstance(out.values, Mapping):
        raise TypeError(
            f"{what} recorded {kind_of(out.values)} as `Applied.values`: it must be a dict of "
            "scalars by name (`{'lag': lag}`; `{}` for none)."
        )
    values: dict[str, Array] = {}
    weights: dict[str, Array] = {}
    for name, value in out.values.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise TypeError(
                f"{what} recorded a value named {name!r}: a value's name ends its history "
                f"name (`{update.name}_<name>`), so it must be a word such as 'lag'."
            )
        if isinstance(value, Mean):  # its steps weigh by its weight, as a loss's do
            values[name] = (value.total / value.weight).astype(jnp.float32)
            weights[name] = value.weight.astype(jnp.float32)
            continue
        dtype = getattr(value, "dtype", None)
        wrong = None
        if dtype is None and real_dtype(value) is None:
            wrong = f"{kind_of(value)}, not an array"
        elif real_dtype(value) is None:
            wrong = f"an array of dtype {dtype}, not a real number"
        elif (shape := np.shape(value)) != ():
            wrong = (
                f"an array of shape {shape}, not a scalar (shape ()): record its mean "
                f"(`jnp.mean(...)`), or a weighted mean (`eqfit.Mean.of(values, weights)`)"
            )
        if wrong is not None:
            raise TypeError(
                f"{what} recorded {name!r} as {wrong}. Each value it records is a real "
                "scalar (or an `eqfit.Mean`), recorded per step and averaged over the epoch."
            )
        values[name] = jnp.asarray(value).astype(jnp.float32)
    return values, weights


def kind_of(x: Any) -> str:
    """What `x` is, in a few words, for a message."""
    if isinstance(x, tuple):
        return f"a tuple of {len(x)}"
    return "None" if x is None else f"a {type(x).__name__}"


def check_samples(name: Any, samples: Any) -> None:
    if samples is None:
        return
    if isinstance(samples, bool) or not isinstance(samples, int | np.integer) or samples < 1:
        raise ValueError(
            f"Update {name!r}: `samples` must be an integer of 1 or more (the samples one "
            f"of its steps processes, such as a rollout's environment steps), got {samples!r}."
        )


def check_every(name: Any, every: Any) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"Update {name!r}: `every` must be an integer of 1 or more (the update runs on "
            f"every `every`-th step), got {every!r}."
        )


def trained_spec(model: Any, trains: Callable[[Any], Any] | None, what: str) -> PyTree:
    """A filter spec for `eqx.partition`: `True` at the floating-point arrays inside the
    parts `trains(model)` picks (all of them for `None`), `False` elsewhere. Refuses a
    `trains` that fails on the model or picks no floating-point array, naming `what`.
    """
    if trains is None:
        return jax.tree.map(eqx.is_inexact_array, model)
    nothing = jax.tree.map(lambda _: False, model)
    try:
        spec = eqx.tree_at(
            trains, nothing, replace_fn=lambda part: jax.tree.map(lambda _: True, part)
        )
    except Exception as e:
        raise ValueError(
            f"{what} must pick parts of the model, as `eqx.tree_at`'s `where` does "
            f"(`lambda m: m.generator`), but calling it on the model failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    spec = jax.tree.map(lambda s, a: bool(s) and eqx.is_inexact_array(a), spec, model)
    if not any(jax.tree.leaves(spec)):
        raise ValueError(
            f"{what} picks no floating-point array of the model, so the update would "
            "change nothing: pick the parts that hold its weights (`lambda m: m.generator`)."
        )
    return spec
