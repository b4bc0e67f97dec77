"""Metrics that accumulate (`AbstractMetric`): each batch gives its statistics, which the
run sums (over an epoch's steps, microbatches, devices, a validation set's batches) and
turns into the metric's value once, from the sum. How the run holds them: the arrays of
a batch's statistics (`arrays`), summed; the rest (a metrax metric's `num_thresholds`),
found before the run (`Like`) and put back before `compute` (`value`).
"""

import dataclasses
import functools
import math
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from .._core._metric import AbstractMetric, adds


@dataclasses.dataclass(frozen=True)
class Like:
    """A batch's statistics of one metric, found abstractly and kept hashable (the run's
    description is): their structure, and their leaves, shapes for the arrays.
    """

    treedef: Any
    leaves: tuple[Any, ...]

    @staticmethod
    def of(statistics: PyTree) -> "Like":
        leaves, treedef = jax.tree.flatten(statistics)
        return Like(treedef, tuple(leaves))

    @property
    def tree(self) -> PyTree:
        return jax.tree.unflatten(self.treedef, self.leaves)

    @property
    def static(self) -> PyTree:
        """Its leaves that are not arrays (configuration), `None` in the arrays' places."""
        return eqx.filter(self.tree, _is_shaped, inverse=True, is_leaf=_is_shaped)


def arrays(statistics: PyTree) -> PyTree:
    """The arrays of `statistics` (what the run sums), `None` elsewhere."""
    return eqx.filter(statistics, eqx.is_array)


def zeros(like: Like | tuple[Like, ...]) -> PyTree:
    """Empty statistics: zeros shaped as `like`'s arrays."""
    tree = tuple(x.tree for x in like) if isinstance(like, tuple) else like.tree
    return jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype),
        eqx.filter(tree, _is_shaped),
        is_leaf=_is_shaped,
    )


def add(a: PyTree, b: PyTree) -> PyTree:
    """Two statistics' arrays summed."""
    return jax.tree.map(jnp.add, a, b)


def value(metric: AbstractMetric, like: Like, summed: PyTree) -> Array:
    """`metric`'s value from its `summed` arrays, its other leaves put back from
    `like`, as a float32 array.
    """
    out = metric.compute(eqx.combine(summed, like.static))
    return jnp.asarray(out).astype(jnp.float32)


def value_shape(metric: AbstractMetric, like: Like) -> tuple[int, ...]:
    """The shape of `metric`'s value, found abstractly from `like`."""
    return tuple(jax.eval_shape(lambda: value(metric, like, zeros(like))).shape)


def entry_names(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The names of a value's entries as the run records them, flat: `name` for a
    scalar; `name/i/j` for each entry of an array (C order), the name that the loggers
    take (TensorBoard, W&B and MLflow group names by `/`).
    """
    if not shape:
        return (name,)
    return tuple("/".join((name, *map(str, i))) for i in np.ndindex(*shape))


# An array value's entry among the logs (`entry_names`): left out of the bar and lines.
ENTRY = re.compile(r"/\d+(?:/\d+)*$")


def grouped(
    flat: dict[str, Any], arrays: tuple[tuple[str, tuple[int, ...], tuple[str, ...]], ...]
) -> dict[str, Any]:
    """`flat` (values by name, each an array `(epochs, ...)` or a number) with each array
    value's entries (`arrays`: its name, shape and entries' names) put together as one
    array, `(epochs, *shape, ...)` or `shape`, where its first entry was; an array whose
    entries `flat` does not hold is passed over.
    """
    firsts = {entries[0]: (name, shape, entries) for name, shape, entries in arrays}
    taken = {e for _, _, entries in arrays for e in entries}
    out: dict[str, Any] = {}
    for key, v in flat.items():
        if key in firsts:
            name, shape, entries = firsts[key]
            parts = [np.asarray(flat[e]) for e in entries]
            if parts[0].ndim == 0:
                out[name] = np.stack(parts).reshape(shape)
            else:
                lead, rest = parts[0].shape[0], parts[0].shape[1:]
                out[name] = np.stack(parts, axis=1).reshape(lead, *shape, *rest)
        elif key not in taken:
            out[key] = v
    return out


def _is_shaped(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


def accumulated_shapes(
    accumulating: tuple[tuple[str, AbstractMetric], ...], likes: tuple[Like, ...]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each accumulating metric's name and its value's shape, found abstractly (and
    remembered for the same metrics, where they can be hashed).
    """
    try:
        return _accumulated_shapes(accumulating, likes)
    except TypeError:  # a metric that holds arrays
        return _accumulated_shapes.__wrapped__(accumulating, likes)


