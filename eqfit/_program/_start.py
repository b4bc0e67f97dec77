"""The training state at a run's start (`start`: the trained arrays copied, the
optimizer's state made, the record's arrays filled), and its compiled program
(`start_program`), from eqfit's cache. Every program of the run (`_program.py`) takes
and returns that state.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, Key, PyTree

from .._step._labels import LabelError
from .._step._statistics import zeros
from ._compile import PROGRAM_CACHE
from ._loop import Loop
from ._state import Consts, Stop, strongly_typed, TrainState


def start(
    loop: Loop,
    params: list[Array],
    opt_state: PyTree | None,
    model_state: PyTree,
    key: Key[Array, ""],
    consts: Consts,
    begin: Int[Array, ""],
) -> tuple[TrainState, Key[Array, "*members"]]:
    """The training state at the start (at global step `begin`, the run's first), and
    the key of each member (or the key).

    Its outputs are new buffers (`run` may donate them), never the caller's arrays, and
    never weakly typed (`strongly_typed`).
    """
    parts = loop.parts(consts)
    schedule = loop.schedule
    rows, steps = schedule.rows, schedule.columns

    def start_one(
        params: list[Array], opt_state: PyTree, model_state: PyTree, key: Key[Array, ""]
    ) -> TrainState:
        params = loop.params_tree([jnp.copy(p) for p in params])
        if loop.step.precision is not None:  # the master copy
            params = loop.step.precision.master(params)
        if opt_state is None:  # an update's `init` may take a key: the member's own
            opt_state = parts.init(params, jax.random.fold_in(key, INIT))
        else:
            opt_state = jax.tree.map(jnp.copy, opt_state)
        if parts.lay_out is not None:  # laid out as `shard=` asks, from the start
            params, opt_state = parts.lay_out(params, opt_state)
        model_state = jax.tree.map(jnp.copy, model_state)
        average = None if loop.step.average is None else loop.step.average.init(params)
        if average is not None and parts.lay_out is not None:
            average, _ = parts.lay_out(average, None)
        stopping = None
        if loop.early_stopping is not None:
            stopping = loop.early_stopping.init((params, average), model_state)
        nan = jnp.float32(jnp.nan)
        state = TrainState(
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            average=average,
            loss_scale=loop.start_loss_scale(),
            stopping=stopping,
            step=jnp.copy(jnp.asarray(begin, jnp.int32)),  # own buffers: `run` donates them
            first=jnp.copy(jnp.asarray(begin, jnp.int32)),
            reason=jnp.asarray(Stop.RUNNING, jnp.int32),
            nan_step=jnp.asarray(-1, jnp.int32),
            label_error=LabelError.none(),
            step_loss=jnp.full((rows, steps), nan),
            step_values=jnp.full((rows, steps, len(loop.record.names)), nan),
            batch_sizes=jnp.zeros((rows, steps), jnp.int32),
            epoch_values=jnp.full((rows, len(loop.log_names)), nan),
            running=jnp.zeros(2),
            validations=loop.val_steps.start_table(schedule, len(loop.val_names)),
            statistics=tuple(map(zeros, loop.statistics)),
        )
        # Its types fixed once, as every program returns them (`finish`): no weak type.
        return strongly_typed(state)

    if loop.members is None:
        return start_one(params, opt_state, model_state, key), key
    keys = jax.random.split(key, loop.members)
    in_axes = (0, None if opt_state is None else 0, 0, 0)
    return jax.vmap(start_one, in_axes=in_axes)(params, opt_state, model_state, keys), keys


def start_program(loop: Loop) -> Callable[..., tuple[TrainState, Key[Array, "*members"]]]:
    """`start` compiled for `loop`, from eqfit's bounded cache of programs.

    It runs once per `fit` and only fills and copies arrays, so XLA compiles it without
    optimising its kernels: half the compile time, which a first `fit` waits for. Not
    where an update of the user's own makes its state (an environment's reset, say):
    unoptimised kernels round otherwise (no fused multiply-adds), and its state must be
    the bits a `jax.jit` of its `init` gives.
    """
    loop = loop.for_programs()
    fn = functools.partial(start, loop)
    options = None if any(not u.loss for u in loop.updates) else START_OPTIONS
    return PROGRAM_CACHE.get(start_key(loop), lambda: jax.jit(fn, compiler_options=options))


def start_key(loop: Loop) -> tuple[str, Loop]:
    """Where `start_program(loop)` is cached (with what is known of it)."""
    return ("start", loop.for_programs())


def made_before(loop: Loop) -> bool:
    """Whether `start_program(loop)` has made a state (so it is compiled): a later `fit`
    of the configuration then queues it at once, with nothing traced, lowered or put on
    the device from the host (each of which an accelerator waits for).
    """
    return bool(PROGRAM_CACHE.fact(start_key(loop), "made"))


def mark_made(loop: Loop) -> None:
    """Notes that `start_program(loop)` made a state (`made_before`)."""
    PROGRAM_CACHE.set_fact(start_key(loop), "made", True)


START_OPTIONS = {"xla_backend_optimization_level": 0}

# What the run's key (a member's) is folded with for the updates' `init`s: apart from the
# steps' keys (1) and validation's (2).
INIT = 3
