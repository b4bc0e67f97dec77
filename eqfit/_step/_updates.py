"""Several updates in a step (`fit(..., updates=[...])`): a GAN's discriminator and then
its generator, a critic trained five steps to one, a target network moved by averaging.

Each update is an object with an `init` and an update rule, as optimistix's solvers and
diffrax's controllers are: `eqfit.Update` (a loss, an optimizer and the parts it trains)
is one, and a subclass of `eqfit.AbstractUpdate` is a user's own. The step runs them in
order on its batch, each on the model the one before it left.
"""

import abc
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Key, PyTree

from .._core._checks import as_int, real_dtype
from .._core._typing import ArrayTree
from ._descent import hyperparams, UpdateContext
from ._labels import LabelError
from ._mean import Mean
from ._objective import clone, find_outputs, LossTrace, Objective, split_output
from ._precision import LossScale, Precision
from ._record import column_name, LOSS, UpdateInfo, weight_name
from ._remat import as_remat, chosen, RematLike
from ._signatures import takes_key


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


class AbstractUpdate(eqx.Module):
    """An update of part of the model, run on each step's batch (or on every `every`-th
    step's), after the updates listed before it in `fit(..., updates=[...])`.

    Subclass it for an update of your own (a target network moved by Polyak averaging,
    an update that takes two gradients): give it a `name` and the two methods below, and
    where they differ from the defaults the parts it `trains` (as `eqx.tree_at`'s
    `where`; `None`, the default: every floating-point array), `every` (run on steps
    `every`, `2 * every`, ... counted from 1; default 1) and `samples` (how many samples
    one of its steps processes, such as the environment steps of a rollout, which the
    history's, the bar's and the log's samples per second count instead of the batch's
    rows; a step's are the sum of its updates' that say theirs). `fit` keeps only the arrays of
    the parts it trains from the model `apply` returns, carries its state from step to
    step (and in checkpoints), and records its values. `eqfit.Update` is the built-in
    one.

    Validation (and `eqfit.evaluate`) computes each update's loss where it has one: an
    `eqfit.Update`'s is its `loss`. An update of your own gives one by defining a method
    `loss(self, model, *batch)` (with `fit(..., state=)`, `loss(self, model, state,
    *batch)` returning `(value, new_state)`), called as `fit`'s `loss` is and returning
    what its `apply` records of it: its value, recorded as `"loss"`, and any aux values,
    each recorded under its name. Validation then gives `val_<name>_loss` and
    `val_<name>_<aux>`.
    """

    name: eqx.AbstractVar[str]
    # Keyword-only, so that a subclass's own fields come first in its constructor's
    # arguments (`eqfit.Update(name, loss, optimizer, trains=..., every=...)`).
    trains: Callable[[Any], Any] | None = eqx.field(default=None, kw_only=True)
    every: int = eqx.field(default=1, kw_only=True, converter=as_int)
    samples: int | None = eqx.field(default=None, kw_only=True, converter=as_int)

    def __check_init__(self) -> None:
        # `""` is `fit`'s own `loss=`/`optimizer=` (whose values keep their own names);
        # `fit(..., updates=)` refuses it (`check_updates`).
        if not isinstance(self.name, str) or (self.name and not NAME.fullmatch(self.name)):
            raise ValueError(
                f"An update is named {self.name!r}: its name begins the history's names of "
                "its values (`d_loss`), so it must be a letter, then letters, digits and "
                "underscores (such as 'd', 'g' or 'critic')."
            )
        check_every(self.name, self.every)
        check_samples(self.name, self.samples)

    @abc.abstractmethod
    def init(self, params: ArrayTree) -> ArrayTree:
        """The update's state at the start (an optimizer's, say).

        An update that starts from randomness (an environment's reset, a replay buffer's
        first fill) takes a keyword `key` too, `def init(self, params, *, key=None)`
        (the default keeps the override compatible for type checkers): `fit` always
        passes it a key of its own, `jax.random.fold_in(jax.random.fold_in(k, 3), i)`
        for the `i`-th of `updates` (counted from 0), where `k` is `fit`'s `key`, or in
        an ensemble member `m`'s, `jax.random.split(key, members)[m]`: each member
        starts apart.

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
            PyTree passed whole); `None` where `fit` has no data (`data=None`: the update
            makes its own, a rollout, say).
        - `model_state`: the model's state with `fit(..., state=)` (BatchNorm's), else
            `None`.
        - `key`: a key of this update's own for this step: at the run's step `t`
            (counted from 0 across epochs), `fold_in(fold_in(fold_in(k, 1), t), i)` for
            the `i`-th of `updates`, where `k` is `fit`'s `key` (an ensemble member's:
            `jax.random.split(key, members)[m]`). An update that threads a key of its
            own through its state instead (as PureJaxRL does) may ignore it.

        **Returns:**

        An [`eqfit.Applied`][]: the model after the update (only the parts it `trains`
        are kept), the update's new state, the model state, and the values to record.
        """

    def _take_turn(
        self,
        info: UpdateInfo,
        context: UpdateContext,
        params: PyTree,
        state: ArrayTree,
        model_state: ArrayTree,
        batch: ArrayTree,
        key: Key[Array, ""] | None,
    ) -> Turn:
        """Its turn in `fit`'s step, on the arrays it trains (`params`): `apply` on the
        whole model, whose trained arrays are kept, and its values checked against those
        it recorded before the run (`info.values`).
        """
        assert key is not None and context.split is not None
        out = self.apply(
            context.combine(params), state, batch, model_state=clone(model_state), key=key
        )
        values, weights = recorded(self, out)
        if set(values) != set(info.values):
            raise ValueError(
                f"Update {self.name!r} recorded {sorted(values)}, but before the run it "
                f"recorded {sorted(info.values)}: an update must record the same names every "
                "step."
            )
        if LOSS.name in weights:  # a weighted mean's batch of weight 0 records NaN
            found = out.values[LOSS.name]
            assert isinstance(found, Mean)
            finite = jnp.isfinite(found.total) & jnp.isfinite(found.weight)
        else:
            finite = jnp.isfinite(values.get(LOSS.name, jnp.zeros((), jnp.float32)))
        loss = values.get(LOSS.name, jnp.zeros((), jnp.float32))
        new = (context.split(out.model), out.state, out.model_state)
        if LOSS.name in values:  # as a loss's update: not applied where it is not finite
            old = (params, state, model_state)
            new = jax.tree.map(lambda n, o: jax.lax.select(finite, n, o), new, old)
        trained, own_state, model_state = new
        return Turn(trained, own_state, model_state, loss, finite, finite, values, weights, None)


