"""The public `fit`: check the inputs, partition, pick the loop, combine, return the result."""

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from beartype import beartype
from jax.sharding import Mesh
from jaxtyping import Array, jaxtyped, Key, PyTree, Shaped, UInt32

from ._data import as_data, as_key, ensemble_size, plan_batches
from ._early_stopping import EarlyStopping
from ._history import epoch_values, History, StopReason
from ._loop import Inputs, Loop, Progress, Record, run_chunked, run_compiled, TrainState
from ._parallel import choose_placement, Device, Pmap
from ._step import Objective, Step, takes_key


ArrayData = tuple[Shaped[Array | np.ndarray, "n ..."], ...]
ValidationData = tuple[Shaped[Array | np.ndarray, "n_val ..."], ...]


@runtime_checkable
class Callback(Protocol):
    """Called on the host after each epoch of a `progress=True` run."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> bool | None:
        """`logs` holds the epoch's values by name. Return `True` to stop training."""
        ...


class FitResult(eqx.Module):
    """What `fit` returns.

    **Attributes:**

    - `model`: the trained model, of the same type as the one passed in.
    - `opt_state`: the optimizer state; pass it back as `fit(..., opt_state=)` to go on.
    - `history`: a [`eqfit.History`][] of per-epoch values and per-step losses.
    - `state`: the model state (`eqx.nn.State`) after training, if `state=` was given.
    """

    model: PyTree
    opt_state: PyTree
    history: History
    state: PyTree = None


class NonFiniteLossError(FloatingPointError):
    """The loss was NaN or infinite. `result` holds the last finite model."""

    def __init__(self, message: str, result: FitResult, epoch: int, step: int):
        super().__init__(message)
        self.result = result
        self.epoch = epoch
        self.step = step


