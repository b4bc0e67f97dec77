"""The producers of the driver's feeds: arrays in memory, memmaps and loaders.

Arrays in memory go to the device once, as one feed for the whole run; the program orders
and gathers each pass's batches itself. Data larger than memory streams instead: a feed
per chunk of consecutive batches of one size, read and moved to the device by a
background thread while the device trains on the chunk before, so host memory holds a few
chunks whatever the data's size.
"""

import itertools
import mmap
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from ._data import BatchPlan, check_data, num_samples, sample_shapes
from ._drive import Feed
from ._loop import Inputs, Piece


CHUNK_BYTES = 32 * 2**20  # about this much data per chunk: few enough host copies in flight
# A loader's chunks hold at most this many batches: the device waits for the first chunk to
# be gathered from the loader, one batch at a time, so it must come quickly; and a call per
# this many steps costs nothing that shows.
LOADER_CHUNK_BATCHES = 128


class InMemory:
    """Arrays on the device: one feed, from the start to the end of the run."""

    def __init__(self, data: PyTree):
        self.data = data
        self.num_samples = num_samples(data)

    def describe(self) -> list[list[Any]]:
        return [["num_samples", self.num_samples], *sample_shapes(self.data)]

    def feeds(self, begin: int, end: int, template: Inputs, put: Callable) -> Iterator[Feed]:
        del begin
        yield Feed(template._replace(data=put(self.data, sharded=True)), end)


class _Chunk(NamedTuple):
    """The host rows of consecutive batches of one size, with where they sit in the run."""

    data: PyTree  # numpy arrays, `steps * batch_size` rows
    order: np.ndarray  # the rows' order within the chunk
    first: int  # the global step of its first batch
    batch_size: int

    @property
    def end(self) -> int:
        return self.first + len(self.order) // self.batch_size


