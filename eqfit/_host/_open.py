"""The open phase: the training data's source (`open_source`, and `read_again` to read
it from its start once more), the validation data, and the run's schedule from their
shape, each checked against the others.
"""

import collections.abc
import weakref
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from .._core._data import as_data, bucketed, data_kind, sample_shapes
from .._program._options import Options
from .._program._parallel import check_batch_split, global_rows
from .._program._schedule import check_profile, make_schedule, Schedule
from .._step._average import warn_if_short
from .._step._validation import naming_advice, ValidationSets
from .._step._validation_steps import AT_EPOCH_ENDS
from ._inference import Reread, StreamedSets
from ._loader import Loader
from ._sources import host_seed, InMemory, Memmaps, Source


def open_data(
    data: Any,
    validation_data: Any,
    options: Options,
    planning: bool = False,
    directory: Any = None,
) -> tuple[Source, PyTree | None]:
    """The training data's source, less the rows held out for validation (if asked), and
    the validation data (with named sets, `{name: set}`), each set checked to be like the
    training data. `planning`, `directory`: `open_source`'s.
    """
    source = open_source(data, options, planning=planning, directory=directory)
    like = sample_shapes(source.like)
    buckets = bucketed(data)  # a sample's lengths are its bucket's: compared by axes alone
    if options.validation is not None and options.validation.streamed:
        return source, _streamed_sets(validation_data, like, planning, buckets)
    if isinstance(validation_data, ValidationSets):
        sets = {}
        for name, given in validation_data.items():
            sets[name] = as_data(given, f"validation_data[{name!r}]")
            _refuse_unlike(sample_shapes(sets[name]), like, name, buckets)
        return source, sets
    if _several_datasets(validation_data, like):
        raise ValueError(
            "`validation_data` must hold arrays like `data`'s, but it is a tuple of "
            f"{len(validation_data)} datasets, each like `data`: a tuple is one dataset, of "
            f"nested arrays. {naming_advice(len(validation_data), 'tuple')}"
        )
    val = None
    if validation_data is not None:
        val = as_data(validation_data, "validation_data")
    elif options.validation_split is not None:
        source, val = source.hold_out(options.validation_split, options.key)
    if val is not None:
        _refuse_unlike(sample_shapes(val), like, None, buckets)
    return source, val


def _refuse_unlike(
    got: list[list[Any]], like: list[list[Any]], name: str | None = None, buckets: bool = False
) -> None:
    """Refuses a validation set (set `name` of `ValidationSets`, or the one) whose samples
    (`got`) are not like `data`'s (`like`): path, shape of one sample, dtype (with
    `buckets`, where either is in buckets, the number of a sample's axes for its shape).
    """
    if got == like or (buckets and _axes(got) == _axes(like)):
        return
    subject = "`validation_data`" if name is None else f"`validation_data`'s set {name!r}"
    what = "validation_data" if name is None else f"validation_data[{name!r}]"
    raise ValueError(
        f"{subject} must hold arrays like `data`'s, one sample apart: `data`'s samples have "
        f"{like}, `{what}`'s {got} (path, shape of one sample, dtype)."
    )


def _axes(shapes: list[list[Any]]) -> list[list[Any]]:
    """`sample_shapes`' rows with each shape as its number of axes: samples of buckets."""
    return [[path, len(shape), dtype] for path, shape, dtype in shapes]


def _streamed_sets(
    validation_data: Any, like: list[list[Any]], planning: bool, buckets: bool
) -> StreamedSets:
    """The validation sets of a run whose validation streams, each opened and checked to
    be like the training data (`like`, its sample shapes). An iterator that `eqfit.plan`
    read from is refused, and one it reads from now remembered (`planning`).
    """
    if isinstance(validation_data, ValidationSets):
        named: list[tuple[str | None, Any]] = list(validation_data.items())
    else:
        named = [(None, validation_data)]
    sets = []
    for name, given in named:
        what = "validation_data" if name is None else f"validation_data[{name!r}]"
        refuse_planned(given, what)
        opened = Reread(given, what)
        if planning:
            remember_planned(given)
        _refuse_unlike(sample_shapes(opened.like), like, name, buckets or bucketed(given))
        sets.append(opened)
    return StreamedSets(tuple(sets))


