"""How the step calls the optimizer: each gets the extra arguments its `update` takes.

Beside the gradients, the state and the parameters, optax's `GradientTransformationExtraArgs`
take keyword arguments: `value` (the loss, which `optax.contrib.reduce_on_plateau` reads)
and `grad_fn` (a function giving the gradient at other parameters on the step's batch,
which `optax.contrib.sam` asks for in its opaque mode). An update that names its keywords
gets only those it names; one that takes any (`**extra_args`, as `optax.chain` and plain
transformations wrapped by `optax.with_extra_args_support` do) gets them all.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any


def extra_args(update: Callable[..., Any], **given: Any) -> dict[str, Any]:
    """The keyword arguments of `given` that `update` takes."""
    takes = _keywords(update)
    if takes is None:
        return given
    return {name: value for name, value in given.items() if name in takes}


@functools.lru_cache(maxsize=64)
def _cached_keywords(update: Callable[..., Any]) -> frozenset[str] | None:
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):  # no signature to read: give it everything
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return frozenset(p.name for p in parameters if p.kind in kinds)


def _keywords(update: Callable[..., Any]) -> frozenset[str] | None:
    """The keywords `update` takes by name; `None`: any."""
    try:
        return _cached_keywords(update)
    except TypeError:  # unhashable
        return _cached_keywords.__wrapped__(update)
