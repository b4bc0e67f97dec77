"""An epoch's end inside the program: its values from the record of its steps,
validation (each set's batches, computed here or added up by `PerStep`'s programs), and
early stopping; and with `validation_every=n`, the validation after an n-th step.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, Key, PyTree

from .._core._early_stopping import StoppingState
from .._step._evaluate import add_batches, add_chunk, evaluate_batches, evaluation_needs_key
from .._step._labels import LabelError
from .._step._statistics import values as accumulated_values, zeros
from .._step._validation_steps import EveryNSteps
from ._loop import Loop, Rebuilt
from ._members import put_row
from ._records import epoch_values, first_step, put
from ._state import Inputs, Stop, TrainState, ValAt, Validations, ValSums


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    """One member's epoch end, while tracing: the loop's pieces with the inputs and the
    member's key, that validation's keys are folded from.
    """

    loop: Loop
    parts: Rebuilt
    inputs: Inputs
    key: Key[Array, ""]

    def close(self, state: TrainState, sums: tuple[ValSums, ...] = ()) -> TrainState:
        """The end of the epoch just finished: its values, validation, early stopping.
        Validation's values are computed here (`validate`), or made from each set's
        `sums` where `PerStep`'s programs added them up (`validation_batches`).
        """
        state, row, values = self.closing(state, sums)
        return state._replace(epoch_values=put(state.epoch_values, values, row))

    def close_where(
        self,
        due: Bool[Array, ""],
        state: TrainState,
        closing: tuple[ValSums, ...],
        sums: tuple[ValSums, ...] | None,
    ) -> TrainState:
        """The epoch closed where `due` (`when`): an ensemble member's values written
        at the row of the members that close (`put_row`), outside the `cond`.
        """
        if self.loop.members is None:
            return when(due, lambda s: self.close(s, closing), lambda s: s, state, sums)

        def not_due(state: TrainState) -> tuple[TrainState, Int[Array, ""], Array]:
            row = self.loop.schedule.record_row(state.step - 1, first_step(self.loop, state))
            values = state.epoch_values
            return state, row, jnp.full(values.shape[-1:], jnp.nan, values.dtype)

        def closed(state: TrainState) -> tuple[TrainState, Int[Array, ""], Array]:
            state, row, values = self.closing(state, closing)
            return state, row, values.astype(state.epoch_values.dtype)

        state, row, values = when(due, closed, not_due, state, sums)
        return state._replace(epoch_values=put_row(due, state.epoch_values, row, values))

    def closing(
        self, state: TrainState, sums: tuple[ValSums, ...] = ()
    ) -> tuple[TrainState, Int[Array, ""], Array]:
        """`close`, but the epoch's values: returned with their row of the epochs' table,
        not yet written there (an ensemble's members write theirs at one row: `close_where`).
        """
        loop, schedule = self.loop, self.loop.schedule
        row = schedule.record_row(state.step - 1, first_step(loop, state))
        epoch = schedule.epoch_of(state.step - 1)
        values = epoch_values(state, row, loop)
        if loop.statistics:  # the accumulating metrics', from the epoch's statistics
            objective = self.parts.objective
            computed = accumulated_values(objective.accumulating, loop.statistics, state.statistics)
            values = jnp.concatenate([values, computed])
            state = state._replace(statistics=tuple(map(zeros, loop.statistics)))
        validated = None  # every epoch, or not at all
        validation = loop.validation
        validate = self.summed(sums) if sums else self.validate
        if validation is not None and validation.steps.by_steps:
            values = jnp.concatenate([values, self.last_validation(state)])
        elif validation is not None:
            if validation.freq == 1:  # no branch: the program it always was
                val, label_error = validate(state, epoch)
            else:
                validated = epoch % validation.freq == 0

                dtype = state.epoch_values.dtype  # a float64 loss's too, under x64

                def due(state: TrainState) -> tuple[Array, LabelError]:
                    val, label_error = validate(state, epoch)
                    return val.astype(dtype), label_error

                def not_due(state: TrainState) -> tuple[Array, LabelError]:
                    return jnp.full(len(loop.val_names), jnp.nan, dtype), state.label_error

                val, label_error = jax.lax.cond(validated, due, not_due, state)
            values = jnp.concatenate([values, val])
            state = state._replace(label_error=label_error)
        state = state._replace(running=jnp.zeros(2))
        if loop.early_stopping is None:
            return state, row, values
        assert state.stopping is not None
        stopping_rule = loop.early_stopping
        if loop.val_steps.judging(stopping_rule.monitor, loop.val_names).by_steps:
            return state, row, values  # judged at each validation (`validated`)
        monitored = values[loop.log_names.index(stopping_rule.monitor)]
        trained = (state.params, state.average)

        def update(stopping: StoppingState) -> tuple[StoppingState, Bool[Array, ""]]:
            return stopping_rule.update(stopping, monitored, epoch, trained, state.model_state)

        if validated is not None and stopping_rule.monitor in loop.val_names:
            # As Keras, which checks the monitor only where it is in the epoch's logs: an
            # epoch not validated neither improves nor counts towards the patience.
            def wait(stopping: StoppingState) -> tuple[StoppingState, Bool[Array, ""]]:
                return stopping, jnp.asarray(False)

            stopping, stop = jax.lax.cond(validated, update, wait, state.stopping)
        else:
            stopping, stop = update(state.stopping)
        reason = jnp.where(stop, Stop.EARLY_STOPPING, state.reason)
        return state._replace(stopping=stopping, reason=reason), row, values

    def validated(
        self, state: TrainState, sums: tuple[ValSums, ...] = ()
    ) -> tuple[TrainState, Bool[Array, ""]]:
        """The validation after global step `state.step`, an n-th (`validation_every=n`):
        its values in the run's table at their row (computed here, or from `PerStep`'s
        `sums`), and early stopping judging them where it monitors one; returns the state
        and whether early stopping stops the run (once the epoch, if it ends here, is
        closed: `_Member.boundary`). Its keys are folded from the step, as an epoch's
        validation's are from the epoch.
        """
        state, stop, row, values = self.validating(state, sums)
        table = state.validations
        assert table is not None
        table = Validations(put(table.values, values, row), put(table.done, True, row))
        return state._replace(validations=table), stop

    def validated_where(
        self, due: Bool[Array, ""], state: TrainState, sums: tuple[ValSums, ...] | None
    ) -> tuple[TrainState, Bool[Array, ""]]:
        """The validation after an n-th step made where `due` (`when`), as `validated`:
        an ensemble member's values written at the row of the members that validate
        (`put_row`), outside the `cond`.
        """
        if self.loop.members is None:

            def none(state: TrainState) -> tuple[TrainState, Bool[Array, ""]]:
                return state, jnp.asarray(False)

            return when(due, lambda s: self.validated(s, sums or ()), none, state, sums)
        every = self.loop.val_steps
        assert isinstance(every, EveryNSteps)

        def not_due(state: TrainState) -> tuple[TrainState, Bool[Array, ""], Any, Array]:
            assert state.validations is not None
            row = every.row(self.loop.schedule, state.step, first_step(self.loop, state))
            values = jnp.full(state.validations.values.shape[-1:], jnp.nan)
            return state, jnp.asarray(False), row, values.astype(state.validations.values.dtype)

        def made(state: TrainState) -> tuple[TrainState, Bool[Array, ""], Any, Array]:
            assert state.validations is not None
            dtype = state.validations.values.dtype
            state, stop, row, values = self.validating(state, sums or ())
            return state, stop, row, values.astype(dtype)

        state, stop, row, values = when(due, made, not_due, state, sums)
        table = state.validations
        assert table is not None
        written = put_row(due, table.values, row, values), put_row(due, table.done, row, True)
        return state._replace(validations=Validations(*written)), stop

    def validating(
        self, state: TrainState, sums: tuple[ValSums, ...] = ()
    ) -> tuple[TrainState, Bool[Array, ""], Int[Array, ""], Array]:
        """`validated`, but the values: returned with their row of the validations'
        table, not yet written there (an ensemble's members write theirs at one row).
        """
        loop, step, every = self.loop, state.step, self.loop.val_steps
        assert isinstance(every, EveryNSteps) and state.validations is not None
        validate = self.summed(sums) if sums else self.validate
        values, label_error = validate(state, step)
        row = every.row(loop.schedule, step, first_step(loop, state))
        state = state._replace(label_error=label_error)
        rule, stop = loop.early_stopping, jnp.asarray(False)
        if rule is None or rule.monitor not in loop.val_names:
            return state, stop, row, values
        assert state.stopping is not None
        # Validations, not epochs, are what early stopping counts here (its patience, its
        # `start_from_epoch`, its best: the validation's number, `step // n`).
        number = every.number(loop.schedule, step)
        monitored = values[loop.val_names.index(rule.monitor)]
        trained = (state.params, state.average)
        stopping, stop = rule.update(state.stopping, monitored, number, trained, state.model_state)
        return state._replace(stopping=stopping), stop, row, values

    def last_validation(self, state: TrainState) -> Array:
        """The validation values of the epoch that ends at `state.step`, with
        `validation_every`: its last validation's, NaN where it had none.
        """
        every = self.loop.val_steps
        assert isinstance(every, EveryNSteps) and state.validations is not None
        first = first_step(self.loop, state)
        row, inside = every.last(self.loop.schedule, state.step, first)
        safe = jnp.maximum(row, 0)
        table = state.validations
        values = jax.lax.dynamic_index_in_dim(table.values, safe, 0, False)
        done = jax.lax.dynamic_index_in_dim(table.done, safe, 0, False)
        return jnp.where(inside & done, values, jnp.nan)

    def validate(self, state: TrainState, epoch: Int[Array, ""]) -> tuple[Array, LabelError]:
        """The validation values of epoch `epoch`'s model (`Loop.val_names`'), and the
        label error with the first label out of range that they met, if any.

        A loss that takes a key (and requires one, `evaluation_needs_key`) gets a new one
        for each batch of each set at each epoch, from the run's key: the noise of a
        variational loss differs from batch to batch and epoch to epoch, and is the same
        for the same run, however it is cut into calls. Its own fold of the run's key
        (the steps' is 1) leaves the training's keys as they were.
        """
        loop, parts = self.loop, self.parts
        model = self.model(state)
        values, label_error = [], state.label_error
        for i, data in enumerate(self.sets()):
            val, labels = evaluate_batches(
                parts.objective,
                model,
                state.model_state,
                data,
                loop.schedule.batch_size,
                self.set_key(model, epoch, i),
            )
            values.append(val)
            if labels is not None:
                label_error = label_error.or_else(labels.in_set(i))
        return jnp.concatenate(values), label_error

    def model(self, state: TrainState) -> PyTree:
        """The model that validation evaluates: the trained one, or its average."""
        validation = self.loop.validation
        assert validation is not None
        return self.parts.combine(state.average if validation.ema else state.params)

    def sets(self) -> list[PyTree]:
        """The validation sets' data, in the order of their values."""
        validation, val_data = self.loop.validation, self.inputs.val_data
        assert validation is not None
        return [val_data[name] for name in validation.sets] if validation.sets else [val_data]

    def set_key(self, model: PyTree, epoch: Int[ArrayLike, ""], i: int) -> Key[Array, ""] | None:
        """Set `i`'s key at epoch `epoch`, that its batches' are folded from (`None` where
        the loss gets none: `evaluation_needs_key`).
        """
        if not evaluation_needs_key(self.parts.objective, model):
            return None
        epoch_key = jax.random.fold_in(jax.random.fold_in(self.key, 2), epoch)
        return jax.random.fold_in(epoch_key, i)

    def batches(
        self,
        state: TrainState,
        sums: ValSums,
        set_index: int,
        data: PyTree,
        batch_size: int,
        count: int,
        remainder: bool,
        at: ValAt,
    ) -> ValSums:
        """`validation_batches`' (the program's) for one member: as `evaluate_batches`
        computes each batch of set `set_index`'s `data` (all of it, or a streamed chunk,
        whose `at.offset` and `at.valid` say where it is), added in the same order.
        """
        model = self.model(state)
        totals, label_error = add_batches(
            self.parts.objective,
            model,
            state.model_state,
            data,
            batch_size,
            self.set_key(model, at.epoch, set_index),
            at.batch,
            count,
            remainder,
            jnp.asarray(sums.totals),
            sums.label_error,
            at.offset,
            at.valid,
        )
        return ValSums(totals, label_error)

    def chunk(
        self,
        state: TrainState,
        sums: ValSums,
        set_index: int,
        chunk: PyTree,
        batch_size: int,
        at: ValAt,
    ) -> ValSums:
        """`validation_chunk`'s (the program's) for one member: a streamed set's chunk
        (`OnDevice`), its batches added to the sums in one scan as `validate` adds a set's
        in memory (the same keys, by the batch's number in the set).
        """
        assert at.offset is not None and at.valid is not None
        model = self.model(state)
        totals, label_error = add_chunk(
            self.parts.objective, model, state.model_state, chunk, batch_size,
            self.set_key(model, at.epoch, set_index), at.offset, at.valid,
            jnp.asarray(sums.totals), sums.label_error,
        )  # fmt: skip
        return ValSums(totals, label_error)

    def summed(
        self, sums: tuple[ValSums, ...]
    ) -> Callable[[TrainState, Int[Array, ""]], tuple[Array, LabelError]]:
        """`validate` where `PerStep`'s programs added up each set's batches (`sums`):
        each set's value its totals' quotient, the label error the first they met.
        """

        def validate(state: TrainState, epoch: Int[Array, ""]) -> tuple[Array, LabelError]:
            del epoch  # the sums are the epoch's
            totals = [jnp.asarray(set_sums.totals) for set_sums in sums]
            values = [self.parts.objective.quotient(t) for t in totals]
            label_error = state.label_error
            for i, (_, labels) in enumerate(sums):
                label_error = label_error.or_else(labels.in_set(i))
            return jnp.concatenate(values), label_error

        return validate


def when(
    due: Bool[Array, ""],
    fn: Callable[[Any], Any],
    otherwise: Callable[[Any], Any],
    state: TrainState,
    sums: tuple[ValSums, ...] | None,
) -> Any:
    """`fn(state)` where `due`, else `otherwise(state)`: under a `cond` inside the run
    (a validation not due is not computed), or both computed and selected where the host
    added up the sums (`sums` given: `fn` only divides them).
    """
    if sums is None:
        return jax.lax.cond(due, fn, otherwise, state)
    return jax.tree.map(lambda a, b: jnp.where(due, a, b), fn(state), otherwise(state))
