"""What made a loss not finite, found by replaying its step (`find`): the run is
deterministic, so the step's batch, key and parameters are those it had, and the step
runs once more, outside the compiled run, under JAX's checks for NaNs and infinities.

With `on_nan="raise"` or `"stop"`, the run stops at a step whose loss is not finite, and
the state it returns is the state that step began from (kept by the step's guard, or
replayed up to it: `_replay`): the replay starts there, and runs that one step. It reads
the step's batch as the run read it: from arrays in memory by the epoch's shuffle, from
memmaps and loaders by reading their chunks again (a loader is iterated again up to the
step, as a resumed run reads it).
"""

import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
from jaxtyping import PyTree

from ._core._data import order_at, shuffle_seed
from ._history import NonFinite
from ._host._open import read_again
from ._host._sources import InMemory, Memmaps, Source
from ._program._loop import Loop
from ._program._options import Options
from ._program._skeleton import unwrap
from ._program._state import Consts
from ._result import model_from
from ._step._mean import Mean
from ._step._objective import batch_args, split_output
from ._step._record import UpdateInfo
from ._step._signatures import takes_key
from ._step._step import by_name
from ._step._updates import trained_spec


def _folders(*files: str | None) -> tuple[str, ...]:
    """The folders of modules' files, each ending in a separator."""
    return tuple(os.path.dirname(f) + os.sep for f in files if f)


# Where an operation's line is looked for: first the user's code, outside these libraries;
# else (a loss of eqfit's, an Equinox layer's) theirs, never JAX's or numpy's own. eqfit's
# folder is this module's: importing eqfit from inside it would run back up the package.
_INTERNALS = _folders(jax.__file__, np.__file__, jaxlib.__file__)
_LIBRARIES = (*_INTERNALS, *_folders(eqx.__file__, optax.__file__, __file__))


def find(
    loop: Loop,
    source: Source,
    options: Options,
    consts: Consts,
    keys: PyTree,
    params: PyTree,
    opt_state: PyTree,
    model_state: PyTree,
    step: int,
    member: int | None,
    *,
    replayed_from: int | None = None,
    replay_seconds: float = 0.0,
    unreplayed: str | None = None,
) -> NonFinite:
    """Replays global step `step` of the run (of ensemble member `member`) from the state
    it began from, and finds what made its loss not finite. A replay that fails says so
    in its `not_reproduced`: it never loses the run's result.

    **Arguments:**

    - `loop`: the run's.
    - `source`: its training data.
    - `options`: its options (a loader is opened anew with them, to be read again).
    - `consts`: the run's frozen arrays.
    - `keys`: the run's key, or each member's.
    - `params`, `opt_state`, `model_state`: the run's final trained arrays, optimizer
        state (several updates': by name) and model state, on the host: those the step
        began from.
    - `step`: the global step whose loss was not finite (counted from 0).
    - `member`: the ensemble member, or `None`.
    - `replayed_from`, `replay_seconds`: where the run had applied the step, the position
        the replay of the run up to it began from (`_replay`), and how long it took;
        `unreplayed`: why that replay did not reach the step, and which model the
        arrays given are (nothing is then replayed).

    **Returns:**

    A `NonFinite`.
    """
    began = time.perf_counter() - replay_seconds
    epoch, within = loop.schedule.locate(step)

    def unfound(why: str) -> NonFinite:
        seconds = time.perf_counter() - began
        return NonFinite(epoch, within, member, seconds, why, replayed_from=replayed_from)

    if unreplayed is not None:
        return unfound(f"the run's replay did not reach the step: {unreplayed}")
    try:
        frozen, key = consts.frozen, keys
        if member is not None:  # the member's own arrays, from each one's leading axis
            params, opt_state, model_state, frozen, key = jax.tree.map(
                lambda a: a[member], (params, opt_state, model_state, frozen, key)
            )
        model = model_from(loop, params, consts._replace(frozen=frozen))
        try:
            batch, rows = _batch_at(loop, source, options, key, step)
        except Exception as e:  # a loader that cannot be read again (a generator)
            return unfound(f"its batch could not be read again ({type(e).__name__}: {e})")
        step_key = jax.random.fold_in(jax.random.fold_in(key, 1), step) if loop.use_key else None
        # The arrays the run trains (`True`), as a filter spec of the model.
        filled = unwrap(loop.model.fill(list(loop.trains)))
        spec = jax.tree.map(lambda x: x if isinstance(x, bool) else False, filled)
        broken = _non_finite(eqx.filter(model, spec))
        # Each update in its turn, on the model the one before it left.
        turn = (loop.updates, options.objects.updates, opt_state, step, step_key, spec)
        finding = _each_update(*turn, model, model_state, batch, rows)
    except Exception as e:
        return unfound(f"the replay failed ({type(e).__name__}: {e})")
    if finding is None:
        return unfound(
            "replayed, the step's losses and gradients are finite: the run's compiled step "
            "and the replay computed them differently (XLA's fusion, or a precision "
            "policy, norms or microbatches, which the replay does not apply)"
        )
    seconds = time.perf_counter() - began
    return NonFinite(
        epoch,
        within,
        member,
        seconds,
        None,
        *finding,
        replayed_from=replayed_from,
        began_non_finite=broken,
    )


