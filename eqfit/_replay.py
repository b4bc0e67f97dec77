"""The state a run's first non-finite step began from, replayed (`on_nan="raise"` and
`"stop"`).

Where a run's execution asks for no guard (`replays`: by default, wherever the run can be
replayed), its compiled step applies each update whatever its loss: no `cond` around the
update, which costs the step time (`benchmarks/small_steps.py --guards`). The run stops
after its first step whose loss is not finite, with that step applied. The state the
step began from, which `fit` returns, is then made again by `replay`: the run's own
programs, from the newest checkpoint (or the run's start) up to that step, with no
observer. A run's result does not depend on how its steps are cut into calls, so the
replayed state is the one the run had, bit for bit.
"""

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from ._host._drive import drive, Outcome
from ._host._feeds import Feed
from ._host._open import replayable
from ._host._signals import Interrupt
from ._host._sources import Source
from ._program._calls import program_for
from ._program._options import Options
from ._program._parallel import Pmap
from ._program._schedule import Schedule
from ._program._start import start_program
from ._program._state import StartArgs, TrainState


def replays(options: Options, source: Source) -> bool:
    """Whether a run of `options` on `source` applies a non-finite step and replays the
    state before it: as its execution's `guard` asks (`None`: wherever the run can be
    replayed bit for bit), with `on_nan` `"raise"` or `"stop"`. Refuses `guard=False`
    where it cannot (`unreplayable`).
    """
    asked = None if options.execution == "auto" else options.execution.guard
    if asked or options.step.on_nan == "skip":
        return False
    why = unreplayable(options, source)
    if asked is None:
        return why is None
    if why is not None:
        raise ValueError(
            f"`execution={options.execution!r}` asks for no guard around the updates, but "
            f"{why}. Leave `guard` as it is (`None`), or `True`."
        )
    return True


def unreplayable(options: Options, source: Source) -> str | None:
    """Why a run cannot be replayed to its state before a step bit for bit, if it cannot:
    under `pmap` and a precision policy XLA computes the update to other last bits
    without the guard's `cond` (and a finite run gives the bits it gave); an ensemble's
    members stop each at its own step; a one-shot iterator's batches are gone; several
    processes would each have to replay in step.
    """
    if isinstance(options.placement, Pmap):
        return "under `devices=` (`pmap`) XLA computes the update to other last bits without it"
    if options.step.precision is not None:
        return "with a precision policy XLA computes the update to other last bits without it"
    if options.members is not None:
        return "an ensemble's members each stop at their own step, which a replay cannot give"
    if not replayable(source):
        return "the data is a one-shot iterator, whose batches cannot be read again to replay"
    if jax.process_count() > 1:
        return "several processes would each have to replay the run in step"
    return None


class Replayed(NamedTuple):
    """The run's outcome with its trained state replaced by the replay's (the state the
    non-finite step began from), where the replay began, and how long it took; with
    `failed`, why the replay did not reach the step, and which model the outcome holds.
    """

    outcome: Outcome
    began_from: int
    seconds: float
    failed: str | None = None

    def reported(self) -> dict[str, Any]:
        """What `_nonfinite.find` reports of the replay, as its keyword arguments."""
        return {
            "replayed_from": self.began_from,
            "replay_seconds": self.seconds,
            "unreplayed": self.failed,
        }


Feeds = Callable[[Source, Schedule, int, int], tuple[Iterator[Feed], Callable[[], None]]]
Resume = Callable[[TrainState, Schedule], tuple[TrainState, int]]


def replay(
    outcome: Outcome,
    start: StartArgs,
    resume: Resume,
    feeds_from: Feeds,
    source: Callable[[], Source | None],
    interrupt: Interrupt,
    stop_feeds: Callable[[], None],
) -> Replayed | None:
    """The run of `outcome` replayed up to its first non-finite step, where it applied
    that step (`StepOptions.replays`) and was not cut short (a signal, a failure);
    `None` where there is nothing to replay.

    It runs from where `resume(state, schedule)` says, given the state `start` makes:
    the newest checkpoint (`Kept.resume`), or that start; on the data `source()` reads
    again (`feeds_from(source, schedule, begin, end)` gives the feeds from `begin` to
    `end`, and what stops them), once the run's own feeds have stopped (`stop_feeds`).
    A signal (`interrupt`) stops it at the end of the call in flight, the model then the
    replay's at the step it reached. It never raises: where it fails, `failed` says so,
    and the outcome is the run's own.
    """
    loop = outcome.loop
    step = int(np.asarray(outcome.read.nan_step).max())
    cut = outcome.interrupted or outcome.failure is not None
    if not loop.step.replays or step < 0 or cut:
        return None
    stop_feeds()  # the run's reading ahead ends before the data is read again
    interrupt.ended = False  # a signal stops the replay too
    try:
        return _replayed(outcome, start, resume, feeds_from, source, step, interrupt)
    finally:
        interrupt.ended = True


def _replayed(
    outcome: Outcome,
    start: StartArgs,
    resume: Resume,
    feeds_from: Feeds,
    source: Callable[[], Source | None],
    step: int,
    interrupt: Interrupt,
) -> Replayed:
    """`replay`'s, up to global step `step`."""
    began = time.perf_counter()
    loop = outcome.loop
    schedule, placement = loop.schedule, loop.placement
    begin = schedule.begin
    try:
        state, _ = start_program(loop)(*placement.start_inputs(start, loop.trains))
        resumed, position = resume(state, schedule)
        if position <= step:  # else (never: none is written past it) from the start
            state, begin = resumed, position
        again = source()
        assert again is not None  # `replays` asks that it can be read again
        train_feeds, stop_feeds = feeds_from(again, schedule, begin, step)
        try:  # no observers: the run told them all already
            replayed = drive(
                loop, program_for, placement.put(state), train_feeds, begin, [], interrupt
            )
        finally:
            stop_feeds()
    except Exception as e:  # the run's result is kept, whatever the replay met
        why = f"it failed ({type(e).__name__}: {e}), so the model returned is the one after it"
        return Replayed(outcome, begin, time.perf_counter() - began, why)
    r = replayed.state
    reached = int(np.asarray(replayed.read.step).max())
    failed = None
    if replayed.failure is not None or reached != step:
        cause = replayed.failure or ("a signal" if interrupt.requested else "the data's end")
        failed = (
            f"{cause} stopped it at step {reached}, so the model returned is the one after "
            f"step {reached} (counted from 1)"
        )
    elif not _same_losses(replayed.read.step_loss, outcome.read.step_loss):
        warnings.warn(
            "The replay of the run up to its non-finite step computed other losses than the "
            "run did: the loader gave other batches the second time (an unseeded shuffle), "
            "or the device's operations are not deterministic. The model returned is the "
            "replay's, from before the step.",
            stacklevel=4,
        )
    state = outcome.state._replace(
        params=r.params,
        opt_state=r.opt_state,
        model_state=r.model_state,
        average=r.average,
        loss_scale=r.loss_scale,
    )
    report = outcome.report._replace(trained=replayed.report.trained)  # `restore_best`'s
    return Replayed(
        outcome._replace(state=state, report=report), begin, time.perf_counter() - began, failed
    )


def _same_losses(replayed: Any, run: Any) -> bool:
    """Whether every step loss the replay recorded is the run's, bit for bit."""
    replayed, run = np.asarray(replayed), np.asarray(run)
    made = ~np.isnan(replayed)
    return bool(np.array_equal(replayed[made], run[made]))
