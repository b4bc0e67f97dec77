"""Where the training data comes from: arrays in memory, memmaps and loaders.

Each is a `Source`: it opens itself (checking what it can without training on it), holds
out validation rows where it can, says its shape to the schedule, and yields `Chunk`s of
plain host or device arrays. It knows nothing of the program or the driver, which move
chunks to the device and train on them.

Arrays in memory go to the device once, as one chunk for the whole run; the program orders
and gathers each pass's batches itself. Data larger than memory streams instead: a chunk
per run of consecutive batches of one size, so host memory holds a few chunks whatever the
data's size.
"""

import collections.abc
import functools
import itertools
import json
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np
from jaxtyping import Array, Key, PyTree

from .._core._data import (
    as_data,
    bucketed,
    check_data,
    data_kind,
    fingerprint,
    num_samples,
    sample_shapes,
)
from .._keep._checkpoint import newest_config
from .._program._options import Options
from .._program._schedule import (
    check_learnable,
    Schedule,
    SourceShape,
)
from ._batches import as_batch, check_batch, PassLength, sample_shapes_of, ShapesMet
from ._rows import advise_rows, POPULATE_READ, read_rows


CHUNK_BYTES = 32 * 2**20  # about this much data per chunk: few enough host copies in flight
# A loader's chunks hold at most this many batches: the device waits for the first chunk to
# be gathered from the loader, one batch at a time, so it must come quickly; and a call per
# this many steps costs nothing that shows.
LOADER_CHUNK_BATCHES = 128


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


def open_source(data: Any, options: Options, planning: bool = False) -> Source:
    """The source of `data`: arrays in memory, memmaps, or a loader. `planning`: for
    `eqfit.plan`, which remembers a one-shot iterator it reads from, for `fit` to refuse.
    """
    arrays = (np.ndarray, jax.Array)
    if isinstance(data, list) and data and all(isinstance(a, arrays) for a in data):
        raise TypeError(
            f"`data` is a list of {len(data)} arrays; pass them as a tuple, `(x, y)`. (A list "
            "is taken as a loader: a sequence of batches.)"
        )
    kind = data_kind(data)
    if kind == "memmaps":
        return Memmaps(data, options.shuffle, host_seed(options.key))
    if kind == "loader":
        refuse_planned(data, "data")
        directory = None if options.checkpoint is None else options.checkpoint.directory
        loader = Loader(
            data,
            epochs=options.epochs,
            steps_per_epoch=options.steps_per_epoch,
            initial_epoch=options.initial_epoch,
            directory=directory,
        )
        if planning:
            remember_planned(data)
        return loader
    return InMemory(data)  # a PyTree of arrays (an `eqx.Module`, say), checked there


def read_again(source: Source, options: Options) -> Source | None:
    """`source` to be read from its start again (a step's batch replayed, `_nonfinite`):
    arrays and memmaps as they are (their chunks are made afresh each time), a loader
    opened anew (iterated again from its first pass); `None` for a one-shot iterator,
    whose batches are gone.
    """
    if not isinstance(source, Loader):
        return source
    if not replayable(source):
        return None
    return open_source(source.loader, options)


def replayable(source: Source) -> bool:
    """Whether `source` can be read again from its start (`read_again`): all but a
    one-shot iterator (a generator, say).
    """
    return not (isinstance(source, Loader) and source.one_shot)


# The one-shot iterators (generators, say) that `plan` read from, held weakly: a `fit`
# given one would silently train without the batches `plan` took.
_PLANNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def refuse_planned(data: Any, name: str) -> None:
    """Refuses an iterator that `eqfit.plan` has read from (`remember_planned`)."""
    if isinstance(data, collections.abc.Iterator) and data in _PLANNED:
        raise ValueError(
            f"`{name}` is an iterator that `eqfit.plan` has read its first batches from: a "
            "run on it would miss them. Pass a fresh iterator (a new generator, say) to "
            "`fit`, and give `plan` one of its own."
        )