@jaxtyped(typechecker=beartype)
def fit(
    model: PyTree,
    data: ArrayData,
    *,
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    key: Key[Array, ""] | UInt32[Array, "2"],
    epochs: int = 1,
    batch_size: int = 32,
    shuffle: bool = True,
    drop_remainder: bool = False,
    progress: bool = False,
    filter_spec: PyTree = eqx.is_inexact_array,
    opt_state: PyTree | None = None,
    state: PyTree | None = None,
    validation_data: ValidationData | None = None,
    validation_split: float | None = None,
    metrics: Mapping[str, Callable[..., Any]] | None = None,
    early_stopping: EarlyStopping | None = None,
    on_nan: Literal["raise", "stop", "skip"] = "raise",
    callbacks: Sequence[Callback] = (),
    devices: int | Sequence[Device] | None = None,
    mesh: Mesh | None = None,
    ensemble: bool = False,
) -> FitResult:
    """Trains `model` on `data` by minibatch gradient descent, compiled end to end.

    **Arguments:**

    - `model`: any PyTree of arrays, usually an `eqx.Module`. It is not changed.
    - `data`: a tuple of numpy or JAX arrays sharing their leading (sample) axis. It is
        moved to the device once; each epoch then permutes indices, not data.
    - `loss`: called as `loss(model, *batch)` (or `loss(model, state, *batch)` returning
        `(value, new_state)` with `state=`), returning a scalar. If it takes a keyword
        `key`, it gets a fresh key every step (for dropout and the like).
    - `optimizer`: any optax `GradientTransformation` (or `optax.MultiSteps`). Those that
        read the loss (`optax.contrib.reduce_on_plateau`) receive it as `value`.
    - `key`: a PRNG key. It drives the shuffle, the per-step keys and `validation_split`.
    - `epochs`: passes over the data.
    - `batch_size`: samples per step.
    - `shuffle`: visit the samples in a new random order each epoch.
    - `drop_remainder`: skip the last, smaller batch of each epoch instead of taking it
        as one more step.
    - `progress`: `False` runs the whole training as one XLA program. `True` shows a
        tqdm bar and runs the same compiled steps in chunks; the result is the same.
    - `filter_spec`: which leaves of `model` train, as in `eqx.partition`. Leaves that
        are not floating-point arrays never train.
    - `opt_state`: an optimizer state to continue from, such as a previous result's.
    - `state`: the `eqx.nn.State` of a stateful model (BatchNorm and the like).
    - `validation_data`: a tuple like `data`, evaluated after each epoch in inference mode.
    - `validation_split`: instead, hold out this fraction of `data`, chosen from `key`.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar`, recorded per epoch on
        the training batches and on the validation data.
    - `early_stopping`: an [`eqfit.EarlyStopping`][], carried out on the device.
    - `on_nan`: what a NaN or infinite loss does. `"raise"`: stop, and raise
        [`eqfit.NonFiniteLossError`][] holding the last finite model. `"stop"`: stop and
        return it. `"skip"`: skip that update and go on. The check never syncs the host.
    - `callbacks`: objects with `on_epoch_end(epoch, logs)`, called between epochs on the
        `progress=True` path; returning `True` stops training. The compiled path runs no
        Python during training, so it takes none.
    - `devices`: data parallel over these local devices (or the first `devices` of them)
        with `eqx.filter_pmap`. Each batch is split evenly over them, so `batch_size`
        must be a multiple of their number.
    - `mesh`: data parallel through sharding over the first axis of this
        `jax.sharding.Mesh`, which may span several processes (`jax.distributed`); then
        each process passes its own rows of `data`.
    - `ensemble`: `model` is a stack of members (every array with a leading member axis,
        as `eqx.filter_vmap` builds it), trained side by side in one program. Member `i`
        trains as it would alone with key `jax.random.split(key, members)[i]`: its own
        shuffle and per-step keys. `state` and `opt_state`, if given, are stacked too.
        With `devices=` or `mesh=`, each batch is split over the devices and every
        device holds all members.

    **Returns:**

    A [`eqfit.FitResult`][] with the trained `model`, the `opt_state`, the `history` and
    the model `state`.

    !!! warning "What triggers a compilation"

        The run is compiled once per model structure, `loss`, `metrics` and `optimizer`
        objects, data shapes and `(epochs, batch_size, shuffle, drop_remainder)`. A new
        `optax.adam(...)` is a new object, so keep one optimizer to reuse the program.
    """
    start = time.perf_counter()
    data_ = as_data(data)
    key_ = as_key(key)
    if isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"`epochs` must be 0 or more, got {epochs}.")
    if callbacks and not progress:
        raise ValueError(
            "`callbacks` run on the host between epochs, which only the `progress=True` "
            "path has; the compiled path runs no Python while it trains."
        )
    members = ensemble_size(model) if ensemble else None
    if members is not None and validation_split is not None:
        raise ValueError(
            "`validation_split` would hold out different samples for each member of an "
            "ensemble; pass `validation_data` instead."
        )
    keys, split_key = _keys(key_, members)
    data_, val_data = _validation(data_, validation_data, validation_split, split_key)
    placement = choose_placement(devices, mesh, batch_size)
    num_samples = data_[0].shape[0]
    if mesh is not None and jax.process_count() > 1:
        num_samples *= jax.process_count()  # each process passed its own rows
    plan = plan_batches(num_samples, batch_size, drop_remainder)
    if isinstance(optimizer, optax.MultiSteps):
        optimizer = optimizer.gradient_transformation()

    # Only floating-point arrays chosen by `filter_spec` train; everything else,
    # frozen arrays included, is closed over by the step.
    params, static = eqx.partition(model, filter_spec)
    params, frozen = eqx.partition(params, eqx.is_inexact_array)
    static = eqx.combine(frozen, static)
    if opt_state is None:
        opt_state = (jax.vmap(optimizer.init) if ensemble else optimizer.init)(params)

    objective = Objective(
        loss, tuple((metrics or {}).items()), stateful=state is not None, use_key=takes_key(loss)
    )
    axis_name = placement.axis_name if isinstance(placement, Pmap) else None
    loop = Loop(
        Step(static, objective, optimizer, axis_name),
        plan,
        shuffle,
        placement,
        validate=val_data is not None,
        early_stopping=early_stopping,
        on_nan=on_nan,
        ensemble=ensemble,
    )
    if early_stopping is not None and early_stopping.monitor not in loop.log_names:
        raise ValueError(
            f"`early_stopping.monitor` is {early_stopping.monitor!r}, which this run does "
            f"not compute; it computes {list(loop.log_names)}."
        )
    init = lambda p, o, st: loop.init(p, o, st, epochs)  # noqa: E731
    s, r = (jax.vmap(init) if ensemble else init)(params, opt_state, state)
    inputs = Inputs(loop, data_, val_data, keys)
    if progress:
        s, r = _run_with_bar(inputs, s, r, epochs, callbacks)
    else:
        s, r = run_compiled(inputs, s, r, epochs)
    return _result(loop, s, r, static, time.perf_counter() - start)