def _several_datasets(validation_data: Any, like: list[list[Any]]) -> bool:
    """Whether `validation_data` is a tuple of datasets each like `data` (whose samples
    are `like`), rather than one dataset like it.
    """
    if not isinstance(validation_data, tuple) or len(validation_data) < 2:
        return False
    if not all(isinstance(part, tuple | dict) for part in validation_data):
        return False
    try:
        shapes = [sample_shapes(part) for part in validation_data]
    except AttributeError:  # leaves that are not arrays: the data's own check says so
        return False
    return all(s == like for s in shapes) and sample_shapes(validation_data) != like


def schedule_for(source: Source, options: Options) -> Schedule:
    """The run's schedule: the source's shape (every process's rows, over a mesh of
    several) and the options, checked against each other.
    """
    shape = source.shape()
    if shape.batch_size is not None:  # a loader makes its own batches
        if options.drop_remainder:
            raise ValueError(
                "`drop_remainder=True` with a loader: a loader makes its own batches, so drop "
                "its smaller last batch there (PyTorch: `DataLoader(..., drop_last=True)`)."
            )
        if options.batch_size_given and options.batch_size != shape.batch_size:
            raise ValueError(
                f"`batch_size`={options.batch_size}, but the loader yields batches of "
                f"{shape.batch_size}: leave `batch_size` out, or set it to the loader's."
            )
    shape = shape._replace(num_samples=global_rows(options.placement, shape.num_samples))
    schedule = make_schedule(shape, options)
    check_batch_split(options.placement, schedule.batch_size, options.step.microbatches)
    check_profile(options, schedule)
    if not schedule.learning:
        warn_if_short(options.step.average, schedule.total - schedule.begin)
    _check_every(options, schedule)
    return schedule


def _check_every(options: Options, schedule: Schedule) -> None:
    """Refuses a `log_every` or `validation_every` that the run's steps are not known
    for (a loader without `len`), or that no step of the run reaches: it would log or
    validate nothing, without a word.
    """
    steps = AT_EPOCH_ENDS if options.validation is None else options.validation.steps
    for name, n, kept, does, instead in (
        ("log_every", options.log_every, "the values every n steps are", "log a value", ""),
        *steps.length_checks(),
    ):
        if n is None:
            continue
        if schedule.learning:
            raise ValueError(
                f"`{name}={n}` with a loader that does not say its length (no `len`): "
                "the run's steps are not known before its first epoch ends, and "
                f"{kept} kept for the run's length. Pass `steps_per_epoch=`."
            )
        if n > schedule.total:
            epochs = schedule.total // schedule.steps_per_epoch
            raise ValueError(
                f"`{name}={n}`, but this run has {schedule.total} steps ({epochs} epochs of "
                f"{schedule.steps_per_epoch} steps, counted from the first ever): it would never "
                f"{does}. Give `{name}` of at most {schedule.total}{instead}."
            )


def first_rows(source: Any, n: int) -> PyTree:
    """Up to `n` of the data's first rows, for a check that needs real ones (a metric's
    statistics, halved, `check_additive`): a source's, or arrays' in memory.
    """
    if isinstance(source, Memmaps):
        return source.read(0, min(n, source.num_samples))
    if isinstance(source, Loader):
        data = source.first
    else:
        data = source.data if isinstance(source, InMemory) else source
    return jax.tree.map(lambda a: a[:n], data)


def open_source(
    data: Any, options: Options, planning: bool = False, directory: Any = None
) -> Source:
    """The source of `data`: arrays in memory, memmaps, or a loader. `planning`: for
    `eqfit.plan`, which remembers a one-shot iterator it reads from, for `fit` to refuse.
    `directory`: the run's checkpoints (`None`: none), whose newest may keep a loader's
    epoch length.
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
    return open_source(source.loader, options, directory=source.directory)


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
