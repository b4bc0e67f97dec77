"""`Buckets`: sequences of many lengths padded to a few bucket lengths, with a mask, as a
loader of shuffled batches of one bucket each, which `fit` trains with one program per
bucket.
"""

import hashlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Key

from ._core._checks import as_int, as_real
from ._core._data import as_key


class Buckets:
    """Variable-length sequences, padded to the next of a few bucket lengths, as a loader
    for `fit`, `eqfit.evaluate` and `eqfit.predict`: each batch holds samples of one
    bucket, so XLA compiles one program per bucket rather than one per length, and none
    pays for padding to the longest.

    ```python
    buckets = eqfit.Buckets((tokens, labels), lengths=(16, 32, 64, 128), batch_size=32, key=key)
    eqfit.fit(model, buckets, loss=masked_loss, optimizer=opt, key=key, epochs=10)

    def masked_loss(model, tokens, labels, mask):  # each batch: the fields, then the mask
        per_token = ...  # (batch, length)
        return eqfit.Mean.of(per_token, mask)  # a mean over the real tokens
    ```

    Each pass yields every sample once: the samples of each bucket in an order shuffled
    from `key` and the pass (`set_epoch`, which `fit` calls before each), cut into
    batches of `batch_size`, and the batches of every bucket in a shuffled order. The last
    batch of a bucket is filled up with rows of padding (mask 0), so every batch is full
    and a masked mean (`eqfit.Mean` weighted by the mask) is the mean over the real
    tokens: the same as on the sequences unpadded. The same `key` gives the same batches
    bit for bit, so a resumed run reads the pass it stopped in as it was.

    **Arguments:**

    - `data`: a tuple of fields, one entry per sample in each: a list of arrays whose
        first axis is the sample's length (its tokens: every such field of a sample has
        the same length; a field's samples share their dtype and other axes), or an
        array with a row per sample (a label per sequence).
    - `lengths`: the bucket lengths, whole numbers, increasing: a sample goes to the
        shortest that holds it, and one longer than the longest is refused.
    - `batch_size`: samples a batch.
    - `key`: the shuffle's key; `shuffle=False` keeps the samples' order in each bucket
        and the buckets in order.
    - `pad`: the value padded positions hold (the mask says which they are).

    A batch is the tuple of the fields, each padded to its bucket's length (`(batch,
    length, ...)`; a field with a row per sample stays `(batch, ...)`), then the mask,
    `(batch, length)` float32: 1 at a sample's tokens, 0 at padding. With a label per
    sequence (a classifier's, `(batch,)`), eqfit's losses and ready metrics weigh each
    sequence 1 if any of its positions is real, 0 for a row of padding.

    How to choose the lengths: a few (4 to 8), so that the programs compile in little
    time, spread so that each bucket pads its samples little: the quantiles of the
    samples' lengths (`np.quantile(lengths, [0.25, 0.5, 0.75, 1.0])`, rounded up to a
    multiple of 8 for the accelerator's tiles) are a good start.
    """

    # Its batches come in several shapes, shuffled among each other: `fit` reads each as a
    # call of its own (`Loader.batches_per_chunk`).
    bucketed: bool = True
    bucket_lengths: tuple[int, ...]  # `lengths`, as given
    batch_size: int
    shuffle: bool
    pad: float

    def __init__(
        self,
        data: tuple[Any, ...],
        *,
        lengths: Sequence[int] | np.ndarray,
        batch_size: int,
        key: Key[Array, ""] | None = None,
        shuffle: bool = True,
        pad: float = 0,
    ):
        if not isinstance(data, tuple) or not data:
            given = "an empty tuple" if isinstance(data, tuple) else f"a {type(data).__name__}"
            raise TypeError(
                "`Buckets`'s `data` must be a tuple of one or more fields (`(tokens, "
                "labels)`), each a list of arrays (one per sample) or an array with a row per "
                f"sample; got {given}."
            )
        bounds = _bounds(lengths)
        batch_size = as_int(batch_size)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                "`Buckets`'s `batch_size` must be a whole number of samples, 1 or more; got "
                f"{batch_size!r}."
            )
        padding = as_real(pad)
        if padding is None or not math.isfinite(padding):
            raise ValueError(
                "`Buckets`'s `pad` must be a finite number: padded positions go through the "
                "model, and a mask of 0 does not clear a NaN or infinite output (0 * NaN is "
                f"NaN); got {pad!r}."
            )
        if shuffle and key is None:
            raise ValueError("`Buckets` shuffles with `key=`: give one, or `shuffle=False`.")
        self._fields: list[list[np.ndarray] | np.ndarray] = [
            _field(f, i) for i, f in enumerate(data)
        ]
        self._ragged: list[bool] = [isinstance(f, list) for f in self._fields]
        counts = {len(f) for f in self._fields}
        if len(counts) > 1:
            raise ValueError(
                f"`Buckets`'s fields hold {sorted(counts)} samples: each needs one entry per "
                "sample."
            )
        if not any(self._ragged):
            raise ValueError(
                "`Buckets`'s `data` has no field of sequences: give at least one as a list "
                "of arrays, one per sample, whose first axis is its length."
            )
        self._lengths: np.ndarray = _sample_lengths(self._fields, self._ragged)
        too_long = np.flatnonzero(self._lengths > bounds[-1])
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"`Buckets`: sample {i} has length {int(self._lengths[i])}, longer than the "
                f"longest bucket, {bounds[-1]}: add a longer one to `lengths`, or cut it."
            )
        self.bucket_lengths = tuple(bounds)
        self.batch_size, self.shuffle, self.pad = batch_size, shuffle, pad
        # Each sample's bucket; the shuffle's seed, from the key's bits; the pass.
        self._bucket: np.ndarray = np.searchsorted(np.asarray(bounds), self._lengths)
        self._seed: np.ndarray | None = None
        if key is not None:
            self._seed = np.asarray(jax.random.key_data(_key(key))).ravel()
        self._epoch: int = 0

    def set_epoch(self, epoch: int) -> None:
        """The pass the next iteration makes (`fit` calls it before each)."""
        self._epoch = int(epoch)

    def __len__(self) -> int:
        """Batches a pass."""
        sizes = np.bincount(self._bucket, minlength=len(self.bucket_lengths))
        return int(sum(-(-int(n) // self.batch_size) for n in sizes))

    def shapes(self) -> list[tuple[tuple[int, ...], ...]]:
        """Each bucket's batch shapes, a sample's of each array (the mask's last): what
        `eqfit.plan` lists, a program each.
        """
        out = []
        for length in self.bucket_lengths:
            row = []
            for field, ragged in zip(self._fields, self._ragged):
                rest = np.shape(field[0])[1:]
                row.append((length, *rest) if ragged else tuple(rest))
            out.append((*row, (length,)))
        return out

    def fingerprint(self) -> str:
        """What tells its batches from another `Buckets`' of the same shapes, for a run's
        checkpoints (a resumed run must read the same): its key, lengths, batch size,
        shuffle and padding, its samples' lengths, and a few samples spread over them.
        """
        digest = hashlib.blake2b(digest_size=8)
        seed = None if self._seed is None else self._seed.tolist()
        head = (seed, self.bucket_lengths, self.batch_size, self.shuffle, repr(self.pad))
        digest.update(repr(head).encode())
        digest.update(self._lengths.tobytes())
        picked = np.linspace(0, len(self._lengths) - 1, min(len(self._lengths), 64))
        for field in self._fields:
            for i in np.unique(picked.astype(np.intp)):
                digest.update(np.ascontiguousarray(field[i]).tobytes())
        return digest.hexdigest()

    def order(self) -> list[tuple[int, np.ndarray]]:
        """This pass's batches: each its bucket and its samples' indices (shorter than
        `batch_size` for a bucket's last).
        """
        rng = None
        if self.shuffle:
            assert self._seed is not None
            rng = np.random.default_rng([*self._seed.tolist(), self._epoch])
        batches = []
        for b in range(len(self.bucket_lengths)):
            members = np.flatnonzero(self._bucket == b)
            if rng is not None:
                members = rng.permutation(members)
            for start in range(0, len(members), self.batch_size):
                batches.append((b, members[start : start + self.batch_size]))
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        for b, samples in self.order():
            yield self.batch(self.bucket_lengths[b], samples)

    def batch(self, length: int, samples: np.ndarray) -> tuple[np.ndarray, ...]:
        """The samples padded to `length` (and with rows of padding to `batch_size`),
        each field, then the mask.
        """
        size = self.batch_size
        mask = np.zeros((size, length), np.float32)
        out = []
        for field, ragged in zip(self._fields, self._ragged):
            if ragged:
                first = field[samples[0]]
                padded = np.full((size, length, *first.shape[1:]), self.pad, first.dtype)
                for row, i in enumerate(samples):
                    padded[row, : len(field[i])] = field[i]
            else:
                rows = field[samples]
                padded = np.zeros((size, *rows.shape[1:]), rows.dtype)
                padded[: len(samples)] = rows
            out.append(padded)
        for row, i in enumerate(samples):
            mask[row, : self._lengths[i]] = 1.0
        return (*out, mask)


def _bounds(lengths: Any) -> list[int]:
    """`lengths` checked: increasing whole numbers, 1 or more (a float is refused, not
    cut to an int).
    """
    given = list(lengths) if isinstance(lengths, list | tuple | np.ndarray) else None
    bounds = None if given is None or np.ndim(lengths) != 1 else [as_int(n) for n in given]
    if not bounds or any(isinstance(n, bool) or not isinstance(n, int) for n in bounds):
        raise TypeError(
            "`Buckets`'s `lengths` must be a sequence of bucket lengths, increasing whole "
            f"numbers such as `(16, 32, 64)`; got {lengths!r}."
        )
    if any(n < 1 for n in bounds) or bounds != sorted(set(bounds)):
        raise ValueError(
            f"`Buckets`'s `lengths` must be increasing lengths of 1 or more, got {lengths!r}."
        )
    return bounds


def _field(field: Any, i: int) -> list[np.ndarray] | np.ndarray:
    """A field as a list of numpy arrays (sequences) or one numpy array (a row a sample)."""
    if isinstance(field, list | tuple):
        arrays = [np.asarray(a) for a in field]
        if any(a.ndim == 0 for a in arrays):
            raise ValueError(
                f"`Buckets`'s field {i} holds a scalar: a sequence's array has its length "
                "first (`(length, ...)`); give a field of one value per sample as an array."
            )
        _check_samples(arrays, i)
        return arrays
    array = np.asarray(field)
    if array.ndim == 0:
        raise ValueError(f"`Buckets`'s field {i} is a scalar: give one entry per sample.")
    return array


def _sample_lengths(fields: list[Any], ragged: list[bool]) -> np.ndarray:
    """Each sample's length, the same in every field of sequences (refused otherwise)."""
    per_field = [np.array([len(a) for a in f]) for f, r in zip(fields, ragged) if r]
    for other in per_field[1:]:
        differ = np.flatnonzero(other != per_field[0])
        if differ.size:
            i = int(differ[0])
            raise ValueError(
                f"`Buckets`: sample {i} has sequences of lengths {int(per_field[0][i])} and "
                f"{int(other[i])} in two fields: a sample's sequences share their length."
            )
    return per_field[0]


def _key(key: Any) -> Key[Array, ""]:
    """`key` as a typed PRNG key, refused with `Buckets`'s name."""
    try:
        return as_key(key)
    except TypeError as e:
        raise TypeError(f"`Buckets`'s {e}") from None


def _check_samples(arrays: list[np.ndarray], i: int) -> None:
    """Refuses a field of sequences whose samples differ past their length (a token of
    3 features among tokens of 2) or in dtype: one batch holds them in one array.
    """
    if not arrays:
        return
    first = arrays[0]
    for j, a in enumerate(arrays):
        if a.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"`Buckets`'s field {i}: sample {j} has shape {a.shape}, sample 0 "
                f"{first.shape}: a field's sequences may differ in length (their first axis) "
                f"only; each of its tokens must have shape {first.shape[1:]}."
            )
        if a.dtype != first.dtype:
            raise TypeError(
                f"`Buckets`'s field {i}: sample {j} is {a.dtype}, sample 0 {first.dtype}: a "
                "field's samples share one dtype (a batch holds them in one array, and would "
                "take its first sample's, cutting floats to ints); convert them to one, such "
                "as `[np.asarray(s, np.float32) for s in field]`."
            )
