"""The layout of a model's arrays over a mesh: rules, their resolution, and `init`.

A rule says, for each array of the model (found by its path, as `jax.tree_util.keystr`
writes it), which `PartitionSpec` lays it out over the mesh. `resolve` turns a rule into
one spec per array and checks each against the array and the mesh, so that a wrong
layout fails here, naming the array, rather than inside XLA's partitioner.
"""

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .._core._checks import checked
from .._core._typing import ArrayTree
from ._compile import PROGRAM_CACHE


# `jax.Device`, which type checkers see as a variable rather than a class.
Device = Any

# Rules are frozen dataclasses: hashable and comparable by value, because a rule is part of
# a compiled program's static key and of a checkpoint's configuration.


@dataclasses.dataclass(frozen=True, repr=False)
class FSDP:
    """The rule `fsdp` returns."""

    axis: str | tuple[str, ...]
    min_bytes: int

    def __repr__(self) -> str:
        return f"fsdp(axis={self.axis!r}, min_bytes={self.min_bytes})"


@dataclasses.dataclass(frozen=True, repr=False)
class Rules:
    """The rule `rules` returns. Each pair is `(compiled pattern, layout)`."""

    # `re.Pattern`s compare and hash by their pattern and flags, so two `rules(...)`
    # written alike are equal.
    pairs: tuple[tuple[re.Pattern[str], Any], ...]
    default: Any

    def __repr__(self) -> str:
        shown = [f"({_pattern(pattern)}, {layout!r})" for pattern, layout in self.pairs]
        return f"rules({', '.join([*shown, f'default={self.default!r}'])})"


Function = Callable[[str, jax.ShapeDtypeStruct], P | None]
Layout = P | None | FSDP | Rules | Function
# What `shard=` takes: a layout for every array, or a PyTree of `PartitionSpec | None`
# that is a prefix of the model (as `eqx.filter_shard` takes).
Shard = Layout | ArrayTree


@checked("sharding.fsdp")
def fsdp(axis: str | tuple[str, ...] = "data", *, min_bytes: int = 2**14) -> FSDP:
    """Fully sharded data parallelism (FSDP, ZeRO-3), as big_vision's `fsdp` rule: each
    array is split along its largest dimension that the mesh axis's size divides (of
    equal dimensions, the first), so each device holds one slice of it.

    An array smaller than `min_bytes`, or with no dimension the axis divides, is
    replicated: splitting a bias of a few kilobytes saves little memory and costs a
    collective each time it is used.

    **Arguments:**

    - `axis`: the mesh axis to split over, or a tuple of axes to split over all of them
        at once (over `("data", "model")`, a dimension is split into as many pieces as
        both have devices together).
    - `min_bytes`: arrays of fewer bytes are replicated. The default, 16 KiB, replicates
        biases and small layers.

    **Returns:**

    A rule to pass as `shard=`.

    !!! example

        ```python
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        model = eqfit.sharding.init(
            eqx.nn.MLP, 64, 1, 1024, 2, key=jax.random.key(0),
            mesh=mesh, shard=eqfit.sharding.fsdp("data"),
        )
        model.layers[1].weight.sharding.spec  # P('data',): 128 rows per device
        model.layers[1].bias.sharding.spec  # P(): 4 KiB, replicated
        ```
    """
    if isinstance(axis, tuple) and not axis:
        raise ValueError("`fsdp`'s `axis` is an empty tuple: give a mesh axis name.")
    if min_bytes < 0:
        raise ValueError(f"`fsdp`'s `min_bytes` must be at least 0, got {min_bytes}.")
    return FSDP(axis, min_bytes)


@checked("sharding.rules")
def rules(*pairs: tuple[str | re.Pattern[str], Layout], default: Layout = None) -> Rules:
    """Layouts chosen by regular expressions over the arrays' paths, as Keras's
    `LayoutMap`.

    Each array's path is written as `jax.tree_util.keystr` writes it for the model:
    `.layers[0].weight` for the weight of an `eqx.nn.MLP`'s first layer. Each pattern is
    matched with `re.search`, so it may match anywhere in the path; anchor it with `^` or
    `$` to match the start or end only. A path that two patterns match is an error.

    **Arguments:**

    - `*pairs`: `(pattern, layout)` pairs. A layout is a `jax.sharding.PartitionSpec`;
        `None`, which replicates the array; or another rule, such as `fsdp()`.
    - `default`: the layout of an array that no pattern matches: `None` (replicated, the
        default), a `PartitionSpec`, or another rule.

    **Returns:**

    A rule to pass as `shard=`.

    !!! example

        ```python
        from jax.sharding import PartitionSpec as P

        # Megatron-style tensor parallelism over "model" for the hidden layer, FSDP over
        # "data" for the rest.
        shard = eqfit.sharding.rules(
            (r"^\\.layers\\[1\\]\\.weight$", P("model", "data")),
            (r"^\\.layers\\[1\\]\\.bias$", P("model")),
            default=eqfit.sharding.fsdp("data"),
        )
        ```
    """
    compiled = []
    for pattern, layout in pairs:
        if not isinstance(pattern, re.Pattern):
            try:
                pattern = re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"`rules`: the pattern {pattern!r} is not a regular expression ({e})."
                ) from None
        compiled.append((pattern, layout))
    return Rules(tuple(compiled), default)


