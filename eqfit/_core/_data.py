"""Check and normalise data, plan batches, order samples on the device, gather a batch."""

import functools
import hashlib
import math
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int, Key, PyTree, UInt32


def describe(tree: PyTree) -> list[list[Any]]:
    """Each array's path, shape and dtype, as JSON: what a checkpoint must match.

    Paths rather than the tree's repr, which holds object addresses that change between
    processes.
    """
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return [[jax.tree_util.keystr(path), list(x.shape), str(x.dtype)] for path, x in leaves]


def dtype_of(x: Any) -> Any:
    """An array's dtype, or the one JAX gives a Python number (weak types aside)."""
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def summary(state: PyTree) -> str:
    """A state (an optimizer's, an update's) in a line, for a message: its outer types and
    its first arrays, `(ScaleByAdamState, EmptyState) of 3 arrays [int32[], ...]`.
    """
    if state is None:
        return "None"
    leaves = jax.tree.leaves(state)
    shapes = ", ".join(f"{dtype_of(x)}{list(np.shape(x))}" for x in leaves[:4])
    if eqx.is_array(state):
        return f"an array {shapes}"
    kinds = (
        f"({', '.join(type(s).__name__ for s in state)})"
        if isinstance(state, tuple) and not hasattr(state, "_fields")
        else type(state).__name__
    )
    more = ", ..." if len(leaves) > 4 else ""
    return f"{kinds} of {len(leaves)} arrays [{shapes}{more}]"


def as_data(data: Any, name: str = "data") -> PyTree:
    """Checks `data` and moves it to the device once.

    **Arguments:**

    - `data`: a PyTree of numpy or JAX arrays (usually a tuple `(x, y)`) that share their
        leading (sample) axis.
    - `name`: the argument's name, for errors.

    **Returns:**

    The same PyTree of JAX arrays. JAX arrays are not copied.
    """
    check_data(data, name)
    # `jax.device_put`, not `jnp.asarray`: JAX's `asarray` of a numpy array compiles a
    # program for its shape (an identity, `stage`) and calls it, where `device_put`
    # copies the array over, to the same array, with nothing compiled.
    return jax.tree.map(lambda a: a if isinstance(a, jax.Array) else jax.device_put(a), data)


def data_kind(data: Any) -> Literal["arrays", "memmaps", "loader"]:
    """What `data` is, as `fit`, `evaluate` and `predict` take it: arrays in memory (a
    PyTree of them, checked later), memmaps (a tuple or dict holding an `np.memmap`),
    or a loader (a list of batches, a re-iterable loader, an iterator, a generator). A
    list of arrays is taken for arrays, which `check_data` refuses (pass a tuple). Reads
    nothing.
    """
    arrays = (np.ndarray, jax.Array)
    if isinstance(data, list) and data and all(isinstance(a, arrays) for a in data):
        return "arrays"
    if isinstance(data, (tuple, dict)):
        if any(isinstance(a, np.memmap) for a in jax.tree.leaves(data)):
            return "memmaps"
    elif isinstance(data, Iterable) and not isinstance(data, (*arrays, str, bytes)):
        return "loader"
    return "arrays"


def check_data(data: Any, name: str = "data") -> None:
    """Refuses `data` that is not a non-empty PyTree of numeric arrays sharing their
    leading (sample) axis, naming the array and the sizes. Moves nothing.
    """
    if _is_array(data):
        raise TypeError(
            f"`{name}` must be a tuple of arrays such as `(x, y)` (or another PyTree of "
            f"arrays, a dict say), got {_describe(data)}. For a single array pass `(x,)`."
        )
    if isinstance(data, (tuple, dict)) and not data:
        raise ValueError(f"`{name}` is empty: give at least one array, e.g. `(x, y)`.")
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(data)) and not _is_array(data):
        raise TypeError(
            f"`{name}` must be a tuple of arrays such as `(x, y)` (or another PyTree of arrays, "
            f"or a loader of batches), got {_describe(data)}."
        )
    if isinstance(data, list):
        raise TypeError(
            f"`{name}` must be a tuple of arrays such as `(x, y)` (or a dict), got a list "
            f"of {len(data)}: a list is not taken as the data's arrays, since a list of "
            "batches is a loader. Pass `tuple(...)`."
        )
    if isinstance(data, tuple):
        for i, part in enumerate(data):
            if isinstance(part, list):
                raise TypeError(
                    f"`{name}[{i}]` must be a numpy or JAX array, got a list; convert it with "
                    "`np.asarray`."
                )
    leaves = jax.tree_util.tree_leaves_with_path(data)
    if not leaves:
        raise ValueError(f"`{name}` is empty: give at least one array, e.g. `(x, y)`.")
    for path, a in leaves:
        where = f"`{name}{jax.tree_util.keystr(path)}`"
        if not _is_array(a):
            raise TypeError(f"{where} must be a numpy or JAX array, got {_describe(a)}.")
        if not _is_numeric(a.dtype):
            raise TypeError(f"{where} has dtype {a.dtype}; eqfit trains on numeric arrays.")
        if a.ndim == 0:
            raise ValueError(f"{where} is a scalar; every array needs a leading sample axis.")
    lengths = [a.shape[0] for _, a in leaves]
    if any(n != lengths[0] for n in lengths):
        bad = next(i for i, n in enumerate(lengths) if n != lengths[0])
        first, other = (f"`{name}{jax.tree_util.keystr(leaves[i][0])}`" for i in (0, bad))
        raise ValueError(
            f"The arrays in `{name}` must share their leading (sample) axis: {first} has "
            f"{lengths[0]} samples but {other} has {lengths[bad]} "
            f"(shapes {[tuple(a.shape) for _, a in leaves]})."
        )
    if lengths[0] == 0:
        raise ValueError(
            f"`{name}` is empty: its arrays have 0 samples "
            f"(shapes {[tuple(a.shape) for _, a in leaves]})."
        )


