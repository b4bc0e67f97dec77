"""`evaluate`: a model's loss and metrics over data in batches, one compiled scan over
the data in memory, or over each chunk of data streamed as training streams it
(memmaps, loaders).
"""

import dataclasses
import functools
from typing import Any, Literal

import jax
import numpy as np

from ._core._checks import checked, reported_as
from ._core._data import as_data, as_key, batch_calls, check_alive, check_batch_size, num_samples
from ._core._execution import Execution
from ._core._metric import tried
from ._core._typing import ArrayTree, Data, Loss, Metrics, ModelState, PRNGKey
from ._host._feeds import inference_chunks
from ._host._inference import EXECUTION_HINTS, inference_execution, inference_source
from ._host._loader import Loader
from ._host._open import first_rows
from ._host._sources import Memmaps
from ._program._build import check_additive, SPLIT_ROWS
from ._program._jit import cached_jit
from ._program._state import OnDevice, Releases
from ._step._evaluate import add_batches, add_chunk, evaluate_batches
from ._step._labels import LabelError, raise_found
from ._step._objective import find_outputs, Objective
from ._step._precision import as_precision, PrecisionLike
from ._step._record import Record
from ._step._signatures import takes_key
from ._step._statistics import accumulated_shapes, grouped
from ._step._validation import refuse_sets
from .metrics import _taken


@checked("evaluate", EXECUTION_HINTS)
def evaluate(
    model: ArrayTree,
    data: Data,
    *,
    loss: Loss,
    metrics: Metrics | None = None,
    batch_size: int = 256,
    state: ModelState | None = None,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
    execution: Execution | Literal["auto"] = "auto",
) -> dict[str, Any]:
    """The loss and metrics of `model` over all of `data`, in batches, in inference mode.

    Each batch's value is weighted by its size, so for a loss that is a mean over the
    batch's examples the result equals the full-batch value, without its memory. A value
    that is an `eqfit.Mean` (a masked or token-weighted loss) is the sum of its totals
    over the sum of its weights, the whole data's weighted mean (NaN if they sum to 0).

    **Arguments:**

    - `model`: the model, as `fit` takes it.
    - `data`: what `fit`'s `data` takes: a tuple of arrays sharing their leading axis (or
        another PyTree of them); the same with `np.memmap` arrays; or a loader (a
        re-iterable, an iterator or a generator of batches, read once, each batch a
        step's arguments after the model). Memmaps and loaders are streamed as `fit`
        streams them, in chunks read in a background thread while the device computes:
        memory holds a few chunks, however large the data.
    - `loss`: `loss(model, *batch)`, or `loss(model, state, *batch) -> (value, state)`.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar` (with `state`,
        `fn(model, state, *batch)`), or metrics that accumulate
        (`eqfit.metrics.AbstractMetric`), their statistics summed over every batch.
    - `batch_size`: examples per batch (a loader's batches are its own).
    - `state`: the model's `eqx.nn.State`, for stateful models.
    - `precision`: as `fit`'s: the loss and metrics compute under this policy.
    - `key`: for a loss (or model) that requires a keyword `key`, as `fit`'s validation
        passes one: batch `b` (counted from 0) gets `jax.random.fold_in(key, b)`. By
        default every batch gets `jax.random.key(0)`. A loss whose `key` has a default
        gets none, in inference as in `fit`'s validation.
    - `execution`: as `predict`'s: one program over every batch ([`eqfit.WholeRun`][]),
        or programs of `unroll` batches called from Python ([`eqfit.PerStep`][]); by
        default `PerStep(1)` where the loss or a metric convolves on the CPU backend.

    **Returns:**

    `{"loss": ..., **{name: ...}}` as plain floats: the loss, the aux values it returns
    (see `fit`'s `loss`), and the metrics; a metric whose value is an array (a
    confusion matrix) as a numpy array.
    """
    refuse_sets(data, "data", "evaluate")
    check_alive(model=model, data=data, state=state)
    check_batch_size(batch_size)
    source = inference_source(data, "data")
    data_ = as_data(data) if source is None else None
    objective = Objective(
        loss,
        tuple(_taken(metrics).items()),
        state is not None,
        takes_key(loss),
        precision=as_precision(precision, model=model),
    )
    with reported_as("evaluate", "data"):
        # A batch's shape, for the loss's outputs: a loader's batches are its own.
        shapes, size = data_, batch_size
        if isinstance(source, Memmaps):
            shapes = source.data
        elif isinstance(source, Loader):
            shapes, size = source.first, source.batch_size
        batch = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((min(size, a.shape[0]), *a.shape[1:]), a.dtype),
            shapes,
        )
        outputs = find_outputs(objective, model, state, batch)
        objective = dataclasses.replace(objective, aux_names=outputs.aux_names, means=outputs.means)
        if objective.accumulating:
            objective = dataclasses.replace(
                objective, statistics_like=objective.find_statistics(model, state, batch)
            )
            if tried(objective.metrics):
                rows = first_rows(data_ if source is None else source, SPLIT_ROWS)
                check_additive(objective, model, state, rows)
        key_ = None if key is None else as_key(key)

        def convolves() -> bool:
            if outputs.convolves is not None:
                return outputs.convolves
            return bool(find_outputs(objective, model, state, batch, always=True).convolves)

        chosen = inference_execution(execution, convolves)
        if source is not None:
            values_, labels = _evaluate_streamed(
                (objective, model, state, source, batch_size, key_), chosen
            )
        else:
            args = (objective, model, state, data_, batch_size, key_)
            values_, labels = chosen.batches(
                functools.partial(_evaluate, *args), functools.partial(_evaluate_in_calls, args)
            )
        values = np.asarray(values_).tolist()
    if labels is not None:
        raise_found(labels)
    # Named and grouped as a run's record names and groups an epoch's values.
    record = Record(
        accumulated=accumulated_shapes(objective.accumulating, objective.statistics_like)
    )
    names = (*objective.value_names, *record.accumulated_names)
    return grouped(dict(zip(names, values)), record.array_values(None))


