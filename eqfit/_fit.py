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

from ._data import as_data, as_key, plan_batches
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
    shuffle_key, step_key, split_key = jax.random.split(key_, 3)
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
        opt_state = optimizer.init(params)

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
    )
    if early_stopping is not None and early_stopping.monitor not in loop.log_names:
        raise ValueError(
            f"`early_stopping.monitor` is {early_stopping.monitor!r}, which this run does "
            f"not compute; it computes {list(loop.log_names)}."
        )
    s, r = loop.init(params, opt_state, state, epochs)
    inputs = Inputs(loop, data_, val_data, jnp.stack([shuffle_key, step_key]))
    if progress:
        s, r = _run_with_bar(inputs, s, r, epochs, callbacks)
    else:
        s, r = run_compiled(inputs, s, r, epochs)
    return _result(loop, s, r, static, time.perf_counter() - start)


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
    plan = loop.plan
    sizes = (plan.batch_size,) * plan.num_full + ((plan.remainder,) if plan.remainder else ())
    epochs_done, nan_step = int(s.epoch), int(s.nan_step)
    stopped_by_nan = nan_step >= 0 and loop.on_nan != "skip"
    ran = epochs_done + (1 if stopped_by_nan and nan_step // len(sizes) >= epochs_done else 0)
    step_loss = np.asarray(r.step_loss)[:ran].copy()
    if stopped_by_nan:  # steps after the non-finite one never ran
        step_loss.reshape(-1)[nan_step + 1 :] = np.nan
    names = loop.log_names
    train = np.concatenate([step_loss[..., None], np.asarray(r.step_metrics)[:ran]], axis=-1)
    values = epoch_values(train, sizes)
    if loop.validate:
        values = np.concatenate([values, np.asarray(r.val)[:ran]], axis=-1)
    stopping = loop.early_stopping
    best_epoch = int(s.best_epoch) if stopping is not None and int(s.best_epoch) >= 0 else None
    reason: StopReason = None
    if stopped_by_nan:
        reason = "non_finite_loss"
    elif bool(s.stopped) and stopping is not None:
        reason = "early_stopping"
    elif ran < r.step_loss.shape[0]:
        reason = "callback"
    history = History(
        {name: values[:, i] for i, name in enumerate(names)},
        step_loss,
        sizes,
        wall_time,
        best_epoch,
        reason,
    )
    params, model_state = s.params, s.model_state
    if stopping is not None and stopping.restore_best and best_epoch is not None:
        params, model_state = s.best_params, s.best_model_state
    result = FitResult(eqx.combine(params, static), s.opt_state, history, model_state)
    if stopped_by_nan and loop.on_nan == "raise":
        epoch, step = divmod(nan_step, len(sizes))
        raise NonFiniteLossError(
            f"The loss was not finite at epoch {epoch}, step {step} (step {nan_step} of the "
            "run). Training stopped there; the last finite model, from before that step, "
            "is in this error's `.result`. Pass `on_nan='skip'` to skip such steps, or "
            "`on_nan='stop'` to return early without an error.",
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
