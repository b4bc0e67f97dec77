"""What a resumed run must match beyond its configuration's shapes and settings: the
fingerprints of its data, validation data, metrics and optimizer, kept in a checkpoint's
configuration (`fingerprints`), and the resume refused where one differs
(`changed`), unless `Checkpoint.allow_changes` says the change is meant.

An object (a metric, an optimizer) is fingerprinted by what it is made of, read off it
(`_described`): its class and fields (an `eqx.Module`, a dataclass, a named tuple, the
attributes of another object), a function's name and the values its closure holds
(optax's optimizers are closures over their hyperparameters: `optax.adam(1e-3)`'s
learning rate is a number in the closure of its `update`), a `functools.partial`'s
arguments, numbers, strings, small arrays by value and larger ones by a hash. An object
without attributes counts by its class alone.
"""

import dataclasses
import functools
import hashlib
import json
import math
import types
from collections.abc import Collection
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from .._core._policy import CHANGES
from .._program._state import Callables
from .._step._hyperparams import injected_arrays
from .._step._updates import described


# The key of a checkpoint's configuration that holds the fingerprints. A checkpoint of an
# eqfit before them has none, and resumes unchecked.
FINGERPRINTS = "fingerprints"

# How much of an object `_described` reads: the nesting it follows, the parts it lists,
# the entries of an array it lists by value (a larger one by a hash), and the bytes of
# arrays it hashes in all (past them, an array counts by its dtype and shape).
_DEPTH, _PARTS, _VALUES, _HASHED = 12, 4000, 16, 64 * 2**20


def fingerprints(
    objects: Callables, opt_state: PyTree, data: str | None, validation: Any
) -> dict[str, Any]:
    """A run's fingerprints, by `CHANGES`' names: the data's and the validation data's
    (the sources' hashes, `None` where they have none), each metric's make, the
    optimizer's (or each update's) and the injected hyperparameters of the state it
    starts from (made by it, or given as `opt_state`).
    """
    optimizer = described(objects.updates, _described)
    optimizer["hyperparams"] = {n: _plain(v) for n, v in injected_arrays(opt_state).items()}
    if objects.schedules:
        optimizer["schedules"] = {n: _described(s) for n, s in objects.schedules}
    return {
        "data": data,
        "validation_data": validation,
        "metrics": {name: _described(metric) for name, metric in objects.metrics},
        "optimizer": optimizer,
    }


def without_fingerprints(config: dict[str, Any]) -> dict[str, Any]:
    """A configuration less its fingerprints: what must match exactly."""
    return {k: v for k, v in config.items() if k != FINGERPRINTS}


def changed(
    saved: dict[str, Any], now: dict[str, Any], allow: Collection[str]
) -> tuple[list[str], str] | None:
    """What differs between a checkpoint's fingerprints (of configuration `saved`) and
    the run's (`now`'s), of the changes `allow` does not let through: their names, and
    each in words with both values; `None` where nothing does (or the checkpoint has
    none: an earlier eqfit's).
    """
    old, new = saved.get(FINGERPRINTS), now.get(FINGERPRINTS, {})
    if not isinstance(old, dict):
        return None
    names, said = [], []
    for concern in CHANGES:
        if concern in allow or old.get(concern) == new.get(concern):
            continue
        where, was, is_ = _first_difference(old.get(concern), new.get(concern))
        at = f" at `{where}`" if where else ""
        if concern in ("data", "validation_data"):  # a hash of rows spread over it
            at += " (a hash of its rows, sampled)"
        names.append(concern)
        said.append(f"{concern}{at}: the checkpoint's {_short(was)}, now {_short(is_)}")
    return (names, "; ".join(said)) if names else None