def check_alive(**arguments: Any) -> None:
    """Refuses an argument holding a deleted JAX array, naming the argument and the
    array's path: one whose buffer a `jax.jit(..., donate_argnums=...)` call elsewhere
    gave away, or that `.delete()` freed. Left alone, such an array fails deep inside the
    run with JAX's `Array has been deleted with shape=float32[256]`, which names neither.
    Reads no array and moves nothing.
    """
    for name, tree in arguments.items():
        # An iterator (a generator of batches) is a leaf, taken whole: not read here.
        leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=_is_iterator)
        for path, x in leaves:
            if isinstance(x, jax.Array) and x.is_deleted():
                where = f"{name}{jax.tree_util.keystr(path)}"
                shape = f"{x.dtype}[{', '.join(map(str, x.shape))}]"
                raise ValueError(
                    f"`{where}` ({shape}) is a deleted array: a `jax.jit` call that donates "
                    "its arguments (`donate_argnums=`, `eqx.filter_jit(donate=...)`) gave "
                    f"its buffer away, or `.delete()` freed it. Pass the `{name}` that call "
                    "returned, or a copy made before it (`jnp.copy`)."
                )


def _is_iterator(x: Any) -> bool:
    return isinstance(x, Iterator)


def num_samples(data: PyTree) -> int:
    """The size of the leading axis that every array of `data` shares."""
    return jax.tree.leaves(data)[0].shape[0]


def bucketed(data: Any) -> bool:
    """Whether `data` is a loader whose batches come in several shapes, shuffled among
    each other, and says so (`bucketed = True`, as `eqfit.Buckets` does).
    """
    return getattr(data, "bucketed", False) is True


# Rows a data's fingerprint reads, spread evenly over its samples: enough to tell other
# data of the same shapes apart, few enough to cost nothing beside a run.
FINGERPRINT_ROWS = 64


def fingerprint(data: PyTree) -> str | None:
    """A cheap fingerprint of data with a row per sample (arrays in memory, memmaps): a
    hash of `FINGERPRINT_ROWS` rows spread evenly over its samples, of every array, with
    their paths, shapes and dtypes. The rows are taken as `rows_of` takes them: a
    memmap's read alone, compiling nothing where the data is cheap to read whole. `None`
    where an array is not all in this process (a mesh over several): each process's
    rows differ.
    """
    leaves = jax.tree_util.tree_leaves_with_path(data)
    if not leaves:
        return None
    if any(isinstance(a, jax.Array) and not a.is_fully_addressable for _, a in leaves):
        return None
    arrays = [jax.random.key_data(a) if _is_key(a) else a for _, a in leaves]
    n = arrays[0].shape[0]
    rows = np.unique(np.linspace(0, max(n - 1, 0), min(n, FINGERPRINT_ROWS)).astype(np.intp))
    (samples,) = rows_of(arrays, rows)
    digest = hashlib.blake2b(digest_size=8)
    for (path, _), a, sample in zip(leaves, arrays, samples):
        digest.update(f"{jax.tree_util.keystr(path)} {a.shape} {a.dtype};".encode())
        digest.update(np.ascontiguousarray(np.asarray(sample)).tobytes())
    return digest.hexdigest()


