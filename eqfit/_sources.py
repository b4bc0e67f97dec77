"""The producers of the driver's feeds: arrays in memory, memmaps and loaders.

Arrays in memory go to the device once, as one feed for the whole run; the program orders
and gathers each pass's batches itself. Data larger than memory streams instead: a feed
per chunk of K consecutive batches, read and moved to the device by a background thread
while the device trains on the chunk before, so host memory holds a few chunks whatever
the data's size.
"""

import mmap
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from ._checkpoint import describe
from ._data import BatchPlan, check_data, plan_batches
from ._drive import Feed
from ._loop import Inputs, Piece


CHUNK_BYTES = 32 * 2**20  # about this much data per chunk: few enough host copies in flight


class InMemory:
    """Arrays on the device: one feed, from the start to the end of the run."""

    def __init__(self, data: tuple[jax.Array, ...]):
        self.data = data
        self.num_samples = data[0].shape[0]

    def sample_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(a.shape[1:]) for a in self.data]

    def describe(self) -> list[list[Any]]:
        return describe(self.data)

    def feeds(self, begin: int, end: int, template: Inputs, put: Callable) -> Iterator[Feed]:
        del begin
        yield Feed(template._replace(data=put(self.data, sharded=True)), end)


class _Chunk(NamedTuple):
    """The host rows of the batches of one chunk, with where they sit in the run."""

    arrays: tuple[np.ndarray, ...]  # padded to the chunk capacity
    order: np.ndarray  # the rows' order within the chunk
    first: int  # the global step of its first batch
    pass_first: int  # the global step of its pass's first batch
    end: int  # the global step after its last batch