def remember_planned(data: Any) -> None:
    """Remembers a one-shot iterator that `eqfit.plan` read from, for `fit` to refuse."""
    if not isinstance(data, collections.abc.Iterator):
        return
    try:
        _PLANNED.add(data)
    except TypeError:  # not weakly referable (`iter(list)`, `map`): not remembered
        pass


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
        val = jax.tree.map(lambda a: a[held], self.data)
        return InMemory(jax.tree.map(lambda a: a[train], self.data), train), val

    def chunks(self, schedule: Schedule, begin: int, end: int) -> Iterator[Chunk]:
        yield Chunk(self.data, None, begin, end, schedule.batch_size)


class _Streamed:
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


class Memmaps(_Streamed):
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
        val = jax.tree.map(lambda a: jax.numpy.asarray(np.asarray(a[held])), self.data)
        return Memmaps(self.data, self.shuffle, self.seed, train), val

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


class Loader(_Streamed):
    """Batches from a loader: a re-iterable (iterated anew for each pass, such as a
    PyTorch `DataLoader` or a Grain dataset), or an iterator or generator (used once; an
    endless one with `steps_per_epoch`). Each batch is one step. Every batch has the size
    of the first but the last of a pass, which may be smaller. The loader shuffles as it
    likes; one with `set_epoch` is told, before each pass (the first included), how many
    passes came before.

    Opening it starts the first pass, whose first batch says the batch's shape; training
    goes on from that same iterator. A loader that does not say its length (no `len`,
    no `steps_per_epoch`) is never counted ahead: its first pass trains as it is read, a
    batch read ahead to see where it ends, and that pass's length is every epoch's. Its
    checkpoints keep that length: a run resuming from them takes it, and checks the
    loader's first pass against it. From `initial_epoch`, the first pass, read and not
    trained (as every pass before it is, with `len` too), is counted on opening.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        initial_epoch: int = 0,
        directory: Any = None,
        name: str = "data",
        once: bool = False,
    ):
        self.loader, self.name = loader, name
        self.one_shot = isinstance(loader, collections.abc.Iterator)
        self.once = once  # one pass read (an inference's), not pass after pass
        self.passes_done = 0
        length = _length(loader)
        if length is not None and length >= 2**31 and steps_per_epoch is None:
            raise ValueError(
                f"`data` says it has {length} batches (`len`), more than a run can count: it "
                "is endless, or repeats. Pass `steps_per_epoch=`, the number of batches each "
                "epoch takes."
            )
        self.length = length  # batches in a pass, if known
        # Where `len` is taken as a pass's length (not only `steps_per_epoch`'s), each
        # pass is checked to have it.
        self.said = length if steps_per_epoch is None else None
        # Neither `len` nor `steps_per_epoch`: an epoch is as long as the first pass.
        self.unsaid = self.learns = steps_per_epoch is None and length is None
        self.stored: int | None = None  # that length, as the checkpoints resumed keep it
        self.directory = directory  # the run's checkpoints, that may keep that length
        if self.learns:
            check_learnable(self.one_shot, epochs)
        self.stream = self._batches()
        try:
            first = next(self.stream)
        except StopIteration:
            raise ValueError("`data` yielded no batches.") from None
        self.first = first[0]
        self.like = jax.tree.map(lambda a: a[:1], self.first)
        self.batch_size = num_samples(self.first)
        # Every batch, checked, with its global step: the first pass's first is step 0.
        self.read = self._checked(itertools.chain([first], self.stream))
        if self.unsaid:
            self.length = self.stored = self._stored_length()
            if self.length is None and initial_epoch:
                self.length = self._count_first_pass()
            self.learns = self.length is None

    def _stored_length(self) -> int | None:
        """The epoch's length kept by the newest checkpoint, if it is of this data."""
        config = None if self.directory is None else newest_config(self.directory)
        if config is None or config.get("data") != json.loads(json.dumps(self.describe())):
            return None  # none, or another run's: refused when the run restores it
        length = config.get("steps_per_epoch")
        return length if isinstance(length, int) and length > 0 else None

    def _count_first_pass(self) -> int:
        """Reads the first pass to its end (its last batch is known as such: it is read
        ahead), and returns its length.
        """
        count = 0
        for step, _, _, ends_first, _ in self.read:
            count = step + 1
            if ends_first:
                break
        return count

    def shape(self) -> SourceShape:
        return SourceShape(None, self.batch_size, self.length, self.batches_per_chunk())

    def describe(self) -> list[list[Any]]:
        # The epoch's length, stored with the run's checkpoints, is then the first pass's.
        epochs = [["epochs", "as long as its first pass"]] if self.unsaid else []
        return [["loader", type(self.loader).__qualname__], *epochs, *sample_shapes(self.first)]

    def fingerprint(self) -> str | None:
        """`eqfit.Buckets`'s own (its key, lengths and samples); other loaders have none:
        a batch read from one may differ from run to run (a shuffle of its own), and
        reading more of it costs what training does.
        """
        own = getattr(self.loader, "fingerprint", None)
        return str(own()) if bucketed(self.loader) and callable(own) else None

    def hold_out(self, fraction: float, key: Key[Array, ""]) -> tuple["Loader", PyTree]:
        raise ValueError(
            "`validation_split` needs the whole data to choose rows from; a loader yields it "
            "a batch at a time. Pass `validation_data` instead."
        )

    def chunk_size(self, schedule: Schedule) -> int:
        return self.batches_per_chunk(schedule.batch_size)

    def bucket_shapes(self) -> tuple[tuple[tuple[int, ...], ...], ...] | None:
        """Each bucket's sample shapes, where the loader is in buckets and says them
        (`eqfit.Buckets.shapes`); else `None`.
        """
        shapes = getattr(self.loader, "shapes", None)
        if not bucketed(self.loader) or not callable(shapes):
            return None
        said: Any = shapes()
        return tuple(tuple(tuple(int(n) for n in s) for s in bucket) for bucket in said)

    def batches_per_chunk(self, batch_size: int | None = None) -> int:
        """Full batches a chunk: about `CHUNK_BYTES`, at most `LOADER_CHUNK_BATCHES`; one
        where the loader says its batches come in several shapes, shuffled among each other
        (`bucketed = True`, as `eqfit.Buckets`): each a call of one step, so that each shape
        compiles one program, not one for a chunk and one for a batch between others.
        """
        if bucketed(self.loader):
            return 1
        return min(self.per_chunk(batch_size or self.batch_size), LOADER_CHUNK_BATCHES)

    def _iterate(self) -> Iterator[Any]:
        """One pass over the loader, telling it which pass it is (`set_epoch`)."""
        if not self.one_shot:
            set_epoch = getattr(self.loader, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.passes_done)
            self.passes_done += 1
        return iter(self.loader)

    def _batches(self) -> Iterator[tuple[PyTree, bool, bool]]:
        """Every batch as numpy arrays, with whether it starts a pass and whether it ends
        the first, pass after pass (a one-shot loader gives one pass). Where the loader's
        length is to be learned, its first pass is read a batch ahead, so that its last
        batch is known as such; otherwise nothing is read before it is trained on.
        """
        index = 0
        while True:
            batches = self._iterate()
            ahead = self.learns and not index  # the first pass, of unknown length
            batch = next(batches, _END)
            starts = True
            while batch is not _END:
                following = next(batches, _END) if ahead else None
                yield as_batch(batch, index), starts, following is _END
                starts = False
                index += 1
                batch = following if ahead else next(batches, _END)
            if self.one_shot or self.once or starts:  # used up, or a pass yielded nothing
                return

    def _checked(self, stream: Iterator[tuple[PyTree, bool, bool]]) -> Iterator[Any]:
        """`(step, batch, starts a pass, ends the first, size)` of every batch of `stream`,
        each checked to be like the first, and the first pass against a stored length.
        """
        structure = jax.tree.structure(self.first)
        shapes = [(a.shape[1:], a.dtype) for a in jax.tree.leaves(self.first)]
        size, stored = self.batch_size, self.stored
        met, passes = ShapesMet(self.first), PassLength(self.said, self.name)
        smaller = None  # the size of the last batch, if smaller: its pass must end there
        step = 0
        for step, (batch, starts_pass, ends_first) in enumerate(stream):
            if smaller is not None and not starts_pass:
                raise ValueError(
                    f"The loader's batch {step} follows a batch of {smaller} samples in "
                    "the same pass: only the last batch of a pass may be smaller than "
                    f"the first batch's {size}."
                )
            got = check_batch(batch, step, structure, shapes, size)
            smaller = got if got < size else None
            met.add(batch, step)
            passes.add(step, starts_pass, got)
            if stored is not None and 0 < step < stored and starts_pass:
                raise self._changed(f"{step} batches")
            if stored is not None and step == stored and not starts_pass:
                raise self._changed(f"more than {stored} batches")
            yield step, batch, starts_pass, ends_first, got
        if stored is not None and step + 1 < stored:  # the loader ran out in its first pass
            raise self._changed(f"{step + 1} batches")
        passes.ended(step + 1)

    def _changed(self, now: str) -> ValueError:
        return ValueError(
            "`data` is a loader without `len`, whose epochs were as long as its first pass, "
            f"{self.stored} batches, when the checkpoints in {self.directory} were written "
            f"(they keep that length); now its first pass yields {now}. Resume with the "
            "data that wrote them, or use another `checkpoint` directory."
        )

    def raw_chunks(self, schedule: Schedule, begin: int, end: int) -> Iterator[Chunk]:
        """Chunks of consecutive full batches; a smaller batch makes a chunk of its own.
        Steps before `begin` (a resume, `initial_epoch`) are skipped: the loader is read
        up to there; and none is read past `end`.
        """
        size, per_chunk = self.batch_size, self.chunk_size(schedule)
        held: list[PyTree] = []
        learned = None  # the first epoch's length, once its last batch is read

        def chunk(batches: list[PyTree], batch_size: int, first: int) -> Chunk:
            # One shape a chunk: a bucket's batches (`sample_shapes_of`) share a program.
            data = jax.tree.map(lambda *parts: np.concatenate(parts), *batches)
            order = np.arange(len(batches) * batch_size)
            return Chunk(data, order, first, first + len(batches), batch_size, learned)

        step = last_held = 0
        try:
            for step, batch, _, ends_first, got in self.read:
                if ends_first and schedule.learning:
                    learned = step + 1  # then the run is its epochs of this many steps
                    end = min(end, schedule.epochs * learned)
                if step < begin:  # trained before a resume
                    continue
                if held and sample_shapes_of(batch) != sample_shapes_of(held[0]):
                    yield chunk(held, size, step - len(held))  # a new bucket: a new chunk
                    held = []
                if got < size:
                    if held:
                        yield chunk(held, size, step - len(held))
                        held = []
                    yield chunk([batch], got, step)
                else:
                    held.append(batch)
                    last_held = step
                    if len(held) == per_chunk or step + 1 >= end or ends_first:
                        yield chunk(held, size, step - len(held) + 1)
                        held = []
                if step + 1 >= end:
                    return
        except Exception:
            # The loader raised (or gave a bad batch): the batches read before it still
            # train, and `fit` raises the error with that training as its `.result`.
            if held:
                yield chunk(held, size, last_held - len(held) + 1)
            raise
        if held:
            yield chunk(held, size, step - len(held) + 1)


_END = object()  # a pass's end, when reading ahead


def _length(loader: Any) -> int | None:
    """The loader's batches per pass, if it says (an endless one may say `sys.maxsize`)."""
    try:
        length = len(loader)
    except TypeError:
        return None
    return length if length > 0 else None
