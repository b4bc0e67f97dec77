"""Check and normalise data, plan batches, order samples on the device, gather a batch."""

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Key, PyTree, Shaped, UInt32


Data = tuple[Shaped[Array, "n ..."], ...]
Batch = tuple[Shaped[Array, "batch ..."], ...]
ValData = tuple[Shaped[Array, "n_val ..."], ...]


def as_data(data: Any, name: str = "data") -> tuple[Array, ...]:
    """Checks `data` and moves it to the device once.

    **Arguments:**

    - `data`: a tuple of numpy or JAX arrays that share their leading axis.
    - `name`: the argument's name, for errors.

    **Returns:**

    The same tuple as JAX arrays. JAX arrays are not copied.
    """
    check_data(data, name)
    return tuple(a if isinstance(a, jax.Array) else jnp.asarray(a) for a in data)


def check_data(data: Any, name: str = "data") -> None:
    """Refuses `data` that is not a non-empty tuple of numeric arrays sharing their
    leading (sample) axis, naming the array and the sizes. Moves nothing.
    """
    if not isinstance(data, tuple):
        hint = " For a single array pass `(x,)`." if _is_array(data) else ""
        raise TypeError(
            f"`{name}` must be a tuple of arrays such as `(x, y)`, got {_describe(data)}." + hint
        )
    if len(data) == 0:
        raise ValueError(f"`{name}` is empty: give at least one array, e.g. `(x, y)`.")
    for i, a in enumerate(data):
        if not _is_array(a):
            raise TypeError(f"`{name}[{i}]` must be a numpy or JAX array, got {_describe(a)}.")
        if not _is_numeric(a.dtype):
            raise TypeError(f"`{name}[{i}]` has dtype {a.dtype}; eqfit trains on numeric arrays.")
        if a.ndim == 0:
            raise ValueError(f"`{name}[{i}]` is a scalar; every array needs a leading sample axis.")
    lengths = [a.shape[0] for a in data]
    if any(n != lengths[0] for n in lengths):
        bad = next(i for i, n in enumerate(lengths) if n != lengths[0])
        raise ValueError(
            f"The arrays in `{name}` must share their leading (sample) axis: "
            f"`{name}[0]` has {lengths[0]} samples but `{name}[{bad}]` has {lengths[bad]} "
            f"(shapes {[tuple(a.shape) for a in data]})."
        )
    if lengths[0] == 0:
        raise ValueError(
            f"`{name}` is empty: its arrays have 0 samples "
            f"(shapes {[tuple(a.shape) for a in data]})."
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


class BatchPlan(NamedTuple):
    """How one epoch splits into batches. Hashable: it is part of a compiled program."""

    num_samples: int
    batch_size: int
    num_full: int
    remainder: int

    @property
    def steps_per_epoch(self) -> int:
        return self.num_full + (self.remainder > 0)

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


# -- The shuffle: a keyed bijection on the sample indices, O(N) and without a sort.
#
# A sort costs O(N log N), and XLA's sort on a CPU is slow (an epoch's order by sorting random
# keys costs more than training on a million samples does). Instead each epoch's order comes
# from a keyed permutation of [0, 2^k), 2^k >= N: a Feistel network of `FEISTEL_ROUNDS`
# rounds. Luby and Rackoff (1988) showed four rounds with independent pseudorandom round
# functions give a strong pseudorandom permutation. With k odd the two halves differ by a bit
# and swap widths each round (an alternating, unbalanced Feistel network, as in the FFX
# mode of format-preserving encryption), so the domain is never more than 2N. The round
# function is a 32-bit integer hash (Wellons' "lowbias32" finaliser) of the half and a round
# key, and the round keys are hashed from the PRNG key's bits and the epoch.
#
# Points of [0, 2^k) at or above N are dropped, keeping the rest in the order of their
# inputs: order[p] is the p-th in-range value of f(0), f(1), ... This is the permutation
# that ranks [0, N) by f's inverse (Black and Rogaway's 2002 "prefix" construction, with
# the cipher's inverse), computed by enumeration and a prefix sum in O(2^k) rather than
# by a sort; and it is uniform whenever f is, as a random permutation of [0, 2^k) induces
# a uniformly random order on any N of its points. Unlike cycle-walking, it needs no
# loop whose length is the longest walk.

FEISTEL_ROUNDS = 4
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive integers over 32 bits


def _hash32(x: UInt32[Array, "*shape"]) -> UInt32[Array, "*shape"]:
    """Wellons' lowbias32: a 32-bit integer hash with near-ideal avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def shuffle_seed(key: Key[Array, ""]) -> UInt32[Array, ""]:
    """A 32-bit seed for the shuffle, hashed from all the bits of `key`."""
    words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    seed = jnp.uint32(0x5EED)
    for i in range(words.shape[0]):
        seed = _hash32(seed ^ (words[i] + jnp.uint32((_GOLDEN * (i + 1)) & 0xFFFFFFFF)))
    return seed


def feistel(
    x: UInt32[Array, " m"], round_keys: UInt32[Array, " rounds"], bits: int
) -> UInt32[Array, " m"]:
    """A keyed permutation of `[0, 2**bits)`, applied to each element of `x`."""
    high, low = (bits + 1) // 2, bits // 2  # the widths of the two halves
    for r in range(round_keys.shape[0]):
        upper, lower = x >> low, x & jnp.uint32((1 << low) - 1)
        mixed = _hash32(lower ^ round_keys[r]) & jnp.uint32((1 << high) - 1)
        x = (lower << high) | (upper ^ mixed)
        high, low = low, high
    return x


def epoch_order(
    seed: UInt32[Array, ""], epoch: Int[Array, ""], num_samples: int, shuffle: bool
) -> UInt32[Array, " {num_samples}"]:
    """The order in which one epoch visits the samples: a permutation of `[0, N)`.

    **Arguments:**

    - `seed`: the run's shuffle seed (`shuffle_seed`).
    - `epoch`: the epoch (or pass over the data) it is for.
    - `num_samples`: N.
    - `shuffle`: `False` gives `0, 1, ..., N - 1`.

    **Returns:**

    The sample indices in the order the epoch visits them.
    """
    index = jnp.arange(num_samples, dtype=jnp.uint32)
    if not shuffle or num_samples == 1:
        return index
    bits = max(1, (num_samples - 1).bit_length())
    epoch_key = _hash32(seed ^ _hash32(jnp.asarray(epoch, jnp.uint32) + jnp.uint32(_GOLDEN)))
    rounds = jnp.arange(FEISTEL_ROUNDS, dtype=jnp.uint32)
    round_keys = _hash32(epoch_key + rounds * jnp.uint32(_GOLDEN))
    if num_samples == 1 << bits:
        return feistel(index, round_keys, bits)
    image = feistel(jnp.arange(1 << bits, dtype=jnp.uint32), round_keys, bits)
    keep = image < num_samples
    # `associative_scan`: XLA's CPU lowering of `cumsum` is four times slower here.
    position = jax.lax.associative_scan(jnp.add, keep.astype(jnp.int32)) - 1
    slot = jnp.where(keep, position, num_samples)  # dropped points go out of bounds
    return jnp.zeros(num_samples, jnp.uint32).at[slot].set(image, mode="drop")


def take(data: PyTree, index: UInt32[Array, " batch"]) -> PyTree:
    """Gathers the samples at `index` from every array of `data`."""
    # Indices come from `epoch_order`, so they are in bounds and unique within a batch;
    # saying so spares XLA the bounds masking of the default "fill" mode.
    return jax.tree.map(
        lambda a: a.at[index].get(mode="promise_in_bounds", unique_indices=True), data
    )


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
