"""The pure training step `(params, opt_state, batch, key) -> (params, opt_state, loss)`."""

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Key, PyTree, TypeCheckError

from ._labels import collecting, either, first_of, LabelError


Metrics = Mapping[str, Callable[..., Any]]


def takes_key(fn: object) -> bool:
    """Whether `fn` accepts a keyword argument `key` (for dropout and the like); `False`
    for what is not callable (a model may be any PyTree).
    """
    return _key_parameter(fn) is not None


def needs_key(fn: object) -> bool:
    """Whether `fn` requires a keyword argument `key` (one without a default); `False`
    for what is not callable.
    """
    param = _key_parameter(fn)
    return param is not None and param.default is inspect.Parameter.empty


def _key_parameter(fn: object) -> inspect.Parameter | None:
    try:
        return _cached_key_parameter(fn)  # `inspect.signature` is slow next to a small `fit`
    except TypeError:  # unhashable: a Module with a list field, say
        return _cached_key_parameter.__wrapped__(fn)


@functools.lru_cache(maxsize=64)
def _cached_key_parameter(fn: object) -> inspect.Parameter | None:
    if not callable(fn):
        return None
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    param = parameters.get("key")
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return param if param is not None and param.kind in kinds else None


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


# Words of the errors that a model called on a whole batch raises: `dot_general requires
# contracting dimensions to have the same shape`, `Input to Conv needs to have rank 3`,
# `Incompatible shapes for broadcasting`.
_SHAPE_ERROR = re.compile(r"shape|dimension|\brank\b|broadcast", re.IGNORECASE)


@contextlib.contextmanager
def noting_call(
    name: str, fn: Callable[..., Any], args: tuple[Any, ...], stateful: bool
) -> Iterator[None]:
    """Notes on an error raised while the user's `fn` (the loss, or metric `name`) is
    traced: the call, with the shapes of the batch it was given, since the traceback shows
    only tracers; and, for an Equinox model and an error such as calling it on the whole
    batch gives, that the model is called on one example and should be vmapped.
    """
    try:
        yield
    except Exception as e:
        first = 2 if stateful else 1
        call, shapes = _described_call(fn, args[first:], ("model", "state")[:first])
        e.add_note(f"while eqfit traced `{name}{call}` with {shapes} (one batch)")
        if isinstance(args[0], eqx.Module) and _whole_batch_error(e, fn, args[first:]):
            e.add_note(
                "Equinox models are called on one example, `model(x[i])`: if the loss calls "
                "the model on the whole batch, `jax.vmap` it over the batch, "
                "`jax.vmap(model)(x)`, as `eqfit.losses` do."
            )
        raise


def _whole_batch_error(error: Exception, fn: Callable[..., Any], batch: tuple[Any, ...]) -> bool:
    """Whether `error` looks like that of a model called on the whole batch: an error about
    shapes, or a runtime type check that met an array with the batch's leading size.
    """
    if getattr(fn, "__module__", "").startswith("eqfit."):
        return False  # eqfit's losses and metrics vmap the model themselves
    if not isinstance(error, TypeCheckError):
        return _SHAPE_ERROR.search(str(error)) is not None
    leaves = [x for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0) > 0]
    if not leaves:
        return False
    return re.search(rf"Actual value: \w+\[{leaves[0].shape[0]}[,\]]", str(error)) is not None


def _described_call(
    fn: Callable[..., Any], batch: tuple[Any, ...], before: tuple[str, ...]
) -> tuple[str, str]:
    """`(model, x, y)` with `fn`'s own names for the batch's arguments (else `(model,
    *batch)`), and each argument's arrays as `x: float32[32, 16]`.
    """
    names = None
    with contextlib.suppress(TypeError, ValueError):
        parameters = list(inspect.signature(fn).parameters.values())[len(before) :]
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if len(parameters) >= len(batch) and all(
            p.kind in positional for p in parameters[: len(batch)]
        ):
            names = [p.name for p in parameters[: len(batch)]]
    if names is None:
        call = f"({', '.join([*before, '*batch'])})"
        names = [f"batch[{i}]" for i in range(len(batch))]
    else:
        call = f"({', '.join([*before, *names])})"
    shapes = [
        f"{name}{jax.tree_util.keystr(path)}: {_shape(leaf)}"
        for name, arg in zip(names, batch)
        for path, leaf in jax.tree_util.tree_leaves_with_path(arg)
    ]
    return call, ", ".join(shapes) or "no arrays"


