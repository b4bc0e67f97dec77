"""The drive phase's wiring: the starting state (resumed from the newest checkpoint if
there is one), the feeds, the observers, the drive itself, and the finish.
"""

import contextlib
from typing import Any, NamedTuple

from jaxtyping import PyTree

from ._checks import reported_as
from ._compile import Starting
from ._drive import drive, feeds
from ._identity import run_config
from ._loop import Loop
from ._observers import Costs, observers_for
from ._options import Options
from ._parallel import OneDevice
from ._plan import Plan
from ._program import run_program, start_program
from ._result import finish, FitResult, model_from
from ._resume import open_store, resume
from ._signals import Interrupt
from ._sources import Source
from ._state import Inputs, StartArgs, TrainState


class Run(NamedTuple):
    """A run opened and built, ready to compile and train (`fit`'s phases so far)."""

    options: Options
    loop: Loop
    start: StartArgs
    source: Source
    val_data: PyTree | None
    loss: Any  # names the run in its checkpoints' configuration


def begin_state(run: Run) -> tuple[TrainState | Starting, PyTree]:
    """The training state at the start, and the key of each member (or the key). On one
    device, with no checkpoint to resume and one key, the state is made in a thread while
    the run's program is traced (`Starting`); else now.
    """
    loop, options = run.loop, run.options
    inputs = loop.placement.start_inputs(run.start, loop.trains)
    alone = isinstance(loop.placement, OneDevice) and options.members is None
    if alone and options.checkpoint is None:
        return Starting(start_program(loop), inputs), options.key
    return start_program(loop)(*inputs)


def train(
    run: Run,
    *,
    interrupt: Interrupt,
    costs: Costs | None,
    plan: Plan | None,
    stack: contextlib.ExitStack,
    began: float,
) -> FitResult[Any]:
    """Trains `run` to its end (or a stop), from the newest checkpoint if there is one,
    its observers told as it goes, and makes the result. Every way out closes what it
    opened, through `stack`.
    """
    loop, options, schedule = run.loop, run.options, run.loop.schedule
    placement, consts = loop.placement, run.start.consts
    starting, keys = begin_state(run)
    if isinstance(starting, Starting):
        stack.callback(starting.join)
    store, begin = None, schedule.begin
    if not isinstance(starting, Starting) and options.checkpoint is not None:
        config = run_config(
            loop, starting, run.source.describe(), run.val_data, run.loss, options.key
        )
        store = open_store(options, config, schedule)
        stack.callback(store.close)
        starting, begin = resume(store, starting, schedule)
    template = Inputs(
        None, placement.put(run.val_data, sharded=True), placement.put(keys), placement.put(consts)
    )
    chunks = run.source.chunks(schedule, begin, schedule.total)
    train_feeds, stop_feeds = feeds(chunks, template, placement.put, run.source.streamed)
    stack.callback(stop_feeds)
    observers = observers_for(
        options,
        loop,
        begin=begin,
        store=store,
        interrupt=interrupt,
        model_of=lambda params: model_from(loop, params, consts),
        summary=None if plan is None else plan.summary(),
    )
    try:
        with reported_as("fit", "data"):
            outcome = drive(
                loop,
                run_program,
                placement.put(starting),
                train_feeds,
                begin,
                observers,
                interrupt,
                costs,
            )
        # Still deferred: a signal now, with training over, must not lose its result.
        interrupt.ended = True
        result = finish(outcome.loop, outcome, consts, began)
    except BaseException:
        interrupt.ended = True
        for observer in observers:  # how the run ended is `sys.exc_info()`'s now
            observer.finished()
        raise
    for observer in observers:
        observer.finished()
    return result
