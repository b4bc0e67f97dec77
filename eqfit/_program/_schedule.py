"""The run's shape, decided once: batch size, passes, epochs, steps, where calls may end.

Every other module asks the `Schedule` where a step falls (its epoch, its pass, the next
epoch's end), so the arithmetic from steps to epochs lives here and nowhere else. Steps are
counted globally from the first epoch ever (`initial_epoch` included), so that shuffles,
per-step keys and epoch numbers go on across a resumed or continued run. Its methods work
on Python integers and on traced JAX integers alike, so the program asks them too.
"""

import dataclasses
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from ._options import Options


_Int = TypeVar("_Int")  # a Python int, or a traced integer inside the program


def _div(position: Any, steps: int) -> Any:
    """`position // steps` for a position or step index (never negative). On a JAX
    integer, `lax.div`: for non-negative operands truncation is floor division, and it
    traces to one operation where `//` on signed integers traces to eight.
    """
    if isinstance(position, jax.Array):
        return jax.lax.div(position, jnp.asarray(steps, position.dtype))
    return position // steps


def _mod(position: Any, steps: int) -> Any:
    """`position % steps` for a position (never negative), as `_div`."""
    if isinstance(position, jax.Array):
        return jax.lax.rem(position, jnp.asarray(steps, position.dtype))
    return position % steps


# The `steps_per_epoch` of a run whose epoch's length is learned from its first epoch,
# while that epoch trains: no step reaches an epoch's end before the length is known.
UNKNOWN = 2**31 - 1


class SourceShape(NamedTuple):
    """What a source says of its shape, before any batch is trained on."""

    num_samples: int | None  # rows per pass (arrays and memmaps); None for a loader
    batch_size: int | None  # a loader's own batch size (its first batch's)
    batches: int | None  # a loader's batches per pass, where it says (`len`)
    steps_per_chunk: int | None = None  # a loader's most batches in one chunk