def _shape(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{x.dtype}[{', '.join(map(str, x.shape))}]"
    return type(x).__name__


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
    ) -> tuple[Float[Array, ""], PyTree, LabelError | None]:
        """The loss, the model state after the batch (`None` without state), and the
        first label out of range that the loss met (see `eqfit._labels`).
        """
        args = batch_args(batch)
        args = (model, model_state, *args) if self.stateful else (model, *args)
        kwargs = {"key": key} if self.use_key and key is not None else {}
        _check_signature(self.loss, args, kwargs, "`loss`", self.stateful)
        with collecting() as checks, noting_call("loss", self.loss, args, self.stateful):
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
        return check_scalar(value, "`loss(model, *batch)`"), model_state, first_of(checks)

    def metric_values(
        self, model: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[Float[Array, " metrics"], LabelError | None]:
        """Each metric on the batch, in order (an empty vector without metrics), and the
        first label out of range that they met.
        """
        args = batch_args(batch)
        args = (model, model_state, *args) if self.stateful else (model, *args)
        values = []
        with collecting() as checks:
            for name, fn in self.metrics:
                _check_signature(fn, args, {}, f"metric {name!r}", self.stateful)
                with noting_call(f"metrics[{name!r}]", fn, args, self.stateful):
                    value = fn(*args)
                values.append(check_scalar(value, f"metric {name!r}"))
        stacked = jnp.stack(values).astype(jnp.float32) if values else jnp.zeros(0)
        return stacked, first_of(checks)


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
    labels: LabelError | None  # the first label out of range; `None`: nothing checked


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
    # With `shard=`: lays out a params-shaped tree (the gradients, the new parameters) as
    # the parameters are, and the optimizer state as it follows them.
    lay_out: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]] | None = None

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

        def value(p: PyTree) -> tuple[Float[Array, ""], tuple[PyTree, PyTree, LabelError | None]]:
            model = self.combine(p)
            loss, new_state, labels = self.objective.value(model, model_state, batch, key)
            return loss, (model, new_state, labels)

        (loss, (model, new_state, labels)), grads = jax.value_and_grad(value, has_aux=True)(params)
        # Metrics see the model before this step's update, as the loss does.
        metrics, metric_labels = self.objective.metric_values(model, clone(new_state), batch)
        labels = either(labels, metric_labels)
        if self.axis_name is not None:
            # Data parallel: each device saw an equal share of the batch, so the mean of
            # the per-device means is the mean over the whole batch.
            loss, grads, metrics = jax.lax.pmean((loss, grads, metrics), self.axis_name)
            if labels is not None:  # a bad label on any device's share is the batch's
                every = jax.lax.all_gather(labels, self.axis_name)
                first = jnp.argmax(every.found)
                labels = jax.tree.map(lambda x: x[first], every)
        if self.lay_out is not None:
            # The gradients as the parameters are laid out: XLA reduce-scatters them.
            grads, _ = self.lay_out(grads, None)
        # `value=` lets optax transformations that read the loss (reduce_on_plateau)
        # work unchanged; with_extra_args_support makes plain ones ignore it.
        optimizer = optax.with_extra_args_support(self.optimizer)
        finite = jnp.isfinite(loss)

        def apply(carry: tuple[PyTree, PyTree, PyTree]) -> tuple[PyTree, PyTree, PyTree]:
            params, opt_state, _ = carry
            updates, opt_state = optimizer.update(grads, opt_state, params, value=loss)
            params = eqx.apply_updates(params, updates)
            if self.lay_out is not None:
                params, opt_state = self.lay_out(params, opt_state)
            return params, opt_state, new_state

        def skip(carry: tuple[PyTree, PyTree, PyTree]) -> tuple[PyTree, PyTree, PyTree]:
            return carry

        # A `cond`, not a `where` over every leaf, which would compute and select the
        # whole update even for finite losses.
        params, opt_state, model_state = jax.lax.cond(
            finite, apply, skip, (params, opt_state, kept)
        )
        return StepResult(params, opt_state, model_state, loss, metrics, finite, labels)