def hyperparams_changed(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the injected hyperparameters a run starts from (configuration `now`'s)
    differ from those of the run that wrote a checkpoint (of configuration `saved`): a
    change of the optimizer, allowed, which the resumed state must take up, since
    `inject_hyperparams`' updates read them from the state.
    """
    if not isinstance(saved.get(FINGERPRINTS), dict):  # an earlier eqfit's: unknown
        return False
    old = saved[FINGERPRINTS].get("optimizer") or {}
    new = (now.get(FINGERPRINTS) or {}).get("optimizer") or {}
    return old.get("hyperparams") != new.get("hyperparams")


def _described(obj: Any) -> Any:
    """`obj` as JSON that tells it from another object of another make (the module's
    docstring says what is read), the same in every process that makes it alike.
    """
    budget = [_PARTS, _HASHED]
    return _describe(obj, 0, budget, set())


def _describe(obj: Any, depth: int, budget: list[int], seen: set[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > _DEPTH:
        return "..."
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float | complex | np.generic):
        return _plain(obj)
    if isinstance(obj, np.ndarray | jax.Array):
        budget[1] -= obj.nbytes
        return _array(obj, hashed=budget[1] >= 0)
    if isinstance(obj, np.dtype | type):
        return getattr(obj, "__qualname__", str(obj)) if isinstance(obj, type) else str(obj)
    if id(obj) in seen:  # a cycle (a closure that holds itself)
        return "..."
    seen = seen | {id(obj)}
    down = functools.partial(_describe, depth=depth + 1, budget=budget, seen=seen)
    if isinstance(obj, functools.partial):
        return {"partial": down(obj.func), "args": down(obj.args), "kwargs": down(obj.keywords)}
    if isinstance(obj, types.MethodType):
        return {"method": obj.__func__.__qualname__, "of": down(obj.__self__)}
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        free = {n: down(_cell(c)) for n, c in zip(obj.__code__.co_freevars, cells)}
        return {"function": obj.__qualname__, **({"closure": free} if free else {})}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        fields = {f: down(getattr(obj, f)) for f in getattr(obj, "_fields")}  # noqa: B009
        return {"class": type(obj).__qualname__, "fields": fields}
    if isinstance(obj, list | tuple):
        return [down(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): down(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, eqx.Module) or dataclasses.is_dataclass(obj):
        fields = {f.name: down(getattr(obj, f.name, None)) for f in dataclasses.fields(obj)}
        return {"class": type(obj).__qualname__, "fields": fields}
    wrapped = getattr(obj, "__wrapped__", None)  # `jax.jit`'s functions, `custom_jvp`s
    if wrapped is not None and callable(obj):
        return {"wraps": down(wrapped)}
    fields = getattr(obj, "__dict__", None)  # `optax.MultiSteps`' inner optimizer, say
    if isinstance(fields, dict) and not isinstance(obj, types.ModuleType):
        return {"class": type(obj).__qualname__, "fields": down(fields)}
    return {"object": type(obj).__qualname__}


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a free variable not bound yet
        return None


def _array(x: Any, hashed: bool) -> Any:
    """An array by its dtype, shape and values (a few), or a hash of them (where
    `hashed`); one that is not all in this process, by its dtype and shape alone.
    """
    head = f"{x.dtype}{list(x.shape)}"
    if isinstance(x, jax.Array) and not x.is_fully_addressable or not hashed:
        return head
    if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    host = np.asarray(x)
    if host.size <= _VALUES:
        return {head: _plain(host)}
    return {head: hashlib.blake2b(np.ascontiguousarray(host).tobytes(), digest_size=8).hexdigest()}


def _plain(x: Any) -> Any:
    """Numbers (a numpy scalar or array of them) as JSON holds them and gives them back
    equal: a float that is not finite as its name.
    """
    if isinstance(x, np.ndarray) and x.ndim:
        return [_plain(v) for v in x]
    value = x.item() if isinstance(x, np.ndarray | np.generic) else x
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, complex):
        return repr(value)
    return value


def _first_difference(old: Any, new: Any, where: str = "") -> tuple[str, Any, Any]:
    """Where two fingerprints (`_described`'s JSON) first differ, as a path into them (by
    the fields' and the closures' names), and the values there.
    """
    if isinstance(old, dict) and isinstance(new, dict) and set(old) == set(new):
        for k in old:
            if old[k] != new[k]:
                step = "" if k in ("fields", "closure") else k
                return _first_difference(old[k], new[k], ".".join(filter(None, (where, step))))
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                return _first_difference(a, b, f"{where}[{i}]")
    return where, old, new


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 160 else text[:157] + "..."