class Passes(NamedTuple):
    """How one pass over `num_samples` rows splits into batches: `num_full` full ones, then
    one of `remainder` rows (0: none). Hashable: it is part of a compiled program.
    """

    num_samples: int
    batch_size: int
    num_full: int
    remainder: int

    @property
    def steps_per_pass(self) -> int:
        return self.num_full + (self.remainder > 0)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The run's shape: made once by `make_schedule`, then only asked.

    **Attributes:**

    - `batch_size`: samples per full step.
    - `steps_per_epoch`: optimizer steps in an epoch.
    - `first_epoch`: epochs done before this run (`initial_epoch`).
    - `epochs`: the number of the run's last epoch, counted from 1.
    - `passes`: how a pass over rows the program (or the memmap reader) orders splits
        into batches; `None` for a loader, which makes its own batches.
    - `columns`: the steps each epoch's row of the run's record holds: `steps_per_epoch`,
        but while a loader's first epoch teaches its length (`steps_per_epoch` is then
        `UNKNOWN`), the most steps of one call, the host keeping each call's steps.
    - `shaped`: whether this is a program's schedule (`shaped_for_programs`): the run's
        extent left out, `epochs` the rows its record holds, `first_epoch` 0.
    """

    batch_size: int
    steps_per_epoch: int
    first_epoch: int
    epochs: int
    passes: Passes | None = None
    columns: int = 0  # 0: `steps_per_epoch`
    shaped: bool = False

    def __post_init__(self) -> None:
        if not self.columns:
            object.__setattr__(self, "columns", self.steps_per_epoch)

    @property
    def learning(self) -> bool:
        """Whether the epoch's length is still to be learned from the first epoch."""
        return self.steps_per_epoch == UNKNOWN

    def learned(self, steps_per_epoch: int) -> "Schedule":
        """The schedule once the first epoch has shown its length."""
        assert self.learning and self.first_epoch == 0 and not self.shaped
        return Schedule(self.batch_size, steps_per_epoch, 0, self.epochs)

    def shaped_for_programs(self) -> "Schedule":
        """The schedule as the run's programs are compiled for it: its shape (the batch,
        the epoch's length, the passes) without its extent (`first_epoch`, `epochs`), the
        record's rows rounded up (`record_capacity`). Runs of one configuration whose
        extents differ share its programs, which read where a run begins from the state
        (`TrainState.first`), and stop where the drive's calls stop: its `begin` and
        `total` are not the run's, and nothing in a program asks them.
        """
        if self.shaped:
            return self
        rows = record_capacity(self.rows)
        return Schedule(
            self.batch_size, self.steps_per_epoch, 0, rows, self.passes, self.columns, True
        )

    @property
    def begin(self) -> int:
        """The global step the run starts at."""
        return self.first_epoch * self.steps_per_epoch

    @property
    def total(self) -> int:
        """The global step the run ends at (while learning the epoch's length: none)."""
        if self.learning:
            return UNKNOWN
        return max(self.epochs, self.first_epoch) * self.steps_per_epoch

    @property
    def rows(self) -> int:
        """Epochs in the run's record: those of this run, and one to trace with if none;
        of a program's schedule, the rows its record holds.
        """
        return max(self.epochs - self.first_epoch, 1)

    # -- Steps and epochs. A position is a global step count: the steps done so far.

    def epoch_of(self, step: _Int) -> _Int:
        """The epoch, counted from 1, that the step at index `step` belongs to."""
        return _div(step, self.steps_per_epoch) + 1

    def epochs_ended(self, position: _Int) -> _Int:
        """How many epochs have ended (counted from the first ever) at `position`."""
        return _div(position, self.steps_per_epoch)

    def epochs_begun(self, position: int) -> int:
        """How many epochs had at least one step by `position` (a cut-short one counts)."""
        return -(-position // self.steps_per_epoch)

    def next_epoch_end(self, position: _Int, every: int = 1) -> _Int:
        """The position at which the epoch that `position` is in ends (with `every`, the
        next end of an epoch whose number `every` divides).
        """
        steps = self.steps_per_epoch * every
        return (_div(position, steps) + 1) * steps

    def multiples(self, position: _Int, n: int) -> _Int:
        """The positions up to `position` that `n` divides, but 0 (n-th steps reached)."""
        return _div(position, n)

    def multiples_run(self, n: int) -> int:
        """The n-th steps this run reaches, from its first step to its last (a table
        with a row for each: `log_every`'s, `validation_every`'s); of a program's
        schedule, the most that a run its record holds can reach, wherever it begins.
        """
        if self.shaped:
            return -(-self.rows * self.steps_per_epoch // n)
        return self.total // n - self.begin // n

    def next_multiple(self, position: _Int, n: int) -> _Int:
        """The first position after `position` that `n` divides (an n-th step's)."""
        return (_div(position, n) + 1) * n

    def is_epoch_end(self, position: int, every: int = 1) -> bool:
        """Whether an epoch ends at `position` (whose number `every` divides)."""
        return position % (self.steps_per_epoch * every) == 0

    def record_row(self, step: _Int, first: Any = None) -> _Int:
        """The row of the run's record (one per epoch of this run) that step `step`
        fills; `first`: the run's first step (`begin`; in a program, `TrainState.first`).
        """
        first = self.begin if first is None else first
        return _div(step - first, self.steps_per_epoch)

    def record_column(self, step: _Int) -> _Int:
        return _mod(step, self.columns)

    def record_cell(self, step: jax.Array, first: Any = None) -> jax.Array:
        """The cell that step `step` fills in the run's record read as one row of cells
        (its rows end to end): `record_row * columns + record_column`. Where a row holds
        an epoch, that is the step counted from the run's first (`first`, as
        `record_row`'s), with no division: XLA:CPU schedules a division's and a
        remainder's small operations apart from the step's own, which a step of a tenth
        of a millisecond feels.
        """
        first = self.begin if first is None else first
        if self.columns == self.steps_per_epoch:
            return step - first
        return self.record_row(step, first) * self.columns + self.record_column(step)

    def record_place(self, step: jax.Array, first: Any) -> tuple[jax.Array, jax.Array]:
        """`(row, column)` of the record that step `step` fills (`record_cell`'s, apart);
        `first` as `record_row`'s. Where a row holds an epoch, the row is the step's epoch
        less the run's first, each divided apart: a loop of steps computes `first`'s part
        once, outside it, and the step's division and remainder by a constant fuse into
        the kernels that write its cell (where `(step - first) // columns` would be two
        kernels of their own at every step).
        """
        if self.columns == self.steps_per_epoch:
            spe = self.steps_per_epoch
            return _div(step, spe) - _div(first, spe), _mod(step, spe)
        return self.record_row(step, first), self.record_column(step)

    def locate(self, step: int) -> tuple[int, int]:
        """`(epoch, step within it)` of the step at index `step`, both counted from 1."""
        epoch, within = epochs_and_steps(step, self.steps_per_epoch)
        return epoch + 1, within + 1

    def run_epochs(self, position: int) -> int:
        """Epochs of this run that had a step by `position` (a cut-short one counts)."""
        return self.epochs_begun(position) - self.first_epoch

    # -- Passes over the data (arrays and memmaps).

    def pass_of(self, step: _Int) -> _Int:
        assert self.passes is not None
        return _div(step, self.passes.steps_per_pass)

    @property
    def epochs_end_at_pass_ends(self) -> bool:
        """Whether every epoch ends where a pass over the data ends (an epoch is one pass,
        or several whole ones), so that no epoch ends inside a pass.
        """
        return self.passes is not None and self.steps_per_epoch % self.passes.steps_per_pass == 0

    def pass_start(self, index: _Int) -> _Int:
        assert self.passes is not None
        return index * self.passes.steps_per_pass  # type: ignore[operator]

    def remainder_step(self, index: Any) -> Any:
        """The global step of pass `index`'s smaller last batch; `None` if it has none."""
        assert self.passes is not None
        if not self.passes.remainder:
            return None
        return self.pass_start(index) + self.passes.num_full

    def samples(self, start: int, stop: int) -> int:
        """The samples of global steps `start` to `stop` (not included): each pass's
        batches, its smaller last one too; for a loader, `batch_size` a step.
        """
        passes = self.passes
        if passes is None:
            return (stop - start) * self.batch_size

        def before(step: int) -> int:  # the samples of the steps before `step`
            whole, part = divmod(step, passes.steps_per_pass)
            full = min(part, passes.num_full)
            last = passes.remainder if part > passes.num_full else 0
            per_pass = passes.num_full * passes.batch_size + passes.remainder
            return whole * per_pass + full * passes.batch_size + last

        return before(stop) - before(start)

    # -- Where the driver's calls may end.

    def call_stop(self, position: int, steps: int, *, at_epoch_ends: bool) -> int:
        """Where a call from `position` of about `steps` steps stops, before any observer
        asks for an earlier stop: with `at_epoch_ends`, at the last epoch end it reaches,
        if it reaches one (so a call never lasts much longer than `steps`).
        """
        stop = min(self.total, position + max(steps, 1))
        if at_epoch_ends:
            ended = (stop // self.steps_per_epoch) * self.steps_per_epoch
            if ended > position:
                stop = ended
        return stop


# The fewest rows a program's record holds (`record_capacity`): runs of up to this many
# epochs share one program.
MIN_RECORD_ROWS = 8


def record_capacity(rows: int) -> int:
    """The rows of the record a program is compiled with, for a run of `rows` epochs: the
    next power of two, at least `MIN_RECORD_ROWS`. Runs of one configuration share a
    program while their epochs round to the same; the record holds under twice the run's
    rows (or 8), and the host reads the run's own.
    """
    return max(MIN_RECORD_ROWS, 1 << (rows - 1).bit_length())


def make_schedule(shape: SourceShape, options: Options) -> Schedule:
    """The run's `Schedule`, from the source's shape and the checked options."""
    if shape.num_samples is None:  # a loader: its batches are the steps
        assert shape.batch_size is not None
        batch_size, passes = shape.batch_size, None
        per_epoch = options.steps_per_epoch or shape.batches
        if per_epoch is None:  # learned from the first epoch, as it trains
            assert shape.steps_per_chunk is not None
            return Schedule(batch_size, UNKNOWN, 0, options.epochs, columns=shape.steps_per_chunk)
    else:
        batch_size = options.batch_size
        passes = plan_passes(shape.num_samples, batch_size, options.drop_remainder)
        per_epoch = options.steps_per_epoch or passes.steps_per_pass
    if options.epochs * per_epoch >= 2**31:
        raise ValueError(
            f"`epochs`={options.epochs} of {per_epoch} steps each is "
            f"{options.epochs * per_epoch} steps, more than the 2**31 - 1 a run can count; "
            "train for fewer, or give a smaller `steps_per_epoch`."
        )
    return Schedule(batch_size, per_epoch, options.initial_epoch, options.epochs, passes)


def check_profile(options: Options, schedule: Schedule) -> None:
    """Refuses a `profile` that starts outside the run's steps, before anything compiles.
    A run whose epoch's length is still to be learned has no known end: only a start
    before its first step is refused then.
    """
    profile = options.profile
    if profile is None:
        return
    begin, start = schedule.begin, profile.start_step
    if schedule.learning:
        outside, steps = start < begin, f"from {begin}, to an end not known yet"
    else:
        outside = not begin <= start < schedule.total
        steps = f"{begin} to {schedule.total - 1}, {schedule.steps_per_epoch} per epoch"
    if outside:
        raise ValueError(
            f"`profile` starts at step {start}, outside this run's steps: {steps} (steps "
            "are counted from 0 from the first epoch ever, `initial_epoch`'s included). "
            "Give a `start_step` among them."
        )


def check_learnable(one_shot: bool, epochs: int) -> None:
    """Refuses, before any batch is read, a run that needs an epoch's length before the
    first epoch can show it (a loader without `len` or `steps_per_epoch`). `initial_epoch`
    and checkpoints need not: the passes before `initial_epoch` are read, the first
    teaching the length, and checkpoints are written once it is learned, and keep it.
    """
    need = None
    if one_shot and epochs > 1:
        need = (
            f"trains for `epochs`={epochs}, but it is an iterator (or generator): "
            "one pass, which eqfit cannot cut into epochs without knowing their length"
        )
    elif jax.process_count() > 1:
        need = "runs over several processes, which must agree on every epoch's end"
    if need is not None:
        raise ValueError(
            "`data` is a loader that does not say its length (no `len`), and this run "
            f"{need}. Pass `steps_per_epoch=`, the number of batches each epoch takes."
        )


def plan_passes(num_samples: int, batch_size: int, drop_remainder: bool) -> Passes:
    """Splits a pass over `num_samples` rows into full batches and one remainder batch
    (skipped with `drop_remainder`).
    """
    num_full, remainder = divmod(num_samples, batch_size)
    if drop_remainder:
        if num_full == 0:
            raise ValueError(
                f"`batch_size`={batch_size} is larger than the {num_samples} samples "
                "in `data` and `drop_remainder=True`, so no step would run."
            )
        remainder = 0
    return Passes(num_samples, batch_size, num_full, remainder)


def epochs_and_steps(position: int, steps_per_epoch: int) -> tuple[int, int]:
    """The epochs ended at `position` (a count of steps since the first epoch ever) and
    the steps since the last of them: how a checkpoint is named, and where a step falls.
    """
    return divmod(position, steps_per_epoch)
