"""The training state's types: what a run carries from step to step and call to call,
what it reads and never changes, and what each call reports to the host. All PyTrees of
arrays, with named fields.
"""

import contextlib
import enum
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Key, PyTree, UInt32

from .._core._data import batch_calls
from .._core._early_stopping import StoppingState
from .._core._metric import MetricLike
from .._step._labels import LabelError
from .._step._precision import LossScale
from .._step._validation_steps import Validations


class Stop(enum.IntEnum):
    """Why the program stopped a run (a member, in an ensemble): reported as a value."""

    RUNNING = 0  # not stopped: it reached the call's stop, or the run's end
    EARLY_STOPPING = 1
    NON_FINITE_LOSS = 2
    BAD_LABEL = 3  # a label out of range made the loss non-finite


# The reasons that say a run stopped at a step whose loss was not finite.
NON_FINITE_STOPS = (Stop.NON_FINITE_LOSS, Stop.BAD_LABEL)


def stopped_at_non_finite(reason: Any) -> bool:
    """Whether a state's `reason` (an ensemble's: any member's) is one of
    `NON_FINITE_STOPS`.
    """
    return bool(np.isin(np.asarray(reason), NON_FINITE_STOPS).any())


class Callables(NamedTuple):
    """What the run calls: the metrics, the schedules whose values it records, and its
    updates (`fit`'s `loss=` and `optimizer=` one, unnamed, with a plain optimizer),
    whose losses validation computes (`_updates.run_loss`).
    """

    metrics: tuple[tuple[str, MetricLike], ...]
    schedules: tuple[tuple[str, Callable[[Any], Any]], ...]
    updates: tuple[Any, ...]  # `AbstractUpdate`s


class Consts(NamedTuple):
    """Arrays the run reads but never changes: the model's frozen ones, and any that the
    loss, metrics, optimizer or early stopping hold.
    """

    frozen: list[Array]
    objects: list[Array]


class StartArgs(NamedTuple):
    """The arguments of the program that makes the training state (`_start.start`)."""

    params: list[Array]  # the model's arrays that train, in order
    opt_state: PyTree | None  # given to continue from, else made by the optimizer
    model_state: PyTree
    key: Key[Array, ""]
    consts: Consts
    begin: Int[ArrayLike, ""]  # the run's first step (`Schedule.begin`)


class TrainState(NamedTuple):
    """Everything a run carries from step to step and from call to call; all arrays.

    With an ensemble every field has a leading member axis.
    """

    params: PyTree  # the arrays that train, in the model's structure (`Loop.params_tree`)
    opt_state: PyTree
    model_state: PyTree
    average: PyTree  # their moving average, laid out as they are (`None` without `ema=`)
    # With a precision policy that scales the loss (float16): its scale; with several
    # updates, each loss's update's, by name.
    loss_scale: LossScale | dict[str, LossScale] | None
    stopping: StoppingState | None
    step: Int[Array, ""]  # optimizer steps done since the first epoch ever: the position
    # The run's first step (`Schedule.begin`), that of row 0 of its record: the programs
    # are compiled for a run's shape, not its extent (`Schedule.shaped_for_programs`).
    first: Int[Array, ""]
    reason: Int[Array, ""]  # a `Stop`: why the run stopped, if it did
    nan_step: Int[Array, ""]  # the first step whose loss was not finite, or -1
    label_error: LabelError  # the first label out of range met, if any
    # One row per epoch of this run:
    step_loss: Float[Array, "epochs steps"]  # NaN where no step ran
    step_values: Float[Array, "epochs steps values"]  # the record's columns (`Record`)
    batch_sizes: Int[Array, "epochs steps"]  # 0 where no step ran
    epoch_values: Float[Array, "epochs logs"]  # `Loop.log_names` of each finished epoch
    # The epoch in progress: its finite steps' losses weighted by their batch sizes,
    # summed, and the sizes summed (for the bar; the epoch's value is `epoch_values`').
    running: Float[Array, "2"]
    validations: Validations | None = None  # with `validation_every=`
    # The epoch in progress: each accumulating metric's statistics of its finite steps,
    # summed (`eqfit.metrics.AbstractMetric`); `()` without such metrics.
    statistics: tuple[PyTree, ...] = ()


