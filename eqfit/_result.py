"""What `fit` returns, how it is read back from the run's record, and how it is saved."""

import dataclasses
import functools
import json
import time
import warnings
from pathlib import Path
from typing import Any, Generic, overload

import equinox as eqx
import jax
import numpy as np

from ._checkpoint import serialise, versions, write_atomically
from ._checks import checked
from ._drive import Outcome
from ._history import History, StopReason
from ._loop import Consts, Loop
from ._parallel import Placement
from ._typing import Model, ModelState, OptState, PathLike


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["model", "opt_state", "history", "state"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class FitResult(Generic[Model]):
    """What `fit` returns: a PyTree, so `jax.block_until_ready(result)` and the like work.

    **Attributes:**

    - `model`: the trained model, of the same type as the one passed in.
    - `opt_state`: the optimizer state; pass it back as `fit(..., opt_state=)` to go on.
    - `history`: a [`eqfit.History`][] of per-epoch values and per-step losses.
    - `state`: the model state (`eqx.nn.State`) after training, if `state=` was given.
    """

    # A registered dataclass rather than an `eqx.Module`: it is made once per `fit`
    # after the run has finished, and a Module's checks at construction showed in the
    # host work per call that `benchmarks/fit_speed.py` measures.
    model: Model
    opt_state: OptState
    history: History
    state: ModelState | None = None


class TrainingInterrupted(KeyboardInterrupt):
    """Training was interrupted (Ctrl-C). It stopped at an epoch's end, wrote a checkpoint
    if it had a directory, and `result` holds what it had trained.
    """

    def __init__(self, result: FitResult[Any]):
        last = result.history.initial_epoch + result.history.epochs
        super().__init__(
            f"Training interrupted after epoch {last}; the result so far is in this "
            "exception's `.result`."
        )
        self.result: FitResult[Any] = result


class NonFiniteLossError(FloatingPointError):
    """The loss was NaN or infinite. `result` holds the last finite model; `epoch` and
    `step` (counted from 1) say where.
    """

    def __init__(self, message: str, result: FitResult[Any], epoch: int, step: int):
        super().__init__(message)
        self.result: FitResult[Any] = result
        self.epoch: int = epoch
        self.step: int = step


def make_result(
    loop: Loop,
    placement: Placement,
    outcome: Outcome,
    consts: Consts,
    began: float,
    raises: bool = True,
) -> FitResult[Any]:
    """The result of a run, from its final state and the last call's report.

    If `raises`, raises `NonFiniteLossError` (holding the result) if a non-finite loss
    stopped the run and `on_nan="raise"`, and warns if the data ran out.
    """
    report, state = outcome.report, outcome.state
    # `np.asarray` on each, not `jax.device_get`, whose tree walk costs more.
    fields = (report.step, report.stopped, report.nan_step, report.best_epoch)
    steps, stopped, nan_steps, best = (np.asarray(x).reshape(-1) for x in placement.host(fields))
    table, step_loss, sizes = placement.host(
        (report.epoch_values, state.step_loss, state.batch_sizes)
    )
    wall_time = time.perf_counter() - began  # `began`: when `fit` began
    per_epoch = loop.steps_per_epoch
    ensemble = loop.members is not None
    if not ensemble:  # a single model is an ensemble of one here
        table, step_loss, sizes = table[None], step_loss[None], sizes[None]
    # Python lists for the per-member bookkeeping: quicker than numpy scalars. An epoch cut
    # short by a non-finite loss counts as run.
    ran = [-(-int(t) // per_epoch) - loop.first_epoch for t in steps.tolist()]
    nan_steps_ = nan_steps.tolist()
    by_nan = loop.on_nan != "skip"
    reasons: list[StopReason] = []
    for step, nan_step, halted in zip(steps.tolist(), nan_steps_, stopped.tolist()):
        if by_nan and nan_step >= 0:
            reasons.append("non_finite_loss")
        elif halted:
            reasons.append("early_stopping")
        elif step < loop.total_steps:
            reasons.append("callback" if outcome.stopped_by_callback else "out_of_data")
        else:
            reasons.append(None)
    has_stopping = loop.stopping is not None
    best_epochs = [b if has_stopping and b >= 0 else None for b in best.tolist()]
    rows = max(ran)

    def squeeze(x: np.ndarray) -> np.ndarray:  # (members, rows, ...) -> (rows, ..., members)
        return x[0] if not ensemble else np.moveaxis(x, 0, -1)

    # Copies: the transfer's arrays are read-only, and each value gets its own.
    values = squeeze(table[:, :rows])
    history = History(
        {name: values[:, i].copy() for i, name in enumerate(loop.log_names)},
        squeeze(step_loss[:, :rows]).copy(),
        squeeze(sizes[:, :rows]).copy(),
        wall_time,
        tuple(best_epochs) if ensemble else best_epochs[0],
        tuple(reasons) if ensemble else reasons[0],
        loop.first_epoch,
    )
    if report.trained is not None:
        params, model_state = report.trained
    else:
        params, model_state = state.params, state.model_state
    params, model_state, opt_state = placement.get((params, model_state, state.opt_state))
    # Only the trained arrays come back: the frozen ones are the caller's, untouched.
    trained, frozen = iter(jax.tree.leaves(params)), iter(consts.frozen)
    arrays = [next(trained) if t else next(frozen) for t in loop.trains]
    model = loop.model.fill(arrays)
    result = FitResult(model, opt_state, history, model_state)
    if not raises:
        return result
    if "out_of_data" in reasons:
        warnings.warn(
            f"The data ran out after {max(ran)} of the {loop.epochs - loop.first_epoch} "
            f"epochs asked for ({loop.steps_per_epoch} steps each); training stopped there. "
            "Give an iterator with enough batches, or fewer `epochs` or `steps_per_epoch`.",
            stacklevel=3,
        )
    if loop.on_nan == "raise" and max(nan_steps_) >= 0:
        i = next(i for i, t in enumerate(nan_steps_) if t >= 0)
        epoch, step = divmod(nan_steps_[i], per_epoch)
        member = f"member {i}: " if ensemble else ""
        raise NonFiniteLossError(
            f"The loss was not finite at {member}epoch {epoch + 1}, step {step + 1} of "
            f"{per_epoch} (counted from 1). Training stopped there; the last finite model, "
            "from before that step, is in this error's `.result`. Pass `on_nan='skip'` to "
            "skip such steps, or `on_nan='stop'` to return early without an error.",
            result,
            epoch + 1,
            step + 1,
        )
    return result


_MAGIC = b"eqfit-result\n"


@checked(
    "save",
    {
        "result": "the `FitResult` that `fit` returned (a model alone saves with "
        "`eqx.tree_serialise_leaves`)"
    },
)
def save(path: PathLike, result: FitResult[Any]) -> None:
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
            "batch_sizes": np.asarray(h.batch_sizes).tolist(),
            "initial_epoch": h.initial_epoch,
            "wall_time": h.wall_time,
            "best_epoch": h.best_epoch,
            "stop_reason": h.stop_reason,
        },
        "versions": versions(),
    }
    leaves = serialise((result.model, result.opt_state, result.state))
    write_atomically(Path(path), _MAGIC + json.dumps(header).encode() + b"\n" + leaves)


@overload
def load(path: PathLike, *, like: FitResult[Model]) -> FitResult[Model]: ...
@overload
def load(path: PathLike, *, like: Model) -> Model: ...
@checked("load")
def load(path: PathLike, *, like: Any) -> Any:
    """Reads what `save` wrote.

    **Arguments:**

    - `path`: the file.
    - `like`: a `FitResult` of the same structure (`fit(..., epochs=0)` makes one), or
        just a model of the same structure.

    **Returns:**

    A `FitResult` with the saved model, optimizer state, state and history; or, given a
    model, the saved model.
    """
    if not isinstance(like, FitResult) and not any(eqx.is_array(x) for x in jax.tree.leaves(like)):
        raise TypeError(
            "`like` must be a `FitResult` (such as `fit(..., epochs=0)` returns) or a model "
            f"of the saved one's structure, to read the arrays into; got {type(like).__name__}, "
            "which holds no arrays."
        )
    with open(path, "rb") as f:
        if f.readline() != _MAGIC:
            raise ValueError(f"{path} is not an eqfit file written by `eqfit.save`.")
        try:
            header = json.loads(f.readline())
            target = (
                (like.model, like.opt_state, like.state) if isinstance(like, FitResult) else like
            )
            loaded = eqx.tree_deserialise_leaves(f, target)
        except Exception as e:  # a truncated file, or arrays of another structure
            raise ValueError(
                f"{path} does not read back into `like`: the file is truncated, or was saved "
                f"from a model of another structure ({type(e).__name__}: {e})."
            ) from None
        extra = len(f.read()) if isinstance(like, FitResult) else 0  # a model: more follows
    if extra:
        raise ValueError(
            f"{path} has {extra} bytes more than `like`'s arrays take: it was saved from a "
            "model of another structure, or is not the file `eqfit.save` wrote."
        )
    if not isinstance(like, FitResult):
        return loaded
    model, opt_state, state = loaded
    h = header["history"]
    history = History(
        {k: np.asarray(v, np.float32) for k, v in h["values"].items()},
        np.asarray(h["step_loss"], np.float32),
        np.asarray(h["batch_sizes"], np.int32),
        h["wall_time"],
        tuple(h["best_epoch"]) if isinstance(h["best_epoch"], list) else h["best_epoch"],
        tuple(h["stop_reason"]) if isinstance(h["stop_reason"], list) else h["stop_reason"],
        h["initial_epoch"],
    )
    return FitResult(model, opt_state, history, state)