def resolve(tree: PyTree, mesh: Mesh, shard: Shard) -> PyTree:
    """The `PartitionSpec` of each array of `tree`, checked against the array and `mesh`.

    **Arguments:**

    - `tree`: the model (or any PyTree); its arrays may be `jax.ShapeDtypeStruct`s.
    - `mesh`: the mesh the arrays are laid out over.
    - `shard`: a rule (`fsdp`, `rules`, a function `(path, leaf) -> PartitionSpec | None`),
        a `PartitionSpec` or `None` for every array, or a PyTree of `PartitionSpec | None`
        that is a prefix of `tree`.

    **Returns:**

    A PyTree of `tree`'s structure with a `PartitionSpec` in place of each array (`P()`
    for a replicated one) and `None` in place of everything else, as
    `eqx.partition(tree, eqx.is_array)[0]` is laid out.

    Raises a `ValueError` naming the array's path and shape and the rule that chose its
    layout, where a layout names an axis the mesh does not have, or splits a dimension
    into uneven parts, or has more entries than the array has dimensions.
    """
    if _is_layout(shard):
        return _each_array(tree, (), lambda path, leaf: _choose(shard, path, leaf, mesh), mesh)
    return _broadcast(shard, tree, (), mesh)


def shardings(tree: PyTree, mesh: Mesh, shard: Shard) -> PyTree:
    """As `resolve`, with a `NamedSharding` on `mesh` (its axes made "auto", as `fit`
    makes them) in place of each `PartitionSpec`.
    """
    mesh = _auto(mesh)
    specs = resolve(tree, mesh, shard)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


@checked("sharding.init")
def init(make: Callable[..., Any], *args: Any, mesh: Mesh, shard: Shard, **kwargs: Any) -> Any:
    """Builds a model with its arrays laid out over a mesh from the start, so that no
    device ever holds the whole model: `make(*args, **kwargs)`, compiled, with each
    array of its output made directly in its place.

    The parameters are the same, bit for bit, as those of `make(*args, **kwargs)` called
    plainly with the same key: JAX's random numbers do not depend on how the arrays are
    laid out (under `jax_threefry_partitionable`, JAX's default).

    **Arguments:**

    - `make`: builds the model, such as `eqx.nn.MLP` or a function.
    - `*args`, `**kwargs`: its arguments; the arrays among them (keys too) are passed to
        the compiled program, and everything else is held fixed in it.
    - `mesh`: the devices, as a `jax.sharding.Mesh`. Its axes are made "auto" (as
        `fit(..., mesh=)` makes them) if they are not already.
    - `shard`: the layout of each array: `fsdp(...)`, `rules(...)`, a function
        `(path, leaf) -> PartitionSpec | None`, or a PyTree of `PartitionSpec | None`
        that is a prefix of the model.

    **Returns:**

    The model, its arrays sharded over `mesh`.
    """
    # The layouts are checked on the model's shapes, before anything compiles or runs.
    abstract = eqx.filter_eval_shape(make, *args, **kwargs)
    placed = shardings(abstract, mesh, shard)
    shapes, rest = eqx.partition(abstract, _is_abstract)
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    out_shardings = jax.tree.leaves(placed)

    def build(dynamic: PyTree) -> list:
        args, kwargs = eqx.combine(dynamic, static)
        return jax.tree.leaves(eqx.filter(make(*args, **kwargs), eqx.is_array))

    # A flat list of arrays and of shardings: nothing for `jit` to match up but order.
    compile = lambda: jax.jit(build, out_shardings=out_shardings)  # noqa: E731
    # Kept with `fit`'s programs, so a second `init` of the same build compiles nothing.
    leaves, treedef = jax.tree.flatten(static)
    key = ("sharding.init", make, treedef, tuple(leaves), tuple(map(type, leaves)))
    try:
        program = PROGRAM_CACHE.get((*key, tuple(out_shardings)), compile)
    except TypeError:  # an argument that cannot be hashed: compiled afresh, as `jit` would
        program = compile()
    out = program(dynamic)
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(shapes), out), rest)