class Streamed:
    """What the streamed sources share: chunks of full batches padded to one shape (so
    that the program compiles once for them, and once more for a smaller last batch),
    read ahead in a background thread.
    """

    batch_size: int
    per_chunk: int  # full batches per chunk
    like: PyTree  # one batch: the structure, sample shapes and dtypes every batch has

    def chunks(self, begin: int, end: int) -> Iterator[_Chunk]:
        """The chunks from the one holding global step `begin` to the one holding `end - 1`."""
        raise NotImplementedError

    def describe(self) -> list[list[Any]]:
        raise NotImplementedError

    def set_chunk_size(self) -> None:
        row_bytes = sum(
            a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in jax.tree.leaves(self.like)
        )
        per_batch = max(1, row_bytes * self.batch_size)
        self.per_chunk = max(1, CHUNK_BYTES // per_batch)

    def feeds(self, begin: int, end: int, template: Inputs, put: Callable) -> Iterator[Feed]:
        """The chunks from the one holding step `begin` to `end`, each moved to the
        device in a background thread while the one before trains.
        """
        capacity = self.per_chunk * self.batch_size

        def feed(chunk: _Chunk) -> Feed:
            rows = len(chunk.order)
            data, order = chunk.data, chunk.order.astype(np.uint32)
            if chunk.batch_size == self.batch_size and rows < capacity:  # one shape for all
                data = jax.tree.map(lambda a: _pad(a, capacity), data)
                order = np.concatenate([order, np.arange(rows, capacity, dtype=np.uint32)])
            piece = Piece(order, np.asarray(chunk.first, np.int32), np.asarray(chunk.end, np.int32))
            inputs = template._replace(data=put(data, sharded=True), piece=put(piece))
            return Feed(inputs, min(chunk.end, end), chunk.batch_size)

        if begin >= end:
            # Nothing left to train (a finished run resumed): one empty chunk, so that the
            # program still reports where the run stands.
            empty = jax.tree.map(lambda a: a[:0], self.like)
            return iter([feed(_Chunk(empty, np.arange(0), end, self.batch_size))])

        def produce() -> Iterator[Feed]:
            for chunk in self.chunks(begin, end):
                yield feed(chunk)
                if chunk.end >= end:
                    return

        return _read_ahead(produce())


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])


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
    """Reads rows from `np.memmap` arrays (`np.load(mmap_mode="r")`), in passes.

    With `shuffle`, each pass visits the blocks of `per_chunk` batches in a new random
    order and shuffles the rows inside each block (on the host, in the reading thread),
    like a shuffle buffer of a block that never holds more than one. Both come from `key`
    and the pass. Rows are read with `np.fromfile` at the array's offset, not through the
    mapping, so pages already trained on are not held in this process's memory.
    """

    def __init__(self, data: PyTree, rows: np.ndarray | None = None):
        check_data(data)  # the same checks as in-memory data, nothing read
        self.data = data
        self.rows = rows  # the training rows (sorted), when some are held out
        self.num_samples = num_samples(data) if rows is None else len(rows)
        self.like = jax.tree.map(lambda a: np.zeros((1, *a.shape[1:]), a.dtype), data)

    def setup(self, passes: BatchPlan, shuffle: bool, seed: int) -> None:
        self.passes, self.shuffle, self.seed = passes, shuffle, seed
        self.batch_size = passes.batch_size
        self.set_chunk_size()
        self.per_chunk = min(self.per_chunk, max(passes.num_full, 1))

    def describe(self) -> list[list[Any]]:
        return [["num_samples", self.num_samples], *sample_shapes(self.data)]

    def read(self, start: int, stop: int) -> PyTree:
        """Training rows `start` to `stop` (of `self.rows` if set)."""
        if self.rows is None:
            return jax.tree.map(lambda a: _read_rows(a, start, stop), self.data)
        picked = self.rows[start:stop]
        low, high = int(picked[0]), int(picked[-1]) + 1
        return jax.tree.map(lambda a: _read_rows(a, low, high)[picked - low], self.data)

    def chunks(self, begin: int, end: int) -> Iterator[_Chunk]:
        per_pass = self.passes.steps_per_pass
        for pass_index in itertools.count(begin // per_pass):
            for chunk in self.pass_chunks(pass_index):
                if chunk.end > begin:  # else trained before a resume
                    yield chunk

    def pass_chunks(self, pass_index: int) -> Iterator[_Chunk]:
        """One pass: whole blocks of `per_chunk` batches in a random order (if shuffled),
        then the leftover full batches, then the remainder batch.
        """
        plan, per_chunk, size = self.passes, self.per_chunk, self.batch_size
        first_step = pass_index * plan.steps_per_pass
        blocks = plan.num_full // per_chunk
        rng = np.random.default_rng([self.seed, pass_index]) if self.shuffle else None
        order = np.arange(blocks) if rng is None else rng.permutation(blocks)
        # (steps into the pass, batches, batch size, first row)
        rows = per_chunk * size
        pieces = [(i * per_chunk, per_chunk, size, int(b) * rows) for i, b in enumerate(order)]
        leftover = plan.num_full - blocks * per_chunk
        if leftover:
            pieces.append((blocks * per_chunk, leftover, size, blocks * per_chunk * size))
        if plan.remainder:
            pieces.append((plan.num_full, 1, plan.remainder, plan.num_full * size))
        for step, batches, batch, start in pieces:
            count = batches * batch
            # Rows are shuffled within the chunk here, in the reading thread: numpy permutes
            # half a million indices in milliseconds, and the device never waits for it.
            within = np.arange(count) if rng is None else rng.permutation(count)
            yield _Chunk(self.read(start, start + count), within, first_step + step, batch)


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
    """Batches from a loader: a re-iterable (iterated anew for each pass, such as a
    PyTorch `DataLoader` or a Grain dataset), or an iterator or generator (used once; an
    endless one with `steps_per_epoch`). Each batch is one step. Every batch has the size
    of the first but the last of a pass, which may be smaller. The loader shuffles as it
    likes; one with `set_epoch` is told, before each pass, how many passes came before.
    """

    def __init__(self, loader: Iterable[Any], steps_per_epoch: int | None):
        self.loader = loader
        self.one_shot = iter(loader) is loader  # type: ignore[comparison-overlap]
        self.passes_done = 0
        length = _length(loader)
        if steps_per_epoch is None and length is None:
            if self.one_shot:
                raise ValueError(
                    "`data` is an iterator (or generator) of unknown length, so eqfit cannot "
                    "tell where an epoch ends, nor count its batches without using them up. "
                    "Pass `steps_per_epoch=`, the number of batches each epoch takes."
                )
            length = sum(1 for _ in self._iterate())  # the one counting pass
            if not length:
                raise ValueError("`data` yielded no batches.")
        self.length = length  # batches in a pass, if known
        self.stream = self._batches()
        try:
            self.first, _ = next(self.stream)
        except StopIteration:
            raise ValueError("`data` yielded no batches.") from None
        self.like = jax.tree.map(lambda a: a[:1], self.first)
        self.batch_size = num_samples(self.first)

    def set_chunk_size(self) -> None:
        super().set_chunk_size()
        self.per_chunk = min(self.per_chunk, LOADER_CHUNK_BATCHES)

    def _iterate(self) -> Iterator[Any]:
        """One pass over the loader, telling it which pass it is (`set_epoch`)."""
        if not self.one_shot:
            set_epoch = getattr(self.loader, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.passes_done)
            self.passes_done += 1
        return iter(self.loader)

    def _batches(self) -> Iterator[tuple[PyTree, bool]]:
        """Every batch as numpy arrays, with whether it starts a pass, pass after pass (a
        one-shot loader gives one pass).
        """
        index = 0
        while True:
            starts = True
            for batch in self._iterate():
                yield _as_batch(batch, index), starts
                starts = False
                index += 1
            if self.one_shot or starts:  # used up, or a pass yielded nothing
                return

    def describe(self) -> list[list[Any]]:
        return [["loader", type(self.loader).__qualname__], *sample_shapes(self.first)]

    def chunks(self, begin: int, end: int) -> Iterator[_Chunk]:
        """Chunks of consecutive full batches; a smaller batch makes a chunk of its own.
        Steps before `begin` (a resume) are skipped: the loader is read up to there; and
        none is read past `end`.
        """
        structure = jax.tree.structure(self.first)
        shapes = [(a.shape[1:], a.dtype) for a in jax.tree.leaves(self.first)]
        size = self.batch_size
        held: list[PyTree] = []
        smaller = None  # the size of the last batch, if smaller: its pass must end there

        def chunk(batches: list[PyTree], batch_size: int, first: int) -> _Chunk:
            data = jax.tree.map(lambda *parts: np.concatenate(parts), *batches)
            return _Chunk(data, np.arange(len(batches) * batch_size), first, batch_size)

        stream = itertools.chain([(self.first, True)], self.stream)
        step = 0
        for step, (batch, starts_pass) in enumerate(stream):
            if smaller is not None and not starts_pass:
                raise ValueError(
                    f"The loader's batch {step} follows a batch of {smaller} samples in the "
                    f"same pass: only the last batch of a pass may be smaller than the first "
                    f"batch's {size}."
                )
            got = _check_batch(batch, step, structure, shapes, size)
            smaller = got if got < size else None
            if step < begin:  # trained before a resume
                continue
            if got < size:
                if held:
                    yield chunk(held, size, step - len(held))
                    held = []
                yield chunk([batch], got, step)
            else:
                held.append(batch)
                if len(held) == self.per_chunk or step + 1 >= end:
                    yield chunk(held, size, step - len(held) + 1)
                    held = []
            if step + 1 >= end:
                return
        if held:
            yield chunk(held, size, step - len(held) + 1)


def _length(loader: Any) -> int | None:
    """The loader's batches per pass, if it says (an endless one may say `sys.maxsize`)."""
    try:
        length = len(loader)
    except TypeError:
        return None
    return length if 0 < length < 2**62 else None


def _as_batch(batch: Any, index: int) -> PyTree:
    """A loader's batch as numpy arrays, checked to be a PyTree of arrays."""
    if isinstance(batch, list):
        batch = tuple(batch)  # loaders (PyTorch's collate) yield lists for tuples
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise TypeError(f"The loader's batch {index} holds no arrays: got {type(batch).__name__}.")
    try:
        return jax.tree.map(np.asarray, batch)
    except (TypeError, ValueError) as e:
        raise TypeError(f"The loader's batch {index} is not a PyTree of arrays: {e}") from None


def _check_batch(
    batch: PyTree, index: int, structure: Any, shapes: list[tuple[Any, Any]], size: int
) -> int:
    """Refuses a batch unlike the first: another structure, arrays that do not share
    their leading size, other sample shapes or dtypes, or more samples. Returns its size.
    (It runs for every batch, so it compares plain tuples; the messages do the work.)
    """
    leaves, got_structure = jax.tree.flatten(batch)
    if got_structure != structure:
        raise ValueError(
            f"The loader's batch {index} has the structure {got_structure}, but its first "
            f"batch had {structure}."
        )
    sizes = [a.shape[0] if a.ndim else -1 for a in leaves]
    if -1 in sizes or len(set(sizes)) > 1:
        raise ValueError(
            f"The loader's batch {index} has arrays of different lengths, "
            f"{[list(np.shape(a)) for a in leaves]}: every array of a batch needs the same "
            "leading (sample) size, or inputs and labels would not line up."
        )
    if [(a.shape[1:], a.dtype) for a in leaves] != shapes:
        got = [[tuple(a.shape[1:]), str(a.dtype)] for a in leaves]
        first = [[tuple(shape), str(dtype)] for shape, dtype in shapes]
        raise ValueError(
            f"The loader's batch {index} has samples of shapes and dtypes {got}, but its "
            f"first batch had {first}."
        )
    got_size = int(sizes[0])
    if got_size > size:
        raise ValueError(
            f"The loader's batch {index} has {got_size} samples, more than its first batch's "
            f"{size}: all must have that many but the last of a pass, which may have fewer."
        )
    return got_size


def streamed_source(data: Any, steps_per_epoch: int | None) -> "Memmaps | Loader | None":
    """The source to stream `data` from: memmaps or a loader; `None` for arrays in memory
    (checked later, as any PyTree of arrays).
    """
    arrays = (np.ndarray, jax.Array)
    if isinstance(data, list) and data and all(isinstance(a, arrays) for a in data):
        raise TypeError(
            f"`data` is a list of {len(data)} arrays; pass them as a tuple, `(x, y)`. (A list "
            "is taken as a loader: a sequence of batches.)"
        )
    if isinstance(data, (np.ndarray, jax.Array, str, bytes)):
        return None  # refused by the checks of data in memory
    if isinstance(data, (tuple, dict)):
        memmaps = any(isinstance(a, np.memmap) for a in jax.tree.leaves(data))
        return Memmaps(data) if memmaps else None
    if isinstance(data, Iterable):  # a list of batches, a loader, an iterator, a generator
        return Loader(data, steps_per_epoch)
    return None  # another PyTree of arrays (an `eqx.Module`, say), or refused later