# JAX arrays on an accelerator of at most this many bytes in all are read to the host
# whole where some of their rows are wanted (`rows_of`): a copy this small compiles
# nothing, where taking the rows there compiles programs of their own.
READ_WHOLE_BYTES = 4 * 2**20


def rows_of(data: PyTree, *rows: np.ndarray) -> tuple[PyTree, ...]:
    """`data`'s rows `rows[i]` (indices of its samples), a tree of arrays for each `i`.
    Taken on the host, with no program compiled, where `data` costs little to read:
    numpy arrays and memmaps (whose rows alone are read), arrays on the CPU (whose
    buffers are the host's), or arrays on an accelerator of at most `READ_WHOLE_BYTES`
    in all, read whole; numpy arrays then. Larger arrays on an accelerator (and arrays
    over several processes) are gathered where they are, by one program for all of
    `rows` (`_gathered`), which JAX compiles once for their shapes and keeps: JAX arrays
    then.
    """
    arrays = [a for a in jax.tree.leaves(data) if isinstance(a, jax.Array)]
    on_cpu = all(device.platform == "cpu" for a in arrays for device in a.devices())
    small = sum(a.nbytes for a in arrays) <= READ_WHOLE_BYTES
    if not (on_cpu or small) or not all(a.is_fully_addressable for a in arrays):
        return _gathered(data, rows)  # (an array over several processes: all take part)
    # Each array read once (a memmap not even that; one on the CPU not copied), all its
    # rows taken from that one copy.
    host = jax.tree.map(np.asarray, data)
    return tuple(jax.tree.map(lambda a: a[r], host) for r in rows)


@jax.jit
def _gathered(data: PyTree, rows: tuple[Any, ...]) -> tuple[PyTree, ...]:
    return tuple(jax.tree.map(lambda a: a[r], data) for r in rows)


def sample_shapes(data: PyTree) -> list[list[Any]]:
    """Each array's path, shape of one sample and dtype: what batches must match."""
    return [
        [jax.tree_util.keystr(path), list(a.shape[1:]), str(a.dtype)]
        for path, a in jax.tree_util.tree_leaves_with_path(data)
    ]


def as_key(key: Any) -> Key[Array, ""]:
    """Returns `key` as a typed PRNG key, accepting `jax.random.key` and raw `uint32[2]`."""
    if _is_key(key) and key.shape == ():
        return key
    if _is_array(key) and key.dtype == jnp.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(jnp.asarray(key))
    raise TypeError(
        f"`key` must be a single PRNG key such as `jax.random.key(0)`, got {_describe(key)}."
    )


def check_batch_size(batch_size: int) -> None:
    """Refuses a `batch_size` below 1."""
    if isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"`batch_size` must be at least 1, got {batch_size}.")


# -- The shuffle: a keyed bijection on the sample indices, O(N) and without a sort.
#
# A sort costs O(N log N), and XLA's sort on a CPU is slow (an epoch's order by sorting
# random keys cost more than training an epoch on a million samples). Instead each epoch's
# order is a keyed permutation of [0, N) evaluated at 0, 1, ..., N - 1: Black and Rogaway's
# generalised Feistel cipher Fe[r, a, b] ("Ciphers with arbitrary finite domains", 2002)
# on [0, a * b), with a * b = N when N has two factors within a factor of two of sqrt(N)
# (most sizes do: 8192 = 128 * 64, 60000 = 250 * 240), else a = ceil(sqrt(N)),
# b = ceil(N / a) and cycle-walking into [0, N).
#
# - A point x is the pair (x // b, x % b). Each round maps (L, R) to
#   (R, (L + F_i(R)) mod m_i), the modulus alternating between a and b: a bijection for any
#   round function, so the order is a permutation whatever the keys.
# - `FEISTEL_ROUNDS` = 8 rounds, as NIST's FF3-1 format-preserving mode (SP 800-38G
#   Rev. 1) uses. Luby and Rackoff (1988) showed that four rounds give a strong
#   pseudorandom permutation, but with independent random round functions. Here the round
#   function is a 32-bit integer hash (Wellons' "lowbias32" finaliser) of R and a round
#   key, taken to [0, m) by a multiply-high (Lemire's reduction, no division), with round
#   keys hashed from the PRNG key's bits and the epoch; and domains can be as small and
#   lopsided as 5 x 10. There, with 4 or 6 rounds, neighbouring samples shared a batch far
#   more often than chance (tests/test_shuffle.py); with 8, every test passes.
# - Walking, a * b - N < a <= sqrt(N) + 1, so a point lands outside [0, N) with
#   probability under 1 / sqrt(N); it is mapped again until it lands inside (cycle-walking
#   keeps a bijection). The walk is a loop over the whole vector, which runs two to four
#   times.
#
# This is no cipher: the keys are not secret and the round function is no PRF. What it must
# pass are the statistical tests in tests/test_shuffle.py, beside `jax.random.permutation`.