@checked("sharding.bytes_per_device")
def bytes_per_device(tree: ArrayTree) -> dict[Device, int]:
    """The bytes of `tree`'s arrays that each device holds: a replicated array counts
    whole on each of its devices, a sharded one its shard only.

    The count is exact, from the arrays' shards (`Device.memory_stats()`, which would
    also count XLA's buffers, is not available on every platform, CPU among them).

    **Arguments:**

    - `tree`: any PyTree; its leaves other than JAX arrays are ignored.

    **Returns:**

    A dict from each device of this process that holds a part of an array of `tree` to
    its bytes.
    """
    held: dict[Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for piece in leaf.addressable_shards:
                held[piece.device] = held.get(piece.device, 0) + piece.data.nbytes
    return held


# The layout of one array.


def _choose(layout: Layout, path: str, leaf: jax.ShapeDtypeStruct, mesh: Mesh) -> tuple[Any, str]:
    """The spec `layout` gives the array at `path`, and words for the rule that chose it."""
    if layout is None or isinstance(layout, P):
        return layout, f"the layout {layout!r}"
    if isinstance(layout, FSDP):
        return _fsdp(layout, path, leaf, mesh), repr(layout)
    if isinstance(layout, Rules):
        matched = [(p, value) for p, value in layout.pairs if p.search(path)]
        if len(matched) > 1:
            (first, a), (second, b) = matched[:2]
            raise ValueError(
                f"`shard`: the rules ({_pattern(first)}, {a!r}) and ({_pattern(second)}, "
                f"{b!r}) both match {_where(path, leaf)}; a path may match one rule at most, "
                "so make the patterns exclusive (anchor them with `^` or `$`, say)."
            )
        if matched:
            pattern, value = matched[0]
            if value is None or isinstance(value, P):
                return value, f"the rule ({_pattern(pattern)}, {value!r})"
            return _choose(value, path, leaf, mesh)
        if layout.default is None or isinstance(layout.default, P):
            return layout.default, f"the default layout {layout.default!r} of `rules`"
        return _choose(layout.default, path, leaf, mesh)
    spec = layout(path, leaf)
    name = f"the function `{getattr(layout, '__qualname__', repr(layout))}`"
    if spec is not None and not isinstance(spec, P):
        raise ValueError(
            f"`shard`: {name} returned {spec!r} for {_where(path, leaf)}, where a "
            "`jax.sharding.PartitionSpec` (or `None`, to replicate the array) was expected."
        )
    return spec, name


def _fsdp(rule: FSDP, path: str, leaf: jax.ShapeDtypeStruct, mesh: Mesh) -> P | None:
    axes = rule.axis if isinstance(rule.axis, tuple) else (rule.axis,)
    for axis in axes:
        if axis not in mesh.shape:
            raise ValueError(
                f"`shard`: {rule!r} lays out {_where(path, leaf)} over the mesh axis {axis!r}, "
                f"but the mesh has no axis {axis!r} (its axes are {dict(mesh.shape)})."
            )
    if math.prod(leaf.shape) * leaf.dtype.itemsize < rule.min_bytes:
        return None
    pieces = math.prod(mesh.shape[axis] for axis in axes)
    splits = [i for i, size in enumerate(leaf.shape) if size > 0 and size % pieces == 0]
    if not splits:
        return None
    largest = max(splits, key=lambda i: leaf.shape[i])  # the first of equal ones
    return P(*[None] * largest, rule.axis)


def _check(spec: Any, path: str, leaf: jax.ShapeDtypeStruct, rule: str, mesh: Mesh) -> P:
    """`spec` (`P()` for `None`), if it fits the array at `path` and `mesh`."""
    if spec is None:
        return P()

    def fail(why: str) -> ValueError:
        return ValueError(f"`shard`: {rule} lays out {_where(path, leaf)} as {spec!r}, but {why}.")

    if len(spec) > len(leaf.shape):
        raise fail(
            f"the array has {len(leaf.shape)} dimensions, fewer than the layout's "
            f"{len(spec)} entries"
        )
    used: set[str] = set()
    for i, entry in enumerate(spec):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        for axis in axes:
            if not isinstance(axis, str):
                raise fail(f"its entry {entry!r} is not a mesh axis name")
            if axis not in mesh.shape:
                raise fail(f"the mesh has no axis {axis!r} (its axes are {dict(mesh.shape)})")
            if axis in used:
                raise fail(f"it splits more than one dimension over the mesh axis {axis!r}")
            used.add(axis)
        pieces = math.prod(mesh.shape[axis] for axis in axes)
        if leaf.shape[i] % pieces:
            over = f"axis {entry!r}" if isinstance(entry, str) else f"axes {entry!r}"
            raise fail(
                f"dimension {i} (of size {leaf.shape[i]}) does not split evenly over the "
                f"{pieces} devices of the mesh {over}"
            )
    return spec


# One layout for every array of a tree, or a PyTree of specs that is a prefix of it.


def _each_array(
    tree: PyTree,
    base: tuple,
    choose: Callable[[str, jax.ShapeDtypeStruct], tuple[Any, str]],
    mesh: Mesh,
) -> PyTree:
    def one(path: tuple, leaf: Any) -> P | None:
        if not _is_arraylike(leaf):
            return None
        where, abstract = jax.tree_util.keystr((*base, *path)), _abstract(leaf)
        spec, rule = choose(where, abstract)
        return _check(spec, where, abstract, rule, mesh)

    return jax.tree_util.tree_map_with_path(one, tree)


def _broadcast(prefix: Any, tree: PyTree, base: tuple, mesh: Mesh) -> PyTree:
    """The specs of `tree`'s arrays, from `prefix`, a PyTree of specs that is a prefix of
    `tree` (which is at `base` in the whole model).
    """
    if prefix is None or isinstance(prefix, P):
        where = jax.tree_util.keystr(base)
        rule = f"the layout {prefix!r}" + (f" that `shard` gives at `{where}`" if where else "")
        return _each_array(tree, base, lambda path, leaf: (prefix, rule), mesh)
    if not _holds_arrays(tree):
        return jax.tree.map(lambda _: None, tree)  # nothing to lay out: any prefix fits
    prefix_children, prefix_def = _one_level(prefix)
    children, tree_def = _one_level(tree)
    if jax.tree_util.treedef_is_leaf(prefix_def) or prefix_def != tree_def:
        where = jax.tree_util.keystr(base)
        at = f"at `{where}`" if where else "at its root"
        if jax.tree_util.treedef_is_leaf(prefix_def):
            expected = "a `PartitionSpec` or `None`"
        else:
            expected = "a PyTree that is a prefix of the model"
        raise ValueError(
            f"`shard` is not a prefix of the model: {at} it holds {_describe(prefix)}, where "
            f"the model holds {_describe(tree)}{_first_array(tree, base)}; `shard` must hold "
            f"{expected} there."
        )
    return tree_def.unflatten(
        _broadcast(p, t, (*base, *path), mesh)
        for (_, p), (path, t) in zip(prefix_children, children)
    )


def _one_level(node: Any) -> tuple[list, Any]:
    """`node`'s children with their keys, and its treedef with each child a leaf."""
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)


