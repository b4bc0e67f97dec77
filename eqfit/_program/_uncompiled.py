"""A program that only copies its arguments and fills arrays with constants, made without
compiling it (`without_compiling`): `start`'s, for most optimizers (Adam's state is
zeros and a count).

XLA:CPU takes tens of milliseconds to compile even such a program, and it compiles on
every core there is: a first `fit` on a small machine waits for that, or shares the host
with it while it traces the run. Copies of the arguments and filled numpy arrays put on
the device are the same arrays, bit for bit, and compile nothing.
"""

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jaxtyping import PyTree


# Filled arrays are made in the host's memory, then copied to the device: beyond this many
# bytes of them, a compiled program that writes them on the device is the cheaper.
FILL_BYTES = 1 << 26


def without_compiling(program: Any, args: tuple[Any, ...]) -> PyTree | None:
    """What `program(*args)` returns (`program` a `jax.jit` function), made without
    compiling it where its jaxpr only copies its arguments (or drops their weak types:
    `strongly_typed`) and broadcasts constants (at most `FILL_BYTES` of them, and of the
    weakly typed arguments), with no effects (a `jax.debug.callback` in an `init` runs, as
    compiled): each output a copy of its argument (wherever that lies) or a filled array
    on JAX's default device. `None` where it does anything else: then compile it.
    """
    traced = program.trace(*args)
    jaxpr = traced.jaxpr.jaxpr
    if jaxpr.constvars or jaxpr.effects:
        return None
    made: dict[Any, _Make] = {
        var: _copy(arg) for var, arg in zip(jaxpr.invars, jax.tree.leaves(args), strict=True)
    }
    filled = 0
    for eqn in _used(jaxpr):
        if len(eqn.outvars) != 1:
            return None
        (out,), (operand, *_) = eqn.outvars, eqn.invars
        if eqn.primitive.name == "copy" and operand in made:
            made[out] = made[operand]
        elif _drops_weak_type(eqn) and operand in made:
            filled += out.aval.size * out.aval.dtype.itemsize
            made[out] = _strong(made[operand])
        elif eqn.primitive.name == "broadcast_in_dim" and isinstance(operand, jex_core.Literal):
            filled += out.aval.size * out.aval.dtype.itemsize
            made[out] = _fill(operand.val, out.aval)
        else:
            return None
    if filled > FILL_BYTES:
        return None
    outs = []
    for var in jaxpr.outvars:
        if isinstance(var, jex_core.Literal):
            outs.append(_fill(var.val, var.aval))
        elif var in made:
            outs.append(made[var])
        else:
            return None
    # Put on the device together, in one call: each its own call would pay JAX's dispatch.
    put = jax.device_put([make.value for make in outs], may_alias=False)
    return jax.tree.unflatten(traced.out_tree, [make.finish(x) for make, x in zip(outs, put)])


@dataclasses.dataclass(frozen=True)
class _Make:
    """An output of the program: `value` put on the device (a copy, never an alias: the
    run donates the state), then `finish`ed.
    """

    value: Any  # an argument, or an array filled in the host's memory
    strong: bool = False  # its weak type dropped

    def finish(self, x: jax.Array) -> jax.Array:
        if not (self.strong and x.weak_type):
            return x
        # `device_put` keeps a weak type; an array put from numpy's memory has none. Where
        # it lies as the copy does, committed or not (a committed one lowers the run anew).
        where = x.sharding if x.committed else None
        return jax.device_put(np.asarray(x), where, may_alias=False)


def _copy(arg: Any) -> _Make:
    return _Make(arg)


def _drops_weak_type(eqn: Any) -> bool:
    """Whether `eqn` only makes a weakly typed array strongly typed, its dtype kept."""
    if eqn.primitive.name != "convert_element_type":
        return False
    return eqn.params["new_dtype"] == eqn.invars[0].aval.dtype and not eqn.params["weak_type"]


def _strong(make: _Make) -> _Make:
    return dataclasses.replace(make, strong=True)


def _fill(value: Any, aval: Any) -> _Make:
    return _Make(np.full(aval.shape, value, aval.dtype))


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