FEISTEL_ROUNDS = 8
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive integers over 32 bits

# The cipher is written in `lax` operations on uint32 values, its constants numpy uint32
# scalars: each `^`, `>>` or `*` on a traced array would go through one of jax.numpy's
# jitted functions, several times the cost to trace of the one operation it stages (and
# every first `fit` traces the shuffle).
_U32 = np.uint32
xor, shr, mul, add = lax.bitwise_xor, lax.shift_right_logical, lax.mul, lax.add


def _hash32(x: UInt32[Array, "*shape"]) -> UInt32[Array, "*shape"]:
    """Wellons' lowbias32: a 32-bit integer hash with near-ideal avalanche."""
    x = mul(xor(x, shr(x, _U32(16))), _U32(0x7FEB352D))
    x = mul(xor(x, shr(x, _U32(15))), _U32(0x846CA68B))
    return xor(x, shr(x, _U32(16)))


def _below(h: UInt32[Array, "*shape"], m: int) -> UInt32[Array, "*shape"]:
    """`floor(h * m / 2**32)`: a uniform 32-bit `h` taken to `[0, m)`, for `m < 2**16`,
    by a multiply-high in 32-bit arithmetic (no 64-bit integers, no division).
    """
    high = mul(shr(h, _U32(16)), _U32(m))
    low = shr(mul(lax.bitwise_and(h, _U32(0xFFFF)), _U32(m)), _U32(16))
    return shr(add(high, low), _U32(16))


def shuffle_seed(key: Key[Array, ""]) -> UInt32[Array, ""]:
    """A 32-bit seed for the shuffle, hashed from all the bits of `key`."""
    words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    seed = jnp.uint32(0x5EED)
    for i in range(words.shape[0]):
        seed = _hash32(xor(seed, add(words[i], _U32((_GOLDEN * (i + 1)) & 0xFFFFFFFF))))
    return seed


