"""A program that only copies its arguments and fills arrays with constants, made without
compiling it (`without_compiling`): `start`'s, for most optimizers (Adam's state is
zeros and a count).

XLA:CPU takes tens of milliseconds to compile even such a program, and it compiles on
every core there is: a first `fit` on a small machine waits for that, or shares the host
with it while it traces the run. Copies of the arguments and filled arrays are the same
arrays, bit for bit, and compile nothing; the filled arrays are kept on the device for
later fits (`DEVICE_FILLS`), which copy them there.

How the outputs are made is read off the program's jaxpr once per configuration and kept
with its compiled programs (`Recipe`, a fact of `PROGRAM_CACHE`): a later `fit` of it
traces nothing, and puts its arrays on the device in one call.
"""

import collections
import dataclasses
import math
import threading
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jaxtyping import PyTree

from ._compile import PROGRAM_CACHE


# Filled arrays are made in the host's memory, then copied to the device: beyond this many
# bytes of them, a compiled program that writes them on the device is the cheaper.
FILL_BYTES = 1 << 26
# Filled arrays are kept on the device for later fits (copied there, not put from the
# host's memory) up to this many bytes of them, across configurations; beyond, the least
# recently used are dropped, and each `fit` fills them anew.
KEPT_FILL_BYTES = 1 << 24


def without_compiling(program: Any, args: tuple[Any, ...], key: Hashable) -> PyTree | None:
    """What `program(*args)` returns (`program` a `jax.jit` function, cached in
    `PROGRAM_CACHE` under `key`), made without compiling it where its jaxpr only copies
    its arguments (or drops their weak types: `strongly_typed`) and broadcasts constants
    (at most `FILL_BYTES` of them, and of the weakly typed arguments), with no effects (a
    `jax.debug.callback` in an `init` runs, as compiled): each output a copy of its
    argument (wherever that lies) or a filled array on JAX's default device, never an
    alias of either. `None` where it does anything else: then compile it.
    """
    leaves, treedef = jax.tree.flatten(args)
    signature = _signature(treedef, leaves)
    recipe = PROGRAM_CACHE.fact(key, "recipe")
    if recipe is None or signature is None or recipe.signature != signature:
        recipe = Recipe.of(program.trace(*args), signature, len(leaves))
        if signature is not None:  # the newest only: one a program
            PROGRAM_CACHE.set_fact(key, "recipe", recipe)
    if recipe.outs is None:
        return None
    fills = recipe.fills()
    values = [(fills if out.filled else leaves)[out.index] for out in recipe.outs]
    # Put on the device together, in one call: each its own call would pay JAX's dispatch.
    put = jax.device_put(values, may_alias=False)
    return jax.tree.unflatten(recipe.out_tree, [o.finish(x) for o, x in zip(recipe.outs, put)])


