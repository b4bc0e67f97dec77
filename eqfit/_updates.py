"""Several updates in a step (`fit(..., updates=[...])`): a GAN's discriminator and then
its generator, a critic trained five steps to one, a target network moved by averaging.

Each update is an object with an `init` and an update rule, as optimistix's solvers and
diffrax's controllers are: `eqfit.Update` (a loss, an optimizer and the parts it trains)
is one, and a subclass of `eqfit.AbstractUpdate` is a user's own. The step runs them in
order on its batch, each on the model the one before it left.
"""

import abc
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Key, PyTree

from ._mean import Mean
from ._objective import batch_args, split_output, takes_key
from ._optimizer import extra_args
from ._typing import ArrayTree


# An update's name begins the history's names of its values (`d_loss`): a word.
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


class Applied(NamedTuple):
    """What an update gives back: the model after it, its own state, the model state
    (`None` without `fit(..., state=)`), and the values it records, by name (each a
    scalar, recorded as `<update>_<name>`; one named `"loss"` adds to `history.loss`).
    """

    model: Any
    state: ArrayTree
    model_state: ArrayTree
    values: Mapping[str, Array]


class AbstractUpdate(eqx.Module):
    """An update of part of the model, run on each step's batch (or on every `every`-th
    step's), after the updates listed before it in `fit(..., updates=[...])`.

    Subclass it for an update of your own (a target network moved by Polyak averaging,
    an update that takes two gradients): give it a `name` and the two methods below, and
    where they differ from the defaults the parts it `trains` (as `eqx.tree_at`'s
    `where`; `None`, the default: every floating-point array) and `every` (run on steps
    `every`, `2 * every`, ... counted from 1; default 1). `fit` keeps only the arrays of
    the parts it trains from the model `apply` returns, carries its state from step to
    step (and in checkpoints), and records its values. `eqfit.Update` is the built-in
    one.
    """

    name: eqx.AbstractVar[str]
    # Keyword-only, so that a subclass's own fields come first in its constructor's
    # arguments (`eqfit.Update(name, loss, optimizer, trains=..., every=...)`).
    trains: Callable[[Any], Any] | None = eqx.field(default=None, kw_only=True)
    every: int = eqx.field(default=1, kw_only=True)

    def __check_init__(self) -> None:
        check_every(self.name, self.every)

    @abc.abstractmethod
    def init(self, params: ArrayTree) -> ArrayTree:
        """The update's state at the start (an optimizer's, say).

        **Arguments:**

        - `params`: the model's arrays that the update trains, in the model's structure,
            `None` elsewhere (as `eqx.filter` gives them).

        **Returns:**

        A PyTree of arrays.
        """

    @abc.abstractmethod
    def apply(
        self,
        model: Any,
        state: ArrayTree,
        batch: ArrayTree,
        *,
        model_state: ArrayTree,
        key: Key[Array, ""],
    ) -> Applied:
        """One update on a step's batch.

        **Arguments:**

        - `model`: the whole model, as the updates before this one in the step left it.
        - `state`: the update's state (`init`'s, then the last `apply`'s).
        - `batch`: the step's batch, as the loss would get it (a tuple `(x, y)`, or the
            PyTree passed whole).
        - `model_state`: the model's state with `fit(..., state=)` (BatchNorm's), else
            `None`.
        - `key`: a key of this update's own for this step.

        **Returns:**

        An [`eqfit.Applied`][]: the model after the update (only the parts it `trains`
        are kept), the update's new state, the model state, and the values to record.
        """