class Streamed:
    """What the streamed sources share: chunks padded to one shape (so that the program
    compiles once), read ahead in a background thread.
    """

    plan: BatchPlan
    per_chunk: int  # full batches per chunk

    def row_bytes(self) -> int:
        raise NotImplementedError

    def chunks(self, pass_index: int) -> Iterator[_Chunk]:
        """The chunks of one pass over the data."""
        raise NotImplementedError

    def describe(self) -> list[list[Any]]:
        raise NotImplementedError

    def sample_shapes(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def dtypes(self) -> list[np.dtype]:
        raise NotImplementedError

    def setup(self, plan: BatchPlan, shuffle: bool, seed: int) -> None:
        self.plan, self.shuffle, self.seed = plan, shuffle, seed
        rows = max(1, self.row_bytes() * plan.batch_size)
        self.per_chunk = max(1, min(plan.num_full or 1, CHUNK_BYTES // rows))
        # Every chunk holds at most `per_chunk` full batches and the remainder.
        self.capacity = self.per_chunk * plan.batch_size + plan.remainder

    def _pad(self, arrays: tuple[np.ndarray, ...], order: np.ndarray) -> Any:
        rows = len(order)
        if rows == self.capacity:
            return arrays, order
        padded = tuple(
            np.concatenate([a, np.zeros((self.capacity - rows, *a.shape[1:]), a.dtype)])
            for a in arrays
        )
        return padded, np.concatenate([order, np.arange(rows, self.capacity, dtype=order.dtype)])

    def feeds(self, begin: int, end: int, template: Inputs, put: Callable) -> Iterator[Feed]:
        """The chunks from the one holding step `begin` to the end, each moved to the
        device in a background thread while the one before trains.
        """
        steps_per_pass = self.plan.steps_per_epoch

        def feed(chunk: _Chunk) -> Feed:
            arrays, order = self._pad(chunk.arrays, chunk.order.astype(np.uint32))
            piece = Piece(
                order=order,
                first=np.asarray(chunk.first, np.int32),
                pass_first=np.asarray(chunk.pass_first, np.int32),
                end=np.asarray(chunk.end, np.int32),
            )
            placed = put(arrays, sharded=True), put(piece)
            return Feed(template._replace(data=placed[0], piece=placed[1]), chunk.end)

        if begin >= end:
            # Nothing left to train (a finished run resumed): one empty chunk, so that the
            # program still reports where the run stands.
            empty = tuple(np.zeros((0, *s), d) for s, d in zip(self.sample_shapes(), self.dtypes()))
            return iter([feed(_Chunk(empty, np.arange(0), end, end, end))])

        def produce() -> Iterator[Feed]:
            for pass_index in range(begin // steps_per_pass, -(-end // steps_per_pass)):
                for chunk in self.chunks(pass_index):
                    if chunk.end > begin:  # else trained before a resume
                        yield feed(chunk)

        return _read_ahead(produce())


def _read_ahead(feeds: Iterator[Feed], depth: int = 2) -> Iterator[Feed]:
    """`feeds`, produced in a background thread at most `depth` ahead of the consumer."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for feed in feeds:
                while not stop.is_set():
                    try:
                        ready.put(feed, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
            ready.put(done)
        except BaseException as e:  # surfaced in the training thread
            ready.put(e)

    reader = threading.Thread(target=produce, daemon=True)
    reader.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join()


class Memmaps(Streamed):
    """Reads rows from `np.memmap` arrays (`np.load(mmap_mode="r")`).

    With `shuffle`, each pass visits the blocks of `per_chunk` batches in a new random
    order and shuffles the rows inside each block (on the host, in the reading thread),
    like a shuffle buffer of a block that never holds more than one. Both come from `key`
    and the pass. Rows are read with `np.fromfile` at the array's offset, not through the
    mapping, so pages already trained on are not held in this process's memory.
    """

    def __init__(self, arrays: tuple[np.ndarray, ...], rows: np.ndarray | None = None):
        check_data(arrays)  # the same checks as in-memory data, nothing read
        self.arrays = arrays
        self.rows = rows  # the training rows (sorted), when some are held out
        self.num_samples = arrays[0].shape[0] if rows is None else len(rows)

    def row_bytes(self) -> int:
        return sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in self.arrays)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        """Training rows `start` to `stop` (of `self.rows` if set)."""
        if self.rows is None:
            return tuple(_read_rows(a, start, stop) for a in self.arrays)
        picked = self.rows[start:stop]
        low = int(picked[0])
        return tuple(_read_rows(a, low, int(picked[-1]) + 1)[picked - low] for a in self.arrays)

    def describe(self) -> list[list[Any]]:
        return [[f"[{i}]", list(a.shape), str(a.dtype)] for i, a in enumerate(self.arrays)]

    def sample_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(a.shape[1:]) for a in self.arrays]

    def dtypes(self) -> list[np.dtype]:
        return [a.dtype for a in self.arrays]

    def chunks(self, pass_index: int) -> Iterator[_Chunk]:
        plan, per_chunk = self.plan, self.per_chunk
        first_step = pass_index * plan.steps_per_epoch
        blocks = plan.num_full // per_chunk
        rng = np.random.default_rng([self.seed, pass_index]) if self.shuffle else None
        order = np.arange(blocks) if rng is None else rng.permutation(blocks)
        rows = per_chunk * plan.batch_size
        pieces = [
            (position * per_chunk, per_chunk, int(b) * rows) for position, b in enumerate(order)
        ]
        tail = plan.num_full - blocks * per_chunk + (plan.remainder > 0)
        if tail:
            pieces.append((blocks * per_chunk, tail, blocks * rows))
        for position, (step, steps, start) in enumerate(pieces):
            count = min(steps, plan.num_full - step) * plan.batch_size
            if step + steps > plan.num_full:  # the last piece holds the remainder
                count += plan.remainder
            # Rows are shuffled within the chunk here, in the reading thread: numpy permutes
            # half a million indices in milliseconds, and the device never waits for it.
            within = np.arange(count) if rng is None else rng.permutation(count)
            first = first_step + step
            yield _Chunk(self.read(start, start + count), within, first, first_step, first + steps)


def _read_rows(a: np.ndarray, start: int, stop: int) -> np.ndarray:
    if (
        isinstance(a, np.memmap)
        and isinstance(a.base, mmap.mmap)
        and a.filename is not None
        and a.flags.c_contiguous
    ):
        row = int(np.prod(a.shape[1:]))
        offset = a.offset + start * row * a.dtype.itemsize
        out = np.fromfile(a.filename, dtype=a.dtype, count=(stop - start) * row, offset=offset)
        return out.reshape(stop - start, *a.shape[1:])
    return np.array(a[start:stop])


class Loader(Streamed):
    """A re-iterable that yields batches as tuples of arrays, such as a Grain or PyTorch
    loader. Every batch has the same size but the last of an epoch, which may be smaller.
    It does its own shuffling.
    """

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        sizes = [len(_as_batch(b, 0)[0]) for b in loader]  # one pass to learn the epoch
        if not sizes:
            raise ValueError("`data` yielded no batches.")
        self.batch_size = sizes[0]
        if any(n != sizes[0] for n in sizes[:-1]) or sizes[-1] > sizes[0]:
            raise ValueError(
                "A loader's batches must all have the same size but the last of an epoch, "
                f"which may be smaller; got sizes {sizes[:5]}...{sizes[-2:]}."
            )
        self.num_samples = sum(sizes)
        self.first = _as_batch(next(iter(loader)), 0)

    def row_bytes(self) -> int:
        return sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in self.first)

    def describe(self) -> list[list[Any]]:
        return [
            [f"[{i}]", [self.num_samples, *a.shape[1:]], str(a.dtype)]
            for i, a in enumerate(self.first)
        ]

    def sample_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(a.shape[1:]) for a in self.first]

    def dtypes(self) -> list[np.dtype]:
        return [a.dtype for a in self.first]

    def chunks(self, pass_index: int) -> Iterator[_Chunk]:
        plan, per_chunk = self.plan, self.per_chunk
        first_step = pass_index * plan.steps_per_epoch
        held: list[tuple[np.ndarray, ...]] = []
        step, smaller = 0, None

        def chunk(steps: int) -> _Chunk:
            arrays = tuple(np.concatenate(parts) for parts in zip(*held))
            first = first_step + step
            return _Chunk(arrays, np.arange(len(arrays[0])), first, first_step, first + steps)

        for i, batch in enumerate(self.loader):
            arrays = _as_batch(batch, i)
            size = len(arrays[0])
            if smaller is not None or size > plan.batch_size:
                raise ValueError(
                    f"The loader's batch {i} has {size} samples after a batch of {smaller}: "
                    f"only the last batch of an epoch may be smaller than {plan.batch_size}."
                )
            if size < plan.batch_size:
                smaller = size
                if plan.remainder == 0:  # drop_remainder
                    continue
            held.append(arrays)
            if len(held) == per_chunk and smaller is None:
                yield chunk(per_chunk)
                step, held = step + per_chunk, []
        full = len(held) - (smaller is not None and plan.remainder > 0)
        if step + full != plan.num_full:
            raise ValueError(
                f"The loader yielded {step + full} full batches this epoch, but "
                f"{plan.num_full} in its first."
            )
        if held:
            yield chunk(len(held))


def _as_batch(batch: Any, i: int) -> tuple[np.ndarray, ...]:
    if isinstance(batch, dict) or not isinstance(batch, (tuple, list)):
        raise TypeError(
            f"A loader must yield each batch as a tuple of arrays, got {type(batch).__name__} "
            f"for batch {i}."
        )
    return tuple(np.asarray(a) for a in batch)


def streamed_source(data: Any) -> "Memmaps | Loader | None":
    """The source to stream `data` from, or `None` for in-memory arrays."""
    if isinstance(data, tuple):
        if not any(isinstance(a, np.memmap) for a in data):
            return None
        return Memmaps(data)
    if not isinstance(data, Iterable) or isinstance(data, (np.ndarray, jax.Array, str)):
        return None
    return Loader(data)


def stream_plan(source: "Memmaps | Loader", batch_size: int, drop: bool) -> BatchPlan:
    if isinstance(source, Loader) and batch_size != source.batch_size:
        raise ValueError(
            f"`batch_size`={batch_size}, but the loader yields batches of "
            f"{source.batch_size}: set `batch_size` to the loader's."
        )
    return plan_batches(source.num_samples, batch_size, drop)