def _keys(key: Key[Array, ""], members: int | None) -> tuple[Array, Key[Array, ""]]:
    """The (shuffle, step) keys, per member for an ensemble, and the split key."""
    if members is None:
        shuffle_key, step_key, split_key = jax.random.split(key, 3)
        return jnp.stack([shuffle_key, step_key]), split_key
    per_member = jax.vmap(lambda k: jax.random.split(k, 3)[:2])(jax.random.split(key, members))
    return per_member, jax.random.split(key, 3)[2]


def _validation(
    data: tuple[Array, ...],
    validation_data: Any,
    validation_split: float | None,
    key: Key[Array, ""],
) -> tuple[tuple[Array, ...], tuple[Array, ...] | None]:
    """Returns the training data and the validation data, if any."""
    if validation_data is not None and validation_split is not None:
        raise ValueError("Give `validation_data` or `validation_split`, not both.")
    if validation_data is not None:
        val = as_data(validation_data)
        if len(val) != len(data) or any(v.shape[1:] != d.shape[1:] for v, d in zip(val, data)):
            raise ValueError(
                "`validation_data` must hold arrays like `data`'s, one sample apart: "
                f"`data` has shapes {[tuple(a.shape) for a in data]}, "
                f"`validation_data` {[tuple(a.shape) for a in val]}."
            )
        return data, val
    if validation_split is None:
        return data, None
    n = data[0].shape[0]
    held = math.ceil(validation_split * n)
    if not 0.0 < validation_split < 1.0 or held >= n:
        raise ValueError(
            f"`validation_split` must be in (0, 1) and leave training data; got "
            f"{validation_split}, which holds out {held} of {n} samples."
        )
    order = jax.random.permutation(key, n)
    val_index, train_index = order[:held], order[held:]
    return tuple(a[train_index] for a in data), tuple(a[val_index] for a in data)


