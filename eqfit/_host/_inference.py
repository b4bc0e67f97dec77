"""What an inference reads, and how it runs: the source of `evaluate`'s and `predict`'s
data (memmaps read in place, a loader), its one pass in order (`one_pass`), a run's
validation sets that stream (`Reread`, `StreamedSets`), a pass each validation; and the
way it runs its batches (`inference_execution`).
"""

from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from .._core._data import check_data, data_kind, sample_shapes
from .._core._execution import choose, Execution
from .._program._schedule import plan_passes, Schedule, UNKNOWN
from ._loader import Loader
from ._sources import Chunk, Memmaps


def inference_source(data: Any, name: str) -> "Memmaps | Loader | None":
    """The source that an inference (`evaluate`, `predict`) streams `data` (the argument
    `name`) from, read once, in order: memmaps, or a loader (its own batches, one pass,
    which its `len` must count); `None` for arrays in memory, which go to the device whole.
    """
    kind = data_kind(data)
    if kind == "memmaps":
        return Memmaps(data, shuffle=False, seed=0, mapped=True)
    if kind == "loader":
        return Loader(data, name=name, once=True)
    return None


class Reread:
    """A validation set that streams, read a pass per validation as an inference reads
    (`one_pass`): memmaps read again, a loader opened anew (a fresh pass; told
    `set_epoch(0)` each time, if it listens), arrays in memory (in a run whose other sets
    stream) read from the host. Opening it reads a loader's first batch, for its shape.
    """

    def __init__(self, data: Any, name: str):
        self.data, self.name, self.fresh = data, name, True
        source = inference_source(data, name)
        if source is None:  # arrays in memory, read a chunk at a time as a memmap is
            check_data(data, name)
            source = Memmaps(jax.tree.map(np.asarray, data), shuffle=False, seed=0)
        self.source: Memmaps | Loader = source

    @property
    def like(self) -> PyTree:
        return self.source.like

    def describe(self) -> list[list[Any]]:
        """What identifies the set for a checkpoint: its size (a loader: its type) and its
        sample shapes.
        """
        if isinstance(self.source, Memmaps):
            return self.source.describe()
        return [["loader", type(self.data).__qualname__], *sample_shapes(self.source.first)]

    def fingerprint(self) -> str | None:
        """What tells the set from another of its shapes, for a checkpoint (`Source`'s)."""
        return self.source.fingerprint()

    def abstract(self) -> PyTree | None:
        """The whole set as `jax.ShapeDtypeStruct`s, by its rows (a loader's: its length
        times its batch size, where it says its length); `None` where not known.
        """
        source = self.source
        if isinstance(source, Memmaps):
            rows: int | None = source.num_samples
        else:
            rows = None if source.length is None else source.length * source.batch_size
        if rows is None:
            return None
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype), self.like
        )

    def chunks(self, batch_size: int) -> Iterator[Chunk]:
        """The set's batches, a pass, as `one_pass` gives them."""
        if not self.fresh and isinstance(self.source, Loader):
            self.source = Loader(self.data, name=self.name, once=True)
        self.fresh = False
        return one_pass(self.source, batch_size)


class StreamedSets(NamedTuple):
    """The validation sets of a run whose validation streams (`Validation.streamed`),
    in the order of their values.
    """

    sets: tuple[Reread, ...]


def one_pass(source: "Memmaps | Loader", batch_size: int) -> Iterator[Chunk]:
    """Every batch of one pass over `source`, in order, as training streams them: chunks
    of consecutive full batches, padded to one shape (`Chunk.end` says where the real
    ones end), and the smaller last batch in a chunk of its own. `batch_size`: a
    memmap's; a loader's batches are its own.
    """
    if isinstance(source, Memmaps):
        passes = plan_passes(source.num_samples, batch_size, drop_remainder=False)
        schedule = Schedule(batch_size, passes.steps_per_pass, 0, 1, passes)
        return source.chunks(schedule, 0, schedule.total)
    return _loader_pass(source)


def _loader_pass(source: Loader) -> Iterator[Chunk]:
    """A loader's pass, as `one_pass` gives it, then read to its end: where the loader
    yields more batches than its `len` says, refused (`PassLength`), not cut short.
    """
    # A loader without `len` shows its pass's end as it is read.
    length = UNKNOWN if source.length is None else source.length
    schedule = Schedule(source.batch_size, length, 0, 1, columns=1)
    yield from source.chunks(schedule, 0, schedule.total)
    for _ in source.read:
        pass


# What `execution=` takes, in words, for the runtime check's messages.
EXECUTION_HINTS = {"execution": "`'auto'`, `eqfit.WholeRun()` or `eqfit.PerStep(unroll)`"}


def inference_execution(
    asked: Execution | Literal["auto"], convolves: Callable[[], bool]
) -> Execution:
    """The way an inference (`predict`, `evaluate`) runs its batches (`Execution.batches`):
    as `asked` (`execution=`), or by default by `fit`'s rule (`choose`).
    """
    platform = jax.devices()[0].platform
    return choose(asked, platform=platform, steps_per_epoch=None, convolves=convolves).execution
