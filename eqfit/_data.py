"""Check and normalise data, plan batches, order samples on the device, gather a batch."""

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key, PyTree, Shaped, UInt32


Data = tuple[Shaped[Array, "n ..."], ...]
Batch = tuple[Shaped[Array, "batch ..."], ...]
ValData = tuple[Shaped[Array, "n_val ..."], ...]


def as_data(data: Any) -> tuple[Array, ...]:
    """Checks `data` and moves it to the device once.

    **Arguments:**

    - `data`: a tuple of numpy or JAX arrays that share their leading axis.

    **Returns:**

    The same tuple as JAX arrays. JAX arrays are not copied.
    """
    check_data(data)
    return tuple(a if isinstance(a, jax.Array) else jnp.asarray(a) for a in data)


def check_data(data: Any) -> None:
    """Refuses `data` that is not a non-empty tuple of numeric arrays sharing their
    leading (sample) axis, naming the array and the sizes. Moves nothing.
    """
    if not isinstance(data, tuple):
        hint = " For a single array pass `(x,)`." if _is_array(data) else ""
        raise TypeError(
            f"`data` must be a tuple of arrays such as `(x, y)`, got {_describe(data)}." + hint
        )
    if len(data) == 0:
        raise ValueError("`data` is empty: give at least one array, e.g. `(x, y)`.")
    for i, a in enumerate(data):
        if not _is_array(a):
            raise TypeError(f"`data[{i}]` must be a numpy or JAX array, got {_describe(a)}.")
        if not _is_numeric(a.dtype):
            raise TypeError(f"`data[{i}]` has dtype {a.dtype}; eqfit trains on numeric arrays.")
        if a.ndim == 0:
            raise ValueError(f"`data[{i}]` is a scalar; every array needs a leading sample axis.")
    lengths = [a.shape[0] for a in data]
    if any(n != lengths[0] for n in lengths):
        bad = next(i for i, n in enumerate(lengths) if n != lengths[0])
        raise ValueError(
            "The arrays in `data` must share their leading (sample) axis: "
            f"`data[0]` has {lengths[0]} samples but `data[{bad}]` has {lengths[bad]} "
            f"(shapes {[tuple(a.shape) for a in data]})."
        )
    if lengths[0] == 0:
        raise ValueError(
            f"`data` is empty: its arrays have 0 samples (shapes {[tuple(a.shape) for a in data]})."
        )


def as_key(key: Any) -> Key[Array, ""]:
    """Returns `key` as a typed PRNG key, accepting `jax.random.key` and raw `uint32[2]`."""
    if _is_key(key) and key.shape == ():
        return key
    if _is_array(key) and key.dtype == jnp.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(jnp.asarray(key))
    raise TypeError(
        f"`key` must be a single PRNG key such as `jax.random.key(0)`, got {_describe(key)}."
    )


def split_keys(key: Key[Array, ""], members: int | None) -> tuple[Array, Key[Array, ""]]:
    """The (shuffle, step) keys, `(members, 2)` of them for an ensemble, and the key that
    chooses `validation_split`'s samples.
    """
    if members is None:
        shuffle_key, step_key, split_key = jax.random.split(key, 3)
        return jnp.stack([shuffle_key, step_key]), split_key
    per_member = jax.vmap(lambda k: jax.random.split(k, 3)[:2])(jax.random.split(key, members))
    return per_member, jax.random.split(key, 3)[2]


class BatchPlan(NamedTuple):
    """How one epoch splits into batches. Hashable: it is part of a compiled program."""

    num_samples: int
    batch_size: int
    num_full: int
    remainder: int

    @property
    def steps_per_epoch(self) -> int:
        return self.num_full + (self.remainder > 0)

    def weights(self) -> Float[Array, " steps"]:
        """Each step's share of an epoch's samples: per-epoch means weight steps by it."""
        sizes = self.batch_sizes
        return jnp.asarray(sizes, jnp.float32) / sum(sizes)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The size of each step's batch within an epoch."""
        return (self.batch_size,) * self.num_full + ((self.remainder,) if self.remainder else ())