def _describe(node: Any) -> str:
    if _is_arraylike(node):
        return f"an array of shape {tuple(node.shape)}"
    children, treedef = _one_level(node)
    if jax.tree_util.treedef_is_leaf(treedef):
        shown = repr(node)
        return f"{shown[:60]}..." if len(shown) > 63 else shown
    keys = [jax.tree_util.keystr(path) for path, _ in children]
    return f"a {type(node).__name__} with children {', '.join(keys) or 'none'}"


def _first_array(tree: PyTree, base: tuple) -> str:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_arraylike(leaf):
            where = jax.tree_util.keystr((*base, *path))
            return f" (its arrays start with `{where}`, of shape {tuple(leaf.shape)})"
    return ""


# Small pieces.


def _is_layout(shard: Any) -> bool:
    """Whether `shard` is one layout for every array, rather than a PyTree of specs. A
    callable `eqx.Module` is taken for a PyTree: a model-shaped tree of specs is one.
    """
    if shard is None or isinstance(shard, P | FSDP | Rules):
        return True
    return callable(shard) and not isinstance(shard, eqx.Module)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _is_abstract(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _is_arraylike(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _holds_arrays(tree: PyTree) -> bool:
    return any(_is_arraylike(leaf) for leaf in jax.tree.leaves(tree))


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """What a rule sees of an array: its shape and dtype, not where it is now."""
    return jax.ShapeDtypeStruct(tuple(np.shape(leaf)), leaf.dtype)


def _where(path: str, leaf: jax.ShapeDtypeStruct) -> str:
    return f"`{path}` (shape {tuple(leaf.shape)})" if path else f"the array of shape {leaf.shape}"


def _pattern(pattern: re.Pattern[str]) -> str:
    return repr(pattern.pattern) if pattern.flags == re.UNICODE else repr(pattern)


def _auto(mesh: Mesh) -> Mesh:
    # eqfit places each array itself, which needs the mesh's axes in "auto" mode
    # (`jax.make_mesh` makes explicit ones), as `fit(..., mesh=)` does.
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
