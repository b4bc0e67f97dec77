"""An epoch's end inside the program: its values from the record of its steps,
validation (each set's batches, computed here or added up by `PerStep`'s programs), and
early stopping.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int, Key, PyTree

from .._core._early_stopping import StoppingState
from .._step._evaluate import add_batches, add_chunk, evaluate_batches, evaluation_needs_key
from .._step._labels import LabelError
from ._loop import Loop, Rebuilt
from ._records import epoch_values, put
from ._state import Inputs, Stop, TrainState, ValAt, ValSums


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
        loop, schedule = self.loop, self.loop.schedule
        row = schedule.record_row(state.step - 1)
        epoch = schedule.epoch_of(state.step - 1)
        values = epoch_values(state, row, loop)
        validated = None  # every epoch, or not at all
        validation = loop.validation
        validate = self.summed(sums) if sums else self.validate
        if validation is not None:
            if validation.freq == 1:  # no branch: the program it always was
                val, label_error = validate(state, epoch)
            else:
                validated = epoch % validation.freq == 0

                def not_due(state: TrainState) -> tuple[Array, LabelError]:
                    return jnp.full(len(loop.val_names), jnp.nan), state.label_error

                val, label_error = jax.lax.cond(
                    validated, lambda s: validate(s, epoch), not_due, state
                )
            values = jnp.concatenate([values, val])
            state = state._replace(label_error=label_error)
        state = state._replace(
            epoch_values=put(state.epoch_values, values, row), running=jnp.zeros(2)
        )
        if loop.early_stopping is None:
            return state
        assert state.stopping is not None
        stopping_rule = loop.early_stopping
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
        return state._replace(stopping=stopping, reason=reason)

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
                label_error = label_error.or_else(labels)
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
        count: int,
        remainder: bool,
        at: ValAt,
    ) -> ValSums:
        """`validation_batches`' (the program's) for one member: as `evaluate_batches`
        computes each batch, added in the same order.
        """
        model = self.model(state)
        totals, label_error = add_batches(
            self.parts.objective,
            model,
            state.model_state,
            self.sets()[set_index],
            self.loop.schedule.batch_size,
            self.set_key(model, at.epoch, set_index),
            at.batch,
            count,
            remainder,
            jnp.asarray(sums.totals),
            sums.label_error,
        )
        return ValSums(totals, label_error)

    def chunk(
        self,
        state: TrainState,
        sums: ValSums,
        set_index: int,
        chunk: PyTree,
        batch_size: int,
        count: int | None,
        at: ValAt,
    ) -> ValSums:
        """`validation_chunk`'s (the program's) for one member: a streamed set's chunk
        (`OnDevice`), its batches added to the sums as `validate` adds a set's in memory
        (the same keys, by the batch's number in the set): by one scan (`count` `None`),
        or `count` batches from the chunk's batch `at.batch` on, written out.
        """
        assert at.offset is not None and at.valid is not None
        model = self.model(state)
        totals, label_error = add_chunk(
            self.parts.objective, model, state.model_state, chunk, batch_size,
            self.set_key(model, at.epoch, set_index), at.offset, at.valid,
            jnp.asarray(sums.totals), sums.label_error, at.batch, count,
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
            values = [t[0] / t[1] for t in totals]
            label_error = state.label_error
            for _, labels in sums:
                label_error = label_error.or_else(labels)
            return jnp.concatenate(values), label_error

        return validate
