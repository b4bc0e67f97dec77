"""What `fit` returns, how it is read back from the run's record, and how it is saved."""

import json
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from ._checkpoint import serialise, versions, write_atomically
from ._history import epoch_values, History, StopReason
from ._loop import Loop, Record, TrainState


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


def make_result(
    loop: Loop, s: TrainState, r: Record, static: PyTree, wall_time: float
) -> FitResult:
    """Reads the run's record back into a History and the trained model."""
    plan, stopping = loop.plan, loop.early_stopping
    sizes = plan.batch_sizes
    steps = len(sizes)
    # One row per member (a single model is an ensemble of one, squeezed at the end).
    # One transfer for everything read here, rather than one per array.
    host_s, host_r = jax.device_get(
        ((s.epoch, s.nan_step, s.best_epoch, s.stopped), (r.step_loss, r.step_metrics, r.val))
    )
    epochs_done, nan_step, best, stopped = (np.atleast_1d(x) for x in host_s)
    members = len(epochs_done)
    step_loss = host_r[0].reshape(members, *r.step_loss.shape[-2:])
    step_metrics = host_r[1].reshape(members, *r.step_metrics.shape[-3:])
    val = host_r[2].reshape(members, *r.val.shape[-2:])
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


_MAGIC = b"eqfit-result\n"


def save(path: str | os.PathLike, result: FitResult) -> None:
    """Writes a [`eqfit.FitResult`][] to one file: model, optimizer state, model state and
    history. The write is atomic: a crash leaves the old file or the new one, never half.

    **Arguments:**

    - `path`: the file to write.
    - `result`: what `fit` returned.
    """
    h = result.history
    header = {
        "history": {
            "values": {k: np.asarray(v).tolist() for k, v in h.values.items()},
            "step_loss": np.asarray(h.step_loss).tolist(),
            "batch_sizes": list(h.batch_sizes),
            "wall_time": h.wall_time,
            "best_epoch": h.best_epoch,
            "stop_reason": h.stop_reason,
        },
        "versions": versions(),
    }
    leaves = serialise((result.model, result.opt_state, result.state))
    write_atomically(Path(path), _MAGIC + json.dumps(header).encode() + b"\n" + leaves)


def load(path: str | os.PathLike, *, like: Any) -> Any:
    """Reads what `save` wrote.

    **Arguments:**

    - `path`: the file.
    - `like`: a `FitResult` of the same structure (`fit(..., epochs=0)` makes one), or
        just a model of the same structure.

    **Returns:**

    A `FitResult` with the saved model, optimizer state, state and history; or, given a
    model, the saved model.
    """
    with open(path, "rb") as f:
        if f.readline() != _MAGIC:
            raise ValueError(f"{path} is not an eqfit file written by `eqfit.save`.")
        header = json.loads(f.readline())
        if not isinstance(like, FitResult):
            return eqx.tree_deserialise_leaves(f, like)
        model, opt_state, state = eqx.tree_deserialise_leaves(
            f, (like.model, like.opt_state, like.state)
        )
    h = header["history"]
    history = History(
        {k: np.asarray(v, np.float32) for k, v in h["values"].items()},
        np.asarray(h["step_loss"], np.float32),
        tuple(h["batch_sizes"]),
        h["wall_time"],
        tuple(h["best_epoch"]) if isinstance(h["best_epoch"], list) else h["best_epoch"],
        tuple(h["stop_reason"]) if isinstance(h["stop_reason"], list) else h["stop_reason"],
    )
    return FitResult(model, opt_state, history, state)