class Update(AbstractUpdate):
    """The built-in update: one optimizer's step on the gradient of one loss, with respect
    to the parts of the model it trains.

    ```python
    eqfit.fit(
        gan, (latents, images), key=key, state=state, batch_size=32,
        updates=[
            eqfit.Update("d", d_loss, optax.adam(2e-4, b1=0.5), trains=lambda m: m.discriminator),
            eqfit.Update("g", g_loss, optax.adam(2e-4, b1=0.5), trains=lambda m: m.generator),
        ],
    )
    ```

    **Arguments:**

    - `name`: a word (a letter, then letters, digits and underscores), which begins the
        history's names of its values: `d_loss`, `d_<aux>`, `d_grad_norm`, `val_d_loss`.
    - `loss`: called as `fit`'s `loss` is, `loss(model, *batch)` (with `state=`,
        `loss(model, state, *batch)` returning `(value, new_state)`), on the model as the
        updates before it left it; it may return aux values and take a `key`.
    - `optimizer`: an optax `GradientTransformation`. Its state is
        `result.opt_state[name]`.
    - `trains`: the parts of the model it trains, as `eqx.tree_at`'s `where`
        (`lambda m: m.generator`); `None`: every floating-point array.
    - `every`: it runs on steps `every`, `2 * every`, ... (counted from 1) only; on the
        others its values are not recorded (a WGAN's generator: `every=5`).

    Precision, `on_nan`, `norms` and `ema` act per update as with one loss: an update
    whose loss is not finite is not applied.
    """

    name: str
    loss: Callable[..., Any]
    optimizer: optax.GradientTransformation

    def init(self, params: ArrayTree) -> ArrayTree:
        return self.optimizer.init(params)

    def apply(
        self,
        model: Any,
        state: ArrayTree,
        batch: ArrayTree,
        *,
        model_state: ArrayTree,
        key: Key[Array, ""],
    ) -> Applied:
        """The update as plain Equinox and optax, without `fit`'s options: what the step
        runs (with precision, norms and `on_nan` besides) and what a hand-written loop
        may call.
        """
        spec = trained_spec(model, self.trains, f"`eqfit.Update({self.name!r})`'s `trains`")
        params, rest = eqx.partition(model, spec)
        stateful = model_state is not None
        kwargs = {"key": key} if takes_key(self.loss) else {}

        def value(p: PyTree) -> tuple[Array, tuple[Any, Any]]:
            whole = eqx.combine(p, rest)
            args = (whole, model_state) if stateful else (whole,)
            args += batch_args(batch)
            out, aux, new_state = split_output(self.loss(*args, **kwargs), stateful)
            if isinstance(out, Mean):  # the total over the weight, as `fit`'s step takes it
                out = out.total / jax.lax.stop_gradient(out.weight)
            return out, (aux, new_state)

        (loss, (aux, new_state)), grads = jax.value_and_grad(value, has_aux=True)(params)
        optimizer = optax.with_extra_args_support(self.optimizer)
        extra = extra_args(optimizer.update, value=loss)
        updates, state = optimizer.update(grads, state, params, **extra)
        model = eqx.combine(eqx.apply_updates(params, updates), rest)
        values = {"loss": loss, **(aux or {})}
        values = {k: v.value if isinstance(v, Mean) else v for k, v in values.items()}
        return Applied(model, state, new_state, values)


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
        if not isinstance(name, str) or not _NAME.fullmatch(name):
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
        seen.add(name)
        check_every(name, update.every)
    return tuple(updates)


class Losses(eqx.Module):
    """The built-in updates' losses as one function, on one model: what validation and
    `eqfit.evaluate` compute. Its value is their sum; its aux values each update's loss
    (`<name>_loss`) and aux values (`<name>_<aux>`). With state, each loss gets the state
    the one before it returned.
    """

    updates: tuple[Update, ...]
    stateful: bool

    def __call__(self, model: Any, *args: Any, key: Key[Array, ""] | None = None) -> Any:
        state = args[0] if self.stateful else None
        batch = args[1:] if self.stateful else args
        total = jnp.zeros((), jnp.float32)
        aux: dict[str, Any] = {}
        for i, update in enumerate(self.updates):
            kwargs = {}
            if key is not None and takes_key(update.loss):
                kwargs["key"] = jax.random.fold_in(key, i)
            call = (model, state, *batch) if self.stateful else (model, *batch)
            value, its_aux, new_state = split_output(update.loss(*call, **kwargs), self.stateful)
            if self.stateful:
                state = new_state
            # The run's loss is the sum of the updates' values; each stays a `Mean`
            # where it is one, under its own name.
            total = total + (value.value if isinstance(value, Mean) else value)
            aux[f"{update.name}_loss"] = value
            aux |= {f"{update.name}_{k}": v for k, v in (its_aux or {}).items()}
        out = (total, aux)
        return (out, state) if self.stateful else out
