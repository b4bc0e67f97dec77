"""Where the training data comes from: arrays in memory and memmaps here, loaders in
`_loader.py` (`_open.py` opens the one `data` is).

Each is a `Source`: it opens itself (checking what it can without training on it), holds
out validation rows where it can, says its shape to the schedule, and yields `Chunk`s of
plain host or device arrays. It knows nothing of the program or the driver, which move
chunks to the device and train on them.

Arrays in memory go to the device once, as one chunk for the whole run; the program orders
and gathers each pass's batches itself. Data larger than memory streams instead: a chunk
per run of consecutive batches of one size, so host memory holds a few chunks whatever the
data's size.
"""

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np
from jaxtyping import Array, Key, PyTree

from .._core._data import (
    as_data,
    check_data,
    fingerprint,
    num_samples,
    rows_of,
    sample_shapes,
)
from .._program._schedule import (
    Schedule,
    SourceShape,
)
from ._rows import advise_rows, POPULATE_READ, read_rows


CHUNK_BYTES = 32 * 2**20  # about this much data per chunk: few enough host copies in flight


class Chunk(NamedTuple):
    """Data for the global steps `first` to `end` (not included).

    `order` is `None` for the whole data in memory, which the program orders itself;
    otherwise step `t` takes rows `order[(t - first) * batch_size:]` of `data`, whose
    batches all have `batch_size` rows.
    """

    data: PyTree
    order: np.ndarray | None
    first: int
    end: int
    batch_size: int
    # A loader without `len`: the first epoch's length, on the chunk that ends it (and
    # every chunk after), learned by reading one batch ahead in its first pass.
    epoch_length: int | None = None
    # Memmaps read through their mapping (an inference's): drops the chunk's pages from
    # the process's memory, once the program that reads them is done.
    release: Callable[[], None] | None = None
    # Memmaps': the first of the source's training rows it read (row `j` of `data` is
    # its `start + j`), to name a batch's rows in the data.
    start: int = 0


@runtime_checkable
class Source(Protocol):
    """Training data that can say its shape and yield chunks."""

    like: PyTree  # a batch of one: the structure, sample shapes and dtypes of every batch
    streamed: bool  # chunks come from the host while training goes on

    def shape(self) -> SourceShape: ...

    def describe(self) -> list[list[Any]]:
        """What identifies the data for a checkpoint: its size and sample shapes."""
        ...

    def fingerprint(self) -> str | None:
        """What tells the data from other data of its shapes, for a checkpoint: a hash of
        rows spread over it (`fingerprint`); `None` where nothing cheap does.
        """
        ...

    def hold_out(self, fraction: float, key: Key[Array, ""]) -> tuple["Source", PyTree]:
        """The source less the validation rows, and those rows as arrays."""
        ...

    def chunks(self, schedule: Schedule, begin: int, end: int) -> Iterator[Chunk]:
        """The chunks from the one holding step `begin` to the one holding `end - 1`."""
        ...


def host_seed(key: Key[Array, ""]) -> int:
    """An integer seed for the host's random choices (streamed shuffles, held-out rows)."""
    words = np.asarray(jax.random.key_data(key)).reshape(-1)
    return int.from_bytes(words.astype(np.uint32).tobytes(), "little")


def held_out_rows(n: int, fraction: float, key: Key[Array, ""]) -> tuple[np.ndarray, np.ndarray]:
    """The rows that train and the rows held out for validation, both sorted, chosen
    from `key` on the host.
    """
    held = int(np.ceil(fraction * n))
    if not 0 < held < n:
        raise ValueError(
            f"`validation_split`={fraction} holds out {held} of the {n} samples of `data`, "
            "leaving none to train on (or none held out); give a fraction that leaves both."
        )
    order = np.random.default_rng([host_seed(key), 0x5B117]).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