def recorded(update: AbstractUpdate, out: Any) -> tuple[dict[str, Array], dict[str, Array]]:
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
    - `remat`: activation checkpointing of its loss's forward pass, by a policy of
        `jax.checkpoint`'s, as `fit`'s `remat=` (which it overrides for this update):
        `"nothing"`, `"dots"`, `"dots_no_batch"` or a policy function; `None` (the
        default): `fit`'s. In a hand loop, its `apply` checkpoints so too.

    Precision, `on_nan`, `norms`, `ema` and `remat` act per update as with one loss: an
    update whose loss is not finite is not applied. (An update of your own, an
    `eqfit.AbstractUpdate`, trains as its `apply` is written: checkpoint inside it, with
    `jax.checkpoint`, where it should.)
    """

    name: str
    loss: Callable[..., Any]
    optimizer: optax.GradientTransformation
    remat: RematLike = eqx.field(default=None, kw_only=True)

    def __check_init__(self) -> None:
        if not callable(self.loss):
            raise TypeError(
                f"`eqfit.Update({self.name!r})`'s `loss` must be a function "
                f"`loss(model, *batch)`, got {type(self.loss).__name__}."
            )
        optimizer = self.optimizer
        if not (
            callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))
        ):
            hint = ""
            if callable(optimizer) and not isinstance(optimizer, type):
                name = getattr(optimizer, "__name__", "it")
                hint = f" `{name}` itself makes one when called: `{name}(1e-3)`, say."
            raise TypeError(
                f"`eqfit.Update({self.name!r})`'s `optimizer` must be an optax "
                f"`GradientTransformation`, such as `optax.adam(1e-3)`, got "
                f"{type(optimizer).__name__}.{hint}"
            )
        as_remat(self.remat, f"`eqfit.Update({self.name!r})`'s `remat`")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Final, as in Equinox's rule: `fit` and a hand loop run its `apply` as it is, so
        # an override would change only one of them.
        raise TypeError(
            f"`{cls.__name__}` subclasses `eqfit.Update`, which is final: `fit` runs the "
            "built-in update's step as it is, so an override of its `apply` or `init` would "
            "not be what trains. Subclass `eqfit.AbstractUpdate` for an update of your own "
            "(its `init` and `apply` are then what `fit` runs)."
        )

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
        """The step `fit` runs for this update, its very turn in the step (`fit`'s options
        at their defaults: one device, no precision policy, no norms, no microbatches;
        its own `remat`), for a hand-written loop: the same bits as `fit`'s parameters,
        optimizer state and values (its loss, its aux values, its injected
        hyperparameters). An update
        whose loss is not finite is not applied; a weighted mean's batch of weight 0
        trains on a zero gradient and records NaN; `grad_fn` reaches optimizers that take
        it (SAM's opaque mode).
        """
        spec = trained_spec(model, self.trains, f"`eqfit.Update({self.name!r})`'s `trains`")
        params, rest = eqx.partition(model, spec)
        objective = self._objective(model_state is not None, None)
        info = self._info((), find_outputs(objective, model, model_state, batch, True))
        context = UpdateContext(combine=lambda p: eqx.combine(p, rest))
        t = self._take_turn(info, context, params, state, model_state, batch, key)
        values = t.values | hyperparams(t.opt_state)
        return Applied(eqx.combine(t.params, rest), t.opt_state, t.model_state, values)

    def _take_turn(
        self,
        info: UpdateInfo,
        context: UpdateContext,
        params: PyTree,
        state: ArrayTree,
        model_state: ArrayTree,
        batch: ArrayTree,
        key: Key[Array, ""] | None,
    ) -> Turn:
        """Its turn in `fit`'s step: `apply`'s descent, under `fit`'s options (its own
        `remat` over `fit`'s), with the run's metrics (`context.metrics`) computed in its
        forward pass.
        """
        remat = chosen(self.remat, context.remat, context.recompute)
        context = dataclasses.replace(context, remat=remat)
        objective = Objective(
            self.loss,
            context.metrics,
            model_state is not None,
            takes_key(self.loss),
            info.aux_names,
            context.precision,
            (*info.means, *context.metric_means),
        )
        d = context.descend(
            objective, self.optimizer, params, state, model_state, context.loss_scale, batch, key
        )
        names = objective.metric_names
        metrics = None
        if names:
            metrics = dict(zip(names, d.metrics))
            metrics |= {weight_name(n): d.weights.pop(n) for n in names if n in d.weights}
        return Turn(
            d.params,
            d.opt_state,
            d.model_state,
            d.loss,
            d.finite,
            d.applies,
            d.values(objective),
            d.weights,
            d.labels,
            d.loss_scale,
            metrics,
            d.statistics if objective.accumulating else None,
        )

    def _info(self, picks: tuple[bool, ...], found: LossTrace) -> UpdateInfo:
        """What a run keeps of it: its loss and the aux values its loss returns
        (`found`, its trace), of the trained arrays it `picks`.
        """
        values = (LOSS.name, *found.aux_names)
        return UpdateInfo(
            self.name, self.every, picks, True, values, means=found.means, validated=values
        )

    def _objective(
        self,
        stateful: bool,
        precision: Precision | None,
        aux_names: tuple[str, ...] = (),
        means: tuple[str, ...] = (),
    ) -> Objective:
        """How its loss is called (`aux_names` and `means` as found before the run)."""
        return Objective(self.loss, (), stateful, takes_key(self.loss), aux_names, precision, means)


def validation_loss(update: AbstractUpdate) -> Callable[..., Any] | None:
    """The loss validation computes for `update`: an `eqfit.Update`'s `loss`, or the
    `loss` method of an update of the user's own that defines one; else `None`.
    """
    loss = getattr(update, "loss", None)
    return loss if callable(loss) else None


def builtin(update: AbstractUpdate) -> Update | None:
    """`update` where it is the built-in one (`eqfit.Update`: a loss, which validation
    computes, and whose values are its loss and aux values); `None` for an update of the
    user's own. How the update objects are told apart where the run is checked, traced
    and built; inside the step, `_take_turn` is each kind's own, and what reads the run's
    static description tells them apart by `UpdateInfo.loss`.
    """
    return update if isinstance(update, Update) else None


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


class Losses(eqx.Module):
    """The updates' losses (`validation_loss`) as one function, on one model: what
    validation and `eqfit.evaluate` compute. Its value is their sum; its aux values each
    update's loss and aux values, under the record's names (`d_loss`, `d_<aux>`). With
    state, each loss gets the state the one before it returned.
    """

    updates: tuple[AbstractUpdate, ...]
    stateful: bool

    def __call__(self, model: Any, *args: Any, key: Key[Array, ""] | None = None) -> Any:
        state = args[0] if self.stateful else None
        batch = args[1:] if self.stateful else args
        total = jnp.zeros((), jnp.float32)
        aux: dict[str, Any] = {}
        losses = [(u.name, f) for u in self.updates if (f := validation_loss(u)) is not None]
        for i, (name, loss) in enumerate(losses):
            kwargs = {}
            if key is not None and takes_key(loss):
                kwargs["key"] = jax.random.fold_in(key, i)
            call = (model, state, *batch) if self.stateful else (model, *batch)
            value, its_aux, new_state = split_output(loss(*call, **kwargs), self.stateful)
            if self.stateful:
                state = new_state
            # The run's loss is the sum of the updates' values; each stays a `Mean`
            # where it is one, under its own name.
            total = total + (value.value if isinstance(value, Mean) else value)
            named = {LOSS.name: value, **(its_aux or {})}
            aux |= {column_name(name, k): v for k, v in named.items()}
        out = (total, aux)
        return (out, state) if self.stateful else out