def _non_finite(trained: PyTree) -> tuple[str, ...]:
    """The paths of `trained`'s arrays that hold a value not finite."""
    return tuple(
        jax.tree_util.keystr(path)
        for path, a in jax.tree_util.tree_leaves_with_path(trained)
        if eqx.is_inexact_array(a) and not bool(jnp.all(jnp.isfinite(a)))
    )


def _diagnose(
    call: "_Call", model: Any, spec: PyTree, batch: PyTree, rows: np.ndarray
) -> tuple[Any, ...] | None:
    """What makes `call`'s loss (or its gradient with respect to the arrays `spec` picks)
    not finite on `batch`: `NonFinite`'s fields from `operation` on; `None` where both
    are finite.
    """
    trained, rest = eqx.partition(model, spec)

    def value_of(p: PyTree) -> Any:
        return call.value(eqx.combine(p, rest), batch)

    value, grads = eqx.filter_value_and_grad(value_of)(trained)
    parameters = tuple(
        jax.tree_util.keystr(path)
        for path, g in jax.tree_util.tree_leaves_with_path(grads)
        if not bool(jnp.all(jnp.isfinite(g)))
    )
    if bool(jnp.isfinite(value)) and not parameters:
        return None
    operation, source_line, backward = _first_operation(value_of, trained)
    return (operation, source_line, backward, parameters, _rows(call, model, batch, rows))


def _each_update(
    infos: tuple[UpdateInfo, ...],
    updates: tuple[Any, ...],
    opt_state: Any,
    step: int,
    step_key: Any,
    spec: PyTree,
    model: Any,
    model_state: Any,
    batch: PyTree,
    rows: np.ndarray,
) -> tuple[Any, ...] | None:
    """A step replayed: its updates, each due in its turn, as the step runs them
    (`Update.apply` is its turn, bit for bit, at `fit`'s default options), until the
    first whose loss (an `eqfit.Update`'s, or the `loss` method of an update of your
    own) or its gradient is not finite: `_diagnose`'s fields, and its name (none for
    `fit`'s one loss, which is no named update).
    """
    states = by_name(infos, opt_state)
    for i, (info, update) in enumerate(zip(infos, updates)):
        if (step + 1) % info.every:
            continue  # not due at this step
        key = jax.random.key(0) if step_key is None else info.turn_key(step_key, i)
        loss = update.validation_loss()  # an `eqfit.Update`'s, or your own's `loss`
        if loss is not None:
            picks = trained_spec(model, update.trains, f"update {update.name!r}'s `trains`")
            mine = jax.tree.map(lambda a, b: bool(a) and bool(b), spec, picks)
            found = _diagnose(_Call(loss, model_state, key), model, mine, batch, rows)
            if found is not None:
                return (*found, info.named)
        if i + 1 == len(updates):
            break  # the last: no update after it needs the model it leaves
        out = update.apply(model, states[info.name], batch, model_state=model_state, key=key)
        model, model_state, states[info.name] = out.model, out.model_state, out.state
    return None


class _Call:
    """The loss as the step calls it: with the model state and the step's key, where the
    run has them; its value a float32 scalar (a weighted mean's quotient).
    """

    def __init__(self, loss: Callable[..., Any], model_state: PyTree, key: Any):
        self.loss, self.model_state = loss, model_state
        self.key = key if key is not None and takes_key(loss) else None

    def value(self, model: Any, batch: PyTree) -> Any:
        args = batch_args(batch)
        stateful = self.model_state is not None
        if stateful:
            args = (self.model_state, *args)
        kwargs = {} if self.key is None else {"key": self.key}
        value, _, _ = split_output(self.loss(model, *args, **kwargs), stateful)
        if isinstance(value, Mean):
            value = value.total / value.weight
        return jnp.asarray(value, jnp.float32)


