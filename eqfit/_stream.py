"""Data larger than memory: chunks of batches read from disk or a loader, double-buffered.

A chunk is K consecutive batches. While the device trains on one chunk, a background
thread reads the next from disk and moves it to the device, so host memory holds a few
chunks whatever the data's size, and the device rarely waits.
"""

import mmap
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from ._data import BatchPlan, check_data, plan_batches
from ._loop import _chunk, _epoch_end, Inputs, Loop, Progress, Record, TrainState
from ._parallel import OneDevice


CHUNK_BYTES = 32 * 2**20  # about this much data per chunk: few enough host copies in flight


class Chunk(NamedTuple):
    """Rows for the full batches `first .. first + steps` of an epoch (and, for the last
    chunk of an epoch, its remainder batch), as host arrays.
    """

    first: int
    steps: int
    arrays: tuple[np.ndarray, ...]
    last: bool = False
    order: np.ndarray | None = None  # the rows' order within the chunk; None: as read


def _mark_last(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """The same chunks, the final one marked `last` (one chunk of lookahead)."""
    previous = None
    for chunk in chunks:
        if previous is not None:
            yield previous
        previous = chunk
    if previous is not None:
        yield previous._replace(last=True)


def stream_source(
    data: Any, devices: Any, mesh: Any, ensemble: bool, validation_split: Any
) -> "MemmapSource | LoaderSource | None":
    """The source to stream `data` from, or `None` for in-memory arrays."""
    if isinstance(data, tuple):
        if not any(isinstance(a, np.memmap) for a in data):
            return None
    elif not isinstance(data, Iterable) or isinstance(data, (np.ndarray, jax.Array, str)):
        return None
    for name, given in (
        ("devices", devices),
        ("mesh", mesh),
        ("ensemble", ensemble),
        ("validation_split", validation_split),
    ):
        if given:
            raise ValueError(
                f"Streamed `data` (memmaps or a loader) does not support `{name}=` yet; "
                "load the data into memory, or pass `validation_data`."
            )
    return MemmapSource(data) if isinstance(data, tuple) else LoaderSource(data)


class MemmapSource:
    """Reads blocks of consecutive rows from `np.memmap` arrays (`np.load(mmap_mode="r")`).

    Rows are read with `np.fromfile` at the array's offset, not through the mapping, so
    pages already trained on are not held in this process's memory.
    """

    def __init__(self, arrays: tuple[np.ndarray, ...]):
        check_data(arrays)  # the same checks as in-memory data, nothing read
        self.arrays = arrays
        self.num_samples = arrays[0].shape[0]
        self.row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in arrays)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        return tuple(_read_rows(a, start, stop) for a in self.arrays)

    def describe(self) -> list[list[Any]]:
        return [[f"[{i}]", list(a.shape), str(a.dtype)] for i, a in enumerate(self.arrays)]


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


def memmap_chunks(
    source: MemmapSource, plan: BatchPlan, per_chunk: int, epoch: int, seed: int | None
) -> Iterator[Chunk]:
    """An epoch's chunks: whole blocks of `per_chunk` batches in a random order (if `seed`),
    then the last, partial block with the remainder.
    """
    blocks = plan.num_full // per_chunk
    order = np.arange(blocks) if seed is None else np.random.default_rng(seed).permutation(blocks)
    rows = per_chunk * plan.batch_size
    pieces = [
        (position * per_chunk, per_chunk, int(block) * rows, (int(block) + 1) * rows)
        for position, block in enumerate(order)
    ]
    first = blocks * per_chunk
    end = plan.num_full * plan.batch_size + plan.remainder
    if end > first * plan.batch_size:
        pieces.append((first, plan.num_full - first, first * plan.batch_size, end))
    for position, (first, steps, start, stop) in enumerate(pieces):
        # Rows are shuffled within the chunk here, in the reading thread: numpy permutes
        # half a million indices in milliseconds, where a sort on the device takes 126 ms
        # and holds up training.
        within = None
        if seed is not None:
            within = np.random.default_rng([seed, position]).permutation(stop - start)
        yield Chunk(first, steps, source.read(start, stop), order=within)


class LoaderSource:
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

    def describe(self) -> list[list[Any]]:
        return [
            [f"[{i}]", [self.num_samples, *a.shape[1:]], str(a.dtype)]
            for i, a in enumerate(self.first)
        ]


def loader_chunks(source: LoaderSource, plan: BatchPlan, per_chunk: int) -> Iterator[Chunk]:
    """An epoch's chunks: `per_chunk` batches stacked, then the rest with the remainder."""
    held: list[tuple[np.ndarray, ...]] = []
    first, smaller = 0, None
    for i, batch in enumerate(source.loader):
        arrays = _as_batch(batch, i)
        size = len(arrays[0])
        if smaller is not None or size > plan.batch_size:
            raise ValueError(
                f"The loader's batch {i} has {size} samples after a batch of {smaller}: only "
                f"the last batch of an epoch may be smaller than {plan.batch_size}."
            )
        if size < plan.batch_size:
            smaller = size
            if plan.remainder == 0:  # drop_remainder
                continue
        held.append(arrays)
        if len(held) == per_chunk and smaller is None:
            yield Chunk(first, per_chunk, tuple(np.concatenate(parts) for parts in zip(*held)))
            first, held = first + per_chunk, []
    steps = len(held) - (smaller is not None and plan.remainder > 0)
    if first + steps != plan.num_full:
        raise ValueError(
            f"The loader yielded {first + steps} full batches this epoch, but "
            f"{plan.num_full} in its first."
        )
    if held:
        yield Chunk(first, steps, tuple(np.concatenate(parts) for parts in zip(*held)))


