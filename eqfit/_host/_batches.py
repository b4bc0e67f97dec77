"""A loader's batches as the training reads them: numpy arrays, each checked to be like
the first (or a batch of another bucket: the same arrays, of other lengths), the
shapes met (`ShapesMet`), and each pass counted against the loader's `len` (`PassLength`).
"""

import warnings
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree


def as_batch(batch: Any, index: int) -> PyTree:
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


# Past this many shapes of a loader's batches, `fit` warns: each compiles its programs.
SHAPES_WARNED = 8


class ShapesMet:
    """The shapes of a loader's batches met so far (its buckets): past `SHAPES_WARNED`,
    warned of once.
    """

    def __init__(self, first: PyTree):
        self.met = {sample_shapes_of(first)}

    def add(self, batch: PyTree, step: int) -> None:
        """Batch `step`'s shape, met."""
        if len(self.met) > SHAPES_WARNED:
            return
        self.met.add(sample_shapes_of(batch))
        if len(self.met) > SHAPES_WARNED:
            warnings.warn(
                f"The loader has yielded batches of more than {SHAPES_WARNED} shapes (batch "
                f"{step} has a new one): each compiles programs of its own. Pad to a few "
                "bucket lengths (`eqfit.Buckets`) so that a few programs serve every batch.",
                RuntimeWarning,
                stacklevel=4,
            )


def sample_shapes_of(batch: PyTree) -> tuple[tuple[int, ...], ...]:
    """The shape of a sample of each of a batch's arrays: what its bucket is."""
    return tuple(a.shape[1:] for a in jax.tree.leaves(batch))


def check_batch(
    batch: PyTree, index: int, structure: Any, shapes: list[tuple[Any, Any]], size: int
) -> int:
    """Refuses a batch unlike the first: another structure, arrays that do not share
    their leading size, samples of other dtypes or of another number of axes, or more
    samples. Returns its size. Samples of other lengths along their axes are a batch of
    another bucket (a sequence padded to another length), which trains with programs of
    its own. (It runs for every batch, so it compares plain tuples; the messages do the
    work.)
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
    if [(a.ndim - 1, a.dtype) for a in leaves] != [(len(s), d) for s, d in shapes]:
        got = [[tuple(a.shape[1:]), str(a.dtype)] for a in leaves]
        first = [[tuple(shape), str(dtype)] for shape, dtype in shapes]
        raise ValueError(
            f"The loader's batch {index} has samples of shapes and dtypes {got}, but its "
            f"first batch had {first}: each array's dtype and number of axes must stay "
            "(its lengths may change, a bucket's)."
        )
    got_size = int(sizes[0])
    if got_size > size:
        raise ValueError(
            f"The loader's batch {index} has {got_size} samples, more than its first batch's "
            f"{size}: all must have that many but the last of a pass, which may have fewer."
        )
    return got_size


class PassLength:
    """Each pass of a loader counted against its `len`, where a run takes `len` as an
    epoch's batches (or an inference as its pass's): a pass of another length is refused
    as soon as it shows, never read as the batches `len` said (a loader started over, or
    cut short).
    """

    def __init__(self, said: int | None, name: str):
        self.said, self.name = said, name
        self.start = self.samples = 0  # the pass's first step, and its samples so far

    def add(self, step: int, starts_pass: bool, size: int) -> None:
        """Batch `step`, of `size` samples, read."""
        if self.said is None:
            return
        if starts_pass and step:
            self.ended(step)
            self.start, self.samples = step, 0
        elif step - self.start == self.said:
            raise ValueError(
                f"`len({self.name})` is {self.said}, but a pass over `{self.name}` yielded "
                f"more batches: its batch {self.said} (counted from 0) came in the same "
                f"pass. {self._advice()}"
            )
        self.samples += size

    def ended(self, step: int) -> None:
        """The pass ends before batch `step` (a new pass starts there, or the loader ran
        out).
        """
        yielded = step - self.start
        if self.said is None or yielded == self.said:
            return
        samples = (
            ": `len` is its number of samples, where a loader's is its number of batches"
            if self.samples == self.said
            else ""
        )
        raise ValueError(
            f"`len({self.name})` is {self.said}, but a pass over `{self.name}` yielded "
            f"{yielded} batches ({self.samples} samples){samples}. {self._advice()}"
        )

    def _advice(self) -> str:
        return (
            "Make `__len__` return the number of batches a pass yields, or leave it out: a "
            "loader without `len` is read to the end of its pass."
        )