class InMemory:
    """Arrays on the device: one chunk, from the start to the end of the run."""

    streamed = False

    def __init__(self, data: PyTree, rows: np.ndarray | None = None):
        self.data = as_data(data)  # checked, and moved to the device once
        self.rows = rows  # the training rows of the data given (sorted), when some are held out
        # On the host: slicing a device array would compile a program.
        self.like = jax.tree.map(lambda a: np.zeros((1, *a.shape[1:]), a.dtype), self.data)

    def shape(self) -> SourceShape:
        return SourceShape(num_samples(self.data), None, None)

    def describe(self) -> list[list[Any]]:
        return [["num_samples", num_samples(self.data)], *sample_shapes(self.data)]

    def fingerprint(self) -> str | None:
        return fingerprint(self.data)

    def hold_out(self, fraction: float, key: Key[Array, ""]) -> tuple["InMemory", PyTree]:
        train, held = held_out_rows(num_samples(self.data), fraction, key)
        kept, val = rows_of(self.data, train, held)  # on the device again in `as_data`
        return InMemory(kept, train), as_data(val)

    def chunks(self, schedule: Schedule, begin: int, end: int) -> Iterator[Chunk]:
        yield Chunk(self.data, None, begin, end, schedule.batch_size)


class Streamed:
    """What the streamed sources share: chunks of full batches padded to one shape, so
    that the program compiles once for them (and once more for a smaller last batch).
    """

    streamed = True
    like: PyTree

    def per_chunk(self, batch_size: int) -> int:
        """Full batches per chunk: about `CHUNK_BYTES` of data."""
        row_bytes = sum(
            a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in jax.tree.leaves(self.like)
        )
        return max(1, CHUNK_BYTES // max(1, row_bytes * batch_size))

    def padded(self, chunk: Chunk, capacity: int, end: int) -> Chunk:
        """`chunk` padded to `capacity` rows if its batches are full ones, and cut at the
        run's `end`.
        """
        order = chunk.order
        assert order is not None
        data, order = chunk.data, order.astype(np.uint32)
        rows = len(order)
        if rows < capacity:
            data = jax.tree.map(
                lambda a: np.concatenate([a, np.zeros((capacity - rows, *a.shape[1:]), a.dtype)]),
                data,
            )
            order = np.concatenate([order, np.arange(rows, capacity, dtype=np.uint32)])
        return chunk._replace(data=data, order=order, end=min(chunk.end, end))

    def raw_chunks(self, schedule: Schedule, begin: int, end: int) -> Iterator[Chunk]:
        raise NotImplementedError

    def chunk_size(self, schedule: Schedule) -> int:
        return self.per_chunk(schedule.batch_size)

    def chunks(self, schedule: Schedule, begin: int, end: int) -> Iterator[Chunk]:
        capacity = self.chunk_size(schedule) * schedule.batch_size
        if begin >= end:
            # Nothing left to train (a finished run resumed): one empty chunk, so that the
            # program still reports where the run stands.
            empty = jax.tree.map(lambda a: a[:0], self.like)
            chunk = Chunk(empty, np.arange(0), end, end, schedule.batch_size)
            yield self.padded(chunk, capacity, end)
            return
        for chunk in self.raw_chunks(schedule, begin, end):
            assert chunk.order is not None
            full = chunk.batch_size == schedule.batch_size
            yield self.padded(chunk, capacity if full else len(chunk.order), end)
            if chunk.end >= end:
                return


class Memmaps(Streamed):
    """Reads rows from `np.memmap` arrays (`np.load(mmap_mode="r")`), in passes.

    With `shuffle`, each pass visits the blocks of `per_chunk` batches in a new random
    order and shuffles the rows inside each block (on the host, in the reading thread),
    like a shuffle buffer of a block that never holds more than one. Both come from `seed`
    and the pass. Rows are read with `np.fromfile` at the array's offset, not through the
    mapping, so pages already trained on are not held in this process's memory.
    """

    def __init__(
        self,
        data: PyTree,
        shuffle: bool,
        seed: int,
        rows: np.ndarray | None = None,
        mapped: bool = False,
    ):
        check_data(data)  # the same checks as in-memory data, nothing read
        self.data, self.shuffle, self.seed = data, shuffle, seed
        # Rows read as views of the mapping, not copied (an inference, whose chunks the
        # device reads in place): each chunk's pages are dropped once it is done with
        # (`Chunk.release`), so memory still holds a few chunks.
        self.mapped = mapped and rows is None
        self.rows = rows  # the training rows (sorted), when some are held out
        self.num_samples = num_samples(data) if rows is None else len(rows)
        self.like = jax.tree.map(lambda a: np.zeros((1, *a.shape[1:]), a.dtype), data)

    def shape(self) -> SourceShape:
        return SourceShape(self.num_samples, None, None)

    def describe(self) -> list[list[Any]]:
        return [["num_samples", self.num_samples], *sample_shapes(self.data)]

    def fingerprint(self) -> str | None:
        return fingerprint(self.data)  # its rows read alone, through the mapping

    def hold_out(self, fraction: float, key: Key[Array, ""]) -> tuple["Memmaps", PyTree]:
        train, held = held_out_rows(self.num_samples, fraction, key)
        val = jax.tree.map(lambda a: np.asarray(a[held]), self.data)
        return Memmaps(self.data, self.shuffle, self.seed, train), as_data(val)

    def read(self, start: int, stop: int) -> PyTree:
        """Training rows `start` to `stop` (of `self.rows` if set)."""
        if self.rows is None:
            return jax.tree.map(lambda a: read_rows(a, start, stop), self.data)
        picked = self.rows[start:stop]
        low, high = int(picked[0]), int(picked[-1]) + 1
        return jax.tree.map(lambda a: read_rows(a, low, high)[picked - low], self.data)

    def chunk_size(self, schedule: Schedule) -> int:
        assert schedule.passes is not None
        return min(self.per_chunk(schedule.batch_size), max(schedule.passes.num_full, 1))

    def raw_chunks(self, schedule: Schedule, begin: int, end: int) -> Iterator[Chunk]:
        for index in itertools.count(schedule.pass_of(begin)):
            for chunk in self.pass_chunks(schedule, index):
                if chunk.end > begin:  # else trained before a resume
                    yield chunk

    def pass_chunks(self, schedule: Schedule, index: int) -> Iterator[Chunk]:
        """One pass: whole blocks of `per_chunk` batches in a random order (if shuffled),
        then the leftover full batches, then the remainder batch (where the schedule puts
        it, as the program does for data in memory).
        """
        passes = schedule.passes
        assert passes is not None
        per_chunk, size = self.chunk_size(schedule), schedule.batch_size
        first_step = schedule.pass_start(index)
        blocks = passes.num_full // per_chunk
        rng = np.random.default_rng([self.seed, index]) if self.shuffle else None
        order = np.arange(blocks) if rng is None else rng.permutation(blocks)
        # (steps into the pass, batches, batch size, first row)
        rows = per_chunk * size
        pieces = [(i * per_chunk, per_chunk, size, int(b) * rows) for i, b in enumerate(order)]
        leftover = passes.num_full - blocks * per_chunk
        if leftover:
            pieces.append((blocks * per_chunk, leftover, size, blocks * per_chunk * size))
        remainder = schedule.remainder_step(index)
        if remainder is not None:
            pieces.append((remainder - first_step, 1, passes.remainder, passes.num_full * size))
        for step, batches, batch, start in pieces:
            count = batches * batch
            # Rows are shuffled within the chunk here, in the reading thread: numpy permutes
            # half a million indices in milliseconds, and the device never waits for it.
            within = np.arange(count) if rng is None else rng.permutation(count)
            first = first_step + step
            if self.mapped:  # read in place, its pages mapped in now and dropped once done
                data = jax.tree.map(lambda a: a[start : start + count], self.data)
                advise_rows(self.data, start, start + count, POPULATE_READ)
                release = functools.partial(advise_rows, self.data, start, start + count)
            else:
                data, release = self.read(start, start + count), None
            yield Chunk(data, within, first, first + batches, batch, release=release, start=start)
