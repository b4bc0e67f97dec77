"""`cached_jit`: `eqx.filter_jit`'s calling convention, its programs in eqfit's cache."""

import functools
from collections.abc import Callable
from typing import Any, cast, TypeVar

import jax

from ._compile import PROGRAM_CACHE
from ._skeleton import Skeleton, split_arrays, unwrap


_F = TypeVar("_F", bound=Callable[..., Any])


def cached_jit(fn: _F) -> _F:
    """`fn` compiled as `eqx.filter_jit` compiles it (its arrays traced, everything else
    static), but with each program kept in eqfit's `PROGRAM_CACHE`, so that
    `eqfit.clear_cache()` frees it and the cache's bound counts it: `eqx.filter_jit` keeps
    its programs in a cache of its own, which neither reaches.

    A program is cached per configuration: the arguments' structure and non-array values
    (as `fit` describes its model, by `split_arrays`) and their arrays' shapes and dtypes.
    `fn` must return a PyTree of arrays.

    **Arguments:**

    - `fn`: the function to compile.

    **Returns:**

    `fn`, compiled on its first call with each configuration.
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        arrays, skeleton = split_arrays((args, kwargs))
        shapes = tuple((a.shape, a.dtype) for a in arrays)
        program = PROGRAM_CACHE.get(
            (fn, skeleton, shapes),
            # A new function for each configuration: JAX's caches are keyed on it, so
            # dropping it from eqfit's cache drops JAX's entries too.
            lambda: jax.jit(functools.partial(_filled, fn, skeleton)),
        )
        return program(arrays)

    return cast(_F, call)


def _filled(fn: Callable[..., Any], skeleton: Skeleton, arrays: list[Any]) -> Any:
    args, kwargs = unwrap(skeleton.fill(arrays))
    return fn(*args, **kwargs)