@dataclasses.dataclass(frozen=True)
class _Out:
    """An output of the program: an argument (`index` among the arguments' leaves) or,
    `filled`, a filled array (`index` among `Recipe.fills()`), put on the device (a copy,
    never an alias: the run donates the state), then `finish`ed.
    """

    index: int
    filled: bool = False
    strong: bool = False  # its weak type dropped

    def finish(self, x: jax.Array) -> jax.Array:
        if not (self.strong and x.weak_type):
            return x
        # `device_put` keeps a weak type; an array put from numpy's memory has none. Where
        # it lies as the copy does, committed or not (a committed one lowers the run anew).
        where = x.sharding if x.committed else None
        return jax.device_put(np.asarray(x), where, may_alias=False)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the program's outputs are made from arguments of `signature`, read off its
    jaxpr: each a copy of an argument or a filled array (`outs`, in the order of the
    output's leaves, whose tree is `out_tree`); `outs` `None` where the program does
    anything else. It holds none of the arguments.
    """

    signature: Hashable
    outs: tuple[_Out, ...] | None
    out_tree: Any = None
    filled: tuple[tuple[Any, tuple[int, ...], np.dtype], ...] = ()  # value, shape, dtype

    def fills(self) -> tuple[jax.Array | np.ndarray, ...]:
        """The filled arrays: kept on the device (`DEVICE_FILLS`) where all of them fit
        there, else made anew in the host's memory (kept, they would push each other out,
        each fit putting them from the host and copying them once more).
        """
        if sum(math.prod(s) * d.itemsize for _, s, d in self.filled) > KEPT_FILL_BYTES:
            return tuple(_filled(value, shape, dtype) for value, shape, dtype in self.filled)
        return tuple(DEVICE_FILLS.get(value, shape, dtype) for value, shape, dtype in self.filled)

    @staticmethod
    def of(traced: Any, signature: Hashable, arguments: int) -> "Recipe":
        """The recipe of a program traced (`jax.jit(...).trace`) on arguments of
        `signature`, `arguments` leaves in all.
        """
        jaxpr = traced.jaxpr.jaxpr
        none = Recipe(signature, None)
        if jaxpr.constvars or jaxpr.effects or len(jaxpr.invars) != arguments:
            return none  # each argument's leaf one input: what the outputs' indices name
        fills = _Fills()
        made: dict[Any, _Out] = {var: _Out(i) for i, var in enumerate(jaxpr.invars)}
        filled = 0
        for eqn in _used(jaxpr):
            if len(eqn.outvars) != 1:
                return none
            (out,), (operand, *_) = eqn.outvars, eqn.invars
            if eqn.primitive.name == "copy" and operand in made:
                made[out] = made[operand]
            elif _drops_weak_type(eqn) and operand in made:
                filled += out.aval.size * out.aval.dtype.itemsize
                made[out] = dataclasses.replace(made[operand], strong=True)
            elif eqn.primitive.name == "broadcast_in_dim" and isinstance(operand, jex_core.Literal):
                filled += out.aval.size * out.aval.dtype.itemsize
                made[out] = fills.out(operand.val, out.aval)
            else:
                return none
        if filled > FILL_BYTES:
            return none
        outs = []
        for var in jaxpr.outvars:
            if isinstance(var, jex_core.Literal):
                outs.append(fills.out(var.val, var.aval))
            elif var in made:
                outs.append(made[var])
            else:
                return none
        return Recipe(signature, tuple(outs), traced.out_tree, tuple(fills.filled))


class _DeviceFills:
    """Filled arrays kept on the device for later fits, each value, shape, dtype and
    default device once, the least recently used dropped beyond `KEPT_FILL_BYTES` of
    them: a fit copies them on the device, where putting them from the host's memory
    costs an accelerator a transfer at every fit (Adam's zeros, as large as the model).
    Cleared by `eqfit.clear_cache()`.
    """

    def __init__(self) -> None:
        self.arrays: collections.OrderedDict[Hashable, tuple[jax.Array, int]] = (
            collections.OrderedDict()
        )  # each array, and its bytes
        self.bytes = 0
        self.lock = threading.Lock()  # fits may run in several threads at once

    def get(self, value: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
        """The array of `shape` filled with `value`, kept on the default device."""
        size = math.prod(shape) * dtype.itemsize
        where = jax.config.jax_default_device  # pyright: ignore[reportAttributeAccessIssue]
        key = (value.tobytes(), shape, dtype, repr(where))
        with self.lock:
            if key in self.arrays:
                self.arrays.move_to_end(key)
                return self.arrays[key][0]
        array = jax.device_put(_filled(value, shape, dtype))
        with self.lock:
            if key not in self.arrays:  # else another thread put it meanwhile
                self.arrays[key], self.bytes = (array, size), self.bytes + size
            while self.bytes > KEPT_FILL_BYTES:
                _, (_, dropped) = self.arrays.popitem(last=False)
                self.bytes -= dropped
        return array

    def clear(self) -> None:
        with self.lock:
            self.arrays.clear()
            self.bytes = 0


DEVICE_FILLS = _DeviceFills()
PROGRAM_CACHE.keep_beside(DEVICE_FILLS.clear)  # `eqfit.clear_cache()` drops them too


class _Fills:
    """The distinct filled arrays a recipe puts (Adam's two states of a parameter share
    their zeros in the host's memory; each is its own array on the device).
    """

    def __init__(self) -> None:
        self.filled: list[tuple[Any, tuple[int, ...], np.dtype]] = []
        self.index: dict[tuple[bytes, tuple[int, ...], np.dtype], int] = {}

    def out(self, value: Any, aval: Any) -> _Out:
        shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
        # By the value's bits: NaN is one value here, and 0.0 and -0.0 two.
        key = (np.asarray(value, dtype).tobytes(), shape, dtype)
        if key not in self.index:
            self.index[key] = len(self.filled)
            self.filled.append((np.asarray(value, dtype), shape, dtype))
        return _Out(self.index[key], filled=True)


def _filled(value: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array of `shape` filled with `value`: zeros by `np.zeros`, whose pages the host
    maps (the zero page) only as they are read, where `np.full` writes every byte.
    """
    if not value.reshape(1).view(np.uint8).any():  # all bits 0 (not -0.0)
        return np.zeros(shape, dtype)
    return np.full(shape, value, dtype)


def _signature(treedef: Any, leaves: list[Any]) -> Hashable | None:
    """What a trace of the program on arguments `leaves` (of tree `treedef`) depends on, as
    `jax.jit`'s own cache of traces keys it; `None` for a leaf that is no array, or out of
    its type's range (its trace then says what is wrong, as `jax.jit` does).
    """
    try:
        avals = tuple(map(jax.typeof, leaves))
    except (TypeError, OverflowError):
        return None
    return treedef, avals, jax.config.read("jax_enable_x64")


def _drops_weak_type(eqn: Any) -> bool:
    """Whether `eqn` only makes a weakly typed array strongly typed, its dtype kept."""
    if eqn.primitive.name != "convert_element_type":
        return False
    return eqn.params["new_dtype"] == eqn.invars[0].aval.dtype and not eqn.params["weak_type"]


def _used(jaxpr: Any) -> list[Any]:
    """The equations of `jaxpr` whose values its outputs use, in order: not, say, a key
    folded for an optimizer's `init` that takes none.
    """
    needed = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    used = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            used.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    return used[::-1]
