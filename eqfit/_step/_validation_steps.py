"""When a run validates by its steps: `validation_every=n` (`EveryNSteps`), a validation
after every n-th step, each in its row of the run's table (`Validations`); or the null
concern, `AtEpochEnds`, at the epochs' ends (`validation_freq`), or not at all. The run
asks it what it does by the option (`StepValidation`'s methods): no other module reads
the option's number or tests it for `None`.
"""

import abc
from collections.abc import Callable
from typing import Any, ClassVar, final, NamedTuple, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float


class Validations(NamedTuple):
    """With `validation_every=n`, the run's validations, a row each: row `r` is the one
    after global step `(begin // n + r + 1) * n`, `begin` the run's first step.
    """

    values: Float[Array, "*members rows values"]  # `Loop.val_names`'; NaN where not made
    done: Bool[Array, "*members rows"]  # whether it was made (the run reached it, running)


@runtime_checkable
class ScheduleLike(Protocol):
    """What validation reads of the run's `Schedule` (`_program/_schedule.py`, the one
    home of step and epoch arithmetic, a layer above). A position is a global step count;
    each takes a Python int, a traced integer, or (where the host reads) a numpy array.
    """

    @property
    def steps_per_epoch(self) -> int: ...
    @property
    def begin(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def first_epoch(self) -> int: ...
    @property
    def epochs(self) -> int: ...
    def epochs_ended(self, position: Any) -> Any: ...
    def epoch_of(self, step: Any) -> Any: ...
    def next_epoch_end(self, position: Any, every: int = 1) -> Any: ...
    def multiples(self, position: Any, n: int) -> Any: ...
    def multiples_run(self, n: int) -> int: ...
    def next_multiple(self, position: Any, n: int) -> Any: ...
    def is_epoch_end(self, position: int, every: int = 1) -> bool: ...
    def record_row(self, step: Any, first: Any = None) -> Any: ...


class StepValidation(eqx.Module):
    """Whether a run validates after its steps rather than at its epochs' ends:
    `EveryNSteps` (`validation_every=n`), or the null `AtEpochEnds` (at the epochs'
    ends `validation_freq` says, or not at all). What the run does by it (where its
    stretches of steps stop, its table of validations, what early stopping and
    `Checkpoint(keep_best=)` count, the history's steps, the plan's passes, the
    checkpoint's configuration) is asked of it. Hashable: `Validation` holds it.
    """

    # Validations after steps, inside epochs: a stretch of steps may stop there, each
    # epoch's validation values are its last validation's.
    by_steps: ClassVar[bool]

    @abc.abstractmethod
    def validates_at(self, position: int) -> bool:
        """Whether a validation follows the step that ends at `position`."""

    @abc.abstractmethod
    def next_boundary(self, schedule: ScheduleLike, position: Any, end: Any) -> Any:
        """Where the stretch of steps from `position` ends: `end` (the epoch's), or the
        next validation's step if sooner.
        """

    @abc.abstractmethod
    def last_boundary(self, schedule: ScheduleLike, position: Any, start: Any) -> Any:
        """Where the stretch of steps that `position` is in began: `start` (the epoch's),
        or the last validation's step at or before `position` if later.
        """

    @abc.abstractmethod
    def ends_epoch(self, is_end: Callable[[], Any]) -> Any:
        """Whether a stretch's end is an epoch's: always (`True`, no test in the program)
        where none stops elsewhere; else `is_end()`.
        """

    @abc.abstractmethod
    def when(self, schedule: ScheduleLike, end: int, freq: int) -> tuple[int, bool]:
        """At a close the host makes at `end`: the number the validation's keys are
        folded from (the epoch's, or the step's), and whether it validates there.
        """

    @abc.abstractmethod
    def start_table(self, schedule: ScheduleLike, width: int) -> Validations | None:
        """The run's table of validations (`TrainState.validations`), none made, a row
        of `width` values each; `None`: the run keeps none.
        """

    @abc.abstractmethod
    def made(
        self, schedule: ScheduleLike, begin: int, position: int
    ) -> tuple[tuple[int, int], ...]:
        """The validations after `begin` up to `position`, each its step and its row of
        the table.
        """

    @abc.abstractmethod
    def passes(self, schedule: ScheduleLike, freq: int) -> int:
        """The validation passes of the run (the epochs `freq` divides, at epochs' ends)."""

    @abc.abstractmethod
    def judging(self, monitor: str, val_names: tuple[str, ...]) -> "StepValidation":
        """How `monitor` is judged (by early stopping, `keep_best`): at each validation
        after steps where it is a validation value; else at epochs' ends (`AtEpochEnds`).
        """

    @abc.abstractmethod
    def column(self, monitor: str, log_names: tuple[str, ...], val_names: tuple[str, ...]) -> int:
        """The column of the judged values (`judged_values`) that holds `monitor`."""

    @abc.abstractmethod
    def number(self, schedule: ScheduleLike, position: Any) -> Any:
        """What early stopping counts a judgement at `position` as: the epochs ended, or
        the validations after steps made (`step // n`).
        """

    @abc.abstractmethod
    def best(self, schedule: ScheduleLike, number: int | None) -> tuple[int | None, int | None]:
        """Early stopping's best as an epoch and a step (`None` where it is no step's):
        from its `number`.
        """

    @abc.abstractmethod
    def next_judged(self, schedule: ScheduleLike, position: int) -> int:
        """The next position after `position` at which a value is judged."""

    @abc.abstractmethod
    def judged_row(self, schedule: ScheduleLike, position: int) -> int | None:
        """The row of the value judged at `position`, if one is made there."""

    @abc.abstractmethod
    def judged_values(
        self, state: Any, row: int, column: int, local: Callable[[Any], np.ndarray]
    ) -> np.ndarray:
        """The values judged at `row` of a `state` (each member's, its arrays read on the
        host by `local`), NaN where none was made.
        """

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """What a checkpoint's configuration says of it (`{}` where nothing)."""

    @abc.abstractmethod
    def length_checks(self) -> tuple[tuple[str, int, str, str, str], ...]:
        """What the open phase refuses where the run's steps are not known, or are too few
        to reach one validation (`_host/_open.py`'s `_check_every`): the option, its
        number, and the words of the message (what is kept, what it does, what instead).
        """


@final
class AtEpochEnds(StepValidation):
    """No validation after steps: a run validates at its epochs' ends, or not at all."""

    by_steps: ClassVar[bool] = False

    def validates_at(self, position: int) -> bool:
        return False

    def next_boundary(self, schedule: ScheduleLike, position: Any, end: Any) -> Any:
        return end

    def last_boundary(self, schedule: ScheduleLike, position: Any, start: Any) -> Any:
        return start

    def ends_epoch(self, is_end: Callable[[], Any]) -> Any:
        return True

    def when(self, schedule: ScheduleLike, end: int, freq: int) -> tuple[int, bool]:
        epoch = schedule.epoch_of(end - 1)
        return epoch, epoch % freq == 0

    def start_table(self, schedule: ScheduleLike, width: int) -> None:
        return None

    def made(
        self, schedule: ScheduleLike, begin: int, position: int
    ) -> tuple[tuple[int, int], ...]:
        return ()

    def passes(self, schedule: ScheduleLike, freq: int) -> int:
        last = max(schedule.epochs, schedule.first_epoch)
        return last // freq - schedule.first_epoch // freq

    def judging(self, monitor: str, val_names: tuple[str, ...]) -> "AtEpochEnds":
        return self

    def column(self, monitor: str, log_names: tuple[str, ...], val_names: tuple[str, ...]) -> int:
        return log_names.index(monitor)

    def number(self, schedule: ScheduleLike, position: Any) -> Any:
        return schedule.epochs_ended(position)

    def best(self, schedule: ScheduleLike, number: int | None) -> tuple[int | None, int | None]:
        return number, None

    def next_judged(self, schedule: ScheduleLike, position: int) -> int:
        return schedule.next_epoch_end(position)

    def judged_row(self, schedule: ScheduleLike, position: int) -> int | None:
        return schedule.record_row(position - 1) if schedule.is_epoch_end(position) else None

    def judged_values(
        self, state: Any, row: int, column: int, local: Callable[[Any], np.ndarray]
    ) -> np.ndarray:
        return local(state.epoch_values)[..., row, column]

    def config(self) -> dict[str, Any]:
        return {}

    def length_checks(self) -> tuple[tuple[str, int, str, str, str], ...]:
        return ()


# The null concern's one instance: made once, not at each question a run asks.
AT_EPOCH_ENDS = AtEpochEnds()


@final
class EveryNSteps(StepValidation):
    """`validation_every=n`: a validation after every n-th step, counted from the first
    ever, instead of at epochs' ends; each in its row of the run's table (`Validations`).
    """

    n: int
    by_steps: ClassVar[bool] = True

    def validates_at(self, position: int) -> bool:
        return position % self.n == 0

    def next_boundary(self, schedule: ScheduleLike, position: Any, end: Any) -> Any:
        validation = schedule.next_multiple(position, self.n)
        if isinstance(position, jax.Array):
            return jnp.minimum(end, validation)
        return min(end, validation)

    def last_boundary(self, schedule: ScheduleLike, position: Any, start: Any) -> Any:
        validation = schedule.multiples(position, self.n) * self.n
        if isinstance(position, jax.Array):
            return jnp.maximum(start, validation)
        return max(start, validation)

    def ends_epoch(self, is_end: Callable[[], Any]) -> Any:
        return is_end()

    def when(self, schedule: ScheduleLike, end: int, freq: int) -> tuple[int, bool]:
        return end, self.validates_at(end)

    def due(self, step: Array) -> Array:
        """Whether the step that ends at `step` (traced) is an n-th."""
        return jax.lax.rem(step, jnp.asarray(self.n, step.dtype)) == 0

    def rows(self, schedule: ScheduleLike) -> int:
        """The n-th steps the run reaches, at least one: the rows of its table."""
        return max(self.passes(schedule, 1), 1)

    def row(self, schedule: ScheduleLike, position: Any, first: Any = None) -> Any:
        """The row of the table that the validation after `position` (an int, or traced;
        one that `n` divides) fills; `first`: the run's first step (`begin`; in a
        program, the state's).
        """
        first = schedule.begin if first is None else first
        return schedule.multiples(position, self.n) - schedule.multiples(first, self.n) - 1

    def last(self, schedule: ScheduleLike, step: Any, first: Any) -> tuple[Any, Any]:
        """The row of the last validation up to `step` (traced, an epoch's end), and
        whether it is inside the epoch that ends there (and the run made it); `first` as
        `row`'s.
        """
        row = self.row(schedule, step, first)
        last = schedule.multiples(step, self.n) * self.n
        return row, (last > step - schedule.steps_per_epoch) & (row >= 0)

    def steps_of(self, schedule: ScheduleLike, rows: np.ndarray) -> np.ndarray:
        """The step of each of the table's `rows`."""
        return (schedule.begin // self.n + 1 + rows) * self.n

    def start_table(self, schedule: ScheduleLike, width: int) -> Validations:
        rows = self.rows(schedule)
        values = jnp.full((rows, width), jnp.float32(jnp.nan))
        return Validations(values, jnp.zeros(rows, bool))

    def made(
        self, schedule: ScheduleLike, begin: int, position: int
    ) -> tuple[tuple[int, int], ...]:
        ks = range(begin // self.n + 1, position // self.n + 1)
        return tuple((k * self.n, self.row(schedule, k * self.n)) for k in ks)

    def passes(self, schedule: ScheduleLike, freq: int) -> int:
        return schedule.multiples_run(self.n)

    def judging(self, monitor: str, val_names: tuple[str, ...]) -> StepValidation:
        return self if monitor in val_names else AT_EPOCH_ENDS

    def column(self, monitor: str, log_names: tuple[str, ...], val_names: tuple[str, ...]) -> int:
        return val_names.index(monitor)

    def number(self, schedule: ScheduleLike, position: Any) -> Any:
        return schedule.multiples(position, self.n)

    def best(self, schedule: ScheduleLike, number: int | None) -> tuple[int | None, int | None]:
        if number is None:
            return None, None
        step = number * self.n
        return schedule.epoch_of(step - 1), step

    def next_judged(self, schedule: ScheduleLike, position: int) -> int:
        return schedule.next_multiple(position, self.n)

    def judged_row(self, schedule: ScheduleLike, position: int) -> int | None:
        return self.row(schedule, position) if self.validates_at(position) else None

    def judged_values(
        self, state: Any, row: int, column: int, local: Callable[[Any], np.ndarray]
    ) -> np.ndarray:
        table = state.validations
        done = local(table.done)[..., row]
        return np.where(done, local(table.values)[..., row, column], np.nan)

    def config(self) -> dict[str, Any]:
        return {"validation_every": self.n}  # the state holds a row for each validation

    def length_checks(self) -> tuple[tuple[str, int, str, str, str], ...]:
        instead = ", or leave it out to validate at each epoch's end"
        return (("validation_every", self.n, "each validation's values are", "validate", instead),)