@functools.lru_cache(maxsize=64)
def _accumulated_shapes(
    accumulating: tuple[tuple[str, AbstractMetric], ...], likes: tuple[Like, ...]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(
        (name, value_shape(metric, like)) for (name, metric), like in zip(accumulating, likes)
    )


def values(
    accumulating: tuple[tuple[str, AbstractMetric], ...],
    likes: tuple[Like, ...],
    summed: tuple[PyTree, ...],
) -> Array:
    """The accumulating metrics' values from their summed statistics, flat, in order
    (as `Record.accumulated_names`): float32, empty without such metrics.
    """
    flat = [
        value(metric, like, s).reshape(-1)
        for (_, metric), like, s in zip(accumulating, likes, summed)
    ]
    return jnp.concatenate(flat) if flat else jnp.zeros(0, jnp.float32)


def flat_size(likes: tuple[Like, ...]) -> int:
    """How many numbers the arrays of statistics shaped as `likes` hold."""
    return sum(math.prod(s.shape) for like in likes for s in like.leaves if _is_shaped(s))


def flatten(statistics: tuple[PyTree, ...]) -> Array:
    """Statistics' arrays as one float32 vector (a validation's totals carry them so)."""
    leaves = [jnp.asarray(x, jnp.float32).reshape(-1) for x in jax.tree.leaves(statistics)]
    return jnp.concatenate(leaves) if leaves else jnp.zeros(0, jnp.float32)


def unflatten(flat: Array, likes: tuple[Like, ...]) -> tuple[PyTree, ...]:
    """`flatten`'s inverse: statistics' arrays shaped (and typed) as `likes`'."""
    empty = zeros(likes)
    leaves, treedef = jax.tree.flatten(empty)
    out, start = [], 0
    for x in leaves:
        out.append(flat[start : start + x.size].reshape(x.shape).astype(x.dtype))
        start += x.size
    return jax.tree.unflatten(treedef, out)


def check_statistics(name: str, metric: AbstractMetric, like: Like) -> None:
    """Refuses, before the run, statistics it would not sum right, as found abstractly
    (`like`): a number that is no array (kept as configuration, never summed), an array
    of bools (summed as an OR) or of complex numbers (recorded as float32, its imaginary
    part dropped); and a metrax (or clu) metric whose `merge` does not add its arrays
    (the run sums them, across devices too, by `psum`). That `merge` is tried on two
    small statistics of ones and twos: it must give threes.
    """
    taken = getattr(metric, "metric", None)  # `Metrax`'s class
    merges = getattr(taken, "merge", None) is not None
    for path, leaf in jax.tree_util.tree_leaves_with_path(like.tree):
        where = f"metric {name!r}: its statistic `{jax.tree_util.keystr(path)}`"
        if not _is_shaped(leaf):
            if not merges and isinstance(leaf, int | float | complex | np.number):
                raise TypeError(
                    f"{where} is a Python {type(leaf).__name__} ({leaf!r}), which the run "
                    "would keep as it is, as configuration, and not sum over the batches: "
                    "return it as an array (`jnp.asarray(...)`), so that it adds."
                )
            continue  # configuration (a metrax metric's `num_thresholds`)
        if leaf.dtype == jnp.bool_:
            raise TypeError(
                f"{where} is an array of bools, which add as an OR (True + True is True): "
                "count them (`jnp.sum(...)`), or return them as numbers (`.astype(jnp.int32)`)."
            )
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            raise TypeError(
                f"{where} is complex ({leaf.dtype}): the run keeps statistics as real "
                "numbers, and would drop its imaginary part. Return its real and imaginary "
                "parts as two statistics."
            )
    if merges:
        _check_merge(name, taken, like)


def _check_merge(name: str, taken: Any, like: Like) -> None:
    """Refuses a metrax (or clu) metric class whose `merge` does not add (`check_statistics`)."""
    ones, twos = (
        eqx.combine(jax.tree.map(lambda z: jnp.full(z.shape, k, z.dtype), zeros(like)), like.static)
        for k in (1, 2)
    )
    try:
        merged = arrays(type(ones).merge(ones, twos))
    except NotImplementedError:
        kind = getattr(taken, "__name__", repr(taken))
        raise ValueError(
            f"metric {name!r}: {kind} has no `merge` (metrax leaves it unwritten), so its "
            "statistics cannot be added up over an epoch's batches. Use a metric that merges "
            "(eqfit's `F1`, `Precision` and `Recall` accumulate their counts), or write it as "
            "an `eqfit.metrics.AbstractMetric`."
        ) from None
    if not all(bool(jnp.all(x == 3)) for x in jax.tree.leaves(merged)):
        kind = getattr(taken, "__name__", repr(taken))
        raise ValueError(
            f"metric {name!r}: {kind}.merge does not add its statistics, but eqfit sums "
            "them (over an epoch's steps, across devices, over a validation set's "
            "batches), which would give another value than merging. Write it as an "
            "`eqfit.metrics.AbstractMetric` whose statistics add."
        )


def check_leaves(name: str, statistics: PyTree) -> PyTree:
    """`statistics`, refused where a leaf is a numpy array (text, or numbers made on the
    host): the run sums statistics as JAX arrays, and a traced function cannot return one.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(statistics):
        if isinstance(leaf, np.ndarray | np.generic):
            fix = (
                "text cannot be summed: count what it names as numbers"
                if leaf.dtype.kind in "USO"
                else "make it a JAX array, `jnp.asarray(...)`"
            )
            raise TypeError(
                f"metric {name!r}: its statistics hold a numpy {leaf.dtype}{list(leaf.shape)} "
                f"at `statistics{jax.tree_util.keystr(path)}`, but the run sums a batch's "
                f"statistics as JAX arrays: {fix}."
            )
    return statistics


def one_row_less(batch: PyTree) -> PyTree | None:
    """`batch`'s shapes with a row less (`None` for a batch of one row, or none): the
    statistics found on both show which grow with the batch.
    """
    leaves = [x for x in jax.tree.leaves(batch) if _is_shaped(x) and x.ndim > 0]
    if not leaves or leaves[0].shape[0] < 2:
        return None

    def fewer(x: Any) -> Any:
        if not (_is_shaped(x) and x.ndim > 0):
            return x
        return jax.ShapeDtypeStruct((x.shape[0] - 1, *x.shape[1:]), x.dtype)

    return jax.tree.map(fewer, batch)


def check_batch_free(name: str, like: Like, fewer: Like) -> None:
    """Refuses statistics whose shapes follow the batch's size (`like` found on a batch,
    `fewer` on it with a row less): a row's each, which summing over batches would add
    row to row of different examples, or fail where a last batch is smaller.
    """
    pairs = zip(jax.tree_util.tree_leaves_with_path(like.tree), jax.tree.leaves(fewer.tree))
    for (path, a), b in pairs:
        if _is_shaped(a) and _is_shaped(b) and a.shape != b.shape:
            raise ValueError(
                f"metric {name!r}: its statistics `statistics{jax.tree_util.keystr(path)}` "
                f"have shape {tuple(a.shape)} on a batch and {tuple(b.shape)} on a batch of a "
                "row less: a batch's statistics must be sums over its rows (counts, totals) "
                "of a shape of their own, which the run adds up batch by batch; sum them "
                "over the batch, `jnp.sum(..., axis=0)`."
            )


def split_statistics(
    objective: Any, model: PyTree, model_state: PyTree, rows: PyTree, half: int
) -> tuple[tuple[PyTree, ...], tuple[PyTree, ...], tuple[PyTree, ...]]:
    """The statistics of each metric that accumulates (`objective`'s) on `rows`, and on
    its first `half` rows and the rest: what `check_split` compares.
    """

    def of(batch: PyTree) -> tuple[PyTree, ...]:
        return objective.statistics(model, model_state, batch)[0]

    first = jax.tree.map(lambda a: a[:half], rows)
    second = jax.tree.map(lambda a: a[half:], rows)
    return of(rows), of(first), of(second)


def check_split(
    accumulating: tuple[tuple[str, AbstractMetric], ...],
    whole: tuple[PyTree, ...],
    first: tuple[PyTree, ...],
    second: tuple[PyTree, ...],
    rows: int,
) -> None:
    """Refuses a metric of one's own (eqfit's and metrax's are known to add) whose
    statistics do not add under a batch split: those of `rows` rows of the data (`whole`)
    must be, to float rounding, the sum of those of its two halves. The run sums them
    over steps, microbatches, devices and batches; a mean or a maximum would be summed.
    """
    for (name, metric), w, a, b in zip(accumulating, whole, first, second):
        if adds(metric):
            continue
        for (path, x), y, z in zip(
            jax.tree_util.tree_leaves_with_path(w), jax.tree.leaves(a), jax.tree.leaves(b)
        ):
            x, y, z = np.asarray(x), np.asarray(y), np.asarray(z)
            where = f"metric {name!r}: its statistic `{jax.tree_util.keystr(path)}`"
            if y.shape != x.shape or z.shape != x.shape:
                raise ValueError(
                    f"{where} has shape {x.shape} on a batch of {rows} rows and {y.shape} "
                    "on its half: its shape depends on the batch (a statistic per row?), so "
                    "the batches' cannot be summed. Reduce it over the batch's rows: a "
                    "count, a sum."
                )
            summed = np.asarray(y + z)
            inexact = jnp.issubdtype(x.dtype, jnp.floating)  # bfloat16's numpy kind is "V"
            rtol = max(1e-2, 16 * float(jnp.finfo(x.dtype).eps)) if inexact else 0
            # Rounding is of the largest of the three: halves that cancel add up to ~0.
            scale = float(max(np.nanmax(np.abs(v), initial=0.0) for v in (x, y, z)))
            if not np.allclose(summed, x, rtol=rtol, atol=rtol * scale, equal_nan=True):
                raise ValueError(
                    f"{where} does not add under a batch split: on {rows} rows of the data "
                    f"it is {_shown(x)}, but the sum of its halves' is {_shown(summed)}. The run "
                    "sums a batch's statistics over the steps, microbatches, devices and "
                    "validation batches, so each must be a sum over the batch's rows (a "
                    "count, a sum), not a mean or a maximum: return sums, and divide in "
                    "`compute`."
                )


def _shown(x: np.ndarray) -> str:
    """A statistic's value in a message: a number, or an array's first entries."""
    if x.ndim == 0:
        return f"{x.item():.6g}"
    flat = ", ".join(f"{v:.6g}" for v in x.reshape(-1)[:4].tolist())
    return f"[{flat}{', ...' if x.size > 4 else ''}] (shape {x.shape})"