def _as_batch(batch: Any, i: int) -> tuple[np.ndarray, ...]:
    if isinstance(batch, dict) or not isinstance(batch, (tuple, list)):
        raise TypeError(
            f"A loader must yield each batch as a tuple of arrays, got {type(batch).__name__} "
            f"for batch {i}."
        )
    return tuple(np.asarray(a) for a in batch)


def stream_plan(source: MemmapSource | LoaderSource, batch_size: int, drop: bool) -> BatchPlan:
    if isinstance(source, LoaderSource):
        if batch_size != source.batch_size:
            raise ValueError(
                f"`batch_size`={batch_size}, but the loader yields batches of "
                f"{source.batch_size}: set `batch_size` to the loader's."
            )
    return plan_batches(source.num_samples, batch_size, drop)


def chunk_batches(source: MemmapSource | LoaderSource, plan: BatchPlan) -> int:
    """Batches per chunk: about `CHUNK_BYTES` of data, at least one."""
    if isinstance(source, MemmapSource):
        row = source.row_bytes
    else:
        row = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in source.first)
    return max(1, min(plan.num_full or 1, CHUNK_BYTES // max(1, row * plan.batch_size)))


def run_streamed(
    loop: Loop,
    inputs: Inputs,
    s: TrainState,
    r: Record,
    begin: tuple[int, int],
    num_epochs: int,
    progress: Progress,
    source: MemmapSource | LoaderSource,
    checkpoint_every: int | None,
) -> tuple[TrainState, Record]:
    """Trains chunk by chunk with the chunked runner's compiled pieces, the next chunk
    read and moved to the device in the background while the current one trains.

    The randomness, for memmaps with `shuffle=True`: each epoch visits the blocks of K
    batches in a new random order, and shuffles the rows inside each block (on the host,
    in the reading thread), like a shuffle buffer of K batches that never holds more than
    a block. Both come from `key` and the epoch. A loader shuffles as it likes.
    """
    plan = loop.plan
    per_chunk = chunk_batches(source, plan)
    chunk_fn = OneDevice().compile(_chunk, donate=(4, 5))
    epoch_end_fn = OneDevice().compile(_epoch_end, donate=(4, 5))
    first_epoch, first_step = begin

    def chunks(epoch: int) -> Iterator[Chunk]:
        if isinstance(source, LoaderSource):
            return _mark_last(loader_chunks(source, plan, per_chunk))
        seed = None
        if loop.shuffle:
            seed = int(
                jax.random.randint(jax.random.fold_in(inputs.keys[0], epoch), (), 0, 2**31 - 1)
            )
        return _mark_last(memmap_chunks(source, plan, per_chunk, epoch, seed))

    def produce(out: "queue.Queue[Any]", stop: threading.Event) -> None:
        try:
            for epoch in range(first_epoch, num_epochs):
                for chunk in chunks(epoch):
                    resumed = epoch == first_epoch and not chunk.last
                    if resumed and chunk.first + chunk.steps <= first_step:
                        continue  # trained before a resume
                    arrays = tuple(jax.device_put(a) for a in chunk.arrays)
                    rows = len(chunk.arrays[0])
                    within = np.arange(rows) if chunk.order is None else chunk.order
                    arrays = (arrays, jax.device_put(within.astype(np.uint32)))
                    while not stop.is_set():
                        try:
                            # Only the device copies travel on: the host ones can go.
                            light = chunk._replace(arrays=(), order=None)
                            out.put((epoch, light, arrays), timeout=0.1)
                            break
                        except queue.Full:
                            pass
                    if stop.is_set():
                        return
            out.put(None)
        except BaseException as e:  # surfaced in the training thread
            out.put(e)

    ready: queue.Queue[Any] = queue.Queue(maxsize=2)  # the double buffer
    stop = threading.Event()
    reader = threading.Thread(target=produce, args=(ready, stop), daemon=True)
    reader.start()
    pending: list[tuple[int, int, Any]] = []
    try:
        while True:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                break
            epoch, chunk, (arrays, arrays_order) = item
            chunk_inputs = Inputs(arrays, inputs.val_data, inputs.keys)
            order = arrays_order
            start = max(chunk.first, first_step) if epoch == first_epoch else chunk.first
            bounds = np.asarray([start, chunk.first + chunk.steps, chunk.first], np.int32)
            s, r, loss_sum = chunk_fn(loop, chunk_inputs, order, bounds, s, r)
            for done in pending:
                progress.on_steps(done[0], done[1], float(done[2]))
            pending = [(epoch, chunk.first + chunk.steps - start, loss_sum)]
            if chunk.last:
                offset = np.asarray(chunk.first, np.int32)
                s, r, logs, remainder_loss = epoch_end_fn(loop, chunk_inputs, order, offset, s, r)
                values = np.asarray(logs).tolist()
                for done in pending:
                    progress.on_steps(done[0], done[1], float(done[2]))
                pending = []
                if plan.remainder:
                    progress.on_steps(epoch, 1, float(remainder_loss))
                stopped, epochs_done = bool(values[-2]), int(values[-1])
                names = loop.log_names
                if epochs_done > epoch and progress.on_epoch(epoch, dict(zip(names, values))):
                    break
                if checkpoint_every and (epoch + 1) % checkpoint_every == 0:
                    progress.save(s, r)
                if stopped:
                    break
            if progress.interrupted():
                break
        for done in pending:
            progress.on_steps(done[0], done[1], float(done[2]))
    finally:
        stop.set()
        reader.join()
    return s, r