def running(state: TrainState) -> Bool[Array, ""]:
    """Whether the run (this member) has not stopped."""
    return state.reason == Stop.RUNNING


def strongly_typed(state: TrainState) -> TrainState:
    """`state` with each weakly typed array made strongly typed, its dtype kept: the types
    of the state `start` makes and each program returns. An update hands its arrays back
    strongly typed (optax's arithmetic with the gradient), so a weakly typed one (Equinox's
    `PReLU(0.2)` holds `jnp.asarray(0.2)`; gymnax's states hold many) would change type
    after the first call, and the next call would trace and compile its program again.
    """

    def strong(x: Any) -> Any:
        # A conversion only where a type changes: on the others, no equation at all.
        return jax.lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x

    return jax.tree.map(strong, state)


class Piece(NamedTuple):
    """A piece of streamed data: the rows of consecutive batches, all of the program's
    `Loop.batch_size`. Step `t` (a global step, `first <= t < end`) takes rows
    `order[(t - first) * batch_size:]`. Made on the host (numpy), then placed.
    """

    order: UInt32[ArrayLike, " rows"]
    first: Int[ArrayLike, ""]  # the global step of its first batch
    end: Int[ArrayLike, ""]  # the global step after its last batch


class Inputs(NamedTuple):
    """The arrays a run reads but never changes (never donated)."""

    data: PyTree
    val_data: PyTree
    key: Key[Array, "*members"]
    consts: Consts
    piece: Piece | None = None  # streamed data: where `data` sits in the run


class CallEnd(NamedTuple):
    """How far a call of a `PerStep` program goes, from the host: the step it stops at
    (if nothing stops the run before), and whether it begins a call of the drive (whose
    record of steps, while the epoch's length is learned, it starts afresh).
    """

    stop: Int[ArrayLike, ""]
    fresh: Bool[ArrayLike, ""]


class ValAt(NamedTuple):
    """Where a call of a `PerStep` run's validation begins, from the host: the batch of
    the set (counted from 0; of the chunk, for a streamed set's), and the epoch
    validated; for a streamed set's chunk (`OnDevice`), its `offset` and `valid`.
    """

    batch: Int[ArrayLike, ""]
    epoch: Int[ArrayLike, ""]
    offset: Int[ArrayLike, ""] | None = None
    valid: Int[ArrayLike, ""] | None = None


class OnDevice(NamedTuple):
    """A chunk of data streamed to an inference (`evaluate`, `predict`, a streamed
    validation set), on the device.
    """

    data: PyTree  # full batches of `batch_size`, padding after the first `valid`
    offset: np.ndarray  # the number of its first batch in the data (int32, traced)
    valid: int  # its batches that are the data's
    batch_size: int
    # Call once the programs given `data` are done with it: memmaps read in place drop
    # its pages then.
    release: Callable[[], None]

    def calls(self, unroll: int) -> list[tuple[int, int]]:
        """The programs that add up its batches `unroll` a call, written out, as `PerStep`
        runs them (`batch_calls`), as `(first, count)`.
        """
        rows = self.valid * self.batch_size
        return [(b, count) for b, count, _ in batch_calls(rows, self.batch_size, unroll)]


class Releases:
    """Each streamed chunk of an inference released (`OnDevice.release`) once what was
    computed from it is ready: a chunk behind the one just given to the device, which
    meanwhile computes.
    """

    def __init__(self) -> None:
        self.pending: tuple[OnDevice, Any] | None = None

    def computed(self, chunk: OnDevice | None = None, outputs: Any = None) -> None:
        """`chunk` gave `outputs`; without one, the last is done with."""
        if self.pending is not None:
            jax.block_until_ready(self.pending[1])
            self.pending[0].release()
        self.pending = None if chunk is None else (chunk, outputs)