def plan_batches(num_samples: int, batch_size: int, drop_remainder: bool) -> BatchPlan:
    """Splits `num_samples` into full batches of `batch_size` and one remainder batch.

    **Arguments:**

    - `num_samples`: the size of the data's leading axis.
    - `batch_size`: samples per step.
    - `drop_remainder`: if `True`, the last `num_samples % batch_size` samples of each
        epoch's order are skipped rather than taken as a smaller final step.

    **Returns:**

    A `BatchPlan`.
    """
    check_batch_size(batch_size)
    num_full, remainder = divmod(num_samples, batch_size)
    if drop_remainder:
        if num_full == 0:
            raise ValueError(
                f"`batch_size`={batch_size} is larger than the {num_samples} samples "
                "in `data` and `drop_remainder=True`, so no step would run."
            )
        remainder = 0
    return BatchPlan(num_samples, batch_size, num_full, remainder)


def check_batch_size(batch_size: int) -> None:
    """Refuses a `batch_size` below 1."""
    if isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}.")


def epoch_order(
    key: Key[Array, ""], epoch: Int[Array, ""], num_samples: int, shuffle: bool
) -> UInt32[Array, " {num_samples}"]:
    """The order in which one epoch visits the samples.

    A single sort of 64 random bits per sample, not `jax.random.permutation`: that runs
    two rounds of sorting and costs 2.35 ms for 8192 samples on a 2-core CPU, against
    1.43 ms here (`python benchmarks/shuffle.py`). With 64-bit keys a
    tie, which would keep two samples in their original order, has odds of about
    N^2 / 2^65.
    """
    index = jnp.arange(num_samples, dtype=jnp.uint32)
    if not shuffle:
        return index
    bits = jax.random.bits(jax.random.fold_in(key, epoch), (2, num_samples))
    return jax.lax.sort((bits[0], bits[1], index), num_keys=2)[2]


def take(data: Data, index: UInt32[Array, " batch"]) -> Batch:
    """Gathers the samples at `index` from every array of `data`."""
    # Indices come from `epoch_order`, so they are in bounds and unique within a batch;
    # saying so spares XLA the bounds masking of the default "fill" mode.
    return tuple(a.at[index].get(mode="promise_in_bounds", unique_indices=True) for a in data)


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _is_numeric(dtype: Any) -> bool:
    """Numbers and booleans, bfloat16 and the other ML types included; PRNG keys too."""
    if isinstance(dtype, np.dtype) and dtype.kind in "biufc":
        return True  # the common case, without the slower `jnp.issubdtype`
    return is_dtype(dtype, jnp.number) or is_dtype(dtype, jax.dtypes.prng_key)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and is_dtype(x.dtype, jax.dtypes.prng_key)


@functools.cache
def is_dtype(dtype: Any, kind: Any) -> bool:
    """`jnp.issubdtype`, remembered: it costs about a microsecond a call, and `fit`
    asks it of every array it is given.
    """
    return bool(jnp.issubdtype(dtype, kind))


def _describe(x: Any) -> str:
    if _is_array(x):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


def ensemble_size(model: PyTree) -> int:
    """The number of members of a stacked model, checked."""
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    if not leaves or any(leaf.ndim == 0 for leaf in leaves):
        shapes = [tuple(leaf.shape) for leaf in leaves][:4]
        raise ValueError(
            "With `ensemble=True`, `model` must be a stack of members: every array needs "
            f"a leading member axis, but some are scalars (shapes {shapes}...). Build it "
            "with `eqx.filter_vmap(make_model)(jax.random.split(key, members))`."
        )
    sizes = {leaf.shape[0] for leaf in leaves}
    if len(sizes) > 1:
        raise ValueError(
            "With `ensemble=True`, every array of `model` must have the same leading "
            f"(member) size, but they have sizes {sorted(sizes)}."
        )
    return sizes.pop()
