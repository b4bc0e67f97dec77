"""The drive phase's wiring: the starting state (resumed from the newest checkpoint if
there is one), the feeds, the observers, the drive itself, and the finish.
"""

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from ._core._auto_microbatches import AutoMicrobatches, Needs
from ._core._checks import reported_as
from ._core._data import fingerprint
from ._core._metric import tried
from ._core._policy import Checkpoint
from ._core._typing import Data, ModelState, OptState
from ._host._checkpointing import BestBy, Checkpointing
from ._host._drive import drive, feeds
from ._host._feeds import Feed, validation_reader
from ._host._inference import StreamedSets
from ._host._observers import Callbacks, copy_taken, Costs, EpochModels, Observer
from ._host._open import first_rows, open_data, read_again, schedule_for
from ._host._plan import Plan
from ._host._planner import make_plan, memory_limit
from ._host._profiling import Profiling
from ._host._progress import Bar, early_stops, Lines, progress_kind
from ._host._signals import Interrupt
from ._host._sources import Source
from ._keep._checkpoint import Checkpoints
from ._keep._identity import checkpoint_config
from ._keep._keeping import Keeping, Kept
from ._nonfinite import find
from ._program._build import make_loop, SPLIT_ROWS
from ._program._callables import no_data
from ._program._calls import program_for
from ._program._compile import Starting
from ._program._loop import Loop
from ._program._options import Options
from ._program._parallel import OneDevice, placement_devices, split_count
from ._program._schedule import Schedule
from ._program._start import made_before, mark_made, start_key, start_program
from ._program._state import Inputs, StartArgs, TrainState
from ._program._uncompiled import without_compiling
from ._replay import replay, replays
from ._result import finish, FitResult, model_from
from ._step._validation import run_config, ValidationSets


class Ready(NamedTuple):
    """A run opened and built, ready to compile and train (`fit`'s phases so far)."""

    options: Options
    loop: Loop
    start: StartArgs
    source: Source
    val_data: PyTree | None
    keeping: Keeping  # the checkpoints


def open_and_build(
    model: PyTree,
    data: Data | None,
    validation_data: Data | ValidationSets | None,
    state: ModelState | None,
    opt_state: OptState | None,
    options: Options,
    keeping: Keeping,
    planning: bool,
) -> tuple[Ready, Callable[[int], Ready]]:
    """Opens the data, plans the run's shape from it, and builds its static description;
    and how to build it again with another number of microbatches (`"auto"`).
    """
    if data is None:  # the updates make their own: a row of nothing for each step
        data = no_data(options.steps_per_epoch or 1)
    source, val_data = open_data(
        data, validation_data, options, planning=planning, directory=keeping.directory
    )
    # With `on_nan` "raise" or "stop", a non-finite step applied, then replayed (`_replay`).
    step = dataclasses.replace(options.step, replays=replays(options, source))
    options = dataclasses.replace(options, step=step)
    schedule = schedule_for(source, options)
    rows = first_rows(source, SPLIT_ROWS) if tried(options.objects.metrics) else None

    # `schedule_for` checked the count given; `"auto"` tries only counts that divide each
    # device's rows.
    def build(microbatches: int) -> Ready:
        step = dataclasses.replace(options.step, microbatches=microbatches)
        chosen = dataclasses.replace(options, step=step)
        loop, start = make_loop(model, schedule, chosen, source.like, state, opt_state, rows)
        keeping.check_record(loop)
        return Ready(chosen, loop, start, source, val_data, keeping)

    return build(options.step.microbatches), build


def plan_of(ready: Ready, model: PyTree) -> Plan:
    """Compiles the run's programs into eqfit's cache, where the drive finds them, and
    reads what they need.
    """
    options, loop, start, source, val_data, _ = ready
    return make_plan(loop, model, source, val_data, start, options)


def choose_microbatches(
    auto: AutoMicrobatches, ready: Ready, build: Callable[[int], Ready], model: PyTree
) -> tuple[Ready, Plan]:
    """`microbatches="auto"`: the run built with the fewest microbatches whose compiled
    program fits, and its plan, which says why.
    """
    built: dict[int, tuple[Ready, Plan]] = {}

    def needs(count: int) -> Needs | None:
        again = ready if count == ready.options.step.microbatches else build(count)
        try:
            built[count] = again, plan_of(again, model)
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            return None  # XLA would not compile it: it needs more than the device has
        memory = built[count][1].memory
        return Needs(memory.total, memory.temporary)

    loop = ready.loop
    rows = loop.schedule.batch_size // split_count(loop.placement)
    count, why = auto.choose(rows, needs, memory_limit(placement_devices(loop.placement)))
    chosen, plan = built[count]
    return chosen, dataclasses.replace(plan, microbatches_why=why)


