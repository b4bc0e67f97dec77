"""The pure training step `(params, opt_state, batch, key) -> (params, opt_state, loss)`."""

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Key, PyTree


Metrics = Mapping[str, Callable[..., Any]]


def takes_key(fn: Callable[..., Any]) -> bool:
    """Whether `fn` accepts a keyword argument `key` (for dropout and the like)."""
    try:
        return _takes_key(fn)  # `inspect.signature` is slow next to a small `fit` call
    except TypeError:  # unhashable: a Module with a list field, say
        return _takes_key.__wrapped__(fn)


@functools.lru_cache(maxsize=64)
def _takes_key(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    param = parameters.get("key")
    return param is not None and param.kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


def check_scalar(value: Any, what: str) -> Float[Array, ""]:
    """Refuses a loss or metric that is not a float scalar, giving what it returned."""
    if not isinstance(value, jax.Array) or value.shape != ():
        shape = getattr(value, "shape", None)
        got = f"an array of shape {tuple(shape)}" if shape is not None else repr(value)
        raise ValueError(
            f"{what} must return a scalar, but it returned {got}. "
            "Reduce it over the batch, e.g. with `jnp.mean`."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        if jnp.issubdtype(value.dtype, jnp.number) or value.dtype == jnp.bool_:
            if what.startswith("metric"):
                return value.astype(jnp.float32)
        raise TypeError(f"{what} must return a float scalar, got dtype {value.dtype}.")
    return value


def batch_args(batch: PyTree) -> tuple[Any, ...]:
    """How a batch is passed on: a tuple is unpacked (`loss(model, *batch)`), any other
    PyTree (a dict, say) is passed whole (`loss(model, batch)`).
    """
    return batch if isinstance(batch, tuple) else (batch,)


def _check_signature(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], what: str, stateful: bool
) -> None:
    """Refuses a loss or metric that cannot take the arguments eqfit passes, saying which
    it passes, rather than failing with Python's bare `TypeError` (runs while tracing).
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or the like: let the call speak
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        expected = "(model, state, *batch)" if stateful else "(model, *batch)"
        got = ", ".join(type(a).__name__ for a in args)
        raise TypeError(
            f"{what} is called as fn{expected}, here with {len(args)} arguments ({got}), "
            f"which its signature {signature} does not take: {e}."
        ) from None


class Objective(eqx.Module):
    """How to call the user's loss and metrics on a batch, with or without model state."""

    loss: Callable[..., Any]
    metrics: tuple[tuple[str, Callable[..., Any]], ...] = ()
    stateful: bool = False
    use_key: bool = False

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.metrics)

    def value(
        self, model: PyTree, model_state: PyTree, batch: PyTree, key: Key[Array, ""] | None
    ) -> tuple[Float[Array, ""], PyTree]:
        """The loss, and the model state after the batch (`None` without state)."""
        args = batch_args(batch)
        args = (model, model_state, *args) if self.stateful else (model, *args)
        kwargs = {"key": key} if self.use_key and key is not None else {}
        _check_signature(self.loss, args, kwargs, "`loss`", self.stateful)
        out = self.loss(*args, **kwargs)
        if self.stateful:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(
                    "With `state=`, `loss(model, state, *batch)` must return "
                    f"`(value, new_state)`, got {type(out).__name__}."
                )
            value, model_state = out
        else:
            value = out
        return check_scalar(value, "`loss(model, *batch)`"), model_state

    def metric_values(
        self, model: PyTree, model_state: PyTree, batch: PyTree
    ) -> Float[Array, " metrics"]:
        """Each metric on the batch, in order; an empty vector without metrics."""
        args = batch_args(batch)
        args = (model, model_state, *args) if self.stateful else (model, *args)
        values = []
        for name, fn in self.metrics:
            _check_signature(fn, args, {}, f"metric {name!r}", self.stateful)
            values.append(check_scalar(fn(*args), f"metric {name!r}"))
        return jnp.stack(values).astype(jnp.float32) if values else jnp.zeros(0)


def clone(state: PyTree) -> PyTree:
    """A new `eqx.nn.State` object with the same arrays (one a layer has not used up)."""
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, leaves)


class StepResult(NamedTuple):
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    loss: Float[Array, ""]
    metrics: Float[Array, " metrics"]
    finite: Bool[Array, ""]


class Step(eqx.Module):
    """One optimisation step on a batch.

    An update whose loss is not finite is not applied: one `lax.cond` per step, as
    `optax.apply_if_finite` does, so the parameters are always the last finite ones and
    every `on_nan` policy runs the same arithmetic. The caller decides whether to stop.
    """

    objective: Objective
    optimizer: optax.GradientTransformation
    combine: Callable[[PyTree], PyTree]  # the trained arrays -> the whole model
    axis_name: str | None = None  # set under `pmap`: losses and gradients are averaged

    def __call__(
        self,
        params: PyTree,
        opt_state: PyTree,
        model_state: PyTree,
        batch: PyTree,
        key: Key[Array, ""] | None,
    ) -> StepResult:
        if self.axis_name is not None and key is not None:
            # Each device's share of the batch gets its own key.
            key = jax.random.fold_in(key, jax.lax.axis_index(self.axis_name))

        # A stateful layer marks the state it was given as used up, so the loss, the
        # metrics and a skipped step each get their own copy.
        kept = clone(model_state)

        def value(p: PyTree) -> tuple[Float[Array, ""], tuple[PyTree, PyTree]]:
            model = self.combine(p)
            loss, new_state = self.objective.value(model, model_state, batch, key)
            return loss, (model, new_state)

        (loss, (model, new_state)), grads = jax.value_and_grad(value, has_aux=True)(params)
        # Metrics see the model before this step's update, as the loss does.
        metrics = self.objective.metric_values(model, clone(new_state), batch)
        if self.axis_name is not None:
            # Data parallel: each device saw an equal share of the batch, so the mean of
            # the per-device means is the mean over the whole batch.
            loss, grads, metrics = jax.lax.pmean((loss, grads, metrics), self.axis_name)
        # `value=` lets optax transformations that read the loss (reduce_on_plateau)
        # work unchanged; with_extra_args_support makes plain ones ignore it.
        optimizer = optax.with_extra_args_support(self.optimizer)
        finite = jnp.isfinite(loss)

        def apply(carry: tuple[PyTree, PyTree, PyTree]) -> tuple[PyTree, PyTree, PyTree]:
            params, opt_state, _ = carry
            updates, opt_state = optimizer.update(grads, opt_state, params, value=loss)
            return eqx.apply_updates(params, updates), opt_state, new_state

        def skip(carry: tuple[PyTree, PyTree, PyTree]) -> tuple[PyTree, PyTree, PyTree]:
            return carry

        # A `cond`, not a `where` over every leaf, which would compute and select the
        # whole update even for finite losses.
        params, opt_state, model_state = jax.lax.cond(
            finite, apply, skip, (params, opt_state, kept)
        )
        return StepResult(params, opt_state, model_state, loss, metrics, finite)