def _batch_at(
    loop: Loop, source: Source, options: Options, key: Any, step: int
) -> tuple[PyTree, np.ndarray]:
    """Step `step`'s batch, as the run read it, and where each of its rows is in the data:
    its index in the arrays or memmaps given (`validation_split`'s held-out rows
    counted), or for a loader its place in the epoch (the batches before it
    in the epoch, times the batch size, plus its place in its batch).
    """
    schedule = loop.schedule
    if isinstance(source, InMemory):
        passes = schedule.passes
        assert passes is not None
        index = schedule.pass_of(step)
        start = (step - schedule.pass_start(index)) * passes.batch_size
        size = passes.remainder if step == schedule.remainder_step(index) else passes.batch_size
        positions = jnp.arange(start, start + size, dtype=jnp.uint32)
        seed = shuffle_seed(key)
        epoch = jnp.asarray(index, jnp.int32)
        rows = np.asarray(order_at(seed, epoch, passes.num_samples, loop.shuffle, positions))
        batch = jax.tree.map(lambda a: a[rows], source.data)
        return batch, rows if source.rows is None else source.rows[rows]
    again = read_again(source, options)
    if again is None:
        raise ValueError("a one-shot iterator's batches are gone once read")
    chunk = next(iter(again.chunks(schedule, step, step + 1)))
    assert chunk.order is not None
    start = (step - chunk.first) * chunk.batch_size
    picked = chunk.order[start : start + chunk.batch_size]
    batch = jax.tree.map(lambda a: jnp.asarray(a[picked]), chunk.data)
    if isinstance(again, Memmaps):
        rows = chunk.start + picked.astype(np.int64)
        if again.rows is not None:  # the training rows, some held out
            rows = again.rows[rows]
    else:  # a loader's: its place in the epoch's batches
        into = step - (schedule.locate(step)[0] - 1) * schedule.steps_per_epoch
        rows = into * schedule.batch_size + np.arange(len(picked))
    return batch, np.asarray(rows)


def _first_operation(value: Callable[[Any], Any], trained: PyTree) -> tuple[str | None, ...]:
    """The first operation that made a NaN (or, if none did, an infinity) in the loss or
    its gradient, as JAX's checks name it, the line of the user's code it came from, and
    whether it was in the backward pass. `None`s where no check fired.
    """
    for check in (jax.debug_nans, jax.debug_infs):
        try:
            with check(True):
                jax.block_until_ready(eqx.filter_value_and_grad(value)(trained))
        except FloatingPointError as e:
            # Where the operation came from: for one of the gradient's, the forward
            # operation it transposes (JAX chains its traceback as the cause).
            cause = e.__cause__
            backward = type(cause).__name__ == "JaxStackTraceBeforeTransformation"
            before = cause if backward else None
            frames = traceback.extract_tb((before or e).__traceback__)
            # The frames below this function's: the loss's (a traceback JAX kept from
            # tracing holds the whole stack, `fit`'s caller's too).
            ours = [i for i, f in enumerate(frames) if f.filename == __file__]
            frames = frames[ours[-1] + 1 :] if ours else frames
            line = None
            for outside in (_LIBRARIES, _INTERNALS):
                found = [f for f in frames if not f.filename.startswith(outside)]
                if found:
                    f = found[-1]
                    line = f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"
                    break
            message = str(e).splitlines()[0]
            return message, line, "backward" if backward else "forward"
    return None, None, None


def _rows(call: _Call, model: Any, batch: PyTree, rows: np.ndarray) -> tuple[int, ...] | None:
    """The rows of the batch (by their place in the data, `rows`) whose loss, each row
    taken as a batch of its own, is not finite; `None` where each row's loss is finite
    (the loss is not a mean over rows, or mixes them).
    """
    one = lambda row: call.value(model, jax.tree.map(lambda a: a[None], row))  # noqa: E731
    try:
        values = np.asarray(jax.vmap(one)(batch))
    except Exception:  # a loss that cannot take a row alone (a batch statistic's)
        return None
    bad = ~np.isfinite(values)
    return tuple(int(r) for r in rows[bad]) if bad.any() else None