def begin_state(ready: Ready) -> tuple[TrainState | Starting, PyTree]:
    """The training state at the start, and the key of each member (or the key). On one
    device with one key, where `start` only copies and fills arrays, the state is made
    without compiling it (`without_compiling`); else, with no checkpoint to resume, it is
    made in a thread while the run's program is traced (`Starting`); else now. Where an
    earlier `fit` of the configuration compiled `start`, it is queued at once.
    """
    loop, options = ready.loop, ready.options
    inputs = loop.placement.start_inputs(ready.start, loop.trains)
    program = start_program(loop)
    if isinstance(loop.placement, OneDevice) and options.members is None and not made_before(loop):
        made = without_compiling(program, inputs, start_key(loop))
        if made is not None:
            return made
        if not ready.keeping.resumes:
            return Starting(program, inputs, functools.partial(mark_made, loop)), options.key
    made = program(*inputs)
    mark_made(loop)
    return made


def train(
    ready: Ready,
    *,
    interrupt: Interrupt,
    costs: Costs | None,
    plan: Plan | None,
    stack: contextlib.ExitStack,
    began: float,
) -> FitResult[Any]:
    """Trains `ready` to its end (or a stop), from the newest checkpoint if there is one,
    its observers told as it goes, and makes the result. Every way out closes what it
    opened, through `stack`.
    """
    loop, options, schedule = ready.loop, ready.options, ready.loop.schedule
    placement, consts = loop.placement, ready.start.consts
    starting, keys = begin_state(ready)
    if isinstance(starting, Starting):
        stack.callback(starting.join)
    identity = functools.partial(_identity, ready)
    kept = ready.keeping.open(starting, identity, options.placement, schedule)
    stack.callback(kept.close)
    starting, begin = kept.resume(starting, schedule)
    feeds_from = _feeds_from(ready, keys)
    train_feeds, stop_feeds = feeds_from(ready.source, schedule, begin, schedule.total)
    stack.callback(stop_feeds)
    observers = observers_for(
        options,
        loop,
        begin=begin,
        kept=kept,
        interrupt=interrupt,
        model_of=lambda params: model_from(loop, params, consts),
        summary=None if plan is None else plan.summary(),
    )
    try:
        with reported_as("fit", "data"):
            outcome = drive(
                loop,
                program_for,
                placement.put(starting),
                train_feeds,
                begin,
                observers,
                interrupt,
                costs,
            )
        # Still deferred: a signal now, with training over, must not lose its result.
        interrupt.ended = True
        found = functools.partial(find, outcome.loop, ready.source, options, consts, keys)
        # Where the run applied a non-finite step: the state before it, replayed.
        again = functools.partial(read_again, ready.source, options)
        replayed = replay(
            outcome, ready.start, kept.resume, feeds_from, again, interrupt, stop_feeds
        )
        if replayed is not None:
            outcome = replayed.outcome
            found = functools.partial(found, **replayed.reported())
        result = finish(outcome.loop, outcome, consts, began, found)
    except BaseException:
        interrupt.ended = True
        for observer in observers:  # how the run ended is `sys.exc_info()`'s now
            observer.finished()
        raise
    for observer in observers:
        observer.finished()
    return result


def _feeds_from(
    ready: Ready, keys: PyTree
) -> Callable[[Source, Schedule, int, int], tuple[Iterator[Feed], Callable[[], None]]]:
    """What makes the run's feeds (the training run's, and a replay's): each call's
    inputs, with the validation data, the keys and the frozen arrays put on the devices
    once, here.
    """
    placement, consts = ready.loop.placement, ready.start.consts
    streams = ready.val_data if isinstance(ready.val_data, StreamedSets) else None
    template = Inputs(
        None,
        None if streams is not None else placement.put(ready.val_data, sharded=True),
        placement.put(keys),
        placement.put(consts),
    )

    def feeds_from(
        source: Source, schedule: Schedule, begin: int, end: int
    ) -> tuple[Iterator[Feed], Callable[[], None]]:
        """The feeds of `source` from step `begin` to `end`, and what stops them."""
        chunks = source.chunks(schedule, begin, end)
        validation = None if streams is None else validation_reader(streams, placement.put)
        return feeds(chunks, template, placement.put, source.streamed, validation)

    return feeds_from


def _identity(ready: Ready, starting: TrainState) -> dict[str, Any]:
    """What identifies the run that `ready` and its starting state describe, for its
    checkpoints (`checkpoint_config`).
    """
    loop, options = ready.loop, ready.options
    val_data = ready.val_data
    prints = (None, None)  # several processes' rows differ: none is compared
    if jax.process_count() == 1:
        prints = (ready.source.fingerprint(), validation_fingerprint(val_data, loop.val_sets))
    if isinstance(val_data, StreamedSets):  # described by the sets themselves
        val_data = [opened.describe() for opened in val_data.sets]
    return checkpoint_config(
        loop, starting, ready.source.describe(), val_data, options.objects, options.key, prints
    )