def feistel(
    x: UInt32[Array, " m"], round_keys: UInt32[Array, " rounds"], a: int, b: int
) -> UInt32[Array, " m"]:
    """A keyed permutation of `[0, a * b)` (an even number of rounds), applied to `x`.

    The rounds go by pairs (moduli `a`, then `b`) in a loop, not unrolled: the program
    then holds two rounds, which XLA compiles in a quarter of the time of eight.
    """

    def one(high: Any, low: Any, key: Any, m: int) -> tuple[Any, Any]:
        total = add(high, _below(_hash32(xor(low, key)), m))
        return low, lax.select(lax.ge(total, _U32(m)), lax.sub(total, _U32(m)), total)

    def two(r: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        keys = lax.dynamic_slice(round_keys, (2 * r,), (2,), allow_negative_indices=False)
        high, low = one(*carry, keys[0], a)
        return one(high, low, keys[1], b)

    pairs = round_keys.shape[0] // 2
    high, low = jax.lax.fori_loop(0, pairs, two, (lax.div(x, _U32(b)), lax.rem(x, _U32(b))))
    return add(mul(high, _U32(b)), low)


def epoch_order(
    seed: UInt32[Array, ""], epoch: Int[Array, ""], num_samples: int, shuffle: bool
) -> UInt32[Array, " {num_samples}"]:
    """The order in which one epoch visits the samples: a permutation of `[0, N)`.

    **Arguments:**

    - `seed`: the run's shuffle seed (`shuffle_seed`).
    - `epoch`: the epoch (or pass over the data) it is for.
    - `num_samples`: N, below 2**31.
    - `shuffle`: `False` gives `0, 1, ..., N - 1`.

    **Returns:**

    The sample indices in the order the epoch visits them.
    """
    return order_at(seed, epoch, num_samples, shuffle, jnp.arange(num_samples, dtype=jnp.uint32))


def order_at(
    seed: UInt32[Array, ""],
    epoch: Int[Array, ""],
    num_samples: int,
    shuffle: bool,
    positions: UInt32[Array, " m"],
) -> UInt32[Array, " m"]:
    """`epoch_order(seed, epoch, num_samples, shuffle)[positions]`, computed for those
    positions only (each position's sample is its own walk of the cipher): a program of
    one step gathers its batch without ordering the whole pass.

    **Arguments:**

    - `seed`, `epoch`, `num_samples`, `shuffle`: as `epoch_order`'s.
    - `positions`: places in the epoch's order, each in `[0, N)`.

    **Returns:**

    The sample index at each place.
    """
    if not shuffle or num_samples == 1:
        return positions
    a, b = _domain(num_samples)
    epoch_bits = lax.convert_element_type(epoch, jnp.uint32)
    epoch_key = _hash32(xor(seed, _hash32(add(epoch_bits, _U32(_GOLDEN)))))
    rounds = jnp.arange(FEISTEL_ROUNDS, dtype=jnp.uint32)
    round_keys = _hash32(add(epoch_key, mul(rounds, _U32(_GOLDEN))))

    def walking(carry: tuple[Any, Any]) -> Any:
        first, x = carry
        return first | jnp.any(x >= num_samples)

    def walk(carry: tuple[Any, Any]) -> Any:
        first, x = carry
        x = jnp.where(first | (x >= num_samples), feistel(x, round_keys, a, b), x)
        return jnp.asarray(False), x

    if a * b == num_samples:
        return feistel(positions, round_keys, a, b)
    # One copy of the cipher in the program: the first pass is the loop's first turn.
    _, order = jax.lax.while_loop(walking, walk, (jnp.asarray(True), positions))
    return order


@functools.cache
def _domain(n: int) -> tuple[int, int]:
    """The sides `(a, b)` of the cipher's domain `[0, a * b)`: `a * b == n` if `n` has two
    factors within a factor of two of its square root, else the least square-ish cover.
    Both are below 2**16, as `_below` needs.
    """
    root = math.isqrt(n)
    for a in range(root, (root + 1) // 2, -1):
        if n % a == 0 and n // a < 2**16:
            return a, n // a
    a = math.isqrt(n - 1) + 1
    return a, -(-n // a)


def take(data: PyTree, index: UInt32[Array, " batch"]) -> PyTree:
    """Gathers the samples at `index` from every array of `data`."""
    # Indices come from `epoch_order`, so they are in bounds and unique within a batch;
    # saying so spares XLA the bounds masking of the default "fill" mode.
    return jax.tree.map(
        lambda a: a.at[index].get(mode="promise_in_bounds", unique_indices=True), data
    )


def take_rows(data: PyTree, index: UInt32[Array, " batch"], consecutive: bool) -> PyTree:
    """`take`, or where `index` holds consecutive rows (an order not shuffled), the same
    rows sliced from `index[0]`: a slice where XLA would otherwise gather row by row,
    which costs a small step (a DQN's) much of its time on a CPU.
    """
    if not consecutive:
        return take(data, index)
    size = index.shape[0]
    return jax.tree.map(
        lambda a: jax.lax.dynamic_slice_in_dim(a, index[0], size, allow_negative_indices=False),
        data,
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
    """`jnp.issubdtype`, remembered: `fit` asks it of every array it is given, and
    it is slow next to a dictionary lookup.
    """
    return bool(jnp.issubdtype(dtype, kind))


def _describe(x: Any) -> str:
    if _is_array(x):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    name = type(x).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def not_a_stack(members: int, what: str, error: Exception) -> ValueError:
    """The error for a model that `ensemble=True` took for a stack of `members` and that
    failed when one member was called (`error`): most likely a single model whose arrays
    happen to share their leading size (1, for a model of one output).
    """
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return ValueError(
        f"With `ensemble=True`, {what} took `model` for a stack of {members} members (each "
        f"array's leading axis indexing them), and calling one member failed "
        f"({type(error).__name__}: {first}). If `model` is a single model, leave out "
        "`ensemble`; a stack is built with "
        "`eqx.filter_vmap(make_model)(jax.random.split(key, members))`."
    )


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
            "With `ensemble=True`, `model` must be a stack of members: every array with the "
            f"same leading (member) axis, but its arrays' leading sizes are {sorted(sizes)}; "
            "is it a single model? Build a stack with "
            "`eqx.filter_vmap(make_model)(jax.random.split(key, members))`."
        )
    return sizes.pop()


def batch_calls(rows: int, batch_size: int, unroll: int) -> list[tuple[int, int, bool]]:
    """The calls of an inference over `rows` rows in programs of `unroll` batches (as
    `PerStep` runs validation, `evaluate` and `predict`): `(first, count, remainder)`,
    programs of `count` full batches from batch `first` on (the last may run past them:
    its extra batches are dropped), then one of the smaller last batch if there is one.
    `count` is at most the full batches, so no program is longer than the data.
    """
    num_full, remainder = divmod(rows, batch_size)
    count = max(1, min(unroll, num_full))
    calls = [(b, count, False) for b in range(0, num_full, count)]
    return calls + [(num_full, 1, True)] if remainder else calls
