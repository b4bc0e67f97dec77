"""A PyTree split into its arrays and the rest: the rest (a `Skeleton`) is hashable, so
it can be a compiled program's static argument, and the arrays its dynamic ones.
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax
from jaxtyping import PyTree


class Skeleton(NamedTuple):
    """A PyTree with its arrays taken out: hashable, so it can be a static argument.

    `leaves` holds `None` where an array was (flattening never yields `None` itself) and
    `types` tells `1` from `1.0` and `True`, which compare equal but trace differently.
    """

    treedef: Any
    leaves: tuple[Any, ...]
    types: tuple[type, ...]

    def fill(self, arrays: list[Any]) -> PyTree:
        """The PyTree again, its array places filled in order from `arrays`."""
        it = iter(arrays)
        return jax.tree.unflatten(self.treedef, [next(it) if x is None else x for x in self.leaves])


def split_arrays(tree: PyTree) -> tuple[list[Any], Skeleton]:
    """`tree`'s arrays, and the rest of it as a `Skeleton`."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [x for x in leaves if eqx.is_array(x)]
    rest = tuple(None if eqx.is_array(x) else _hashable(x) for x in leaves)
    return arrays, Skeleton(treedef, rest, tuple(map(type, rest)))


class _ByIdentity:
    """A leaf that cannot be hashed, compared by identity instead (so a new one each call
    means a new compilation, as `jax.jit` would demand a hashable static argument).
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.value is self.value


def _hashable(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return _ByIdentity(x)
    return x


def unwrap(tree: PyTree) -> PyTree:
    """`tree` with the leaves that `split_arrays` wrapped (`_ByIdentity`) unwrapped."""
    return jax.tree.map(lambda x: x.value if isinstance(x, _ByIdentity) else x, tree)
