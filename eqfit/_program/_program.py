"""The compiled programs of a run, from the training state that `start` made
(`_start.py`). `run` trains from the state's position (a global step count) up to a
stop position: `WholeRun` calls it once, from the start to the end, and the bar,
checkpoints, resume and streamed data call it in pieces; since the positions are traced,
every piece runs the same compiled program, and the pieces agree with one whole run bit
for bit. `PerStep` calls `unrolled` (its few steps written out) instead, and the host
then ends each epoch with `close`, computing validation with `_beside.py`'s programs;
each takes the same `TrainState` and writes the same record.

`run` reads as its loops: passes over the data, the stretches between epoch ends, the
batches; `EpochEnd.close` (`_epoch_end.py`) ends an epoch (its values, validation, early
stopping).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Key, PyTree, UInt32

from .._core._data import epoch_order, order_at, shuffle_seed
from .._step._labels import LabelError
from .._step._statistics import add
from .._step._step import StepResult
from .._step._validation_steps import EveryNSteps
from ._ahead import gathered_steps
from ._epoch_end import EpochEnd
from ._loop import Loop, Rebuilt
from ._members import some_member, steps_while
from ._records import (
    add_running,
    epoch_values,
    first_step,
    fresh_record,
    logs_of,
    masked,
    MEMBERS,
    put_cell,
)
from ._state import (
    CallEnd,
    Consts,
    Inputs,
    Report,
    running,
    Steps,
    Stop,
    strongly_typed,
    TrainState,
    ValSums,
)
from ._stretch import StepEnd, steps_waiting, waits


def run(
    loop: Loop, state: TrainState, inputs: Inputs, stop: Int[Array, ""]
) -> tuple[TrainState, Report]:
    """Trains from `state.step` to the global step `stop`, or until stopped. (Named `run`
    as the program is: profiles show its calls as `jit_run`.)

    A while loop over passes over the data, each holding a while loop over the stretches
    between epoch ends (one stretch and no loop where epochs end only at pass ends), each
    a while loop over full batches, then the pass's remainder batch and the epoch's end
    (validation, metrics, early stopping) as they fall due.
    """

    def one(parts: Rebuilt, state: TrainState, key: Key[Array, ""]) -> tuple[TrainState, Report]:
        return _Member(loop, parts, inputs, key, stop).run(state)

    return each_member_with(loop, inputs.consts, one, state, inputs.key)


def unrolled(
    loop: Loop, unroll: int, remainder: bool, state: TrainState, inputs: Inputs, until: CallEnd
) -> tuple[TrainState, Report]:
    """`unroll` steps from `state.step`, written out with no loop around them, towards
    `until.stop` (`_Member.unrolled`); with `remainder`, the pass's smaller last batch.
    The epoch's end is closed by the programs below, which the host calls after it.
    """

    def one(parts: Rebuilt, state: TrainState, key: Key[Array, ""]) -> tuple[TrainState, Report]:
        return _Member(loop, parts, inputs, key, jnp.asarray(until.stop)).unrolled(
            state, until, unroll, remainder
        )

    return each_member_with(loop, inputs.consts, one, state, inputs.key)


def close(
    loop: Loop,
    state: TrainState,
    read: tuple[Inputs, tuple[ValSums, ...]],
    until: CallEnd,
) -> tuple[TrainState, Report]:
    """`PerStep`'s close of the epoch that ends at `until.stop`, once its steps have run
    (if the run is still running there): its values, with validation's from each set's
    sums (`read`'s, after the inputs; made by `validation_batches`), and early stopping.
    """
    inputs, sums = read

    def one(
        parts: Rebuilt, state: TrainState, sums: tuple[ValSums, ...], key: Key[Array, ""]
    ) -> tuple[TrainState, Report]:
        member = _Member(loop, parts, inputs, key, jnp.asarray(until.stop))
        return member.closed(state, sums)

    return each_member_with(loop, inputs.consts, one, state, sums, inputs.key)


def each_member(loop: Loop, one: Callable[..., Any], *args: Any) -> Any:
    """`one(*args)`, a member's program, for each member of an ensemble (`vmap`ped over
    the leading axis of every argument: the members' states and keys), or for the one
    model: the one place a program is made per member.
    """
    return one(*args) if loop.members is None else jax.vmap(one, axis_name=MEMBERS)(*args)


def each_member_with(loop: Loop, consts: Consts, one: Callable[..., Any], *args: Any) -> Any:
    """`each_member` of `one(parts, *args)`, given the run's objects rebuilt (`Loop.parts`)
    with the member's own arrays that do not train: an ensemble's are stacked as its
    trained ones are (frozen by `filter_spec`, or integers), each member's slice its own.
    """
    if loop.members is None:
        return one(loop.parts(consts), *args)

    def member(frozen: list[Array], *args: Any) -> Any:
        return one(loop.parts(consts._replace(frozen=frozen)), *args)

    return jax.vmap(member, axis_name=MEMBERS)(consts.frozen, *args)


@dataclasses.dataclass(frozen=True)
class _Member:
    """One member's run, while tracing: the loop's pieces with their shared arguments."""

    loop: Loop
    parts: Rebuilt
    inputs: Inputs
    key: Key[Array, ""]
    stop: Int[Array, ""]

    def run(self, state: TrainState) -> tuple[TrainState, Report]:
        loop, schedule = self.loop, self.loop.schedule
        begin = state.step  # the call's first step
        stop = jnp.asarray(self.stop, jnp.int32)  # within the run: the drive stops there
        if schedule.learning:  # each call's steps are recorded afresh, for the host
            state = fresh_record(state)
        step_key = self.step_key()
        piece, passes = self.inputs.piece, schedule.passes
        if piece is not None:  # streamed: this piece's rows
            end = jnp.minimum(stop, piece.end)
            order = jnp.asarray(piece.order)
            # A piece of smaller batches (a pass's last) is a remainder: not split over
            # devices, as it need not divide evenly.
            full = loop.batch_size == schedule.batch_size
            state = self.run_steps(state, order, piece.first, end, None, step_key, full)
        else:
            assert passes is not None
            seed = shuffle_seed(self.key)

            def more(state: TrainState) -> Bool[Array, ""]:
                return (state.step < stop) & running(state)

            def one_pass(state: TrainState) -> TrainState:
                index = schedule.pass_of(state.step)
                order = epoch_order(seed, index, passes.num_samples, loop.shuffle)
                first = schedule.pass_start(index)
                end = jnp.minimum(stop, first + passes.steps_per_pass)
                remainder = schedule.remainder_step(index)
                return self.run_steps(state, order, first, end, remainder, step_key)

            state = self.while_loop(more, one_pass, state)
        # The n-th steps' values (`log_every`), but where the host closes the epochs: it
        # reports them once it has (`EpochCloses.logged`).
        validation = loop.validation
        return self.finish(
            state, logs_from=begin if validation is None or not validation.streamed else None
        )

    def unrolled(
        self, state: TrainState, until: CallEnd, unroll: int, remainder: bool
    ) -> tuple[TrainState, Report]:
        """`PerStep`'s program: `unroll` steps written out (each a no-op in a slot left
        idle, or once the run has reached `until.stop`, the epoch's end (or a validation's
        step), the pass's full batches' end, or has stopped). With `remainder`, one step:
        the pass's smaller last batch, if the state is at it.
        """
        loop, schedule = self.loop, self.loop.schedule
        if schedule.learning:  # each call of the drive's steps are recorded afresh
            fresh = fresh_record(state)
            state = jax.tree.map(lambda a, b: jnp.where(until.fresh, a, b), fresh, state)
        step_key = self.step_key()
        begin = state.step
        boundary = loop.next_boundary(begin)  # the epoch's end, or a validation's step
        end = jnp.minimum(until.stop, boundary)  # within the run, as `run`'s stop
        piece, passes = self.inputs.piece, schedule.passes
        if piece is not None:  # streamed: this piece's rows
            first, order = piece.first, jnp.asarray(piece.order)
            end, size = jnp.minimum(end, piece.end), loop.batch_size
            full, safe = loop.batch_size == schedule.batch_size, first

            def rows(t: Int[Array, ""]) -> UInt32[Array, " batch"]:
                start = (t - first) * loop.batch_size
                return jax.lax.dynamic_slice(order, (start,), (size,), allow_negative_indices=False)

        else:
            assert passes is not None
            seed, index = shuffle_seed(self.key), schedule.pass_of(begin)
            first = schedule.pass_start(index)
            if remainder:  # the pass's last step, on its remaining samples
                safe = schedule.remainder_step(index)
                end, size, full = jnp.minimum(end, safe + 1), passes.remainder, False
            else:
                end = jnp.minimum(end, first + passes.num_full)
                safe, size, full = first, loop.batch_size, True

            def rows(t: Int[Array, ""]) -> UInt32[Array, " batch"]:
                start = ((t - first) * loop.batch_size).astype(jnp.uint32)
                positions = start + jnp.arange(size, dtype=jnp.uint32)
                return order_at(seed, index, passes.num_samples, loop.shuffle, positions)

        for slot in range(unroll):
            # Straight-line code, no loop and no `cond` around the step (XLA compiles a
            # convolution in either worse): a step past the end or in an idle slot
            # (`Loop.in_slot`) is computed and dropped, on rows in range (`safe`'s).
            active = loop.in_slot((state.step < end) & running(state), slot, begin, unroll)
            if remainder:
                active = active & (state.step == safe)
            t = jnp.where(active, state.step, safe)
            stepped = self.step_at(state._replace(step=t), rows(t), full, step_key, active)
            state = stepped._replace(step=jnp.where(active, stepped.step, state.step))

        return self.finish(state)

    def epoch_end(self) -> EpochEnd:
        """The member's epoch end (its values, validation, early stopping)."""
        return EpochEnd(self.loop, self.parts, self.inputs, self.key)

    def step_key(self) -> Key[Array, ""] | None:
        """The key the steps' keys are folded from: one key per global step, so that a
        step's key does not depend on how the run is cut into calls. (Derived only if
        the loss asks for one: threefry is costly to compile.)
        """
        return jax.random.fold_in(self.key, 1) if self.loop.use_key else None

    def finish(
        self, state: TrainState, logs_from: Int[Array, ""] | None = None
    ) -> tuple[TrainState, Report]:
        """The state at the call's end, laid out as `shard=` asks, and its report; with
        `logs_from` (a call of the drive's whole, from that step), the n-th steps' values
        it reached (`log_every`).
        """
        loop = self.loop
        lay_out = self.parts.lay_out
        if lay_out is not None:
            params, opt_state = lay_out(state.params, state.opt_state)
            state = state._replace(params=params, opt_state=opt_state)
            if state.average is not None:
                state = state._replace(average=lay_out(state.average, None)[0])
        # As `start` made its types: a step of an update's own may return a weak type.
        state = strongly_typed(state)
        logs = None if logs_from is None else logs_of(loop, state, logs_from)
        return state, self.report(state, logs)

    def run_steps(
        self,
        state: TrainState,
        order: UInt32[Array, " n"],
        first: Any,
        end: Any,
        remainder_step: Any,
        step_key: Key[Array, ""] | None,
        full: bool = True,
    ) -> TrainState:
        """Steps until `end` or until stopped, closing each epoch as it ends. Step `t`
        takes rows `order[(t - first) * batch_size:]`; in memory, `remainder_step` is
        the pass's last step, on the smaller batch of its remaining samples.
        """
        loop, schedule = self.loop, self.loop.schedule

        def batch_rows(size: int) -> Callable[[TrainState], tuple[UInt32[Array, " b"], None]]:
            def rows(state: TrainState) -> tuple[UInt32[Array, " b"], None]:
                start = (state.step - first) * loop.batch_size  # in range: in the piece
                at = (start,)
                return jax.lax.dynamic_slice(order, at, (size,), allow_negative_indices=False), None

            return rows

        def between_epoch_ends(state: TrainState) -> TrainState:
            epoch_end = schedule.next_epoch_end(state.step)
            boundary = loop.next_boundary(state.step)  # or a validation's, if sooner
            limit = jnp.minimum(end, boundary)
            full_limit = limit if remainder_step is None else jnp.minimum(limit, remainder_step)

            def more_full(state: TrainState) -> Bool[Array, ""]:
                return (state.step < full_limit) & running(state)

            passes = schedule.passes
            if loop.ahead > 1 and self.inputs.piece is None:  # shuffled, on one CPU
                state = gathered_steps(self, state, order, first, full_limit, step_key)
            elif passes is None or passes.num_full:  # else all is the remainder
                rows, size = batch_rows(loop.batch_size), loop.batch_size
                state = self.steps_while(more_full, rows, state, full, step_key, size)
            if remainder_step is not None:
                assert passes is not None

                # A loop that runs once or not at all, not a `cond`: XLA compiles a step
                # inside a conditional more slowly than inside a loop.
                def remainder_due(state: TrainState) -> Bool[Array, ""]:
                    return (state.step == remainder_step) & (state.step < limit) & running(state)

                rows, size = batch_rows(passes.remainder), passes.remainder
                state = self.steps_while(
                    remainder_due, rows, state, False, step_key, size, together=False
                )
            if loop.validation is not None and loop.validation.streamed:
                return state  # the host validates, then closes it (`close`)
            at_end = loop.val_steps.ends_epoch(lambda: state.step == epoch_end)
            return self.boundary(state, state.step == boundary, at_end)

        if schedule.epochs_end_at_pass_ends and not loop.val_steps.by_steps:
            # From a step inside a pass to `end`, at or before the pass's end (in memory
            # the caller's loop sees to that, and a memmap's pieces each lie in one pass),
            # no epoch ends but at `end`: one stretch, with no loop around it. A loop
            # level fewer in the program, which XLA then compiles in much less time.
            return between_epoch_ends(state)

        def more(state: TrainState) -> Bool[Array, ""]:
            return (state.step < end) & running(state)

        return self.while_loop(more, between_epoch_ends, state)

    def while_loop(
        self,
        more: Callable[[TrainState], Bool[Array, ""]],
        body: Callable[[TrainState], TrainState],
        state: TrainState,
    ) -> TrainState:
        """`jax.lax.while_loop(more, body, state)` over stretches of steps. In an
        ensemble, while any member has `more`: a loop whose condition differs between
        the members of a `vmap` selects every member's whole state after each turn,
        its record of the run's steps too. A member with no more runs its turn as a
        no-op: each step inside is masked (`steps_while`), each epoch end waits for its
        step and for the member to be running.
        """
        if self.loop.members is not None:
            more = some_member(more)
        return jax.lax.while_loop(more, body, state)

    def steps_while(
        self,
        more: Callable[[TrainState], Bool[Array, ""]],
        rows: Callable[[TrainState], tuple[UInt32[Array, " batch"], PyTree]],
        state: TrainState,
        full: bool,
        step_key: Key[Array, ""] | None,
        size: int,
        together: bool = True,
    ) -> TrainState:
        """Steps while `more(state)`, each on the `size` rows `rows(state)` gives (and their
        batch, if taken ahead; else `None`). One model's steps leave their bookkeeping to
        the stretch's end where they can (`_stretch`); in an ensemble, the steps run while
        any member has more, masked where a member has none (`_members.steps_while`,
        which steps them `together` unmasked first).
        """

        def step(state: TrainState, active: Bool[Array, ""] | None) -> TrainState:
            index, batch = rows(state)
            return self.step_at(state, index, full, step_key, active, batch)

        if self.loop.members is not None or not waits(self.loop):
            return steps_while(self.loop.members, more, step, state, together)

        def waiting(state: TrainState) -> tuple[TrainState, StepEnd]:
            index, batch = rows(state)
            return self.waiting_step(state, index, full, step_key, batch)

        return steps_waiting(more, waiting, state, size, self.loop)

    def step_at(
        self,
        state: TrainState,
        index: UInt32[Array, " batch"],
        full: bool,
        step_key: Key[Array, ""] | None,
        active: Bool[Array, ""] | None = None,
        batch: PyTree = None,
    ) -> TrainState:
        """One step, at `state.step`, on the rows `index` of the data (or `batch`, those
        rows taken ahead): a full batch (split over devices), or a pass's smaller last
        one (never split, as it need not divide evenly: no pmean). Where `active` is
        false, computed and dropped: the state comes back as it was (`masked`).
        """
        before, t, size = state, state.step, index.shape[0]
        state, out, place = self.advanced(state, index, full, step_key, active, batch)
        nan_step = jnp.where(~out.finite & (state.nan_step < 0), t, state.nan_step)
        label_error, end = self.labels_met(state, out, t)
        reason = state.reason
        if self.loop.step.on_nan != "skip":
            reason = jnp.where(out.finite, reason, end.reason)
        state = state._replace(
            reason=reason,
            nan_step=nan_step,
            label_error=label_error,
            running=self.running_with(state, out, size),
            batch_sizes=put_cell(state.batch_sizes, size, place, active),
        )
        return state if active is None else masked(active, state, before)

    def waiting_step(
        self,
        state: TrainState,
        index: UInt32[Array, " batch"],
        full: bool,
        step_key: Key[Array, ""] | None,
        batch: PyTree = None,
    ) -> tuple[TrainState, StepEnd]:
        """`step_at`'s step, its bookkeeping left to its stretch's end (`_stretch`): but
        the running mean's sums, and the first label out of range.
        """
        t = state.step
        state, out, _ = self.advanced(state, index, full, step_key, None, batch)
        label_error, end = self.labels_met(state, out, t)
        running = self.running_with(state, out, index.shape[0])
        return state._replace(label_error=label_error, running=running), end

    def running_with(self, state: TrainState, out: StepResult, size: int) -> Array:
        """The running mean's sums with the step's, where the record is emptied for each
        call (a loader's first epoch, while it teaches the epoch's length): else the
        record's row holds the epoch's steps, and the report reads the mean there
        (`epoch_loss`), once a call rather than at every step.
        """
        if not self.loop.schedule.learning:
            return state.running
        return add_running(state.running, out, size)

    def epoch_loss(self, state: TrainState) -> Array:
        """The mean loss of the epoch so far: of the steps of its row of the record (as
        the epoch's own value, once it ends: `Record.epoch_values`), or the running mean
        where the record is emptied for each call; NaN before its first step.
        """
        if self.loop.schedule.learning:
            return state.running[0] / state.running[1]
        first = first_step(self.loop, state)
        row = self.loop.schedule.record_row(jnp.maximum(state.step - 1, first), first)
        loss = epoch_values(state, row, self.loop)[0]
        return jnp.where(state.step > first, loss, jnp.nan)

    def labels_met(
        self, state: TrainState, out: StepResult, t: Int[Array, ""]
    ) -> tuple[LabelError, StepEnd]:
        """The run's first label out of range, with the step's; and the step's end: the
        reason it stops the run with where it is not finite (a label out of range, or
        its loss).
        """
        if out.labels is None:  # neither the loss nor the metrics check labels
            return state.label_error, StepEnd.of(out.finite, None)
        end = StepEnd.of(out.finite, out.labels.found)
        return state.label_error.or_else(out.labels.at_step(t)), end

    def advanced(
        self,
        state: TrainState,
        index: UInt32[Array, " batch"],
        full: bool,
        step_key: Key[Array, ""] | None,
        active: Bool[Array, ""] | None,
        batch: PyTree,
    ) -> tuple[TrainState, StepResult, tuple[Int[Array, ""], Int[Array, ""]]]:
        """The step's new parameters and states, at the next step, with its loss and
        values in its cell of the record (whose place, `(row, column)`, it returns); its
        other bookkeeping is the caller's.
        """
        loop, schedule = self.loop, self.loop.schedule
        t = state.step
        size = index.shape[0]
        placement, data = loop.placement, self.inputs.data
        # Unshuffled arrays in memory: each batch's rows are consecutive, and sliced.
        consecutive = not loop.shuffle and self.inputs.piece is None
        if full:
            step = self.parts.step
            if batch is None:
                batch = placement.full_batch(data, index, consecutive)
        else:
            batch = placement.remainder_batch(data, index, consecutive)
            step = dataclasses.replace(
                self.parts.step, axis_name=None, microbatch=loop.microbatch(size)
            )
        key = None if step_key is None else jax.random.fold_in(step_key, t)
        if active is not None:
            # Masked (a stopped member's step, `PerStep`'s): the guard stays the `cond`'s
            # select, with which XLA fuses the mask's; ordered to update in place, each
            # update would be a kernel of its own (`Step.guard_in_place`).
            step = dataclasses.replace(step, guard_in_place=False)
        out = step(
            state.params,
            state.opt_state,
            state.model_state,
            state.average,
            state.loss_scale,
            batch,
            key,
            t,
        )
        if loop.members is not None and active is not None:
            # The running members' cell, the same for all: they step together, and a
            # member not stepping writes its cell's own value back. A write at each
            # member's own cell would be a scatter in the `vmap`; this one is in place.
            cell = jax.lax.pmax(schedule.record_cell(t, first_step(loop, state)), MEMBERS)
            place = (cell // schedule.columns, cell % schedule.columns)
        else:
            place = schedule.record_place(t, first_step(loop, state))
        state = state._replace(
            params=out.params,
            opt_state=out.opt_state,
            model_state=out.model_state,
            average=out.average,
            loss_scale=out.loss_scale,
            step=t + 1,
            step_loss=put_cell(state.step_loss, out.loss, place, active),
        )
        if loop.record.names:
            values = put_cell(state.step_values, out.values, place, active)
            state = state._replace(step_values=values)
        if out.statistics:  # a step whose loss is not finite is left out, as in the means
            summed = add(state.statistics, out.statistics)
            kept = jax.tree.map(lambda a, b: jnp.where(out.finite, a, b), summed, state.statistics)
            state = state._replace(statistics=kept)
        return state, out, place

    def closed(self, state: TrainState, sums: tuple[ValSums, ...]) -> tuple[TrainState, Report]:
        """`close`'s (the program's) for one member: the epoch closed if its steps have
        run to `self.stop`, its end, and the run is still running (with
        `validation_every`, also called at a validation's step: validated there if due).
        """
        reached, spe = state.step == self.stop, self.loop.schedule.steps_per_epoch
        # The host also calls it at validations (`validation_every`).
        epoch_end = self.loop.val_steps.ends_epoch(
            lambda: jax.lax.rem(state.step, jnp.asarray(spe, state.step.dtype)) == 0
        )
        return self.finish(self.boundary(state, reached, epoch_end, sums))

    def boundary(
        self,
        state: TrainState,
        reached: Bool[Array, ""],
        epoch_end: Bool[Array, ""] | bool,
        sums: tuple[ValSums, ...] | None = None,
    ) -> TrainState:
        """Where the steps have `reached` a stretch's end (`Loop.next_boundary`): the
        validation after an n-th step (`validation_every`) if due there, then the epoch's
        close if one ends there (`epoch_end`), each only while the run runs. Computed
        under a `cond` inside the run (`sums` `None`), or from `sums` that the host's
        programs added up, and selected (`closed`).
        """
        end, every = self.epoch_end(), self.loop.val_steps
        stop = None
        if isinstance(every, EveryNSteps):
            due = reached & every.due(state.step) & running(state)
            state, stop = end.validated_where(due, state, sums)
        closes = reached if epoch_end is True else reached & epoch_end
        if stop is not None:
            # Stopped early inside an epoch: the epoch closes where its steps ended, its
            # values those of the steps it trained (as `log_every`'s are of theirs).
            closes = reached & (epoch_end | stop)
        # With `validation_every`, the epoch's validation values are its last validation's.
        closing = () if every.by_steps else sums or ()
        state = end.close_where(closes & running(state), state, closing, sums)
        if stop is not None:  # an early stop at a validation, once its epoch is closed
            state = state._replace(reason=jnp.where(stop, Stop.EARLY_STOPPING, state.reason))
        return state

    def report(self, state: TrainState, logs: Array | None = None) -> Report:
        stopping = self.loop.early_stopping
        trained = None
        if stopping is not None and stopping.restore_best:
            assert state.stopping is not None
            (params, average), model_state = stopping.trained(
                state.stopping, (state.params, state.average), state.model_state
            )
            trained = (params, model_state, average)
        best = -1 if state.stopping is None else state.stopping.best_epoch
        return Report(
            step=state.step,
            reason=state.reason,
            nan_step=state.nan_step,
            label_error=state.label_error,
            best_epoch=jnp.asarray(best, jnp.int32),
            epoch_loss=self.epoch_loss(state),
            epoch_values=state.epoch_values,
            trained=trained,
            steps=Steps(state.step_loss[0], state.step_values[0], state.batch_sizes[0])
            if self.loop.schedule.learning
            else None,
            logs=logs,
            validations=state.validations,
        )
