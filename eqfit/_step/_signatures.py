"""What eqfit reads of the user's functions (the loss, the metrics, an update's `init`,
a model) to call them: whether they take a `key` (`takes_key`, `needs_key`), whether
they take the arguments eqfit passes (`check_signature`), and the notes that name the
call, with the batch's shapes, where one fails while traced (`noting_call`).
"""

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
from jaxtyping import TypeCheckError


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


def check_signature(
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
    if is_own(fn):
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
        f"{name}{jax.tree_util.keystr(path)}: {dtype_shape(leaf)}"
        for name, arg in zip(names, batch)
        for path, leaf in jax.tree_util.tree_leaves_with_path(arg)
    ]
    return call, ", ".join(shapes) or "no arrays"


def dtype_shape(x: Any) -> str:
    """An array as `float32[32, 16]`; anything else by its type's name."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{x.dtype}[{', '.join(map(str, x.shape))}]"
    return type(x).__name__


def is_own(fn: object) -> bool:
    """Whether `fn` is one of eqfit's own losses or metrics."""
    # `__module__` is None for a function made by `exec` without a `__name__`.
    return (getattr(fn, "__module__", None) or "").startswith("eqfit.")