def _result(loop: Loop, s: TrainState, r: Record, static: PyTree, wall_time: float) -> FitResult:
    """Reads the run's record back into a History and the trained model."""
    plan, stopping = loop.plan, loop.early_stopping
    sizes = (plan.batch_size,) * plan.num_full + ((plan.remainder,) if plan.remainder else ())
    steps = len(sizes)
    # One row per member (a single model is an ensemble of one, squeezed at the end).
    epochs_done, nan_step, best, stopped = (
        np.atleast_1d(np.asarray(x)) for x in (s.epoch, s.nan_step, s.best_epoch, s.stopped)
    )
    members = len(epochs_done)
    step_loss = np.asarray(r.step_loss).reshape(members, *r.step_loss.shape[-2:])
    step_metrics = np.asarray(r.step_metrics).reshape(members, *r.step_metrics.shape[-3:])
    val = np.asarray(r.val).reshape(members, *r.val.shape[-2:])
    by_nan = (nan_step >= 0) & (loop.on_nan != "skip")
    # An epoch cut short by a non-finite loss counts as run, with NaN for its lost steps.
    ran = epochs_done + (by_nan & (nan_step // steps >= epochs_done))
    rows = int(ran.max())
    losses = np.full((members, rows, steps), np.nan, np.float32)
    values = np.full((members, rows, len(loop.log_names)), np.nan, np.float32)
    reasons: list[StopReason] = []
    for i in range(members):
        n = int(ran[i])
        losses[i, :n] = step_loss[i, :n]
        if by_nan[i]:
            losses[i].reshape(-1)[nan_step[i] + 1 :] = np.nan
        train = np.concatenate([losses[i, :n, :, None], step_metrics[i, :n]], axis=-1)
        member_values = epoch_values(train, sizes)
        if loop.validate:
            member_values = np.concatenate([member_values, val[i, :n]], axis=-1)
        values[i, :n] = member_values
        if by_nan[i]:
            reasons.append("non_finite_loss")
        elif stopped[i] and stopping is not None:
            reasons.append("early_stopping")
        else:
            reasons.append("callback" if n < step_loss.shape[1] else None)
    best_epochs = [int(b) if stopping is not None and b >= 0 else None for b in best]

    def squeeze(x: np.ndarray) -> np.ndarray:  # (members, rows, ...) -> (rows, ..., members)
        return x[0] if not loop.ensemble else np.moveaxis(x, 0, -1)

    history = History(
        {name: squeeze(values[..., i]) for i, name in enumerate(loop.log_names)},
        squeeze(losses),
        sizes,
        wall_time,
        tuple(best_epochs) if loop.ensemble else best_epochs[0],
        tuple(reasons) if loop.ensemble else reasons[0],
    )
    params, model_state = s.params, s.model_state
    if stopping is not None and stopping.restore_best:
        restore = jnp.asarray([b is not None for b in best_epochs])
        if not loop.ensemble:
            restore = restore[0]

        def pick(best: PyTree, last: PyTree) -> PyTree:
            def one(b: Array, x: Array) -> Array:
                return jnp.where(
                    restore.reshape(restore.shape + (1,) * (x.ndim - restore.ndim)), b, x
                )

            return jax.tree.map(one, best, last)

        params, model_state = pick(s.best_params, params), pick(s.best_model_state, model_state)
    result = FitResult(eqx.combine(params, static), s.opt_state, history, model_state)
    if by_nan.any() and loop.on_nan == "raise":
        i = int(np.argmax(by_nan))
        epoch, step = divmod(int(nan_step[i]), steps)
        member = f"member {i}: " if loop.ensemble else ""
        raise NonFiniteLossError(
            f"The loss was not finite at {member}epoch {epoch}, step {step} (step "
            f"{int(nan_step[i])} of the run). Training stopped there; the last finite model, "
            "from before that step, is in this error's `.result`. Pass `on_nan='skip'` to "
            "skip such steps, or `on_nan='stop'` to return early without an error.",
            result,
            epoch,
            step,
        )
    return result


class _Bar(Progress):
    """Drives a tqdm bar and the user's callbacks from the chunked runner."""

    def __init__(self, bar: Any, epochs: int, callbacks: Sequence[Callback]):
        self.bar, self.epochs, self.callbacks = bar, epochs, callbacks
        self.epoch, self.loss_sum, self.steps = -1, 0.0, 0
        self.last_logs: dict[str, str] = {}

    def on_steps(self, epoch: int, steps: int, loss_sum: float) -> None:
        if epoch != self.epoch:
            self.epoch, self.loss_sum, self.steps = epoch, 0.0, 0
            self.bar.set_description(f"epoch {epoch + 1}/{self.epochs}", refresh=False)
        self.loss_sum += loss_sum
        self.steps += steps
        postfix = {"loss": f"{self.loss_sum / self.steps:.4g}", **self.last_logs}
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(steps)

    def on_epoch(self, epoch: int, logs: dict[str, float]) -> bool:
        self.last_logs = {k: f"{v:.4g}" for k, v in logs.items() if k.startswith("val_")}
        stop = False
        for callback in self.callbacks:
            stop = bool(callback.on_epoch_end(epoch, dict(logs))) or stop
        return stop


def _run_with_bar(
    inputs: Inputs, s: TrainState, r: Record, epochs: int, callbacks: Sequence[Callback]
) -> tuple[TrainState, Record]:
    from tqdm.auto import tqdm

    steps = inputs.loop.plan.steps_per_epoch
    with tqdm(total=epochs * steps, unit="step", dynamic_ncols=True) as bar:
        progress = _Bar(bar, epochs, callbacks)
        return run_chunked(inputs, s, r, epochs, progress, sync_epochs=bool(callbacks))