# How a run whose validation streams reads a set: `read(i, batch_size)` opens set `i`'s
# pass, its chunks placed on the run's devices as they are read (in a background thread
# that leaving the block stops).
ReadSet = Callable[[int, int], contextlib.AbstractContextManager[Iterator[OnDevice]]]


class ValSums(NamedTuple):
    """A validation set's sums so far, in a `PerStep` run's validation, batch by batch:
    each value's total and weight (`_evaluate.batch_totals`), whose quotient is its mean,
    and the first label out of range met.
    """

    totals: Float[ArrayLike, "*members 2 values"]
    label_error: LabelError


class Steps(NamedTuple):
    """The record of one call's steps, while the epoch's length is learned: column
    `t % Schedule.columns` holds step `t`'s (NaN, or 0 for sizes, where none ran).
    """

    loss: Float[ArrayLike, "*members steps"]
    values: Float[ArrayLike, "*members steps values"]
    batch_sizes: Int[ArrayLike, "*members steps"]


class Report(NamedTuple):
    """What a call of the run's program tells the host, read once it is due."""

    step: Int[Array, "*members"]  # the position after the call
    reason: Int[Array, "*members"]  # a `Stop`
    nan_step: Int[Array, "*members"]
    label_error: LabelError
    best_epoch: Int[Array, "*members"]  # by early stopping; -1 without it
    # The mean loss of the epoch in progress so far (NaN at its start).
    epoch_loss: Float[Array, "*members"]
    epoch_values: Float[Array, "*members epochs logs"]  # NaN for epochs not finished
    # With `restore_best`: the trained arrays, model state and average to return.
    trained: tuple[PyTree, PyTree, PyTree] | None
    steps: Steps | None = None  # while the epoch's length is learned: this call's steps
    # With `log_every=n`: the training values of the n steps before each n-th step of the
    # run, a row each (`(begin // n + r + 1) * n` is row `r`, `begin` the run's first
    # step), NaN for one not reached.
    logs: Float[Array, "*members rows values"] | None = None
    validations: Validations | None = None  # with `validation_every=`: the state's


class Taken(NamedTuple):
    """What the host reads of each call's report as it takes it (`_drive._Reader`), beside
    what it reads only when due (the n-th steps' values, the validations).
    """

    step: Int[ArrayLike, "*members"]
    reason: Int[ArrayLike, "*members"]
    epoch_loss: Float[ArrayLike, "*members"]
    epoch_values: Float[ArrayLike, "*members epochs logs"]
    steps: Steps | None  # while the epoch's length is learned

    @staticmethod
    def of(report: Report) -> "Taken":
        return Taken(
            report.step, report.reason, report.epoch_loss, report.epoch_values, report.steps
        )


class Ending(NamedTuple):
    """What the host reads of a run at its end, in one go (`_drive.Drive.outcome`): the
    last report's, and the final state's record, for the result (`_result.py`), its
    errors and a replay.
    """

    step: Int[ArrayLike, "*members"]
    reason: Int[ArrayLike, "*members"]
    nan_step: Int[ArrayLike, "*members"]
    label_error: LabelError
    best_epoch: Int[ArrayLike, "*members"]
    epoch_values: Float[ArrayLike, "*members epochs logs"]
    step_loss: Float[ArrayLike, "*members rows steps"]
    step_values: Float[ArrayLike, "*members rows steps values"]
    batch_sizes: Int[ArrayLike, "*members rows steps"]
    validations: Validations | None

    @staticmethod
    def of(report: Report, state: TrainState) -> "Ending":
        return Ending(
            report.step,
            report.reason,
            report.nan_step,
            report.label_error,
            report.best_epoch,
            report.epoch_values,
            state.step_loss,
            state.step_values,
            state.batch_sizes,
            state.validations,
        )