_evaluate = cached_jit(evaluate_batches)
_add_batches = cached_jit(add_batches)
_add_chunk = cached_jit(add_chunk)


def _chunk_scanned(args: tuple[Any, ...], chunk: OnDevice, totals: Any, labels: Any) -> Any:
    """A streamed `chunk`'s batches added to `totals` and `labels` by one program."""
    objective, model, state, _, _, key = args
    valid = np.asarray(chunk.valid, np.int32)
    return _add_chunk(
        objective, model, state, chunk.data, chunk.batch_size, key, chunk.offset, valid,
        totals, labels,
    )  # fmt: skip


def _chunk_in_calls(
    args: tuple[Any, ...], chunk: OnDevice, totals: Any, labels: Any, unroll: int
) -> Any:
    """A streamed `chunk`'s batches added to `totals` and `labels` by programs of
    `unroll` batches (`add_batches`), called one after another.
    """
    objective, model, state, _, _, key = args
    size, valid = chunk.batch_size, np.asarray(chunk.valid, np.int32)
    for b, count in chunk.calls(unroll):
        totals, labels = _add_batches(
            objective, model, state, chunk.data, size, key, np.asarray(b, np.int32), count,
            False, totals, labels, chunk.offset, valid,
        )  # fmt: skip
    return totals, labels


def _evaluate_in_calls(args: tuple[Any, ...], unroll: int) -> tuple[Any, LabelError | None]:
    """`evaluate_batches`' values and label error, as programs of `unroll` full batches
    then one of the smaller last batch (`add_batches`), called one after another.
    """
    objective, model, state, data, batch_size, key = args
    totals, labels = _nothing_yet(objective)
    for b, count, remainder in batch_calls(num_samples(data), batch_size, unroll):
        first = np.asarray(b, np.int32)  # an array: traced, one program for every call
        totals, labels = _add_batches(
            objective, model, state, data, batch_size, key, first, count, remainder, totals, labels
        )
    return objective.quotient(totals), labels


def _evaluate_streamed(args: tuple[Any, ...], chosen: Execution) -> tuple[Any, LabelError]:
    """`evaluate_batches`' values and label error over streamed data: each chunk's
    batches added to the totals as the chunk arrives, as `chosen` runs them
    (`Execution.batches`): by one program of the chunk's shape (`add_chunk`), or by
    programs of a few batches (`add_batches`).
    """
    objective, _, _, source, batch_size, _ = args
    totals, labels = _nothing_yet(objective)
    with inference_chunks(source, batch_size) as chunks:
        done = Releases()
        for chunk in chunks:
            totals, labels = chosen.batches(
                functools.partial(_chunk_scanned, args, chunk, totals, labels),
                functools.partial(_chunk_in_calls, args, chunk, totals, labels),
            )
            done.computed(chunk, totals)
        done.computed()
    return objective.quotient(totals), labels


def _nothing_yet(objective: Objective) -> tuple[Any, Any]:
    """The totals and the label error before any batch: zeros, and none found."""
    totals = np.zeros((2, objective.width), np.float32)
    return totals, jax.tree.map(np.asarray, LabelError.none())
