"""Several updates in a step (`fit(..., updates=[...])`): a GAN's discriminator and then
its generator, a critic trained five steps to one, a target network moved by averaging.

Each update is an object with an `init` and an update rule, as optimistix's solvers and
diffrax's controllers are: `eqfit.Update` (a loss, an optimizer and the parts it trains)
is one, and a subclass of `eqfit.AbstractUpdate` is a user's own. The step runs them in
order on its batch, each on the model the one before it left. `fit`'s `loss=` and
`optimizer=` are one `eqfit.Update`, unnamed, made where the options are.

Every update takes its turn the same way, a call of its `apply` given `fit`'s options
(`AbstractUpdate._take_turn`, final), which `Update.apply` reads (`given`); a hand loop's
call gets the defaults. This module alone tells the built-in update from one's own, and
`fit`'s one loss from several updates (`run_loss`, `info_of`, `identified`, ...).
"""

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast, TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Key, PyTree

from .._core._checks import as_int
from .._core._typing import ArrayTree
from ._descent import hyperparams, UpdateContext
from ._mean import Mean
from ._objective import clone, find_outputs, LossTrace, Objective, split_output
from ._precision import Precision
from ._record import column_name, LOSS, UpdateInfo, weight_name
from ._remat import as_remat, chosen, RematLike
from ._signatures import takes_key
from ._turn import (
    Applied,
    check_every,
    check_samples,
    given,
    giving,
    NAME,
    recorded,
    trained_spec,
    Turn,
)


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

    Validation (and `eqfit.evaluate`) computes each update's loss where it has one
    (`validation_loss`): an `eqfit.Update`'s is its `loss`. An update of your own gives
    one by defining a method `loss(self, model, *batch)` (with `fit(..., state=)`,
    `loss(self, model, state, *batch)` returning `(value, new_state)`), called as `fit`'s
    `loss` is and returning what its `apply` records of it: its value, recorded as
    `"loss"`, and any aux values, each recorded under its name. Validation then gives
    `val_<name>_loss` and `val_<name>_<aux>`.
    """

    name: eqx.AbstractVar[str]
    # Keyword-only, so that a subclass's own fields come first in its constructor's
    # arguments (`eqfit.Update(name, loss, optimizer, trains=..., every=...)`).
    trains: Callable[[Any], Any] | None = eqx.field(default=None, kw_only=True)
    every: int = eqx.field(default=1, kw_only=True, converter=as_int)
    samples: int | None = eqx.field(default=None, kw_only=True, converter=as_int)
    if not TYPE_CHECKING:  # none by default: an `eqfit.Update`'s field, or a method of one's own
        loss = None

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

    def validation_loss(self) -> Callable[..., Any] | None:
        """The loss validation (and `eqfit.evaluate`) computes for it: an `eqfit.Update`'s
        `loss`, or the `loss` method of an update of one's own that defines one; `None`
        (the default) for none.
        """
        loss = self.loss  # pyright: ignore[reportAttributeAccessIssue]
        return loss if callable(loss) else None

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
        """Its turn in `fit`'s step, on the arrays it trains (`params`), the same for every
        update: `apply` on the whole model, given `fit`'s options (`context`) and what the
        run knows of it (`info`), which an `apply` that takes its turn under them reads
        (`given`: `eqfit.Update`'s descent). Otherwise the trained arrays of the model it
        gives back are kept, and its values checked against those it recorded before the
        run (`info.values`).
        """
        with giving(self, context, info) as taken:
            # `None` only for an `eqfit.Update` whose loss takes no key, which takes it.
            out = self.apply(
                context.combine(params),
                state,
                batch,
                model_state=clone(model_state),
                key=cast(Key[Array, ""], key),
            )
        if taken:
            return taken[0]
        return _applied(self, info, context, out, params, state, model_state)


def _applied(
    update: AbstractUpdate,
    info: UpdateInfo,
    context: UpdateContext,
    out: Any,
    params: PyTree,
    state: ArrayTree,
    model_state: ArrayTree,
) -> Turn:
    """The turn of an update whose `apply` gave `out` on the model `params` make: the
    arrays it trains of the model it gives back, its state and values; as a loss's, not
    applied where its loss (the value it records as `"loss"`) is not finite.
    """
    assert context.split is not None
    values, weights = recorded(update, out)
    if set(values) != set(info.values):
        raise ValueError(
            f"Update {update.name!r} recorded {sorted(values)}, but before the run it "
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
    # A field of its own: the base's `loss` (none) is no default.
    loss: Callable[..., Any] = eqx.field()
    optimizer: optax.GradientTransformation = eqx.field()
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
        key: Key[Array, ""] | None,
    ) -> Applied:
        """The step `fit` runs for this update, its very turn in the step, for a
        hand-written loop too (`fit`'s options at their defaults: one device, no
        precision policy, no norms, no microbatches; its own `remat`): the same bits as
        `fit`'s parameters, optimizer state and values (its loss, its aux values, its
        injected hyperparameters). An update whose loss is not finite is not applied; a
        weighted mean's batch of weight 0 trains on a zero gradient and records NaN;
        `grad_fn` reaches optimizers that take it (SAM's opaque mode). In `fit`'s step it
        runs under the options `fit` gives it (`given`).
        """
        turn = given(self)
        if turn is None:  # a hand loop's call: `fit`'s options at their defaults
            return self._by_hand(model, state, batch, model_state, key)
        context = turn.context
        assert context.split is not None
        t = self._turn(turn.info, context, context.split(model), state, model_state, batch, key)
        turn.taken.append(t)
        return Applied(context.combine(t.params), t.opt_state, t.model_state, t.values)

    def _by_hand(
        self,
        model: Any,
        state: ArrayTree,
        batch: ArrayTree,
        model_state: ArrayTree,
        key: Key[Array, ""] | None,
    ) -> Applied:
        """`apply` in a hand loop: on the arrays it `trains`, under the plain
        `UpdateContext`, with its injected hyperparameters among its values.
        """
        spec = trained_spec(model, self.trains, f"`eqfit.Update({self.name!r})`'s `trains`")
        params, rest = eqx.partition(model, spec)
        objective = self._objective(model_state is not None, None)
        info = self._info((), find_outputs(objective, model, model_state, batch, True))
        context = UpdateContext(combine=lambda p: eqx.combine(p, rest))
        t = self._turn(info, context, params, state, model_state, batch, key)
        values = t.values | hyperparams(t.opt_state)
        return Applied(eqx.combine(t.params, rest), t.opt_state, t.model_state, values)

    def _turn(
        self,
        info: UpdateInfo,
        context: UpdateContext,
        params: PyTree,
        state: ArrayTree,
        model_state: ArrayTree,
        batch: ArrayTree,
        key: Key[Array, ""] | None,
    ) -> Turn:
        """Its descent under `context` (its own `remat` over `fit`'s), with the run's
        metrics (`context.metrics`) computed in its forward pass.
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
        return loss_info(self.name, picks, values, found.means, self.every)

    def _objective(self, stateful: bool, precision: Precision | None) -> Objective:
        """How its loss is called, before the run's trace found its aux values."""
        return Objective(self.loss, (), stateful, takes_key(self.loss), (), precision, ())


def loss_info(
    name: str,
    picks: tuple[bool, ...],
    values: tuple[str, ...],
    means: tuple[str, ...] = (),
    every: int = 1,
    schedules: tuple[str, ...] = (),
) -> UpdateInfo:
    """What a run keeps of a loss's update (an `eqfit.Update`): its `values`, its loss
    and aux values, all validated. Unnamed (`""`, `fit`'s `loss=` and `optimizer=`): its
    values keep their own names, it gets the step's key as it is, its state is the run's
    whole, and its loss is the step's.
    """
    unnamed = not name
    return UpdateInfo(
        name,
        every,
        picks,
        True,
        values,
        means=means,
        validated=values,
        schedules=schedules,
        keyed=not unnamed,
        whole=unnamed,
        step_loss=unnamed,
    )


# How the kinds of update are told apart, and `fit`'s one loss from several updates: here
# alone, each a question the run asks of its updates.


def _one_loss(updates: Sequence[AbstractUpdate]) -> bool:
    """Whether `updates` are `fit`'s `loss=` and `optimizer=`: one unnamed update."""
    return len(updates) == 1 and updates[0].name == ""


def run_loss(updates: Sequence[AbstractUpdate], stateful: bool) -> Callable[..., Any]:
    """The loss validation (and the run's metrics' objective) computes: `fit`'s one loss
    as it is, or several updates' losses as one (`Losses`).
    """
    if _one_loss(updates):
        loss = updates[0].validation_loss()
        assert loss is not None
        return loss
    return Losses(tuple(updates), stateful)


def run_traced(updates: Sequence[AbstractUpdate], run: Callable[[], LossTrace]) -> LossTrace:
    """What the run's loss and metrics return, traced before the run (`run()`) where the
    run's loss is `fit`'s one loss, whose `UpdateInfo` is read off that trace; nothing for
    several updates, whose losses are traced one by one (`info_of`).
    """
    return run() if _one_loss(updates) else LossTrace((), ())


def info_of(
    update: AbstractUpdate,
    picks: tuple[bool, ...],
    trace: Callable[[Objective], LossTrace],
    run: Callable[[], LossTrace],
    own: Callable[[], UpdateInfo],
    stateful: bool,
    precision: Precision | None,
    metric_names: tuple[str, ...],
) -> UpdateInfo:
    """What a run keeps of `update`, found before the run: an `eqfit.Update`'s loss's
    values, from `trace` of its loss, or for `fit`'s one loss from `run()` (the run's
    loss and metrics, traced once, whose metrics' means are the run's); an update of
    one's own's from `own()` (what its `apply` records).
    """
    if not isinstance(update, Update):
        return own()
    if not _one_loss((update,)):
        return update._info(picks, trace(update._objective(stateful, precision)))
    found = run()
    values = (LOSS.name, *found.aux_names)
    return loss_info("", picks, values, tuple(n for n in found.means if n not in metric_names))


def uses_key(updates: Sequence[AbstractUpdate]) -> bool:
    """Whether the step makes a key: for an update of the user's own, or a loss (each
    update's, or `fit`'s one) that takes one.
    """
    return any(not isinstance(u, Update) or takes_key(u.loss) for u in updates)


def own_names(updates: Sequence[AbstractUpdate]) -> list[str]:
    """The names of the updates of the user's own among `updates`: no loss's gradient
    step, which `norms=`, `precision=` and `remat=` act on.
    """
    return [u.name for u in updates if not isinstance(u, Update)]


def refuse_without_data(updates: Sequence[Any]) -> None:
    """Refuses an `eqfit.Update` among `updates` of a run with no data (`data=None`)."""
    for update in updates:
        if isinstance(update, Update):
            raise ValueError(
                f"`data` is None, but update {update.name!r} is an `eqfit.Update`, whose loss "
                "is computed on a batch of data: give `data`, or make it an update of your "
                "own (`eqfit.AbstractUpdate`) that makes its data in its `apply`."
            )


def optimizer_of(update: AbstractUpdate) -> optax.GradientTransformation | None:
    """The optimizer whose state an update keeps (an `eqfit.Update`'s); `None` for an
    update of the user's own, whose state is its own to lay out.
    """
    return update.optimizer if isinstance(update, Update) else None


def identified(
    updates: Sequence[AbstractUpdate], name_of: Callable[[Any], str | None]
) -> dict[str, Any]:
    """The updates as a checkpoint's configuration identifies them: its `"loss"`, by its
    name (`name_of`) for `fit`'s one loss, else `None` and `"updates"`, each by its name,
    its class, its loss (an `eqfit.Update`'s) and how often it runs.
    """
    losses = [name_of(u.loss if isinstance(u, Update) else None) for u in updates]
    if _one_loss(updates):
        return {"loss": losses[0]}
    entries = [[u.name, type(u).__name__, n, u.every] for u, n in zip(updates, losses)]
    return {"loss": None, "updates": entries}


def described(updates: Sequence[AbstractUpdate], describe: Callable[[Any], Any]) -> dict[str, Any]:
    """The updates' part of a run's optimizer fingerprint: `fit`'s one loss's optimizer
    (`"optimizer"`), or each update whole (`"updates"`), as `describe` gives them.
    """
    if _one_loss(updates):
        return {"optimizer": describe(optimizer_of(updates[0]))}
    return {"updates": [describe(u) for u in updates]}


class Losses(eqx.Module):
    """The updates' losses (`AbstractUpdate.validation_loss`) as one function, on one model: what
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
        losses = [(u.name, f) for u in self.updates if (f := u.validation_loss()) is not None]
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
