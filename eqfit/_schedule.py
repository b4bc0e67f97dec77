"""The run's shape, decided once: batch size, passes, epochs, steps, where calls may end.

Every other module asks the `Schedule` where a step falls (its epoch, its pass, the next
epoch's end), so the arithmetic from steps to epochs lives here and nowhere else. Steps are
counted globally from the first epoch ever (`initial_epoch` included), so that shuffles,
per-step keys and epoch numbers go on across a resumed or continued run. Its methods work
on Python integers and on traced JAX integers alike, so the program asks them too.
"""

import dataclasses
from typing import Any, NamedTuple, TypeVar

from ._options import Options


_Int = TypeVar("_Int")  # a Python int, or a traced integer inside the program


class SourceShape(NamedTuple):
    """What a source says of its shape, before any batch is trained on."""

    num_samples: int | None  # rows per pass (arrays and memmaps); None for a loader
    batch_size: int | None  # a loader's own batch size (its first batch's)
    batches: int | None  # a loader's batches per pass, where it says (`len`)


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
    """

    batch_size: int
    steps_per_epoch: int
    first_epoch: int
    epochs: int
    passes: Passes | None = None

    @property
    def begin(self) -> int:
        """The global step the run starts at."""
        return self.first_epoch * self.steps_per_epoch

    @property
    def total(self) -> int:
        """The global step the run ends at."""
        return max(self.epochs, self.first_epoch) * self.steps_per_epoch

    @property
    def rows(self) -> int:
        """Epochs in the run's record: those of this run, and one to trace with if none."""
        return max(self.epochs - self.first_epoch, 1)

    # -- Steps and epochs. A position is a global step count: the steps done so far.

    def epoch_of(self, step: _Int) -> _Int:
        """The epoch, counted from 1, that the step at index `step` belongs to."""
        return step // self.steps_per_epoch + 1  # type: ignore[operator]

    def epochs_ended(self, position: _Int) -> _Int:
        """How many epochs have ended (counted from the first ever) at `position`."""
        return position // self.steps_per_epoch  # type: ignore[operator]

    def epochs_begun(self, position: int) -> int:
        """How many epochs had at least one step by `position` (a cut-short one counts)."""
        return -(-position // self.steps_per_epoch)

    def next_epoch_end(self, position: _Int) -> _Int:
        """The position at which the epoch that `position` is in ends."""
        return (position // self.steps_per_epoch + 1) * self.steps_per_epoch  # type: ignore[operator]

    def is_epoch_end(self, position: int) -> bool:
        return position % self.steps_per_epoch == 0

    def record_row(self, step: _Int) -> _Int:
        """The row of the run's record (one per epoch of this run) that step `step` fills."""
        return step // self.steps_per_epoch - self.first_epoch  # type: ignore[operator]

    def record_column(self, step: _Int) -> _Int:
        return step % self.steps_per_epoch  # type: ignore[operator]

    def locate(self, step: int) -> tuple[int, int]:
        """`(epoch, step within it)` of the step at index `step`, both counted from 1."""
        epoch, within = divmod(step, self.steps_per_epoch)
        return epoch + 1, within + 1

    def run_epochs(self, position: int) -> int:
        """Epochs of this run that had a step by `position` (a cut-short one counts)."""
        return self.epochs_begun(position) - self.first_epoch

    # -- Passes over the data (arrays and memmaps).

    def pass_of(self, step: _Int) -> _Int:
        assert self.passes is not None
        return step // self.passes.steps_per_pass  # type: ignore[operator]

    def pass_start(self, index: _Int) -> _Int:
        assert self.passes is not None
        return index * self.passes.steps_per_pass  # type: ignore[operator]

    def remainder_step(self, index: Any) -> Any:
        """The global step of pass `index`'s smaller last batch; `None` if it has none."""
        assert self.passes is not None
        if not self.passes.remainder:
            return None
        return self.pass_start(index) + self.passes.num_full

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


def make_schedule(shape: SourceShape, options: Options) -> Schedule:
    """The run's `Schedule`, from the source's shape and the checked options."""
    if shape.num_samples is None:  # a loader: its batches are the steps
        assert shape.batch_size is not None
        batch_size, passes = shape.batch_size, None
        per_epoch = options.steps_per_epoch or shape.batches
        if per_epoch is None:
            raise ValueError(
                "`data` is a loader that does not say its length (no `len`), or says one too "
                "large to be an epoch, so eqfit cannot tell where an epoch ends. Pass "
                "`steps_per_epoch=`, the number of batches each epoch takes."
            )
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
