"""The program's feeds: the data of each call as the program takes it. Streamed chunks
are moved to the device ahead of time, in a background thread (`ReadAhead`) that every
way out stops.
"""

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

import jax
import numpy as np
from jaxtyping import PyTree

from .._program._state import Inputs, OnDevice, Piece, ReadSet
from ._inference import one_pass, StreamedSets
from ._loader import Loader
from ._sources import Chunk, Memmaps


_Fed = TypeVar("_Fed")


class Feed(NamedTuple):
    """Data for the steps before the global step `end`, as the program takes it."""

    inputs: Inputs
    end: int
    batch_size: int
    epoch_length: int | None = None  # learned from the loader's first pass
    validation: ReadSet | None = None  # where validation streams: how to read its sets


class ReadAhead(Generic[_Fed]):
    """Chunks of streamed data turned into feeds (moved to the device) in a background
    thread, at most `depth` ahead of the driver.

    The thread checks a stop event between chunks and never blocks on the queue for
    long; `close()`, which the driver calls on every way out, sets the event and waits a
    bounded time for it. A loader that blocks forever inside `next` leaves a daemon thread
    behind, never a hung `fit`.
    """

    def __init__(self, chunks: Iterator[Chunk], feed: Callable[[Chunk], _Fed], depth: int = 2):
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, args=(chunks, feed), daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, chunks: Iterator[Chunk], feed: Callable[[Chunk], _Fed]) -> None:
        try:
            for chunk in chunks:
                if self.stop.is_set() or not self._put(feed(chunk)):
                    return
            self._put(_DONE)
        except BaseException as e:  # surfaced in the training thread
            self._put(e)

    def __iter__(self) -> Iterator[_Fed]:
        while True:
            try:
                item = self.ready.get(timeout=0.05)
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    return
                continue
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=1.0)


_DONE = object()


def feeds(
    chunks: Iterator[Chunk],
    template: Inputs,
    put: Callable[..., Any],
    streamed: bool,
    validation: ReadSet | None = None,
) -> tuple[Iterator[Feed], Callable[[], None]]:
    """The program's feeds from a source's chunks, and how to stop making them. Streamed
    chunks are moved to the device ahead of time, in a background thread. `validation`:
    how the run reads its validation sets, where they stream.
    """

    def feed(chunk: Chunk) -> Feed:
        if chunk.order is None:  # the whole data: the program orders it
            inputs = template._replace(data=put(chunk.data, sharded=True))
        else:
            piece = Piece(chunk.order, np.int32(chunk.first), np.int32(chunk.end))
            inputs = template._replace(data=put(chunk.data, sharded=True), piece=put(piece))
        return Feed(inputs, chunk.end, chunk.batch_size, chunk.epoch_length, validation)

    if not streamed:
        return map(feed, chunks), lambda: None
    ahead = ReadAhead(chunks, feed)
    return iter(ahead), ahead.close


def inference_chunks(
    source: Memmaps | Loader, batch_size: int
) -> contextlib.AbstractContextManager[Iterator[OnDevice]]:
    """One pass over `source` (`one_pass`'s chunks) moved to the device in a background
    thread, a few chunks ahead of the programs that take them; the thread is stopped on
    every way out of the block.
    """
    return on_device(one_pass(source, batch_size), jax.device_put)


def validation_reader(streams: StreamedSets, put: Callable[..., Any]) -> ReadSet:
    """How a run reads its streamed validation sets: each set's pass on the run's
    devices (`put`, the placement's), as `inference_chunks` reads.
    """

    def read(i: int, batch_size: int) -> contextlib.AbstractContextManager[Iterator[OnDevice]]:
        return on_device(streams.sets[i].chunks(batch_size), lambda x: put(x, sharded=True))

    return read


@contextlib.contextmanager
def on_device(
    chunks: Iterator[Chunk], put: Callable[[PyTree], PyTree]
) -> Iterator[Iterator[OnDevice]]:
    """`chunks` moved to the device by `put` in a background thread, a few ahead of the
    programs that take them; the thread is stopped on every way out of the block.
    """

    def moved(chunk: Chunk) -> OnDevice:
        offset = np.asarray(chunk.first, np.int32)  # an array: traced, one program
        valid, release = chunk.end - chunk.first, chunk.release or _nothing
        return OnDevice(put(chunk.data), offset, valid, chunk.batch_size, release)

    ahead = ReadAhead(chunks, moved)
    try:
        yield iter(ahead)
    finally:
        ahead.close()


def _nothing() -> None:
    pass


class DataError(Exception):
    """An error raised while the data was read (a loader that raised, a bad batch)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def from_data(feeds: Iterator[Feed]) -> Iterator[Feed]:
    """`feeds`, with an error raised in reading them wrapped as a `DataError`."""
    while True:
        try:
            feed = next(feeds)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(e) from e
        yield feed