def validation_fingerprint(val_data: Any, names: tuple[str, ...] | None) -> Any:
    """The validation data's fingerprint for the checkpoints: the arrays' (`fingerprint`),
    or each named set's, or each streamed set's (`Source.fingerprint`); `None` for none.
    """
    if isinstance(val_data, StreamedSets):
        return [opened.fingerprint() for opened in val_data.sets]
    if val_data is None:
        return None
    if names:
        return {name: fingerprint(val_data[name]) for name in names}
    return fingerprint(val_data)


def observers_for(
    options: Options,
    loop: Loop,
    *,
    begin: int,
    kept: Kept,
    interrupt: Interrupt,
    model_of: Callable[[PyTree], Any],
    summary: str | None = None,
) -> list[Observer]:
    """The run's observers, as its options ask: the bar or a log's lines (`_progress`,
    either with the plan's `summary` first), the callbacks (which see the models that
    `model_of` makes of trained arrays), the checkpoints (which take the state off the
    devices to write it, with `keep_best`'s value from the record), and the profile
    (`_profiling`).
    """
    schedule, placement = loop.schedule, loop.placement
    observers: list[Observer] = []
    kind = progress_kind(options.progress, sys.stderr)
    if kind == "bar":
        observers.append(Bar(schedule, begin, summary))
    elif kind == "lines":
        stops = early_stops(options)
        observers.append(Lines(schedule, begin, summary, sys.stderr, kept.newest, stops))
    if options.callbacks:

        def make(taken: PyTree) -> tuple[Any, Any]:
            params, average = taken
            return model_of(params), None if average is None else model_of(average)

        take = lambda state: copy_taken(placement.get((state.params, state.average)))  # noqa: E731
        config = train_config(options, loop, kept)
        models = EpochModels(take, make)
        observers.append(Callbacks(options.callbacks, schedule, config, models))

    def checkpointing(store: Checkpoints, policy: Checkpoint) -> Observer:
        def host(state: PyTree) -> PyTree:
            if store.collective:  # every process writes its own shards
                return state
            return jax.device_get(state)

        monitor, best = None, policy.keep_best
        if best is not None:  # judged at epochs' ends, or validations (`validation_every`)
            judging = loop.val_steps.judging(best, loop.val_names)
            monitor = BestBy(judging.column(best, loop.log_names, loop.val_names), judging)
        take = placement.get
        return Checkpointing(
            store, policy, schedule, interrupt, take, host, monitor, loop.step.replays
        )

    observers.extend(kept.observers(checkpointing))
    if options.profile is not None:
        observers.append(Profiling(options.profile, begin))
    return observers


def train_config(options: Options, loop: Loop, kept: Kept) -> dict[str, Any]:
    """The run's arguments as plain JSON-able values, for the callbacks' `on_train_begin`
    (the loggers' run config): what `fit` was asked, not the model or the data.
    """
    schedule, step, validation = loop.schedule, options.step, options.validation
    policy, average, placement = step.precision, step.average, options.placement
    mesh = getattr(placement, "mesh", None)
    if mesh is not None:
        devices = int(mesh.devices.size)
    else:
        devices = len(getattr(placement, "devices", ())) or 1
    precision, profile = None, options.profile
    if policy is not None:  # by its dtypes' names
        compute, params = np.dtype(policy.compute_dtype), np.dtype(policy.params_dtype)
        precision = {"compute": compute.name, "params": params.name}
    return {
        "epochs": schedule.epochs,
        "initial_epoch": options.initial_epoch,
        "batch_size": schedule.batch_size,
        "steps_per_epoch": None if schedule.learning else schedule.steps_per_epoch,
        "shuffle": options.shuffle,
        "drop_remainder": options.drop_remainder,
        "on_nan": step.on_nan,
        "metrics": list(loop.metric_names),
        "validation": validation is not None,
        "validation_split": options.validation_split,
        **run_config(validation),
        "log_every": options.log_every,
        "early_stopping": None if options.early_stopping is None else repr(options.early_stopping),
        "precision": precision,
        "ema": None if average is None else average.momentum,
        "validate_ema": validation is not None and validation.ema,
        "norms": step.norms,
        "microbatches": step.microbatches,
        "remat": None if step.remat is None else step.remat.name,
        "ensemble_members": options.members,
        "devices": devices,
        **kept.config(),
        "signals": [s.name for s in options.signals],
        "schedules": [name for name, _ in options.schedules],
        "profile": None
        if profile is None
        else {
            "directory": str(profile.directory),
            "start_step": profile.start_step,
            "steps": profile.steps,
        },
    }
