"""A loader as the training data's source (`Loader`): batches read pass after pass from
a re-iterable, or once from an iterator, each checked to be like the first, gathered into
chunks of consecutive batches; a loader without `len` learns its epoch's length from its
first pass.
"""

import collections.abc
import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Key, PyTree

from .._core._data import bucketed, num_samples, sample_shapes
from .._keep._checkpoint import newest_config
from .._program._schedule import check_learnable, Schedule, SourceShape
from ._batches import as_batch, check_batch, PassLength, sample_shapes_of, ShapesMet
from ._sources import Chunk, Streamed


# A loader's chunks hold at most this many batches: the device waits for the first chunk to
# be gathered from the loader, one batch at a time, so it must come quickly; and a call per
# this many steps costs nothing that shows.
LOADER_CHUNK_BATCHES = 128


class Loader(Streamed):
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
